"""Round robin: the cache-blind baseline every router ships.

Algorithm
---------
SGLang / SMG ``round_robin`` (``model_gateway/src/policies/round_robin.rs``) and
vllm-router ``round_robin`` keep one atomic counter and take ``counter % n`` over
the currently healthy workers; vLLM production-stack ``roundrobin`` does the same
(routing-anchors.md §1 "Other policies", §2, §3). A modulo over a changing list
reshuffles whenever a worker drops out, so kvgate keeps the cursor in *slot*
space instead: the next pick is the candidate with the smallest slot strictly
after the last one chosen, wrapping around. Nodes that are not candidates (down,
draining, excluded for a retry) are skipped without disturbing the rotation of
the others, and with a fixed candidate set the sequence is exactly
``n0, n1, ..., n(k-1), n0, ...``.

It has no parameters (none of the peers exposes any), ignores load and cache
(``uses_cache = False``), and reports ``RouteReason.ROTATION``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing._common import best_match, match_of
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason


class RoundRobinPolicy:
    """Cycle through the candidates in slot order, skipping non-candidates."""

    name: ClassVar[str] = "round_robin"
    uses_cache: ClassVar[bool] = False
    uses_hot_rate: ClassVar[bool] = False

    def __init__(self) -> None:
        self._last_slot = -1  # slot of the previous pick; -1 = start at the lowest slot

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
        after: NodeState | None = None  # the lowest slot after the cursor
        lowest: NodeState | None = None  # the lowest slot overall (wrap-around)
        for state in candidates:
            slot = state.slot
            if lowest is None or slot < lowest.slot:
                lowest = state
            if slot > self._last_slot and (after is None or slot < after.slot):
                after = state
        chosen = after if after is not None else lowest
        assert chosen is not None
        self._last_slot = chosen.slot
        return RouteDecision(
            node_id=chosen.node_id,
            reason=RouteReason.ROTATION,
            matched_blocks=match_of(matches, chosen.node_id),
            best_matched_blocks=best_match(candidates, matches),
            score=0.0,
            parts={"slot": float(chosen.slot), "wrapped": 0.0 if after is not None else 1.0},
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        return None
