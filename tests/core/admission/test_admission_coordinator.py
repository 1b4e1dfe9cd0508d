"""InProcessCoordinator: FAIR_SHARE across gateways, the held rule, tenants, expiry,
learning mode, the bypass pool and C_eff."""

from __future__ import annotations

import math
from typing import Any

import pytest
from admission_testlib import req

from kvgate.core.admission import (
    AdmissionConfig,
    Admitted,
    ClassConfig,
    GatewayAdmission,
    InProcessCoordinator,
    LeaseConfig,
    LeaseState,
    Queued,
    RefreshRequest,
    SloConfig,
    TenantUsage,
)
from kvgate.core.admission.coordinator_state import dump_state, load_state

ONE_CLASS = (
    ClassConfig(share=1.0, lendable=1.0),
    ClassConfig(share=0.0, lendable=1.0),
    ClassConfig(share=0.0, lendable=1.0),
)


def _one_class(budget: int, **kw: object) -> AdmissionConfig:
    return AdmissionConfig(budget=budget, bypass_fraction=0.0, classes=ONE_CLASS, **kw)  # type: ignore[arg-type]


def report(
    gid: str,
    wants0: int = 0,
    *,
    has: int = 0,
    inuse0: int = 0,
    wants1: int = 0,
    inuse1: int = 0,
    tenants: dict[str, TenantUsage] | None = None,
    c_eff: int | None = None,
    epoch: str | None = "epoch-0",
) -> RefreshRequest:
    return RefreshRequest(
        gateway_id=gid,
        epoch=epoch,
        inuse=(inuse0, inuse1, 0),
        wants=(wants0, wants1, 0),
        has=(has, 0, 0),
        has_total=has,
        tenants=tenants or {},
        c_eff_seen=c_eff,
    )


def test_doorman_fair_share_across_gateways() -> None:
    """C = 120, wants 1000 / 50 / 10 converge to 60 / 50 / 10 (reports carry has)."""
    coord = InProcessCoordinator(_one_class(120))
    wants = {"a": 1000, "b": 50, "c": 10}
    has = dict.fromkeys(wants, 0)
    history = []
    for rnd in range(4):
        for gid, w in wants.items():
            grant = coord.refresh(report(gid, w, has=has[gid]), 0.1 * rnd)
            has[gid] = grant.total
        history.append(dict(has))
        assert sum(has.values()) <= 120
    assert history[-1] == {"a": 60, "b": 50, "c": 10}
    assert history[2] == history[3]  # converged by the third round


def test_every_gateway_of_a_fleet_gets_a_bypass_credit() -> None:
    """C = 40 for two gateways: 3 % is one credit, so the pool is two, one each, and the
    class capacity is 38. (With one credit the gateway whose id sorted last was granted
    none, and refused every bypass request while the other's credit sat idle.)"""
    cfg = AdmissionConfig(budget=40, lease=LeaseConfig(expected_gateways=2))
    coord = InProcessCoordinator(cfg)
    for t in (0.0, 0.1, 0.2):
        grants = {gid: coord.refresh(report(gid), t) for gid in ("gw-a", "gw-b")}
    assert {gid: g.bypass for gid, g in grants.items()} == {"gw-a": 1, "gw-b": 1}
    assert all(g.total <= 38 for g in grants.values())
    # before its first lease each gateway of the fleet also counts on one credit
    local = GatewayAdmission(cfg, "gw-b")
    assert local.stats().bypass_limit == 1


def test_held_is_max_of_lease_has_and_inuse() -> None:
    coord = InProcessCoordinator(_one_class(100))
    assert coord.refresh(report("a", 100, inuse0=80, has=80), 0.0).total == 100  # alone
    assert coord.refresh(report("b", 100), 0.0).total == 0  # a holds its whole lease
    assert coord.refresh(report("a", 100, inuse0=80, has=100), 0.1).total == 50  # fair
    assert coord.refresh(report("b", 100), 0.1).total == 0  # a still admits on has = 100
    assert coord.refresh(report("a", 100, inuse0=80, has=50), 0.2).total == 50
    assert coord.refresh(report("b", 100), 0.2).total == 20  # a's 80 in flight stay held
    assert coord.refresh(report("a", 100, inuse0=45, has=50), 0.3).total == 50  # drained
    assert coord.refresh(report("b", 100, has=20), 0.3).total == 50
    assert coord.held_total() == 100


