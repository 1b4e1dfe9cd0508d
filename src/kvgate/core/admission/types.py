"""The values stage-1 admission speaks in: requests, tickets, decisions, lease messages.

Backpressure is a value. ``GatewayAdmission.admit`` answers :class:`Admitted`,
:class:`Queued` or :class:`Rejected`; it raises only for bad configuration or bugs.

Reject reasons, their HTTP status and whether the client may retry on its own
(``retryable_by_client`` False makes the gateway send ``x-should-retry: false``):

==================  ======  =========  ==============================================
reason              status  retryable  meaning
==================  ======  =========  ==============================================
INVALID_REQUEST     400     no         prompt over max_seq_len (never queued)
TENANT_QUOTA        429     no         the tenant's global concurrency quota is used up
BREAKER_OPEN        503     yes        the cluster breaker is open (errors, no node)
QUEUE_FULL          503     yes        the class queue is full: the gateway is
                                       overloaded, not the caller (so 503, not 429)
QUEUE_TIMEOUT       429     no         waited in the queue past its deadline
OVERLOADED          503     no         no capacity at all: bypass pool exhausted,
                                       no node can take it (pool overloaded)
DEGRADED            503     yes        P2 is off while the coordinator is lost (SAFE)
==================  ======  =========  ==============================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, Literal, TypeAlias

from kvgate.core.errors import KvgateError


class Priority(IntEnum):
    """Request class; P0 is the most important."""

    P0 = 0
    P1 = 1
    P2 = 2


NUM_CLASSES = 3
PRIORITIES: tuple[Priority, Priority, Priority] = (Priority.P0, Priority.P1, Priority.P2)

Lane = Literal["bypass", "class"]
Triple: TypeAlias = tuple[int, int, int]


class RejectReason(StrEnum):
    INVALID_REQUEST = "invalid_request"
    TENANT_QUOTA = "tenant_quota"
    BREAKER_OPEN = "breaker_open"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    OVERLOADED = "overloaded"
    DEGRADED = "degraded"
    PREEMPTED = "preempted"  # a P2 request ended to give P0 / P1 back what it borrowed
    SHUTTING_DOWN = "shutting_down"  # the gateway is stopping: another one may take it


REJECT_HTTP_STATUS: Mapping[RejectReason, int] = {
    RejectReason.INVALID_REQUEST: 400,
    RejectReason.TENANT_QUOTA: 429,
    RejectReason.BREAKER_OPEN: 503,
    RejectReason.QUEUE_FULL: 503,
    RejectReason.QUEUE_TIMEOUT: 429,
    RejectReason.OVERLOADED: 503,
    RejectReason.DEGRADED: 503,
    RejectReason.PREEMPTED: 503,
    RejectReason.SHUTTING_DOWN: 503,
}

REJECT_RETRYABLE: Mapping[RejectReason, bool] = {
    RejectReason.INVALID_REQUEST: False,
    RejectReason.TENANT_QUOTA: False,
    RejectReason.BREAKER_OPEN: True,
    RejectReason.QUEUE_FULL: True,
    RejectReason.QUEUE_TIMEOUT: False,
    RejectReason.OVERLOADED: False,
    RejectReason.DEGRADED: True,
    RejectReason.PREEMPTED: True,
    RejectReason.SHUTTING_DOWN: True,
}


class LeaseState(StrEnum):
    """Envoy RLQS names for the quota book's states."""

    NO_ASSIGNMENT = "no_assignment"  # start-up: P0 only, C / expected gateways
    ACTIVE = "active"  # a lease inside its local deadline
    EXPIRED_REUSING = "expired_reusing"  # past the deadline, reusing the last lease briefly
    SAFE = "safe"  # coordinator lost: min(last lease, C / gateways), P2 off, degraded


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CoordinatorUnavailable(KvgateError):
    """The coordinator (Redis, or a fake) could not be reached; the book degrades."""

    http_status = 503


# ----------------------------------------------------------------------------- requests


