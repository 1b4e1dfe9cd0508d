"""SimEngine on a tiny pool (10 blocks of 4 tokens): exact cache state after each step."""

from __future__ import annotations

import math

import pytest

from kvgate.engine import (
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineRequest,
    FinishedRequest,
    ReqStatus,
    SimEngine,
    generated_block_hash,
    generated_token_id,
    get_profile,
    prompt_key,
)

PROMPT_IDS = tuple(range(1000, 1010))


def refs(engine: SimEngine) -> list[int]:
    return [engine.pool.block(i).ref_cnt for i in range(engine.pool.num_blocks)]


def test_chunked_prefill_decode_and_generated_block_caching(kit) -> None:
    engine = kit.tiny_engine(profile=kit.tiny_profile(max_num_batched_tokens=8))
    a = kit.req("A", 10, base=100, max_tokens=3, token_ids=PROMPT_IDS)
    assert engine.submit(a, 0.0).accepted

    # step 1: first chunk of 8 tokens fills blocks 0 and 1, cached at schedule time
    out = engine.step(0.0)
    assert out is not None
    assert (out.duration_s, out.num_prefill_tokens) == (pytest.approx(0.018), 8)
    assert (out.tokens, out.first_token_ids) == ({}, ())
    assert engine.take_events() == [
        BlockStored(
            block_hashes=(101, 102), parent_block_hash=None, token_ids=PROMPT_IDS[:8], block_size=4
        )
    ]
    assert engine.pool.cached_hashes() == {101: 0, 102: 1}
    assert refs(engine)[:3] == [1, 1, 0]
    assert engine.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9]

    # step 2: the last 2 prompt tokens (h = 8) take block 2 and give the first token
    out = engine.step(out.end)
    assert out is not None
    assert (out.duration_s, out.num_prefill_tokens) == (pytest.approx(0.012), 2)
    assert (out.first_token_ids, dict(out.tokens)) == (("A",), {"A": 1})
    assert out.end == pytest.approx(0.030)
    assert engine.take_events() == []  # block 2 is not full yet

    # step 3: decode (context 11), no new block
    out = engine.step(out.end)
    assert out is not None
    assert (out.duration_s, out.num_decode_seqs, out.first_token_ids) == (
        pytest.approx(0.011),
        1,
        (),
    )
    assert engine.take_events() == []

    # step 4: decode fills block 2 (2 prompt + 2 generated tokens), then A finishes
    out = engine.step(out.end)
    assert out is not None
    g2 = generated_block_hash(102, "A", 2, prompt_key(a))
    assert engine.take_events() == [
        BlockStored(
            block_hashes=(g2,),
            parent_block_hash=102,
            token_ids=(1008, 1009, generated_token_id("A", 0), generated_token_id("A", 1)),
            block_size=4,
        )
    ]
    assert out.finished == (
        FinishedRequest(request_id="A", prompt_tokens=10, cached_tokens=0, output_tokens=3),
    )
    # freed in reverse: the chain's root is the last to be evicted
    assert engine.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert engine.pool.cached_hashes() == {101: 0, 102: 1, g2: 2}
    assert refs(engine) == [0] * 10
    assert engine.step(out.end) is None

    # B shares A's prompt: 8 tokens hit (capped so one token is computed), one blank block
    b = kit.req("B", 10, base=100, max_tokens=1)
    assert engine.submit(b, 1.0).accepted
    out = engine.step(1.0)
    assert out is not None
    assert (out.num_prefill_tokens, out.duration_s) == (2, pytest.approx(0.012))
    assert out.finished == (
        FinishedRequest(request_id="B", prompt_tokens=10, cached_tokens=8, output_tokens=1),
    )
    assert engine.take_events() == []  # hits emit nothing; block 3 never filled
    assert engine.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    m = engine.metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (20, 8)
    assert (m.prompt_tokens, m.generation_tokens, m.num_requests_finished) == (20, 4, 2)

    # C needs 8 blocks: 7 blank ones, then the LRU cached block g2 is really evicted
    c = kit.req("C", 32, base=300)
    assert engine.submit(c, 2.0).accepted
    outs, _ = kit.drive(engine, 2.0)
    assert [o.num_prefill_tokens for o in outs] == [8, 8, 8, 8]
    stored_then_removed = kit.cache_events(engine.take_events())
    assert stored_then_removed == [
        BlockStored(block_hashes=(301, 302), parent_block_hash=None, token_ids=(), block_size=4),
        BlockStored(block_hashes=(303, 304), parent_block_hash=302, token_ids=(), block_size=4),
        BlockStored(block_hashes=(305, 306), parent_block_hash=304, token_ids=(), block_size=4),
        BlockRemoved(block_hashes=(g2,)),
        BlockStored(block_hashes=(307, 308), parent_block_hash=306, token_ids=(), block_size=4),
    ]
    assert engine.pool.cached_hashes() == {
        101: 0,
        102: 1,
        301: 3,
        302: 4,
        303: 5,
        304: 6,
        305: 7,
        306: 8,
        307: 9,
        308: 2,
    }
    assert engine.metrics().num_evicted_blocks == 1