def test_idle_capacity_is_lent_as_headroom_and_the_p0_reserve_is_kept() -> None:
    cfg = AdmissionConfig(budget=256)  # K = 249, P0 reserve 88, bypass pool 7
    coord = InProcessCoordinator(cfg)
    g = coord.refresh(report("a"), 0.0)
    assert (g.grants, g.headroom, g.p0_reserve, g.bypass) == ((88, 0, 0), 161, 88, 7)

    def flood(gid: str, has: int, t: float) -> tuple[object, ...]:
        r = RefreshRequest(
            gateway_id=gid,
            epoch="epoch-0",
            inuse=(0, 0, 0),
            wants=(0, 300, 0),
            has=(0, 0, 0),
            has_total=has,
        )
        g = coord.refresh(r, t)
        return (g.grants, g.headroom, g.p0_reserve, g.bypass)

    assert flood("a", 249, 0.1) == ((88, 161, 0), 0, 88, 7)  # P1 flood, P0 idle
    assert flood("b", 0, 0.2) == ((0, 0, 0), 0, 0, 0)  # a holds everything
    assert flood("a", 249, 0.3) == ((44, 81, 0), 0, 44, 4)  # two gateways: halves
    assert flood("b", 0, 0.4) == ((0, 0, 0), 0, 0, 3)  # a's report still said 249
    assert flood("a", 125, 0.5) == ((44, 81, 0), 0, 44, 4)
    assert flood("b", 0, 0.6) == ((44, 80, 0), 0, 44, 3)  # converged: reserve 44 each


def test_idle_headroom_waits_for_the_expected_gateways_not_seen_yet() -> None:
    """A fleet of four starting: the first gateway to report is lent a quarter of the
    idle capacity, not all of it (the others' first requests would wait for its next
    refresh to give it back); once the four are live each holds a quarter."""
    cfg = AdmissionConfig(budget=256, lease=LeaseConfig(expected_gateways=4))  # K = 249
    coord = InProcessCoordinator(cfg)
    first = coord.refresh(report("a"), 0.0)
    assert first.headroom == 161 // 4  # the idle 161 over a and 3 unseen gateways
    for i, gid in enumerate(("b", "c", "d")):
        coord.refresh(report(gid), 0.1 * (i + 1))
    shares = [coord.refresh(report(g), 0.5).headroom for g in "abcd"]
    assert sum(shares) <= 161 and min(shares) >= 161 // 4 - 1


def test_a_lapsed_lease_is_held_while_its_gateway_may_reuse_it() -> None:
    """a stops refreshing (cut off alone: b still refreshes). Its gateway may admit on
    its last lease for reuse_timeout_s (5 s) past its deadline, so the coordinator
    lends that lease to nobody until a's TTL (2 s) and that window have passed."""
    coord = InProcessCoordinator(_one_class(100))
    coord.refresh(report("a", 100, inuse0=100, has=100), 0.0)
    assert coord.refresh(report("b", 100), 1.0).total == 0
    for t in (2.01, 4.0, 6.99):  # a's TTL passed, its reuse window not
        assert coord.refresh(report("b", 100), t).total == 0
    assert coord.refresh(report("b", 100), 7.01).total == 100
    coord.release_gateway("b")
    assert coord.records == {}


def test_a_gateway_back_within_its_reuse_window_keeps_its_record() -> None:
    coord = InProcessCoordinator(_one_class(100))
    coord.refresh(report("a", 100, inuse0=60, has=100), 0.0)
    coord.refresh(report("b", 100), 2.5)  # a lapsed: reusing
    assert coord.records["a"].reusing
    coord.refresh(report("a", 100, inuse0=60, has=100), 3.0)  # a reaches us again
    assert not coord.records["a"].reusing and coord.records["a"].expires_at == 5.0


