"""Round robin: cycles in slot order, skips non-candidates without losing its place."""

import random

from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.round_robin import RoundRobinPolicy


def _pick(policy, c, cands, ctx, matches=None):
    d = policy.select(ctx, cands, matches or {}, c.table, random.Random(0), c.now)
    assert d is not None
    return d


def test_cycles_in_slot_order(make_cluster, make_ctx):
    c = make_cluster(3)
    p = RoundRobinPolicy()
    picks = [_pick(p, c, c.candidates(), make_ctx()).node_id for _ in range(7)]
    assert picks == ["n0", "n1", "n2", "n0", "n1", "n2", "n0"]


def test_ignores_load_cache_and_candidate_order(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    c.load("n0", inflight=50, waiting=50)
    p = RoundRobinPolicy()
    cands = list(reversed(c.candidates()))
    picks = [_pick(p, c, cands, make_ctx(), matches(n2=4)).node_id for _ in range(3)]
    assert picks == ["n0", "n1", "n2"]


def test_skips_non_candidates_and_keeps_its_place(make_cluster, make_ctx):
    c = make_cluster(4)
    p = RoundRobinPolicy()
    ctx = make_ctx()
    assert _pick(p, c, c.candidates(), ctx).node_id == "n0"
    assert _pick(p, c, c.candidates(), ctx).node_id == "n1"
    without_n2 = c.candidates("n0", "n1", "n3")
    assert _pick(p, c, without_n2, ctx).node_id == "n3"  # n2 skipped
    assert _pick(p, c, without_n2, ctx).node_id == "n0"  # wrap
    assert _pick(p, c, c.candidates(), ctx).node_id == "n1"  # n2 back, rotation continues
    assert _pick(p, c, c.candidates(), ctx).node_id == "n2"


def test_decision_fields(make_cluster, make_ctx, matches):
    c = make_cluster(2)
    d = _pick(RoundRobinPolicy(), c, c.candidates(), make_ctx(), matches(n0=2, n1=3))
    assert d.reason is RouteReason.ROTATION
    assert (d.matched_blocks, d.best_matched_blocks) == (2, 3)
    assert d.parts["slot"] == 0.0


def test_no_candidates(make_cluster, make_ctx):
    c = make_cluster(2)
    assert RoundRobinPolicy().select(make_ctx(), [], {}, c.table, random.Random(0), c.now) is None
