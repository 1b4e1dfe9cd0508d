"""Second-stage node admission: accept / queue / reject, TTL expiry, priorities."""

from __future__ import annotations

import math

import pytest

from kvgate.engine import (
    AdmissionStatus,
    NodeAdmission,
    NodeAdmissionConfig,
    RejectedRequest,
    RejectKind,
    ReqStatus,
)
from kvgate.engine.node_admission import NodeLoad, decide_admission

CFG = NodeAdmissionConfig()


def load(**kw: float) -> NodeLoad:
    base: dict[str, float] = dict(
        num_running=0,
        max_num_seqs=256,
        kv_usage=0.0,
        num_waiting_ahead=0,
        num_queued_ahead=0,
        can_preempt=False,
        can_displace=False,
    )
    base.update(kw)
    return NodeLoad(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("facts", "num_queued", "status", "kind"),
    [
        ({}, 0, AdmissionStatus.ACCEPTED, None),
        ({"num_waiting_ahead": 4}, 0, AdmissionStatus.ACCEPTED, None),
        ({"num_waiting_ahead": 5}, 0, AdmissionStatus.QUEUED, None),
        ({"num_running": 256}, 0, AdmissionStatus.QUEUED, None),
        ({"kv_usage": 0.8}, 0, AdmissionStatus.QUEUED, None),
        ({"kv_usage": 0.8, "can_preempt": True}, 0, AdmissionStatus.ACCEPTED, None),
        ({"num_queued_ahead": 1}, 1, AdmissionStatus.QUEUED, None),
        ({"num_waiting_ahead": 5}, 64, AdmissionStatus.REJECTED, RejectKind.RETRY_ELSEWHERE),
        ({"kv_usage": 0.94}, 64, AdmissionStatus.REJECTED, RejectKind.RETRY_ELSEWHERE),
        ({"kv_usage": 0.95}, 64, AdmissionStatus.REJECTED, RejectKind.POOL_OVERLOADED),
        ({"kv_usage": 0.95, "can_displace": True}, 64, AdmissionStatus.QUEUED, None),
    ],
)
def test_decision_table(
    facts: dict[str, float], num_queued: int, status: AdmissionStatus, kind: RejectKind | None
) -> None:
    decision = decide_admission(CFG, load(**facts), num_queued)
    assert (decision.status, decision.reject_kind) == (status, kind)


def test_defaults_are_the_documented_ones() -> None:
    assert (CFG.kv_accept, CFG.waiting_accept, CFG.kv_overload) == (0.8, 4, 0.95)
    assert (CFG.queue_max, CFG.queue_ttl_s) == (64, 10.0)
    with pytest.raises(ValueError):
        NodeAdmissionConfig(kv_accept=0.96, kv_overload=0.95)


def small(kit, policy: str = "fcfs", max_num_seqs: int = 1, **adm: float):  # type: ignore[no-untyped-def]
    """10 blocks of 4; waiting_accept 1, queue_max 2, TTL 1 s unless overridden."""
    fields: dict[str, float] = {"waiting_accept": 1, "queue_max": 2, "queue_ttl_s": 1.0}
    fields.update(adm)
    cfg = NodeAdmissionConfig(**fields)  # type: ignore[arg-type]
    return kit.tiny_engine(
        admission=cfg, scheduling_policy=policy, profile=kit.tiny_profile(max_num_seqs=max_num_seqs)
    )


def test_accept_then_queue_then_reject_and_queued_requests_move_in(kit) -> None:
    engine = small(kit)
    results = [engine.submit(kit.req(f"r{i}", 4, base=10 * i), 0.0) for i in range(5)]
    assert [r.status for r in results] == [AdmissionStatus.ACCEPTED] * 2 + [
        AdmissionStatus.QUEUED
    ] * 2 + [AdmissionStatus.REJECTED]
    assert results[4].reject_kind is RejectKind.RETRY_ELSEWHERE
    assert "admission queue full" in results[4].reason
    m = engine.metrics()
    assert (m.num_requests_waiting, m.num_requests_queued, m.num_requests_rejected) == (4, 2, 1)
    outs, _ = kit.drive(engine, 0.0)
    assert [f.request_id for o in outs for f in o.finished] == ["r0", "r1", "r2", "r3"]
    assert all(not o.rejected for o in outs)


def test_queued_request_expires_after_ttl_as_retry_elsewhere(kit) -> None:
    engine = small(kit)
    engine.submit(kit.req("long", 36, base=100, max_tokens=4), 0.0)
    out = engine.step(0.0)  # long is running and holds 9 blocks: kv usage 0.9 >= 0.8
    assert out is not None
    assert engine.submit(kit.req("q", 4, base=200), 0.05).queued
    assert engine.request_status("q") is ReqStatus.QUEUED
    assert engine.next_timer_at() == 1.05  # an idle driver would know when to step
    out = engine.step(1.05)  # the driver was late: q's TTL passed before it could start
    assert out is not None
    assert out.rejected == (
        RejectedRequest(
            request_id="q",
            reject_kind=RejectKind.RETRY_ELSEWHERE,
            reason="queued at the node for 1 s without starting",
        ),
    )
    assert dict(out.tokens) == {"long": 1}
    assert engine.request_status("q") is None
    assert engine.next_timer_at() is None
    outs, _ = kit.drive(engine, out.end)
    assert [f.request_id for o in outs for f in o.finished] == ["long"]
    assert engine.metrics().num_requests_rejected == 1


