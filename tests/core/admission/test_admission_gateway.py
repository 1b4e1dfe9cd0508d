"""Stage 1 at one gateway: the class rule, the order of checks, bypass, tenants, breaker."""

from __future__ import annotations

from typing import Any

import pytest
from admission_testlib import (
    FlakyCoordinator,
    fill,
    kind,
    lease,
    leased_gateway,
    req,
    sync_refresh,
)

from kvgate.core.admission import (
    AdmissionConfig,
    Admitted,
    BreakerState,
    GatewayAdmission,
    InProcessCoordinator,
    LeaseConfig,
    Queued,
    Rejected,
    RejectReason,
)
from kvgate.core.errors import InvariantViolation

# name, lease kwargs, prefill [(class, n)], arriving class, expected decision
CLASS_RULE: list[tuple[str, dict[str, Any], list[tuple[int, int]], int, str]] = [
    ("empty: P0 in", {"grants": (4, 4, 0), "headroom": 2, "p0_reserve": 2}, [], 0, "Admitted"),
    ("empty: P1 in", {"grants": (4, 4, 0), "headroom": 2, "p0_reserve": 2}, [], 1, "Admitted"),
    ("P2 without its own grant waits", {"grants": (4, 4, 0), "headroom": 2}, [], 2, "Queued"),
    # P1 borrows P0's unused grant, but not P0's unlendable reserve (2 of 10)
    (
        "P1 to the reserve",
        {"grants": (4, 4, 0), "headroom": 2, "p0_reserve": 2},
        [(1, 8)],
        1,
        "Queued",
    ),
    (
        "P0 takes any free credit",
        {"grants": (4, 4, 0), "headroom": 2, "p0_reserve": 2},
        [(1, 8)],
        0,
        "Admitted",
    ),
    # the reserve is P0's *unused* reserve: once P0 uses one, P1 may use one more
    (
        "reserve net of P0 use",
        {"grants": (4, 4, 0), "headroom": 2, "p0_reserve": 2},
        [(0, 1), (1, 7)],
        1,
        "Admitted",
    ),
    ("total in use: all wait", {"grants": (4, 4, 0), "headroom": 2}, [(0, 4), (1, 6)], 0, "Queued"),
    # Netflix work conservation: P1's own grant binds only when the total is in use
    ("P1 beyond its grant", {"grants": (5, 2, 0), "headroom": 3}, [(1, 9)], 1, "Admitted"),
    # ... except while the SLO loop holds P1 back (ceiling < 1): its grant binds
    (
        "P1 at its SLO ceiling",
        {"grants": (4, 3, 0), "headroom": 3, "ceilings": (1.0, 0.5, 1.0)},
        [(1, 3)],
        1,
        "Queued",
    ),
    (
        "P0 unaffected by ceiling",
        {"grants": (4, 3, 0), "headroom": 3, "ceilings": (1.0, 0.5, 1.0)},
        [(1, 3)],
        0,
        "Admitted",
    ),
    # P2: only its own grant (idle capacity), even when credits are free
    ("P2 own grant", {"grants": (4, 3, 2), "headroom": 1}, [(2, 2)], 2, "Queued"),
    ("P2 within grant", {"grants": (4, 3, 2), "headroom": 1}, [(2, 1)], 2, "Admitted"),
    # P2 never eats P0's reserve: grant 9, reserve 1 -> at most 9 of 10, 1 left for P0
    ("P2 leaves P0 reserve", {"grants": (1, 0, 9), "p0_reserve": 1}, [(2, 9)], 2, "Queued"),
    ("P0 finds its reserve", {"grants": (1, 0, 9), "p0_reserve": 1}, [(2, 9)], 0, "Admitted"),
]


@pytest.mark.parametrize(
    ("name", "grant", "prefill", "arrival", "expected"), CLASS_RULE, ids=[r[0] for r in CLASS_RULE]
)
def test_class_rule(
    name: str, grant: dict[str, Any], prefill: list[tuple[int, int]], arrival: int, expected: str
) -> None:
    gw = leased_gateway(lease(**grant))
    for priority, n in prefill:
        fill(gw, n, priority)
    assert kind(gw.admit(req(arrival), 0.1)) == expected


