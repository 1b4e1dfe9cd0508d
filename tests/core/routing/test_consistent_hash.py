"""Consistent hash with bounded loads: stable placement, KubeAI's bound, ~1/N moves."""

import random
from collections import Counter

import pytest
import xxhash

from kvgate.core.errors import ConfigError
from kvgate.core.routing.base import RouteReason
from kvgate.core.routing.consistent_hash import ConsistentHashPolicy, load_ok

RNG = random.Random(0)


def _chain(key, n=6):
    return tuple(key * 1000 + i for i in range(n))


def _place(p, c, ctx, cands=None):
    d = p.select(ctx, cands if cands is not None else c.candidates(), {}, c.table, RNG, c.now)
    assert d is not None
    return d


def test_same_prefix_same_node_suffix_irrelevant(make_cluster, make_ctx):
    c = make_cluster(5)
    p = ConsistentHashPolicy()  # 256 tokens / 64 per block → key = chain[3]
    base = _chain(1)
    first = _place(p, c, make_ctx(base)).node_id
    assert first == _place(ConsistentHashPolicy(), c, make_ctx(base)).node_id  # fresh instance
    other_suffix = (*base[:4], 77, 78, 79)
    assert _place(p, c, make_ctx(other_suffix)).node_id == first
    d = _place(p, c, make_ctx(base))
    assert d.reason is RouteReason.HASH and d.parts["hops"] == 0.0


def test_key_is_the_chain_hash_covering_prefix_tokens(make_ctx):
    p = ConsistentHashPolicy()
    chain = (11, 22, 33, 44, 55)
    expected = xxhash.xxh3_64_intdigest(b"m\0" + (44).to_bytes(8, "little"))
    assert p.key(make_ctx(chain, tokens_per_block=64)) == expected
    big_blocks = p.key(make_ctx(chain, tokens_per_block=512))  # one 512-token block ≥ 256
    assert big_blocks == xxhash.xxh3_64_intdigest(b"m\0" + (11).to_bytes(8, "little"))
    assert p.key(make_ctx((11, 22), tokens_per_block=64)) == xxhash.xxh3_64_intdigest(
        b"m\0" + (22).to_bytes(8, "little")
    )  # shorter prompt: all its blocks
    assert p.key(make_ctx((), prompt_tokens=20)) is None


def test_prefixes_spread_over_all_nodes(make_cluster, make_ctx):
    c = make_cluster(4)
    p = ConsistentHashPolicy()
    counts = Counter(_place(p, c, make_ctx(_chain(k))).node_id for k in range(400))
    assert set(counts) == {"n0", "n1", "n2", "n3"}
    assert all(50 < v < 160 for v in counts.values()), counts


def test_kubeai_load_bound():
    assert load_ok(0, 0, 4, 1.25)  # nothing in flight: always ok
    assert load_ok(0, 5, 4, 1.25)  # 0 + 1 <= 1.25 * (5 + 1) / 4 = 1.875
    assert not load_ok(1, 5, 4, 1.25)  # 2 > 1.875
    assert load_ok(2, 11, 4, 1.25)  # 3 <= 3.75
    assert not load_ok(3, 11, 4, 1.25)  # 4 > 3.75


def _owner(c, ctx):
    return _place(ConsistentHashPolicy(), c, ctx).node_id


def test_overloaded_owner_walks_to_its_ring_successor(make_cluster, make_ctx):
    ctx = make_ctx(_chain(3))
    c = make_cluster(4)
    owner = _owner(c, ctx)
    others = [s for s in c.candidates() if s.node_id != owner]
    successor = _place(ConsistentHashPolicy(), c, ctx, others).node_id  # owner excluded
    c.load(owner, inflight=10)  # 11 > 1.25 * 11 / 4 = 3.44
    d = _place(ConsistentHashPolicy(), c, ctx)
    assert d.node_id == successor and d.reason is RouteReason.HASH
    assert d.parts["hops"] == 1.0 and d.parts["threshold"] == pytest.approx(3.4375)