def test_queued_request_moves_in_before_its_ttl_when_room_appears(kit) -> None:
    engine = small(kit)
    engine.submit(kit.req("long", 36, base=100, max_tokens=4), 0.0)
    engine.step(0.0)
    assert engine.submit(kit.req("q", 4, base=200), 0.05).queued
    outs, _ = kit.drive(engine, 0.05)
    assert [f.request_id for o in outs for f in o.finished] == ["long", "q"]
    assert all(o.rejected == () for o in outs)


def test_pool_overloaded_when_memory_saturated_and_queue_full(kit) -> None:
    engine = small(kit, queue_max=0)
    engine.submit(kit.req("long", 36, base=100, max_tokens=4), 0.0)
    out = engine.step(0.0)
    assert out is not None
    out = engine.step(out.end)
    assert engine.metrics().kv_cache_usage_perc == 1.0
    decision = engine.submit(kit.req("x", 4, base=200), 1.0)
    assert (decision.status, decision.reject_kind) == (
        AdmissionStatus.REJECTED,
        RejectKind.POOL_OVERLOADED,
    )


def test_too_long_is_a_distinct_non_retryable_rejection(kit) -> None:
    engine = kit.tiny_engine(max_model_len=20)
    decision = engine.submit(kit.req("big", 16, base=1, max_tokens=5), 0.0)
    assert decision == NodeAdmission(
        status=AdmissionStatus.REJECTED,
        reject_kind=RejectKind.BAD_REQUEST,
        reason="prompt (16) + max_tokens (5) exceeds max_model_len (20)",
    )
    assert engine.submit(kit.req("fits", 16, base=1, max_tokens=4), 0.0).accepted
    with pytest.raises(ValueError, match="max_model_len"):
        kit.tiny_engine(max_model_len=41)  # more than the pool can ever hold


def test_queue_is_one_fifo_per_priority_lower_value_first(kit) -> None:
    engine = small(kit, policy="priority", queue_max=10)
    engine.submit(kit.req("run", 36, base=100, max_tokens=3, priority=0), 0.0)
    out = engine.step(0.0)  # kv 0.9: everything else queues
    assert out is not None
    for name, prio in [("p2a", 2), ("p1a", 1), ("p2b", 2), ("p1b", 1)]:
        assert engine.submit(kit.req(name, 4, base=hash_base(name), priority=prio), 0.01).queued
    outs, _ = kit.drive(engine, out.end)
    order = [f.request_id for o in outs for f in o.finished]
    assert order == ["run", "p1a", "p1b", "p2a", "p2b"]


def hash_base(name: str) -> int:
    return 1000 * (sum(map(ord, name)) % 97 + 1)


def test_newcomer_never_overtakes_its_own_class(kit) -> None:
    engine = small(kit, queue_max=10)
    engine.submit(kit.req("run", 36, base=100, max_tokens=2), 0.0)
    engine.step(0.0)
    assert engine.submit(kit.req("early", 4, base=200), 0.0).queued
    # even if the node looked acceptable, "late" must queue behind "early"
    assert engine.submit(kit.req("late", 4, base=300), 0.0).queued


def test_under_priority_a_high_priority_arrival_is_accepted_despite_kv_pressure(kit) -> None:
    engine = small(kit, policy="priority", max_num_seqs=4)
    engine.submit(kit.req("bulk", 36, base=100, max_tokens=3, priority=2), 0.0)
    engine.step(0.0)
    assert engine.metrics().kv_cache_usage_perc == 0.9
    assert engine.submit(kit.req("same", 4, base=200, priority=2), 0.01).queued
    assert engine.submit(kit.req("vip", 4, base=300, priority=0), 0.01).accepted


def test_a_full_queue_makes_room_for_a_better_priority_by_displacing_the_worst_newest(
    kit,
) -> None:
    engine = small(kit, policy="priority")  # queue_max 2, one running slot
    engine.submit(kit.req("run", 36, base=100, max_tokens=3, priority=2), 0.0)
    out = engine.step(0.0)  # the only slot is taken: everything else queues
    assert out is not None
    for name in ("old", "new"):
        assert engine.submit(kit.req(name, 4, base=hash_base(name), priority=2), 0.01).queued
    peer = engine.submit(kit.req("peer", 4, base=hash_base("peer"), priority=2), 0.01)
    assert (peer.reject_kind, peer.reason) == (
        RejectKind.RETRY_ELSEWHERE,
        "admission queue full (2 requests)",
    )  # an equal priority displaces nobody
    assert engine.submit(kit.req("vip", 4, base=hash_base("vip"), priority=0), 0.01).queued
    assert engine.request_status("new") is None
    m = engine.metrics()
    assert (m.num_requests_queued, m.num_requests_rejected) == (2, 2)
    outs, _ = kit.drive(engine, out.end)
    displaced = RejectedRequest(
        request_id="new",
        reject_kind=RejectKind.RETRY_ELSEWHERE,
        reason="displaced by a higher-priority request",
    )
    assert outs[0].rejected == (displaced,)  # the next step reports it, as a TTL drop
    assert all(o.rejected == () for o in outs[1:])  # and only once
    assert [f.request_id for o in outs for f in o.finished] == ["run", "vip", "old"]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_queue_ttl_is_refused_by_name(value: float) -> None:
    with pytest.raises(ValueError, match=r"NodeAdmissionConfig\.queue_ttl_s must be a finite"):
        NodeAdmissionConfig(queue_ttl_s=value)