def test_reclaim_grace_keeps_inuse_held_after_the_reuse_window() -> None:
    coord = InProcessCoordinator(_one_class(100, lease=LeaseConfig(reclaim_grace_s=10.0)))
    coord.refresh(report("a", 100, inuse0=70, has=100), 0.0)
    coord.refresh(report("b", 100), 1.0)  # b refreshes on: only a's record lapses
    g = coord.refresh(report("b", 100), 2.5)  # a lapsed at 2: its whole lease held ...
    assert g.total == 0 and g.gateways_live == 2
    for t in (3.5, 4.5, 5.5, 6.5):
        assert coord.refresh(report("b", 100), t).total == 0
    g = coord.refresh(report("b", 100), 7.5)  # ... until 2 + 5; then its in-use only
    assert g.total == 30 and g.gateways_live == 1
    for t in (8.5, 10.0, 11.5, 13.0, 14.5, 16.0, 16.9):  # a's in-use held until 7 + 10
        assert coord.refresh(report("b", 100, has=30), t).total == 30
    assert coord.refresh(report("b", 100, has=30), 17.1).total == 100


def test_tenant_quota_is_shared_across_gateways() -> None:
    coord = InProcessCoordinator(AdmissionConfig(budget=1000, tenant_quotas={"t": 10}))
    one = {"t": TenantUsage(inuse=1, wants=1, has=0)}
    ga = coord.refresh(report("a", tenants=one), 0.0)
    assert ga.tenant_grants == {"t": 10}  # alone: the whole quota, idle part as headroom
    gb = coord.refresh(report("b", tenants=one), 0.1)
    assert gb.tenant_grants == {"t": 0}  # a still holds all 10
    ga = coord.refresh(report("a", tenants={"t": TenantUsage(inuse=1, wants=1, has=10)}), 0.2)
    assert ga.tenant_grants == {"t": 5}
    assert coord.refresh(report("b", tenants=one), 0.25).tenant_grants == {"t": 0}
    ga = coord.refresh(report("a", tenants={"t": TenantUsage(inuse=1, wants=1, has=5)}), 0.3)
    assert ga.tenant_grants == {"t": 5}
    gb = coord.refresh(report("b", tenants=one), 0.35)
    assert gb.tenant_grants == {"t": 5}
    # idle at b, the tenant keeps a share there of what a does not want (b's next
    # request needs no round trip) ...
    idle = {"t": TenantUsage(inuse=0, wants=0, has=5)}
    assert coord.refresh(report("b", tenants=idle), 0.4).tenant_grants == {"t": 4}
    # ... until a wants it: b's next refresh gives it back, and a's gets it
    busy = {"t": TenantUsage(inuse=5, wants=9, has=5)}
    assert coord.refresh(report("a", tenants=busy), 0.5).tenant_grants == {"t": 5}
    assert coord.refresh(report("b", tenants={}), 0.6).tenant_grants == {"t": 0}
    assert coord.refresh(report("a", tenants=busy), 0.7).tenant_grants == {"t": 10}
    # in use nowhere, the tenant leaves the grants of the gateways that do not report it
    gone = {"t": TenantUsage(inuse=0, wants=0, has=10)}
    assert coord.refresh(report("a", tenants=gone), 0.8).tenant_grants == {"t": 5}
    assert coord.refresh(report("b", tenants={}), 0.9).tenant_grants == {}
    # unlimited tenants get no grant at all
    assert coord.refresh(report("a", tenants={"free": one["t"]}), 0.6).tenant_grants == {}


