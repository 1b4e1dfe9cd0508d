"""Second-stage admission at the node (design brief 4.3).

Theory of operation
-------------------
The gateway routes on a stale snapshot, so the node makes the final call from
its real-time state when a request arrives:

1. ACCEPTED straight into the scheduler's waiting queue when
       running < max_num_seqs  and  kv usage < kv_accept  and  waiting <= waiting_accept
   and no queued request of the same or better priority is ahead of it
   (a newcomer never overtakes its own class). Under the "priority" policy
   "waiting" counts only waiting requests of the same or better priority
   (the scheduler serves those first), and the KV condition is waived when a
   running request of strictly worse priority exists (the scheduler may
   preempt it to make room).
2. QUEUED otherwise, in a bounded admission queue (`queue_max` requests in
   all) with one FIFO per priority value, lower value dequeued first. Entries
   move to the scheduler when rule 1 holds for them; an entry still queued
   `queue_ttl_s` after it arrived is dropped and reported as REJECTED /
   RETRY_ELSEWHERE, so the gateway may retry it on another node (no work has
   started on it).
   When the queue is full, a newcomer that outranks its lowest-priority class
   displaces that class's newest entry (reported as a TTL drop is, REJECTED /
   RETRY_ELSEWHERE) and is QUEUED: the bound holds, and a flood of low-priority
   requests cannot shut out a high-priority one.
3. REJECTED when the queue is full and the newcomer displaces nobody:
   POOL_OVERLOADED if kv usage >= kv_overload (memory-saturated: the cluster
   budget is over-committed, retrying elsewhere only spreads the overload),
   RETRY_ELSEWHERE otherwise.

Requests longer than the model allows are REJECTED as BAD_REQUEST (never
retryable). Defaults: kv_accept 0.8 and kv_overload 0.95 leave the last 5 % of
the pool as headroom for decode growth, waiting_accept 4 keeps a short local
queue so the batch never starves, queue_max 64 / queue_ttl_s 10 s bound the
wait a gateway can be made to endure before it tries elsewhere.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvgate.core.finite import require_finite
from kvgate.protocol.node_reject import RejectKind

__all__ = [
    "AdmissionQueue",
    "AdmissionStatus",
    "NodeAdmission",
    "NodeAdmissionConfig",
    "NodeLoad",
    "RejectKind",
    "decide_admission",
]

T = TypeVar("T")


class AdmissionStatus(enum.Enum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeAdmissionConfig:
    """Thresholds of second-stage admission (defaults documented above)."""

    kv_accept: float = 0.8
    waiting_accept: int = 4
    kv_overload: float = 0.95
    queue_max: int = 64
    queue_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        require_finite(self, "NodeAdmissionConfig")  # before the range checks: NaN passes them
        if not 0.0 <= self.kv_accept <= self.kv_overload <= 1.0:
            raise ValueError("need 0 <= kv_accept <= kv_overload <= 1")
        if self.waiting_accept < 0 or self.queue_max < 0 or self.queue_ttl_s <= 0:
            raise ValueError("waiting_accept, queue_max >= 0 and queue_ttl_s > 0 required")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeAdmission:
    """The node's answer to one submission."""

    status: AdmissionStatus
    reject_kind: RejectKind | None = None
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return self.status is AdmissionStatus.ACCEPTED

    @property
    def queued(self) -> bool:
        return self.status is AdmissionStatus.QUEUED

    @property
    def rejected(self) -> bool:
        return self.status is AdmissionStatus.REJECTED

    @classmethod
    def reject(cls, kind: RejectKind, reason: str) -> NodeAdmission:
        return cls(status=AdmissionStatus.REJECTED, reject_kind=kind, reason=reason)


ACCEPTED = NodeAdmission(status=AdmissionStatus.ACCEPTED)
QUEUED = NodeAdmission(status=AdmissionStatus.QUEUED)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLoad:
    """The real-time facts rules 1-3 need, seen from one request's priority."""

    num_running: int
    max_num_seqs: int
    kv_usage: float
    num_waiting_ahead: int  # waiting requests the scheduler would serve before it
    num_queued_ahead: int  # admission-queue entries of the same or better priority
    can_preempt: bool  # "priority" policy and a running request of worse priority
    can_displace: bool  # an admission-queue entry of worse priority (rule 2)


