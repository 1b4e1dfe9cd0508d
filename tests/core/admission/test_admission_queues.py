"""Queues: deadlines, the youngest rejected when full, tenant round robin, class order."""

from __future__ import annotations

from collections import Counter

from admission_testlib import fill, kind, lease, leased_gateway, req

from kvgate.core.admission import (
    AdmissionConfig,
    Admitted,
    ClassConfig,
    FairQueue,
    Queued,
    Rejected,
    RejectReason,
)


def _cfg(limit: int = 1024, timeout: float = 30.0) -> AdmissionConfig:
    return AdmissionConfig(
        budget=1000,
        classes=(
            ClassConfig(share=0.7, lendable=0.5, queue_limit=limit, queue_timeout_s=timeout),
            ClassConfig(share=0.3, lendable=1.0, queue_limit=limit, queue_timeout_s=timeout),
            ClassConfig(share=0.0, lendable=1.0, queue_limit=limit, queue_timeout_s=2 * timeout),
        ),
    )


def test_queue_deadline_expiry_is_a_429_without_client_retry() -> None:
    gw = leased_gateway(lease((1, 0, 0), ttl_s=100.0), _cfg(timeout=30.0))  # no expiry
    fill(gw, 1, 0)
    q = gw.admit(req(1, rid="late"), 1.0)
    assert isinstance(q, Queued) and q.deadline == 31.0
    q2 = gw.admit(req(2, rid="later"), 1.0)
    assert isinstance(q2, Queued) and q2.deadline == 61.0  # P2 waits longer
    assert gw.poll(30.9) == []
    (r,) = gw.poll(31.0)
    assert isinstance(r, Rejected) and r.request_id == "late"
    assert (r.reason, r.http_status, r.retryable_by_client) == (
        RejectReason.QUEUE_TIMEOUT,
        429,
        False,
    )
    assert gw.stats().queued == (0, 0, 1)