def test_learning_mode_after_an_epoch_change() -> None:
    coord = InProcessCoordinator(_one_class(100))
    coord.refresh(report("a", 100, has=60, inuse0=60), 0.0)
    coord.refresh(report("b", 100, has=40, inuse0=40), 0.0)
    coord.reset_epoch("epoch-1", 1.0)  # lost state (a Redis restart)
    g = coord.refresh(report("a", 100, has=60, inuse0=55), 1.1)
    assert g.learning and g.total == 60 and g.epoch == "epoch-1"  # echo max(has, inuse)
    g = coord.refresh(report("c", 100, epoch=None), 1.2)
    assert g.learning and g.total == 0  # a newcomer gets nothing while learning
    g = coord.refresh(report("b", 100, has=40, inuse0=40), 1.3)
    assert g.learning and g.total == 40
    # a and b reported the lost epoch: the state was lost, and a gateway cut off from the
    # coordinator may spend its old lease until a TTL plus reuse_timeout_s (5 s) after
    # the reset; nobody is lent anything before that
    g = coord.refresh(report("c", 100, epoch="epoch-1"), 3.1)  # one ttl later
    assert g.learning and g.total == 0
    for t in (4.5, 6.0, 7.5):  # a and b keep refreshing (no outage)
        coord.refresh(report("a", 100, has=60, inuse0=60, epoch="epoch-1"), t)
        coord.refresh(report("b", 100, has=40, inuse0=40, epoch="epoch-1"), t)
    g = coord.refresh(report("c", 100, epoch="epoch-1"), 8.1)  # ttl + reuse later
    assert not g.learning and g.total == 0  # a and b still hold all 100
    g = coord.refresh(report("a", 100, has=60, inuse0=30, epoch="epoch-1"), 8.2)
    assert not g.learning and g.total == 34  # fair share 33 (+1 remainder), not 60


def test_a_lost_state_is_learnt_until_a_cut_off_gateways_old_lease_ends() -> None:
    """Redis lost the state (a missing key: a fresh coordinator that learns on start)
    while c could not reach it. a and b report the epoch before, so the state was lost,
    not new: c may spend its old lease until a TTL plus reuse_timeout_s, and a and b
    were lent c's share after one TTL (3 gateways, K = 100: 133 in flight). A state
    that is new (nobody reports an older epoch) is learnt for one TTL, as before."""
    lost = InProcessCoordinator(_one_class(100), epoch="epoch-2", learn_on_start=True)
    for t in (0.0, 1.5, 3.0, 4.5, 6.0, 6.9):  # every 1.5 s, within a TTL (no outage)
        g = lost.refresh(report("a", 100, has=34, inuse0=34, epoch="epoch-1"), t)
        assert g.learning and g.total == 34, t  # echoed, never lent c's 33
        g = lost.refresh(report("b", 100, has=33, inuse0=33, epoch="epoch-1"), t + 0.05)
        assert g.learning and g.total == 33, t
    g = lost.refresh(report("a", 100, has=34, inuse0=34, epoch="epoch-2"), 7.1)
    assert not g.learning  # c's old lease cannot be spent past 0 + 2 + 5 s
    new = InProcessCoordinator(_one_class(100), epoch="epoch-2", learn_on_start=True)
    assert new.refresh(report("a", 100, epoch=None), 0.0).learning
    assert new.refresh(report("a", 100, epoch="epoch-2"), 1.5).learning
    assert not new.refresh(report("a", 100, epoch="epoch-2"), 2.1).learning


def test_a_gateway_reporting_an_old_epoch_is_echoed_for_one_ttl() -> None:
    coord = InProcessCoordinator(_one_class(100), epoch="epoch-7")
    g = coord.refresh(report("a", 100, has=30, epoch="epoch-6"), 0.0)
    assert g.learning and g.total == 30
    assert coord.refresh(report("a", 100, has=30, epoch="epoch-6"), 1.0).learning
    g = coord.refresh(report("a", 100, has=30, epoch="epoch-7"), 2.5)
    assert not g.learning and g.total == 100


def test_every_record_lapsed_means_an_outage_learnt_for_one_ttl() -> None:
    coord = InProcessCoordinator(_one_class(30))
    for gid in ("a", "b", "c"):
        coord.refresh(report(gid, 10, has=10, inuse0=10), 0.0)
    # nobody reached the coordinator for 10 s; a comes back first, with a queue
    g = coord.refresh(report("a", 100, has=10, inuse0=10), 10.0)
    assert g.learning and g.total == 10  # not 30: b and c still run their 10
    assert coord.refresh(report("b", 10, has=10, inuse0=10), 10.1).total == 10
    assert coord.refresh(report("c", 10, has=10, inuse0=10), 10.2).total == 10
    g = coord.refresh(report("a", 100, has=10, inuse0=10), 12.1)
    assert not g.learning and g.total == 10  # one ttl later: fair shares again


