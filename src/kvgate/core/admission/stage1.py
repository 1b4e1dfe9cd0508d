"""Stage-1 admission at one gateway: the limiter, its queues and its quota book.

``admit`` decides in microseconds from local state only, in this order:

1. bypass lane: never queued; draws from the bypass pool carved out of C, rejected
   OVERLOADED only when that pool is exhausted;
2. validation: prompt over max_seq_len -> INVALID_REQUEST (never queued);
3. the tenant's global concurrency quota (slots = in flight + queued here, against
   the tenant's lease) -> TENANT_QUOTA with a Retry-After; while the lease is live
   and its entry for the tenant is missing or below the quota, a request over it is
   parked instead (Queued, holding no slot, at most the quota's worth) until the
   grant the early refresh brings, then checked again (``GatewayAdmission`` settles);
4. the credit check, against the lease and the class rule (then the cluster breaker,
   -> BREAKER_OPEN: a half-open one's probes go only to requests admitted now):

   - P0 may use any free credit;
   - P1 may use any free credit except P0's unlendable reserve not yet used by P0
     (a class limit binds only when the gateway's total is in use: Netflix work
     conservation), but while the SLO loop holds P1 back (ceiling < 1) only its own
     grant;
   - P2 only its own grant (which the coordinator gives from idle capacity only) and
     never P0's reserve; when P0 outgrows its reserve while P2 holds credits beyond a
     grant that shrank, the controller reclaims them (``p2_to_reclaim``);

   -> Admitted, else Queued (P2 in SAFE mode: DEGRADED; BREAKER_OPEN while it refuses).

``release`` frees the credit and dispatches queued requests that now fit: highest
class first, round-robin across tenants inside a class. ``GatewayAdmission.poll``
handles queue deadlines, lease-state transitions and evictions, and dispatches when
capacity grew.

A queued request holds its tenant slot (the quota bounds a tenant's concurrent
requests, waiting or running), but no class credit.
"""

from __future__ import annotations

import math

from kvgate.core.admission.breaker import ClusterBreaker
from kvgate.core.admission.config import AdmissionConfig
from kvgate.core.admission.pressed import PressedTenants
from kvgate.core.admission.queues import FairQueue, QueueEntry
from kvgate.core.admission.quota_book import QuotaBook
from kvgate.core.admission.slo import TtftWindow
from kvgate.core.admission.types import (
    ESTIMATE_SLACK,
    PRIORITIES,
    AdmissionRequest,
    Admitted,
    BreakerState,
    Priority,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    admitted,
    make_rejection,
)
from kvgate.core.errors import InvariantViolation
from kvgate.core.rng import Rng

_CLOSED = BreakerState.CLOSED


