"""One bounded queue per priority class, fair across tenants inside it.

- **Round robin over tenants** (APF fair queuing without the shuffle sharding):
  each tenant with waiting requests has its own FIFO; ``pop_next`` serves the
  tenants in turn, so a tenant with 1000 queued requests and one with 1 alternate.
- **Deadlines**: every entry has one (now + class timeout, or the client's own
  deadline if sooner); ``expire`` returns the entries past it, earliest first.
- **Full queue**: the youngest request of the tenant with the most queued is the one
  rejected (APF rejects the youngest). If the arriving request's tenant is that
  tenant (or ties it), the arrival itself is rejected; otherwise the other
  tenant's youngest entry is evicted to make room, so a flood cannot lock out a
  quiet tenant.

Removals mark an entry done; done entries leave a tenant's FIFO when they reach its
head, and a FIFO or the rotation holding more than about twice its live entries is
rebuilt, so a class nobody serves stays O(live) however many requests give up.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from kvgate.core.admission.types import AdmissionRequest


@dataclass(slots=True)
class QueueEntry:
    request: AdmissionRequest
    enqueued_at: float
    deadline: float
    seq: int
    done: bool = False


class FairQueue:
    __slots__ = (
        "_by_id",
        "_count",
        "_heap",
        "_in_rr",
        "_rr",
        "_seq",
        "_tenants",
        "limit",
        "size",
    )

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._tenants: dict[str, deque[QueueEntry]] = {}
        self._count: dict[str, int] = {}  # live entries per tenant
        self._rr: deque[str] = deque()  # tenants with live entries, in service order
        self._in_rr: set[str] = set()
        self._heap: list[tuple[float, int, QueueEntry]] = []
        self._by_id: dict[str, QueueEntry] = {}
        self._seq = 0

    def __len__(self) -> int:
        return self.size

    # ----------------------------------------------------------------- in
    def victim_for(self, tenant: str) -> QueueEntry | None:
        """When full: the entry to evict for an arrival of ``tenant``, or None = reject it."""
        if self.size == 0:
            return None
        top_tenant, top = max(self._count.items(), key=lambda kv: kv[1])
        if self._count.get(tenant, 0) + 1 >= top:
            return None
        dq = self._tenants[top_tenant]
        while dq and dq[-1].done:
            dq.pop()
        return dq[-1] if dq else None

    def push(self, request: AdmissionRequest, now: float, deadline: float) -> QueueEntry:
        self._seq += 1
        entry = QueueEntry(request=request, enqueued_at=now, deadline=deadline, seq=self._seq)
        tenant = request.tenant
        dq = self._tenants.get(tenant)
        if dq is None:
            dq = self._tenants[tenant] = deque()
        dq.append(entry)
        self._count[tenant] = self._count.get(tenant, 0) + 1
        if tenant not in self._in_rr:
            self._in_rr.add(tenant)
            self._rr.append(tenant)
        heap = self._heap
        if len(heap) > 2 * self.size + 1024:  # compact lazily removed entries
            heap[:] = [item for item in heap if not item[2].done]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, entry.seq, entry))
        self._by_id[request.request_id] = entry
        self.size += 1
        return entry

    # ----------------------------------------------------------------- out
    def pop_next(self) -> QueueEntry | None:
        """The next entry in tenant round-robin order (None when empty)."""
        rr = self._rr
        while rr:
            tenant = rr.popleft()
            dq = self._tenants.get(tenant)
            while dq:
                entry = dq.popleft()
                if entry.done:
                    continue
                self._take(entry)
                if tenant in self._count:
                    self._rr.append(tenant)  # (_take may have rebuilt the rotation)
                else:
                    self._in_rr.discard(tenant)
                return entry
            self._in_rr.discard(tenant)
        return None

    def expire(self, now: float) -> list[QueueEntry]:
        """Entries whose deadline is <= now, earliest deadline first."""
        out: list[QueueEntry] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            if not entry.done:
                self._take(entry)
                out.append(entry)
        return out

    def remove(self, request_id: str) -> QueueEntry | None:
        """Cancel a queued request (client went away); None if it is not queued."""
        entry = self._by_id.get(request_id)
        if entry is None or entry.done:
            return None
        self._take(entry)
        return entry

    def evict(self, entry: QueueEntry) -> None:
        self._take(entry)

    def drain(self) -> list[QueueEntry]:
        """Remove and return every live entry (oldest deadline first)."""
        out = [e for _, _, e in sorted(self._heap) if not e.done]
        for entry in out:
            self._take(entry)
        self._heap.clear()
        self._tenants.clear()
        self._rr.clear()
        self._in_rr.clear()
        return out

    def depth(self, tenant: str) -> int:
        """Live entries of ``tenant``."""
        return self._count.get(tenant, 0)

    def tenant_depths(self) -> dict[str, int]:
        return {t: n for t, n in self._count.items() if n > 0}

    def _take(self, entry: QueueEntry) -> None:
        entry.done = True
        tenant = entry.request.tenant
        n = self._count[tenant] - 1
        if n:
            self._count[tenant] = n
            # Entries that expire or are cancelled are skipped lazily by pop_next, but
            # a class nobody serves (P2 under load) never pops: drop them here so the
            # deque holds O(live) entries, not every request that ever gave up.
            dq = self._tenants[tenant]
            while dq[0].done:
                dq.popleft()
            if len(dq) > 2 * n + 32:
                self._tenants[tenant] = deque(e for e in dq if not e.done)
        else:  # no live entry left: what remains in its deque is done
            del self._count[tenant]
            self._tenants.pop(tenant, None)
            if len(self._rr) > 2 * len(self._count) + 64:
                self._compact_rr()
        self._by_id.pop(entry.request.request_id, None)
        self.size -= 1

    def _compact_rr(self) -> None:
        """Drop the turns of tenants with nothing queued (kept in order otherwise), so
        tenants that come and go while no one is served do not pile up in the rotation."""
        live = self._count
        self._rr = deque(t for t in self._rr if t in live)
        self._in_rr = set(self._rr)