def test_c_eff_is_the_latest_reported_and_clamped_to_the_budget() -> None:
    coord = InProcessCoordinator(_one_class(100))
    assert coord.refresh(report("a", 500, c_eff=60), 0.0).total == 60
    assert coord.refresh(report("b", 500, c_eff=1000), 0.1).capacity == 100
    assert coord.refresh(report("a", 500, c_eff=0), 0.2).total == 0


def test_real_gateways_share_a_backlog_evenly() -> None:
    """Two backlogged gateways taking traffic from t = 0, 1 s requests: Σ <= C, ~half each.

    Both admit their start-up allowance (C / 2, P0 only) before their first report; the
    coordinator learns for its first TTL, so the first to report is not lent the
    capacity the other is already using.
    """
    cfg = _one_class(100, lease=LeaseConfig(expected_gateways=2))
    coord = InProcessCoordinator(cfg, learn_on_start=True)
    gws = [GatewayAdmission(cfg, n) for n in ("a", "b")]
    running: list[tuple[float, int, object]] = []
    served = [0, 0]
    for i, gw in enumerate(gws):
        for _ in range(1000):
            d = gw.admit(req(0), 0.0)
            if not isinstance(d, Queued):
                running.append((1.0, i, d.ticket))  # type: ignore[union-attr]
                served[i] += 1
    for step in range(1, 101):
        t = step * 0.1
        for end, i, ticket in [r for r in running if r[0] <= t]:
            running.remove((end, i, ticket))
            for a in gws[i].release(ticket, t):  # type: ignore[arg-type]
                running.append((t + 1.0, i, a.ticket))
                served[i] += 1
        for i, gw in enumerate(gws):
            if gw.refresh_due(t):
                for a in gw.apply_grant(coord.refresh(gw.make_refresh(t), t), t):
                    running.append((t + 1.0, i, a.ticket))
                    served[i] += 1
        assert sum(gw.inuse_total for gw in gws) <= 100
    assert sum(served) >= 900  # ~100 per second for 10 s
    assert abs(served[0] - served[1]) <= 0.1 * sum(served)


def test_mixed_p0_p1_overload_uses_the_whole_budget_fairly() -> None:
    """Five gateways, each sent P0 and P1 alike, far more than the budget. A gateway
    admits P0 on any free credit, so its P0 runs on its P1 grant too; the coordinator
    counted those credits twice (in-use for P0, grant for P1), or its P0 in-use against
    the P0 budget, and the leases settled at 20 of 26 credits, split 6 / 6 / 4 / 1 / 3,
    for good. Counted where they sit, every credit is lent: max-min by class."""
    cfg = AdmissionConfig(budget=31, lease=LeaseConfig(expected_gateways=5))
    coord = InProcessCoordinator(cfg)
    k = 31 - cfg.bypass_credits(31)
    gws = [GatewayAdmission(cfg, f"g{i}") for i in range(5)]
    live: list[list[Any]] = [[] for _ in gws]
    n = 0
    for step in range(400):
        now = step * 0.05
        for i, gw in enumerate(gws):
            for _ in range(3):
                n += 1
                d = gw.admit(req(n % 2), now)
                if isinstance(d, Admitted):
                    live[i].append(d.ticket)
            if live[i] and step % 2 == 0:  # one request ends every 0.1 s per gateway
                live[i] += [a.ticket for a in gw.release(live[i].pop(0), now)]
            live[i] += [a.ticket for a in gw.poll(now) if isinstance(a, Admitted)]
            if gw.refresh_due(now):
                grant = coord.refresh(gw.make_refresh(now), now)
                live[i] += [a.ticket for a in gw.apply_grant(grant, now)]
        totals = [gw.stats().lease_total for gw in gws]
        assert sum(gw.inuse_total for gw in gws) <= k
        if step >= 100:
            assert sum(totals) == k, (step, totals)
            assert max(totals) - min(totals) <= 2, (step, totals)
    assert sorted(gw.inuse_total for gw in gws) == [4, 5, 5, 6, 6]


