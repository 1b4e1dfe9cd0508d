"""The coordinator: hands out leases so that the gateways together never exceed C.

:class:`Coordinator` is the contract; :class:`InProcessCoordinator` implements
admission-anchors 8.2, one call per gateway refresh (a Redis fleet runs this very
code on state it loads and stores per refresh: ``gateway/redis_coordinator.py``):

1. Expire gateway records past their TTL, in steps: a lapsed record's whole claim
   stays held for ``reuse_timeout_s`` more, the time its gateway may keep admitting
   on its last lease (EXPIRED_REUSING) if it alone lost the coordinator (a partial
   partition: the others still refresh and would be lent that lease); then, with
   ``reclaim_grace_s`` > 0, its last reported in-use for that long; then it is gone.
2. Upsert the caller. C_eff is the latest C_eff any gateway reported (each sees the
   node health itself; the newest report wins), clamped to the configured budget.
   The bypass pool R = max(expected gateways, floor(3 % of C_eff)) is carved out
   first (at least one credit each: the pool is split over the live gateways); the class
   capacity is K = C_eff - R.
3. Class budgets B[c] (``allocation.class_budgets``): P0's demand is at least its
   unlendable reserve (spread over the live gateways: burst room for P0 everywhere),
   P1 is capped by the SLO ceiling, P2 gets only what is idle.
4. The caller's grant per class: a max-min fair share of B[c] by wants (Doorman
   FAIR_SHARE); capacity nobody wants is spread evenly as ``headroom`` (over the live
   gateways and the expected ones not seen yet). Then the clamps, with **held =
   max(lease granted, lease the gateway reports it holds, inuse)** for every other:

   - grant[c] <= B[c] - sum of the others' held[c], where a class's part of a
     gateway's held is its grant (or what it has), plus only the in-use that neither
     the headroom nor another class's unused grant holds (P0 runs on any free credit:
     counted where it sits, not twice; ``GatewayRecord.held``);
   - sum(grant) + headroom <= K - sum of the others' held totals (headroom is cut
     first, then P2, P1, P0);
   - bypass grant <= R - the others' held bypass; tenant t's grant <= quota(t) - the
     others' held for t, its fair part a max-min share of quota(t) by wants, what
     nobody wants spread like the headroom. The grant names the tenants whose quota
     the reported requests fill: a gateway refuses what its lease does not cover.

   Why "reported has" on top of the brief's max(lease, inuse): a refresh is
   asynchronous, and until the new grant lands the gateway keeps admitting against
   its old lease. Counting only the new lease would let another gateway receive the
   credits the first one is still spending (the invariant test shows it).

Result: sum of in-flight <= C while every gateway reaches the coordinator, and while
one that lost it still runs on its last lease. After that it runs in SAFE, on up to
min(last lease, K / live gateways) of new admissions and what it had in flight, which
the coordinator no longer reserves unless ``reclaim_grace_s`` holds its in-use: a
gateway cut off alone for longer than TTL + ``reuse_timeout_s`` can take the fleet
over C by up to that much (a crashed gateway's credits would otherwise stay reserved
for as long as the grace, with nobody to spend them).

Learning mode (Doorman): a gateway is granted max(has, inuse) as it reports them,
clamped by what the others reported holding; a newcomer (has 0) gets nothing. It runs

- after an epoch change (``reset_epoch``: the Redis coordinator lost its state), until
  TTL + ``reuse_timeout_s`` from it once a gateway reports the epoch before (so also
  for a ``learn_on_start`` state that was lost, not new): an old lease lives that long;
- for a gateway still reporting an older epoch, one TTL from its first such report;
- for the first TTL after the coordinator starts, if ``learn_on_start``: it cannot know
  what gateways admitted in NO_ASSIGNMENT (the first to report would be lent the others'
  start-up allowance).
- after an outage (every record lapsed unrefreshed), for one TTL from the first
  refresh after it: the gateways kept running what they admitted, which the first one
  back would otherwise be lent.
- after a rollback (a gateway reports a state serial of this epoch above the stored
  one: a failover to a lagging replica, a restart from a snapshot), for TTL +
  ``reuse_timeout_s``: its gateways hold leases the stored state never granted.

Start-up bounds. With ``learn_on_start`` and ``expected_gateways`` >= the real count,
in-flight never exceeds C from the first request on. Without it (the default: the first
TTL is not spent echoing start-up allowances), the overshoot is at most the
NO_ASSIGNMENT admits (P0 only, K / expected_gateways each) before each first report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvgate.core.admission.allocation import (
    class_budgets,
    max_min_share,
    spread,
)
from kvgate.core.admission.config import AdmissionConfig
from kvgate.core.admission.coordinator_record import GatewayRecord
from kvgate.core.admission.coordinator_tenants import tenant_grants, tenants_full
from kvgate.core.admission.slo import SloController
from kvgate.core.admission.types import LeaseGrant, RefreshRequest, Triple


class Coordinator(Protocol):
    def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        """Report usage, receive a lease; may raise ``CoordinatorUnavailable``."""
        ...

    def release_gateway(self, gateway_id: str) -> None:
        """Graceful shutdown: forget the gateway's lease now instead of at TTL."""
        ...


