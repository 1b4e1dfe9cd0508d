"""Paged KV block pool with a prefix cache (modelled on vLLM v1 `BlockPool`).

Theory of operation
-------------------
The pool owns `num_blocks` fixed blocks of `block_size` tokens. Each block is
in exactly one of three states:

    used          ref_cnt > 0, not in the free queue (maybe cached)
    cached-free   ref_cnt == 0, in the free queue, has a hash, findable
    blank-free    ref_cnt == 0, in the free queue, no hash

Invariants (checked by `check_invariants`, relied on by the engine):

* num_free_blocks + num_used_blocks == num_blocks, ref_cnt >= 0;
* a block is in the free queue iff its ref_cnt is 0;
* `_cached[h]` is a block whose block_hash is h, and every block with a hash is
  in `_cached` (one physical block per hash: a second request that computes
  the same block keeps its copy uncached, so no duplicate events are needed).

The free queue is an LRU: allocation takes blocks from its head, freeing puts
blocks at its tail. A freed block keeps its hash, so it can still be hit; it
is evicted lazily, only when an allocation takes it (then `BlockRemoved`).
Blank blocks are put at the *head* on free (vLLM puts them at the tail), so
an allocation uses them before it destroys any cached content. Callers free a
request's blocks in reverse order (`free` does this), so the tail of a chain is
evicted before its root and shared roots survive longest.

Allocation returns None when it does not fit; it never raises for lack of
space. Events are queued and drained by `take_events()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["BlockPool", "KVBlock"]


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV block. Only `BlockPool` mutates it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None  # chain parent, kept to describe evictions


class BlockPool:
    """Fixed pool of KV blocks, free LRU queue, hash -> block prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self._block_size = block_size
        self._blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        # OrderedDict keyed by block id: O(1) pop from the head, removal from
        # the middle (a prefix hit on a cached-free block) and moves to either end.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[int, KVBlock] = {}
        self._events: list[KvEvent] = []
        self.num_lazy_evictions = 0  # cached blocks destroyed by reuse (counter)

    # ----------------------------------------------------------------- views
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._blocks) - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks with ref_cnt > 0 (vLLM `kv_cache_usage_perc`)."""
        return self.num_used_blocks / len(self._blocks)

    def block(self, block_id: int) -> KVBlock:
        return self._blocks[block_id]

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first)."""
        return list(self._free)

    def cached_hashes(self) -> dict[int, int]:
        """Snapshot hash -> block id of every cached block (used or free)."""
        return {h: b.block_id for h, b in self._cached.items()}

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    # -------------------------------------------------------------- lookups
    def find_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[KVBlock]:
        """Longest run of `block_hashes` from the start that is cached, at most max_blocks."""
        hits: list[KVBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, num_new: int, reused: Sequence[KVBlock] = ()) -> bool:
        """Whether `num_new` blocks fit after touching `reused` (prefix hits).

        Touching a cached-free hit takes it out of the free queue, so it no
        longer counts as allocatable (vLLM's `num_evictable_computed_blocks`).
        """
        evictable_hits = sum(1 for b in reused if b.ref_cnt == 0)
        return num_new <= len(self._free) - evictable_hits

    # ------------------------------------------------------------ mutations
    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks (removing free ones from the LRU)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take `num_blocks` blocks from the LRU head, or None if they do not fit.

        A cached block taken this way is evicted now: its hash is forgotten and
        one `BlockRemoved` is queued for it (vLLM emits one event per hash).
        """
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        if num_blocks > len(self._free):
            return None
        taken: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._events.append(BlockRemoved(block_hashes=(self._forget(block),)))
                self.num_lazy_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[tuple[int, ...]],
        *,
        root_extra: tuple[str, ...] | None = None,
    ) -> None:
        """Register newly full blocks of one request under their chained hashes.

        `blocks[i]` holds `block_hashes[i]`, the chain continues from
        `parent_hash`, and `token_ids[i]` are the block's tokens (empty tuples
        when unknown). Runs of consecutive blocks become one `BlockStored`. A
        hash that is already cached by another block leaves this block
        uncached and splits the run (the next event names it as parent).
        `root_extra` is the chain's first block's extra key (a cache_salt), when
        `blocks[0]` is that block.
        """
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_extra: tuple[str, ...] | None = None  # the run's first block's, if the root
        run_parent = parent_hash
        parent = parent_hash
        for i, (block, block_hash, tokens) in enumerate(
            zip(blocks, block_hashes, token_ids, strict=True)
        ):
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            if block_hash in self._cached:
                self._flush_run(run_hashes, run_parent, run_tokens, run_extra)
                run_hashes, run_tokens, run_extra = [], [], None
                run_parent = block_hash
            else:
                block.block_hash = block_hash
                block.parent_hash = parent
                self._cached[block_hash] = block
                if i == 0 and parent_hash is None:
                    run_extra = root_extra
                run_hashes.append(block_hash)
                run_tokens.extend(tokens)
            parent = block_hash
        self._flush_run(run_hashes, run_parent, run_tokens, run_extra)

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block, walking `blocks` in reverse.

        `blocks` is a request's block table in prompt order; walking it from
        the end puts the chain's tail nearer the LRU head, so it is evicted
        first. Freed blank blocks go to the head: reusing them costs nothing.
        """
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cached_free_blocks(self, limit: int, exclude: set[int]) -> list[KVBlock]:
        """Up to `limit` cached-free blocks in LRU order, skipping ids in `exclude`."""
        chosen: list[KVBlock] = []
        for block in self._free.values():
            if len(chosen) >= limit:
                break
            if block.block_hash is not None and block.block_id not in exclude:
                chosen.append(block)
        return chosen

    def evict_cached(self, targets: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Evict the `(block_id, block_hash)` targets that are still cached-free.

        A target that is in use, or whose block was reused or evicted since it
        was chosen, is skipped. Emits one `BlockRemoved` for the whole batch.
        Returns the evicted hashes.
        """
        evicted: list[int] = []
        for block_id, block_hash in targets:
            block = self._blocks[block_id]
            if block.ref_cnt > 0 or block.block_hash != block_hash:
                continue
            self._forget(block)
            self._free.move_to_end(block_id, last=False)  # blank now: reuse first
            evicted.append(block_hash)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=tuple(evicted)))
        return tuple(evicted)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM `reset_prefix_cache`).

        Refused (returns False) while any block is in use, as in vLLM.
        """
        if self.num_used_blocks:
            return False
        self._clear()
        return True

    def clear_all(self) -> None:
        """Crash: drop every reference and every hash; queue `AllBlocksCleared`."""
        for block in self._blocks:
            block.ref_cnt = 0
        self._clear()

    def emit(self, event: KvEvent) -> None:
        """Queue an event in order with the pool's own (used by bulk eviction)."""
        self._events.append(event)

    def take_events(self) -> list[KvEvent]:
        """Drain queued events, oldest first."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting described above is broken."""
        for block in self._blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id} free-queue membership is wrong")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} has a hash the cache lost")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"hash {block_hash} maps to a block holding another")

    # -------------------------------------------------------------- private
    def _forget(self, block: KVBlock) -> int:
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        block.block_hash = None
        block.parent_hash = None
        return block_hash

    def _clear(self) -> None:
        for block in self._blocks:
            block.block_hash = None
            block.parent_hash = None
        self._cached.clear()
        self._free = OrderedDict((b.block_id, b) for b in self._blocks)
        self._events.append(AllBlocksCleared())

    def _flush_run(self, hashes: list[int], parent: int | None, tokens: list[int],
                   root_extra: tuple[str, ...] | None = None) -> None:
        if hashes:
            extra = None if root_extra is None else (root_extra, *([None] * (len(hashes) - 1)))
            self._events.append(
                BlockStored(
                    block_hashes=tuple(hashes),
                    parent_block_hash=parent,
                    token_ids=tuple(tokens),
                    block_size=self._block_size,
                    extra_keys=extra,
                )
            )
