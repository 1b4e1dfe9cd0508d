"""KV cache events of the simulated engine.

Theory of operation
-------------------
The first three classes mirror vLLM's `vllm/distributed/kv_events.py`
(field names and order as in vLLM 0.11+, the first release with `medium`), so
that `kvgate.protocol` can put them on the wire exactly as vLLM does and the
gateway's precise-mode index cannot tell the simulated engine from vLLM.
Semantics follow vLLM's v1 block pool (research/engine-integration.md 1.4):

* `BlockStored` goes out when a block becomes full and cached, i.e. in the step
  that *schedules* its computation, not when that step finishes. One event
  covers a run of consecutive blocks of one request; `parent_block_hash` is the
  hash of the block before the first one (None for a chain root); `token_ids`
  are the tokens of exactly those blocks (empty when the request carried none).
* A prefix hit emits nothing. Freeing a block emits nothing: the block stays
  cached and findable in the free LRU queue.
* `BlockRemoved` goes out only when a cached block really loses its contents
  (lazy eviction on reuse, or a bulk eviction batch).
* `AllBlocksCleared` goes out on a prefix-cache reset or a crash.

The last two classes are kvgate's own (vLLM has no equivalent): a node about
to evict in bulk announces it first (`EvictionAnnounced`), evicts in small
batches (each a `BlockRemoved`), then says it is done (`EvictionDone`), so
gateways can lower the node's cache weight for the duration (design brief,
"cache invalidation pre-announcement"). An `AllBlocksCleared` ends any pending
announcement.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EvictionAnnounced",
    "EvictionDone",
    "KvEvent",
]

GPU_MEDIUM = "GPU"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks became full and cached (vLLM `BlockStored`)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str = GPU_MEDIUM
    # per block, what names its KV beyond its tokens (vLLM: a cache_salt on a prompt's
    # first block); None: nothing for any block
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Cached blocks were evicted (vLLM `BlockRemoved`)."""

    block_hashes: tuple[int, ...]
    medium: str = GPU_MEDIUM


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """Every cached block is gone (vLLM `AllBlocksCleared`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionAnnounced:
    """A bulk eviction will start at `starts_at` and end by `done_by` (kvgate).

    Attributes:
        num_blocks: blocks chosen for eviction (some may be skipped later if
            they are in use by then).
        prefixes: for each affected chain segment, the hash of its first
            chosen block; a prompt whose chain passes through one of these
            hashes loses its cached prefix from that block on.
        starts_at: time of the first batch (now + announce lead).
        done_by: time of the last batch.
        reason: why, e.g. "flush", "memory-pressure", "fault".
    """

    num_blocks: int
    prefixes: tuple[int, ...]
    starts_at: float
    done_by: float
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionDone:
    """The announced bulk eviction has finished (kvgate)."""

    num_blocks_evicted: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | EvictionAnnounced | EvictionDone