def test_a_state_rolled_back_to_an_older_copy_lends_nothing_twice() -> None:
    """The store goes back to an older copy of the same epoch (a failover to a lagging
    replica, a restart from a snapshot): g1's lease grew since, and the copy lent g0
    the credits g1 was spending, 24 in flight for a budget of 20. The gateways report
    the state serial they last saw; one above the stored serial means a rollback, and
    the coordinator learns what they hold (as after a lost state) before lending."""
    cfg = AdmissionConfig(budget=22, lease=LeaseConfig(expected_gateways=2))
    k = 22 - cfg.bypass_credits(22)
    gws = [GatewayAdmission(cfg, f"g{i}") for i in range(2)]
    running: list[tuple[float, int, Any]] = []
    peak = 0

    def run(
        coord: InProcessCoordinator, start: float, end: float, per_tick: tuple[int, int],
        life: tuple[float, float],
    ) -> None:
        nonlocal peak
        for step in range(round((end - start) / 0.05)):
            now = start + step * 0.05
            for end_at, i, ticket in [r for r in running if r[0] <= now]:
                running.remove((end_at, i, ticket))
                running.extend((now + life[i], i, a.ticket) for a in gws[i].release(ticket, now))
            for i, gw in enumerate(gws):
                for _ in range(per_tick[i]):
                    d = gw.admit(req(0), now)
                    if isinstance(d, Admitted):
                        running.append((now + life[i], i, d.ticket))
                admits = [a for a in gw.poll(now) if isinstance(a, Admitted)]
                if gw.refresh_due(now):
                    grant = coord.refresh(gw.make_refresh(now), now)
                    admits += gw.apply_grant(grant, now)
                running.extend((now + life[i], i, a.ticket) for a in admits)
            peak = max(peak, sum(gw.inuse_total for gw in gws))

    coord = InProcessCoordinator(cfg)
    run(coord, 0.0, 3.0, (3, 0), (0.3, 0.3))  # g0 busy with short requests, g1 idle
    copy = dump_state(coord)
    run(coord, 3.0, 4.2, (0, 3), (0.3, 60.0))  # g0 drains; g1's long requests take over
    assert gws[1].inuse_total >= k // 2, [gw.inuse_total for gw in gws]
    restored = load_state(cfg, copy)  # the older copy comes back
    run(restored, 4.2, 13.0, (3, 3), (60.0, 60.0))
    assert peak <= k, peak  # 21 before
    # once what a cut-off gateway may hold has lapsed (TTL + reuse), all of it is lent
    assert sum(gw.inuse_total for gw in gws) == k


def test_a_gateway_cut_off_alone_spends_a_lease_nobody_else_is_lent() -> None:
    """A partial partition: a loses the coordinator at 0.5 s, b keeps refreshing, and
    both have more demand than C. While a still admits on its last lease (until its
    deadline plus reuse_timeout_s), the two together stay within K; before, the
    coordinator forgot a at its TTL and lent b a's lease (167 in flight for K 100)."""
    cfg = AdmissionConfig(budget=100, bypass_fraction=0.0, lease=LeaseConfig(expected_gateways=2))
    coord = InProcessCoordinator(cfg)
    gws = {"a": GatewayAdmission(cfg, "a"), "b": GatewayAdmission(cfg, "b")}
    n = 0

    def admit(g: GatewayAdmission, now: float) -> None:
        nonlocal n
        for _ in range(5):  # steady P0 demand beyond the budget
            n += 1
            g.admit(req(0, rid=f"r{n}"), now)

    for g in gws.values():
        g.apply_grant(coord.refresh(g.make_refresh(0.0), 0.0), 0.0)
        admit(g, 0.0)
    worst_while_reusing = 0
    t = 0.0
    while t < 9.0:
        t = round(t + 0.05, 3)
        for gid, g in gws.items():
            g.poll(t)
            if g.refresh_due(t):
                if gid == "a" and t >= 0.5:
                    g.refresh_failed(t)
                else:
                    g.apply_grant(coord.refresh(g.make_refresh(t), t), t)
            admit(g, t)
        total = gws["a"].inuse_total + gws["b"].inuse_total
        if gws["a"].lease_state is not LeaseState.SAFE:
            worst_while_reusing = max(worst_while_reusing, total)
    assert gws["a"].lease_state is LeaseState.SAFE  # the window did end
    assert 90 <= worst_while_reusing <= 100


