"""Bulk eviction with pre-announcement (design brief: cache invalidation notice).

Theory of operation
-------------------
Normal LRU churn is lazy and silent apart from `BlockRemoved`: a cached-free
block is evicted only when an allocation reuses it (see block_pool.py). A
*bulk* eviction is discretionary: a forced flush, a memory-pressure purge, an
injected mass eviction. `BulkEvictor.evict(fraction, now, reason)` picks up to
ceil(fraction * num_blocks) cached-free blocks in LRU order (blocks in use are
never chosen) and then:

* if the announcement is enabled (`announce_lead_s` is not None) and the
  discretionary evictions of the last `bulk_window_s` (this one included)
  exceed `bulk_fraction` of the pool, it is a bulk eviction: it queues
  `EvictionAnnounced(starts_at=now + announce_lead_s, done_by=...)` at once,
  then evicts the chosen blocks in batches of ceil(batch_fraction * num_blocks)
  every `batch_interval_s` from `starts_at`, one `BlockRemoved` per batch, and
  finally `EvictionDone`. Gateways thus get `announce_lead_s` to move traffic
  away before any block is lost, and the loss is smoothed over time;
* otherwise (small trims, or announcements disabled for comparison) the same
  blocks are evicted at once, one `BlockRemoved`, with no announcement.

A chosen block that is in use or reused by the time its batch runs is
skipped (it is no longer cold); `EvictionDone` reports the real count.
Batches run when the engine is stepped at or after their time; an idle
engine's driver asks `next_due()` when to step it. A crash or a cache reset
drops pending plans: `clear()` emits each one's `EvictionDone` (the eviction is
over, everything is gone), before the pool's `AllBlocksCleared`, so a gateway
that only follows the notices never waits for a done that will not come.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvgate.core.finite import require_finite
from kvgate.engine.block_pool import BlockPool
from kvgate.engine.kv_events import EvictionAnnounced, EvictionDone

__all__ = ["BulkEvictor", "EvictionConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionConfig:
    """Bulk-eviction settings.

    Attributes:
        announce_lead_s: notice given before the first batch (brief: "a few
            seconds"); None disables announcements (evict at once).
        batch_fraction: share of the pool evicted per batch (5 %).
        batch_interval_s: time between batches (0.5 s).
        bulk_fraction: discretionary evictions above this share of the pool
            within `bulk_window_s` count as bulk and are announced (10 % / 1 s).
        bulk_window_s: the window of that threshold.
    """

    announce_lead_s: float | None = 2.0
    batch_fraction: float = 0.05
    batch_interval_s: float = 0.5
    bulk_fraction: float = 0.10
    bulk_window_s: float = 1.0

    def __post_init__(self) -> None:
        require_finite(self, "EvictionConfig")  # before the range checks: NaN passes them
        if self.announce_lead_s is not None and self.announce_lead_s < 0:
            raise ValueError("announce_lead_s must be >= 0 or None")
        if not 0 < self.batch_fraction <= 1 or self.batch_interval_s < 0:
            raise ValueError("need 0 < batch_fraction <= 1 and batch_interval_s >= 0")
        if not 0 <= self.bulk_fraction <= 1 or self.bulk_window_s < 0:
            raise ValueError("need 0 <= bulk_fraction <= 1 and bulk_window_s >= 0")


@dataclass(slots=True)
class _Plan:
    targets: list[tuple[int, int]]  # (block_id, block_hash) in LRU order
    next_at: float
    cursor: int = 0
    num_evicted: int = 0


@dataclass(slots=True)
class BulkEvictor:
    """Plans and paces bulk evictions on one `BlockPool`."""

    config: EvictionConfig
    pool: BlockPool
    _plans: list[_Plan] = field(default_factory=list)
    _planned: set[int] = field(default_factory=set)  # block ids in pending plans
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    @property
    def batch_blocks(self) -> int:
        return max(1, math.ceil(self.config.batch_fraction * self.pool.num_blocks))

    @property
    def pending(self) -> bool:
        return bool(self._plans)

    def evict(self, fraction: float, now: float, reason: str) -> int:
        """Evict (or announce and schedule) up to `fraction` of the pool.

        Returns the number of blocks chosen (0 when nothing is cached-free).
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        return self.evict_blocks(math.ceil(fraction * self.pool.num_blocks), now, reason)

    def evict_blocks(self, limit: int, now: float, reason: str, *, forced: bool = False) -> int:
        """Evict (or announce and schedule) up to `limit` cached-free blocks, least
        recently used first. A `forced` eviction (a flush) is a bulk one whatever its
        size against the bulk threshold: announced when announcements are on."""
        chosen = self.pool.cached_free_blocks(limit, exclude=self._planned)
        if not chosen:
            return 0
        targets = [(b.block_id, b.block_hash) for b in chosen if b.block_hash is not None]
        cfg = self.config
        while self._recent and self._recent[0][0] <= now - cfg.bulk_window_s:
            self._recent.popleft()
        self._recent.append((now, len(targets)))
        recent_total = sum(n for _, n in self._recent)
        lead = cfg.announce_lead_s
        bulk = forced or recent_total > cfg.bulk_fraction * self.pool.num_blocks
        if lead is None or not bulk:
            self.pool.evict_cached(targets)
            return len(targets)
        chosen_hashes = {h for _, h in targets}
        # A segment starts where the parent is not itself being evicted.
        prefixes = tuple(
            b.block_hash
            for b in chosen
            if b.block_hash is not None and b.parent_hash not in chosen_hashes
        )
        num_batches = math.ceil(len(targets) / self.batch_blocks)
        starts_at = now + lead
        self.pool.emit(
            EvictionAnnounced(
                num_blocks=len(targets),
                prefixes=prefixes,
                starts_at=starts_at,
                done_by=starts_at + (num_batches - 1) * cfg.batch_interval_s,
                reason=reason,
            )
        )
        self._plans.append(_Plan(targets=targets, next_at=starts_at))
        self._planned.update(block_id for block_id, _ in targets)
        return len(targets)

    def poll(self, now: float) -> None:
        """Run every batch due at or before `now`; finish completed plans."""
        for plan in list(self._plans):
            while plan.cursor < len(plan.targets) and plan.next_at <= now:
                batch = plan.targets[plan.cursor : plan.cursor + self.batch_blocks]
                plan.num_evicted += len(self.pool.evict_cached(batch))
                plan.cursor += len(batch)
                plan.next_at += self.config.batch_interval_s
                self._planned.difference_update(block_id for block_id, _ in batch)
            if plan.cursor >= len(plan.targets):
                self.pool.emit(EvictionDone(num_blocks_evicted=plan.num_evicted))
                self._plans.remove(plan)

    def next_due(self) -> float | None:
        """Time of the next pending batch, if any."""
        return min((p.next_at for p in self._plans), default=None)

    def clear(self) -> None:
        """Drop pending plans, each ending with its `EvictionDone` (call it before the
        pool is cleared: a plan's done precedes the `AllBlocksCleared` that ends it)."""
        for plan in self._plans:
            # what its batches evicted: the rest goes with the clear, not this plan
            self.pool.emit(EvictionDone(num_blocks_evicted=plan.num_evicted))
        self._plans.clear()
        self._planned.clear()
        self._recent.clear()
