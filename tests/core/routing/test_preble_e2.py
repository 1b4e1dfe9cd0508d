"""Preble E2: exploit when cached > uncached, else explore by window load + prefill cost."""

import random

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.preble_e2 import PrebleE2Policy

RNG = random.Random(0)
A, B = 0.066, 0.25  # default ms per prefill token / per decode token


def _ctx(make_ctx, prompt_tokens=1000, max_tokens=100, request_id=""):
    # blocks of 100 tokens: a match of k blocks caches 100 k tokens
    n = -(-prompt_tokens // 100)
    return make_ctx(
        tuple(range(n)),
        tokens_per_block=100,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        request_id=request_id,
    )


def _route(p, c, ctx, matches, cands=None, now=10.0):
    d = p.select(ctx, cands or c.candidates(), matches, c.table, RNG, now)
    assert d is not None
    return d


def _warm(p, c, make_ctx):
    """Window load: n0 182 ms (2,000 + 200 decode), n1 33 ms (500 + 0), n2 nothing."""
    _route(p, c, _ctx(make_ctx, 2000, 200), {}, c.candidates("n0"), now=0.0)
    _route(p, c, _ctx(make_ctx, 500, 0), {}, c.candidates("n1"), now=0.0)
    assert p.recent_load("n0") == pytest.approx(A * 2000 + B * 200)
    assert p.recent_load("n1") == pytest.approx(A * 500)


def test_exploit_when_cached_exceeds_uncached(make_cluster, make_ctx, matches):
    c = make_cluster(4)
    p = PrebleE2Policy()
    _route(p, c, _ctx(make_ctx), {}, c.candidates("n1"), now=0.0)  # n1 has recent load
    # 600 cached > 400 uncached; holders n1, n2 (6 blocks), n0 shorter, n3 idle
    d = _route(p, c, _ctx(make_ctx), matches(n0=3, n1=6, n2=6))
    assert d.node_id == "n2" and d.reason is RouteReason.CACHE_HIT
    assert d.parts["exploit"] == 1.0 and d.parts["cached_tokens"] == 600.0
    assert d.matched_blocks == 6


def test_exploit_ignores_load_outside_the_holders(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    p = PrebleE2Policy()
    for _ in range(20):
        _route(p, c, _ctx(make_ctx), {}, c.candidates("n2"), now=0.0)
    d = _route(p, c, _ctx(make_ctx), matches(n2=9))
    assert d.node_id == "n2"  # heavy, but the only holder of a 90 % match


def test_equal_split_explores_by_hand_computed_cost(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    p = PrebleE2Policy()
    _warm(p, c, make_ctx)
    # 500 cached == 500 uncached → explore. cost = window load + prefill of the misses:
    #   n0: 182 + 0.066 * 500 = 215;  n1: 33 + 0.066 * 1000 = 99;  n2: 0 + 66 = 66  ← min
    d = _route(p, c, _ctx(make_ctx), matches(n0=5))
    assert d.node_id == "n2" and d.score == pytest.approx(66.0)
    assert d.parts["exploit"] == 0.0 and d.reason is RouteReason.EXPLORATION
    # its own cost now counts on n2: prefill 66 (window) + active decode 0.25 * 100
    assert p.recent_load("n2") == pytest.approx(66.0 + 25.0)


def test_explore_can_pick_a_holder_when_it_is_cheapest(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    p = PrebleE2Policy()
    _route(p, c, _ctx(make_ctx, 500, 0), {}, c.candidates("n1"), now=0.0)  # n1: 33
    _route(p, c, _ctx(make_ctx, 500, 0), {}, c.candidates("n2"), now=0.0)  # n2: 33
    # n0 (holder of 400 tokens): 0 + 0.066 * 600 = 39.6 < 33 + 66
    d = _route(p, c, _ctx(make_ctx), matches(n0=4))
    assert d.node_id == "n0" and d.reason is RouteReason.CACHE_HIT
    assert d.parts["exploit"] == 0.0


def test_window_forgets_after_h(make_cluster, make_ctx):
    c = make_cluster(2)
    for now, expected in ((179.0, "n1"), (180.0, "n0")):
        p = PrebleE2Policy()
        _route(p, c, _ctx(make_ctx, request_id="a"), {}, c.candidates("n0"), now=0.0)
        p.on_finished("n0", 1.0, "a")  # n0: prefill 66 ms stays in the window, decode gone
        _route(p, c, _ctx(make_ctx, 500, 0), {}, c.candidates("n1"), now=100.0)  # 33 ms
        # at 179 s: n0 66 + 66 > n1 33 + 66; at 180 s n0's entry has left the window
        d = _route(p, c, _ctx(make_ctx), {}, now=now)
        assert d.node_id == expected
        assert d.parts["recent_load_ms"] == pytest.approx(0.0 if now == 180.0 else 33.0)


def test_finished_requests_release_their_decode_but_keep_prefill(make_cluster, make_ctx):
    # the audit's repro: 40 short chats on n0, all finished by t=1 s; n1 has one active
    c = make_cluster(2)
    p = PrebleE2Policy()
    for k in range(40):
        ctx = _ctx(make_ctx, 100, 1024, request_id=f"r{k}")
        _route(p, c, ctx, {}, c.candidates("n0"), now=k * 0.01)
        p.on_finished("n0", 1.0, f"r{k}")
    _route(p, c, _ctx(make_ctx, 100, 64, request_id="live"), {}, c.candidates("n1"), now=1.0)
    # at 170 s n0 is idle: only its prefill history (40 x 6.6 ms) is left, no decode
    d = _route(p, c, _ctx(make_ctx, 100, 0), {}, c.candidates("n0"), now=170.0)
    assert d.parts["recent_load_ms"] == pytest.approx(40 * A * 100)
    assert p.active_decode("n0") == 0.0
    # n1's request is still running: its decode still counts
    assert p.recent_load("n1") == pytest.approx(A * 100 + B * 64)
    assert p.active_decode("n1") == pytest.approx(B * 64)
    p.on_finished("n1", 171.0, "live")
    assert p.recent_load("n1") == pytest.approx(A * 100)


def test_finish_by_id_and_fallbacks(make_cluster, make_ctx):
    c = make_cluster(2)
    p = PrebleE2Policy()
    for rid, out in (("a", 100), ("b", 200), ("", 400)):
        _route(p, c, _ctx(make_ctx, 100, out, request_id=rid), {}, c.candidates("n0"), now=0.0)
    assert p.active_decode("n0") == pytest.approx(B * 700)
    p.on_finished("n0", 1.0, "b")  # by id
    assert p.active_decode("n0") == pytest.approx(B * 500)
    p.on_finished("n0", 1.0, "unknown")  # unknown id: the oldest (a)
    assert p.active_decode("n0") == pytest.approx(B * 400)
    p.on_finished("n1", 1.0, "x")  # nothing active there: no-op
    p.on_finished("n0", 1.0)  # no id: the oldest (the id-less one)
    assert p.active_decode("n0") == 0.0 and not p._active.holds("n0")
    p.on_finished("n0", 1.0, "a")  # already released: no-op
    assert p.recent_load("n0") == pytest.approx(3 * A * 100)


def test_same_id_routed_again_replaces_and_removal_forgets(make_cluster, make_ctx):
    c = make_cluster(2)
    p = PrebleE2Policy()
    _route(p, c, _ctx(make_ctx, 100, 100, request_id="a"), {}, c.candidates("n0"), now=0.0)
    _route(p, c, _ctx(make_ctx, 100, 40, request_id="a"), {}, c.candidates("n0"), now=0.0)
    assert p.active_decode("n0") == pytest.approx(B * 40)
    _route(p, c, _ctx(make_ctx, 100, 40, request_id="b"), {}, c.candidates("n1"), now=1.0)
    p.on_node_removed("n0")
    assert p.active_decode("n0") == 0.0 and not p._active.holds("n0")
    # its prefill history goes too: a node added back under its id starts afresh
    assert p.recent_load("n0") == 0.0 and p.recent_load("n1") > 0.0
    p._expire(500.0)  # the rest of the window expires without tripping on it
    assert p.recent_load("n1") == pytest.approx(B * 40)


def test_active_requests_are_bounded(make_cluster, make_ctx):
    c = make_cluster(1)
    p = PrebleE2Policy()
    p._active.cap = 3
    for k in range(5):
        ctx = _ctx(make_ctx, 100, 100 * (k + 1), request_id=f"r{k}")
        _route(p, c, ctx, {}, now=0.0)
    # the oldest went first
    assert [p._active.get("n0", f"r{k}") is not None for k in range(5)] == [0, 0, 1, 1, 1]
    assert p.active_decode("n0") == pytest.approx(B * (300 + 400 + 500))


def test_eviction_cost_is_off_by_default_and_uses_utilisation(make_cluster, make_ctx):
    c = make_cluster(2)
    c.load("n0", kv_util=1.0)
    c.load("n1", kv_util=0.0)
    d = _route(PrebleE2Policy(), c, _ctx(make_ctx), {})
    assert d.node_id == "n0" and d.parts["eviction_ms"] == 0.0
    d = _route(PrebleE2Policy(eviction_weight=1.0), c, _ctx(make_ctx), {})
    assert d.node_id == "n1"


def test_defaults_and_validation():
    p = PrebleE2Policy()
    assert (p.window_s, p.prefill_ms_per_token, p.decode_ms_per_token) == (180.0, A, B)
    assert p.eviction_weight == 0.0
    with pytest.raises(ConfigError):
        PrebleE2Policy(window_s=0.0)
