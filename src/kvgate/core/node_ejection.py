"""Outlier ejection: a node that fails attempts in a row is left out for a while.

Pure bookkeeping, as Envoy's outlier detection keeps it: the controller tells it of
each failed attempt, and it says when a node is to be marked down; ``due`` lists the
ejections whose time is up. Marking the node down or up is the controller's (it
aborts the attempts there and, in approximate mode, forgets the node's cache).
"""

from __future__ import annotations

from collections import deque

from kvgate.core.admission import FailureKind
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState

# The failures that count toward ejecting a node: faults of the node or of the way to
# it (the controller's breaker counts these and NODE_DOWN), but not NODE_DOWN (it is
# down already), nor a client's bad request or a busy node's refusal (backpressure,
# which admission answers).
EJECTING_FAULTS = frozenset(
    {
        FailureKind.CONNECT_ERROR,
        FailureKind.UPSTREAM_ERROR,
        FailureKind.TIMEOUT,
        FailureKind.NODE_AUTH,
    }
)


class NodeEjections:
    """Which nodes are ejected until when, and the news of it for the driver's log."""

    def __init__(self, *, after_failures: int, eject_s: float) -> None:
        self.after_failures = after_failures
        self.eject_s = eject_s
        self._until: dict[NodeId, float] = {}
        # (node, True) on ejection, (node, False) when it ends; bounded: the simulator
        # never drains it
        self._news: deque[tuple[NodeId, bool]] = deque(maxlen=64)

    def failed(self, node: NodeState, failure: FailureKind, now: float) -> bool:
        """Count a failed attempt on ``node``; whether to mark it down now (ejected)."""
        if failure not in EJECTING_FAULTS:
            return False
        node.consecutive_failures += 1
        if node.consecutive_failures < self.after_failures or not node.healthy:
            return False
        self._until[node.spec.node_id] = now + self.eject_s
        self._news.append((node.spec.node_id, True))
        return True

    def due(self, now: float) -> list[NodeId]:
        """The ejected nodes whose time is up, to be marked up again (news of each)."""
        ended = [node_id for node_id, until in self._until.items() if now >= until]
        for node_id in ended:
            del self._until[node_id]
            self._news.append((node_id, False))
        return ended

    def forget(self, node_id: NodeId) -> None:
        """The node is up again, or gone: no ejection of it ends later."""
        self._until.pop(node_id, None)

    def take_news(self) -> list[tuple[NodeId, bool]]:
        news = list(self._news)
        self._news.clear()
        return news
