"""kvgate's own policy: cache benefit against load, with a breaker, spread,
exploration and hot-prefix replication.

Theory of operation
-------------------
Every candidate gets the design brief's score::

    bonus   = min(matched_tokens / max_prefix_len, 1) * cache_weight
    penalty = min(queue / max_queue, 1) + util_weight * utilisation
    score   = w_cache * bonus - w_load * penalty          (w_cache : w_load = 3 : 1)

``max_prefix_len`` is fixed, so the bonus grows with the prefill actually saved,
not with the matched *fraction* (a 90 % match of a 100-token prompt saves little).
``cache_weight`` drops below 1 while a node has announced a bulk eviction.

On top of the score, in this order:

1. **Breaker per holder.** A node whose queue reaches ``breaker_open_queue`` loses
   its cache bonus until its queue falls to ``breaker_close_queue`` (hysteresis, so
   a holder hovering at the threshold does not flap).
2. **Spread.** Several holders of the same prefix compete on load through the same
   score (equal bonus, different penalty), so the prefix is spread among its
   holders before affinity is given up.
3. **Hot-prefix replication.** When the request's hot prefix arrives faster than
   ``replica_rps`` per current holder, and it has fewer than ``max_replicas``
   holders, the request goes to the least-loaded non-holder: one more replica.
4. **Exploration.** With probability ``epsilon``, when the winner is a cache hit,
   an idle node that misses gets the request instead, so idle nodes warm up.

Exactly one ``rng.random()`` is drawn per decision, so a seeded driver replays
the same decisions whatever the cluster state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason


class KvgatePolicy:
    name: ClassVar[str] = "kvgate"
    uses_cache: ClassVar[bool] = True

    def __init__(
        self,
        *,
        w_cache: float = 3.0,
        w_load: float = 1.0,
        max_prefix_len: int = 8192,
        max_queue: int = 32,
        util_weight: float = 0.3,
        breaker_open_queue: int = 24,
        breaker_close_queue: int = 12,
        epsilon: float = 0.05,
        idle_queue: int = 0,
        replica_rps: float | None = None,
        max_replicas: int = 4,
    ) -> None:
        if max_prefix_len < 1 or max_queue < 1:
            raise ConfigError("kvgate policy: max_prefix_len and max_queue must be >= 1")
        if breaker_close_queue > breaker_open_queue:
            raise ConfigError("kvgate policy: breaker_close_queue must be <= breaker_open_queue")
        if not 0.0 <= epsilon <= 1.0:
            raise ConfigError("kvgate policy: epsilon must be in [0, 1]")
        self.w_cache = w_cache
        self.w_load = w_load
        self.max_prefix_len = max_prefix_len
        self.max_queue = max_queue
        self.util_weight = util_weight
        self.breaker_open_queue = breaker_open_queue
        self.breaker_close_queue = breaker_close_queue
        self.epsilon = epsilon
        self.idle_queue = idle_queue
        self.replica_rps = replica_rps
        self.max_replicas = max_replicas
        self._tripped: set[NodeId] = set()  # holders whose breaker is open

    def on_finished(self, node_id: NodeId, now: float) -> None:
        return None

    def _breaker_open(self, node_id: NodeId, queue: int) -> bool:
        tripped = self._tripped
        if node_id in tripped:
            if queue <= self.breaker_close_queue:
                tripped.discard(node_id)
                return False
            return True
        if queue >= self.breaker_open_queue:
            tripped.add(node_id)
            return True
        return False

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
        draw = rng.random()
        tpb = ctx.tokens_per_block
        prompt = ctx.prompt_tokens
        inv_prefix = 1.0 / self.max_prefix_len
        inv_queue = 1.0 / self.max_queue
        w_cache, w_load, util_w = self.w_cache, self.w_load, self.util_weight

        best: NodeState | None = None
        best_key = (float("-inf"), 0, 0)
        best_bonus = 0.0
        best_penalty = 0.0
        best_queue = 0
        best_match = 0  # longest match among candidates
        holders_at_best = 0
        best_match_tripped = False
        least: NodeState | None = None  # least-loaded non-holder, for replication
        least_key = (float("inf"), 0)
        idle: NodeState | None = None  # least-utilised idle non-holder, for exploration
        idle_util = float("inf")
        hot_holders = 0
        hot_blocks = ctx.hot_blocks
        stale_after = nodes.stale_after_s
        max_queue = self.max_queue
        idle_queue = self.idle_queue
        get_match = matches.get
        # The load rule of NodeTable.queue()/utilisation(), inlined: this loop runs for
        # every candidate of every request.
        for s in candidates:
            rt = s.report_time
            if rt is None or now - rt > stale_after:
                q, u = s.inflight, 1.0
            else:
                q, u = s.reported_waiting + s.sent_since_report, s.kv_util
            penalty = (q * inv_queue if q < max_queue else 1.0) + util_w * u
            nid = s.spec.node_id
            m = get_match(nid, 0)
            if m:
                if hot_blocks and m >= hot_blocks:
                    hot_holders += 1
                tripped = self._breaker_open(nid, q)
                if m > best_match:
                    best_match, best_match_tripped, holders_at_best = m, tripped, 1
                elif m == best_match:
                    holders_at_best += 1
                    best_match_tripped = best_match_tripped and tripped
                if tripped:
                    score = -w_load * penalty
                    bonus = 0.0
                else:
                    saved = min(m * tpb, prompt)
                    bonus = min(saved * inv_prefix, 1.0) * s.cache_weight
                    score = w_cache * bonus - w_load * penalty
            else:
                if penalty < least_key[0] or (penalty == least_key[0] and s.slot < least_key[1]):
                    least, least_key = s, (penalty, s.slot)
                if q <= idle_queue and u < idle_util:
                    idle, idle_util = s, u
                score = -w_load * penalty
                bonus = 0.0
            if score >= best_key[0]:
                key = (score, -q, -s.slot)
                if key > best_key:
                    best, best_key = s, key
                    best_bonus, best_penalty, best_queue = bonus, penalty, q
        assert best is not None
        chosen = best
        chosen_match = matches.get(best.spec.node_id, 0)
        reason = self._reason(
            chosen_match, best_match, holders_at_best, best_bonus, best_match_tripped
        )

        # Hot-prefix replication: one more holder when the holders cannot keep up.
        if (
            self.replica_rps is not None
            and least is not None
            and hot_holders
            and hot_holders < self.max_replicas
            and ctx.hot_rate > self.replica_rps * hot_holders
        ):
            chosen, reason, chosen_match = least, RouteReason.REPLICATION, 0
        # Exploration: a small share of cache hits goes to an idle node that misses.
        elif idle is not None and chosen_match and draw < self.epsilon:
            chosen, reason, chosen_match = idle, RouteReason.EXPLORATION, 0

        parts: dict[str, float] = {
            "bonus": best_bonus,
            "penalty": best_penalty,
            "queue": float(best_queue),
            "w_cache": w_cache,
            "w_load": w_load,
        }
        return RouteDecision(
            node_id=chosen.spec.node_id,
            reason=reason,
            matched_blocks=chosen_match,
            best_matched_blocks=best_match,
            score=best_key[0],
            parts=parts,
        )

    @staticmethod
    def _reason(
        chosen_match: int,
        best_match: int,
        holders_at_best: int,
        bonus: float,
        best_match_tripped: bool,
    ) -> RouteReason:
        if chosen_match and bonus > 0:
            if chosen_match >= best_match and holders_at_best == 1:
                return RouteReason.CACHE_HIT
            return RouteReason.SPREAD  # one of several holders, picked by load
        if best_match and best_match_tripped:
            return RouteReason.BREAKER
        return RouteReason.LOAD