def test_work_conservation_rejects_only_at_the_total() -> None:
    """Netflix useExcessCapacityUntilTotalLimit: any mix fills the whole lease, no more."""
    for p0, p1 in ((10, 0), (0, 10), (3, 7), (7, 3)):
        gw = leased_gateway(lease((5, 5, 0)))
        fill(gw, p0, 0)
        fill(gw, p1, 1)
        assert gw.inuse_total == 10
        assert isinstance(gw.admit(req(0), 0.1), Queued)
        assert isinstance(gw.admit(req(1), 0.1), Queued)


def test_bypass_lane_at_saturation() -> None:
    gw = leased_gateway(lease((6, 4, 0), bypass=2))
    fill(gw, 10, 0)
    assert isinstance(gw.admit(req(1), 0.0), Queued)
    a = gw.admit(req(1, bypass=True), 0.0)
    b = gw.admit(req(2, bypass=True), 0.0)
    assert isinstance(a, Admitted) and a.ticket.lane == "bypass"
    assert isinstance(b, Admitted)
    c = gw.admit(req(1, bypass=True), 0.0)  # the pool itself is exhausted
    assert isinstance(c, Rejected)
    assert (c.reason, c.http_status, c.retryable_by_client) == (RejectReason.OVERLOADED, 503, False)
    assert gw.release(a.ticket, 0.1) == []  # a bypass credit frees no class credit
    assert isinstance(gw.admit(req(1, bypass=True), 0.1), Admitted)
    assert gw.stats().bypass_inuse == 2 and gw.inuse_total == 10


def test_fill_raises_if_not_admitted() -> None:
    gw = leased_gateway(lease((1, 0, 0)))
    with pytest.raises(AssertionError):
        fill(gw, 2, 0)


def test_validation_comes_before_quota_and_is_never_queued() -> None:
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"t": 0})
    gw = leased_gateway(lease((1, 0, 0)), cfg)
    too_long = gw.admit(req(0, "t", prompt_tokens=5000, max_seq_len=4096), 0.0)
    assert isinstance(too_long, Rejected)
    assert (too_long.reason, too_long.http_status) == (RejectReason.INVALID_REQUEST, 400)
    assert too_long.retryable_by_client is False
    fits = gw.admit(req(0, "t", prompt_tokens=4096, max_seq_len=4096), 0.0)
    assert isinstance(fits, Rejected) and fits.reason is RejectReason.TENANT_QUOTA
    # unknown max_seq_len: not validated here
    fill(gw, 1, 0, tenant="u", prompt_tokens=10**6, max_seq_len=None)
    # saturated: still INVALID, not queued
    again = gw.admit(req(1, "u", prompt_tokens=5000, max_seq_len=10), 0.0)
    assert isinstance(again, Rejected) and again.reason is RejectReason.INVALID_REQUEST


def test_tenant_quota_with_retry_after() -> None:
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"small": 2}, tenant_retry_after_s=1.5)
    gw = leased_gateway(lease((10, 10, 0), tenants={"small": 2}), cfg)
    tickets = fill(gw, 2, 1, tenant="small")
    r = gw.admit(req(1, "small"), 0.0)
    assert isinstance(r, Rejected)
    assert (r.reason, r.http_status, r.retry_after_s) == (RejectReason.TENANT_QUOTA, 429, 1.5)
    assert r.retryable_by_client is False
    fill(gw, 5, 1, tenant="other")  # other tenants are unaffected (no quota = unlimited)
    gw.release(tickets[0], 0.1)
    assert isinstance(gw.admit(req(1, "small"), 0.1), Admitted)
    # denied demand is reported as wants, so the lease can grow where it is needed
    report = gw.make_refresh(0.2)
    assert report.tenants["small"].inuse == 2 and report.tenants["small"].wants == 2
    assert "other" not in report.tenants


