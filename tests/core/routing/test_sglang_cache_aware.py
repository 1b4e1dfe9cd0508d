"""SGLang cache_aware: imbalance switch (abs AND rel), strict match threshold, first holder."""

import random

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.sglang_cache_aware import SglangCacheAwarePolicy

RNG = random.Random(0)


def _ctx(make_ctx):
    # 100 blocks of 10 tokens: a match of k blocks is a match rate of k / 100
    return make_ctx(tuple(range(100)), tokens_per_block=10, prompt_tokens=1000)


def _loads(c, **loads):
    for name, n in loads.items():
        c.load(name, inflight=n)


def _pick(p, c, ctx, matches, cands=None):
    d = p.select(ctx, cands or c.candidates(), matches, c.table, RNG, c.now)
    assert d is not None
    return d


def test_defaults_are_sglang_router_0_3_2_cli():
    p = SglangCacheAwarePolicy()
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)
    assert p.fallback == "least_loaded"


@pytest.mark.parametrize(
    ("blocks", "expected", "reason"),
    [(31, "n2", RouteReason.CACHE_HIT), (30, "n1", RouteReason.LOAD), (29, "n1", RouteReason.LOAD)],
)
def test_match_threshold_is_strict(make_cluster, make_ctx, matches, blocks, expected, reason):
    c = make_cluster(3)
    _loads(c, n0=3, n1=1, n2=10)  # balanced: 10 - 1 <= 64
    d = _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n2=blocks))
    assert (d.node_id, d.reason) == (expected, reason)
    assert d.best_matched_blocks == blocks
    assert d.parts["best_match_rate"] == pytest.approx(blocks / 100)
    assert d.parts["imbalanced"] == 0.0


def test_imbalance_goes_least_loaded_even_with_a_full_match(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    _loads(c, n0=70, n1=5, n2=6)  # 65 > 64 and 70 > 1.5 * 5
    d = _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n0=100))
    assert d.node_id == "n1" and d.reason is RouteReason.LOAD
    assert d.parts["imbalanced"] == 1.0 and d.matched_blocks == 0 and d.best_matched_blocks == 100
    assert (d.parts["max_load"], d.parts["min_load"]) == (70.0, 5.0)


@pytest.mark.parametrize(
    ("high", "low"),
    [(200, 135), (60, 5)],  # only abs (65 > 64, 200 <= 202.5); only rel (55 <= 64, 60 > 7.5)
)
def test_one_condition_alone_is_not_imbalance(make_cluster, make_ctx, matches, high, low):
    c = make_cluster(3)
    _loads(c, n0=high, n1=low, n2=low)
    d = _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n0=100))
    assert d.node_id == "n0" and d.reason is RouteReason.CACHE_HIT
    assert d.parts["imbalanced"] == 0.0


def test_several_holders_first_not_least_loaded(make_cluster, make_ctx, matches):
    c = make_cluster(4)
    _loads(c, n1=20, n3=0)
    d = _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n1=50, n3=50, n0=10))
    assert d.node_id == "n1" and d.matched_blocks == 50
    cands = list(reversed(c.candidates()))  # order of the candidate list does not matter
    assert (
        _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n1=50, n3=50), cands).node_id
        == "n1"
    )


def test_deepest_holder_wins_regardless_of_load(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    _loads(c, n0=0, n1=40)
    d = _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n0=35, n1=80))
    assert d.node_id == "n1" and d.score == pytest.approx(0.8)


def test_non_candidate_holder_is_ignored(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    _loads(c, n1=2)
    d = _pick(
        SglangCacheAwarePolicy(), c, _ctx(make_ctx), matches(n0=100), c.candidates("n1", "n2")
    )
    assert d.node_id == "n2" and d.best_matched_blocks == 0


def test_least_loaded_ties_go_to_the_first_worker(make_cluster, make_ctx):
    """SGLang's ``min_by_key(load)`` keeps the first of equally loaded workers; ties broken
    by the fewest requests routed (no SGLang does) spread misses more evenly."""
    c = make_cluster(3)
    p = SglangCacheAwarePolicy()
    picks = [_pick(p, c, _ctx(make_ctx), {}).node_id for _ in range(4)]
    assert picks == ["n0"] * 4  # in-flight equal (none stays in flight here)


def test_match_rate_capped_at_one(make_cluster, make_ctx, matches):
    c = make_cluster(2)
    ctx = make_ctx((1, 2), tokens_per_block=64, prompt_tokens=100)  # 2 blocks = 128 > 100
    d = _pick(SglangCacheAwarePolicy(), c, ctx, matches(n1=2))
    assert d.node_id == "n1" and d.score == 1.0


def test_older_smallest_tree_fallback(make_cluster, make_ctx, matches):
    c = make_cluster(2)
    _loads(c, n1=30)
    p = SglangCacheAwarePolicy(fallback="smallest_tree")
    assert _pick(p, c, _ctx(make_ctx), {}).node_id == "n0"  # both trees empty → slot
    # n0's tree now holds 1000 tokens: a miss goes to n1 although n1 is busier
    assert _pick(p, c, _ctx(make_ctx), {}).node_id == "n1"
    assert _pick(SglangCacheAwarePolicy(), c, _ctx(make_ctx), {}).node_id == "n0"


def test_validation():
    with pytest.raises(ConfigError):
        SglangCacheAwarePolicy(cache_threshold=1.5)
    with pytest.raises(ConfigError):
        SglangCacheAwarePolicy(fallback="random")