# A prompt counted from its characters (4 a token) is refused only past the longest
# context by this much: prose of long words runs to 5 characters a token, so a prompt
# that fits would read up to ~25 % too long; a borderline one goes on, and the node,
# which counts exactly, refuses it if it must.
ESTIMATE_SLACK = 1.25


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionRequest:
    """What stage 1 needs to know about a request (nothing about its prompt text)."""

    request_id: str
    tenant: str
    priority: Priority
    bypass: bool = False  # authenticated probe / operator traffic: the bypass lane
    prompt_tokens: int  # prompt plus requested output, as the driver estimates it
    output_tokens: int = 0  # the requested output part of prompt_tokens (for messages)
    max_seq_len: int | None = None  # the longest context any serving node accepts
    # the prompt's count is an estimate (characters / 4): refused only when well over
    prompt_estimated: bool = False
    deadline: float | None = None  # the client's own deadline (monotonic), caps the queue wait


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """The credit an admitted request holds until ``release``; retries reuse it."""

    request_id: str
    tenant: str
    priority: Priority
    lane: Lane
    serial: int  # unique per gateway; release checks it, so a double release is caught


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    ticket: Ticket


@dataclass(frozen=True, slots=True, kw_only=True)
class Queued:
    request_id: str
    deadline: float  # monotonic; past it the request is rejected with QUEUE_TIMEOUT
    priority: Priority = Priority.P1


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    request_id: str = ""
    reason: RejectReason
    retry_after_s: float
    http_status: int
    message: str
    retryable_by_client: bool


Decision: TypeAlias = Admitted | Queued | Rejected

# Hot-path constructors. A frozen dataclass's generated __init__ sets each field with
# object.__setattr__(self, "name", value), about half the cost of an admit; writing
# the slots through their descriptors builds the very same objects in half the time.
_new = object.__new__


def _slot_setter(cls: type, name: str) -> Callable[[object, Any], None]:
    setter: Callable[[object, Any], None] = getattr(cls, name).__set__
    return setter


_set_request_id = _slot_setter(Ticket, "request_id")
_set_tenant = _slot_setter(Ticket, "tenant")
_set_priority = _slot_setter(Ticket, "priority")
_set_lane = _slot_setter(Ticket, "lane")
_set_serial = _slot_setter(Ticket, "serial")
_set_ticket = _slot_setter(Admitted, "ticket")


def admitted(request_id: str, tenant: str, priority: Priority, lane: Lane, serial: int) -> Admitted:
    """``Admitted(ticket=Ticket(...))``, built without the frozen-init overhead."""
    ticket = _new(Ticket)
    _set_request_id(ticket, request_id)
    _set_tenant(ticket, tenant)
    _set_priority(ticket, priority)
    _set_lane(ticket, lane)
    _set_serial(ticket, serial)
    out = _new(Admitted)
    _set_ticket(out, ticket)
    return out


def make_rejection(
    reason: RejectReason, message: str, *, request_id: str = "", retry_after_s: float = 1.0
) -> Rejected:
    """A :class:`Rejected` with the status and retryability of ``reason`` (see table)."""
    return Rejected(
        request_id=request_id,
        reason=reason,
        retry_after_s=retry_after_s,
        http_status=REJECT_HTTP_STATUS[reason],
        message=message,
        retryable_by_client=REJECT_RETRYABLE[reason],
    )


def overloaded_rejection(
    message: str, *, request_id: str = "", retry_after_s: float = 1.0
) -> Rejected:
    """OVERLOADED (503, do not retry): no capacity or no node can take the request."""
    return make_rejection(
        RejectReason.OVERLOADED, message, request_id=request_id, retry_after_s=retry_after_s
    )


def shutting_down_rejection(request_id: str = "") -> Rejected:
    """SHUTTING_DOWN (503, retry): the gateway stops; another one may take the request."""
    return make_rejection(
        RejectReason.SHUTTING_DOWN, "The gateway is shutting down; retry the request.",
        request_id=request_id,
    )


