"""The controller ends P2 requests whose credits waiting P0 requests need (reclaim_p2)."""

from __future__ import annotations

import random

from kvgate.core.admission import AdmissionConfig, InProcessCoordinator, SloConfig
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Decision, Dispatch, Hold, Preempt
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec


def _cluster(capacity: int = 64, **adm: object) -> tuple[Controller, InProcessCoordinator]:
    # budget 4, no bypass pool: P0's unlendable reserve is 2, P2 may borrow the other 2
    cfg = AdmissionConfig(budget=4, bypass_fraction=0.0, slo=SloConfig(p2_start=1.0), **adm)  # type: ignore[arg-type]
    ctl = Controller(ControllerConfig(hasher="trace", admission=cfg), rng=random.Random(1))
    for i in range(2):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}"), capacity=capacity), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    coord = InProcessCoordinator(cfg)
    ctl.refresh_with(coord, 0.0)
    return ctl, coord


def _arrive(ctl: Controller, rid: str, priority: int, now: float) -> Decision:
    return ctl.on_arrival(
        RequestArrived(
            request_id=RequestId(rid), priority=priority, block_ids=(int(now * 10),),
            prompt_tokens=64,
        ),
        now,
    )


def _fill(ctl: Controller, coord: InProcessCoordinator) -> None:
    # P2 "a" then "b" (P2 is granted idle credits at the refresh its queue asks for)
    for t, rid in ((0.1, "a"), (0.2, "b")):
        d = _arrive(ctl, rid, 2, t)
        if isinstance(d, Hold):
            d = next(x for x in ctl.refresh_with(coord, t) if x.request_id == rid)
        assert isinstance(d, Dispatch)
    ctl.on_first_byte(RequestId("b"), 0.3)  # b is streaming, a has sent nothing yet
    assert isinstance(_arrive(ctl, "c", 0, 0.4), Dispatch)
    assert isinstance(_arrive(ctl, "d", 0, 0.5), Dispatch)  # all 4 credits in use


def test_a_waiting_p0_request_takes_the_credit_of_a_p2_request_that_sent_nothing() -> None:
    ctl, coord = _cluster()
    _fill(ctl, coord)
    assert isinstance(_arrive(ctl, "e", 0, 0.6), Hold)
    assert not [d for d in ctl.tick(0.61) if isinstance(d, Preempt)]  # P2 within its grant
    out = ctl.refresh_with(coord, 0.62)  # the grant now gives P0 what P2 borrowed
    # "a" (nothing sent) goes before the younger "b" (streaming); e gets its credit
    assert [(type(d).__name__, d.request_id) for d in out] == [
        ("Preempt", "a"), ("Dispatch", "e")
    ]
    pre = out[0]
    assert isinstance(pre, Preempt) and pre.rejected.reason.value == "preempted"
    assert pre.rejected.http_status == 503 and pre.rejected.retryable_by_client
    assert pre.node_id in ("n0", "n1")
    assert ctl.stats.rejects["preempted"] == 1 and ctl.num_requests() == 4
    assert not [d for d in ctl.tick(0.7) if isinstance(d, Preempt)]  # nobody waits now
    # the preempted request is gone: its late events change nothing
    assert ctl.on_finished(RequestId("a"), 0.8, cached_tokens=0) == []


def test_no_preemption_when_reclaim_is_off() -> None:
    ctl, coord = _cluster(reclaim_p2=False)
    _fill(ctl, coord)
    assert isinstance(_arrive(ctl, "e", 0, 0.6), Hold)
    out = ctl.refresh_with(coord, 0.62) + ctl.tick(0.63)
    assert not out and ctl.stats.rejects["preempted"] == 0


def test_no_preemption_that_would_let_nobody_in() -> None:
    """Half the cluster goes down: the budget falls to 2 with 4 credits in use. Ending
    both P2 requests would leave the waiting P0 request no room, so none is ended."""
    ctl, coord = _cluster(capacity=2)
    _fill(ctl, coord)
    ctl.set_healthy(NodeId("n1"), False, 0.55)
    assert isinstance(_arrive(ctl, "e", 0, 0.6), Hold)
    out = ctl.refresh_with(coord, 0.62) + ctl.tick(0.63) + ctl.tick(0.7)
    assert not [d for d in out if isinstance(d, Preempt)]
    assert ctl.admission.p2_to_reclaim() == 0
    # a P0 request ends: 3 in use of 2, and ending both P2 requests now makes room
    ctl.on_finished(RequestId("c"), 0.8, cached_tokens=0)
    out = ctl.tick(0.81)
    assert [(type(d).__name__, d.request_id) for d in out] == [
        ("Preempt", "a"), ("Preempt", "b"), ("Dispatch", "e")
    ]
