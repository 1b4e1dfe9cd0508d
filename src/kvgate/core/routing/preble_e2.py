"""Preble's E2 (Exploitation + Exploration) global scheduling.

Algorithm (routing-anchors.md §8 "Preble"; workloads.md §2 "Preble (E2)")
-----------------------------------------------------------------------
Preble (ICLR 2025, arXiv 2407.00023, ``WukLab/preble``
``preble/global_scheduler_with_time.py``; ported to AIBrix as
``prefix-cache-preble``) decides per request:

* **Exploit** when the request's cached (matched) tokens exceed its uncached
  tokens: send it to a GPU holding the longest match, the lightest-loaded one
  if several hold it. (AIBrix's port: match ratio > 0.5, the same test.)
* **Explore** otherwise: the GPU with the minimum of
  ``recent load over a window H`` + ``eviction cost of making room`` +
  ``this request's prefill cost on that GPU``.

Preble's load of a GPU is the prefill time of the requests routed there within
the last H plus the decode time of its *active* requests (Preble's
``get_node_cost`` counts decode over the running requests' ref counter, so a
finished request's decode stops counting while its prefill stays in the window);
its eviction cost is the prefill time of what LRU would
evict, weighted by those prefixes' hit frequency. Rebalancing and hot-prefix
autoscaling are separate Preble mechanisms and are not part of E2 here.

Defaults and the cost model
---------------------------
* ``window_s = 180``: H = 3 minutes (Preble; AIBrix
  ``AIBRIX_ROUTER_PREBLE_SLIDING_WINDOW_PERIOD`` default 3 min).
* Costs are GPU-busy milliseconds from a linear model:
  ``cost = prefill_ms_per_token × uncached tokens + decode_ms_per_token × output tokens``.
  ``prefill_ms_per_token = 0.066`` is ``a`` of the Llama-3-8B A100 profile
  (workloads.md §3.2, vidur's linear ops, ≈ 15 K tok/s); ``decode_ms_per_token =
  0.25`` is the marginal batched cost of one decode token there, ``a + k·ctx`` =
  0.066 + 8.7e-5 × ~2 K context. Preble prices decode as output length × time per
  token; the marginal batched time keeps both terms in the same GPU-time unit.
  Output tokens = ``ctx.max_tokens`` (Preble uses the median output length).
* The window is this policy's own record of ``(time, node, prefill cost)`` for
  every request it routed, kept in a bounded deque with running per-node sums.
  The decode cost is held per node by request id (``RouteContext.request_id``)
  until :meth:`on_finished` releases it; an unknown or empty id at the end
  releases that node's oldest active request (``ActiveRequests``).
* ``eviction_weight = 0.0`` (off): when set, explore adds
  ``eviction_weight × utilisation × prefill_ms_per_token × uncached tokens`` —
  writing that many new tokens into a full cache evicts about as many cached
  ones whose recomputation costs the same prefill time (``eviction_weight``
  stands in for Preble's hit-frequency weight; kvgate does not know what LRU
  would evict). Utilisation is :meth:`NodeTable.utilisation` (1.0 when stale).

Ties → lower slot. ``score`` is the chosen node's cost in ms (exploit: its recent
load). The explore branch reports ``EXPLORATION`` when it leaves a holder.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing._common import (
    best_match,
    cache_reason,
    cached_tokens,
    least_loaded,
    match_of,
    require,
    uncached_tokens,
)
from kvgate.core.routing.active_requests import ActiveRequests
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason

MAX_WINDOW_ENTRIES = 200_000  # memory bound on the load window


class PrebleE2Policy:
    """Exploit the longest match when it covers most of the prompt, else explore by cost."""

    name: ClassVar[str] = "preble_e2"
    uses_cache: ClassVar[bool] = True
    uses_hot_rate: ClassVar[bool] = False

    def __init__(
        self,
        *,
        window_s: float = 180.0,
        prefill_ms_per_token: float = 0.066,
        decode_ms_per_token: float = 0.25,
        eviction_weight: float = 0.0,
    ) -> None:
        require(window_s > 0.0, self.name, "window_s must be > 0")
        require(prefill_ms_per_token >= 0.0, self.name, "prefill_ms_per_token must be >= 0")
        require(decode_ms_per_token >= 0.0, self.name, "decode_ms_per_token must be >= 0")
        require(eviction_weight >= 0.0, self.name, "eviction_weight must be >= 0")
        self.window_s = window_s
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_ms_per_token = decode_ms_per_token
        self.eviction_weight = eviction_weight
        self._window: deque[tuple[float, NodeId, float]] = deque()
        self._load: dict[NodeId, float] = {}
        self._count: dict[NodeId, int] = {}
        # active requests' decode ms (per node, by request id), and their sum per node
        self._active: ActiveRequests[float] = ActiveRequests(self._release)
        self._decode: dict[NodeId, float] = {}

    # --- the sliding-window load ---------------------------------------------------
    def recent_load(self, node_id: NodeId) -> float:
        """GPU milliseconds on ``node_id``: prefill of the requests routed there within
        the window plus decode of its active (routed, not finished) requests."""
        return self._load.get(node_id, 0.0) + self.active_decode(node_id)

    def active_decode(self, node_id: NodeId) -> float:
        """Decode milliseconds of the requests routed to ``node_id`` and not finished."""
        return self._decode.get(node_id, 0.0)

    def _drop_oldest(self) -> None:
        _, node_id, cost = self._window.popleft()
        left = self._count[node_id] - 1
        if left > 0:
            self._count[node_id] = left
            self._load[node_id] -= cost
        else:  # nothing of it in the window: forget it
            del self._count[node_id], self._load[node_id]

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._window and self._window[0][0] <= horizon:
            self._drop_oldest()

    def _record(self, node_id: NodeId, cost: float, now: float) -> None:
        self._window.append((now, node_id, cost))
        self._load[node_id] = self._load.get(node_id, 0.0) + cost
        self._count[node_id] = self._count.get(node_id, 0) + 1
        if len(self._window) > MAX_WINDOW_ENTRIES:
            self._drop_oldest()

    def _release(self, node_id: NodeId, decode_ms: float) -> None:
        if self._active.holds(node_id):
            self._decode[node_id] -= decode_ms
        else:  # none left: drop the node's sum and its float residue
            self._decode.pop(node_id, None)

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
        self._expire(now)
        best = best_match(candidates, matches)
        cached = cached_tokens(ctx, best)
        uncached = uncached_tokens(ctx, best)
        decode_ms = self.decode_ms_per_token * max(0, ctx.max_tokens)

        def load(state: NodeState) -> float:
            return self.recent_load(state.node_id)

        def prefill_ms(state: NodeState) -> float:
            return self.prefill_ms_per_token * uncached_tokens(
                ctx, match_of(matches, state.node_id)
            )

        def eviction_ms(state: NodeState) -> float:
            if self.eviction_weight == 0.0:
                return 0.0
            miss = uncached_tokens(ctx, match_of(matches, state.node_id))
            util = nodes.utilisation(state, now)
            return self.eviction_weight * util * self.prefill_ms_per_token * miss

        exploit = best > 0 and cached > uncached
        if exploit:
            holders = [s for s in candidates if match_of(matches, s.node_id) == best]
            chosen = least_loaded(holders, load)
            score = load(chosen)
            reason = RouteReason.CACHE_HIT
        else:

            def cost(state: NodeState) -> float:
                return load(state) + eviction_ms(state) + prefill_ms(state)

            chosen = least_loaded(candidates, cost)
            score = cost(chosen)
            reason = cache_reason(
                match_of(matches, chosen.node_id), best, lost=RouteReason.EXPLORATION
            )

        matched = match_of(matches, chosen.node_id)
        parts = {
            "exploit": 1.0 if exploit else 0.0,
            "cached_tokens": float(cached),
            "uncached_tokens": float(uncached),
            "recent_load_ms": load(chosen),
            "prefill_ms": prefill_ms(chosen),
            "eviction_ms": eviction_ms(chosen),
            "decode_ms": decode_ms,
        }
        self._record(chosen.node_id, prefill_ms(chosen), now)
        self._decode[chosen.node_id] = self._decode.get(chosen.node_id, 0.0) + decode_ms
        self._active.add(chosen.node_id, ctx.request_id, decode_ms)
        return RouteDecision(
            node_id=chosen.node_id,
            reason=reason,
            matched_blocks=matched,
            best_matched_blocks=best,
            score=score,
            parts=parts,
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        """Release the request's decode cost; its prefill stays in the window."""
        self._active.end(node_id, request_id)

    def on_node_removed(self, node_id: NodeId) -> None:
        # its window goes now (rare: one pass): a node added back under its id within the
        # window inherited the removed one's prefill load
        if self._count.pop(node_id, None) is not None:
            del self._load[node_id]
            self._window = deque(e for e in self._window if e[1] != node_id)
        self._active.forget(node_id)
        self._decode.pop(node_id, None)