def test_owner_within_the_bound_keeps_its_key(make_cluster, make_ctx):
    ctx = make_ctx(_chain(3))
    c = make_cluster(4)
    owner = _owner(c, ctx)
    c.load(owner, inflight=1)
    c.load(next(s.node_id for s in c.candidates() if s.node_id != owner), inflight=7)
    assert _owner(c, ctx) == owner  # 2 <= 1.25 * 9 / 4 = 2.81


def test_nobody_within_the_bound_falls_back_to_the_ring_owner(make_cluster, make_ctx):
    # KubeAI chwblGetAddr returns the first endpoint of the walk (its defaultEndpoint);
    # SMG prefix_hash "all workers overloaded, use initial worker anyway"
    c = make_cluster(2)
    ctx = next(x for x in (make_ctx(_chain(k)) for k in range(50)) if _owner(c, x) == "n1")
    c.load("n0", inflight=1)
    c.load("n1", inflight=1)  # 2 > 1.25 * 3 / 2 for both
    d = _place(ConsistentHashPolicy(), c, ctx)
    assert d.reason is RouteReason.FALLBACK and d.node_id == "n1"


def test_light_load_keeps_the_key_on_its_owner(make_cluster, make_ctx):
    # 8 nodes, 2 in flight: even an idle owner fails 0 + 1 <= 1.25 * 3 / 8, so does
    # everyone; the key must stay on its owner, not go to the lowest idle slot
    c = make_cluster(8)
    ctx = next(x for x in (make_ctx(_chain(k)) for k in range(50)) if _owner(c, x) == "n5")
    c.load("n2", inflight=2)
    d = _place(ConsistentHashPolicy(), c, ctx)
    assert d.node_id == "n5"


def test_no_full_block_falls_back_to_least_inflight(make_cluster, make_ctx):
    c = make_cluster(3)
    c.load("n0", inflight=2)
    d = _place(ConsistentHashPolicy(), c, make_ctx((), prompt_tokens=30))
    assert d.reason is RouteReason.FALLBACK and d.node_id == "n1"
    assert d.parts["no_key"] == 1.0


def test_losing_a_node_moves_only_its_keys(make_cluster, make_ctx):
    c = make_cluster(5)
    p = ConsistentHashPolicy()
    ctxs = [make_ctx(_chain(k)) for k in range(1000)]
    before = [_place(p, c, x).node_id for x in ctxs]
    survivors = c.candidates("n0", "n1", "n3", "n4")
    excluded = [_place(p, c, x, survivors).node_id for x in ctxs]
    moved = sum(a != b for a, b in zip(before, excluded, strict=True))
    assert all(b == a for a, b in zip(before, excluded, strict=True) if a != "n2")
    assert "n2" not in excluded
    assert 0.12 < moved / 1000 < 0.30  # ~1/5
    c.table.remove(c["n2"].node_id)  # membership change: ring rebuilt without n2
    removed = [_place(p, c, x).node_id for x in ctxs]
    assert removed == excluded


def test_adding_a_node_takes_keys_only_for_itself(make_cluster, make_ctx):
    c = make_cluster(5)
    p = ConsistentHashPolicy()
    ctxs = [make_ctx(_chain(k)) for k in range(1000)]
    before = [_place(p, c, x).node_id for x in ctxs]
    c.add("n5")
    after = [_place(p, c, x).node_id for x in ctxs]
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == "n5" for _, b in changed)
    assert 0.10 < len(changed) / 1000 < 0.26  # ~1/6


def test_model_is_part_of_the_key(make_ctx):
    p = ConsistentHashPolicy()
    assert p.key(make_ctx(_chain(1), model="a")) != p.key(make_ctx(_chain(1), model="b"))


def test_defaults_and_validation():
    p = ConsistentHashPolicy()
    assert (p.prefix_tokens, p.virtual_nodes, p.load_factor) == (256, 256, 1.25)
    with pytest.raises(ConfigError):
        ConsistentHashPolicy(load_factor=0.9)
    with pytest.raises(ConfigError):
        ConsistentHashPolicy(virtual_nodes=0)