def test_two_prefills_share_the_budget_and_decodes_go_first(kit) -> None:
    engine = kit.tiny_engine(profile=kit.tiny_profile(max_num_batched_tokens=8))
    engine.submit(kit.req("A", 6, base=100, max_tokens=3), 0.0)
    engine.submit(kit.req("B", 6, base=200, max_tokens=1), 0.0)
    out = engine.step(0.0)
    assert out is not None
    assert (out.num_prefill_tokens, out.first_token_ids) == (8, ("A",))  # A: 6, B: chunk of 2
    out = engine.step(out.end)
    assert out is not None
    # A decodes first (1 token), then B's remaining 4 prompt tokens
    assert (out.num_decode_seqs, out.num_prefill_tokens) == (1, 4)
    assert out.first_token_ids == ("B",)
    assert out.duration_s == pytest.approx(0.010 + 0.001 * 5)


def test_preemption_when_the_pool_is_full_then_recompute_with_cache_hits(kit) -> None:
    engine = kit.tiny_engine()  # 10 blocks of 4, budget 64
    x, y = kit.req("X", 16, base=200, max_tokens=8), kit.req("Y", 16, base=300, max_tokens=8)
    engine.submit(x, 0.0)
    engine.submit(y, 0.0)
    now = 0.0
    outs = []
    for _ in range(5):
        out = engine.step(now)
        assert out is not None and out.preempted == ()
        outs.append(out)
        now = out.end
    # X: blocks 0-3 + 8, Y: 4-7 + 9; both generated blocks (index 4) got cached at step 5
    gx4 = generated_block_hash(204, "X", 4, prompt_key(x))
    gy4 = generated_block_hash(304, "Y", 4, prompt_key(y))
    assert engine.pool.cached_hashes() == {
        201: 0,
        202: 1,
        203: 2,
        204: 3,
        301: 4,
        302: 5,
        303: 6,
        304: 7,
        gx4: 8,
        gy4: 9,
    }
    assert engine.pool.num_free_blocks == 0
    engine.take_events()

    # step 6: X needs a 6th block; the pool is full: the newest running request (Y) goes
    out = engine.step(now)
    assert out is not None
    assert out.preempted == ("Y",)
    assert dict(out.tokens) == {"X": 1}
    assert engine.request_status("Y") is ReqStatus.WAITING
    # Y's blocks were freed tail first; X took the LRU head (Y's generated block)
    assert engine.take_events() == [BlockRemoved(block_hashes=(gy4,))]
    assert engine.pool.free_block_ids() == [7, 6, 5, 4]
    assert engine.metrics().num_preemptions == 1

    # step 7: Y's prompt blocks still hit but 2 more blocks do not fit: Y keeps waiting
    out = engine.step(out.end)
    assert out is not None and dict(out.tokens) == {"X": 1}
    # step 8: X finishes (8 tokens); its partial last block is blank and goes to the head
    out = engine.step(out.end)
    assert out is not None
    assert [f.request_id for f in out.finished] == ["X"]
    assert engine.pool.free_block_ids() == [9, 7, 6, 5, 4, 8, 3, 2, 1, 0]
    engine.take_events()

    # step 9: Y resumes: 16 prompt tokens hit, its 5 generated tokens are recomputed
    out = engine.step(out.end)
    assert out is not None
    assert (out.num_prefill_tokens, dict(out.tokens)) == (5, {"Y": 1})
    assert engine.take_events() == [
        BlockRemoved(block_hashes=(gx4,)),
        BlockStored(block_hashes=(gy4,), parent_block_hash=304, token_ids=(), block_size=4),
    ]
    outs, _ = kit.drive(engine, out.end)
    (finished,) = [f for o in outs for f in o.finished]
    assert finished == FinishedRequest(
        request_id="Y", prompt_tokens=16, cached_tokens=0, output_tokens=8, num_preemptions=1
    )
    m = engine.metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (16 + 16 + 21, 16)
    assert m.generation_tokens == 16  # recomputed tokens are not generated twice


