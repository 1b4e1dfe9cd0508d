"""The kvgate policy's load scores: every node's load terms, kept best first.

The load part of the kvgate score (:mod:`kvgate.core.routing.kvgate`) depends on the
node, not on the request, so :class:`LoadScores` keeps one :class:`Load` per node in
best-first order and recomputes only the nodes whose load changed (the node table's
load journal), those with prefill queued when the drain clock ticks, all of them when
a fresh report may have gone stale or the membership changed. Per request the policy
scores only the holders and takes the first candidate non-holder in that order.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable

__all__ = ["DRAIN_TICK_S", "PRESSURE_UTIL", "Load", "LoadScores", "Params", "drain_clock"]

_INF = float("inf")

# (w_load, max_queue, util_weight, stale_after_s, ttft form?, prefill tokens/s,
# kv_pressure_s, decode_s, attention_s_per_pair, decode_s_per_context_token): what the
# scores were computed with
Params = tuple[float, int, float, float, bool, float, float, float, float, float]

# More load changes than this since the last request: rescore every node instead.
_MAX_INCREMENTAL = 16
# The prefill a node has already done is counted on a clock of this resolution, so the
# scores of busy nodes move at most this often however many requests arrive.
DRAIN_TICK_S = 0.01
# KV utilisation above which a node risks preemptions: the KV-pressure term grows from
# here, and the affinity slack does not hold requests on such a holder.
PRESSURE_UTIL = 0.8


def drain_clock(now: float) -> float:
    """``now`` rounded down to the drain clock's tick."""
    return (now // DRAIN_TICK_S) * DRAIN_TICK_S


class Load:
    """One node's load terms at the time they were computed."""

    __slots__ = (
        "moving",
        "node_id",
        "penalty",
        "queue",
        "rank",
        "score",
        "slot",
        "state",
        "util",
        "wait",
    )

    def __init__(
        self, state: NodeState, queue: int, util: float, params: Params, clock: float
    ) -> None:
        w_load, max_queue, util_weight, _, ttft, rate, kv_pressure_s, decode_s, attn, ctx_s = params
        self.state = state
        self.node_id = state.spec.node_id
        self.slot = state.slot
        self.queue = queue
        self.util = util
        self.moving = False  # the penalty changes as the drain clock moves
        self.wait = 0.0  # predicted seconds before a newcomer's prefill starts (ttft form)
        if ttft:
            # seconds of prefill queued here (as the node works through it), plus a
            # KV-pressure term that grows from 0 at 80 % utilisation to kv_pressure_s
            # when full (preemptions)
            prefill = state.pending_prefill_tokens / rate + state.pending_prefill_pairs * attn
            if prefill > 0.0:
                self.moving = True
                elapsed = clock - state.prefill_since
                if elapsed > 0.0:
                    head_tokens, head_pairs = state.head_prefill
                    head = head_tokens / rate + head_pairs * attn
                    if elapsed <= head:
                        prefill -= elapsed  # done of the head so far
                    else:  # overdue: the head is larger than predicted, so is what is left
                        prefill += elapsed - 2.0 * head
            self.wait = prefill
            self.penalty = (
                prefill
                + decode_s * util
                + kv_pressure_s * max(0.0, (util - PRESSURE_UTIL) * 5.0)  # 0 at 80 %, 1 full
                + ctx_s * state.inflight_context_tokens  # the decode batch's contexts
            )
        else:
            self.penalty = min(queue / max_queue, 1.0) + util_weight * util
        # the score of a node that matches nothing (the ttft form has no weights)
        self.score = -(1.0 if ttft else w_load) * self.penalty
        # Sorted ascending, ranks run from the best non-holder to the worst under the
        # policy's tie-break (higher score, then lower queue, then lower slot). Slots
        # are unique in a table, so comparisons never reach the Load.
        self.rank = (-self.score, queue, state.slot, self)


class LoadScores:
    """The load terms of every node of one :class:`NodeTable`, kept best first.

    Valid for any ``now`` from the latest one it was computed at until the oldest
    fresh report becomes stale: ``now - report_time`` only grows with ``now``, so a
    stale node stays stale, and no fresh node turns stale before the oldest one.
    """

    __slots__ = (
        "by_id",
        "clock",
        "draining",
        "load_seq",
        "now",
        "oldest_fresh",
        "order",
        "params",
        "pool",
        "pool_list",
        "pool_set",
        "states",
        "table",
        "version",
    )

    def __init__(self) -> None:
        self.table: NodeTable | None = None
        self.version = -1
        self.load_seq = -1
        self.params: Params | None = None
        self.now = -_INF
        self.clock = -_INF  # the drain clock the penalties were computed at
        self.oldest_fresh = _INF  # the oldest report_time among fresh nodes
        # the scored nodes whose penalty moves with the drain clock (prefill queued)
        self.draining: dict[NodeId, NodeState] = {}
        self.by_id: dict[NodeId, Load] = {}
        self.states: frozenset[NodeState] = frozenset()  # every scored state
        self.order: list[tuple[float, int, int, Load]] = []  # the ranks, ascending
        # the table's eligible pool last seen, as a list and as a set
        self.pool: tuple[NodeState, ...] | None = None
        self.pool_list: list[NodeState] = []
        self.pool_set: frozenset[NodeState] = frozenset()

    def sync(self, nodes: NodeTable, now: float, params: Params) -> None:
        """Bring the scores up to date for ``now``."""
        if (
            nodes is not self.table
            or nodes.version != self.version
            or params != self.params
            or now < self.now
            or now - self.oldest_fresh > params[3]
        ):
            self.rebuild(nodes, nodes, now, params)
            return
        if nodes.load_seq != self.load_seq:
            changed = nodes.load_changes_since(self.load_seq)
            if changed is None or len(changed) > _MAX_INCREMENTAL:
                self.rebuild(nodes, nodes, now, params)
                return
        else:
            changed = []
        clock = drain_clock(now)
        if clock != self.clock:
            self.clock = clock
            for state in list(self.draining.values()):  # busy nodes got on with their prefill
                self._update(nodes, state, now, params)
        if changed:
            for state in dict.fromkeys(changed):  # a node may appear many times
                self._update(nodes, state, now, params)
            self.load_seq = nodes.load_seq
        self.now = now

    def rebuild(
        self, nodes: NodeTable, states: Iterable[NodeState], now: float, params: Params
    ) -> None:
        """Score ``states`` (the table's nodes, or foreign candidates) from scratch."""
        self.table = nodes if states is nodes else None
        self.version = nodes.version
        self.load_seq = nodes.load_seq
        self.params = params
        self.now = now
        self.clock = drain_clock(now)
        self.oldest_fresh = _INF
        self.draining = {}
        self.by_id = {s.spec.node_id: self._load(nodes, s, now, params) for s in states}
        self.states = frozenset(load.state for load in self.by_id.values())
        self.order = sorted(load.rank for load in self.by_id.values())

    def candidate_set(self, nodes: NodeTable, model: str) -> frozenset[NodeState]:
        """The set of the table's eligible nodes for ``model``, kept while it is the same."""
        pool = nodes.eligible(model)[0]
        if pool is not self.pool:
            self.pool, self.pool_list, self.pool_set = pool, list(pool), frozenset(pool)
        return self.pool_set

    def _load(self, nodes: NodeTable, state: NodeState, now: float, params: Params) -> Load:
        if not nodes.is_stale(state, now):
            rt = state.report_time
            assert rt is not None
            self.oldest_fresh = min(self.oldest_fresh, rt)
        clock = self.clock
        load = Load(state, nodes.queue(state, now), nodes.utilisation(state, now), params, clock)
        if load.moving:
            self.draining[load.node_id] = state
        else:
            self.draining.pop(load.node_id, None)
        return load

    def _update(self, nodes: NodeTable, state: NodeState, now: float, params: Params) -> None:
        old = self.by_id.get(state.spec.node_id)
        if old is None or old.state is not state:
            # not a node of this snapshot (removed since): the node now of its id, if any,
            # keeps draining (a request of the removed one ending froze its score)
            if self.draining.get(state.spec.node_id) is state:
                del self.draining[state.spec.node_id]
            return
        new = self._load(nodes, state, now, params)
        if new.rank[:3] != old.rank[:3] or new.util != old.util:
            order = self.order
            del order[bisect_left(order, old.rank)]
            insort(order, new.rank)
            self.by_id[new.node_id] = new
