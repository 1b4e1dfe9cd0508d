"""Least loaded: min queue, then in-flight, then slot."""

import random

from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.least_loaded import LeastLoadedPolicy


def _pick(c, ctx, cands=None, matches=None):
    return LeastLoadedPolicy().select(
        ctx, cands or c.candidates(), matches or {}, c.table, random.Random(0), c.now
    )


def test_min_queue_wins_over_cache(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    c.load("n0", waiting=4)
    c.load("n1", waiting=1)
    c.load("n2", waiting=2)
    d = _pick(c, make_ctx(), matches=matches(n0=4))
    assert d.node_id == "n1" and d.reason is RouteReason.LOAD
    assert d.score == 1.0 and d.parts["queue"] == 1.0
    assert (d.matched_blocks, d.best_matched_blocks) == (0, 4)


def test_ties_by_inflight_then_slot(make_cluster, make_ctx):
    c = make_cluster(3)
    c.load("n0", inflight=3, waiting=2)  # queue 2, in-flight 3
    c.load("n1", inflight=1, waiting=2)  # queue 2, in-flight 1
    c.load("n2", inflight=1, waiting=2)
    assert _pick(c, make_ctx()).node_id == "n1"
    assert _pick(c, make_ctx(), cands=c.candidates("n2", "n0")).node_id == "n2"


def test_stale_report_counts_own_inflight(make_cluster, make_ctx):
    c = make_cluster(2)
    c.load("n0", inflight=5, waiting=0, stale=True)  # stale: queue = in-flight = 5
    c.load("n1", waiting=3)
    assert _pick(c, make_ctx()).node_id == "n1"


def test_no_candidates(make_cluster, make_ctx):
    c = make_cluster(1)
    assert LeastLoadedPolicy().select(make_ctx(), [], {}, c.table, random.Random(0), 0.0) is None
