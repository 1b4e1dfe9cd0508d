"""Dynamo cost: overlap_weight × prefill_blocks + decode_blocks, argmin or softmax sample."""

import math
import random
from collections import Counter

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.dynamo_cost import DynamoCostPolicy

RNG = random.Random(0)
TPB = 16


def _ctx(make_ctx, prompt_tokens, base=0, rid=""):
    """A prompt whose chain is ``base, base + 1, ...`` (distinct bases share no block)."""
    return make_ctx(
        tuple(range(base, base + prompt_tokens // TPB)),
        tokens_per_block=TPB,
        prompt_tokens=prompt_tokens,
        request_id=rid,
    )


def _route(p, c, ctx, matches, cands, now):
    d = p.select(ctx, cands, matches, c.table, RNG, now)
    assert d is not None
    return d


def _loaded_policy(c, make_ctx, **kw):
    """n0: two 320-token (20-block) requests, n2: one 160-token request, all routed at
    t = 0 (ids r1, r2, r3) and past their first tokens (decoding)."""
    p = DynamoCostPolicy(**kw)
    for base, (node, tokens) in enumerate((("n0", 320), ("n0", 320), ("n2", 160))):
        rid = f"r{base + 1}"
        _route(p, c, _ctx(make_ctx, tokens, 1000 * (base + 1), rid), {}, c.candidates(node), 0.0)
        p.on_first_token(node, 0.5, rid)
    return p


def test_hand_computed_argmin(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    p = _loaded_policy(c, make_ctx)
    assert (p.active_blocks("n0"), p.active_blocks("n1"), p.active_blocks("n2")) == (40, 0, 10)
    # request: 160 tokens = 10 blocks; matches n0 = 8, n1 = 2, n2 = 0 (blocks)
    #   n0: prefill (160 - 128) / 16 = 2,  decode 40 + 10 = 50 → 52
    #   n1: prefill (160 -  32) / 16 = 8,  decode  0 + 10 = 10 → 18   ← argmin
    #   n2: prefill  160        / 16 = 10, decode 10 + 10 = 20 → 30
    d = _route(p, c, _ctx(make_ctx, 160), matches(n0=8, n1=2), c.candidates(), 10.0)
    assert d.node_id == "n1" and d.score == 18.0
    assert d.parts["prefill_blocks"] == 8.0 and d.parts["decode_blocks"] == 10.0
    assert (d.matched_blocks, d.best_matched_blocks) == (2, 8)
    assert d.reason is RouteReason.SPREAD  # a holder, not the best one, won on cost


def test_decode_blocks_count_shared_active_blocks_once(make_cluster, make_ctx):
    # Dynamo ActiveSequences: unique active blocks (refcounted by sequence hash) plus
    # the request's blocks not already active there (new_blocks)
    c = make_cluster(2)
    p = DynamoCostPolicy()
    for _ in range(2):  # the same 20-block prompt twice on n0
        _route(p, c, _ctx(make_ctx, 320), {}, c.candidates("n0"), 0.0)
    assert p.active_blocks("n0") == 20
    _route(p, c, _ctx(make_ctx, 320, 500), {}, c.candidates("n0"), 0.0)
    assert p.active_blocks("n0") == 40
    # a 10-block prompt sharing the first 8 blocks of the active prompt: 2 new blocks
    ctx = make_ctx((0, 1, 2, 3, 4, 5, 6, 7, 90, 91), tokens_per_block=TPB, prompt_tokens=160)
    d = p.select(ctx, c.candidates("n0"), {}, c.table, RNG, 100.0)
    assert d is not None and d.parts["decode_blocks"] == 42.0
    p.on_finished(c["n0"].node_id, 100.0)  # the oldest copy left; the other holds its blocks
    assert p.active_blocks("n0") == 42
    p.on_finished(c["n0"].node_id, 100.0)  # blocks 0..7 still held by the last request
    assert p.active_blocks("n0") == 30


def test_overlap_weight_shifts_the_argmin(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    # weight 0 (pure decode load): n0 50, n1 10, n2 20 → n1; weight 8: n0 16 + 50 = 66,
    # n1 64 + 10 = 74, n2 80 + 20 = 100 → n0 (the best holder)
    p0 = _loaded_policy(c, make_ctx, overlap_weight=0.0)
    d = _route(p0, c, _ctx(make_ctx, 160), matches(n0=8, n1=2), c.candidates(), 10.0)
    assert d.node_id == "n1"
    p8 = _loaded_policy(c, make_ctx, overlap_weight=8.0)
    d = _route(p8, c, _ctx(make_ctx, 160), matches(n0=8, n1=2), c.candidates(), 10.0)
    assert d.node_id == "n0" and d.score == 66.0 and d.reason is RouteReason.CACHE_HIT


def test_active_prefill_counts_until_the_first_token(make_cluster, make_ctx, matches):
    """Dynamo's default prefill load: a request's uncached tokens count on its worker
    from routing to its first token (mark_prefill_completed), however long that is."""
    c = make_cluster(3)
    p = _loaded_policy(c, make_ctx)
    _route(p, c, _ctx(make_ctx, 1200, rid="long"), {}, c.candidates("n1"), 9.95)
    assert p.active_prefill_tokens("n1") == 1200.0
    # n1: (1200 + 128) / 16 + (75 + 10) = 168; n2: 30 → n2; n0: 52
    d = _route(p, c, _ctx(make_ctx, 160, rid="x"), matches(n0=8, n1=2), c.candidates(), 60.0)
    assert d.node_id == "n2" and d.score == 30.0 and d.reason is RouteReason.LOAD
    p.on_first_token("n1", 61.0, "long")
    assert p.active_prefill_tokens("n1") == 0.0
    p.on_first_token("n1", 62.0, "long")  # once only
    assert p.active_prefill_tokens("n1") == 0.0 and p.active_blocks("n1") == 75


def test_a_request_is_released_by_its_id(make_cluster, make_ctx):
    """Completion frees the request that left (Dynamo's free(request_id)), not the
    node's oldest: a short request finishing under a long one frees only itself."""
    c = make_cluster(2)
    p = DynamoCostPolicy()
    _route(p, c, _ctx(make_ctx, 32_000, rid="long"), {}, c.candidates("n0"), 0.0)
    _route(p, c, _ctx(make_ctx, 160, 90_000, rid="short"), {}, c.candidates("n0"), 0.1)
    p.on_first_token("n0", 0.2, "short")
    p.on_finished("n0", 0.3, "short")
    assert p.active_blocks("n0") == 2000 and p.active_prefill_tokens("n0") == 32_000.0
    p.on_finished("n0", 9.0, "long")
    assert p.active_blocks("n0") == 0 and p.active_prefill_tokens("n0") == 0.0


def test_on_finished_releases_blocks(make_cluster, make_ctx):
    c = make_cluster(3)
    p = _loaded_policy(c, make_ctx)
    p.on_finished(c["n0"].node_id, 5.0, "r1")
    assert p.active_blocks("n0") == 20
    p.on_finished(c["n0"].node_id, 5.0)  # no id: the oldest left
    p.on_finished(c["n0"].node_id, 5.0)  # nothing left: ignored
    assert p.active_blocks("n0") == 0


def test_ties_break_at_random_among_the_cheapest(make_cluster, make_ctx, scripted):
    c = make_cluster(3)
    c.load("n0", waiting=2)  # queue length is no part of Dynamo's cost or tie-break
    picks = {
        DynamoCostPolicy()
        .select(_ctx(make_ctx, 160), c.candidates(), {}, c.table, scripted(u), 1.0)
        .node_id
        for u in (0.1, 0.5, 0.9)
    }
    assert picks == {"n0", "n1", "n2"}


def test_temperature_sampling_matches_softmax(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    ctx = _ctx(make_ctx, 160)
    # logits 10, 15, 20 → normalised 0, 0.5, 1 → softmax(-x / 1)
    ms = matches(n0=10, n1=5)
    weights = [1.0, math.exp(-0.5), math.exp(-1.0)]
    expected = [w / sum(weights) for w in weights]
    p, rng = DynamoCostPolicy(temperature=1.0), random.Random(11)
    counts = Counter()
    for _ in range(20_000):
        d = p.select(ctx, c.candidates(), ms, c.table, rng, 1.0)
        counts[d.node_id] += 1
        p.on_finished(d.node_id, 1.0)  # keep the load at zero
    for i, prob in enumerate(expected):
        assert counts[f"n{i}"] / 20_000 == pytest.approx(prob, abs=0.015)


def test_temperature_sampling_is_seeded_and_flags_exploration(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    ctx, ms = _ctx(make_ctx, 160), matches(n0=10, n1=5)

    def run(seed):
        p, rng = DynamoCostPolicy(temperature=0.5), random.Random(seed)
        return [p.select(ctx, c.candidates(), ms, c.table, rng, 1.0) for _ in range(30)]

    a, b = run(5), run(5)
    assert [d.node_id for d in a] == [d.node_id for d in b]
    for d in a:
        if d.score > d.parts["min_logit"]:
            assert d.reason is RouteReason.EXPLORATION
    assert any(d.reason is RouteReason.EXPLORATION for d in a)


def test_equal_logits_sample_uniformly(make_cluster, make_ctx, scripted):
    c = make_cluster(4)
    d = DynamoCostPolicy(temperature=2.0).select(
        _ctx(make_ctx, 160), c.candidates(), {}, c.table, scripted(0.6), 1.0
    )
    assert d.node_id == "n2" and d.parts["probability"] == 0.25


def test_validation_and_defaults():
    p = DynamoCostPolicy()
    assert (p.overlap_weight, p.temperature) == (1.0, 0.0)
    with pytest.raises(ConfigError):
        DynamoCostPolicy(temperature=-1.0)
