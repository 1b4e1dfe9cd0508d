"""Power of two: two distinct uniform samples, the lower load of the two."""

import random

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.rng import pick_index
from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.power_of_two import PowerOfTwoPolicy


class Recording:
    def __init__(self, seed):
        self.inner, self.draws = random.Random(seed), []

    def random(self):
        v = self.inner.random()
        self.draws.append(v)
        return v


def test_lower_of_the_two_sampled_not_the_global_min(make_cluster, make_ctx, scripted):
    c = make_cluster(4)
    for name, load in (("n0", 5), ("n1", 3), ("n2", 0), ("n3", 8)):
        c.load(name, inflight=load)
    p = PowerOfTwoPolicy()
    # draws 0.0, 0.0 → i = 0, j = 0 → skip i → 1: pair (n0, n1); n2 (load 0) is not sampled
    d = p.select(make_ctx(), c.candidates(), {}, c.table, scripted(0.0, 0.0), c.now)
    assert d.node_id == "n1" and d.reason is RouteReason.LOAD
    assert d.parts == {"load": 3.0, "other_load": 5.0, "other_slot": 0.0}
    # draws 0.99, 0.99 → i = 3, j = 2: pair (n3, n2)
    d = p.select(make_ctx(), c.candidates(), {}, c.table, scripted(0.99, 0.99), c.now)
    assert d.node_id == "n2"


def test_seeded_choice_is_the_lower_of_two_distinct_samples(make_cluster, make_ctx):
    c = make_cluster(6)
    for i in range(6):
        c.load(f"n{i}", inflight=[4, 9, 1, 7, 3, 6][i])
    p = PowerOfTwoPolicy()
    loads = [4, 9, 1, 7, 3, 6]
    for seed in range(200):
        rng = Recording(seed)
        d = p.select(make_ctx(), c.candidates(), {}, c.table, rng, c.now)
        a, b = rng.draws
        i = pick_index(_Fixed(a), 6)
        j = pick_index(_Fixed(b), 5)
        j = j + 1 if j >= i else j
        assert i != j
        expected = i if loads[i] <= loads[j] else j
        assert d.node_id == f"n{expected}"


class _Fixed:
    def __init__(self, v):
        self.v = v

    def random(self):
        return self.v


def test_two_nodes_always_the_lighter(make_cluster, make_ctx):
    c = make_cluster(2)
    c.load("n0", inflight=2)
    rng = random.Random(3)
    p = PowerOfTwoPolicy()
    assert {
        p.select(make_ctx(), c.candidates(), {}, c.table, rng, c.now).node_id for _ in range(50)
    } == {"n1"}


def test_tie_breaks_by_slot_and_queue_signal(make_cluster, make_ctx, scripted):
    c = make_cluster(2)
    c.load("n0", waiting=5)
    d = PowerOfTwoPolicy().select(
        make_ctx(), c.candidates(), {}, c.table, scripted(0.9, 0.0), c.now
    )
    assert d.node_id == "n1"  # equal in-flight → queue (5 vs 0)
    d = PowerOfTwoPolicy(load="queue").select(
        make_ctx(), c.candidates(), {}, c.table, scripted(0.9, 0.0), c.now
    )
    assert d.node_id == "n1" and d.score == 0.0


def test_single_candidate_and_none(make_cluster, make_ctx, scripted):
    c = make_cluster(3)
    rng = scripted(0.5)
    d = PowerOfTwoPolicy().select(make_ctx(), c.candidates("n2"), {}, c.table, rng, c.now)
    assert d.node_id == "n2" and rng.calls == 0
    assert PowerOfTwoPolicy().select(make_ctx(), [], {}, c.table, rng, c.now) is None


def test_bad_load_signal():
    with pytest.raises(ConfigError):
        PowerOfTwoPolicy(load="kv")


def test_a_tie_keeps_the_first_sample(make_cluster, make_ctx):
    """SGLang keeps the first sample on ``load1 <= load2``; taking the lower slot made
    slot 0 win every tie it was drawn into and the last slot none."""
    c = make_cluster(8)
    p = PowerOfTwoPolicy()
    for seed in range(100):
        rng = Recording(seed)
        d = p.select(make_ctx(), c.candidates(), {}, c.table, rng, c.now)
        assert d.node_id == f"n{pick_index(_Fixed(rng.draws[0]), 8)}"
