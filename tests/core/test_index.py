"""ClusterIndex on tiny configurations: exact match lengths, LRU order, TTL, speculation."""

from __future__ import annotations

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId
from kvgate.core.index import ClusterIndex

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")


def make(
    cap: int = 8, *, ttl_s: float | None = None, speculative_ttl_s: float = 2.0
) -> ClusterIndex:
    idx = ClusterIndex(ttl_s=ttl_s, speculative_ttl_s=speculative_ttl_s)
    for n in (A, B, C):
        idx.add_node(n, cap)
    return idx


# --- match --------------------------------------------------------------------------------
def test_match_counts_leading_blocks_per_node() -> None:
    idx = make()
    assert idx.insert(A, (1, 2, 3, 4), 0.0) == 4
    assert idx.insert(B, (1, 2), 0.0) == 2
    assert idx.insert(C, (9, 2, 3), 0.0) == 3  # holds 2 and 3 but not the root 1
    assert idx.match((1, 2, 3, 4, 5), 1.0) == {A: 4, B: 2}
    assert idx.match((1, 2, 3), 1.0) == {A: 3, B: 2}
    assert idx.match((1, 7, 3), 1.0) == {A: 1, B: 1}
    assert idx.match((9, 2, 3, 4), 1.0) == {C: 3}
    assert idx.match((2, 3), 1.0) == {A: 2, B: 1, C: 2}


def test_match_misses_and_empty_chain() -> None:
    idx = make()
    idx.insert(A, (1, 2), 0.0)
    assert idx.match((), 0.0) == {}
    assert idx.match((5, 1, 2), 0.0) == {}
    assert idx.match((5,), 0.0) == {}


def test_match_with_nodes_dropping_out_at_different_positions() -> None:
    idx = ClusterIndex(ttl_s=None)
    nodes = [NodeId(f"n{i}") for i in range(70)]  # several bytes of slot bits
    chain = tuple(range(100, 200))
    for i, n in enumerate(nodes):
        idx.add_node(n, 1000)
        idx.insert(n, chain[: i + 1], 0.0)
    expected = {n: i + 1 for i, n in enumerate(nodes)}
    assert idx.match(chain, 0.0) == expected
    # a node with a hole stops at the hole even though it holds later blocks
    idx.remove_blocks(nodes[69], [chain[10]])
    expected[nodes[69]] = 10
    assert idx.match(chain, 0.0) == expected


def test_remove_blocks_in_the_middle_stops_the_match_there() -> None:
    idx = make()
    idx.insert(A, (1, 2, 3, 4, 5), 0.0)
    idx.insert(B, (1, 2, 3, 4, 5), 0.0)
    assert idx.remove_blocks(A, [3, 99, 3]) == 1  # unknown and repeated blocks are ignored
    assert idx.match((1, 2, 3, 4, 5), 0.0) == {A: 2, B: 5}
    assert idx.holders(3) == frozenset({B})
    assert idx.holders(4) == frozenset({A, B})
    assert idx.node_entries(A) == 4


# --- LRU ----------------------------------------------------------------------------------
def test_root_is_evicted_last() -> None:
    idx = make(cap=4)
    idx.insert(A, (1, 2, 3), 0.0)  # LRU order (oldest first): 3, 2, 1
    idx.insert(A, (7, 8), 1.0)  # 3, 2, 1, 8, 7 -> evict 3
    assert idx.match((1, 2, 3), 1.0) == {A: 2}
    assert idx.match((7, 8), 1.0) == {A: 2}
    idx.insert(A, (9,), 2.0)  # evict 2
    assert idx.match((1, 2, 3), 2.0) == {A: 1}
    assert idx.node_entries(A) == 4
    assert idx.evicted_capacity == 2


def test_least_recently_touched_chain_is_evicted_first() -> None:
    idx = make(cap=4)
    idx.insert(A, (1, 2), 0.0)
    idx.insert(A, (3, 4), 1.0)
    idx.insert(A, (1, 2), 2.0)  # touch: (3, 4) is now the least recently used chain
    idx.insert(A, (5, 6), 3.0)
    assert idx.match((3, 4), 3.0) == {}
    assert idx.match((1, 2), 3.0) == {A: 2}
    assert idx.match((5, 6), 3.0) == {A: 2}
    assert idx.holders(3) == frozenset() and idx.holders(4) == frozenset()


def test_chain_longer_than_capacity_keeps_its_root_side() -> None:
    idx = make(cap=4)
    assert idx.insert(A, (1, 2, 3, 4, 5, 6), 0.0) == 6
    assert idx.match((1, 2, 3, 4, 5, 6), 0.0) == {A: 4}
    assert idx.node_entries(A) == 4