# ----------------------------------------------------------------------------- leases


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantUsage:
    """One tenant's line in a refresh: slots in use (in flight + queued), wants, lease."""

    inuse: int
    wants: int
    has: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RefreshRequest:
    """A gateway's report; per-class tuples are indexed by :class:`Priority`.

    ``has`` is the lease the gateway admits against while this refresh is in flight;
    the coordinator counts it as held too (see ``coordinator.py``).
    """

    gateway_id: str
    epoch: str | None  # the coordinator epoch of the last grant; None before the first
    inuse: Triple
    wants: Triple  # inuse + queued per class
    has: Triple  # the per-class grant in use now
    has_total: int  # the whole class lease in use now (grants + headroom)
    bypass_inuse: int = 0
    bypass_has: int = 0
    tenants: Mapping[str, TenantUsage] = field(default_factory=dict)
    c_eff_seen: int | None = None  # min(budget, healthy capacity) as this gateway sees it
    p0_ttft_p99_s: float | None = None  # of the last complete window; None = no data
    p0_ttft_window: int = -1  # index of that window (so it is counted once)
    # the state's serial in the last grant of ``epoch``: a store holding an older one
    # was rolled back (a failover to a lagging replica, a restart from a snapshot)
    state_seen: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseGrant:
    """The coordinator's answer: a lease of credits valid for ``ttl_s``.

    The class lease is ``sum(grants) + headroom``. ``grants[c]`` is class c's share of
    the demand; ``headroom`` is idle capacity lent to this gateway (P0 and P1 may use
    it, P2 only its own grant); ``p0_reserve`` (part of ``grants[0]``) is P0's
    unlendable burst room that P1 and P2 must leave free.
    """

    gateway_id: str
    grants: Triple
    headroom: int = 0
    p0_reserve: int = 0
    bypass: int = 0
    tenant_grants: Mapping[str, int] = field(default_factory=dict)
    # reported tenants whose quota the fleet's requests fill (in flight or queued at
    # the gateways): a request its lease does not cover is refused, not kept waiting
    tenant_full: frozenset[str] = frozenset()
    ttl_s: float
    refresh_s: float
    safe_capacity: int  # class capacity / live gateways: the SAFE-mode ceiling
    capacity: int  # the C_eff this grant was computed from
    ceilings: tuple[float, float, float] = (1.0, 1.0, 1.0)
    epoch: str
    gateways_live: int
    learning: bool = False  # granted by echo (after lost coordinator state)
    # P0 and P1 requests queued at the other live gateways when granted: what P2 this
    # gateway holds beyond its grant keeps waiting (``p2_to_reclaim``)
    waiting_elsewhere: int = 0
    state_serial: int = 0  # the coordinator state's refresh count after this grant

    @property
    def total(self) -> int:
        return self.grants[0] + self.grants[1] + self.grants[2] + self.headroom


# ----------------------------------------------------------------------------- stats


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionStats:
    """A snapshot for metrics; tuples are indexed by :class:`Priority`."""

    gateway_id: str
    lease_state: LeaseState
    degraded: bool
    breaker_state: BreakerState
    breaker_reason: str
    c_eff: int
    lease_total: int  # credits this gateway may have in flight now (class lanes)
    class_caps: Triple  # per-class ceiling inside the lease (P0 = total)
    p0_reserve: int
    bypass_limit: int
    bypass_inuse: int
    inuse: Triple
    inuse_total: int
    queued: Triple
    tenant_inflight: Mapping[str, int]
    tenant_queued: Mapping[str, int]
    tenant_limits: Mapping[str, int]
    ceilings: tuple[float, float, float]
    epoch: str | None
    admitted: Triple  # admits by class since start (immediate and from the queue)
    bypass_admitted: int
    rejected: Mapping[tuple[RejectReason, Priority], int]
    refreshes: int
    refresh_failures: int
