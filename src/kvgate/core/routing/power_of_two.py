"""Power of two choices: sample two distinct candidates, keep the less loaded.

Algorithm
---------
SGLang / SMG ``power_of_two`` (``model_gateway/src/policies/power_of_two.rs``)
and vllm-router ``power_of_two`` draw two different healthy workers uniformly at
random and send the request to the one with the lower load (routing-anchors.md
§1 "Other policies", §2(c)); Ray Serve's default router is the same idea (§7).
The SGLang router's load is its router-local in-flight request count (§1(c));
SMG and vllm-router can overlay an engine load polled every 10 s / 30 s.

kvgate maps that onto ``load = "inflight"`` (default): ``state.inflight``, the
gateway's own in-flight requests on the node. ``load = "queue"`` uses
:meth:`NodeTable.queue` instead (the report-plus-own-sends signal, the analogue
of the polled engine load). Ties keep the first sample, as SGLang's ``load1 <= load2``
does (an earlier version took the lower slot, which favoured low slots).

Sampling uses two ``rng.random()`` draws over the candidates in slot order: the
first index uniform in ``[0, n)``, the second uniform over the remaining ``n-1``.
With one candidate there is nothing to sample. ``uses_cache = False``; reason
``LOAD``; ``score`` is the chosen node's load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng, pick_index
from kvgate.core.routing._common import best_match, by_slot, match_of, require
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason

_LOADS = ("inflight", "queue")


class PowerOfTwoPolicy:
    """Two uniform samples, the lower load wins."""

    name: ClassVar[str] = "power_of_two"
    uses_cache: ClassVar[bool] = False
    uses_hot_rate: ClassVar[bool] = False

    def __init__(self, *, load: str = "inflight") -> None:
        require(load in _LOADS, self.name, f"load must be one of {_LOADS}, got {load!r}")
        self.load = load

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
        ordered = by_slot(candidates)
        n = len(ordered)
        if n == 1:
            pair = ordered
        else:
            i = pick_index(rng, n)
            j = pick_index(rng, n - 1)
            if j >= i:
                j += 1
            pair = [ordered[i], ordered[j]]

        def inflight(state: NodeState) -> float:
            return float(state.inflight)

        def queue(state: NodeState) -> float:
            return float(nodes.queue(state, now))

        key = inflight if self.load == "inflight" else queue
        first, second = pair[0], pair[-1]
        chosen, other = (first, second) if key(first) <= key(second) else (second, first)
        load = key(chosen)
        return RouteDecision(
            node_id=chosen.node_id,
            reason=RouteReason.LOAD,
            matched_blocks=match_of(matches, chosen.node_id),
            best_matched_blocks=best_match(candidates, matches),
            score=load,
            parts={"load": load, "other_load": key(other), "other_slot": float(other.slot)},
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        return None
