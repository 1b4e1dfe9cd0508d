"""Bulk evictions a node announced and has not finished: while one is pending, the
node's cache counts only ``evicting_cache_weight`` in routing, so a node about to drop
its cache stops attracting the traffic that would miss there.

A node may announce several evictions before the first is done; its cache counts in
full again after the last done, or at once when its cache is cleared (a crash or
reset makes every pending announcement moot).
"""

from __future__ import annotations

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeTable


class EvictionNotices:
    """Counts each node's announced evictions not done yet and sets its cache weight."""

    def __init__(self, nodes: NodeTable, evicting_cache_weight: float) -> None:
        self._nodes = nodes
        self._weight = evicting_cache_weight
        self._pending: dict[NodeId, int] = {}  # absent: none pending

    def warned(self, node_id: NodeId) -> bool:
        """The node announced one more eviction; False when the node is unknown."""
        state = self._nodes.get(node_id)
        if state is None:
            return False
        self._pending[node_id] = self._pending.get(node_id, 0) + 1
        state.cache_weight = self._weight
        return True

    def done(self, node_id: NodeId) -> None:
        """One announced eviction is done: the cache counts in full after the last (or
        after a done whose warning we missed, clamped at none pending)."""
        left = self._pending.get(node_id, 0) - 1
        if left > 0:
            self._pending[node_id] = left
        else:
            self.end(node_id)

    def end(self, node_id: NodeId) -> None:
        """Every pending eviction of the node is over (its cache was cleared, or it left
        the table: a node added again starts afresh)."""
        self._pending.pop(node_id, None)
        state = self._nodes.get(node_id)
        if state is not None:
            state.cache_weight = 1.0
