"""What the controller hands back to its driver: decisions as values.

The driver carries each one out (send the request to a node, hold it, answer
the client) and reports what happened as further events.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.core.admission import Rejected
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.routing.base import RouteDecision


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch:
    """Send the request to ``route.node_id`` (``attempt`` 2 is the gateway's one retry)."""

    request_id: RequestId
    route: RouteDecision
    attempt: int = 1

    @property
    def node_id(self) -> NodeId:
        return self.route.node_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """The request waits in the local admission queue until ``deadline``."""

    request_id: RequestId
    deadline: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    """Answer the client with an error now; ``rejected`` says why and when to retry."""

    request_id: RequestId
    rejected: Rejected


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """The request failed at the nodes and will not be retried by the gateway."""

    request_id: RequestId
    reason: str
    http_status: int = 502
    node_id: NodeId | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Preempt:
    """Stop this dispatched P2 request (abort it at ``node_id``) and end it for the
    client with ``rejected`` (PREEMPTED): a P0 or P1 request needs the credit it held
    beyond its class's share. The core has already let the credit go."""

    request_id: RequestId
    node_id: NodeId
    rejected: Rejected


Decision = Dispatch | Hold | Reject | Fail | Preempt