def test_queued_requests_hold_their_tenant_slot() -> None:
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"t": 3})
    gw = leased_gateway(lease((1, 0, 0), tenants={"t": 3}), cfg)
    fill(gw, 1, 0, tenant="t")
    assert isinstance(gw.admit(req(0, "t"), 0.0), Queued)
    assert isinstance(gw.admit(req(0, "t"), 0.0), Queued)
    r = gw.admit(req(0, "t"), 0.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.TENANT_QUOTA
    assert gw.tenant_slots("t") == 3


FLEET_OF_TWO = LeaseConfig(expected_gateways=2)


def test_a_gateway_that_is_the_whole_fleet_admits_a_new_tenant_up_to_its_quota() -> None:
    """One gateway, expected and live alone: nobody else can hold the tenant's quota,
    so its first requests need no round trip to the coordinator."""
    cfg = AdmissionConfig(budget=1000, default_tenant_quota=3)
    gw = leased_gateway(lease((10, 10, 0)), cfg)
    fill(gw, 3, 1, 0.1, tenant="new")
    r = gw.admit(req(1, "new"), 0.1)
    assert isinstance(r, Rejected) and r.reason is RejectReason.TENANT_QUOTA


def test_a_tenant_the_lease_has_no_entry_for_waits_for_its_grant() -> None:
    """No first-sight credit by default: the tenant's requests park (Queued, no slot)
    until the early refresh's grant, which admits them; beyond its whole quota a
    request is refused at once, since no grant could let it in."""
    cfg = AdmissionConfig(budget=1000, default_tenant_quota=4, lease=FLEET_OF_TWO)
    gw = leased_gateway(lease((10, 10, 0), live=2), cfg)
    assert not gw.refresh_due(0.1)
    parked = [gw.admit(req(1, "new"), 0.1) for _ in range(4)]
    assert all(isinstance(d, Queued) for d in parked)
    r = gw.admit(req(1, "new"), 0.1)
    assert isinstance(r, Rejected) and r.reason is RejectReason.TENANT_QUOTA
    assert gw.tenant_slots("new") == 0 and gw.stats().tenant_queued == {"new": 4}
    assert gw.pressed.at("new") is None  # refused before any lease: not pressing
    assert gw.refresh_due(0.1)  # an early refresh asks for the tenant's grant
    report = gw.make_refresh(0.1)
    assert report.tenants["new"].wants == 4 and report.tenants["new"].inuse == 0
    coord = InProcessCoordinator(cfg)
    got = gw.apply_grant(coord.refresh(report, 0.1), 0.1)
    assert [a.ticket.request_id for a in got] == [d.request_id for d in parked]
    assert gw.stats().tenant_limits["new"] == 4 and gw.tenant_slots("new") == 4
    assert gw.poll(0.2) == [] and gw.queued_total == 0


def test_a_parked_tenant_is_refused_when_other_gateways_hold_its_quota() -> None:
    """Two gateways, quota 2: A holds both; B's request waits for B's grant (0) and is
    refused, so the fleet never holds more than the quota."""
    cfg = AdmissionConfig(budget=100, tenant_quotas={"t": 2}, lease=FLEET_OF_TWO)
    coord = InProcessCoordinator(cfg)
    a, b = GatewayAdmission(cfg, "a"), GatewayAdmission(cfg, "b")
    for t in (0.0, 0.05):  # two rounds: each gateway's lease counts the other
        for gw in (a, b):
            gw.apply_grant(coord.refresh(gw.make_refresh(t), t), t)
    assert isinstance(a.admit(req(0, "t"), 0.1), Queued)  # parked at A too: ask first
    a.apply_grant(coord.refresh(a.make_refresh(0.1), 0.1), 0.1)
    fill(a, 1, 0, 0.2, tenant="t")
    assert a.tenant_slots("t") == 2
    a.apply_grant(coord.refresh(a.make_refresh(0.25), 0.25), 0.25)  # A reports them
    d = b.admit(req(0, "t"), 0.3)
    assert isinstance(d, Queued) and b.tenant_slots("t") == 0
    assert b.apply_grant(coord.refresh(b.make_refresh(0.3), 0.3), 0.3) == []
    out = b.poll(0.3)
    assert len(out) == 1 and isinstance(out[0], Rejected)
    assert out[0].reason is RejectReason.TENANT_QUOTA and out[0].request_id == d.request_id
    assert a.tenant_slots("t") + b.tenant_slots("t") == 2 and b.queued_total == 0


def test_a_parked_tenant_waits_while_its_quota_has_room_in_another_gateways_lease() -> None:
    """A grant that leaves the tenant nothing here while the fleet does not fill its
    quota (other gateways' leases hold it until their next refresh) keeps the request
    waiting for a later grant instead of refusing it; a request parked after the
    refresh was sent waits for the next one."""
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"t": 10}, lease=FLEET_OF_TWO)
    gw = leased_gateway(lease((10, 10, 0), live=2), cfg)
    d = gw.admit(req(0, "t"), 0.1)
    assert isinstance(d, Queued)
    gw.make_refresh(0.1)
    late = gw.admit(req(0, "t"), 0.15)  # parked while that refresh is in flight
    assert gw.apply_grant(lease((10, 10, 0), tenants={"t": 0}, live=2), 0.2) == []
    assert gw.poll(0.2) == [] and gw.queued_total == 2
    gw.make_refresh(0.3)
    got = gw.apply_grant(lease((10, 10, 0), tenants={"t": 1}, live=2), 0.3)
    assert [g.ticket.request_id for g in got] == [d.request_id]
    assert gw.poll(0.3) == [] and gw.queued_total == 1  # late waits for more
    gw.make_refresh(0.4)
    got = gw.apply_grant(lease((10, 10, 0), tenants={"t": 2}, live=2), 0.4)
    assert [g.ticket.request_id for g in got] == [late.request_id]


