"""The requests a policy routed that have not ended yet, per node, by request id.

Policies whose load is the work of their own in-flight requests (``dynamo_cost``'s
active blocks and prefill tokens, ``preble_e2``'s decode cost) keep a record per
request and a sum per node. This keeps the records; the policy keeps its sums,
taking each record out of them in its ``release(node_id, record)`` callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kvgate.core.ids import NodeId

T = TypeVar("T")

MAX_ACTIVE_PER_NODE = 65_536  # memory bound if an end is ever missed: the oldest goes


class ActiveRequests(Generic[T]):
    """Per node, in routing order, the requests routed there and not ended, keyed by
    ``RouteContext.request_id``. A request routed without an id gets a key of its own;
    the same id routed to the node again replaces its record; an end whose id is
    unknown ends the node's oldest request; past ``cap`` records on a node the oldest
    goes. Every record that leaves is handed to ``release``."""

    __slots__ = ("_by_node", "_release", "_serial", "cap")

    def __init__(
        self, release: Callable[[NodeId, T], None], *, cap: int = MAX_ACTIVE_PER_NODE
    ) -> None:
        self._by_node: dict[NodeId, dict[str, T]] = {}
        self._release = release
        self._serial = 0  # keys for requests routed without an id
        self.cap = cap

    def add(self, node_id: NodeId, request_id: str, record: T) -> None:
        if not request_id:
            self._serial += 1
            request_id = f"\0{self._serial}"
        active = self._by_node.setdefault(node_id, {})
        old = active.pop(request_id, None)
        active[request_id] = record
        if old is not None:  # the same id routed here again: its old record is over
            self._release(node_id, old)
        if len(active) > self.cap:
            self._release(node_id, active.pop(next(iter(active))))

    def get(self, node_id: NodeId, request_id: str) -> T | None:
        active = self._by_node.get(node_id)
        return active.get(request_id) if active else None

    def end(self, node_id: NodeId, request_id: str) -> None:
        """The request left the node (unknown or empty id: the node's oldest did)."""
        active = self._by_node.get(node_id)
        if not active:
            return
        record = active.pop(request_id, None)
        if record is None:
            record = active.pop(next(iter(active)))
        if not active:
            del self._by_node[node_id]
        self._release(node_id, record)

    def holds(self, node_id: NodeId) -> bool:
        """Whether any request routed to the node has not ended."""
        return node_id in self._by_node

    def forget(self, node_id: NodeId) -> None:
        """The node left the cluster: its records go, unreleased."""
        self._by_node.pop(node_id, None)