def test_cache_hit_cuts_ttft_on_a_real_profile(kit) -> None:
    engine = SimEngine(EngineConfig(num_blocks=800, block_size=512), get_profile("a100-8b"))
    hashes = kit.chain(10_000, 16)

    def prompt(request_id: str) -> EngineRequest:
        return EngineRequest(
            request_id=request_id,
            prompt_tokens=8192 + 100,
            block_hashes=hashes,
            max_tokens=16,
            arrival=0.0,
        )

    cold = kit.ttft(engine, prompt("cold"), 0.0)
    warm = kit.ttft(engine, prompt("warm"), 100.0)
    # two chunks under the 8192-token budget: (8192, h=0) then (100, h=8192)
    pairs = 8192 * 4096 + 100 * (8192 + 50)
    assert cold == pytest.approx(2 * 0.011 + 8292 * 0.066e-3 + 3.4e-9 * pairs, rel=1e-9)
    # 8192 tokens hit: only 100 tokens are computed, over an 8192-token history
    assert warm == pytest.approx(0.011 + 100 * 0.066e-3 + 3.4e-9 * 100 * (8192 + 50), rel=1e-9)
    assert warm < cold / 10


def test_priority_policy_serves_lower_value_first(kit) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority", profile=kit.tiny_profile(max_num_seqs=1))
    engine.submit(kit.req("low", 4, base=100, priority=5), 0.0)
    engine.submit(kit.req("high", 4, base=200, priority=0, arrival=0.5), 0.0)
    engine.submit(kit.req("mid", 4, base=300, priority=1), 0.0)
    outs, _ = kit.drive(engine, 1.0)
    assert [f.request_id for o in outs for f in o.finished] == ["high", "mid", "low"]


def test_fcfs_policy_ignores_priority(kit) -> None:
    engine = kit.tiny_engine(profile=kit.tiny_profile(max_num_seqs=1))
    engine.submit(kit.req("low", 4, base=100, priority=5), 0.0)
    engine.submit(kit.req("high", 4, base=200, priority=0), 0.0)
    outs, _ = kit.drive(engine, 1.0)
    assert [f.request_id for o in outs for f in o.finished] == ["low", "high"]


def _fill_with_low_priority(kit, engine: SimEngine) -> float:
    # "low" holds 9 blocks after its prefill (36 tokens) and 10 once it decodes
    engine.submit(kit.req("low", 36, base=100, max_tokens=4, priority=2), 0.0)
    out = engine.step(0.0)
    assert out is not None
    out = engine.step(out.end)
    assert out is not None
    assert engine.pool.num_free_blocks == 0
    return out.end


def test_priority_waiting_request_preempts_a_lower_priority_running_one(kit) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority")
    now = _fill_with_low_priority(kit, engine)
    assert engine.submit(kit.req("urgent", 8, base=900, priority=0, arrival=now), now).accepted
    out = engine.step(now)
    assert out is not None
    assert out.preempted == ("low",)
    assert [f.request_id for f in out.finished] == ["urgent"]
    outs, _ = kit.drive(engine, out.end)
    assert [f.request_id for o in outs for f in o.finished] == ["low"]
    # urgent took the blank block and low's LRU tail (hash 109): low's 8 other prompt
    # blocks still hit, so it recomputes 4 prompt tokens + its 2 generated ones
    assert outs[0].num_prefill_tokens == 6


def test_equal_priority_waiting_request_does_not_preempt(kit) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority")
    now = _fill_with_low_priority(kit, engine)
    engine.submit(kit.req("peer", 8, base=900, priority=2, arrival=now), now)
    out = engine.step(now)
    assert out is not None
    assert (out.preempted, dict(out.tokens)) == ((), {"low": 1})


def test_fcfs_waiting_request_does_not_preempt(kit) -> None:
    engine = kit.tiny_engine()
    now = _fill_with_low_priority(kit, engine)
    engine.submit(kit.req("urgent", 8, base=900, priority=0, arrival=now), now)
    out = engine.step(now)
    assert out is not None
    assert (out.preempted, dict(out.tokens)) == ((), {"low": 1})


def test_running_victim_under_priority_is_the_lowest_priority_not_the_newest(kit) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority")
    # both grow by decoding; "old-low" arrived first but has the worse priority
    engine.submit(kit.req("old-low", 16, base=100, max_tokens=8, priority=3, arrival=0.0), 0.0)
    engine.submit(kit.req("new-high", 16, base=200, max_tokens=8, priority=1, arrival=0.1), 0.1)
    preempted: list[str] = []
    outs, _ = kit.drive(engine, 0.1)
    for out in outs:
        preempted.extend(out.preempted)
    assert preempted == ["old-low"]
    finished = [f.request_id for o in outs for f in o.finished]
    assert finished == ["new-high", "old-low"]


