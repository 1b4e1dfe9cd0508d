"""``GatewayAdmission``: the stage-1 limiter plus its lease protocol and views.

The driver's loop around it (gateway, simulator, tests)::

    decision = adm.admit(req, now)          # per request, no I/O
    adm.release(ticket, now)                # when the request ends -> more Admitted
    adm.poll(now)                           # every 10-100 ms -> Admitted / Rejected
    if adm.refresh_due(now):                # periodic, or early when credits run low
        req = adm.make_refresh(now)         # t_sent is taken here, before sending
        try:
            adm.apply_grant(coordinator.refresh(req, now2), now3)  # -> more Admitted
        except CoordinatorUnavailable:
            adm.refresh_failed(now3)

``set_cluster_capacity`` follows node health: C_eff = min(budget, sum of the healthy
nodes' capacities); with no healthy node the breaker opens. The next refresh carries
C_eff to the coordinator, which uses the latest any gateway reported; meanwhile the
gateway shrinks its own limits in proportion at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

from kvgate.core.admission.queues import FairQueue
from kvgate.core.admission.stage1 import Stage1Limiter
from kvgate.core.admission.types import (
    AdmissionStats,
    Admitted,
    BreakerState,
    LeaseGrant,
    LeaseState,
    Priority,
    Queued,
    RefreshRequest,
    Rejected,
    RejectReason,
    TenantUsage,
)
from kvgate.core.errors import InvariantViolation

_CLOSED = BreakerState.CLOSED
# A quota tenant with nothing in use or asked here for this long stops being reported
# (its lease let go): tenants come and go (one per API key), and each one reported
# costs every refresh and the coordinator's shared state. Long enough that a tenant
# pausing between bursts keeps its lease (its next request needs no round trip).
TENANT_IDLE_FORGET_S = 60.0


class GatewayAdmission(Stage1Limiter):
    """One per gateway. Single-threaded: call it from one event loop, no await inside."""

    __slots__ = ()

    def set_cluster_capacity(self, healthy_capacity: int, healthy_nodes: int, now: float) -> None:
        """C_eff = min(budget, healthy capacity); no healthy node opens the breaker."""
        c_eff = max(0, min(self.config.budget, healthy_capacity))
        self._book.set_capacity(c_eff)
        self._breaker.set_no_healthy(healthy_nodes <= 0)
        self._apply_limits()

    def record_outcome(self, success: bool, now: float) -> None:
        self._breaker.record(success, now)

    def record_ignored(self, now: float) -> None:
        """An outcome the breaker must not count (the client's own bad request, a node
        refusing for load)."""
        self._breaker.ignore(now)

    def record_ttft(self, priority: Priority, ttft_s: float, now: float) -> None:
        if priority == Priority.P0:
            self._ttft.add(ttft_s, now)

    # ----------------------------------------------------------------- leases
    def refresh_due(self, now: float) -> bool:
        self._advance(now)
        lc = self.config.lease
        free = self._total - self._inuse_total
        watermark = max(lc.low_watermark_min, math.ceil(lc.low_watermark_fraction * self._total))
        # Early when credits run low, or when anything waits: a queued request needs
        # credits this lease does not hold (P2 is granted only the demand a report
        # showed, so on an idle cluster the first P2 request would otherwise wait a
        # whole period for credits nobody is using). Not for P2 while the SLO
        # controller holds it off (ceiling 0): no refresh can admit it then.
        waiting = self._queued_total
        grant = self._book.grant
        if waiting and grant is not None and grant.ceilings[2] <= 0.0:
            waiting -= self._queues[Priority.P2].size
        pressure = waiting > 0 or (free < watermark and self._inuse_total > 0)
        urgent = self._book.state is LeaseState.NO_ASSIGNMENT or self._tenant_unseen
        return self._book.due(now, pressure=pressure, urgent=urgent)

    def make_refresh(self, now: float) -> RefreshRequest:
        """The report to send now (t_sent is taken here, before sending)."""
        self._advance(now)
        self._book.begin(now)
        tenants: dict[str, TenantUsage] = {}
        active: set[str] = set()
        parked = self._parked_by_tenant()
        keys = self._tenant_limits.keys() | self._tenant_denied.keys() | self._tenant_slots.keys()
        for tenant in keys | parked.keys():
            quota = self._quotas.get(tenant, self._default_quota)
            if quota is None:
                continue
            slots = self._tenant_slots.get(tenant, 0)
            asked = slots + parked.get(tenant, 0) + self._tenant_denied.get(tenant, 0)
            wants = min(quota, asked)
            has = self._tenant_limits.get(tenant, 0)
            if slots or wants:
                self._tenant_idle_since.pop(tenant, None)
            elif has:
                since = self._tenant_idle_since.setdefault(tenant, now)
                if now - since > TENANT_IDLE_FORGET_S:
                    # idle that long: its lease is let go (not reported, so not granted
                    # again; a request of its later asks for one anew): a lease kept
                    # per tenant ever seen grows every refresh, and the shared state
                    del self._tenant_limits[tenant], self._tenant_idle_since[tenant]
                    continue
            else:
                self._tenant_idle_since.pop(tenant, None)
            if slots or wants or has:
                tenants[tenant] = TenantUsage(inuse=slots, wants=wants, has=has)
                if wants:
                    active.add(tenant)
        self._tenant_denied.clear()
        self._tenant_unseen = False
        self._reported_active = active
        window, p99 = self._ttft.last(now)
        inuse = self._inuse
        queued = self._waiting_per_class()
        return RefreshRequest(
            gateway_id=self.gateway_id,
            epoch=self._book.epoch,
            inuse=(inuse[0], inuse[1], inuse[2]),
            wants=(inuse[0] + queued[0], inuse[1] + queued[1], inuse[2] + queued[2]),
            has=self._has,
            has_total=self._total,
            bypass_inuse=self._bypass_inuse,
            bypass_has=self._bypass_limit,
            tenants=tenants,
            c_eff_seen=self._book.c_eff if self._book.c_eff_known else None,
            p0_ttft_p99_s=p99,
            p0_ttft_window=window,
            state_seen=None if self._book.grant is None else self._book.grant.state_serial,
        )

    def apply_grant(self, grant: LeaseGrant, now: float) -> list[Admitted]:
        """A new lease arrived; returns queued requests it admits."""
        if grant.gateway_id != self.gateway_id:
            raise InvariantViolation(
                f"grant for {grant.gateway_id!r} applied to gateway {self.gateway_id!r}"
            )
        self._book.on_grant(grant, now)
        self._apply_limits()
        if not self._queued_total:
            return []
        # the queued first: a parked request settled first took a credit a queued
        # request of a better class was waiting for
        return self._dispatch(now) + self._settle_awaiting(now)

    def refresh_failed(self, now: float) -> None:
        """The coordinator could not be reached; the lease ages toward SAFE."""
        self._book.on_failure(now)
        self._apply_limits()

    # ----------------------------------------------------------------- driver API
    def poll(self, now: float) -> list[Admitted | Rejected]:
        """Queue deadlines, lease transitions, evictions; dispatch if capacity grew."""
        self._advance(now)
        self._breaker.tick(now)
        out: list[Admitted | Rejected] = []
        if self._queued_total and not self._book.asks_coordinator:
            out.extend(self._settle_awaiting(now))  # no coordinator to wait for
        if self._pending:
            out.extend(self._pending)
            self._pending = []
        if self._queued_total:
            for q, slot in self._all_queues():
                for entry in q.expire(now):
                    out.append(
                        self._forget(
                            entry, RejectReason.QUEUE_TIMEOUT, "queue timeout", 1.0, slot=slot
                        )
                    )
            if self._queued_total:
                out.extend(self._dispatch(now))
        return out

    def cancel(self, request_id: str, now: float) -> bool:
        """The client of a queued request went away; True if it was queued here."""
        for q, slot in self._all_queues():
            entry = q.remove(request_id)
            if entry is not None:
                self._queued_total -= 1
                if slot:  # a parked request holds no tenant slot
                    self._drop_slot(entry.request.tenant)
                return True
        return False

    def _all_queues(self) -> list[tuple[FairQueue, bool]]:
        """Every queue, and whether its entries hold a tenant slot (parked ones do not)."""
        return [(q, True) for q in self._queues] + [(q, False) for q in self._awaiting]

    def _waiting_per_class(self) -> list[int]:
        """Requests waiting per class: queued, or parked awaiting a grant."""
        return [q.size + a.size for q, a in zip(self._queues, self._awaiting, strict=True)]

    def p2_to_reclaim(self) -> int:
        """How many P2 requests to end now (``reclaim_p2``), of those holding credits
        beyond P2's cap (the grant shrank as P0 and P1 demand grew; in safe mode the cap
        is 0); none while the breaker is not closed. The more of:

        - for the P0 and P1 requests waiting here: the fewest that let in as many as
          those credits can (none when that would let nobody in: the total shrank below
          what is in use; the credits freed are P0's reserve and only P1 waits; P1 is
          at its own cap);
        - for the P0 and P1 requests waiting at other gateways (the grant says how
          many; an active grant only): as many as this gateway holds beyond its lease,
          up to that many. The coordinator cannot lend them credits this gateway still
          uses, and P2 would keep those for its requests' whole life (minutes of
          decode) while they time out. Another gateway's P2 ends none."""
        over = self._inuse[2] - self._caps[2]
        if over <= 0 or not self.config.reclaim_p2 or self._breaker.state is not _CLOSED:
            return 0
        owed = 0
        grant = self._book.grant
        if self._book.state is LeaseState.ACTIVE and grant is not None:
            beyond = max(0, self._inuse_total - self._total)
            owed = min(over, beyond, grant.waiting_elsewhere)
        most = self._admitted_with(over)
        if most == 0:
            return owed
        lo, hi = 1, over  # the fewest that admit as many (admitted_with grows with k)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._admitted_with(mid) >= most:
                hi = mid
            else:
                lo = mid + 1
        return max(lo, owed)

    def _admitted_with(self, freed: int) -> int:
        """The waiting P0 and P1 requests ``freed`` more free credits would admit (the
        rules of ``_fits``: P0 any free credit, P1 never P0's unused reserve)."""
        free = self._total - self._inuse_total + freed
        p0 = min(self._queues[0].size, max(0, free))
        reserve_left = max(0, self._reserve - self._inuse[0] - p0)
        p1 = min(
            self._queues[1].size,
            max(0, self._caps[1] - self._inuse[1]),
            max(0, free - p0 - reserve_left),
        )
        return p0 + p1

    def count_rejection(self, reason: RejectReason, priority: Priority) -> None:
        """Count a request turned away after stage 1 (routing found no node for it), so
        the rejection counters see every request the gateway refused."""
        key = (reason, priority)
        self._rejected[key] = self._rejected.get(key, 0) + 1

    def _settle_awaiting(self, now: float) -> list[Admitted]:
        """Parked requests the current grant answers (parked before its refresh was sent),
        or all of them once no coordinator is asked, go through the quota and credit
        checks (admitted, queued, or refused to ``_pending``); the others keep waiting.
        A tenant the grant leaves out (the coordinator knows no quota for it) gets an
        even share, as without a coordinator."""
        out: list[Admitted] = []
        book = self._book
        asks, asked_at = book.asks_coordinator, book.asked_at
        full = book.grant.tenant_full if book.grant is not None else frozenset()
        for q in self._awaiting:
            for entry in q.drain():
                req, tenant = entry.request, entry.request.tenant
                quota = self._quotas.get(tenant, self._default_quota)
                limit = None if quota is None else self._tenant_limits.get(tenant)
                if limit is None and quota is not None:  # absent from the grant: an even share
                    limit = book.tenant_fair_share(quota)
                over = limit is not None and self._tenant_slots.get(tenant, 0) >= limit
                # not asked yet, or the quota has room held in other gateways' leases until
                # their next refresh gives it back: wait for a later grant
                if asks and (entry.enqueued_at > asked_at or (over and tenant not in full)):
                    q.push(req, entry.enqueued_at, entry.deadline)
                    continue
                self._queued_total -= 1
                req = replace(req, deadline=entry.deadline)
                if over:
                    assert quota is not None and limit is not None
                    self._pending.append(self._refuse_tenant(req, quota, limit, now))
                    continue
                verdict = self._admit_credit(req, now)
                if isinstance(verdict, Rejected):
                    self._pending.append(verdict)
                elif not isinstance(verdict, Queued):
                    out.append(verdict)
        return out

    # ----------------------------------------------------------------- views
    @property
    def lease_state(self) -> LeaseState:
        return self._book.state

    @property
    def degraded(self) -> bool:
        """True in NO_ASSIGNMENT and SAFE: gate dispatch by node-reported load."""
        return self._degraded

    @property
    def c_eff(self) -> int:
        return self._book.c_eff

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    @property
    def inuse_total(self) -> int:
        return self._inuse_total

    @property
    def bypass_inuse(self) -> int:
        return self._bypass_inuse

    @property
    def queued_total(self) -> int:
        return self._queued_total

    @property
    def lease_total(self) -> int:
        return self._total

    def tenant_slots(self, tenant: str) -> int:
        """The tenant's requests here, in flight plus queued (what its quota bounds)."""
        return self._tenant_slots.get(tenant, 0)

    def tenant_inflight(self) -> Mapping[str, int]:
        queued = _by_tenant(self._queues)
        return {t: n - queued.get(t, 0) for t, n in self._tenant_slots.items()}

    def _parked_by_tenant(self) -> dict[str, int]:
        """Requests waiting for their tenant's first lease entry, per tenant."""
        return _by_tenant(self._awaiting) if self._queued_total else {}

    def stats(self) -> AdmissionStats:
        queued_by_tenant = _by_tenant((*self._queues, *self._awaiting))
        waiting = self._waiting_per_class()
        inuse, adm = self._inuse, self._admitted
        grant = self._book.grant
        return AdmissionStats(
            gateway_id=self.gateway_id,
            lease_state=self._book.state,
            degraded=self._degraded,
            breaker_state=self._breaker.state,
            breaker_reason=self._breaker.reason,
            c_eff=self._book.c_eff,
            lease_total=self._total,
            class_caps=(self._caps[0], self._caps[1], self._caps[2]),
            p0_reserve=self._reserve,
            bypass_limit=self._bypass_limit,
            bypass_inuse=self._bypass_inuse,
            inuse=(inuse[0], inuse[1], inuse[2]),
            inuse_total=self._inuse_total,
            queued=(waiting[0], waiting[1], waiting[2]),
            tenant_inflight=self.tenant_inflight(),
            tenant_queued=queued_by_tenant,
            tenant_limits=dict(self._tenant_limits),
            ceilings=grant.ceilings if grant is not None else (1.0, 1.0, 1.0),
            epoch=self._book.epoch,
            admitted=(adm[0], adm[1], adm[2]),
            bypass_admitted=self._bypass_admitted,
            rejected=dict(self._rejected),
            refreshes=self._book.refreshes,
            refresh_failures=self._book.failures,
        )


def _by_tenant(queues: Iterable[FairQueue]) -> dict[str, int]:
    """Entries per tenant over ``queues``."""
    out: dict[str, int] = {}
    for q in queues:
        for t, n in q.tenant_depths().items():
            out[t] = out.get(t, 0) + n
    return out
