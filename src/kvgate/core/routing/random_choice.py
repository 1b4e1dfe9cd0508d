"""Random: a uniformly random candidate, the weakest baseline.

Algorithm
---------
SGLang / SMG ``random`` (``model_gateway/src/policies/random.rs``) and
vllm-router ``random`` pick one healthy worker uniformly at random
(routing-anchors.md §1 "Other policies", §2). llm-d's blog uses it as the
cache-blind reference (random: TTFT p90 92.6 s on its B2B workload, §4(f)).

kvgate draws with the injected :class:`~kvgate.core.rng.Rng` only (one
``rng.random()`` per decision through :func:`~kvgate.core.rng.pick_index`) over
the candidates in slot order, so a seeded generator replays the same decisions
regardless of the order the controller lists the candidates in. No parameters;
``uses_cache = False``; reason ``ROTATION``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng, pick_index
from kvgate.core.routing._common import best_match, by_slot, match_of
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason


class RandomPolicy:
    """Uniform among the candidates."""

    name: ClassVar[str] = "random"
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
        ordered = by_slot(candidates)
        i = pick_index(rng, len(ordered))
        chosen = ordered[i]
        return RouteDecision(
            node_id=chosen.node_id,
            reason=RouteReason.ROTATION,
            matched_blocks=match_of(matches, chosen.node_id),
            best_matched_blocks=best_match(candidates, matches),
            score=1.0 / len(ordered),
            parts={"probability": 1.0 / len(ordered), "index": float(i)},
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        return None
