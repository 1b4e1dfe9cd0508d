"""Shared helpers for the admission tests: requests, hand-made grants, a fake coordinator,
and a virtual-time cluster of gateways sharing one coordinator."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.core.admission import (
    AdmissionConfig,
    AdmissionRequest,
    Admitted,
    Coordinator,
    CoordinatorUnavailable,
    GatewayAdmission,
    InProcessCoordinator,
    LeaseGrant,
    Priority,
    Queued,
    RefreshRequest,
    Rejected,
    Ticket,
)

_counter = 0


def req(
    priority: int = 1,
    tenant: str = "t",
    *,
    rid: str | None = None,
    bypass: bool = False,
    prompt_tokens: int = 100,
    max_seq_len: int | None = 4096,
    deadline: float | None = None,
) -> AdmissionRequest:
    global _counter
    _counter += 1
    return AdmissionRequest(
        request_id=rid or f"r{_counter}",
        tenant=tenant,
        priority=Priority(priority),
        bypass=bypass,
        prompt_tokens=prompt_tokens,
        max_seq_len=max_seq_len,
        deadline=deadline,
    )


def lease(
    grants: tuple[int, int, int],
    *,
    gateway_id: str = "g",
    headroom: int = 0,
    p0_reserve: int = 0,
    bypass: int = 0,
    tenants: Mapping[str, int] | None = None,
    full: frozenset[str] = frozenset(),  # tenants whose quota the fleet fills
    ceilings: tuple[float, float, float] = (1.0, 1.0, 1.0),
    safe_capacity: int | None = None,
    capacity: int = 1000,
    ttl_s: float = 2.0,
    refresh_s: float = 0.5,
    live: int = 1,
    epoch: str = "epoch-0",  # the InProcessCoordinator default: no learning mode
) -> LeaseGrant:
    total = sum(grants) + headroom
    return LeaseGrant(
        gateway_id=gateway_id,
        grants=grants,
        headroom=headroom,
        p0_reserve=p0_reserve,
        bypass=bypass,
        tenant_grants=dict(tenants or {}),
        tenant_full=full,
        ttl_s=ttl_s,
        refresh_s=refresh_s,
        safe_capacity=total if safe_capacity is None else safe_capacity,
        capacity=capacity,
        ceilings=ceilings,
        epoch=epoch,
        gateways_live=live,
    )


def leased_gateway(
    grant: LeaseGrant, config: AdmissionConfig | None = None, *, now: float = 0.0
) -> GatewayAdmission:
    """A gateway in ACTIVE holding exactly ``grant`` (sent and applied at ``now``)."""
    gw = GatewayAdmission(config or AdmissionConfig(budget=grant.capacity), grant.gateway_id)
    gw.make_refresh(now)
    gw.apply_grant(grant, now)
    return gw


def fill(
    gw: GatewayAdmission, n: int, priority: int, now: float = 0.0, **kw: object
) -> list[Ticket]:
    """Admit n requests that must all be admitted at once; returns their tickets."""
    out = []
    for _ in range(n):
        d = gw.admit(req(priority, **kw), now)  # type: ignore[arg-type]
        assert isinstance(d, Admitted), d
        out.append(d.ticket)
    return out


def kind(decision: object) -> str:
    return type(decision).__name__


class FlakyCoordinator:
    """Wraps a real coordinator; raises CoordinatorUnavailable while ``down``."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.down = False
        self.calls = 0

    def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        self.calls += 1
        if self.down:
            raise CoordinatorUnavailable("coordinator down")
        return self.inner.refresh(req, now)

    def release_gateway(self, gateway_id: str) -> None:
        self.inner.release_gateway(gateway_id)


def sync_refresh(gw: GatewayAdmission, coord: Coordinator, now: float) -> list[Admitted]:
    try:
        grant = coord.refresh(gw.make_refresh(now), now)
    except CoordinatorUnavailable:
        gw.refresh_failed(now)
        return []
    return gw.apply_grant(grant, now)


# ----------------------------------------------------------------------------- cluster sim