def _p2_at_a_p0_at_b(p0_at_b: bool) -> tuple[GatewayAdmission, GatewayAdmission, list[Any], Any]:
    """Batch traffic (150 P2) fills gateway a; then 60 requests at gateway b, P0 or P2."""
    cfg = AdmissionConfig(
        budget=100, lease=LeaseConfig(expected_gateways=2), slo=SloConfig(p2_start=1.0)
    )
    coord = InProcessCoordinator(cfg)
    a, b = GatewayAdmission(cfg, "a"), GatewayAdmission(cfg, "b")
    held: list[Any] = []  # a's admitted P2 tickets

    def keep(items: Any) -> None:
        held.extend(x.ticket for x in items if isinstance(x, Admitted) and x.ticket.priority == 2)

    def tick(t: float) -> None:
        for g in (a, b):
            out = g.poll(t)
            if g.refresh_due(t):
                out += g.apply_grant(coord.refresh(g.make_refresh(t), t), t)
            if g is a:
                keep(out)

    tick(0.0)
    keep([a.admit(req(2, rid=f"p2-{i}"), 0.0) for i in range(150)])
    t = 0.0
    while t < 3.0:
        t = round(t + 0.05, 3)
        tick(t)
    for i in range(60):
        b.admit(req(0 if p0_at_b else 2, rid=f"b-{i}"), t)
    for _ in range(40):  # 2 s of refreshes: the coordinator sees b's demand
        t = round(t + 0.05, 3)
        tick(t)
    return a, b, held, (tick, t)


def test_p2_at_one_gateway_gives_credits_back_to_p0_waiting_at_another() -> None:
    """P2 keeps a credit for its request's whole life. P0 waiting at another gateway
    for credits P2 holds here beyond its grant used to wait out its queue timeout
    (nothing waited here, so nothing was reclaimed): 26 P0 requests timed out."""
    a, b, held, (tick, t) = _p2_at_a_p0_at_b(p0_at_b=True)
    waiting = b.queued_total
    n = a.p2_to_reclaim()
    assert waiting > 0 and 0 < n <= waiting
    for ticket in held[-n:]:  # the controller ends the youngest
        a.release(ticket, t)
    for _ in range(20):
        t = round(t + 0.05, 3)
        tick(t)
    assert b.queued_total == 0 and b.inuse_total == 60


def test_p2_ends_no_p2_for_another_gateways_p2() -> None:
    a, b, _held, _ = _p2_at_a_p0_at_b(p0_at_b=False)
    assert b.queued_total > 0 and a.p2_to_reclaim() == 0


def test_a_fleet_clock_stepped_back_neither_rewinds_nor_freezes_deadlines() -> None:
    """Redis's TIME is a wall clock: stepped back an hour, a gateway's record would
    have been held an hour past its TTL (its deadline an hour in the new clock's
    future). Time now goes on from the last refresh at the clock's pace."""
    coord = InProcessCoordinator(_one_class(100, lease=LeaseConfig(reuse_timeout_s=0.0)))
    coord.refresh(report("a", 100, inuse0=100, has=100), 3600.0)  # a, then a dies
    assert coord.refresh(report("b", 100), 3601.0).total == 0
    assert coord.refresh(report("b", 100), 1.5).total == 0  # stepped back: 3601 again
    assert coord.refresh(report("b", 100), 2.6).total == 100  # 3602.1: a's TTL passed


def test_the_fleet_clock_offset_survives_the_store() -> None:
    coord = InProcessCoordinator(_one_class(100))
    coord.refresh(report("a", 10), 3600.0)
    coord.refresh(report("a", 10), 5.0)
    again = load_state(coord.config, dump_state(coord))
    assert (again.clock_s, again.clock_offset_s) == (3600.0, 3595.0)


