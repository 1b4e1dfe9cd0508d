"""Random: uniform over candidates, replayable from a seed, one draw per decision."""

import random
from collections import Counter

from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.random_choice import RandomPolicy


def test_covers_all_candidates_roughly_uniformly(make_cluster, make_ctx):
    c = make_cluster(3)
    p, rng = RandomPolicy(), random.Random(7)
    counts = Counter(
        p.select(make_ctx(), c.candidates(), {}, c.table, rng, c.now).node_id for _ in range(3000)
    )
    assert set(counts) == {"n0", "n1", "n2"}
    assert all(900 < v < 1100 for v in counts.values()), counts


def test_seeded_and_independent_of_candidate_order(make_cluster, make_ctx):
    c = make_cluster(5)
    cands = c.candidates()

    def run(order):
        rng = random.Random(42)
        return [
            RandomPolicy().select(make_ctx(), order, {}, c.table, rng, c.now).node_id
            for _ in range(50)
        ]

    assert run(cands) == run(list(reversed(cands)))


def test_one_draw_maps_to_slot_order(make_cluster, make_ctx, scripted):
    c = make_cluster(4)
    rng = scripted(0.6)
    d = RandomPolicy().select(make_ctx(), c.candidates(), {}, c.table, rng, c.now)
    assert d.node_id == "n2" and rng.calls == 1  # int(0.6 * 4) = 2
    assert d.reason is RouteReason.ROTATION


def test_no_candidates(make_cluster, make_ctx):
    c = make_cluster(1)
    assert RandomPolicy().select(make_ctx(), [], {}, c.table, random.Random(0), c.now) is None