@dataclass
class SimResult:
    steps: int = 0
    admits: int = 0
    max_class_inflight: int = 0
    max_bypass_inflight: int = 0
    max_tenant_slots: dict[str, int] = field(default_factory=dict)
    class_capacity: int = 0
    bypass_capacity: int = 0
    quotas: dict[str, int] = field(default_factory=dict)
    violations: int = 0  # class in-flight > K, bypass > R, or a tenant above its quota
    busy_samples: list[int] = field(default_factory=list)

    @property
    def overshoot(self) -> int:
        return max(0, self.max_class_inflight - self.class_capacity)

    def utilisation(self) -> float:
        tail = self.busy_samples[len(self.busy_samples) // 2 :]
        return sum(tail) / (len(tail) * self.class_capacity) if tail else 0.0


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    gw: int = field(compare=False)
    payload: object = field(compare=False, default=None)


class ClusterSim:
    """G gateways, one coordinator, random arrivals and durations over virtual time.

    Refreshes are asynchronous: the coordinator sees the report after d1 and the grant
    lands after d1 + d2 (0-40 ms each); the gateway keeps admitting meanwhile. Every
    gateway refreshes whenever ``refresh_due`` says so, so the coordinator is always
    reachable. The invariant is sampled after every operation that can admit.
    """

    def __init__(
        self,
        seed: int,
        *,
        gateways: int,
        budget: int,
        coordinator_factory: Callable[[AdmissionConfig], Coordinator] | None = None,
        quotas: Mapping[str, int] | None = None,
        expected_gateways: int | None = None,
        traffic_before_first_refresh: bool = False,
        overload: float = 2.0,
        duration_s: float = 20.0,
        demand_walk_per_s: float = 2.0,
    ) -> None:
        from kvgate.core.admission import LeaseConfig

        self.rng = random.Random(seed)
        self.quotas = dict(quotas if quotas is not None else {"ta": max(2, budget // 4)})
        self.cfg = AdmissionConfig(
            budget=budget,
            tenant_quotas=self.quotas,
            lease=LeaseConfig(
                tenant_first_sight_allowance=0,
                expected_gateways=expected_gateways or gateways,
            ),
        )
        if coordinator_factory is None:
            # traffic from t = 0: the coordinator learns start-up allowances for one ttl
            self.coord: Coordinator = InProcessCoordinator(
                self.cfg, learn_on_start=traffic_before_first_refresh
            )
        else:
            self.coord = coordinator_factory(self.cfg)
        self.gws = [
            GatewayAdmission(self.cfg, f"gw{i}", rng=random.Random(seed * 100 + i))
            for i in range(gateways)
        ]
        self.duration_s = duration_s
        self.overload = overload
        self.pre_traffic = traffic_before_first_refresh
        self.walk = demand_walk_per_s
        self._events: list[_Event] = []
        self._seq = 0
        self._awaiting = [False] * gateways
        self._inflight: dict[int, set[Ticket]] = {i: set() for i in range(gateways)}
        self.result = SimResult(
            class_capacity=budget - self.cfg.bypass_credits(budget),
            bypass_capacity=self.cfg.bypass_credits(budget),
            quotas=dict(self.quotas),
        )
        # per-gateway arrival-rate multipliers: a random walk of demand
        self._share = [self.rng.random() + 0.2 for _ in range(gateways)]

    def _push(self, at: float, kind: str, gw: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, _Event(at, self._seq, kind, gw, payload))

    def _mean_duration(self) -> float:
        return 1.0

    def run(self) -> SimResult:
        rng = self.rng
        budget = self.cfg.budget
        # offered concurrency ~ overload x budget: rate x mean duration = overload x C
        total_rate = self.overload * budget / self._mean_duration()
        t = 0.0
        if not self.pre_traffic:
            for i, gw in enumerate(self.gws):  # the first refresh before any traffic
                grant = self.coord.refresh(gw.make_refresh(0.0), 0.0)
                self._on_admitted(i, gw.apply_grant(grant, 0.0), 0.0)
        dt = 0.01
        while t < self.duration_s:
            t = round(t + dt, 6)
            if rng.random() < self.walk * dt:  # demand walk: one gateway's share changes
                j = rng.randrange(len(self.gws))
                self._share[j] = rng.random() * 2 + 0.05
            shares = sum(self._share)
            while self._events and self._events[0].at <= t:
                self._handle(heapq.heappop(self._events))
            for i, gw in enumerate(self.gws):
                rate = total_rate * self._share[i] / shares
                n = self._poisson(rate * dt)
                for _ in range(n):
                    self._arrive(i, t)
                for item in gw.poll(t):
                    if isinstance(item, Admitted):
                        self._on_admitted(i, [item], t)
                if not self._awaiting[i] and gw.refresh_due(t):
                    self._awaiting[i] = True
                    self._push(t + rng.uniform(0.0, 0.04), "coord", i, gw.make_refresh(t))
            self._sample()
            self.result.steps += 1
        return self.result

    def _poisson(self, lam: float) -> int:
        # Knuth; lam is small per step
        limit, k, p = math.exp(-lam), 0, 1.0
        while True:
            p *= self.rng.random()
            if p <= limit:
                return k
            k += 1

    def _arrive(self, i: int, now: float) -> None:
        rng = self.rng
        roll = rng.random()
        bypass = roll < 0.01
        priority = 0 if roll < 0.3 else (1 if roll < 0.8 else 2)
        tenant = "ta" if rng.random() < 0.4 else f"free{rng.randrange(3)}"
        d = self.gws[i].admit(req(priority, tenant, bypass=bypass), now)
        if isinstance(d, Admitted):
            self._on_admitted(i, [d], now)
        elif not isinstance(d, Queued | Rejected):  # pragma: no cover
            raise AssertionError(d)

    def _on_admitted(self, i: int, items: list[Admitted], now: float) -> None:
        for a in items:
            self.result.admits += 1
            self._inflight[i].add(a.ticket)
            # heavy-ish tail: mostly short, sometimes very long (longer than the ttl)
            dur = self.rng.expovariate(1.0 / self._mean_duration())
            if self.rng.random() < 0.05:
                dur *= 8
            self._push(now + max(0.01, dur), "end", i, a.ticket)
        if items:
            self._check()

    def _handle(self, ev: _Event) -> None:
        gw = self.gws[ev.gw]
        if ev.kind == "end":
            ticket = ev.payload
            assert isinstance(ticket, Ticket)
            self._inflight[ev.gw].discard(ticket)
            self._on_admitted(ev.gw, gw.release(ticket, ev.at), ev.at)
        elif ev.kind == "coord":
            assert isinstance(ev.payload, RefreshRequest)
            try:
                grant = self.coord.refresh(ev.payload, ev.at)
            except CoordinatorUnavailable:
                self._push(ev.at + self.rng.uniform(0.0, 0.04), "failed", ev.gw)
                return
            self._push(ev.at + self.rng.uniform(0.0, 0.04), "apply", ev.gw, grant)
        elif ev.kind == "apply":
            assert isinstance(ev.payload, LeaseGrant)
            self._awaiting[ev.gw] = False
            self._on_admitted(ev.gw, gw.apply_grant(ev.payload, ev.at), ev.at)
        elif ev.kind == "failed":
            self._awaiting[ev.gw] = False
            gw.refresh_failed(ev.at)

    def _check(self) -> None:
        r = self.result
        klass = sum(g.inuse_total for g in self.gws)
        bypass = sum(g.bypass_inuse for g in self.gws)
        r.max_class_inflight = max(r.max_class_inflight, klass)
        r.max_bypass_inflight = max(r.max_bypass_inflight, bypass)
        bad = klass > r.class_capacity or bypass > r.bypass_capacity
        for tenant, quota in self.quotas.items():
            slots = sum(g.tenant_slots(tenant) for g in self.gws)
            r.max_tenant_slots[tenant] = max(r.max_tenant_slots.get(tenant, 0), slots)
            bad = bad or slots > quota
        if bad:
            r.violations += 1

    def _sample(self) -> None:
        self._check()
        self.result.busy_samples.append(sum(g.inuse_total for g in self.gws))