class Stage1Limiter:
    """The limiter and its queues; :class:`GatewayAdmission` adds leases and views."""

    __slots__ = (
        "_admitted",
        "_awaiting",
        "_book",
        "_breaker",
        "_bypass_admitted",
        "_bypass_inuse",
        "_bypass_limit",
        "_caps",
        "_default_quota",
        "_degraded",
        "_has",
        "_inuse",
        "_inuse_total",
        "_live",
        "_next_transition",
        "_pending",
        "_queued_total",
        "_queues",
        "_quotas",
        "_reject_from",
        "_rejected",
        "_reported_active",
        "_reserve",
        "_serial",
        "_tenant_denied",
        "_tenant_idle_since",
        "_tenant_limits",
        "_tenant_slots",
        "_tenant_unseen",
        "_timeouts",
        "_total",
        "_ttft",
        "config",
        "gateway_id",
        "pressed",
    )

    def __init__(self, config: AdmissionConfig, gateway_id: str, *, rng: Rng | None = None):
        self.config = config
        self.gateway_id = gateway_id
        self._book = QuotaBook(config, rng)
        self._breaker = ClusterBreaker(config.breaker)
        self._ttft = TtftWindow.for_slo(config.slo)
        self._queues = tuple(FairQueue(c.queue_limit) for c in config.classes)
        # per class: requests their tenant's lease does not cover yet, awaiting a grant
        self._awaiting = tuple(FairQueue(c.queue_limit) for c in config.classes)
        self._timeouts = tuple(c.queue_timeout_s for c in config.classes)
        self._quotas = dict(config.tenant_quotas)  # a dict: faster than the read-only proxy
        self._default_quota = config.default_tenant_quota
        self._inuse = [0, 0, 0]
        self._inuse_total = 0
        self._bypass_inuse = 0
        self._queued_total = 0
        self._tenant_slots: dict[str, int] = {}
        self._tenant_limits: dict[str, int] = {}
        self._tenant_denied: dict[str, int] = {}
        # quota tenants holding a lease here with nothing in use or asked: since when
        self._tenant_idle_since: dict[str, float] = {}
        self.pressed = PressedTenants()  # refused while holding a fair share of the quota
        self._tenant_unseen = False
        self._reported_active: set[str] = set()
        self._live: set[int] = set()
        self._serial = 0
        self._admitted = [0, 0, 0]
        self._bypass_admitted = 0
        self._rejected: dict[tuple[RejectReason, Priority], int] = {}
        self._pending: list[Rejected] = []
        self._total = 0
        self._caps = [0, 0, 0]
        self._reserve = 0
        self._bypass_limit = 0
        self._has = (0, 0, 0)
        self._reject_from = 3  # the first class rejected DEGRADED, not queued (3: none)
        self._degraded = True
        self._next_transition = math.inf
        self._apply_limits()

    # ================================================================= hot path
    def admit(self, req: AdmissionRequest, now: float) -> Admitted | Queued | Rejected:
        if req.bypass:
            return self._admit_bypass(req)
        mx = req.max_seq_len
        if req.prompt_tokens < 0 or (
            mx is not None
            and req.prompt_tokens > (mx * ESTIMATE_SLACK if req.prompt_estimated else mx)
        ):
            return self._reject(
                req,
                RejectReason.INVALID_REQUEST,
                _too_long(req.prompt_tokens, req.output_tokens, mx, req.prompt_estimated),
                0.0,
            )
        tenant = req.tenant
        quota = self._quotas.get(tenant, self._default_quota)
        if quota is not None:
            limit = self._tenant_limits.get(tenant)
            if limit is None:
                limit = self._unseen_tenant(quota)
            slots = self._tenant_slots.get(tenant, 0)
            if slots >= limit:
                grows = limit < quota and self._book.asks_coordinator  # a live lease may grow
                if grows and slots + sum(q.depth(tenant) for q in self._awaiting) < quota:
                    # ask the coordinator first: admitting it unasked could put the fleet
                    # over the quota while other gateways hold it; refusing it would refuse
                    # a tenant whose lease is only catching up with its demand
                    return self._enqueue(req, now, parked=True)
                return self._refuse_tenant(req, quota, limit, now)
        return self._admit_credit(req, now)

    def _admit_credit(self, req: AdmissionRequest, now: float) -> Admitted | Queued | Rejected:
        """The credit check, then the breaker (the tenant's quota has let it through)."""
        if now >= self._next_transition:
            self._advance(now)
        c = req.priority
        tenant = req.tenant
        # it fits, and nobody of its class or better is queued (a P1 overtook a queued P0
        # after a rise)
        if self._fits(c) and not (
            self._queued_total and any(q.size for q in self._queues[: c + 1])
        ):
            if self._breaker.state is not _CLOSED and not self._breaker.allow(now):
                return self._breaker_open(req, now)
            self._serial = serial = self._serial + 1
            self._live.add(serial)
            self._inuse[c] += 1
            self._inuse_total += 1
            slots = self._tenant_slots
            slots[tenant] = slots.get(tenant, 0) + 1
            self._admitted[c] += 1
            return admitted(req.request_id, tenant, c, "class", serial)
        if c >= self._reject_from:
            return self._reject(
                req, RejectReason.DEGRADED, _off(c), self.config.safe_mode.retry_after_s
            )
        if self._breaker.state is not _CLOSED and self._breaker.refusing(now):
            return self._breaker_open(req, now)  # refused now rather than queued for it
        return self._enqueue(req, now)

    def _breaker_open(self, req: AdmissionRequest, now: float) -> Rejected:
        b = self._breaker
        return self._reject(req, RejectReason.BREAKER_OPEN, f"cluster breaker open ({b.reason})",
                            b.retry_after(now))

    def release(self, ticket: Ticket, now: float) -> list[Admitted]:
        """Give the ticket's credit back; returns queued requests admitted with it."""
        try:
            self._live.remove(ticket.serial)
        except KeyError:
            raise InvariantViolation(
                f"ticket {ticket.request_id!r} released twice or not from this gateway"
            ) from None
        if ticket.lane == "bypass":
            self._bypass_inuse -= 1
            return []
        self._inuse[ticket.priority] -= 1
        self._inuse_total -= 1
        self._drop_slot(ticket.tenant)
        if self._queued_total:
            return self._dispatch(now)
        return []

    # ================================================================= slow paths
    def _admit_bypass(self, req: AdmissionRequest) -> Admitted | Rejected:
        if self._bypass_inuse >= self._bypass_limit:
            return self._reject(req, RejectReason.OVERLOADED, "bypass pool exhausted", 1.0)
        self._serial = serial = self._serial + 1
        self._live.add(serial)
        self._bypass_inuse += 1
        self._bypass_admitted += 1
        return admitted(req.request_id, req.tenant, req.priority, "bypass", serial)

    def _reject(
        self,
        req: AdmissionRequest,
        reason: RejectReason,
        message: str,
        retry_after_s: float,
    ) -> Rejected:
        key = (reason, req.priority)
        self._rejected[key] = self._rejected.get(key, 0) + 1
        return make_rejection(
            reason, message, request_id=req.request_id, retry_after_s=retry_after_s
        )

    def _unseen_tenant(self, quota: int) -> int:
        if self._book.asks_coordinator:
            self._tenant_unseen = True  # ask the coordinator soon (early refresh)
        return self._book.tenant_fallback(quota)

    def _refuse_tenant(self, req: AdmissionRequest, quota: int, limit: int, now: float) -> Rejected:
        tenant = req.tenant
        self._tenant_denied[tenant] = self._tenant_denied.get(tenant, 0) + 1
        if limit >= max(1, self._book.tenant_fair_share(quota)):
            self.pressed.note(tenant, now)  # more than its quota, not a growing lease
        return self._reject(
            req,
            RejectReason.TENANT_QUOTA,
            f"tenant {tenant!r} is at its concurrency quota ({quota})",
            self.config.tenant_retry_after_s,
        )

    def _drop_slot(self, tenant: str) -> None:
        slots = self._tenant_slots
        n = slots[tenant] - 1
        if n:
            slots[tenant] = n
        else:
            del slots[tenant]

    def _queue_deadline(self, req: AdmissionRequest, now: float) -> float:
        """Its class's queue timeout from now, or the client's own deadline if sooner."""
        deadline = now + self._timeouts[req.priority]
        return deadline if req.deadline is None or req.deadline >= deadline else req.deadline

    def _enqueue(
        self, req: AdmissionRequest, now: float, *, parked: bool = False
    ) -> Queued | Rejected:
        """Queue ``req`` in its class's queue, holding a tenant slot; or, ``parked``, in
        its class's awaiting queue, holding none (its tenant's lease here does not cover
        it yet: no entry, or one below the quota), until the grant the early refresh
        brings. Only the class queue evicts to make room."""
        c = req.priority
        q = (self._awaiting if parked else self._queues)[c]
        deadline = self._queue_deadline(req, now)
        if deadline <= now:
            return self._reject(req, RejectReason.QUEUE_TIMEOUT, "deadline already passed", 1.0)
        if q.size >= q.limit:
            victim = None if parked else q.victim_for(req.tenant)
            if victim is None:
                return self._reject(
                    req, RejectReason.QUEUE_FULL, f"P{int(c)} queue full ({q.limit})", 1.0
                )
            q.evict(victim)
            self._pending.append(
                self._forget(victim, RejectReason.QUEUE_FULL, "evicted: queue full", 1.0)
            )
        q.push(req, now, deadline)
        self._queued_total += 1
        if not parked:
            self._tenant_slots[req.tenant] = self._tenant_slots.get(req.tenant, 0) + 1
        return Queued(request_id=req.request_id, deadline=deadline, priority=c)

    def _forget(
        self,
        entry: QueueEntry,
        reason: RejectReason,
        message: str,
        retry_after_s: float,
        *,
        slot: bool = True,
    ) -> Rejected:
        """A queued entry leaves without a credit: free its tenant slot (a parked one
        holds none), say why."""
        self._queued_total -= 1
        if slot:
            self._drop_slot(entry.request.tenant)
        return self._reject(entry.request, reason, message, retry_after_s)

    def _fits(self, c: int) -> bool:
        total = self._inuse_total
        if total >= self._total or self._inuse[c] >= self._caps[c]:
            return False
        return c == 0 or self._total - total - 1 >= self._reserve - self._inuse[0]

    def _dispatch(self, now: float) -> list[Admitted]:
        if now >= self._next_transition:
            self._advance(now)
        out: list[Admitted] = []
        breaker = self._breaker
        for c in PRIORITIES:
            q = self._queues[c]
            while q.size and self._fits(c):
                if breaker.state is not _CLOSED and not breaker.allow(now):
                    return out
                entry = q.pop_next()
                if entry is None:  # pragma: no cover - size and entries agree
                    break
                self._queued_total -= 1
                req = entry.request
                self._serial = serial = self._serial + 1
                self._live.add(serial)
                self._inuse[c] += 1
                self._inuse_total += 1
                self._admitted[c] += 1
                out.append(admitted(req.request_id, req.tenant, c, "class", serial))
        return out

    def _advance(self, now: float) -> None:
        if self._book.advance(now):
            self._apply_limits()
        self._next_transition = self._book.next_transition

    def _apply_limits(self) -> None:
        lim = self._book.limits()
        self._total = lim.total
        self._caps = list(lim.caps)
        self._reserve = lim.p0_reserve
        self._bypass_limit = lim.bypass
        self._has = lim.has
        self._reject_from = lim.reject_from
        self._degraded = lim.degraded
        self._next_transition = self._book.next_transition
        # zeros too: the grant names the tenants in use anywhere in the fleet, and one
        # at 0 here is not new (a first-sight allowance would put the fleet over)
        self._tenant_limits = dict(self._book.tenant_limits())
        for c in range(lim.reject_from, len(self._queues)):  # the classes now refused
            if self._queues[c].size:
                retry_s = self.config.safe_mode.retry_after_s
                self._pending.extend(self._forget(e, RejectReason.DEGRADED, _off(c), retry_s)
                                     for e in self._queues[c].drain())


def _off(c: int) -> str:
    """Why class ``c`` is refused while the gateway runs degraded."""
    if c == 2:
        return "P2 is off while the gateway runs in safe mode"
    return f"P{c} is off until the gateway reaches its coordinator"


def _too_long(total: int, output: int, max_seq_len: int | None, estimated: bool) -> str:
    """The context-length rejection, naming both parts so the client knows which to cut."""
    if total < 0:
        return f"a request of {total} tokens is invalid"
    about = "about " if estimated else ""
    return (
        f"this request needs {about}{total} tokens ({about}{total - output} of prompt + "
        f"{output} of max_tokens), more than the {max_seq_len} a serving node accepts; "
        "shorten the prompt or lower max_tokens"
    )