def test_a_parked_request_times_out_is_cancelled_or_settles_without_a_coordinator() -> None:
    cfg = AdmissionConfig(budget=1000, default_tenant_quota=4, lease=FLEET_OF_TWO)
    gw = leased_gateway(lease((10, 10, 0), ttl_s=2.0, live=2), cfg)
    first = gw.admit(req(0, "new"), 0.1)
    second = gw.admit(req(0, "new"), 0.1)
    assert isinstance(first, Queued) and isinstance(second, Queued)
    assert gw.cancel(first.request_id, 0.2) and gw.queued_total == 1
    # the coordinator is gone: once the lease is SAFE the tenant gets an even share
    gw.make_refresh(0.3)
    gw.refresh_failed(0.3)
    assert gw.poll(1.0) == []  # still EXPIRED_REUSING: waiting
    out = gw.poll(10.0)  # SAFE: an even share, 4 // 2
    assert [type(o) for o in out] == [Admitted] and out[0].ticket.request_id == second.request_id
    assert gw.tenant_slots("new") == 1
    late = leased_gateway(lease((10, 10, 0), gateway_id="g2", live=2), cfg)
    p = late.admit(req(0, "new", deadline=0.5), 0.0)  # the client's own deadline
    assert isinstance(p, Queued) and p.deadline == 0.5
    assert late.poll(0.4) == []
    out = late.poll(0.51)
    assert len(out) == 1 and isinstance(out[0], Rejected)
    assert out[0].reason is RejectReason.QUEUE_TIMEOUT and late.queued_total == 0


def test_a_tenant_refused_at_its_quota_presses_it_but_not_one_whose_lease_grows() -> None:
    """Refused while holding its fair share of its quota (here all of it: one gateway), a
    tenant asks for more than its quota; refused on a lease smaller than its fair share,
    its lease is merely catching up with its demand."""
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"small": 2}, default_tenant_quota=4)
    gw = leased_gateway(lease((10, 10, 0), tenants={"small": 2, "grows": 1}), cfg)
    fill(gw, 2, 1, tenant="small")
    assert gw.pressed.at("small") is None
    assert isinstance(gw.admit(req(1, "small"), 3.0), Rejected)
    assert gw.pressed.at("small") == 3.0
    fill(gw, 1, 1, tenant="grows")  # a lease of 1 of a quota of 4
    assert isinstance(gw.admit(req(1, "grows"), 3.5), Queued)  # the lease may grow: ask
    grants = {"small": 2, "grows": 1}
    gw.make_refresh(4.0)
    assert gw.apply_grant(lease((10, 10, 0), tenants=grants), 4.0) == []
    assert gw.poll(4.0) == [] and gw.queued_total == 1  # the quota has room: wait on
    gw.make_refresh(4.5)  # the fleet fills the quota: refused now
    assert gw.apply_grant(lease((10, 10, 0), tenants=grants, full=frozenset(grants)), 4.5) == []
    (r,) = gw.poll(4.5)
    assert isinstance(r, Rejected) and r.reason is RejectReason.TENANT_QUOTA
    assert gw.pressed.at("grows") is None


