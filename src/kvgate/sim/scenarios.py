"""The design brief's gray scenarios, each with written pass criteria.

A scenario turns a base workload and cluster into what it runs (a changed
workload, config and timed hooks); after the run,
:mod:`kvgate.sim.scenario_checks` checks its criteria against the report (the
numbers of the checks below). Criteria (issue "Simulator"):

* ``p2_flood``: a P2 flood at 10x while P0 stays steady; P0 TTFT p99 stays
  within its SLO (5 s by default).
* ``nodes_fail``: 30 % of nodes fail at 30 % of the run and come back at 60 %;
  attempts per request <= 1.2; nothing lost.
* ``coordinator_down``: the coordinator is unreachable from 30 % to 60 % of the
  run; P0 keeps >= 90 % of its admit rate (share of offered P0 requests admitted
  during the outage against before it), the sum of in-flight requests never
  exceeds the budget C, and no admission during the outage leaves its gateway above
  the limit in force there (the last lease while reused, then the safe limit, at most
  C / gateways); admissions are read at every dispatch, not sampled.
* ``mass_eviction``: at 40 % of the run, while its prefixes are hot, the node holding
  the most cached blocks is forced to flush 90 % of them (those not in use, least
  recently used first: a block in use cannot go), a bulk eviction whatever its size;
  run with the pre-announcement and without it, the report shows TTFT p99 and hit
  ratio of both, and the criteria fail when nothing was announced.
* ``tenant_flood``: one tenant floods at 10x its share; it never holds more than
  its quota in flight, and the other tenants' TTFT p99 moves by < 20 % against
  the same run without the flood.
* ``traffic_double``: traffic doubles from 30 % to 50 % of the run; nothing lost
  (every request ends with exactly one outcome) and the sum of in-flight requests
  never exceeds the budget C (the extra traffic waits or is refused at the gateway).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from kvgate.core.admission import AdmissionConfig, LeaseState, Priority
from kvgate.core.rng import Rng
from kvgate.sim.cluster import ClusterConfig, RequestOutcome, SimCluster
from kvgate.sim.runner import Hook
from kvgate.sim.workload import (
    Workload,
    assign_classes,
    concat,
    merge,
    scale_rate,
    time_window,
    with_priority,
    with_tenant,
)


def at_rate(base: Workload, factor: float) -> Workload:
    """``base``'s traffic at ``factor`` times its rate over the same duration.

    Copies of the rate-scaled workload are laid end to end (each with its own block
    ids, so the copies are new prompts, not repeats) and cut to the base's duration.
    """
    d = base.duration_s
    scaled = scale_rate(base, factor)
    copies = max(1, -(-int(factor * 1000) // 1000))
    joined = concat(*([scaled] * copies)) if copies > 1 else scaled
    return time_window(joined, 0.0, d, rebase=False)


@dataclass(slots=True)
class RunMaxima:
    """What admission let in during one run, read at every dispatch (in-flight counts
    only grow there, so these maxima are exact)."""

    # the fleet's requests in flight, at most, inside the probe's window
    inflight_in_window: int = 0
    # per tenant, its requests in flight over every gateway (a quota is fleet-wide)
    tenant_inflight: dict[str, int] = field(default_factory=dict)
    # admissions inside the window (first attempts: a retry keeps its credit), the most
    # any of them left its gateway above the limit in force there (credits in use less
    # the lease total; <= 0 when nothing was admitted beyond it), and of those made in
    # SAFE mode, how many and the most in use at their gateway after one
    admitted_in_window: int = 0
    admitted_over_limit: int = -(10**9)
    admitted_in_safe_mode: int = 0
    safe_mode_inuse: int = 0


@dataclass(slots=True)
class Probe:
    """Watches what admission lets in during a run (for criteria no report field
    covers): ``budget`` is the bound the scenario checks (the budget C, or a quota).

    One plan serves every policy of a comparison in turn: ``total`` keeps the maxima
    over all its runs, ``run`` those of the current run (:meth:`end_run`).
    """

    budget: int = 0
    total: RunMaxima = field(default_factory=RunMaxima)
    run: RunMaxima = field(default_factory=RunMaxima)

    @property
    def max_inflight_in_window(self) -> int:
        return self.total.inflight_in_window

    @property
    def max_tenant_inflight(self) -> dict[str, int]:
        return self.total.tenant_inflight

    def end_run(self) -> RunMaxima:
        """The finished run's maxima, then a fresh record for the next run."""
        out, self.run = self.run, RunMaxima()
        return out


