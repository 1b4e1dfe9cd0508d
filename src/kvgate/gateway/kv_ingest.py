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

* **Copies**: vLLM does not de-duplicate its cache: two requests computing the same
  block in one step each cache a copy, with a ``BlockStored`` each, and each copy's
  eviction sends its own ``BlockRemoved``; a block leaves with its last copy.
* **Data-parallel ranks** (``data_parallel_rank``) keep their own caches (each rank
  publishes on its own endpoint, with its own sequence): a key leaves the node's
  index only when no rank holds it any more, and ``AllBlocksCleared`` or a restart of
  one rank drops only what that rank alone held.
* **Extra keys**: a block whose ``extra_keys`` name more than its tokens (a
  ``cache_salt``, multimodal inputs) is not keyed (``extra_keys_blocks``): by its
  tokens it would be a false hit for the plain prompt; its descendants are orphans.
* **Orphans**: a ``BlockStored`` whose parent we never saw (the gateway started
  after the engine, or missed events) cannot be keyed: its blocks, and their
  descendants, are skipped (``orphan_blocks``). The index then knows those
  prefixes only from routing (its speculative entries) until the engine stores them
  anew. The engine's own block size must equal the hasher's (``block_size``
  events of another size are skipped), and only the GPU pool counts (a CPU
  offload tier is not a prefix-cache hit for the router: ``other_medium``); of a
  hybrid model's KV cache groups only group 0 is followed.
