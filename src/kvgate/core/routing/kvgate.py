"""kvgate's own policy: cache benefit against load, with a breaker, spread,
exploration and hot-prefix replication.

Why each rule is there, the measurements that set each default and the variants
tried and left out are in ``docs/kvgate-policy.md``; measure a change against them.

The score
---------
Two forms, both "cache benefit minus load", chosen by ``form``:

``form="brief"``, the design brief's function::

    bonus   = min(matched_tokens / max_prefix_len, 1) * cache_weight
    penalty = min(queue / max_queue, 1) + util_weight * utilisation
    score   = w_cache * bonus - w_load * penalty          (w_cache : w_load = 3 : 1)

``form="ttft"`` (the default), a predicted time to first token in seconds::

    bonus   = (h / prefill_tokens_per_s + c * h^2 / 2) * cache_weight
              (h = saved tokens: the prefill time of the cached prefix)
    prefill = pending_prefill_tokens / prefill_tokens_per_s      (queued prefill,
            + c * sum(q * (h + q / 2))                            linear and attention)
    penalty = prefill - e        if e <= head                     (the head's progress,
              prefill - 2 * head + e   otherwise                   or its overrun)
            + decode_s * utilisation                             (decode batch)
            + kv_pressure_s * max(0, (utilisation - 0.8) / 0.2)   (preemption risk)
            + decode_s_per_context_token * in-flight context tokens  (the decode
                                                                 batch's contexts)
    score   = cache_gain * bonus - penalty

The bonus grows with the prefill saved, not the matched fraction. The ttft form's
queue is the prefill tokens this gateway sent the node without a first token yet,
worked through in send order (vLLM's chunked prefill is first come first served):
``e`` is what the node has done of the head, and what is left of a head past its
predicted time is taken to be its overrun so far (an evicted hit, a preemption: the
stalled node grows less attractive by the second). ``cache_gain`` (5) values a hit above
its own TTFT saving because it also spares the node work that later requests queue
behind; ``cache_weight`` drops while a node has announced a bulk eviction, and the
request's ``cache_discount`` lowers it on nodes another tenant's flood is confined to.

The ttft form's rules past the score, in order
----------------------------------------------
:meth:`KvgatePolicy._ttft_rules` applies them; the new session, the affinity slack and
the tail guard are in :mod:`kvgate.core.routing.kvgate_rules`.

* **Blocking cost**: a prompt of at least ``blocking_min_s`` of uncached prefill is
  rescored over every candidate less ``blocking_cost`` x its prefill there x the
  node's cache value rate (prefill seconds our hits there saved lately, decayed over
  ``cache_value_tau_s``): long prompts stall the least-used cache.
* **New session**: in a fleet, a request whose cache no single holder has goes to
  its prefix's home, the same for every gateway (``fleet_home_s``); alone, a request
  that starts a session goes, within ``session_spread_s`` (``session_spread_shared_s``
  on a shared prefix) of the winner, to the node with the least recent work.
* **Bounded wait**: nobody waits for its cache more than ``max_cache_wait_s`` past
  the soonest predicted first token.
* **Affinity slack**: an open holder saving at least ``affinity_min_gain_s`` more than
  the winner keeps the request within ``affinity_slack_s`` of the winner's predicted
  TTFT (``affinity_short_slack_s`` when it saves less than ``affinity_short_gain_s``
  more), unless its KV is over 80 % used: moving a session copies its context onto a
  second node, where it evicts other sessions' caches.
* **Tail guard**: a request whose chosen node would start it past the tail level (the
  ``tail_quantile`` of the last ``tail_window`` requests' predicted full prefills,
  capped by ``ttft_target_s`` and the request's own target) goes to the best scored
  candidate under it, if any.

Then, in both forms
-------------------
In :meth:`KvgatePolicy.select`, after the score (and the ttft form's rules):

1. **Breaker per holder**: a holder whose queue reaches ``breaker_open_queue`` (until
   it falls to ``breaker_close_queue``), or that runs as many requests as its
   ``capacity``, loses its cache bonus.
2. **Spread**: several holders of a prefix compete on load through the same score.
3. **Hot-prefix replication**: a prefix arriving faster than ``replica_rps`` per
   holder, with fewer than ``max_replicas`` holders, gets one more replica.
4. **Exploration** (:mod:`kvgate.core.routing.kvgate_explore`): a hit that saves at
   most ``explore_max_loss_s`` goes to an idle non-holder with probability
   ``epsilon`` when the prefix is shared or the idle node would answer no later;
   with none idle, a shared prefix goes to the least loaded non-holder that would
   answer no later (``explore_busy``).

Exactly one ``rng.random()`` is drawn per decision, so a seeded driver replays the
same decisions whatever the cluster state.

Cost
----
The load part of the score is kept per node in best-first order
(:mod:`kvgate.core.routing.kvgate_loads`) and recomputed only for nodes whose load
changed; what the policy remembers across requests is in
:mod:`kvgate.core.routing.kvgate_memory`. Per request only the holders are scored in
Python; the best non-holder is the first candidate non-holder in that order, and the
rarer rules look further only when they can fire. Decisions are the same as scoring
every candidate in one loop (tests/core/test_kvgate_reference.py checks this).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason
from kvgate.core.routing.kvgate_explore import explore_target, least_loaded
from kvgate.core.routing.kvgate_loads import Load, LoadScores
from kvgate.core.routing.kvgate_memory import DecayedSeconds, TailLevel
from kvgate.core.routing.kvgate_rules import (
    Choice,
    fleet_home,
    spread_session,
    under_tail,
    within_slack,
)

_INF = float("inf")


class _Scan:
    """What the score over the candidates found (:meth:`KvgatePolicy._scan`)."""

    __slots__ = (
        "best",
        "best_bonus",
        "best_match",
        "best_match_tripped",
        "holders_at_best",
        "hot_holders",
        "open_holders",
        "soonest",
        "soonest_bonus",
        "soonest_s",
        "w_cache",
        "w_load",
        "win_score",
    )

    best: Load  # the winner
    best_bonus: float  # its bonus
    win_score: float  # its score
    best_match: int  # the longest match among the candidates
    holders_at_best: int  # how many hold it
    best_match_tripped: bool  # whether the breaker is open on all of them
    hot_holders: int  # the holders of a hot prefix
    open_holders: list[Choice]  # holders whose breaker is shut, their bonus
    soonest: Load | None  # the soonest predicted first token (penalty less bonus)
    soonest_bonus: float  # its bonus
    soonest_s: float  # its penalty less bonus
    w_cache: float  # the weights of the form
    w_load: float


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
        epsilon: float = 1.0,
        idle_queue: int = 0,
        idle_util: float = 0.2,
        replica_rps: float | None = None,
        max_replicas: int = 4,
        form: str = "ttft",
        prefill_tokens_per_s: float = 12_000.0,
        kv_pressure_s: float = 5.0,
        decode_s: float = 3.0,
        cache_gain: float = 5.0,
        attention_s_per_pair: float = 3.4e-9,
        blocking_cost: float = 3.0,
        blocking_min_s: float = 1.0,
        cache_value_tau_s: float = 30.0,
        affinity_slack_s: float = 20.0,
        affinity_min_gain_s: float = 0.03,
        affinity_short_gain_s: float = 0.25,
        affinity_short_slack_s: float = 4.0,
        explore_max_loss_s: float = 1.0,
        decode_s_per_context_token: float = 1.74e-5,
        max_cache_wait_s: float = 20.0,
        tail_quantile: float = 0.99,
        tail_window: int = 1000,
        session_spread_s: float = 0.5,
        session_spread_shared_s: float = 1.0,
        session_work_s: float = 4.0,
        session_min_shared_s: float = 0.25,
        recent_work_tau_s: float = 10.0,
        ttft_target_s: float = 0.0,
        fleet_home_s: float = 0.25,
        explore_busy: bool = True,
    ) -> None:
        if form not in ("ttft", "brief"):
            raise ConfigError("kvgate policy: form must be 'ttft' or 'brief'")
        if prefill_tokens_per_s <= 0:
            raise ConfigError("kvgate policy: prefill_tokens_per_s must be > 0")
        if max_prefix_len < 1 or max_queue < 1:
            raise ConfigError("kvgate policy: max_prefix_len and max_queue must be >= 1")
        if breaker_close_queue > breaker_open_queue:
            raise ConfigError("kvgate policy: breaker_close_queue must be <= breaker_open_queue")
        if not 0.0 <= epsilon <= 1.0:
            raise ConfigError("kvgate policy: epsilon must be in [0, 1]")
        nonnegative = {
            "blocking_cost": blocking_cost,
            "blocking_min_s": blocking_min_s,
            "affinity_slack_s": affinity_slack_s,
            "affinity_min_gain_s": affinity_min_gain_s,
            "affinity_short_gain_s": affinity_short_gain_s,
            "affinity_short_slack_s": affinity_short_slack_s,
            "explore_max_loss_s": explore_max_loss_s,
            "decode_s_per_context_token": decode_s_per_context_token,
            "max_cache_wait_s": max_cache_wait_s,
            "session_spread_s": session_spread_s,
            "session_spread_shared_s": session_spread_shared_s,
            "session_work_s": session_work_s,
            "session_min_shared_s": session_min_shared_s,
            "ttft_target_s": ttft_target_s,
            "fleet_home_s": fleet_home_s,
        }
        for key, value in nonnegative.items():
            if math.isnan(value) or value < 0:
                raise ConfigError(f"kvgate policy: {key} must be >= 0")
        if math.isinf(decode_s_per_context_token) or math.isinf(blocking_cost):
            raise ConfigError(
                "kvgate policy: decode_s_per_context_token and blocking_cost must be finite"
            )
        if cache_value_tau_s <= 0 or recent_work_tau_s <= 0:
            raise ConfigError("kvgate policy: cache_value_tau_s and recent_work_tau_s must be > 0")
        if not 0.0 <= tail_quantile < 1.0:
            raise ConfigError("kvgate policy: tail_quantile must be in [0, 1) (0: no tail guard)")
        if tail_window < 1:
            raise ConfigError("kvgate policy: tail_window must be >= 1")
        if not isinstance(explore_busy, bool):
            raise ConfigError("kvgate policy: explore_busy must be true or false")
        self.w_cache = w_cache
        self.w_load = w_load
        self.max_prefix_len = max_prefix_len
        self.max_queue = max_queue
        self.util_weight = util_weight
        self.breaker_open_queue = breaker_open_queue
        self.breaker_close_queue = breaker_close_queue
        self.epsilon = epsilon
        self.idle_queue = idle_queue
        self.idle_util = idle_util
        self.replica_rps = replica_rps
        self.max_replicas = max_replicas
        self.form = form
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.kv_pressure_s = kv_pressure_s
        self.decode_s = decode_s
        self.cache_gain = cache_gain
        self.attention_s_per_pair = attention_s_per_pair
        self.blocking_cost = blocking_cost
        self.blocking_min_s = blocking_min_s
        self.affinity_slack_s = affinity_slack_s
        self.affinity_min_gain_s = affinity_min_gain_s
        self.affinity_short_gain_s = affinity_short_gain_s
        self.affinity_short_slack_s = affinity_short_slack_s
        self.explore_max_loss_s = explore_max_loss_s
        self.decode_s_per_context_token = decode_s_per_context_token
        self.max_cache_wait_s = max_cache_wait_s
        self._cache_value = DecayedSeconds(cache_value_tau_s)
        self.tail_quantile = tail_quantile
        self.tail_window = tail_window
        self.session_spread_s = session_spread_s
        self.session_spread_shared_s = session_spread_shared_s
        self.session_work_s = session_work_s
        self.session_min_shared_s = session_min_shared_s
        # per node, the prefill seconds sent there lately, new sessions counted ahead
        self._recent_work = DecayedSeconds(recent_work_tau_s)
        # the tail guard's level (None: the guard is off)
        self._tail = TailLevel(tail_quantile, tail_window) if tail_quantile > 0 else None
        # the TTFT target caps the tail guard's level (0: no target)
        self.ttft_target_s = ttft_target_s
        self.fleet_home_s = fleet_home_s
        self.explore_busy = explore_busy
        self._tripped: set[NodeId] = set()  # holders whose breaker is open
        self._loads = LoadScores()

    @property
    def uses_hot_rate(self) -> bool:
        return self.replica_rps is not None  # only replication reads the rate

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        self._tripped.discard(node_id)
        self._cache_value.forget(node_id)
        self._recent_work.forget(node_id)

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
        ttft = self.form == "ttft"
        loads, cands = self._load_scores(ctx, candidates, nodes, now, ttft)
        # the score: the winner among the holders and the best non-holder
        scan = self._scan(ctx, loads, cands, matches, ttft)
        best, best_bonus, win_score = scan.best, scan.best_bonus, scan.win_score
        new_session = False
        if ttft:
            # the rules that look past the request itself
            best, best_bonus, win_score, new_session = self._ttft_rules(
                ctx, loads, cands, matches, scan, now
            )
        chosen = best.state
        chosen_match = matches.get(best.node_id, 0)
        reason = self._reason(
            chosen_match,
            scan.best_match,
            scan.holders_at_best,
            best_bonus,
            scan.best_match_tripped,
        )
        prompt, tpb = ctx.prompt_tokens, ctx.tokens_per_block

        # Hot-prefix replication: one more holder when the holders cannot keep up.
        least: NodeState | None = None
        if (
            self.replica_rps is not None
            and scan.hot_holders
            and scan.hot_holders < self.max_replicas
            and ctx.hot_rate > self.replica_rps * scan.hot_holders
        ):
            least = least_loaded(candidates, matches, loads.by_id)
        if least is not None:
            chosen, reason, chosen_match = least, RouteReason.REPLICATION, 0
        # Exploration: a small share of cache hits goes to an idle node that misses.
        elif (
            chosen_match
            and draw < self.epsilon
            and (loss := self._saved_s(prompt, chosen_match * tpb)) <= self.explore_max_loss_s
        ):
            idle = explore_target(
                ctx, candidates, loads, cands, matches, best, loss, new_session, now,
                ttft=ttft,
                idle_queue=self.idle_queue,
                idle_util=self.idle_util,
                explore_busy=self.explore_busy,
                min_gain_s=self.affinity_min_gain_s,
                uncached_s=self._uncached_s,
                blocking_s=self._blocking_s,
            )  # fmt: skip
            if idle is not None:
                chosen, reason, chosen_match = idle, RouteReason.EXPLORATION, 0

        if ttft and self.session_spread_s > 0.0:
            # the prefill sent, and the work a new session is expected to bring
            work = self._uncached_s(prompt, chosen_match * tpb)
            if new_session:
                work += self.session_work_s
            self._recent_work.add(chosen.spec.node_id, work, now)
        if ttft and self.blocking_cost > 0.0 and chosen is best.state and best_bonus > 0.0:
            # what this hit saves, in prefill seconds: the node's cache value
            saved = min(chosen_match * tpb, prompt)
            self._cache_value.add(best.node_id, saved * (1.0 / self.prefill_tokens_per_s), now)

        parts: dict[str, float] = {
            "bonus": best_bonus,
            "penalty": best.penalty,
            "queue": float(best.queue),
            "w_cache": scan.w_cache,
            "w_load": scan.w_load,
        }
        return RouteDecision(
            node_id=chosen.spec.node_id,
            reason=reason,
            matched_blocks=chosen_match,
            best_matched_blocks=scan.best_match,
            score=win_score,
            parts=parts,
        )

    def _load_scores(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        nodes: NodeTable,
        now: float,
        ttft: bool,
    ) -> tuple[LoadScores, frozenset[NodeState]]:
        """Every node's load terms brought up to date, and the candidates as a set."""
        params = (
            self.w_load,
            self.max_queue,
            self.util_weight,
            nodes.stale_after_s,
            ttft,
            self.prefill_tokens_per_s,
            self.kv_pressure_s,
            self.decode_s,
            self.attention_s_per_pair,
            self.decode_s_per_context_token,
        )
        loads = self._loads
        loads.sync(nodes, now, params)
        # Membership in the candidates: usually they are the table's eligible pool as
        # the controller passes it (nothing filtered per request), whose set is kept.
        cands = loads.candidate_set(nodes, ctx.model)
        if candidates != loads.pool_list:
            cands = frozenset(candidates)
            if len(cands) != len(candidates) or not cands <= loads.states:
                # Outside the contract (candidates are distinct nodes of the table):
                # score just these, by the same rules, without touching the cache.
                loads = LoadScores()
                loads.rebuild(nodes, candidates, now, params)
        return loads, cands

    def _scan(
        self,
        ctx: RouteContext,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        ttft: bool,
    ) -> _Scan:
        """The score over the candidates: every holder scored, then the best non-holder
        (the first in rank order), with what the later rules need of them."""
        by_id = loads.by_id
        tpb = ctx.tokens_per_block
        prompt = ctx.prompt_tokens
        if ttft:
            # seconds: the bonus is the prefill time saved (uncapped), counted cache_gain
            # times, because a hit also spares the node work that later requests wait on
            inv_prefix, cap = 1.0 / self.prefill_tokens_per_s, _INF
            attn_half = self.attention_s_per_pair / 2
            w_cache, w_load = self.cache_gain, 1.0
        else:
            inv_prefix, cap = 1.0 / self.max_prefix_len, 1.0
            attn_half = 0.0
            w_cache, w_load = self.w_cache, self.w_load
        hot_blocks = ctx.hot_blocks
        tripped_set, open_queue = self._tripped, self.breaker_open_queue
        discount = ctx.cache_discount  # usually empty

        best: Load | None = None
        best_key = (-_INF, 0, 0)  # (score, -queue, -slot): the highest wins
        best_score = -_INF  # best_key[0]
        best_bonus = 0.0
        best_match = 0  # longest match among candidates
        holders_at_best = 0
        best_match_tripped = False
        hot_holders = 0
        # the open holders and their bonus, for the affinity slack and the tail guard
        track_open = ttft and (
            self.affinity_slack_s > 0.0
            or self._tail is not None
            or self.ttft_target_s > 0.0
            or ctx.ttft_target_s > 0.0
            or self.session_spread_s > 0.0
            or self.fleet_home_s > 0.0
        )
        open_holders: list[Choice] = []
        # the soonest predicted first token: (penalty less bonus, queue, slot), its bonus
        soonest: Load | None = None
        soonest_key = (_INF, 0, 0)
        soonest_bonus = 0.0
        # The holders: the only candidates whose score depends on the request.
        for nid, m in matches.items():
            load = by_id.get(nid)
            if load is None or not m or load.state not in cands:
                continue
            q = load.queue
            if hot_blocks and m >= hot_blocks:
                hot_holders += 1
            # the queue's breaker first: its hysteresis follows the queue either way
            tripped = (
                (q >= open_queue or nid in tripped_set) and self._breaker_open(nid, q)
            ) or _at_capacity(load.state)
            if m > best_match:
                best_match, best_match_tripped, holders_at_best = m, tripped, 1
            elif m == best_match:
                holders_at_best += 1
                best_match_tripped = best_match_tripped and tripped
            if tripped:
                bonus = 0.0
                score = -w_load * load.penalty
            else:
                # min(m * tpb, prompt) and min(saved / max_prefix_len, 1), without the calls
                saved = m * tpb
                if saved > prompt:
                    saved = prompt
                # ttft: the prefill time of the cached prefix, a*h + c*h^2/2 (attn = c)
                bonus = saved * inv_prefix + attn_half * saved * saved
                if bonus > cap:
                    bonus = cap
                bonus *= (
                    load.state.cache_weight * discount.get(nid, 1.0)
                    if discount
                    else load.state.cache_weight
                )
                score = w_cache * bonus - w_load * load.penalty
                if track_open and bonus > 0.0:
                    open_holders.append((load, bonus))
            if ttft and (tkey := (load.penalty - bonus, q, load.slot)) < soonest_key:
                soonest, soonest_key, soonest_bonus = load, tkey, bonus
            if score >= best_score:
                key = (score, -q, -load.slot)
                if key > best_key:
                    best, best_key, best_score, best_bonus = load, key, score, bonus
        # Every non-holder scores -w_load * penalty: the best is the first candidate
        # non-holder in rank order (usually the first rank or close to it).
        for _, q, slot, load in loads.order:
            if load.state in cands and not matches.get(load.node_id):
                key = (load.score, -q, -slot)
                if key > best_key:
                    best, best_key, best_bonus = load, key, 0.0
                if ttft and (tkey := (load.penalty, q, slot)) < soonest_key:
                    soonest, soonest_key, soonest_bonus = load, tkey, 0.0
                break
        assert best is not None
        scan = _Scan()
        scan.best, scan.best_bonus, scan.win_score = best, best_bonus, best_key[0]
        scan.best_match, scan.holders_at_best = best_match, holders_at_best
        scan.best_match_tripped, scan.hot_holders = best_match_tripped, hot_holders
        scan.open_holders = open_holders
        scan.soonest, scan.soonest_bonus, scan.soonest_s = soonest, soonest_bonus, soonest_key[0]
        scan.w_cache, scan.w_load = w_cache, w_load
        return scan

    def _ttft_rules(
        self,
        ctx: RouteContext,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        scan: _Scan,
        now: float,
    ) -> tuple[Load, float, float, bool]:
        """The ttft form's rules past the score, in order: the blocking cost, a new
        session's home (in a fleet) or spread (alone), the bounded wait, the affinity
        slack, the tail guard. The winner, its bonus, its score and whether the request
        starts a new session."""
        best, best_bonus, win_score = scan.best, scan.best_bonus, scan.win_score
        best_match, open_holders, w_cache = scan.best_match, scan.open_holders, scan.w_cache
        prompt, tpb, discount = ctx.prompt_tokens, ctx.tokens_per_block, ctx.cache_discount
        # a new session (its cache is shared, or nowhere): in a fleet, to its prefix's
        # home; alone, where sessions work least
        new_session = False
        # each node's blocking cost, when the blocking rule rescored the request
        costs: Mapping[NodeId, float] = {}
        if self.blocking_cost > 0.0 and (
            self._uncached_s(prompt, matches.get(best.node_id, 0) * tpb) >= self.blocking_min_s
        ):
            best, win_score, best_bonus, costs = self._rescore_blocking(
                loads, cands, matches, prompt, tpb, w_cache, discount, now
            )
        # the latest predicted first token (penalty less bonus) a request waits for
        latest = scan.soonest_s + self.max_cache_wait_s
        moved = False
        home = None
        if (
            ctx.fleet
            and self.fleet_home_s > 0.0
            and not costs
            and (best_match == 0 or scan.holders_at_best >= 2)
        ):
            home = fleet_home(
                loads, cands, matches, open_holders, (best, best_bonus), best_match, ctx.chain,
                discount, self.fleet_home_s,
            )  # fmt: skip
        if home is not None:
            new_session = True
            if home[0] is not best:
                (best, best_bonus), moved = home, True
        elif self.session_spread_s > 0.0 and not costs:
            spread = spread_session(
                loads, cands, matches, open_holders, (best, best_bonus), best_match, prompt,
                tpb, now,
                window_s=self.session_spread_s,
                shared_window_s=self.session_spread_shared_s,
                min_shared_s=self.session_min_shared_s,
                saved_s=self._saved_s,
                recent_work=self._recent_work.rate,
            )  # fmt: skip
            if spread is not None:
                new_session = True
                if spread[0] is not best:
                    (best, best_bonus), moved = spread, True
        soonest = scan.soonest
        if soonest is not None and best.penalty - best_bonus > latest:
            # the winner keeps it waiting too long for its cache: the soonest node
            best, best_bonus, moved = soonest, scan.soonest_bonus, True
        if open_holders:
            kept = within_slack(
                best, best_bonus, open_holders, costs, latest,
                slack_s=self.affinity_slack_s,
                min_gain_s=self.affinity_min_gain_s,
                short_gain_s=self.affinity_short_gain_s,
                short_slack_s=self.affinity_short_slack_s,
            )  # fmt: skip
            if kept is not None:
                (best, best_bonus), moved = kept, True
        full = self._uncached_s(prompt, 0)
        level = self._tail.observe(full) if self._tail is not None else _INF
        if 0.0 < self.ttft_target_s < level:
            level = self.ttft_target_s
        if 0.0 < ctx.ttft_target_s < level:  # the request's own (a P0 SLO)
            level = ctx.ttft_target_s
        if (
            level < _INF
            and best.wait + self._uncached_s(prompt, matches.get(best.node_id, 0) * tpb) > level
        ):
            under = under_tail(
                loads, cands, matches, open_holders, costs, w_cache, prompt, tpb, full, level,
                self._uncached_s,
            )  # fmt: skip
            if under is not None:
                (best, best_bonus), moved = under, True
        if moved:
            win_score = w_cache * best_bonus - best.penalty - costs.get(best.node_id, 0.0)
        return best, best_bonus, win_score, new_session

    def _blocking_s(self, prompt: int, cached: int, node_id: NodeId, now: float) -> float:
        """The blocking cost of ``prompt``'s prefill (``cached`` tokens cached) on a node:
        ``blocking_cost`` x that prefill x the node's cache value rate (the prefill
        seconds per second our hits there have saved lately)."""
        cost = self.blocking_cost * self._uncached_s(prompt, cached)
        return cost * self._cache_value.rate(node_id, now)

    def _saved_s(self, prompt: int, cached: int) -> float:
        """Predicted prefill seconds that ``cached`` cached tokens of ``prompt`` save."""
        return self._uncached_s(prompt, 0) - self._uncached_s(prompt, cached)

    def _uncached_s(self, prompt: int, cached: int) -> float:
        """Predicted prefill seconds of ``prompt`` tokens of which ``cached`` are cached."""
        saved = min(cached, prompt)
        rest = prompt - saved
        return rest / self.prefill_tokens_per_s + self.attention_s_per_pair * rest * (
            saved + rest / 2
        )

    def _rescore_blocking(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        prompt: int,
        tpb: int,
        w_cache: float,
        discount: Mapping[NodeId, float],
        now: float,
    ) -> tuple[Load, float, float, dict[NodeId, float]]:
        """Every candidate scored with the blocking cost of this request's prefill there:
        the winner, its score, its bonus and every candidate's blocking cost."""
        inv_rate = 1.0 / self.prefill_tokens_per_s
        attn_half = self.attention_s_per_pair / 2
        top: Load | None = None
        top_key = (-_INF, 0, 0)
        top_bonus = 0.0
        costs: dict[NodeId, float] = {}
        for load in loads.by_id.values():
            if load.state not in cands:
                continue
            m = matches.get(load.node_id, 0)
            bonus = 0.0
            if m and load.node_id not in self._tripped and not _at_capacity(load.state):
                saved = min(m * tpb, prompt)
                weight = load.state.cache_weight * discount.get(load.node_id, 1.0)
                bonus = (saved * inv_rate + attn_half * saved * saved) * weight
            blocking = self._blocking_s(prompt, m * tpb, load.node_id, now)
            costs[load.node_id] = blocking
            key = (w_cache * bonus - load.penalty - blocking, -load.queue, -load.slot)
            if key > top_key:
                top, top_key, top_bonus = load, key, bonus
        assert top is not None
        return top, top_key[0], top_bonus, costs

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


def _at_capacity(state: NodeState) -> bool:
    """Whether a node runs (or queues) as many requests as it serves well: ours in
    flight there, or what it last reported when that is more (other gateways' too)."""
    occupied = max(state.inflight, state.reported_running + state.reported_waiting)
    return occupied >= state.spec.capacity