def test_client_deadline_caps_the_queue_wait() -> None:
    gw = leased_gateway(lease((1, 0, 0)), _cfg())
    fill(gw, 1, 0)
    q = gw.admit(req(0, deadline=5.0), 1.0)
    assert isinstance(q, Queued) and q.deadline == 5.0
    r = gw.admit(req(0, deadline=0.5), 1.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.QUEUE_TIMEOUT


def test_full_queue_rejects_the_youngest() -> None:
    gw = leased_gateway(lease((1, 0, 0)), _cfg(limit=3))
    fill(gw, 1, 0)
    for i in range(3):
        assert isinstance(gw.admit(req(0, "a", rid=f"a{i}"), 0.0), Queued)
    r = gw.admit(req(0, "a", rid="a3"), 0.0)  # same tenant: the arrival is the youngest
    assert isinstance(r, Rejected)
    assert (r.reason, r.http_status, r.retryable_by_client) == (RejectReason.QUEUE_FULL, 503, True)
    # another tenant: the flooding tenant's youngest is evicted instead
    q = gw.admit(req(0, "b", rid="b0"), 0.0)
    assert isinstance(q, Queued)
    (evicted,) = gw.poll(0.1)
    assert isinstance(evicted, Rejected) and evicted.request_id == "a2"
    assert evicted.reason is RejectReason.QUEUE_FULL
    assert gw.stats().tenant_queued == {"a": 2, "b": 1}


def test_queue_limit_zero_never_queues() -> None:
    gw = leased_gateway(lease((1, 0, 0)), _cfg(limit=0))
    fill(gw, 1, 0)
    r = gw.admit(req(0), 0.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.QUEUE_FULL


def test_tenant_round_robin_inside_a_class() -> None:
    gw = leased_gateway(lease((1, 0, 0)), _cfg())
    (t,) = fill(gw, 1, 0)
    for i in range(6):
        gw.admit(req(1, "noisy", rid=f"n{i}"), 0.0)
    gw.admit(req(1, "quiet", rid="q0"), 0.0)
    gw.admit(req(1, "other", rid="o0"), 0.0)
    order = []
    ticket = t
    for step in range(8):
        (a,) = gw.release(ticket, 0.1 + step)
        order.append(a.ticket.request_id)
        ticket = a.ticket
    assert order == ["n0", "q0", "o0", "n1", "n2", "n3", "n4", "n5"]


def test_fair_share_of_dispatches_under_a_noisy_neighbour() -> None:
    """Two tenants always backlogged, one sending 10x: dispatches split ~50/50."""
    gw = leased_gateway(lease((0, 10, 0)), _cfg())
    tickets = fill(gw, 10, 1, tenant="seed")
    served: Counter[str] = Counter()
    for step in range(400):
        now = step * 0.01
        for _ in range(10):
            gw.admit(req(1, "noisy"), now)
        gw.admit(req(1, "quiet"), now)
        t = tickets.pop(0)
        for a in gw.release(t, now):
            served[a.ticket.tenant] += 1
            tickets.append(a.ticket)
    total = served["noisy"] + served["quiet"]
    assert total == 400
    assert abs(served["quiet"] / total - 0.5) <= 0.1


def test_release_dispatches_the_highest_class_first() -> None:
    gw = leased_gateway(lease((1, 0, 1)), _cfg())
    (t,) = fill(gw, 1, 0)
    fill(gw, 1, 2)  # P2 at its own grant
    gw.admit(req(2, rid="p2"), 0.0)
    gw.admit(req(1, rid="p1"), 0.0)
    gw.admit(req(0, rid="p0"), 0.0)
    (a,) = gw.release(t, 0.1)
    assert a.ticket.request_id == "p0"
    (b,) = gw.release(a.ticket, 0.2)
    assert b.ticket.request_id == "p1"


def test_cancel_removes_a_queued_request() -> None:
    gw = leased_gateway(lease((1, 0, 0)), _cfg())
    (t,) = fill(gw, 1, 0)
    gw.admit(req(0, "x", rid="gone"), 0.0)
    gw.admit(req(0, "x", rid="stays"), 0.0)
    assert gw.cancel("gone", 0.1) is True
    assert gw.cancel("gone", 0.1) is False
    assert gw.cancel("never", 0.1) is False
    assert gw.tenant_slots("x") == 1
    (a,) = gw.release(t, 0.2)
    assert a.ticket.request_id == "stays"
    assert gw.poll(100.0) == []


def test_fair_queue_unit() -> None:
    q = FairQueue(limit=10)
    e1 = q.push(req(1, "a", rid="1"), 0.0, 5.0)
    q.push(req(1, "a", rid="2"), 0.0, 3.0)
    q.push(req(1, "b", rid="3"), 0.0, 9.0)
    assert len(q) == 3 and q.tenant_depths() == {"a": 2, "b": 1}
    assert [e.request.request_id for e in q.expire(4.0)] == ["2"]
    assert q.remove("1") is e1 and e1.done
    assert q.pop_next() is not None and q.pop_next() is None
    assert len(q) == 0 and q.expire(100.0) == []
    for i in range(2000):  # lazily removed entries are compacted, not kept forever
        q.push(req(1, "c", rid=f"c{i}"), 0.0, 1000.0)
        assert q.pop_next() is not None
    assert len(q._heap) < 1100


def test_kind_helper() -> None:
    assert kind(Queued(request_id="x", deadline=1.0)) == "Queued"
    assert not isinstance(Queued(request_id="x", deadline=1.0), Admitted)


def test_a_queue_nobody_serves_keeps_only_its_live_entries() -> None:
    # P2 under sustained load is never popped: requests that time out or whose client
    # gives up must not stay behind in the tenant's FIFO or the rotation.
    q = FairQueue(limit=1000)
    for i in range(20_000):
        q.push(req(2, "t", rid=f"r{i}"), now=float(i), deadline=float(i) + 50.0)
        if i % 2:
            q.remove(f"r{i}")  # the client went away
        q.expire(float(i))  # the others time out 50 s later
    assert len(q) == 25  # live: even ids of the last 50 s
    assert len(q._tenants["t"]) <= 2 * len(q) + 32
    for i in range(5_000):  # tenants that come and go, one request each
        q.push(req(2, f"u{i}", rid=f"u{i}"), now=0.0, deadline=1.0)
        q.remove(f"u{i}")
    assert len(q._rr) <= 2 * len(q.tenant_depths()) + 64
    # and the rotation still serves what is live, in order
    assert [q.pop_next().request.request_id for _ in range(2)] == ["r19950", "r19952"]