def test_capacity_shrink_evicts_at_once_and_zero_capacity_holds_nothing() -> None:
    idx = make(cap=8)
    idx.insert(A, (1, 2, 3, 4, 5, 6), 0.0)
    idx.set_capacity(A, 3)
    assert idx.node_entries(A) == 3
    assert idx.match((1, 2, 3, 4), 0.0) == {A: 3}
    idx.set_capacity(A, 0)
    assert idx.node_entries(A) == 0
    idx.insert(A, (1, 2), 1.0)
    assert idx.match((1, 2), 1.0) == {}
    idx.add_node(A, 5)  # add_node on a known node sets its capacity
    assert idx.capacity(A) == 5
    idx.insert(A, (1, 2), 2.0)
    assert idx.match((1, 2), 2.0) == {A: 2}


def test_insert_returns_only_new_entries() -> None:
    idx = make()
    assert idx.insert(A, (1, 2, 3), 0.0) == 3
    assert idx.insert(A, (1, 2, 3, 4), 1.0) == 1
    assert idx.insert(A, (), 1.0) == 0
    assert idx.num_entries() == 4
    assert idx.num_blocks() == 4


# --- TTL ----------------------------------------------------------------------------------
def test_ttl_counts_from_the_last_touch() -> None:
    idx = make(ttl_s=10.0)
    idx.insert(A, (1, 2, 3), 0.0)
    idx.insert(A, (1, 2), 5.0)
    assert idx.match((1, 2, 3), 9.5) == {A: 3}
    assert idx.match((1, 2, 3), 10.0) == {A: 2}  # block 3 touched at 0 expires at 10
    assert idx.node_entries(A) == 2
    assert idx.match((1, 2, 3), 15.0) == {}
    assert idx.num_entries() == 0
    assert idx.expired_ttl == 3


def test_expiry_is_exact_at_the_boundary() -> None:
    idx = make(ttl_s=10.0)
    idx.insert(A, (1,), 0.0)
    idx.insert(A, (2,), 0.25)
    assert idx.match((1,), 10.0) == {}  # touched at 0: gone at exactly 0 + 10
    assert idx.match((2,), 10.0) == {A: 1}  # touched at 0.25: live until 10.25
    assert idx.match((2,), 10.25) == {}


def test_expire_drops_past_ttl_and_reports_the_count() -> None:
    idx = make(ttl_s=10.0)
    idx.insert(A, (1, 2), 0.0)
    idx.insert(B, (1, 2, 3), 4.0)
    assert idx.expire(9.0) == 0
    assert idx.expire(10.0) == 2
    assert idx.holders(1) == frozenset({B})
    assert idx.expire(14.0) == 3
    assert idx.num_entries() == 0 and idx.num_blocks() == 0
    idx.insert(A, (1,), 20.0)  # an emptied node is scheduled again
    assert idx.expire(29.0) == 0
    assert idx.expire(30.0) == 1


def test_no_ttl_keeps_entries() -> None:
    idx = make(ttl_s=None)
    idx.insert(A, (1, 2), 0.0)
    assert idx.match((1, 2), 1e9) == {A: 2}
    assert idx.expire(1e9) == 0


# --- speculative entries ------------------------------------------------------------------
def test_speculative_entries_expire_unless_confirmed() -> None:
    idx = make(ttl_s=600.0, speculative_ttl_s=2.0)
    assert idx.insert(A, (1, 2, 3), 0.0, speculative=True) == 3
    assert idx.speculative_entries(A) == 3
    assert idx.match((1, 2, 3), 1.9) == {A: 3}
    idx.insert(A, (1, 2), 1.0)  # the engine's BlockStored confirms the first two blocks
    assert not idx.is_speculative(A, 1) and idx.is_speculative(A, 3)
    assert idx.match((1, 2, 3), 2.0) == {A: 2}
    assert idx.expired_speculative == 1
    assert idx.match((1, 2, 3), 500.0) == {A: 2}


def test_speculative_touch_refreshes_a_guess_but_never_unconfirms() -> None:
    idx = make(speculative_ttl_s=2.0)
    idx.insert(A, (1,), 0.0)
    idx.insert(A, (1, 2), 1.0, speculative=True)  # 1 stays confirmed, 2 is a guess
    assert not idx.is_speculative(A, 1) and idx.is_speculative(A, 2)
    idx.insert(A, (1, 2), 2.5, speculative=True)  # routed there again: guess refreshed
    assert idx.match((1, 2), 4.4) == {A: 2}
    assert idx.match((1, 2), 4.5) == {A: 1}
    assert idx.match((1, 2), 1e6) == {A: 1}