def test_check_order_quota_then_breaker() -> None:
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"t": 0})
    gw = leased_gateway(lease((5, 5, 0)), cfg)
    gw.set_cluster_capacity(healthy_capacity=0, healthy_nodes=0, now=0.0)
    r = gw.admit(req(0, "t"), 0.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.TENANT_QUOTA
    r = gw.admit(req(0, "u"), 0.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.BREAKER_OPEN
    assert "no healthy node" in r.message and r.http_status == 503
    assert isinstance(gw.admit(req(0, bypass=True), 0.0), Rejected)  # no bypass pool here


def test_breaker_opens_on_error_rate_half_opens_and_closes() -> None:
    gw = leased_gateway(lease((50, 50, 0)))
    for i in range(19):  # 19 outcomes, 10 failures: below the minimum of 20
        gw.record_outcome(i % 2 == 0, 1.0)
    assert gw.breaker_state is BreakerState.CLOSED
    gw.record_outcome(False, 1.0)  # 20 outcomes, 50 % failures
    assert gw.breaker_state is BreakerState.OPEN
    r = gw.admit(req(0), 2.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.BREAKER_OPEN
    assert r.retry_after_s == pytest.approx(4.0) and r.retryable_by_client
    # after open_s (5 s): half-open, 3 probes
    probes = [gw.admit(req(0), 6.0) for _ in range(4)]
    assert [kind(p) for p in probes] == ["Admitted", "Admitted", "Admitted", "Rejected"]
    gw.record_outcome(True, 6.5)
    gw.record_outcome(True, 6.6)
    assert gw.breaker_state is BreakerState.HALF_OPEN
    gw.record_outcome(True, 6.7)
    assert gw.breaker_state is BreakerState.CLOSED
    assert isinstance(gw.admit(req(0), 6.8), Admitted)


def test_breaker_half_open_failure_reopens() -> None:
    gw = leased_gateway(lease((50, 50, 0)))
    for _ in range(20):
        gw.record_outcome(False, 0.0)
    assert gw.breaker_state is BreakerState.OPEN
    assert isinstance(gw.admit(req(0), 5.0), Admitted)  # half-open probe
    gw.record_outcome(False, 5.1)
    assert gw.breaker_state is BreakerState.OPEN
    assert isinstance(gw.admit(req(0), 5.2), Rejected)
    assert isinstance(gw.admit(req(0), 10.2), Admitted)


def test_breaker_ignores_client_errors_and_hands_back_their_probe() -> None:
    gw = leased_gateway(lease((50, 50, 0)))
    for _ in range(40):
        gw.record_ignored(1.0)
    assert gw.breaker_state is BreakerState.CLOSED
    for _ in range(20):
        gw.record_outcome(False, 2.0)
    assert gw.breaker_state is BreakerState.OPEN
    probes = [gw.admit(req(0), 7.5) for _ in range(3)]
    assert [kind(p) for p in probes] == ["Admitted"] * 3
    assert kind(gw.admit(req(0), 7.5)) == "Rejected"
    gw.record_ignored(7.6)  # a probe that was the client's own bad request proves nothing
    assert isinstance(gw.admit(req(0), 7.7), Admitted)  # ... so another probe may go
    assert kind(gw.admit(req(0), 7.7)) == "Rejected"
    for t in (7.8, 7.9, 8.0):
        gw.record_outcome(True, t)
    assert gw.breaker_state is BreakerState.CLOSED


def test_breaker_window_slides() -> None:
    gw = leased_gateway(lease((50, 50, 0)))
    for _ in range(15):
        gw.record_outcome(False, 0.0)
    for _ in range(15):
        gw.record_outcome(True, 10.5)  # the failures are out of the 10 s window now
    gw.record_outcome(False, 10.5)
    assert gw.breaker_state is BreakerState.CLOSED


def test_no_healthy_node_opens_and_recovery_closes() -> None:
    gw = leased_gateway(lease((5, 5, 0)))
    gw.set_cluster_capacity(healthy_capacity=0, healthy_nodes=0, now=0.0)
    assert gw.breaker_state is BreakerState.OPEN
    assert gw.stats().breaker_reason == "no healthy node"
    queued = gw.admit(req(0, bypass=False), 0.0)
    assert isinstance(queued, Rejected)
    gw.set_cluster_capacity(healthy_capacity=1000, healthy_nodes=2, now=1.0)
    assert gw.breaker_state is BreakerState.CLOSED
    assert isinstance(gw.admit(req(0), 1.0), Admitted)


def test_c_eff_follows_healthy_capacity() -> None:
    cfg = AdmissionConfig(budget=256)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")
    gw.apply_grant(coord.refresh(gw.make_refresh(0.0), 0.0), 0.0)
    assert gw.lease_total == 249  # 256 minus a bypass pool of 7
    gw.set_cluster_capacity(healthy_capacity=1000, healthy_nodes=8, now=0.1)
    assert gw.c_eff == 256  # never above the configured budget
    gw.set_cluster_capacity(healthy_capacity=128, healthy_nodes=4, now=0.2)
    assert gw.c_eff == 128
    assert gw.lease_total == 124  # shrunk in proportion at once, before any refresh
    assert gw.refresh_due(0.25)  # and an early refresh tells the coordinator
    report = gw.make_refresh(0.25)
    assert report.c_eff_seen == 128
    grant = coord.refresh(report, 0.25)
    assert coord.capacity == 128 and grant.capacity == 128
    gw.apply_grant(grant, 0.25)
    assert gw.lease_total == 128 - 3
    tickets = fill(gw, 125, 0, now=0.3)
    assert isinstance(gw.admit(req(0), 0.3), Queued)
    gw.release(tickets[0], 0.4)


def test_release_dispatches_and_double_release_is_a_bug() -> None:
    gw = leased_gateway(lease((1, 0, 0)))
    (t,) = fill(gw, 1, 0)
    q = gw.admit(req(0, rid="waiting"), 0.0)
    assert isinstance(q, Queued)
    out = gw.release(t, 0.5)
    assert [a.ticket.request_id for a in out] == ["waiting"]
    with pytest.raises(InvariantViolation):
        gw.release(t, 0.6)
    other = leased_gateway(lease((1, 0, 0), gateway_id="h"))
    with pytest.raises(InvariantViolation):
        other.release(out[0].ticket, 0.6)


def test_stats_snapshot() -> None:
    cfg = AdmissionConfig(budget=1000, tenant_quotas={"a": 5})
    gw = leased_gateway(lease((2, 1, 0), tenants={"a": 5}), cfg)
    fill(gw, 2, 0, tenant="a")
    fill(gw, 1, 1, tenant="b")
    gw.admit(req(1, "a"), 0.0)
    gw.admit(req(0, "a", prompt_tokens=10**6), 0.0)
    s = gw.stats()
    assert s.inuse == (2, 1, 0) and s.inuse_total == 3 and s.queued == (0, 1, 0)
    assert s.tenant_inflight == {"a": 2, "b": 1} and s.tenant_queued == {"a": 1}
    assert s.admitted == (2, 1, 0)
    assert s.rejected == {(RejectReason.INVALID_REQUEST, 0): 1}
    assert s.lease_state.value == "active" and not s.degraded
    with pytest.raises(AttributeError):
        s.inuse_total = 5  # type: ignore[misc]


def test_a_half_open_breaker_whose_probes_never_report_sends_new_ones() -> None:
    """Probes whose requests end with no outcome (the client gave up, no node could take
    them, they timed out queued) held the breaker half-open with no probe left: every
    request refused until a restart. After open_s with no verdict, new probes go."""
    gw = leased_gateway(lease((50, 50, 0)))
    for _ in range(20):
        gw.record_outcome(False, 0.0)
    probes = [gw.admit(req(0), 5.0) for _ in range(4)]  # open_s = 5 s: 3 probes
    assert [kind(p) for p in probes] == ["Admitted"] * 3 + ["Rejected"]
    assert kind(gw.admit(req(0), 9.9)) == "Rejected"  # their verdict may still come
    again = [gw.admit(req(0), 10.0) for _ in range(4)]
    assert gw.breaker_state is BreakerState.HALF_OPEN
    assert [kind(p) for p in again] == ["Admitted"] * 3 + ["Rejected"]
    for t in (10.1, 10.2, 10.3):
        gw.record_outcome(True, t)
    assert gw.breaker_state is BreakerState.CLOSED


def test_requests_not_admitted_now_leave_a_half_open_breakers_probes_alone() -> None:
    """A P2 request refused in safe mode, or one queued, took a probe and gave nothing
    back: P2 traffic left P0 refused with breaker_open while the breaker was half-open."""
    gw = leased_gateway(lease((40, 40, 10), capacity=100, safe_capacity=90),
                        AdmissionConfig(budget=100), now=0.0)
    gw.make_refresh(0.5)
    gw.refresh_failed(0.5)  # the coordinator is lost: safe mode refuses P2
    gw.poll(7.0)
    for _ in range(20):
        gw.record_outcome(False, 7.0)
    gw.poll(12.1)  # open_s later: half-open, 3 probes
    assert gw.breaker_state is BreakerState.HALF_OPEN
    for _ in range(5):
        r = gw.admit(req(2, tenant="batch"), 12.1)
        assert isinstance(r, Rejected) and r.reason is RejectReason.DEGRADED
    assert [kind(gw.admit(req(0), 12.1)) for _ in range(4)] == ["Admitted"] * 3 + ["Rejected"]


def test_a_queued_request_is_not_overtaken_by_a_worse_class_when_capacity_returns() -> None:
    """A node went down and came back: the limits grew without a dispatch, and until the
    next poll a P1 arrival took the credit a queued P0 waited for."""
    cfg = AdmissionConfig(budget=10, bypass_fraction=0.0)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")
    gw.set_cluster_capacity(10, 2, 0.0)
    sync_refresh(gw, coord, 0.0)
    fill(gw, 5, 0, 0.1)
    gw.set_cluster_capacity(5, 1, 0.2)  # a node down: the limits halve at once
    assert isinstance(gw.admit(req(0), 0.3), Queued)
    gw.set_cluster_capacity(10, 2, 0.4)  # back: room again, nothing dispatched yet
    assert isinstance(gw.admit(req(1), 0.41), Queued)  # behind the P0, not before it
    served = gw.poll(0.42)
    assert [a.ticket.priority for a in served if isinstance(a, Admitted)] == [0, 1]


def test_a_quota_below_the_gateways_count_is_never_exceeded_without_a_coordinator() -> None:
    """Each gateway's share was at least 1: quota 2 over 3 gateways that never reached
    their coordinator let 3 requests of the tenant run."""
    cfg = AdmissionConfig(budget=90, tenant_quotas={"acme": 2, "big": 6},
                          lease=LeaseConfig(expected_gateways=3))
    coord = FlakyCoordinator(InProcessCoordinator(cfg))
    coord.down = True
    gws = [GatewayAdmission(cfg, f"gw{i}") for i in range(3)]
    for g in gws:
        sync_refresh(g, coord, 0.0)
    for tenant, quota in (("acme", 2), ("big", 6)):
        for g in gws:
            for _ in range(3):
                g.admit(req(0, tenant=tenant), 0.1)
        assert sum(g.tenant_slots(tenant) for g in gws) <= quota
    assert [g.tenant_slots("big") for g in gws] == [2, 2, 2]
    assert not any(g.pressed.at("acme") for g in gws)  # starved by the split, no flood
