"""The per-node record of a policy's requests in flight (routing/active_requests.py)."""

from __future__ import annotations

from kvgate.core.ids import NodeId
from kvgate.core.routing.active_requests import ActiveRequests

N0, N1 = NodeId("n0"), NodeId("n1")


def _active(cap: int = 10) -> tuple[ActiveRequests[int], list[tuple[str, int]]]:
    released: list[tuple[str, int]] = []
    return ActiveRequests(lambda node, rec: released.append((node, rec)), cap=cap), released


def test_ends_by_id_else_the_oldest() -> None:
    active, released = _active()
    for rid, rec in (("a", 1), ("b", 2), ("", 3), ("", 4)):  # id-less ones get keys of their own
        active.add(N0, rid, rec)
    active.end(N0, "b")
    active.end(N0, "unknown")  # the oldest: a
    active.end(N1, "a")  # nothing there
    assert released == [("n0", 2), ("n0", 1)] and active.get(N0, "a") is None
    active.end(N0, "")
    active.end(N0, "")
    assert released[2:] == [("n0", 3), ("n0", 4)] and not active.holds(N0)


def test_the_same_id_replaces_and_the_cap_drops_the_oldest() -> None:
    active, released = _active(cap=2)
    active.add(N0, "a", 1)
    active.add(N0, "a", 5)
    assert released == [("n0", 1)] and active.get(N0, "a") == 5
    active.add(N0, "b", 2)
    active.add(N0, "c", 3)
    assert released[1:] == [("n0", 5)] and active.get(N0, "b") == 2
    active.forget(N0)  # a removed node: its records go unreleased
    assert not active.holds(N0) and len(released) == 2
