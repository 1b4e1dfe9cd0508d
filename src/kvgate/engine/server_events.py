"""The engine's KV events on the wire: vLLM's ZMQ frames and kvgate's eviction log.

Theory of operation
-------------------
`SimEngine.take_events()` yields five kinds of event. The three vLLM kinds are
converted to :mod:`kvgate.protocol`'s values with the field values vLLM's GPU
block pool sets (``medium="GPU"``, ``extra_keys=[None]*n``, ``group_idx=0``,
``kv_cache_spec_kind="full_attention"``) and encoded by
:class:`KvEventEncoder` as vLLM's ``ZmqEventPublisher`` sends them: one
``KVEventBatch`` per engine step that has events, frames ``[topic, seq (8-byte
big-endian, from 0), msgpack payload]``, ``data_parallel_rank`` 0. The "map"
layout is vLLM 0.33's encoding (newest), "array" is vLLM 0.23's (the last
release with array-like events), byte for byte.

kvgate's own `EvictionAnnounced` / `EvictionDone` are not vLLM events and never
go on the ZMQ socket: :class:`EvictionLog` keeps the most recent ones for
``GET /kvgate/evictions?since=N`` (see :meth:`EvictionLog.page`).

Everything here is pure: the shell supplies timestamps and sends the frames.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvgate.engine import kv_events as ek
from kvgate.protocol import AllBlocksCleared as WireAllBlocksCleared
from kvgate.protocol import (
    KVEvent,
    KVEventBatch,
    Layout,
    encode_frames,
    gpu_block_removed,
    gpu_block_stored,
)

__all__ = [
    "LAYOUT_VLLM_VERSION",
    "EvictionLog",
    "KvEventEncoder",
    "binds_endpoint",
    "to_wire_event",
    "to_wire_events",
]

#: The vLLM release whose bytes each layout reproduces.
LAYOUT_VLLM_VERSION: Final[dict[str, str]] = {"map": "0.33.0", "array": "0.23.0"}


def binds_endpoint(endpoint: str) -> bool:
    """vLLM's rule (`ZmqEventPublisher._is_bind_endpoint`): bind, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def to_wire_event(event: ek.KvEvent) -> KVEvent | None:
    """The vLLM wire value of an engine event; None for kvgate's own announcements."""
    if isinstance(event, ek.BlockStored):
        return gpu_block_stored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
            extra_keys=event.extra_keys,
        )
    if isinstance(event, ek.BlockRemoved):
        return gpu_block_removed(event.block_hashes)
    if isinstance(event, ek.AllBlocksCleared):
        return WireAllBlocksCleared()
    return None


def to_wire_events(events: Iterable[ek.KvEvent]) -> list[KVEvent]:
    """The vLLM events among `events`, converted, in engine order."""
    return [w for w in map(to_wire_event, events) if w is not None]


@dataclass(slots=True)
class KvEventEncoder:
    """Numbers and encodes batches as one vLLM publisher (one DP rank) does."""

    topic: str = ""
    layout: Layout = "map"
    data_parallel_rank: int = 0
    seq: int = 0  # of the next batch

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_VLLM_VERSION:
            raise ValueError(f"unknown KV-event layout {self.layout!r}; use 'map' or 'array'")

    @property
    def vllm_version(self) -> str:
        return LAYOUT_VLLM_VERSION[self.layout]

    def encode(self, events: Sequence[KVEvent], ts: float) -> list[bytes]:
        """The three frames of the next batch (seq advances by one)."""
        batch = KVEventBatch(
            ts=ts, events=tuple(events), data_parallel_rank=self.data_parallel_rank
        )
        frames = encode_frames(
            self.topic, self.seq, batch, self.layout, vllm_version=self.vllm_version
        )
        self.seq += 1
        return frames


def _notice_json(
    event: ek.EvictionAnnounced | ek.EvictionDone, block_size: int | None
) -> dict[str, Any]:
    if isinstance(event, ek.EvictionAnnounced):
        return {
            "type": "EvictionAnnounced",
            "num_blocks": event.num_blocks,
            "prefixes": list(event.prefixes),
            "starts_at": event.starts_at,
            "done_by": event.done_by,
            "reason": event.reason,
        }
    done: dict[str, Any] = {"type": "EvictionDone", "num_blocks_evicted": event.num_blocks_evicted}
    if block_size is not None:
        # in tokens too: a gateway keys its index by blocks of its own size
        done["num_tokens_evicted"] = event.num_blocks_evicted * block_size
    return done


@dataclass(slots=True)
class EvictionLog:
    """The last `capacity` eviction notices, numbered from 0, for polling gateways.

    Each entry is ``{"seq", "at", "type", ...}`` with ``at`` the engine time it
    was emitted; `EvictionAnnounced` adds ``num_blocks``, ``prefixes`` (engine
    block hashes: the first evicted block of each affected chain segment),
    ``starts_at``, ``done_by`` (engine time) and ``reason``; `EvictionDone` adds
    ``num_blocks_evicted`` and, with ``block_size`` known, ``num_tokens_evicted``.
    Announcements complete in order, so the number pending is announced minus done.
    """

    capacity: int = 1024
    block_size: int | None = None  # the engine's, for notices in tokens
    _entries: deque[dict[str, Any]] = field(default_factory=deque)
    _next: int = 0
    _announced: int = 0
    _done: int = 0

    def add(self, events: Iterable[ek.KvEvent], at: float) -> None:
        """Record the notices among `events` (emitted at engine time `at`).

        An `AllBlocksCleared` (crash, cache reset) ends every pending plan.
        """
        for event in events:
            if isinstance(event, ek.AllBlocksCleared):
                self._done = self._announced
                continue
            if isinstance(event, ek.EvictionAnnounced):
                self._announced += 1
            elif isinstance(event, ek.EvictionDone):
                self._done += 1
            else:
                continue
            notice = _notice_json(event, self.block_size)
            self._entries.append({"seq": self._next, "at": at, **notice})
            self._next += 1
            if len(self._entries) > self.capacity:
                self._entries.popleft()

    @property
    def pending(self) -> int:
        return self._announced - self._done

    def page(self, since: int, *, now: float, speedup: float, node_id: str) -> dict[str, Any]:
        """``GET /kvgate/evictions?since=N``.

        ``{"node_id", "now", "speedup", "pending", "next", "truncated", "events"}``:
        the entries with ``seq >= since``; ``next`` is the cursor for the next
        poll; ``truncated`` is true when entries at or after ``since`` were
        already dropped. Engine times run ``speedup`` times faster than wall
        time: an eviction starts in ``(starts_at - now) / speedup`` wall seconds.
        """
        oldest = self._entries[0]["seq"] if self._entries else self._next
        return {
            "node_id": node_id,
            "now": now,
            "speedup": speedup,
            "pending": self.pending,
            "next": self._next,
            "truncated": since < oldest,
            "events": [dict(e) for e in self._entries if e["seq"] >= since],
        }
