"""NodeEjections: which failures eject a node, when, and the news of it."""

from __future__ import annotations

from kvgate.core.admission import FailureKind
from kvgate.core.ids import NodeId
from kvgate.core.node_ejection import NodeEjections
from kvgate.core.nodes import NodeSpec, NodeTable

N0 = NodeId("n0")


def _node() -> tuple[NodeTable, NodeEjections]:
    table = NodeTable(stale_after_s=5.0)
    table.add(NodeSpec(node_id=N0))
    return table, NodeEjections(after_failures=3, eject_s=10.0)


def test_only_faults_of_the_node_count_and_the_third_in_a_row_ejects() -> None:
    table, ej = _node()
    node = table.get(N0)
    assert node is not None
    for kind in (FailureKind.NODE_DOWN, FailureKind.CLIENT_ERROR, FailureKind.RETRY_ELSEWHERE):
        assert not ej.failed(node, kind, 0.0)
    assert node.consecutive_failures == 0
    assert not ej.failed(node, FailureKind.TIMEOUT, 1.0)
    assert not ej.failed(node, FailureKind.CONNECT_ERROR, 1.0)
    assert ej.failed(node, FailureKind.UPSTREAM_ERROR, 2.0)
    assert ej.take_news() == [(N0, True)]
    assert ej.take_news() == []


def test_an_ejection_ends_once_and_a_node_down_already_is_not_ejected_again() -> None:
    table, ej = _node()
    node = table.get(N0)
    assert node is not None
    for _ in range(3):
        ej.failed(node, FailureKind.TIMEOUT, 2.0)
    table.set_healthy(node, False)
    assert not ej.failed(node, FailureKind.TIMEOUT, 3.0)  # down: no second ejection
    assert ej.due(11.9) == []
    assert ej.due(12.0) == [N0]
    assert ej.due(13.0) == []  # ended once, even if nobody marked it up
    assert ej.take_news() == [(N0, True), (N0, False)]


def test_a_node_forgotten_is_not_brought_back() -> None:
    table, ej = _node()
    node = table.get(N0)
    assert node is not None
    for _ in range(3):
        ej.failed(node, FailureKind.TIMEOUT, 0.0)
    ej.forget(N0)
    assert ej.due(100.0) == []