def can_enter_scheduler(cfg: NodeAdmissionConfig, load: NodeLoad) -> bool:
    """Rule 1 without the fairness clause (used to drain the queue too)."""
    kv_ok = load.kv_usage < cfg.kv_accept or load.can_preempt
    return (
        load.num_running < load.max_num_seqs
        and kv_ok
        and load.num_waiting_ahead <= cfg.waiting_accept
    )


def decide_admission(cfg: NodeAdmissionConfig, load: NodeLoad, num_queued: int) -> NodeAdmission:
    """Rules 1-3 for a new arrival; `num_queued` is the admission queue's length.

    QUEUED with the queue full means the caller displaces an entry (rule 2)."""
    if load.num_queued_ahead == 0 and can_enter_scheduler(cfg, load):
        return ACCEPTED
    if num_queued < cfg.queue_max or load.can_displace:
        return QUEUED
    if load.kv_usage >= cfg.kv_overload:
        return NodeAdmission.reject(
            RejectKind.POOL_OVERLOADED,
            f"KV cache {load.kv_usage:.0%} full and admission queue full ({num_queued})",
        )
    return NodeAdmission.reject(
        RejectKind.RETRY_ELSEWHERE, f"admission queue full ({num_queued} requests)"
    )


@dataclass(slots=True)
class _Entry(Generic[T]):
    item: T
    queued_at: float


@dataclass(slots=True)
class AdmissionQueue(Generic[T]):
    """One FIFO per priority value; lower value first; TTL per entry.

    Items are identified by `key` strings so a queued request can be aborted.
    """

    ttl_s: float
    _fifos: dict[int, deque[tuple[str, _Entry[T]]]] = field(default_factory=dict)
    _where: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def push(self, key: str, priority: int, item: T, now: float) -> None:
        if key in self._where:
            raise ValueError(f"{key!r} is already queued")
        self._fifos.setdefault(priority, deque()).append((key, _Entry(item, now)))
        self._where[key] = priority

    def num_at_or_better(self, priority: int) -> int:
        return sum(len(q) for p, q in self._fifos.items() if p <= priority)

    def worst_priority(self) -> int | None:
        """The largest priority value queued (the class displaced first), if any."""
        return max(self._fifos, default=None)

    def peek(self) -> tuple[int, T] | None:
        """(priority, item) of the entry that would be dequeued next."""
        if not self._fifos:
            return None
        priority = min(self._fifos)
        return priority, self._fifos[priority][0][1].item

    def pop(self) -> T:
        return self._take(min(self._fifos), oldest=True)

    def displace(self) -> T:
        """Remove and return the newest entry of the worst priority class (the one
        that has waited least among those served last)."""
        return self._take(max(self._fifos), oldest=False)

    def _take(self, priority: int, *, oldest: bool) -> T:
        fifo = self._fifos[priority]
        key, entry = fifo.popleft() if oldest else fifo.pop()
        if not fifo:
            del self._fifos[priority]
        del self._where[key]
        return entry.item

    def remove(self, key: str) -> T | None:
        priority = self._where.pop(key, None)
        if priority is None:
            return None
        fifo = self._fifos[priority]
        for index, (entry_key, entry) in enumerate(fifo):
            if entry_key == key:
                del fifo[index]
                if not fifo:
                    del self._fifos[priority]
                return entry.item
        raise AssertionError(f"{key!r} indexed but not queued")  # pragma: no cover

    def expire(self, now: float) -> list[T]:
        """Remove and return entries queued for ttl_s or longer, by priority then age."""
        expired: list[T] = []
        for priority in sorted(self._fifos):
            fifo = self._fifos[priority]
            while fifo and fifo[0][1].queued_at + self.ttl_s <= now:
                key, entry = fifo.popleft()
                del self._where[key]
                expired.append(entry.item)
            if not fifo:
                del self._fifos[priority]
        return expired

    def next_expiry(self) -> float | None:
        heads = [fifo[0][1].queued_at + self.ttl_s for fifo in self._fifos.values()]
        return min(heads) if heads else None

    def items(self) -> Iterator[T]:
        for priority in sorted(self._fifos):
            for _, entry in self._fifos[priority]:
                yield entry.item

    def clear(self) -> list[T]:
        items = list(self.items())
        self._fifos.clear()
        self._where.clear()
        return items