def test_refreshed_guess_moves_behind_younger_guesses() -> None:
    idx = make(speculative_ttl_s=2.0)
    idx.insert(A, (1,), 0.0, speculative=True)
    idx.insert(A, (2,), 0.5, speculative=True)
    idx.insert(A, (1,), 1.0, speculative=True)  # deadline 3.0, now behind 2's 2.5
    assert idx.match((2,), 2.5) == {}
    assert idx.match((1,), 2.5) == {A: 1}
    assert idx.expired_speculative == 1


def test_speculative_entries_count_towards_capacity() -> None:
    idx = make(cap=2)
    idx.insert(A, (1, 2), 0.0)  # LRU: 2, 1
    idx.insert(A, (7,), 0.5, speculative=True)  # 2, 1, 7 -> evict 2
    assert idx.match((1, 2), 0.5) == {A: 1}
    assert idx.match((7,), 0.5) == {A: 1}
    idx.insert(A, (8,), 0.6)  # evicts 1, then 7 is the oldest
    idx.insert(A, (9,), 0.7)  # evicts the guess 7
    assert idx.speculative_entries(A) == 0
    assert idx.match((7,), 0.7) == {}
    assert idx.expire(10.0) == 0  # nothing left to expire


def test_remove_blocks_and_clear_drop_speculative_marks() -> None:
    idx = make()
    idx.insert(A, (1, 2, 3), 0.0, speculative=True)
    idx.remove_blocks(A, [2])
    assert idx.speculative_entries(A) == 2
    idx.clear_node(A)
    assert idx.speculative_entries(A) == 0
    assert idx.expire(5.0) == 0


def test_forget_oldest_drops_the_least_recently_touched_entries() -> None:
    """An announced eviction said only how many blocks went: the node's LRU front goes."""
    idx = make()
    idx.insert(A, (1, 2), 0.0)  # touched last to first: 2 is the older of the two
    idx.insert(A, (5, 6, 7), 1.0)
    idx.insert(B, (1, 2), 1.0)
    idx.insert(A, (1,), 2.0)  # the root again: now the most recent
    assert idx.forget_oldest(A, 2) == 2  # 2, then 7 (the tail of the chain of t=1)
    assert idx.match((1, 2), 3.0) == {A: 1, B: 2}
    assert idx.match((5, 6, 7), 3.0) == {A: 2}
    assert idx.forget_oldest(A, 99) == 3 and idx.node_entries(A) == 0
    assert idx.forget_oldest(A, 1) == 0 and idx.forget_oldest(NodeId("x"), 1) == 0
    assert idx.forget_oldest(B, 0) == 0 and idx.match((1, 2), 3.0) == {B: 2}


# --- membership ---------------------------------------------------------------------------
def test_clear_node_drops_everything_but_keeps_the_node() -> None:
    idx = make()
    idx.insert(A, (1, 2, 3), 0.0)
    idx.insert(B, (1, 2), 0.0)
    assert idx.clear_node(A) == 3
    assert idx.has_node(A) and idx.capacity(A) == 8
    assert idx.match((1, 2, 3), 0.0) == {B: 2}
    assert idx.holders(3) == frozenset()
    idx.insert(A, (1,), 1.0)
    assert idx.match((1, 2), 1.0) == {A: 1, B: 2}


def test_remove_node_forgets_it_and_reuses_its_slot() -> None:
    idx = make(ttl_s=10.0)
    idx.insert(A, (1, 2, 3), 0.0)
    idx.insert(B, (1, 2), 0.0)
    idx.remove_node(A)
    assert not idx.has_node(A)
    assert idx.nodes() == [B, C]
    assert idx.match((1, 2, 3), 0.0) == {B: 2}
    d = NodeId("d")
    idx.add_node(d, 4)  # takes A's slot and starts empty
    assert idx.match((1, 2, 3), 0.0) == {B: 2}
    idx.insert(d, (1, 2, 3), 1.0)
    assert idx.match((1, 2, 3), 1.0) == {B: 2, d: 3}
    assert idx.expire(10.0) == 2  # B's entries; A's stale schedule is ignored
    assert idx.expire(11.0) == 3


def test_unknown_nodes_and_bad_config() -> None:
    idx = make()
    ghost = NodeId("ghost")
    assert idx.insert(ghost, (1,), 0.0) == 0
    assert idx.remove_blocks(ghost, [1]) == 0
    assert idx.clear_node(ghost) == 0
    idx.remove_node(ghost)
    assert idx.node_entries(ghost) == 0
    with pytest.raises(KeyError):
        idx.set_capacity(ghost, 3)
    with pytest.raises(ConfigError):
        idx.add_node(NodeId("x"), -1)
    with pytest.raises(ConfigError):
        ClusterIndex(ttl_s=0.0)
    with pytest.raises(ConfigError):
        ClusterIndex(speculative_ttl_s=-1.0)