def test_a_waiting_request_preempts_nobody_when_all_it_may_preempt_would_not_make_room(
    kit,
) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority")
    # one token short of a block boundary: their decodes need no new block for now
    engine.submit(kit.req("high", 23, base=100, max_tokens=3, priority=0), 0.0)  # 6 blocks
    engine.submit(kit.req("low", 11, base=200, max_tokens=3, priority=2), 0.0)  # 3 blocks
    out = engine.step(0.0)
    assert out is not None and engine.pool.num_free_blocks == 1
    # "urgent" needs 5 blocks: the free one plus low's 3 are not enough
    engine.submit(kit.req("urgent", 20, base=300, priority=0, arrival=out.end), out.end)
    out = engine.step(out.end)
    assert out is not None
    assert (out.preempted, dict(out.tokens)) == ((), {"high": 1, "low": 1})
    assert engine.request_status("urgent") is ReqStatus.WAITING


def test_blocks_a_victim_shares_with_a_better_priority_request_are_no_room(kit) -> None:
    engine = kit.tiny_engine(scheduling_policy="priority")
    # 13 tokens: 3 full blocks and a tail with room for the 3 decodes of this test
    engine.submit(kit.req("high", 13, base=100, max_tokens=3, priority=0), 0.0)
    out = engine.step(0.0)
    assert out is not None
    engine.submit(kit.req("low", 13, base=100, max_tokens=3, priority=2), out.end)
    out = engine.step(out.end)  # low hits high's 3 prompt blocks and adds its own tail
    assert out is not None and engine.pool.num_free_blocks == 5
    assert refs(engine)[:5] == [2, 2, 2, 1, 1]
    # "urgent" needs 7 blocks: preempting low would free its tail only, 6 in all
    engine.submit(kit.req("urgent", 27, base=300, priority=0, arrival=out.end), out.end)
    out = engine.step(out.end)
    assert out is not None
    assert (out.preempted, dict(out.tokens)) == ((), {"high": 1, "low": 1})


def test_block_hash_count_must_match_the_full_blocks(kit) -> None:
    engine = kit.tiny_engine()
    bad = EngineRequest(
        request_id="bad", prompt_tokens=9, block_hashes=(1,), max_tokens=1, arrival=0.0
    )
    with pytest.raises(ValueError, match="1 block hashes for 2 full blocks"):
        engine.submit(bad, 0.0)
    engine.submit(kit.req("dup", 4, base=1), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(kit.req("dup", 4, base=1), 0.0)


@pytest.mark.parametrize("arrival", [math.nan, math.inf])
def test_a_request_with_a_non_finite_arrival_is_refused(arrival: float) -> None:
    # arrival orders the "priority" waiting queue: a NaN there breaks the sort
    with pytest.raises(ValueError, match=r"EngineRequest\.arrival must be a finite number"):
        EngineRequest(request_id="r", prompt_tokens=4, max_tokens=1, arrival=arrival)


def test_abort_frees_blocks_but_keeps_them_cached(kit) -> None:
    engine = kit.tiny_engine()
    engine.submit(kit.req("A", 8, base=100, max_tokens=5), 0.0)
    out = engine.step(0.0)
    assert out is not None
    assert engine.pool.num_used_blocks == 2
    assert engine.abort("A", out.end)
    assert not engine.abort("A", out.end)  # already terminal
    assert engine.pool.num_used_blocks == 0
    assert engine.pool.cached_hashes() == {101: 0, 102: 1}
    assert engine.metrics().num_requests_aborted == 1
    assert engine.step(out.end) is None


def test_a_reused_request_id_with_another_prompt_tail_gets_its_own_generated_blocks(
    kit,
) -> None:
    # The HTTP engine keeps a client's X-Request-Id, so an id can come back with
    # another prompt. Same first block, other tail: block 1 holds other tokens.
    engine = kit.tiny_engine()
    first = kit.req("x", 6, base=100, max_tokens=3, token_ids=(1, 2, 3, 4, 5, 6))
    second = kit.req("x", 7, base=100, max_tokens=2, token_ids=(1, 2, 3, 4, 7, 8, 9))
    for request in (first, second):
        assert engine.submit(request, 0.0).accepted
        kit.drive(engine, 0.0)
    stored = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    x0, x1 = generated_token_id("x", 0), generated_token_id("x", 1)
    assert [(e.parent_block_hash, e.token_ids) for e in stored] == [
        (None, (1, 2, 3, 4)),
        (101, (5, 6, x0, x1)),
        (101, (7, 8, 9, x0)),
    ]
    assert stored[1].block_hashes != stored[2].block_hashes
