"""Least loaded: min in-flight (this gateway's own count), then queue, then a uniform pick."""

import random

from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.least_loaded import LeastLoadedPolicy


def _pick(c, ctx, cands=None, matches=None):
    return LeastLoadedPolicy().select(
        ctx, cands or c.candidates(), matches or {}, c.table, random.Random(0), c.now
    )


def test_min_inflight_wins_over_cache(make_cluster, make_ctx, matches):
    c = make_cluster(3)
    c.load("n0", inflight=4)
    c.load("n1", inflight=1)
    c.load("n2", inflight=2)
    d = _pick(c, make_ctx(), matches=matches(n0=4))
    assert d.node_id == "n1" and d.reason is RouteReason.LOAD
    assert d.score == 1.0 and d.parts["inflight"] == 1.0
    assert (d.matched_blocks, d.best_matched_blocks) == (0, 4)


def test_equal_reported_queues_fewer_inflight_wins(make_cluster, make_ctx):
    # right after a report every queue reads 0 (vLLM waiting = 0): the node running
    # 50 of this gateway's requests must not tie with the one running 5
    c = make_cluster(2)
    c.load("n0", inflight=50, waiting=0, running=50)
    c.load("n1", inflight=5, waiting=0, running=5)
    assert c.table.queue(c["n0"], c.now) == c.table.queue(c["n1"], c.now) == 0
    picks = []
    for _ in range(6):
        d = _pick(c, make_ctx())
        picks.append(d.node_id)
        c.table.on_sent(c[d.node_id], now=c.now)
    assert picks == ["n1"] * 6
    assert d.parts == {"inflight": 10.0, "queue": 5.0}


def test_inflight_ranks_before_the_reported_queue(make_cluster, make_ctx):
    c = make_cluster(2)
    c.load("n0", inflight=3, waiting=0)
    c.load("n1", inflight=1, waiting=4)
    assert _pick(c, make_ctx()).node_id == "n1"


def test_ties_by_queue_then_a_uniform_pick(make_cluster, make_ctx):
    """The lower slot took every tie: an idle cluster sent everything to slot 0, where
    KubeAI, walking a Go map, picks among the tied at random."""
    c = make_cluster(3)
    c.load("n0", inflight=2, waiting=3)  # in-flight 2, queue 3
    c.load("n1", inflight=2, waiting=1)  # in-flight 2, queue 1
    c.load("n2", inflight=2, waiting=1)
    policy = LeastLoadedPolicy()
    picks = [policy.select(make_ctx(), c.candidates(), {}, c.table, random.Random(seed),
                           c.now).node_id for seed in range(200)]
    assert set(picks) == {"n1", "n2"} and 70 <= picks.count("n1") <= 130
    assert _pick(c, make_ctx(), cands=c.candidates("n2", "n0")).node_id == "n2"


def test_stale_report_breaks_ties_by_own_inflight(make_cluster, make_ctx):
    c = make_cluster(2)
    c.load("n0", inflight=2, waiting=0, stale=True)  # stale: queue = in-flight = 2
    c.load("n1", inflight=2, waiting=1)
    assert _pick(c, make_ctx()).node_id == "n1"


def test_no_candidates(make_cluster, make_ctx):
    c = make_cluster(1)
    assert LeastLoadedPolicy().select(make_ctx(), [], {}, c.table, random.Random(0), 0.0) is None
