"""One node's vLLM KV cache events, turned into updates of the cache index (pure).

Theory of operation
-------------------
Precise mode learns where prompts are cached from the engines themselves: each
engine publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in
batches, numbered by a sequence (``protocol/kv_events_wire.py`` decodes them). The
engine's block hashes are opaque ids (vLLM's are SHA-256 or CBOR based, salted per
deployment); the index's keys are ours. So :class:`NodeKvIngest` rebuilds our key of
every stored block from the tokens the event carries: a block's key is the token
hasher's chain step from its parent's key (``TokenBlockHasher.chain_for_tokens``
with ``parent``), the first block of a sequence starts from the model's root, as a
request's chain does. It remembers engine hash -> our key, so a later
``BlockRemoved`` names the keys to drop, and a child names its parent.

Rules, each counted in :attr:`NodeKvIngest.counts` (the gateway's ``/metrics``):

* **Data-parallel ranks** (``data_parallel_rank``) keep their own caches behind one
  API server: a key leaves the node's index only when no rank holds it any more, and
  ``AllBlocksCleared`` of one rank drops only what that rank alone held.
* **Orphans**: a ``BlockStored`` whose parent we never saw (the gateway started
  after the engine, or missed events) cannot be keyed: its blocks, and their
  descendants, are skipped (``orphan_blocks``). The index then knows those
  prefixes only from routing (its speculative entries) until the engine stores them
  anew. The engine's own block size must equal the hasher's (``block_size``
  events of another size are skipped), and only the GPU pool counts (a CPU
  offload tier is not a prefix-cache hit for the router: ``other_medium``); of a
  hybrid model's KV cache groups only group 0 is followed.
* **Sequence**: a batch numbered past the next expected one means batches were lost
  (``missed_batches``; the index may hold a block the engine dropped until its TTL
  or LRU ends it); a number at or below the last one means a new publisher (the
  engine restarted, with an empty cache): the node's index is cleared first.
* **Memory** is bounded: at most ``max_blocks`` engine hashes are remembered per
  node (the oldest forgotten first; a removal of a forgotten block then leaves the
  index to its LRU and TTL).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.core.hashing import TokenBlockHasher
from kvgate.protocol.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

__all__ = ["IndexCleared", "IndexOp", "IndexRemoved", "IndexStored", "NodeKvIngest"]

DEFAULT_MAX_BLOCKS = 1 << 20  # engine hashes remembered per node (about 150 MB at most)


@dataclass(frozen=True, slots=True)
class IndexStored:
    """The node now caches these keys (a chain continuing its first key's parent)."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IndexRemoved:
    """The node no longer caches these keys."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IndexCleared:
    """The node's whole cache is gone (a restarted engine)."""


IndexOp = IndexStored | IndexRemoved | IndexCleared


class NodeKvIngest:
    """Maps one node's KV event batches to index operations; see the module docstring."""

    __slots__ = ("_hasher", "_holders", "_keys", "_last_seq", "_max_blocks", "counts")

    def __init__(self, hasher: TokenBlockHasher, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self._hasher = hasher
        self._max_blocks = max_blocks
        # per data-parallel rank: engine hash -> our key (insertion order: oldest first)
        self._keys: dict[int | None, dict[BlockHash, int]] = {}
        self._holders: Counter[int] = Counter()  # our key -> ranks holding it
        self._last_seq: int | None = None
        self.counts: Counter[str] = Counter()

    @property
    def remembered(self) -> int:
        return sum(len(m) for m in self._keys.values())

    def feed(self, seq: int, batch: KVEventBatch, model: str) -> list[IndexOp]:
        """The index operations batch ``seq`` implies, in order. ``model`` names the
        root of a sequence that is not a LoRA adapter's (the node's base model)."""
        ops: list[IndexOp] = []
        last = self._last_seq
        if last is not None:
            if seq <= last:
                self.counts["restarts"] += 1
                ops += self.reset()
            elif seq > last + 1:
                self.counts["missed_batches"] += seq - last - 1
        self._last_seq = seq
        self.counts["batches"] += 1
        rank = batch.data_parallel_rank
        for event in batch.events:
            if isinstance(event, BlockStored):
                keys = self._stored(event, rank, model)
                if keys:
                    ops.append(IndexStored(keys))
            elif isinstance(event, BlockRemoved):
                if _followed(event.medium, event.group_idx):
                    gone = self._drop(rank, event.block_hashes)
                    if gone:
                        ops.append(IndexRemoved(gone))
                else:
                    self.counts["other_medium"] += 1
            elif isinstance(event, AllBlocksCleared):
                self.counts["cleared"] += 1
                ranks = self._keys.get(rank)
                if ranks:
                    gone = self._drop(rank, list(ranks))
                    if gone:
                        ops.append(IndexRemoved(gone))
        return ops

    def reset(self) -> list[IndexOp]:
        """Forget everything (a new engine process): the node's index is cleared."""
        self._keys.clear()
        self._holders.clear()
        self._last_seq = None
        return [IndexCleared()]

    def _stored(self, ev: BlockStored, rank: int | None, model: str) -> tuple[int, ...]:
        hashes = ev.block_hashes
        if not _followed(ev.medium, ev.group_idx):
            self.counts["other_medium"] += 1
            return ()
        size = self._hasher.block_size
        if ev.block_size != size or len(ev.token_ids) != len(hashes) * size:
            self.counts["bad_block_size"] += len(hashes)
            return ()
        known = self._keys.setdefault(rank, {})
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = known.get(ev.parent_block_hash)
            if parent is None:
                self.counts["orphan_blocks"] += len(hashes)
                return ()
        root = model
        if ev.lora_id is not None:
            lora = ev.lora_name
            if lora is None:  # an adapter we cannot name: its keys would be wrong
                self.counts["unnamed_lora_blocks"] += len(hashes)
                return ()
            root = lora
        keys = self._hasher.chain_for_tokens(ev.token_ids, parent=parent, model=root)
        holders = self._holders
        for h, key in zip(hashes, keys, strict=True):
            old = known.pop(h, None)
            if old is not None:  # stored again without a removal: still one holder
                holders[old] -= 1
                if holders[old] <= 0:
                    del holders[old]
            known[h] = key
            holders[key] += 1
        self.counts["stored_blocks"] += len(keys)
        self._bound(known)
        return tuple(keys)

    def _drop(self, rank: int | None, hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """Forget ``hashes`` of ``rank``; the keys no rank holds any more."""
        known = self._keys.get(rank)
        if not known:
            self.counts["unknown_removed"] += len(hashes)
            return ()
        holders = self._holders
        gone: list[int] = []
        for h in hashes:
            key = known.pop(h, None)
            if key is None:
                self.counts["unknown_removed"] += 1
                continue
            holders[key] -= 1
            if holders[key] <= 0:
                del holders[key]
                gone.append(key)
        self.counts["removed_blocks"] += len(gone)
        return tuple(gone)

    def _bound(self, known: dict[BlockHash, int]) -> None:
        excess = self.remembered - self._max_blocks
        if excess <= 0:
            return
        holders = self._holders
        self.counts["forgotten_blocks"] += excess
        for _ in range(min(excess, len(known))):
            key = known.pop(next(iter(known)))
            holders[key] -= 1
            if holders[key] <= 0:
                del holders[key]


def _followed(medium: str | None, group_idx: int | None) -> bool:
    """The GPU prefix cache (no medium: vLLM before tiers), KV cache group 0."""
    return (medium is None or medium.upper() == "GPU") and not group_idx
