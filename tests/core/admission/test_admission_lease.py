"""The quota book: RLQS states, the local deadline rule, refresh scheduling, safe mode."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from admission_testlib import FlakyCoordinator, fill, kind, lease, leased_gateway, req, sync_refresh

from kvgate.core.admission import (
    AdmissionConfig,
    Admitted,
    GatewayAdmission,
    InProcessCoordinator,
    LeaseConfig,
    LeaseState,
    Queued,
    Rejected,
    RejectReason,
)


def test_no_assignment_is_p0_only_at_c_over_expected_gateways() -> None:
    cfg = AdmissionConfig(budget=104, lease=LeaseConfig(expected_gateways=4))  # K = 100
    gw = GatewayAdmission(cfg, "g")
    assert gw.lease_state is LeaseState.NO_ASSIGNMENT and gw.degraded
    assert gw.refresh_due(0.0)
    fill(gw, 25, 0)
    assert isinstance(gw.admit(req(0), 0.0), Queued)
    assert isinstance(gw.admit(req(1, rid="p1"), 0.0), Queued)  # waits for the first grant
    assert isinstance(gw.admit(req(2, rid="p2"), 0.0), Queued)
    admitted = sync_refresh(gw, InProcessCoordinator(cfg), 0.05)
    assert gw.lease_state is LeaseState.ACTIVE and not gw.degraded
    assert {a.ticket.request_id for a in admitted} >= {"p1", "p2"}


def test_local_deadline_uses_t_sent_before_sending() -> None:
    cfg = AdmissionConfig(budget=100)  # ttl 2.0, margin 0.2, reuse 5.0
    gw = GatewayAdmission(cfg, "g")
    report = gw.make_refresh(10.0)  # t_sent = 10.0
    grant = InProcessCoordinator(cfg).refresh(report, 10.3)
    gw.apply_grant(grant, 10.5)  # the reply took 0.5 s
    gw.poll(11.79)
    assert gw.lease_state is LeaseState.ACTIVE
    gw.poll(11.8)  # 10.0 + 2.0 - 0.2, not 10.5 + ...
    assert gw.lease_state is LeaseState.EXPIRED_REUSING
    assert not gw.degraded
    fill(gw, 5, 1, now=12.0)  # still the last lease
    gw.poll(16.79)
    assert gw.lease_state is LeaseState.EXPIRED_REUSING
    gw.poll(16.8)
    assert gw.lease_state is LeaseState.SAFE and gw.degraded


def test_refresh_schedule_periodic_early_coalesced() -> None:
    cfg = AdmissionConfig(budget=1000)
    gw = leased_gateway(lease((10, 10, 0), capacity=1000), cfg, now=0.0)
    assert not gw.refresh_due(0.3)
    assert gw.refresh_due(0.5)  # periodic
    gw.make_refresh(0.5)
    assert not gw.refresh_due(1.2)  # one refresh in flight at a time
    gw.apply_grant(lease((10, 10, 0), capacity=1000), 0.52)
    assert not gw.refresh_due(0.53)
    fill(gw, 17, 1, now=0.53)  # free 3 >= watermark max(2, 10 % of 20)
    assert not gw.refresh_due(0.6)
    fill(gw, 2, 1, now=0.6)  # free 1 < 2: early ...
    assert gw.refresh_due(0.6)
    gw.make_refresh(0.6)
    gw.apply_grant(lease((10, 10, 0), capacity=1000), 0.6)
    assert not gw.refresh_due(0.63)  # ... but coalesced: at most one per 50 ms
    assert gw.refresh_due(0.65)


def test_after_a_failure_only_the_periodic_schedule() -> None:
    cfg = AdmissionConfig(budget=1000)
    gw = GatewayAdmission(cfg, "g")  # NO_ASSIGNMENT: urgent
    gw.make_refresh(0.0)
    gw.refresh_failed(0.01)
    assert not gw.refresh_due(0.1)  # no early storm against a dead coordinator
    assert gw.refresh_due(0.51)
    assert gw.stats().refresh_failures == 1


def _drive(
    gw: GatewayAdmission,
    coord: FlakyCoordinator,
    t0: float,
    t1: float,
    others: Sequence[tuple[GatewayAdmission, InProcessCoordinator]] = (),
    dt: float = 0.1,
) -> list[LeaseState]:
    """Run gw (and other gateways, on a coordinator that stays up) over virtual time."""
    states: list[LeaseState] = []
    t = t0
    while t < t1 - 1e-9:
        t = round(t + dt, 6)
        for g, c in [(gw, coord), *others]:
            g.poll(t)
            if g.refresh_due(t):
                sync_refresh(g, c, t)
        if not states or states[-1] is not gw.lease_state:
            states.append(gw.lease_state)
    return states


def test_coordinator_down_reuse_then_safe_never_open() -> None:
    cfg = AdmissionConfig(budget=210, lease=LeaseConfig(expected_gateways=4))
    inner = InProcessCoordinator(cfg)
    coord = FlakyCoordinator(inner)
    others = [(GatewayAdmission(cfg, f"o{i}"), inner) for i in range(3)]  # 4 gateways live
    gw = GatewayAdmission(cfg, "g")
    _drive(gw, coord, 0.0, 2.0, others)
    assert gw.lease_state is LeaseState.ACTIVE
    last_total = gw.lease_total
    assert last_total == 51  # K = 204 over 4 idle gateways: the idle capacity is spread
    fill(gw, 3, 1, now=2.0)
    assert isinstance(gw.admit(req(2, rid="p2-waiting"), 2.0), Queued)
    coord.down = True
    states = _drive(gw, coord, 2.0, 10.0, others)
    assert states == [LeaseState.ACTIVE, LeaseState.EXPIRED_REUSING, LeaseState.SAFE]
    s = gw.stats()
    assert s.lease_total == min(last_total, 204 // 4) and s.degraded
    # the P2 still queued at SAFE was rejected (DEGRADED)
    assert s.rejected[(RejectReason.DEGRADED, 2)] == 1 and s.queued == (0, 0, 0)
    # in SAFE: P0 still admitted, never more than the safe limit in flight
    for _ in range(200):
        gw.admit(req(0), 10.0)
        assert gw.inuse_total <= 51
    assert gw.inuse_total == 51
    r = gw.admit(req(2), 10.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.DEGRADED and r.http_status == 503
    # the coordinator comes back: ACTIVE again
    coord.down = False
    states = _drive(gw, coord, 10.0, 11.0, others)
    assert states[-1] is LeaseState.ACTIVE and not gw.degraded


def test_safe_mode_p1_is_admitted_within_the_safe_limit() -> None:
    cfg = AdmissionConfig(budget=1000)
    gw = leased_gateway(lease((5, 50, 0), capacity=1000, safe_capacity=20), cfg)
    gw.poll(10.0)
    assert gw.lease_state is LeaseState.SAFE
    assert gw.lease_total == 20
    kinds = [kind(gw.admit(req(1), 10.0)) for _ in range(25)]
    assert kinds.count("Admitted") == 20 and kinds.count("Queued") == 5


def test_coordinator_never_reachable_stays_no_assignment() -> None:
    cfg = AdmissionConfig(budget=14, lease=LeaseConfig(expected_gateways=2))  # K = 12
    coord = FlakyCoordinator(InProcessCoordinator(cfg))
    coord.down = True
    gw = GatewayAdmission(cfg, "g")
    states = _drive(gw, coord, 0.0, 20.0)
    assert states == [LeaseState.NO_ASSIGNMENT]
    assert [kind(gw.admit(req(0), 20.0)) for _ in range(7)].count("Admitted") == 6
    # P1 and P2 are told at once (503, retry) instead of held for their queue timeout
    # and then refused as not retryable (a 429): no grant may come for long
    for c in (1, 2):
        refused = gw.admit(req(c), 20.0)
        assert isinstance(refused, Rejected) and refused.reason is RejectReason.DEGRADED
        assert refused.http_status == 503 and refused.retryable_by_client
    assert coord.calls == pytest.approx(40, abs=2)  # periodic retries only


def test_requests_queued_before_a_first_refresh_fails_are_refused_then() -> None:
    cfg = AdmissionConfig(budget=14)
    gw = GatewayAdmission(cfg, "g")
    assert isinstance(gw.admit(req(1, rid="early"), 0.0), Queued)  # the first grant comes
    gw.refresh_failed(0.1)  # ... or not
    out = gw.poll(0.1)
    assert [(type(o).__name__, o.request_id) for o in out] == [("Rejected", "early")]
    assert isinstance(out[0], Rejected) and out[0].reason is RejectReason.DEGRADED


def test_grant_for_another_gateway_is_a_bug() -> None:
    from kvgate.core.errors import InvariantViolation

    gw = GatewayAdmission(AdmissionConfig(), "g")
    with pytest.raises(InvariantViolation):
        gw.apply_grant(lease((1, 0, 0), gateway_id="h"), 0.0)


def test_a_waiting_request_asks_early_on_an_idle_gateway() -> None:
    # P2 is granted only the demand a report showed: on an idle gateway (no pressure on
    # credits) the first P2 request must not wait a whole period for idle capacity.
    cfg = AdmissionConfig(budget=100)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")
    gw.apply_grant(coord.refresh(gw.make_refresh(0.0), 0.0), 0.0)
    assert not gw.refresh_due(0.1)  # idle, nothing waits: the periodic schedule
    first = gw.admit(req(2, rid="bulk"), 0.1)
    assert isinstance(first, Queued)  # no P2 credits yet
    assert gw.refresh_due(0.1)  # early, not at 0.5
    admitted = sync_refresh(gw, coord, 0.1)
    assert [a.ticket.request_id for a in admitted] == ["bulk"]
    assert not gw.refresh_due(0.12)  # nothing waits any more


def test_p2_held_off_by_the_slo_does_not_ask_early() -> None:
    # While the SLO controller holds P2 off (ceiling 0) no refresh can admit a waiting
    # P2 request, so it must not make every refresh early (50 ms instead of 0.5 s).
    cfg = AdmissionConfig(budget=100)
    gw = leased_gateway(lease((10, 10, 0), ceilings=(1.0, 1.0, 0.0)), cfg, now=0.0)
    assert isinstance(gw.admit(req(2, rid="bulk"), 0.1), Queued)
    assert not gw.refresh_due(0.1)
    assert isinstance(gw.admit(req(1, rid="p1"), 0.1), Admitted)
    assert gw.refresh_due(0.5)  # the periodic one still comes