def _watch(probe: Probe, start: float, end: float) -> tuple[tuple[float, Hook], ...]:
    """Hooks that have the cluster report every dispatch to ``probe`` (from time 0),
    and take the requests already in flight when the window opens."""

    def observe(c: SimCluster, g: int, attempt: int, total: int) -> None:
        now = c.loop.now
        gateways = c.gateways
        fleet: dict[str, int] = {}  # a tenant's quota is fleet-wide: sum its gateways
        for ctl in gateways:
            for t, n in ctl.admission.tenant_inflight().items():
                fleet[t] = fleet.get(t, 0) + n
        for rec in (probe.total, probe.run):
            for t, n in fleet.items():
                if n > rec.tenant_inflight.get(t, 0):
                    rec.tenant_inflight[t] = n
        if not start <= now < end:
            return
        adm = gateways[g].admission
        safe = adm.lease_state is LeaseState.SAFE
        for rec in (probe.total, probe.run):
            rec.inflight_in_window = max(rec.inflight_in_window, total)
            if attempt == 1:
                rec.admitted_in_window += 1
                rec.admitted_over_limit = max(
                    rec.admitted_over_limit, adm.inuse_total - adm.lease_total
                )
                if safe:
                    rec.admitted_in_safe_mode += 1
                    rec.safe_mode_inuse = max(rec.safe_mode_inuse, adm.inuse_total)

    def install(c: SimCluster) -> None:
        c.on_dispatch.append(partial(observe, c))

    def opened(c: SimCluster) -> None:  # what was let in before counts in the window
        total = sum(ctl.in_flight() for ctl in c.gateways)
        for rec in (probe.total, probe.run):
            rec.inflight_in_window = max(rec.inflight_in_window, total)

    return ((0.0, install), (start, opened))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    workload: Workload
    config: ClusterConfig
    hooks: tuple[tuple[float, Hook], ...] = ()
    probe: Probe | None = None
    # the fault's [start, end) in seconds, for criteria that compare before and during it
    window: tuple[float, float] | None = None
    # what the fault is (nodes_fail, traffic_double: set when planned) or did in the
    # run just ended (mass_eviction: its hook writes it)
    fault: dict[str, object] = field(default_factory=dict)


def p2_flood(base: Workload, config: ClusterConfig, rng: Rng, *, factor: float = 10.0) -> Plan:
    """The workload as P0 plus a P2 flood at 10x its rate; P0 TTFT p99 must stay in its SLO."""
    p0 = with_priority(base, int(Priority.P0))
    flood = with_priority(at_rate(base, factor), int(Priority.P2))
    return Plan(workload=merge(p0, flood, name=f"{base.name}+p2x{factor:g}"), config=config)


def nodes_fail(base: Workload, config: ClusterConfig, rng: Rng, *, fraction: float = 0.3) -> Plan:
    """30% of nodes (rounded up) crash at 30% of the run and return at 60%; <= 1.2
    attempts per request and every request ends with one outcome."""
    d = base.duration_s
    # at least the fraction: 3 of 8 nodes (round() took 2, 25 %)
    k = max(1, math.ceil(config.nodes * fraction - 1e-9))
    start, end = 0.3 * d, 0.6 * d

    def down(c: SimCluster) -> None:
        for i in range(k):
            c.crash_node(i)

    def up(c: SimCluster) -> None:
        for i in range(k):
            c.recover_node(i)

    return Plan(
        workload=base,
        config=config,
        hooks=((start, down), (end, up)),
        window=(start, end),
        fault={"nodes_failed": k, "nodes": config.nodes},
    )


def coordinator_down(base: Workload, config: ClusterConfig, rng: Rng) -> Plan:
    """The coordinator is unreachable from 30% to 60% of the run; P0 keeps >= 90% of its
    admit rate and in-flight requests stay within the budget."""
    d = base.duration_s
    start, end = 0.3 * d, 0.6 * d
    probe = Probe(budget=config.controller.admission.budget)

    def cut(c: SimCluster) -> None:
        c.coordinator_up = False

    def heal(c: SimCluster) -> None:
        c.coordinator_up = True

    wl = assign_classes(base, tenants={}, priorities={0: 0.3, 1: 0.5, 2: 0.2}, rng=rng)
    return Plan(
        workload=wl,
        config=config,
        hooks=((start, cut), (end, heal), *_watch(probe, start, end)),
        probe=probe,
        window=(start, end),
    )