class InProcessCoordinator:
    """Doorman-style lease server in process (one gateway, the simulator, tests)."""

    def __init__(
        self, config: AdmissionConfig, *, epoch: str = "epoch-0", learn_on_start: bool = False
    ) -> None:
        self.config = config
        self.epoch = epoch
        self.learn_on_start = learn_on_start
        self.capacity = config.budget
        self.slo = SloController(config.slo)
        self.records: dict[str, GatewayRecord] = {}
        self.learning_until = -1.0
        self.epoch_started: float | None = None  # its learning began (learn_on_start, reset)
        self.refreshes = 0
        # The fleet's clock (Redis's TIME) may step back: a refresh runs at it plus
        # ``clock_offset_s``, grown by every step back, so it never goes back and keeps
        # the clock's pace (deadlines neither move back nor freeze). ``clock_s``: the last.
        self.clock_s = -math.inf
        self.clock_offset_s = 0.0
        self.slo_seen: dict[str, int] = {}
        self.slo_pending: dict[str, float | None] = {}
        self.slo_next: float | None = None

    # ----------------------------------------------------------------- public
    def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        if not math.isfinite(now):  # every expiry test is False at NaN: all leases dropped
            raise ValueError(f"coordinator clock must be a finite number, got {now}")
        now += self.clock_offset_s
        if now < self.clock_s:  # the clock stepped back: no time passed since the last
            self.clock_offset_s += self.clock_s - now
            now = self.clock_s
        self.clock_s = now
        if self.learn_on_start or self._lapsed(now):
            self.epoch_started = now if self.learn_on_start else self.epoch_started
            self.learn_on_start = False
            self.learning_until = now + self.config.lease.ttl_s
        if self._rolled_back(req):
            # its gateways may hold leases granted since, for up to a TTL and a reuse
            # window; learn what they hold instead of lending it again
            lc = self.config.lease
            self.learning_until = max(self.learning_until, now + lc.ttl_s + lc.reuse_timeout_s)
            self.refreshes = max(self.refreshes, req.state_seen or 0)  # serials only grow
        self.refreshes += 1
        self._expire(now)
        if req.c_eff_seen is not None:
            self.capacity = max(0, min(self.config.budget, req.c_eff_seen))
        self._observe_slo(req, now)
        rec = self._upsert(req, now)
        if now < max(self.learning_until, rec.learning_until):
            return self._echo(rec)
        return self._allocate(rec)

    def _rolled_back(self, req: RefreshRequest) -> bool:
        """Whether the state is older than a grant ``req``'s gateway got in this epoch:
        its record's last grant is older than the one it saw (or its record is gone),
        so the store went back to an older copy (a failover to a lagging replica, a
        restart from a snapshot). Per gateway: the fleet's refresh count alone passes
        the lost serial again once the other gateways have refreshed."""
        seen = req.state_seen
        if req.epoch != self.epoch or not seen:
            return False
        rec = self.records.get(req.gateway_id)
        if rec is None:
            return True
        # a record an older version wrote has no serial: the state's count bounds it
        return seen > (self.refreshes if rec.serial is None else rec.serial)

    def release_gateway(self, gateway_id: str) -> None:
        self.records.pop(gateway_id, None)
        self.slo_seen.pop(gateway_id, None)
        self.slo_pending.pop(gateway_id, None)

    def reset_epoch(self, epoch: str, now: float) -> None:
        """Simulate lost coordinator state (a Redis restart): forget all, learn for a TTL."""
        self.epoch = epoch
        self.records.clear()
        self.epoch_started, self.learning_until = now, now + self.config.lease.ttl_s

    @property
    def ceilings(self) -> tuple[float, float, float]:
        return self.slo.ceilings

    def live(self) -> list[GatewayRecord]:
        return [r for r in self.records.values() if not r.ghost]

    def held_total(self) -> int:
        """Sum of held class credits over all records (for tests and metrics)."""
        return sum(self._held_total(r) for r in self.records.values())

    # ----------------------------------------------------------------- held (overridable)
    def _held(self, rec: GatewayRecord, c: int) -> int:
        return rec.held(c)

    def _held_total(self, rec: GatewayRecord) -> int:
        return rec.held_total()

    # ----------------------------------------------------------------- steps
    def _lapsed(self, now: float) -> bool:
        """Every live record is past its TTL: no gateway has refreshed for a whole TTL
        (the coordinator was unreachable), yet their gateways may still be admitting."""
        live = self.live()
        return bool(live) and all(r.expires_at < now for r in live)

    def _expire(self, now: float) -> None:
        """A record past its TTL lapses in steps, each timed from the end of the last:
        its whole claim held for ``reuse_timeout_s`` (what its gateway may still
        spend), then its last in-use for ``reclaim_grace_s``, then it is forgotten."""
        reuse = self.config.lease.reuse_timeout_s
        grace = self.config.lease.reclaim_grace_s
        for gid in list(self.records):
            rec = self.records[gid]
            if rec.expires_at >= now:
                continue
            if not rec.reusing and not rec.ghost and reuse > 0.0:
                rec.reusing = True
                rec.expires_at += reuse
                if rec.expires_at >= now:
                    continue
            if not rec.ghost and grace > 0.0:
                rec.ghost = True
                rec.expires_at += grace
                if rec.expires_at >= now:
                    continue
            del self.records[gid]
            # forget its SLO bookkeeping too: gateway ids come and go (restarts),
            # and a shared store keeps this state for the fleet's lifetime
            self.slo_seen.pop(gid, None)
            self.slo_pending.pop(gid, None)

    def _upsert(self, req: RefreshRequest, now: float) -> GatewayRecord:
        rec = self.records.get(req.gateway_id)
        if rec is None or rec.ghost:
            rec = GatewayRecord(gateway_id=req.gateway_id, expires_at=0.0)
            self.records[req.gateway_id] = rec
        rec.expires_at = now + self.config.lease.ttl_s
        rec.reusing = False  # it reached us again
        rec.inuse, rec.wants, rec.has = req.inuse, req.wants, req.has
        rec.has_total = req.has_total
        rec.bypass_inuse, rec.bypass_has = req.bypass_inuse, req.bypass_has
        rec.tenants = dict(req.tenants)
        lc = self.config.lease
        if req.epoch is not None and req.epoch != self.epoch:
            if rec.learning_until <= 0.0:
                rec.learning_until = now + lc.ttl_s
            if self.epoch_started is not None:  # lost state: one cut off from us spends its
                end = self.epoch_started + lc.ttl_s + lc.reuse_timeout_s  # old lease that long
                self.learning_until = max(self.learning_until, end)
        return rec

    def _grant(self, rec: GatewayRecord, *, learning: bool, p0_reserve: int) -> LeaseGrant:
        rec.serial = self.refreshes
        live = self.live()
        k = self.capacity - self.config.bypass_credits(self.capacity)
        return LeaseGrant(
            gateway_id=rec.gateway_id,
            grants=rec.lease,
            headroom=rec.lease_total - sum(rec.lease),
            p0_reserve=min(p0_reserve, rec.lease[0]),
            bypass=rec.bypass_lease,
            tenant_grants=dict(rec.tenant_lease),
            tenant_full=tenants_full(self.config, self.records.values(), rec),
            ttl_s=self.config.lease.ttl_s,
            refresh_s=self.config.lease.refresh_s,
            safe_capacity=k // max(1, len(live)),
            capacity=self.capacity,
            ceilings=self.slo.ceilings,
            epoch=self.epoch,
            gateways_live=len(live),
            learning=learning,
            state_serial=self.refreshes,
            waiting_elsewhere=sum(
                r.wants[c] - r.inuse[c]
                for r in live
                if r.gateway_id != rec.gateway_id
                for c in (0, 1)
                if r.wants[c] > r.inuse[c]
            ),
        )

    def _unseen(self, live: list[GatewayRecord]) -> list[str]:
        """Placeholders for expected gateways not live: the first to report gets not all."""
        return [f"\0unseen-{i}" for i in range(self.config.lease.expected_gateways - len(live))]

    def _echo(self, rec: GatewayRecord) -> LeaseGrant:
        """Learning mode: what the gateway says it has (or uses), clamped by the others.

        The clamp (the same held rule as ``_allocate``) keeps a gateway from being
        echoed credits another gateway has already reported holding.
        """
        cfg = self.config
        others = [r for r in self.records.values() if r.gateway_id != rec.gateway_id]
        pool = cfg.bypass_credits(self.capacity)
        k = self.capacity - pool
        grant = [max(rec.has[c], rec.inuse[c]) for c in range(3)]
        # not sum(grant): a P0 running on P1's credit is in inuse[0] and has[1], and
        # counting it twice echoed a gateway more than it held (the fleet over K)
        want_total = max(rec.has_total, sum(rec.inuse))
        room = max(0, k - sum(self._held_total(o) for o in others))
        total = min(want_total, room)
        over = sum(grant) - total
        for c in (2, 1, 0):
            cut = min(grant[c], max(0, over))
            grant[c] -= cut
            over -= cut
        rec.lease = (grant[0], grant[1], grant[2])
        rec.lease_total = total
        bypass_room = max(0, pool - sum(o.held_bypass() for o in others))
        rec.bypass_lease = min(max(rec.bypass_has, rec.bypass_inuse), bypass_room)
        tenant_lease: dict[str, int] = {}
        for tenant, usage in rec.tenants.items():
            quota = cfg.quota_for(tenant)
            if quota is None:
                continue
            free = max(0, quota - sum(o.held_tenant(tenant) for o in others))
            tenant_lease[tenant] = min(max(usage.has, usage.inuse), free)
        rec.tenant_lease = tenant_lease
        return self._grant(rec, learning=True, p0_reserve=0)

    def _budgets(self, live: list[GatewayRecord]) -> _BudgetView:
        cfg = self.config
        k = self.capacity - cfg.bypass_credits(self.capacity)
        shares = (cfg.classes[0].share, cfg.classes[1].share, cfg.classes[2].share)
        lendable = (cfg.classes[0].lendable, cfg.classes[1].lendable, cfg.classes[2].lendable)
        probe = class_budgets(capacity=k, shares=shares, lendable=lendable, demand=(0, 0, 0))
        reserve_share = spread(probe.reserve[0], (r.gateway_id for r in live))
        wants0 = {r.gateway_id: max(r.wants[0], reserve_share[r.gateway_id]) for r in live}
        demand = (
            sum(wants0.values()),
            sum(r.wants[1] for r in live),
            sum(r.wants[2] for r in live),
        )
        cb = class_budgets(
            capacity=k, shares=shares, lendable=lendable, demand=demand, ceilings=self.ceilings
        )
        return _BudgetView(
            k=k, budgets=cb.budgets, idle=cb.idle, wants0=wants0, reserve_share=reserve_share
        )

    def _allocate(self, rec: GatewayRecord) -> LeaseGrant:
        cfg = self.config
        gid = rec.gateway_id
        live = self.live()
        others = [r for r in self.records.values() if r.gateway_id != gid]
        view = self._budgets(live)
        wants_by_class = (
            view.wants0,
            {r.gateway_id: r.wants[1] for r in live},
            {r.gateway_id: r.wants[2] for r in live},
        )
        grant = [0, 0, 0]
        for c in range(3):
            fair = max_min_share(view.budgets[c], wants_by_class[c])[gid]
            free = view.budgets[c] - sum(self._held(o, c) for o in others)
            grant[c] = max(0, min(fair, free))
        lenders = [*(r.gateway_id for r in live), *self._unseen(live)]
        headroom = spread(view.idle, lenders)[gid]
        room = max(0, view.k - sum(self._held_total(o) for o in others))
        over = grant[0] + grant[1] + grant[2] + headroom - room
        cut = min(headroom, max(0, over))
        headroom -= cut
        over -= cut
        for c in (2, 1, 0):
            if over <= 0:
                break
            cut = min(grant[c], over)
            grant[c] -= cut
            over -= cut
        rec.lease = (grant[0], grant[1], grant[2])
        rec.lease_total = sum(grant) + headroom
        pool = cfg.bypass_credits(self.capacity)
        bypass_fair = spread(pool, (r.gateway_id for r in live))[gid]
        bypass_free = pool - sum(o.held_bypass() for o in others)
        rec.bypass_lease = max(0, min(bypass_fair, bypass_free))
        rec.tenant_lease = tenant_grants(self.config, rec, others, live, self._unseen(live))
        return self._grant(rec, learning=False, p0_reserve=view.reserve_share[gid])

    def _observe_slo(self, req: RefreshRequest, now: float) -> None:
        """Count each gateway window once; close a coordinator window every window_s."""
        gid = req.gateway_id
        if req.p0_ttft_window > self.slo_seen.get(gid, -1):
            self.slo_seen[gid] = req.p0_ttft_window
            self.slo_pending[gid] = req.p0_ttft_p99_s
        if self.slo_next is None:
            self.slo_next = now + self.config.slo.window_s
            return
        if now < self.slo_next:
            return
        values = [v for v in self.slo_pending.values() if v is not None]
        self.slo.observe_window(max(values) if values else None)
        self.slo_pending.clear()
        self.slo_next = now + self.config.slo.window_s


@dataclass(frozen=True, slots=True, kw_only=True)
class _BudgetView:
    k: int  # class capacity
    budgets: Triple
    idle: int
    wants0: dict[str, int]
    reserve_share: dict[str, int]
