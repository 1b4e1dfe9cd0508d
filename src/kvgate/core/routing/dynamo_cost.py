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

Mapping onto kvgate (the load approximation)
--------------------------------------------
Dynamo's load is router-local *predicted* state (``ActiveSequences``): it adds a
request's blocks and prefill tokens to the chosen worker at routing time, drops
the prefill tokens at the first token and the blocks at completion; replicas do
not share it unless ``--router-replica-sync`` is on (off by default). kvgate keeps
the same bookkeeping per node from its own decisions:

* ``block_size`` = ``ctx.tokens_per_block`` (chain blocks); this request's blocks
  = ``ceil(prompt_tokens / tokens_per_block)``, its uncached tokens on a node =
  ``prompt_tokens - matches[node] * tokens_per_block`` (floored at 0).
* Decode blocks, as Dynamo's ``ActiveSequences``: the node's *unique* active
  blocks (refcounted by chain hash, so a prefix shared by several routed
  requests still on the node counts once) plus this request's blocks not already
  among them (``new_blocks``). A prompt's partial last block has no chain hash
  and counts as its own. No output blocks (Dynamo's output-block tracking is off
  by default). ``on_finished`` removes the node's oldest entry (requests are
  assumed to leave in FIFO order; the protocol does not say which one left).
* Active un-prefilled tokens: kvgate gets no first-token event, so each node's
  prefills are modelled as served one after the other at ``prefill_tokens_per_s``
  (default 12,000 tok/s, the Llama-3-8B A100 profile of workloads.md §3.2, ≈ 12.3 K
  tok/s at 8 K tokens); a request's uncached tokens count in full until its
  estimated start, then linearly less until its estimated end. This is Dynamo's
  newer ``--router-prefill-load-model aic`` idea (decay the oldest active prefill
  with a predicted duration) with a linear throughput model.

Ties at temperature 0 → lower :meth:`NodeTable.queue` → lower slot. ``score`` is
the chosen logit (a cost). A sampled node that is not an argmin is reported as
``EXPLORATION``.
"""

from __future__ import annotations

import math
from collections import deque
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
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason

MAX_ACTIVE_PER_NODE = 65_536  # memory bound if on_finished is ever missed


@dataclass(slots=True)
class _Active:
    blocks: int  # prompt blocks of the sequence
    hashes: tuple[int, ...]  # its full blocks' chain hashes (at most ``blocks``)
    prefill_tokens: int  # its uncached tokens on this node
    start: float  # estimated prefill start / end
    end: float

    def remaining(self, now: float) -> float:
        if now >= self.end:
            return 0.0
        if now <= self.start or self.end <= self.start:
            return float(self.prefill_tokens)
        return self.prefill_tokens * (self.end - now) / (self.end - self.start)


class DynamoCostPolicy:
    """Argmin (or softmax sample) of Dynamo's prefill + decode block cost."""

    name: ClassVar[str] = "dynamo_cost"
    uses_cache: ClassVar[bool] = True
    uses_hot_rate: ClassVar[bool] = False

    def __init__(
        self,
        *,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        prefill_tokens_per_s: float = 12_000.0,
    ) -> None:
        require(overlap_weight >= 0.0, self.name, "overlap_weight must be >= 0")
        require(temperature >= 0.0, self.name, "temperature must be >= 0")
        require(prefill_tokens_per_s > 0.0, self.name, "prefill_tokens_per_s must be > 0")
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self._active: dict[NodeId, deque[_Active]] = {}
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

    def active_prefill_tokens(self, node_id: NodeId, now: float) -> float:
        total = 0.0
        for seq in reversed(self._active.get(node_id, ())):  # ends are monotonic per node
            if seq.end <= now:
                break
            total += seq.remaining(now)
        return total

    def _add(
        self, node_id: NodeId, blocks: int, hashes: Sequence[int], prefill_tokens: int, now: float
    ) -> None:
        q = self._active.setdefault(node_id, deque())
        start = max(now, q[-1].end) if q else now
        end = start + prefill_tokens / self.prefill_tokens_per_s
        seq = _Active(blocks, tuple(hashes[:blocks]), prefill_tokens, start, end)
        q.append(seq)
        refs = self._refs.setdefault(node_id, {})
        for h in seq.hashes:
            refs[h] = refs.get(h, 0) + 1
        self._tails[node_id] = self._tails.get(node_id, 0) + blocks - len(seq.hashes)
        if len(q) > MAX_ACTIVE_PER_NODE:
            self._release(node_id, q.popleft())

    def _release(self, node_id: NodeId, seq: _Active) -> None:
        refs = self._refs[node_id]
        for h in seq.hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
        self._tails[node_id] -= seq.blocks - len(seq.hashes)

    def on_finished(self, node_id: NodeId, now: float) -> None:
        q = self._active.get(node_id)
        if q:
            self._release(node_id, q.popleft())

    def on_node_removed(self, node_id: NodeId) -> None:
        self._active.pop(node_id, None)
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
            i = min(
                range(len(ordered)),
                key=lambda k: (logits[k], nodes.queue(ordered[k], now), ordered[k].slot),
            )
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
        self._add(chosen.node_id, request_blocks, ctx.chain, uncached_tokens(ctx, matched), now)
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
