"""Workloads: Mooncake trace loading, bucket replay, validation, helpers, hit ratios."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from kvgate.sim.workload import (
    SimRequest,
    Workload,
    assign_classes,
    concat,
    ideal_hit_ratio,
    load_mooncake_trace,
    merge,
    pooled_lru_hit_ratio,
    scale_rate,
    time_window,
    with_priority,
    with_tenant,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.is_file(), reason="shared/traces absent")


def _line(ts: float, inp: int, out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "tiny.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


TINY = [
    _line(0, 1000, 10, [0, 1]),
    _line(0, 1100, 20, [0, 2, 3]),
    _line(0, 512, 30, [0]),
    _line(3000, 1500, 40, [0, 1, 4]),
    _line(6000, 10, 50, [5]),
    _line(6000, 600, 60, [0, 6]),
]


def _req(rid: str, t: float, ids: tuple[int, ...], **kw: object) -> SimRequest:
    return SimRequest(
        request_id=rid,
        arrival_s=t,
        prompt_tokens=512 * len(ids),
        output_tokens=1,
        block_ids=ids,
        **kw,
    )  # type: ignore[arg-type]


# --- loading ---------------------------------------------------------------------------


def test_load_tiny_fields_and_burst(tmp_path: Path) -> None:
    w = load_mooncake_trace(_write(tmp_path, TINY), bucket_mode="burst")
    assert w.name == "tiny" and w.block_tokens == 512
    assert [r.request_id for r in w.requests] == [f"r{k}" for k in range(6)]
    assert [r.arrival_s for r in w.requests] == [0, 0, 0, 3.0, 6.0, 6.0]
    r = w.requests[1]
    assert (r.prompt_tokens, r.output_tokens, r.block_ids) == (1100, 20, (0, 2, 3))
    assert (r.tenant, r.priority, r.session, r.model) == ("default", 1, None, "")


def test_spread_is_even_over_the_gap_and_last_bucket_uses_median_gap(tmp_path: Path) -> None:
    w = load_mooncake_trace(_write(tmp_path, TINY))
    assert [r.arrival_s for r in w.requests] == pytest.approx([0, 1, 2, 3, 6, 7.5])
    assert [r.request_id for r in w.requests] == [f"r{k}" for k in range(6)]


def test_speedup_and_limit(tmp_path: Path) -> None:
    p = _write(tmp_path, TINY)
    w = load_mooncake_trace(p, speedup=2.0, bucket_mode="burst", limit=4)
    assert [r.arrival_s for r in w.requests] == [0, 0, 0, 1.5]
    spread = load_mooncake_trace(p, speedup=3.0)
    assert [r.arrival_s for r in spread.requests] == pytest.approx([0, 1 / 3, 2 / 3, 1, 2, 2.5])


def test_jittered_spread_stays_in_bucket_and_is_seeded(tmp_path: Path) -> None:
    p = _write(tmp_path, TINY)
    a = load_mooncake_trace(p, rng=random.Random(3))
    b = load_mooncake_trace(p, rng=random.Random(3))
    assert a == b
    ts = [r.arrival_s for r in a.requests]
    assert all(0 <= t < 3 for t in ts[:3]) and 3 <= ts[3] < 6 and all(6 <= t < 9 for t in ts[4:])
    assert [r.request_id for r in a.requests] == [f"r{k}" for k in range(6)]


def test_unsorted_file_is_sorted_stably(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(3000, 10, 1, [1]), _line(0, 10, 1, [2]), _line(0, 10, 1, [3])])
    w = load_mooncake_trace(p, bucket_mode="burst")
    assert [r.request_id for r in w.requests] == ["r1", "r2", "r0"]


@pytest.mark.parametrize(
    ("bad", "msg"),
    [
        ("{not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[1, 2]", "expected a JSON object"),
        (_line(10**400, 10, 1, [1]), "'timestamp' must be a number >= 0"),  # overflows
        (
            json.dumps({"input_length": 10, "output_length": 1, "hash_ids": [1]}),
            "'timestamp' is missing",
        ),
        (
            json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [1]}),
            "'input_length' is missing",
        ),
        (_line(0, -5, 1, []), "input_length"),
        (_line(0, 0, 1, []), "'input_length' must be >= 1, got 0"),  # no empty prompt
        (
            json.dumps({"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}),
            "input_length",
        ),
        (
            json.dumps(
                {"timestamp": 0, "input_length": 10, "output_length": True, "hash_ids": [1]}
            ),
            "output_length",
        ),
        (
            json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}),
            "hash_ids",
        ),
        (_line(0, 1025, 1, [1, 2]), r"ceil.*one hash id per 512-token block"),
        # the engine chains hash ids as 64-bit block hashes: out of range was a traceback
        (_line(0, 600, 1, [-1, 2]), r"'hash_ids' must be in \[0, 2\*\*64\), got -1"),
        (_line(0, 600, 1, [1, 2**64]), r"'hash_ids' must be in \[0, 2\*\*64\), got 18446"),
    ],
)
def test_malformed_line_names_its_line(tmp_path: Path, bad: str, msg: str) -> None:
    p = _write(tmp_path, [TINY[0], "", bad])
    with pytest.raises(ValueError, match=rf"tiny.jsonl:3: .*{msg}"):
        load_mooncake_trace(p)


def test_output_length_zero_is_one_token(tmp_path: Path) -> None:
    # the engine's prefill makes the first token: a request for none asks for one
    w = load_mooncake_trace(_write(tmp_path, [_line(0, 600, 0, [1, 2])]))
    assert w.requests[0].output_tokens == 1


def test_epoch_timestamps_start_at_zero(tmp_path: Path) -> None:
    """Arrivals count from the earliest timestamp: a trace stamped in epoch milliseconds
    replays like one stamped from 0 (the simulator stepped its housekeeping through the
    idle decades before the first arrival, and never finished)."""
    shifted = [json.dumps({**json.loads(line), "timestamp": json.loads(line)["timestamp"]
                           + 1_700_000_000_000}) for line in TINY]
    w = load_mooncake_trace(_write(tmp_path, shifted))
    assert [r.arrival_s for r in w.requests] == pytest.approx([0, 1, 2, 3, 6, 7.5])


def test_byte_order_mark_and_bad_utf8(tmp_path: Path) -> None:
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(TINY).encode())
    assert len(load_mooncake_trace(p).requests) == len(TINY)
    p.write_bytes((TINY[0] + "\n").encode() + b'\xff\xfe{}\n')
    with pytest.raises(ValueError, match=r"bom.jsonl:2: not valid UTF-8"):
        load_mooncake_trace(p)


def test_non_strict_accepts_length_mismatch(tmp_path: Path) -> None:
    w = load_mooncake_trace(_write(tmp_path, [_line(0, 1025, 1, [1, 2])]), strict=False)
    assert w.requests[0].block_ids == (1, 2)


def test_block_tokens_parameter(tmp_path: Path) -> None:
    w = load_mooncake_trace(_write(tmp_path, [_line(0, 33, 1, [7, 8, 9])]), block_tokens=16)
    assert w.block_tokens == 16 and w.requests[0].block_ids == (7, 8, 9)


def test_bad_arguments(tmp_path: Path) -> None:
    p = _write(tmp_path, TINY)
    with pytest.raises(ValueError):
        load_mooncake_trace(p, speedup=0)
    with pytest.raises(ValueError):
        load_mooncake_trace(p, bucket_mode="jitter")  # type: ignore[arg-type]


# --- workload and stats ----------------------------------------------------------------


def test_workload_sorts_stably_and_rejects_duplicates() -> None:
    w = Workload(
        name="w",
        block_tokens=512,
        requests=(_req("a", 2.0, (1,)), _req("b", 1.0, (2,)), _req("c", 1.0, (3,))),
    )
    assert [r.request_id for r in w.requests] == ["b", "c", "a"]
    assert w.duration_s == 1.0
    with pytest.raises(ValueError, match="duplicate"):
        Workload(name="w", block_tokens=512, requests=(_req("a", 0, (1,)), _req("a", 1, (2,))))
    with pytest.raises(ValueError):
        _req("x", 0, (1,), priority=3)


def test_describe_tiny(tmp_path: Path) -> None:
    d = load_mooncake_trace(_write(tmp_path, TINY), bucket_mode="burst").describe()
    assert d["requests"] == 6 and d["duration_s"] == 6.0 and d["rate_rps"] == 1.0
    assert d["blocks_total"] == 12 and d["unique_blocks"] == 7
    # hits: r1 [0], r2 [0], r3 [0, 1], r4 -, r5 [0] => 5 of 12 blocks
    assert d["ideal_hit_ratio"] == pytest.approx(5 / 12)
    assert d["input_tokens_max"] == 1500 and d["output_tokens_p50"] == 35


def test_pooled_lru_prefix_only_and_last_to_first() -> None:
    w = Workload(
        name="w",
        block_tokens=512,
        requests=(
            _req("a", 0, (1, 2, 3)),
            _req("b", 1, (4, 5)),  # capacity 4: evicts 3 (inserted first => LRU), keeps root 1
            _req("c", 2, (1, 2, 3)),  # hits 1, 2 (prefix), misses 3
        ),
    )
    assert pooled_lru_hit_ratio(w, 4) == pytest.approx(2 / 8)
    assert pooled_lru_hit_ratio(w, 0) == 0.0
    assert pooled_lru_hit_ratio(w, 100) == pytest.approx(3 / 8) == ideal_hit_ratio(w)
    gap = Workload(
        name="w", block_tokens=512, requests=(_req("a", 0, (1, 2)), _req("b", 1, (9, 2)))
    )  # 2 cached but not a prefix
    assert pooled_lru_hit_ratio(gap, 10) == 0.0


@needs_trace
def test_conversation_trace_matches_readme() -> None:
    w = load_mooncake_trace(CONVERSATION)
    assert len(w.requests) == 12_031
    d = w.describe()
    assert d["blocks_total"] == 288_500 and d["unique_blocks"] == 182_790
    assert round(100 * float(d["ideal_hit_ratio"]), 1) == 36.6
    assert round(100 * float(d["ideal_hit_ratio_tokens"]), 1) == 37.4
    assert round(float(d["rate_rps"]), 2) == 3.40
    assert (d["input_tokens_p50"], round(float(d["input_tokens_p99"]))) == (6909, 85_400)
    # Convention: every hash id counts and is inserted, the partial last block included.
    assert round(100 * pooled_lru_hit_ratio(w, 1_000), 2) == 4.45
    assert round(100 * pooled_lru_hit_ratio(w, 8_000), 2) == 17.81


@needs_trace
def test_conversation_trace_buckets() -> None:
    burst = load_mooncake_trace(CONVERSATION, bucket_mode="burst", limit=200)
    spread = load_mooncake_trace(CONVERSATION, limit=200)
    assert len({r.arrival_s for r in burst.requests}) < 30
    assert len({r.arrival_s for r in spread.requests}) == 200
    fast = load_mooncake_trace(CONVERSATION, bucket_mode="burst", speedup=4, limit=200)
    assert fast.duration_s == pytest.approx(burst.duration_s / 4)


# --- helpers ---------------------------------------------------------------------------


def _stream(name: str, n: int, rate: float, session_every: int = 0) -> Workload:
    reqs = tuple(
        _req(f"q{i}", i / rate, (i,), session=f"s{i // session_every}" if session_every else None)
        for i in range(n)
    )
    return Workload(name=name, block_tokens=512, requests=reqs)


def test_assign_classes_shares_and_sessions() -> None:
    w = _stream("w", 4000, 10.0)
    a = assign_classes(
        w, tenants={"a": 3, "b": 1}, priorities={0: 0.2, 2: 0.8}, rng=random.Random(7)
    )
    share_a = sum(r.tenant == "a" for r in a.requests) / 4000
    share_p0 = sum(r.priority == 0 for r in a.requests) / 4000
    assert abs(share_a - 0.75) < 0.03 and abs(share_p0 - 0.2) < 0.03
    assert {r.priority for r in a.requests} == {0, 2}
    s = assign_classes(
        _stream("s", 600, 10.0, session_every=6),
        tenants={"a": 1, "b": 1},
        priorities={1: 1},
        rng=random.Random(1),
    )
    by_session: dict[str | None, set[str]] = {}
    for r in s.requests:
        by_session.setdefault(r.session, set()).add(r.tenant)
    assert all(len(v) == 1 for v in by_session.values())
    assert {t for v in by_session.values() for t in v} == {"a", "b"}
    kept = assign_classes(w, tenants={}, priorities={2: 1}, rng=random.Random(1))
    assert {r.tenant for r in kept.requests} == {"default"}
    with pytest.raises(ValueError):
        assign_classes(w, tenants={"a": 0}, priorities={}, rng=random.Random(1))
    with pytest.raises(ValueError):
        assign_classes(w, tenants={}, priorities={5: 1}, rng=random.Random(1))


def test_scale_window_and_class_setters() -> None:
    w = _stream("w", 100, 10.0)  # 0 .. 9.9 s
    fast = scale_rate(w, 10)
    assert fast.duration_s == pytest.approx(w.duration_s / 10)
    win = time_window(w, 2.0, 4.0)
    assert len(win.requests) == 20 and win.requests[0].arrival_s == pytest.approx(0.0)
    assert time_window(w, 2.0, 4.0, rebase=False).requests[0].arrival_s == pytest.approx(2.0)
    assert {r.priority for r in with_priority(w, 0).requests} == {0}
    assert {r.tenant for r in with_tenant(w, "noisy").requests} == {"noisy"}
    with pytest.raises(ValueError):
        with_priority(w, 7)


def test_merge_flood_with_steady_stream() -> None:
    steady = with_priority(_stream("steady", 50, 1.0), 0)
    flood = with_priority(scale_rate(_stream("flood", 500, 1.0), 10), 2)
    m = merge(steady, flood)
    assert len(m.requests) == 550 and len({r.request_id for r in m.requests}) == 550
    assert m.requests[0].request_id == "steady:q0" and m.requests[1].request_id == "flood:q0"
    times = [r.arrival_s for r in m.requests]
    assert times == sorted(times)
    ids = [set(r.block_ids[0] for r in m.requests if r.priority == p) for p in (0, 2)]
    assert not ids[0] & ids[1]  # disjoint block id spaces by default
    same = merge(steady, steady)
    assert same.requests[0].request_id == "0.steady:q0"
    shared = merge(steady, steady, disjoint_blocks=False)
    assert ideal_hit_ratio(shared) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        merge(steady, Workload(name="x", block_tokens=16, requests=()))


def test_merge_keeps_sparse_64_bit_block_ids_apart_within_64_bits() -> None:
    # a trace's ids may be any 64-bit hashes: kept apart by rank, not shifted past 2**64
    big = (2**64 - 5, 2**63, 7)
    reqs = (_req("a", 0.0, big), _req("b", 1.0, big[:2]))
    w = Workload(name="w", block_tokens=512, requests=reqs)
    m = concat(merge(w, w), w)
    ids = {r.request_id: r.block_ids for r in m.requests}
    assert ids["w+w:0.w:a"] == (2, 1, 0) and ids["w+w:0.w:b"] == (2, 1)  # the order kept
    assert ids["w+w:1.w:a"] == (5, 4, 3) and ids["w:a"] == (8, 7, 6)


def test_concat_places_workloads_back_to_back() -> None:
    a = _stream("a", 10, 1.0)  # last arrival 9 s
    c = concat(a, a, gap_s=1.0)
    assert [r.arrival_s for r in c.requests][9:11] == [9.0, 10.0]
    assert math.isclose(c.duration_s, 19.0)


def test_closed_loop_requests_are_checked_scaled_and_merged() -> None:
    a = _req("a", 0.0, (1,))
    b = _req("b", 1.0, (1, 2), after="a", think_s=2.0)
    w = Workload(name="w", block_tokens=512, requests=(b, a))  # sorted: a first
    assert [r.request_id for r in w.requests] == ["a", "b"]
    assert w.waits() == {"b": "a"}
    cut = Workload(name="w", block_tokens=512, requests=(b,))  # "a" cut out: b keeps its plan
    assert cut.waits() == {}
    with pytest.raises(ValueError, match="planned after it"):  # a chain could loop
        Workload(name="w", block_tokens=512, requests=(_req("a", 0.0, (1,), after="b"), b))
    with pytest.raises(ValueError, match="wait for itself"):
        _req("a", 0.0, (1,), after="a")
    with pytest.raises(ValueError, match="think_s"):
        _req("b", 1.0, (1,), after="a", think_s=-1.0)
    fast = scale_rate(w, 4)
    assert fast.requests[1].arrival_s == 0.25 and fast.requests[1].think_s == 0.5
    m = merge(w, w)
    assert [r.after for r in m.requests if r.after] == ["0.w:a", "1.w:a"]
