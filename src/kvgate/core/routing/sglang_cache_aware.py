"""SGLang router ``cache_aware``: a global imbalance switch, then a match threshold.

Algorithm (routing-anchors.md §1(a); workloads.md §2 "SGLang router policy")
--------------------------------------------------------------------------
SGLang's router (``sgl-router`` → SGLang Model Gateway → SMG,
``model_gateway/src/policies/cache_aware.rs``; vllm-router forked it unchanged):

1. Load is the router-local in-flight request count per worker. Over the healthy
   workers take ``max`` and ``min``; the fleet is **imbalanced** iff
   ``max - min > balance_abs_threshold`` **and** ``max > balance_rel_threshold * min``.
   Imbalanced → the least-loaded worker (ties: the first, ``min_by_key`` over the
   workers in order), whatever the cache holds.
2. Otherwise prefix-match the prompt in the approximate tree:
   ``match_rate = matched / input`` (characters in HTTP mode, tokens in gRPC mode).
   If ``match_rate > cache_threshold`` (strictly) → the tenant at the deepest
   matched node; when several workers hold that node the pick is arbitrary
   (the first tenant), **not** load-aware. Otherwise → the least-loaded worker
   (ties: the first, as above; the Dec-2025 fix, sglang PR #14305/#14532, after a
   "death spiral" report;
   older builds and the doc comment send a miss to the worker with the
   **smallest tree**: ``fallback="smallest_tree"`` reproduces that).
3. Insert the prompt under the chosen worker (the "learning").

Defaults: sglang-router 0.3.2 command line (``router_args.py``): ``cache_threshold
0.3``, ``balance_abs_threshold 64``, ``balance_rel_threshold 1.5`` (the Rust
struct defaults for library use are 0.5 / 32 / 1.1).

Mapping onto kvgate
-------------------
* Load = ``state.inflight`` (this gateway's in-flight requests on the node), the
  same router-local counter; "the first" of equally loaded workers = the lowest slot
  (an earlier version broke ties by fewest requests routed, which no SGLang does:
  it spread misses more evenly than the real router).
* SGLang's tree is learned from its own routing and knows nothing of the engine's
  eviction: ``cache_view = "routed"`` (``tree="routed"``, the default) has the
  controller match the prompt against what it routed to each node, never evicted
  short of SGLang's 2^26 bound (:mod:`kvgate.core.routed_tree`), not against
  kvgate's cache location table, which mirrors each node's KV capacity; in precise
  mode too (the HTTP router reads no KV events; SGLang's gRPC mode, which does,
  selects by overlap without this policy's threshold). ``tree="index"``
  hands it kvgate's table (what SGLang would do knowing each node's evictions).
  ``match_rate = min(1, matches[node] * tokens_per_block / prompt_tokens)``.
  Only candidates count (SGLang skips unhealthy tenants the same way).
* "Several holders → the first" = the holder with the lowest slot.
* ``smallest_tree`` tracks each node's tree size as the tokens this policy added
  under it (prompt minus that node's match at routing time), never evicted
  (SGLang's per-tenant cap of 2^26 characters practically never bites).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing._common import (
    best_match,
    least_loaded,
    match_of,
    match_rate,
    require,
    uncached_tokens,
)
from kvgate.core.routing.base import CacheView, RouteContext, RouteDecision, RouteReason

_FALLBACKS = ("least_loaded", "smallest_tree")
_TREES: tuple[CacheView, ...] = ("routed", "index")


class SglangCacheAwarePolicy:
    """Imbalance switch → least loaded; else match rate > threshold → deepest holder."""

    name: ClassVar[str] = "sglang_cache_aware"
    uses_cache: ClassVar[bool] = True
    uses_hot_rate: ClassVar[bool] = False

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        fallback: str = "least_loaded",
        tree: str = "routed",
    ) -> None:
        require(0.0 <= cache_threshold <= 1.0, self.name, "cache_threshold must be in [0, 1]")
        require(balance_abs_threshold >= 0, self.name, "balance_abs_threshold must be >= 0")
        require(balance_rel_threshold >= 1.0, self.name, "balance_rel_threshold must be >= 1")
        require(fallback in _FALLBACKS, self.name, f"fallback must be one of {_FALLBACKS}")
        require(tree in _TREES, self.name, f"tree must be one of {_TREES}")
        self.cache_view: CacheView = "routed" if tree == "routed" else "index"
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.fallback = fallback
        self._tree_tokens: dict[NodeId, int] = {}

    def is_imbalanced(self, max_load: int, min_load: int) -> bool:
        return (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        )

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
        loads = [s.inflight for s in candidates]
        max_load, min_load = max(loads), min(loads)
        imbalanced = self.is_imbalanced(max_load, min_load)
        best = best_match(candidates, matches)
        best_rate = match_rate(ctx, best)

        def inflight(state: NodeState) -> float:
            return float(state.inflight)

        def tree(state: NodeState) -> float:
            return float(self._tree_tokens.get(state.node_id, 0))

        if imbalanced:
            chosen = least_loaded(candidates, inflight)
            reason = RouteReason.LOAD
        elif best_rate > self.cache_threshold:
            holders = [s for s in candidates if match_of(matches, s.node_id) == best]
            chosen = min(holders, key=lambda s: s.slot)  # first holder, not load-aware
            reason = RouteReason.CACHE_HIT
        elif self.fallback == "smallest_tree":
            chosen = least_loaded(candidates, tree)
            reason = RouteReason.LOAD
        else:
            chosen = least_loaded(candidates, inflight)
            reason = RouteReason.LOAD

        node_id = chosen.node_id
        matched = match_of(matches, node_id)
        self._tree_tokens[node_id] = self._tree_tokens.get(node_id, 0) + uncached_tokens(
            ctx, matched
        )
        rate = match_rate(ctx, matched)
        return RouteDecision(
            node_id=node_id,
            reason=reason,
            matched_blocks=matched,
            best_matched_blocks=best,
            score=rate,
            parts={
                "load": float(chosen.inflight),
                "match_rate": rate,
                "best_match_rate": best_rate,
                "imbalanced": 1.0 if imbalanced else 0.0,
                "max_load": float(max_load),
                "min_load": float(min_load),
            },
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None  # load is the NodeTable's in-flight count

    def on_node_removed(self, node_id: NodeId) -> None:
        self._tree_tokens.pop(node_id, None)
