"""Least loaded: the fewest in-flight requests, cache-blind.

Algorithm
---------
The "load-aware" baseline of the anchors: KubeAI's default ``LeastLoad``
strategy (fewest in-flight requests, routing-anchors.md §8), vidur's ``lor``
(least outstanding requests, workloads.md §2), SMG ``least_load`` without its
token/KV terms, and llm-d's queue scorer alone (§4). kvgate's queue signal is
this gateway's exact count of its own requests sent to the node and not yet
finished (``state.inflight``, running or waiting), as KubeAI's ``LeastLoad``
keeps per endpoint. Ties → the smaller queue of the one signal the whole gateway
uses, :meth:`NodeTable.queue`:

    queue = reported waiting + this gateway's sends since that report
            (or this gateway's in-flight count when the report is stale)

→ a uniform pick among the nodes still tied (KubeAI walks a Go map, in random order;
taking the lower slot sent every request of an idle cluster to slot 0). In-flight
ranks first because the reported queue reads 0 on every
node right after a report (vLLM's ``waiting`` is 0 while the batch has room), so
ranking by it first would tie a node running 50 requests with one running 5.
No parameters; ``uses_cache = False``; reason ``LOAD``; ``score`` is the in-flight
count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng, pick_index
from kvgate.core.routing._common import best_match, by_slot, match_of
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason


class LeastLoadedPolicy:
    """Minimum in-flight, then queue, then a uniform pick among the tied."""

    name: ClassVar[str] = "least_loaded"
    uses_cache: ClassVar[bool] = False
    uses_hot_rate: ClassVar[bool] = False

    def __init__(self) -> None:
        return None

    def select(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        matches: Mapping[NodeId, int],
        nodes: NodeTable,
        rng: Rng,
        now: float,
    ) -> RouteDecision | None:
        if not candidates:
            return None

        def queue(state: NodeState) -> float:
            return float(nodes.queue(state, now))

        def inflight(state: NodeState) -> float:
            return float(state.inflight)

        keys = {s: (inflight(s), queue(s)) for s in by_slot(candidates)}
        low = min(keys.values())
        tied = [s for s, key in keys.items() if key == low]
        chosen = tied[pick_index(rng, len(tied))] if len(tied) > 1 else tied[0]
        n = inflight(chosen)
        return RouteDecision(
            node_id=chosen.node_id,
            reason=RouteReason.LOAD,
            matched_blocks=match_of(matches, chosen.node_id),
            best_matched_blocks=best_match(candidates, matches),
            score=n,
            parts={"inflight": n, "queue": queue(chosen)},
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        return None