* **Sequence** (per rank): a batch numbered past the next expected one means batches
  were lost (``missed_batches``; the index may hold a block the engine dropped until
  its TTL ends it); a number at or below the last one means a new publisher (the
  engine restarted, with an empty cache): what it held is dropped first (the whole
  node when it is the node's only publisher).
* **Memory** is bounded: at most ``max_blocks`` engine hashes are remembered per
  node, over all its ranks (the node's oldest forgotten first, whichever rank stored
  it; a removal of a forgotten block then leaves the index to its LRU and TTL). The
  watcher sets it from the node's cache size (``kv_watch.remembered_blocks``): a lost
  batch's removals are never heard, so its blocks stay remembered until this bound
  pushes them out.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
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

DEFAULT_MAX_BLOCKS = 1 << 20  # engine hashes remembered per node (~210 bytes each)
UNKEYABLE = -1  # the "key" of a block its tokens do not name (our keys are unsigned)


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

    __slots__ = ("_entries", "_hasher", "_holders", "_last_seq", "_max_blocks", "counts")

    def __init__(self, hasher: TokenBlockHasher, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self._hasher = hasher
        self._max_blocks = max_blocks
        # (data-parallel rank, engine hash) -> [our key, copies], the node's oldest first
        # (one order for every rank: the bound forgets the node's oldest, in O(1)). vLLM
        # does not de-duplicate: two requests computing the same block in one step cache
        # a copy each, each with its BlockStored, and each copy's eviction sends its own
        # BlockRemoved.
        self._entries: OrderedDict[tuple[int | None, BlockHash], list[int]] = OrderedDict()
        self._holders: Counter[int] = Counter()  # our key -> ranks holding it
        self._last_seq: dict[int | None, int] = {}  # per rank: each publishes its own
        self.counts: Counter[str] = Counter()

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    @max_blocks.setter
    def max_blocks(self, value: int) -> None:
        """A new bound (the node's cache size changed); a lower one forgets the oldest
        hashes now."""
        if value < 1:
            raise ValueError("max_blocks must be >= 1")
        self._max_blocks = value
        self._bound()

    @property
    def remembered(self) -> int:
        return len(self._entries)

    def feed(self, seq: int, batch: KVEventBatch, model: str) -> list[IndexOp]:
        """The index operations batch ``seq`` implies, in order. ``model`` names the
        root of a sequence that is not a LoRA adapter's (the node's base model)."""
        ops: list[IndexOp] = []
        rank = batch.data_parallel_rank
        last = self._last_seq.get(rank)
        if last is not None:
            if seq <= last:  # a new publisher: that rank's engine restarted, empty
                self.counts["restarts"] += 1
                ops += self._restart(rank)
            elif seq > last + 1:
                self.counts["missed_batches"] += seq - last - 1
        self._last_seq[rank] = seq
        self.counts["batches"] += 1
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
                ops += self._clear_rank(rank)
        return ops

    def reset(self) -> list[IndexOp]:
        """Forget everything (a new engine process): the node's index is cleared."""
        self._last_seq.clear()
        return self._forget_all()

    def _forget_all(self) -> list[IndexOp]:
        self._entries.clear()
        self._holders.clear()
        return [IndexCleared()]

    def _only_publisher(self, rank: int | None) -> bool:
        return set(self._last_seq) <= {rank}

    def _restart(self, rank: int | None) -> list[IndexOp]:
        if self._only_publisher(rank):  # the node's only publisher: clear it all
            return self.reset()
        return self._drop_rank(rank)

    def _clear_rank(self, rank: int | None) -> list[IndexOp]:
        """``AllBlocksCleared`` from ``rank``: from the node's only publisher the node's
        whole index is cleared, with what routing taught it and its guesses (the keys
        remembered here are not all it holds); from one rank of several, what that rank
        alone held."""
        if self._only_publisher(rank):
            return self._forget_all()
        return self._drop_rank(rank)

    def _drop_rank(self, rank: int | None) -> list[IndexOp]:
        """Every copy ``rank`` holds is gone; the keys no other rank holds."""
        held = [h for (r, h), entry in self._entries.items() if r == rank for _ in range(entry[1])]
        gone = self._drop(rank, held) if held else ()
        return [IndexRemoved(gone)] if gone else []

    def _stored(self, ev: BlockStored, rank: int | None, model: str) -> tuple[int, ...]:
        hashes = ev.block_hashes
        if not _followed(ev.medium, ev.group_idx):
            self.counts["other_medium"] += 1
            return ()
        size = self._hasher.block_size
        if ev.block_size != size or len(ev.token_ids) != len(hashes) * size:
            self.counts["bad_block_size"] += len(hashes)
            return ()
        parent: int | None = None
        if ev.parent_block_hash is not None:
            entry = self._entries.get((rank, ev.parent_block_hash))
            if entry is None:
                self.counts["orphan_blocks"] += len(hashes)
                return ()
            parent = entry[0]
        if parent == UNKEYABLE or _names_more_than_tokens(ev.extra.get("extra_keys"),
                                                          ev.lora_name):
            # a cache_salt or multimodal inputs (or a block continuing one): the tokens
            # alone do not name the KV, and keyed by them it would be a false hit for
            # the plain prompt. Remembered as such, so its continuations are not taken
            # for orphans (which would make routing teach the index, kv_watch.py).
            self.counts["extra_keys_blocks"] += len(hashes)
            self._remember(rank, hashes, [UNKEYABLE] * len(hashes))
            return ()
        root = model
        if ev.lora_id is not None:
            lora = ev.lora_name
            if lora is None:  # an adapter we cannot name: its keys would be wrong
                self.counts["unnamed_lora_blocks"] += len(hashes)
                return ()
            root = lora
        keys = self._hasher.chain_for_tokens(ev.token_ids, parent=parent, model=root)
        self._remember(rank, hashes, keys)
        self.counts["stored_blocks"] += len(keys)
        return tuple(keys)

    def _remember(
        self, rank: int | None, hashes: Sequence[BlockHash], keys: Sequence[int]
    ) -> None:
        """``hashes`` (one more copy each) name ``keys`` on ``rank``; within the bound."""
        entries = self._entries
        for h, key in zip(hashes, keys, strict=True):
            entry = entries.get((rank, h))
            if entry is not None and entry[0] == key:
                entry[1] += 1  # another copy of a block this rank holds
                continue
            if entry is not None and entry[0] != UNKEYABLE:  # other tokens: replaced
                self._release(entry[0])
            entries[(rank, h)] = [key, 1]
            if key != UNKEYABLE:
                self._holders[key] += 1
        self._bound()

    def _drop(self, rank: int | None, hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """One copy of each of ``hashes`` of ``rank`` is gone; the keys no rank holds
        any more."""
        entries = self._entries
        gone: list[int] = []
        for h in hashes:
            entry = entries.get((rank, h))
            if entry is None:
                self.counts["unknown_removed"] += 1
                continue
            entry[1] -= 1
            if entry[1] > 0:  # another copy is still cached
                continue
            del entries[(rank, h)]
            if entry[0] != UNKEYABLE and self._release(entry[0]):
                gone.append(entry[0])
        self.counts["removed_blocks"] += len(gone)
        return tuple(gone)

    def _release(self, key: int) -> bool:
        """One rank fewer holds ``key``; True when none does any more."""
        holders = self._holders
        holders[key] -= 1
        if holders[key] > 0:
            return False
        del holders[key]
        return True

    def _bound(self) -> None:
        """Forget the node's oldest hashes while it is over its bound."""
        entries = self._entries
        excess = len(entries) - self._max_blocks
        if excess <= 0:
            return
        self.counts["forgotten_blocks"] += excess
        for _ in range(excess):
            key = entries.popitem(last=False)[1][0]
            if key != UNKEYABLE:
                self._release(key)


def _names_more_than_tokens(extra: object, lora_name: str | None) -> bool:
    """Whether a ``BlockStored``'s ``extra_keys`` (one entry per block) name more than its
    tokens and its LoRA adapter: a cache salt, multimodal inputs. vLLM (0.33) lists an
    adapter's name first in every block's entry; the adapter is the chain's root here
    already, so that entry alone keys the block by its tokens."""
    if not isinstance(extra, tuple):
        return False
    for keys in extra:
        if keys is None:
            continue
        if lora_name is not None and isinstance(keys, tuple) and keys[:1] == (lora_name,):
            keys = keys[1:]
        if keys:
            return True
    return False


def _followed(medium: str | None, group_idx: int | None) -> bool:
    """The GPU prefix cache (no medium: vLLM before tiers), KV cache group 0."""
    return (medium is None or medium.upper() == "GPU") and not group_idx
