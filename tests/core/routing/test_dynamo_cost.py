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


def _ctx(make_ctx, prompt_tokens, base=0):
    """A prompt whose chain is ``base, base + 1, ...`` (distinct bases share no block)."""
    return make_ctx(
        tuple(range(base, base + prompt_tokens // TPB)),
        tokens_per_block=TPB,
        prompt_tokens=prompt_tokens,
    )


def _route(p, c, ctx, matches, cands, now):
    d = p.select(ctx, cands, matches, c.table, RNG, now)
    assert d is not None
    return d


def _loaded_policy(c, make_ctx, **kw):
    """n0: two 320-token (20-block) requests, n2: one 160-token request, all at t = 0."""
    p = DynamoCostPolicy(**kw)
    for base, (node, tokens) in enumerate((("n0", 320), ("n0", 320), ("n2", 160))):
        _route(p, c, _ctx(make_ctx, tokens, 1000 * (base + 1)), {}, c.candidates(node), 0.0)
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


def test_active_prefill_decays_over_the_estimated_prefill(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    p = _loaded_policy(c, make_ctx)
    # n1 gets 1,200 uncached tokens at t = 9.95: 0.1 s at 12,000 tok/s → half left at t = 10
    _route(p, c, _ctx(make_ctx, 1200), {}, c.candidates("n1"), 9.95)
    assert p.active_prefill_tokens("n1", 9.95) == 1200.0
    assert p.active_prefill_tokens("n1", 10.0) == pytest.approx(600.0)
    assert p.active_prefill_tokens("n1", 10.1) == 0.0
    # n1: (600 + 128) / 16 + (75 + 10) = 130.5; n2: 30 → n2; n0: 52
    d = _route(p, c, _ctx(make_ctx, 160), matches(n0=8, n1=2), c.candidates(), 10.0)
    assert d.node_id == "n2" and d.score == 30.0 and d.reason is RouteReason.LOAD


def test_prefills_queue_behind_each_other(make_cluster, make_ctx):
    c = make_cluster(1)
    p = DynamoCostPolicy()
    for _ in range(2):
        _route(p, c, _ctx(make_ctx, 1200), {}, c.candidates(), 0.0)
    assert p.active_prefill_tokens("n0", 0.1) == pytest.approx(1200.0)  # second starts at 0.1
    assert p.active_prefill_tokens("n0", 0.15) == pytest.approx(600.0)


def test_on_finished_releases_blocks(make_cluster, make_ctx):
    c = make_cluster(3)
    p = _loaded_policy(c, make_ctx)
    p.on_finished(c["n0"].node_id, 5.0)
    assert p.active_blocks("n0") == 20
    p.on_finished(c["n0"].node_id, 5.0)
    p.on_finished(c["n0"].node_id, 5.0)  # nothing left: ignored
    assert p.active_blocks("n0") == 0


def test_ties_break_by_queue_then_slot(make_cluster, make_ctx):
    c = make_cluster(3)
    c.load("n0", waiting=2)
    d = _route(DynamoCostPolicy(), c, _ctx(make_ctx, 160), {}, c.candidates(), 1.0)
    assert d.node_id == "n1"


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