MASS_EVICTION_SHARE = 0.9  # mass_eviction: the share of the node's cached blocks flushed


def mass_eviction(
    base: Workload,
    config: ClusterConfig,
    rng: Rng,
    *,
    announce: bool = True,
    share: float = MASS_EVICTION_SHARE,
) -> Plan:
    """The fullest node is forced to flush 90% of its cached blocks (those not in use)
    at 40% of the run, announced first or not; TTFT p99 and hit ratio of both."""
    at = 0.4 * base.duration_s
    fault: dict[str, object] = {}

    def evict(c: SimCluster) -> None:
        node = max(c.nodes, key=lambda n: (n.engine.pool.num_cached_blocks, -n.index))
        pool = node.engine.pool
        # a forced flush: a bulk eviction however small against the pool (on a workload
        # whose working set is far below the cache, the bulk threshold of 10 % of the
        # pool would otherwise let it go unannounced); only blocks not in use can go
        fault.update(
            node=str(node.node_id),
            at_s=round(c.loop.now, 3),
            pool_blocks=pool.num_blocks,
            cached_blocks=pool.num_cached_blocks,
            evicted_blocks=c.flush_node(node.index, share, "mass eviction (forced flush)"),
        )

    ev = config.eviction if announce else replace(config.eviction, announce_lead_s=None)
    return Plan(
        workload=base, config=replace(config, eviction=ev), hooks=((at, evict),), fault=fault
    )


def tenant_flood(
    base: Workload,
    config: ClusterConfig,
    rng: Rng,
    *,
    factor: float = 10.0,
    quota: int = 4,
    flood: bool = True,
) -> Plan:
    """One tenant floods at 10x its share; it stays within its quota (4 in flight) and the
    other tenants' TTFT p99 moves < 20% against a run without the flood."""
    tenants = {"alpha": 1.0, "beta": 1.0, "gamma": 1.0}
    wl = assign_classes(base, tenants=tenants, priorities={}, rng=rng)
    quotas: dict[str, int] = {t: 10_000 for t in tenants} | {"flood": quota}
    adm: AdmissionConfig = replace(config.controller.admission, tenant_quotas=quotas)
    cfg = replace(config, controller=replace(config.controller, admission=adm))
    if flood:
        extra = with_tenant(at_rate(base, factor / len(tenants)), "flood")
        wl = merge(wl, extra, name=f"{base.name}+flood")
    probe = Probe(budget=quota)
    return Plan(workload=wl, config=cfg, hooks=_watch(probe, 0.0, math.inf), probe=probe)


def traffic_double(base: Workload, config: ClusterConfig, rng: Rng) -> Plan:
    """Traffic doubles from 30% to 50% of the run; every request ends with one outcome
    and the sum of in-flight requests never exceeds the budget C."""
    d = base.duration_s
    extra = time_window(base, 0.3 * d, 0.5 * d, rebase=False)
    return Plan(
        workload=merge(base, extra, name=f"{base.name}+double"),
        config=config,
        fault={"extra_requests": len(extra.requests)},
    )


Builder = Callable[..., Plan]
SCENARIOS: dict[str, Builder] = {
    "p2_flood": p2_flood,
    "nodes_fail": nodes_fail,
    "coordinator_down": coordinator_down,
    "mass_eviction": mass_eviction,
    "tenant_flood": tenant_flood,
    "traffic_double": traffic_double,
}


def describe(name: str) -> str:
    """A scenario's one-paragraph description (its builder's docstring, on one line)."""
    return " ".join((SCENARIOS[name].__doc__ or "").split())


def arrived_in(
    c: SimCluster, start: float, end: float, priority: int | None = None
) -> list[RequestOutcome]:
    """The requests (of ``priority``, or all) that reached their gateway in [start, end)."""
    return [
        o
        for o in c.outcomes.values()
        if start <= o.arrived_s < end and (priority is None or o.req.priority == priority)
    ]


def p0_admit_shares(c: SimCluster, start: float, end: float) -> tuple[float, float]:
    """Share of offered P0 requests admitted (not rejected) before and during a window."""

    def share(lo: float, hi: float) -> float:
        offered = arrived_in(c, lo, hi, priority=0)
        if not offered:
            return 1.0
        admitted = sum(1 for o in offered if o.status != "rejected")
        return admitted / len(offered)

    return share(0.0, start), share(start, end)