def test_an_idle_quota_tenant_lets_its_lease_go() -> None:
    """A tenant with a lease and nothing in use or asked was reported, and granted a
    share of its quota, at every refresh forever: one per API key ever seen, each
    refresh slower and the shared state larger. Idle past TENANT_IDLE_FORGET_S it is
    let go; busy again, it asks anew."""
    from kvgate.core.admission.gateway import TENANT_IDLE_FORGET_S

    cfg = AdmissionConfig(budget=100, default_tenant_quota=4)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")

    def refresh(t: float) -> Any:
        sent = gw.make_refresh(t)
        gw.apply_grant(coord.refresh(sent, t), t)
        return sent

    refresh(0.0)
    admitted = gw.admit(req(1, "alice", rid="a1"), 0.1)
    assert isinstance(admitted, Admitted)
    refresh(0.2)
    gw.release(admitted.ticket, 0.3)
    t = 0.5
    while t < 0.5 + TENANT_IDLE_FORGET_S - 1:  # idle, within the time: still held
        assert "alice" in refresh(t).tenants
        t += 0.5
    t += 2.0
    refresh(t)  # idle past it: let go here ...
    assert "alice" not in refresh(t + 0.5).tenants  # ... and at the coordinator
    assert "alice" not in coord.records["g"].tenants
    later = gw.admit(req(1, "alice", rid="a2"), t + 1.0)  # busy again: it asks anew
    if not isinstance(later, Admitted):
        refresh(t + 1.05)
    assert "alice" in refresh(t + 1.1).tenants


def test_a_rollback_is_noticed_whichever_gateway_reports_first() -> None:
    """The copy lost only g1's last grant; g0 reports first and the fleet's refresh
    count passes g1's lost serial again. Each record keeps the serial of its last grant,
    so g1's report is still seen as newer than the state."""
    cfg = AdmissionConfig(budget=22, lease=LeaseConfig(expected_gateways=2))
    coord = InProcessCoordinator(cfg)
    gws = [GatewayAdmission(cfg, f"g{i}") for i in range(2)]
    now = 0.0
    for _ in range(5):  # a few rounds of refreshes
        now += 0.5
        for gw in gws:
            gw.apply_grant(coord.refresh(gw.make_refresh(now), now), now)
    copy = dump_state(coord)
    now += 0.5
    gws[1].apply_grant(coord.refresh(gws[1].make_refresh(now), now), now)  # the lost grant
    restored = load_state(cfg, copy)
    now += 0.1
    first = restored.refresh(gws[0].make_refresh(now), now)
    assert not first.learning  # g0 lost nothing, and its serial says so
    second = restored.refresh(gws[1].make_refresh(now), now)
    assert second.learning  # g1 saw a grant the state never made
    # without a rollback the same order learns nothing
    plain = load_state(cfg, dump_state(coord))
    assert not plain.refresh(gws[0].make_refresh(now), now).learning
    assert not plain.refresh(gws[1].make_refresh(now), now).learning


def test_learning_echoes_what_a_gateway_holds_not_a_borrowed_credit_twice() -> None:
    """After lost state a gateway is echoed max(its lease, its in flight). A P0 running
    on P1's credit is in inuse[0] and in has[1]; summing max(has[c], inuse[c]) per class
    counted it twice, and the first gateway to report grew out of the share of one that
    had not reported yet (K = 20: 13 echoed to a gateway holding 10, the fleet at 23)."""
    coord = InProcessCoordinator(AdmissionConfig(budget=20, bypass_fraction=0.0))
    coord.reset_epoch("epoch-1", 0.0)
    held = RefreshRequest(
        gateway_id="a",
        epoch="epoch-0",
        inuse=(10, 0, 0),  # 7 on its P0 credits and 3 on P1's
        wants=(10, 0, 0),
        has=(7, 3, 0),
        has_total=10,
        tenants={},
    )
    g = coord.refresh(held, 0.1)
    assert g.learning and g.total == 10 and sum(g.grants) == 10


def test_a_non_finite_clock_is_refused() -> None:
    """Every expiry test is False at NaN: a refresh at NaN dropped every other gateway's
    lease record (their reservations lent again)."""
    coord = InProcessCoordinator(_one_class(100))
    coord.refresh(report("a", 100, has=60, inuse0=60), 0.0)
    held = coord.held_total()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="coordinator clock must be a finite number"):
            coord.refresh(report("b", 100), bad)
    assert set(coord.records) == {"a"} and coord.held_total() == held > 0
