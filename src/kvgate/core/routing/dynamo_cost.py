"""NVIDIA Dynamo KV router cost: ``overlap_weight × prefill_blocks + decode_blocks``.

Algorithm (routing-anchors.md §5(a); workloads.md §2 "Dynamo KV router")
-----------------------------------------------------------------------
Dynamo's ``DefaultWorkerSelector`` (``lib/llm/src/kv_router``, docs/router/
kv_cache_routing.md) scores every worker with a cost, lower is better::

    logit = overlap_weight * potential_prefill_blocks + potential_decode_blocks
    potential_prefill_blocks = (worker's active un-prefilled tokens
                                + request tokens not in the worker's cached prefix) / block_size
    potential_decode_blocks  = blocks of the worker's active sequences + this request's blocks

``router_temperature == 0`` (default): the argmin (Dynamo breaks ties by the
smaller radix tree, then at random). ``> 0``: the logits are min-max normalised,
``softmax(-normalised / T)`` is sampled (all equal → uniform). Defaults:
``overlap_score_weight = 1.0`` (renamed ``--router-kv-overlap-score-credit`` in
newer builds, still 1), ``router_temperature = 0.0``.

Mapping onto kvgate (Dynamo's router-local bookkeeping, exactly)
----------------------------------------------------------------
Dynamo's load is router-local *predicted* state (``ActiveSequences``): it adds a
request's blocks and prefill tokens to the chosen worker at routing time, drops the
prefill tokens at the request's first token (``mark_prefill_completed``) and its
blocks at its completion (``free(request_id)``); replicas do not share it unless
``--router-replica-sync`` is on (off by default). kvgate keeps the same, per node and
per request (``RouteContext.request_id``; the controller reports each request's
first token and end by id):

* ``block_size`` = ``ctx.tokens_per_block`` (chain blocks); this request's blocks
  = ``ceil(prompt_tokens / tokens_per_block)``, its uncached tokens on a node =
  ``prompt_tokens - matches[node] * tokens_per_block`` (floored at 0).
* Decode blocks, as Dynamo's ``ActiveSequences``: the node's *unique* active
  blocks (refcounted by chain hash, so a prefix shared by several routed
  requests still on the node counts once) plus this request's blocks not already
  among them (``new_blocks``). A prompt's partial last block has no chain hash
  and counts as its own. No output blocks (Dynamo's output-block tracking is off
  by default).
* Active un-prefilled tokens: the uncached tokens of the node's requests that have
  not produced a first token yet (Dynamo's default prefill load model).

Ties at temperature 0, as Dynamo: uniformly at random among the cheapest (Dynamo
first prefers the worker with the smaller radix tree, which kvgate's index does not
report per policy). ``score`` is the chosen logit (a cost). A sampled node that is
not an argmin is reported as ``EXPLORATION``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng, pick_index
from kvgate.core.routing._common import (
    best_match,
    by_slot,
    cache_reason,
    match_of,
    require,
    uncached_tokens,
)
from kvgate.core.routing.active_requests import ActiveRequests
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason


@dataclass(slots=True)
class _Active:
    blocks: int  # prompt blocks of the sequence
    hashes: tuple[int, ...]  # its full blocks' chain hashes (at most ``blocks``)
    prefill_tokens: int  # its uncached tokens on this node; 0 once it has a first token


class DynamoCostPolicy:
    """Argmin (or softmax sample) of Dynamo's prefill + decode block cost."""

    name: ClassVar[str] = "dynamo_cost"
    uses_cache: ClassVar[bool] = True
    uses_hot_rate: ClassVar[bool] = False

    def __init__(self, *, overlap_weight: float = 1.0, temperature: float = 0.0) -> None:
        require(overlap_weight >= 0.0, self.name, "overlap_weight must be >= 0")
        require(temperature >= 0.0, self.name, "temperature must be >= 0")
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        # per node, its active sequences by request id, and what they add up to
        self._active: ActiveRequests[_Active] = ActiveRequests(self._release)
        self._prefill: dict[NodeId, int] = {}  # active un-prefilled tokens
        self._refs: dict[NodeId, dict[int, int]] = {}  # chain hash -> active sequences
        self._tails: dict[NodeId, int] = {}  # active blocks without a chain hash

    # --- the router-local active-load view ---------------------------------------
    def active_blocks(self, node_id: NodeId) -> int:
        """Unique active prompt blocks on the node."""
        return len(self._refs.get(node_id, ())) + self._tails.get(node_id, 0)

    def new_blocks(self, node_id: NodeId, hashes: Sequence[int], blocks: int) -> int:
        """Of a ``blocks``-block prompt, the blocks not already active on the node."""
        refs = self._refs.get(node_id)
        if not refs:  # nothing active on the node: every block is new
            return blocks
        return blocks - sum(1 for h in hashes[:blocks] if h in refs)

    def active_prefill_tokens(self, node_id: NodeId, now: float = 0.0) -> float:
        """The node's active un-prefilled tokens (requests without a first token)."""
        return float(self._prefill.get(node_id, 0))

    def _add(
        self, node_id: NodeId, key: str, blocks: int, hashes: Sequence[int], prefill_tokens: int
    ) -> None:
        seq = _Active(blocks, tuple(hashes[:blocks]), prefill_tokens)
        self._prefill[node_id] = self._prefill.get(node_id, 0) + prefill_tokens
        refs = self._refs.setdefault(node_id, {})
        for h in seq.hashes:
            refs[h] = refs.get(h, 0) + 1
        self._tails[node_id] = self._tails.get(node_id, 0) + blocks - len(seq.hashes)
        self._active.add(node_id, key, seq)

    def _release(self, node_id: NodeId, seq: _Active) -> None:
        refs = self._refs[node_id]
        for h in seq.hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
        self._tails[node_id] -= seq.blocks - len(seq.hashes)
        self._prefill[node_id] -= seq.prefill_tokens

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        seq = self._active.get(node_id, request_id)
        if seq is not None and seq.prefill_tokens:
            self._prefill[node_id] -= seq.prefill_tokens
            seq.prefill_tokens = 0

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        self._active.end(node_id, request_id)

    def on_node_removed(self, node_id: NodeId) -> None:
        self._active.forget(node_id)
        self._prefill.pop(node_id, None)
        self._refs.pop(node_id, None)
        self._tails.pop(node_id, None)

    # --- selection ------------------------------------------------------------------
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
        tpb = max(1, ctx.tokens_per_block)
        request_blocks = math.ceil(max(0, ctx.prompt_tokens) / tpb)
        ordered = by_slot(candidates)
        rows: list[tuple[float, float, float, float]] = []  # logit, prefill, decode, active
        for state in ordered:
            active = self.active_prefill_tokens(state.node_id, now)
            uncached = uncached_tokens(ctx, match_of(matches, state.node_id))
            prefill_blocks = (active + uncached) / tpb
            decode_blocks = float(
                self.active_blocks(state.node_id)
                + self.new_blocks(state.node_id, ctx.chain, request_blocks)
            )
            logit = self.overlap_weight * prefill_blocks + decode_blocks
            rows.append((logit, prefill_blocks, decode_blocks, active))
        logits = [r[0] for r in rows]
        lo, hi = min(logits), max(logits)
        probability = 1.0
        if self.temperature == 0.0 or len(ordered) == 1:
            cheapest = [k for k in range(len(ordered)) if logits[k] == lo]
            i = cheapest[pick_index(rng, len(cheapest))] if len(cheapest) > 1 else cheapest[0]
        elif lo == hi:
            i = pick_index(rng, len(ordered))
            probability = 1.0 / len(ordered)
        else:
            weights = [math.exp(-(x - lo) / (hi - lo) / self.temperature) for x in logits]
            total = sum(weights)
            u = rng.random() * total
            i, acc = len(weights) - 1, 0.0
            for k, w in enumerate(weights):
                acc += w
                if u < acc:
                    i = k
                    break
            probability = weights[i] / total

        chosen = ordered[i]
        logit, prefill_blocks, decode_blocks, active = rows[i]
        matched = match_of(matches, chosen.node_id)
        best = best_match(candidates, matches)
        reason = cache_reason(matched, best)
        if logit > lo:
            reason = RouteReason.EXPLORATION
        self._add(
            chosen.node_id, ctx.request_id, request_blocks, ctx.chain, uncached_tokens(ctx, matched)
        )
        return RouteDecision(
            node_id=chosen.node_id,
            reason=reason,
            matched_blocks=matched,
            best_matched_blocks=best,
            score=logit,
            parts={
                "logit": logit,
                "prefill_blocks": prefill_blocks,
                "decode_blocks": decode_blocks,
                "active_prefill_tokens": active,
                "overlap_weight": self.overlap_weight,
                "min_logit": lo,
                "probability": probability,
            },
        )
