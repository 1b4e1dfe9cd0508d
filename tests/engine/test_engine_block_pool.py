"""BlockPool: ref counts, LRU free queue, lazy eviction, events (tiny pools, exact state)."""

from __future__ import annotations

import pytest

from kvgate.engine import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored


def test_allocate_takes_from_the_head_and_returns_none_when_it_does_not_fit() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.allocate(2) is None  # only one left: no exception, nothing taken
    assert pool.free_block_ids() == [3]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage()) == (1, 3, 0.75)
    assert pool.allocate(0) == []


def test_cache_full_blocks_emits_one_event_per_run_with_parent_and_tokens() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks[:2], [11, 12], None, [(1, 2), (3, 4)])
    pool.cache_full_blocks(blocks[2:], [13], 12, [(5, 6)])
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(11, 12), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2
        ),
        BlockStored(block_hashes=(13,), parent_block_hash=12, token_ids=(5, 6), block_size=2),
    ]
    assert pool.take_events() == []  # drained
    assert pool.cached_hashes() == {11: 0, 12: 1, 13: 2}
    assert pool.block(2).parent_hash == 12


def test_a_duplicate_hash_stays_uncached_and_splits_the_run() -> None:
    pool = BlockPool(num_blocks=6, block_size=1)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert first is not None and second is not None
    pool.cache_full_blocks(first, [1, 2], None, [(), ()])
    pool.take_events()
    # the second request computed the same two blocks, then one of its own
    pool.cache_full_blocks(second, [1, 2, 3], None, [(), (), ()])
    assert pool.take_events() == [
        BlockStored(block_hashes=(3,), parent_block_hash=2, token_ids=(), block_size=1)
    ]
    assert [b.block_hash for b in second] == [None, None, 3]
    assert pool.cached_hashes() == {1: 0, 2: 1, 3: 4}


def test_free_walks_in_reverse_and_keeps_blocks_findable() -> None:
    pool = BlockPool(num_blocks=5, block_size=1)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [7, 8, 9], None, [(), (), ()])
    pool.take_events()
    pool.free(blocks)
    # tail (block 2, hash 9) nearest the head: evicted first; the root last
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert pool.get_cached_block(7) is blocks[0]
    assert pool.take_events() == []  # freeing is not eviction
    with pytest.raises(ValueError):
        pool.free(blocks[:1])  # ref_cnt would go negative


def test_blank_blocks_return_to_the_head_so_cached_ones_survive() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    cached = pool.allocate(1)
    blank = pool.allocate(1)
    assert cached is not None and blank is not None
    pool.cache_full_blocks(cached, [5], None, [()])
    pool.free(cached)
    pool.free(blank)
    assert pool.free_block_ids() == [1, 2, 3, 0]


def test_lazy_eviction_on_reuse_emits_block_removed_per_hash() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [1, 2, 3], None, [(), (), ()])
    pool.free(blocks)
    pool.take_events()
    assert pool.free_block_ids() == [2, 1, 0]
    again = pool.allocate(2)
    assert again is not None and [b.block_id for b in again] == [2, 1]
    assert pool.take_events() == [
        BlockRemoved(block_hashes=(3,)),
        BlockRemoved(block_hashes=(2,)),
    ]
    assert pool.cached_hashes() == {1: 0}
    assert pool.num_lazy_evictions == 2
    pool.check_invariants()


def test_touch_takes_hits_out_of_the_free_queue_and_can_allocate_counts_them() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [1, 2], None, [(), ()])
    pool.free(blocks)
    hits = pool.find_prefix([1, 2, 99], max_blocks=3)
    assert hits == blocks
    assert pool.find_prefix([1, 2], max_blocks=1) == blocks[:1]
    assert pool.can_allocate(2, hits)  # 4 free - 2 hits that touching removes
    assert not pool.can_allocate(3, hits)
    pool.touch(hits)
    pool.touch(hits[:1])
    assert [b.ref_cnt for b in blocks] == [2, 1]
    assert pool.free_block_ids() == [2, 3]
    assert pool.can_allocate(2, hits)  # hits are referenced now: no longer evictable


def test_evict_cached_skips_blocks_in_use_or_reused() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [1, 2, 3], None, [(), (), ()])
    pool.free(blocks[1:])  # block 0 stays in use
    pool.take_events()
    assert [b.block_id for b in pool.cached_free_blocks(5, exclude=set())] == [2, 1]
    assert [b.block_id for b in pool.cached_free_blocks(5, exclude={2})] == [1]
    evicted = pool.evict_cached([(0, 1), (1, 2), (2, 999)])
    assert evicted == (2,)
    assert pool.take_events() == [BlockRemoved(block_hashes=(2,))]
    assert pool.free_block_ids() == [1, 3, 2]  # the evicted block is blank: reuse first
    assert pool.evict_cached([(1, 2)]) == ()
    assert pool.take_events() == []


def test_reset_prefix_cache_refuses_while_in_use_and_clear_all_always_works() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [1, 2], None, [(), ()])
    pool.take_events()
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_hashes() == {}
    again = pool.allocate(3)
    assert again is not None
    pool.cache_full_blocks(again[:1], [4], None, [()])
    pool.clear_all()
    assert (pool.num_free_blocks, pool.cached_hashes()) == (3, {})
    assert pool.free_block_ids() == [0, 1, 2]
    assert pool.take_events()[-1] == AllBlocksCleared()
    pool.check_invariants()


def test_a_salted_chains_first_block_names_its_salt_in_extra_keys() -> None:
    """vLLM puts a request's cache_salt in its first block's extra keys; the events of
    kvgate engine said nothing of it, so a gateway keying blocks by their tokens took a
    salted prompt's blocks for the plain prompt's."""
    pool = BlockPool(num_blocks=6, block_size=2)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks[:2], [11, 12], None, [(1, 2), (3, 4)], root_extra=("s",))
    pool.cache_full_blocks(blocks[2:], [13], 12, [(5, 6)], root_extra=("s",))  # not a root
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and first.extra_keys == (("s",), None)
    assert isinstance(second, BlockStored) and second.extra_keys is None
