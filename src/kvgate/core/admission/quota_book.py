"""The quota book: which lease a gateway holds, how long it may trust it, what it allows.

States (Envoy RLQS names)::

    NO_ASSIGNMENT --grant--> ACTIVE --local_deadline--> EXPIRED_REUSING
         ^                     ^  <--------grant-------------|   |
         |                     |                                 | + reuse_timeout_s
      (start)                  +--------------grant---------- SAFE

- NO_ASSIGNMENT (start-up, no grant yet): P0 only, class capacity K / expected
  gateways, degraded. P1 and P2 wait in their queues for the first grant, until a
  refresh fails: then they are rejected DEGRADED (and those queued too). Failed
  refreshes do not move it to SAFE: SAFE's bound comes from a grant (the last lease,
  the gateways it counted), and with none, K / expected_gateways is the only bound
  there is. So a fleet of N gateways must set expected_gateways = N, or, started
  while the coordinator is unreachable, it admits up to N x K.
- ACTIVE: the last grant, until ``local_deadline = t_sent + ttl - margin`` where
  t_sent is taken *before* the refresh is sent (monotonic clock), so the gateway
  stops trusting a lease before the coordinator can hand it to anyone else.
- EXPIRED_REUSING: the last grant still, for ``reuse_timeout_s`` (short blips). The
  coordinator holds a lapsed gateway's lease as long, so a gateway that alone lost it
  (a partial partition) spends a lease nobody else has been lent.
- SAFE: total = min(last lease, K / live gateways of the last grant), P2 off
  (rejected DEGRADED), P1 at its ceiling, ``degraded`` True (the controller gates
  dispatch by node-reported load). Never fail open.

In every state the limits shrink at once, in proportion, when the gateway sees the
cluster's healthy capacity (C_eff) fall below the capacity the grant was made for.

Refresh scheduling: periodic (``refresh_s``, jittered if an rng is given), early
(coalesced, at most every ``early_refresh_min_interval_s``) when free credits fall
below the low watermark, a request waits in a queue, or something urgent happened
(no assignment yet, a new quota tenant, C_eff changed). One refresh in flight at a
time; after a failure, only the periodic schedule (no early storm against a dead
coordinator).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.core.admission.config import AdmissionConfig
from kvgate.core.admission.types import LeaseGrant, LeaseState, Triple
from kvgate.core.rng import Rng

_INF = math.inf


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalLimits:
    """What the gateway may admit against right now."""

    total: int  # class credits in flight at most
    caps: Triple  # per-class ceilings inside ``total`` (P0 = total; 0 = the class waits)
    p0_reserve: int  # credits P1/P2 must leave free for P0 (minus P0's own in-flight)
    bypass: int  # bypass-lane credits
    has: Triple  # per-class lease, as reported back to the coordinator
    # the classes from this one on are off: rejected DEGRADED instead of queued (3: none)
    reject_from: int
    degraded: bool


class QuotaBook:
    __slots__ = (
        "_backoff_until",
        "_inflight_at",
        "_last_sent",
        "_next_at",
        "_rng",
        "asked_at",
        "c_eff",
        "c_eff_known",
        "capacity_changed",
        "config",
        "epoch",
        "failures",
        "grant",
        "local_deadline",
        "next_transition",
        "refreshes",
        "safe_at",
        "state",
    )

    def __init__(self, config: AdmissionConfig, rng: Rng | None = None) -> None:
        self.config = config
        self._rng = rng
        self.state = LeaseState.NO_ASSIGNMENT
        self.grant: LeaseGrant | None = None
        self.asked_at = -_INF  # when the refresh the current grant answers was sent
        self.epoch: str | None = None
        self.c_eff = config.budget
        self.c_eff_known = False
        self.capacity_changed = False
        self.local_deadline = _INF
        self.safe_at = _INF
        self.next_transition = _INF
        self._inflight_at: float | None = None
        self._last_sent = -_INF
        self._next_at = -_INF
        self._backoff_until = -_INF
        self.refreshes = 0
        self.failures = 0

    # ----------------------------------------------------------------- state machine
    def advance(self, now: float) -> bool:
        """Apply time-based transitions; True if the state changed."""
        before = self.state
        if self.state is LeaseState.ACTIVE and now >= self.local_deadline:
            self.state = LeaseState.EXPIRED_REUSING
        if self.state is LeaseState.EXPIRED_REUSING and now >= self.safe_at:
            self.state = LeaseState.SAFE
        self._set_next_transition()
        return self.state is not before

    def _set_next_transition(self) -> None:
        if self.state is LeaseState.ACTIVE:
            self.next_transition = self.local_deadline
        elif self.state is LeaseState.EXPIRED_REUSING:
            self.next_transition = self.safe_at
        else:
            self.next_transition = _INF

    def set_capacity(self, c_eff: int) -> bool:
        self.c_eff_known = True
        if c_eff == self.c_eff:
            return False
        self.c_eff = c_eff
        self.capacity_changed = True
        return True

    # ----------------------------------------------------------------- refresh protocol
    def begin(self, now: float) -> None:
        """A refresh is being sent now (t_sent, taken before sending)."""
        self._inflight_at = now
        self._last_sent = now
        self._next_at = now + self._period()
        self.refreshes += 1

    def on_grant(self, grant: LeaseGrant, now: float) -> None:
        t_sent = self._inflight_at if self._inflight_at is not None else now
        self._inflight_at = None
        self.grant = grant
        self.asked_at = t_sent
        self.epoch = grant.epoch
        self.local_deadline = t_sent + grant.ttl_s - self.config.lease.margin_s
        self.safe_at = self.local_deadline + self.config.lease.reuse_timeout_s
        self.state = LeaseState.ACTIVE
        self.capacity_changed = False
        self._backoff_until = -_INF
        self._next_at = t_sent + self._period(grant.refresh_s)
        self.advance(now)

    def on_failure(self, now: float) -> None:
        self._inflight_at = None
        self.failures += 1
        self._next_at = now + self._period()
        self._backoff_until = self._next_at
        self.advance(now)

    def due(self, now: float, *, pressure: bool, urgent: bool) -> bool:
        lc = self.config.lease
        if self._inflight_at is not None and now - self._inflight_at < lc.ttl_s:
            return False  # one at a time (a reply lost for a whole ttl is given up on)
        if now >= self._next_at:
            return True
        if now < self._backoff_until or now - self._last_sent < lc.early_refresh_min_interval_s:
            return False
        return urgent or pressure or self.capacity_changed

    def _period(self, base: float | None = None) -> float:
        lc = self.config.lease
        period = lc.refresh_s if base is None else base
        if self._rng is not None and lc.jitter > 0:
            period *= 1.0 + lc.jitter * (2.0 * self._rng.random() - 1.0)
        return period

    # ----------------------------------------------------------------- limits
    def _class_capacity(self) -> tuple[int, int]:
        pool = self.config.bypass_credits(self.c_eff)
        return self.c_eff - pool, pool

    def _scale(self) -> float:
        g = self.grant
        if g is None or self.c_eff >= g.capacity:
            return 1.0
        return self.c_eff / g.capacity if g.capacity > 0 else 0.0

    def limits(self) -> LocalLimits:
        cfg = self.config
        g = self.grant
        if self.state is LeaseState.NO_ASSIGNMENT or g is None:
            n = cfg.lease.expected_gateways
            k, pool = self._class_capacity()
            total = k // n
            bypass = max(1, pool // n) if pool > 0 else 0
            return LocalLimits(
                total=total,
                caps=(total, 0, 0),
                p0_reserve=0,
                bypass=bypass,
                has=(total, 0, 0),
                # once a refresh failed no grant may come for long: P1 and P2 are told
                # now (503, retry) rather than held until their queue timeout (a 429)
                reject_from=1 if self.failures else 3,
                degraded=True,
            )
        scale = self._scale()

        def sc(x: int) -> int:
            return x if scale >= 1.0 else math.floor(x * scale + 1e-9)

        safe = self.state is LeaseState.SAFE
        total = sc(min(g.total, g.safe_capacity) if safe else g.total)
        g1 = min(sc(g.grants[1]), total)
        g2 = min(sc(g.grants[2]), total)
        cap1 = total if g.ceilings[1] >= 1.0 else g1
        p2_off = safe and not cfg.safe_mode.p2_enabled
        return LocalLimits(
            total=total,
            caps=(total, cap1, 0 if p2_off else g2),
            p0_reserve=min(sc(g.p0_reserve), total),
            bypass=sc(g.bypass),
            has=(min(sc(g.grants[0]), total), g1, g2),
            reject_from=2 if p2_off else 3,
            degraded=safe,
        )

    def tenant_limits(self) -> Mapping[str, int]:
        """Per-tenant limits from the last grant, for the current state."""
        g = self.grant
        if self.state is LeaseState.NO_ASSIGNMENT or g is None:
            return {}
        if self.state is not LeaseState.SAFE:
            return g.tenant_grants
        live = max(1, g.gateways_live)
        out: dict[str, int] = {}
        for tenant, granted in g.tenant_grants.items():
            quota = self.config.quota_for(tenant)
            share = granted if quota is None else max(1 if quota > 0 else 0, quota // live)
            out[tenant] = min(granted, share)
        return out

    @property
    def asks_coordinator(self) -> bool:
        """Whether a lease is live (ACTIVE or EXPIRED_REUSING): a tenant it has no entry
        for waits for the coordinator's answer rather than taking a share unasked."""
        return self.state is LeaseState.ACTIVE or self.state is LeaseState.EXPIRED_REUSING

    def tenant_fair_share(self, quota: int) -> int:
        """This gateway's even share of a tenant's cluster quota: the quota over the
        gateways live in the last grant, or the expected gateways before one. Rounded
        down, to 0 for a quota below the gateways' count: at least 1 each put a fleet
        without its coordinator over the quota (quota 2, 3 gateways: 3 in flight)."""
        g = self.grant
        if self.state is LeaseState.NO_ASSIGNMENT or g is None:
            return quota // self.config.lease.expected_gateways
        return quota // max(1, g.gateways_live)

    def tenant_fallback(self, quota: int) -> int:
        """The limit of a quota tenant absent from the grant (first sighting): an even
        share without a coordinator, the whole quota for a gateway that is the fleet,
        else the first-sight allowance (0 by default: its requests wait for a grant)."""
        if quota <= 0:
            return 0
        if self.state in (LeaseState.NO_ASSIGNMENT, LeaseState.SAFE) or self.grant is None:
            return self.tenant_fair_share(quota)  # no coordinator to ask: an even share
        if self.grant.gateways_live <= 1 and self.config.lease.expected_gateways <= 1:
            return quota  # a fleet of one: no other gateway can hold any of it
        return min(quota, self.config.lease.tenant_first_sight_allowance)
