"""The facade every driver calls: events in, decisions out.

Theory of operation
-------------------
One ``Controller`` per gateway. The gateway (asyncio), the simulator (virtual
time) and the tests call it from one thread, never awaiting inside a call, so each
call is atomic without locks. ``now`` is always passed in and randomness comes
from the injected ``rng``: the same inputs give the same decisions.

A request's life::

    on_arrival ──► Reject                      (stage 1 said no)
               ──► Hold ──(credit freed)──► Dispatch   (via on_finished/tick/...)
               ──► Dispatch ─► on_first_byte ─► on_finished
                           └─► on_failed ──► Dispatch(attempt=2, another node) | Fail

Stage 1 (admission) runs before any routing work. Routing filters candidates,
matches the prompt's chain against the cache location table, and asks the
configured policy. In approximate mode the chosen node is assumed to hold the
chain from then on (the index learns from our own routing); in precise mode the
guess is speculative and the engines' KV events confirm or expire it.

The predicted hit (whole blocks, at most the prompt less one token, as the engine
hits) is checked against the cached tokens the engine states when the request ends:
the stats' confirmed / checked tokens are the index's precision. On the conversation
trace (kvgate, 8 nodes, 0.8 of round robin's saturation) approximate mode's is 0.957,
precise mode's 0.992. Of approximate mode's misses 86 % were gone before the request
reached its node, the rest evicted while it queued there; they cluster at the index's
LRU end (a third of the hit tokens promised from a node's 100 least recently touched
entries were gone, none past its 400th). Tried and left out, each to make the
index evict earlier: counting the blocks of generated tokens the engine caches (an
entry per expected block), discounting matches among a node's 50-200 least recent
entries, touching the chain again when the request ends (the engine's LRU order),
forgetting a node's entries older than a promised block found gone. Each lowered the
hit ratio (to 0.1572-0.1719 from 0.1732 at 0.95 of saturation) or raised TTFT p99
(17.28 / 17.40 s from 17.05 / 17.00 s at 0.8 / 0.95): most entries past the engine's
horizon in index order are still cached, and routing loses them too.

Every admitted request holds one credit (its ticket) until it finishes, fails
for good or is cancelled; a gateway retry reuses the same credit.

A tenant that stage 1 refused for asking more than its quota (``admission.pressed``)
is confined for ``tenant_confine_s``: its requests go only to the nodes already
holding its requests (any node if those cannot take them), and there, while prefill
is queued (what a newcomer's first token would wait behind), the other tenants' cache
counts ``evicting_cache_weight``, so a flood held to its quota stalls a few nodes that
everybody else avoids, not every node. In a fleet (several gateways, each seeing only
its own requests) it is the tenant's home node instead, the same at every gateway,
discounted while it reports requests waiting or runs at least as many as the average
node (a gateway does not see the others' prefill there). Both are
:mod:`kvgate.core.flood_confinement`'s (``Controller.floods``).

When a node is marked down (health probes, or ejection after failures in a row) the
attempts on it that have no first byte yet will not get one (a hung or dead engine):
the controller lists them, and the driver, which alone knows whether response headers
came in, aborts them (``take_aborts``) and reports each as
``on_failed(NODE_DOWN, before_first_byte=True)``: retried elsewhere or failed (503).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvgate.core.admission import (
    NOT_RUN_FAILURES,
    AdmissionRequest,
    Admitted,
    Coordinator,
    CoordinatorUnavailable,
    FailureKind,
    GatewayAdmission,
    LeaseGrant,
    Priority,
    Queued,
    RefreshRequest,
    Rejected,
    RejectReason,
    RetryPolicy,
    Ticket,
    make_rejection,
    overloaded_rejection,
)
from kvgate.core.admission.types import ESTIMATE_SLACK
from kvgate.core.config import ControllerConfig
from kvgate.core.decisions import Decision, Dispatch, Fail, Hold, Preempt, Reject
from kvgate.core.errors import ClientRequestError
from kvgate.core.events import RequestArrived
from kvgate.core.eviction_notices import EvictionNotices
from kvgate.core.flood_confinement import FloodConfinement
from kvgate.core.hashing import Hasher, make_hasher
from kvgate.core.ids import BlockChain, NodeId, RequestId
from kvgate.core.index import ClusterIndex
from kvgate.core.index_learning import IndexLearning, Learned
from kvgate.core.node_ejection import EJECTING_FAULTS, NodeEjections
from kvgate.core.nodes import NodeSpec, NodeState, NodeTable, fleet_order
from kvgate.core.refusals import REFUSALS, RefusalBackoff
from kvgate.core.request_context import RouteContexts, prompt_chain
from kvgate.core.rng import Rng
from kvgate.core.routed_tree import RoutedTree
from kvgate.core.routing import RouteContext, RouteDecision, make_policy
from kvgate.core.routing.base import cache_view
from kvgate.core.stats import ControllerStats, DecisionRecord

# Failures before the first byte after which the node holds nothing of the prompt: it
# refused the request, never received it, or was marked down before it answered.
_NEVER_RAN = NOT_RUN_FAILURES | {
    FailureKind.CONNECT_ERROR, FailureKind.CLIENT_ERROR, FailureKind.NODE_AUTH
}
# The failures the cluster breaker counts: faults of a node or of the way to it. A
# client's own bad request says nothing of the cluster, and a node refusing for load
# is working: its refusals are backpressure, which admission answers (the budget, the
# class rules). Counted, a P2 flood refused at the nodes opened the breaker for every
# class, P0 included. Those that eject a node, and a node marked down.
_FAULTS = EJECTING_FAULTS | {FailureKind.NODE_DOWN}
# a queued request turned away for waiting too long, or pushed out of a full queue
_GAVE_UP_WAITING = frozenset({RejectReason.QUEUE_TIMEOUT, RejectReason.QUEUE_FULL})


@dataclass(slots=True)
class _Request:
    """Per-request state, alive from admission to the terminal outcome."""

    request_id: RequestId
    ctx: RouteContext
    arrived: RequestArrived
    ticket: Ticket | None = None
    node: NodeState | None = None
    arrived_at: float = 0.0  # when the gateway got it: the client's TTFT runs from here
    sent_at: float = 0.0
    attempts: int = 0
    excluded: set[NodeId] = field(default_factory=set)
    first_byte: bool = False
    predicted_hit_tokens: int = 0
    # approximate mode: the blocks the current attempt's dispatch taught the index its
    # node holds, taken back if the node never runs the attempt
    learned: Learned = None


class Controller:
    def __init__(
        self,
        config: ControllerConfig | None = None,
        *,
        rng: Rng,
        gateway_id: str = "gw0",
    ) -> None:
        self.config = config or ControllerConfig()
        cfg = self.config
        self.rng = rng
        self.hasher: Hasher = make_hasher(cfg.hasher, **dict(cfg.hasher_params))
        self.nodes = NodeTable(stale_after_s=cfg.stale_after_s)
        # the cache location table and what our routing teaches it
        self.learning = IndexLearning(
            ClusterIndex(ttl_s=cfg.index_ttl_s, speculative_ttl_s=cfg.speculative_ttl_s),
            precise=cfg.index_mode == "precise",
        )
        self.policy = make_policy(cfg.policy, cfg.policy_params)
        # a baseline that knows only what it routed (SGLang's HTTP-mode tree, which reads
        # no KV events: in precise mode too)
        routed = cache_view(self.policy) == "routed"
        self.routed: RoutedTree | None = RoutedTree() if routed else None
        self.admission = GatewayAdmission(cfg.admission, gateway_id=gateway_id)
        # one gateway of several: a pressing tenant is confined to its home node
        self._fleet = cfg.admission.lease.expected_gateways > 1
        self.contexts = RouteContexts(
            cfg, self.hasher, hot_rate=self.policy.uses_hot_rate, fleet=self._fleet
        )
        # where a tenant pressing its quota is kept, and what the others route around
        self.floods = FloodConfinement(
            self.nodes, self.admission.pressed, window_s=cfg.tenant_confine_s, fleet=self._fleet
        )
        self.retry_policy = RetryPolicy(cfg.admission)
        self.stats = ControllerStats()
        self._requests: dict[RequestId, _Request] = {}
        self._retries_in_flight = 0
        self.ejections = NodeEjections(
            after_failures=cfg.eject_after_failures, eject_s=cfg.eject_s
        )
        self.refusals = RefusalBackoff()  # nodes that keep refusing, left out a while
        # announced bulk evictions not done yet: the node's cache discounted meanwhile
        self.evictions = EvictionNotices(self.nodes, cfg.evicting_cache_weight)
        self._aborts: dict[RequestId, NodeId] = {}  # see take_aborts
        self._deferred: list[Decision] = []  # decisions made inside a single-result call

    @property
    def index(self) -> ClusterIndex:
        """The cache location table (deferred inserts applied first)."""
        return self.learning.index

    @property
    def defer_index_inserts(self) -> bool:
        """Deferred inserts of dispatched chains (off by default): a driver that turns
        this on calls :meth:`flush_index` soon after a decision (after the request went
        out); see :mod:`kvgate.core.index_learning`."""
        return self.learning.defer

    @defer_index_inserts.setter
    def defer_index_inserts(self, on: bool) -> None:
        self.learning.defer = on

    def flush_index(self) -> None:
        """Apply the deferred inserts of dispatched chains, oldest first."""
        self.learning.flush()

    @property
    def routing_learns(self) -> set[NodeId]:
        """Precise mode: the nodes whose dispatches teach the index (see
        :meth:`set_routing_learns`)."""
        return self.learning.routing_learns

    # ------------------------------------------------------------------ membership
    def add_nodes(self, specs: Iterable[NodeSpec], now: float) -> None:
        """Add a driver's configured nodes. A gateway of a fleet (``expected_gateways``
        above 1) adds them in its own order (:func:`~kvgate.core.nodes.fleet_order`), so
        the fleet's gateways do not break ties between idle nodes alike."""
        ordered = fleet_order(self.admission.gateway_id, specs) if self._fleet else list(specs)
        for spec in ordered:
            self.add_node(spec, now)

    def add_node(self, spec: NodeSpec, now: float) -> None:
        self.nodes.add(spec)
        self.learning.add_node(spec.node_id, spec.cache_blocks)
        self._capacity_changed(now)

    def remove_node(self, node_id: NodeId, now: float) -> None:
        if self.nodes.remove(node_id) is not None:
            self.learning.remove_node(node_id)
            self.policy.on_node_removed(node_id)
            if self.routed is not None:
                self.routed.forget(node_id)
        self.ejections.forget(node_id)
        self.refusals.forget(node_id)
        self.evictions.end(node_id)  # a node added again starts afresh
        self.learning.set_routing_learns(node_id, False)  # so does its learning mode
        self._capacity_changed(now)

    def set_healthy(self, node_id: NodeId, healthy: bool, now: float) -> None:
        state = self.nodes.get(node_id)
        if state is None or not self.nodes.set_healthy(state, healthy):
            return
        if healthy:
            state.consecutive_failures = 0
            self.ejections.forget(node_id)
            # back after failed health checks: most likely restarted, its prefix cache
            # empty and its announced evictions moot; approximate mode has no event to
            # say so (precise mode gets the engine's AllBlocksCleared), so it forgets
            # the node's blocks rather than send requests there for hits it no longer
            # holds
            if self.config.index_mode == "approximate":
                self.on_cache_cleared(node_id, now)  # and its announced evictions end
        else:
            for rid, record in self._requests.items():
                node = record.node
                if node is not None and not record.first_byte and node.spec.node_id == node_id:
                    self._aborts[rid] = node_id
        self._capacity_changed(now)

    def _unlearn(self, node: NodeState, record: _Request) -> None:
        """Take back the blocks ``record``'s dispatch taught the index about ``node``,
        but for those another request in flight there also carries: that one will
        compute them (they become its to take back if it fails in turn)."""
        others = (
            (other.ctx.chain, other.learned)
            for other in self._requests.values()
            if other is not record and other.node is node and other.learned is not None
        )
        self.learning.unlearn(node.spec.node_id, record.learned, others)

    def take_aborts(self) -> list[RequestId]:
        """The attempts to abort now: their node was marked down before their first byte.

        The driver aborts those still waiting for the node's answer and reports each
        with ``on_failed(NODE_DOWN, before_first_byte=True)``; the rest (an answer
        already coming in) it leaves alone. Ids whose attempt moved on are dropped.
        """
        if not self._aborts:
            return []
        out: list[RequestId] = []
        for rid, node_id in self._aborts.items():
            record = self._requests.get(rid)
            if (record is not None and record.node is not None and not record.first_byte
                    and record.node.spec.node_id == node_id):
                out.append(rid)
        self._aborts.clear()
        return out

    def take_ejections(self) -> list[tuple[NodeId, bool]]:
        """(node, True) for each node ejected after ``eject_after_failures`` failed
        attempts in a row, (node, False) when its ``eject_s`` ended, since the last call."""
        return self.ejections.take_news()

    def set_draining(self, node_id: NodeId, draining: bool, now: float) -> None:
        state = self.nodes.get(node_id)
        if state is not None and self.nodes.set_draining(state, draining):
            self._capacity_changed(now)

    def _capacity_changed(self, now: float) -> None:
        healthy, _ = self.nodes.eligible()
        self.admission.set_cluster_capacity(
            healthy_capacity=sum(s.spec.capacity for s in healthy),
            healthy_nodes=len(healthy),
            now=now,
        )

    # ------------------------------------------------------------------ node facts
    def on_load_report(
        self, node_id: NodeId, *, waiting: int, running: int, kv_util: float | None, now: float
    ) -> None:
        self.nodes.report(node_id, waiting=waiting, running=running, kv_util=kv_util, now=now)

    def set_routing_learns(self, node_id: NodeId, on: bool) -> None:
        """Precise mode: while ``on``, dispatches to the node teach the index as in
        approximate mode. Its events cannot key what it caches on top of prefixes they
        never named (a gateway started after a long-running engine: the hot system
        prompt's continuations are orphans), and routing's guesses would expire."""
        self.learning.set_routing_learns(node_id, on)

    def on_blocks_stored(self, node_id: NodeId, chain: Sequence[int], now: float) -> None:
        """Precise mode: the engine cached these blocks (already in our key space)."""
        if self.index.has_node(node_id):
            self.index.insert(node_id, chain, now)

    def on_blocks_removed(self, node_id: NodeId, hashes: Iterable[int], now: float) -> None:
        if self.index.has_node(node_id):
            self.index.remove_blocks(node_id, hashes)

    def on_cache_cleared(self, node_id: NodeId, now: float) -> None:
        """The node's cache is gone (crash, reset): so are its pending evictions, and
        what it caches from now on counts in full again."""
        if self.index.has_node(node_id):
            self.index.clear_node(node_id)
        self.evictions.end(node_id)

    def on_eviction_warning(self, node_id: NodeId, now: float) -> None:
        """The node announced a bulk eviction: stop attracting traffic with its cache."""
        if self.evictions.warned(node_id):
            self.stats.eviction_warnings += 1

    def on_eviction_done(self, node_id: NodeId, now: float, tokens_evicted: int = 0) -> None:
        """One announced eviction is done; the cache counts in full after the last.

        In approximate mode nothing else says which blocks went, and the index kept
        claiming them: every request for an evicted prefix was sent back to the node to
        miss there (a mass eviction of 270 of 300 blocks left 159 stale entries for ~40
        s). The engine evicts least recently used first, so the index forgets as many
        of the node's least recently touched entries as ``tokens_evicted`` fill. In
        precise mode the engine's ``BlockRemoved`` events name the blocks instead."""
        if tokens_evicted > 0 and self.config.index_mode != "precise":
            blocks = tokens_evicted // self.hasher.tokens_per_block
            self.stats.eviction_blocks_forgotten += self.index.forget_oldest(node_id, blocks)
        self.evictions.done(node_id)

    # ------------------------------------------------------------------ requests
    def chain_for(self, req: RequestArrived) -> tuple[BlockChain, int]:
        """The request's block chain and its prompt token count (estimated if unknown)."""
        return prompt_chain(self.hasher, req)

    def on_arrival(self, req: RequestArrived, now: float) -> Decision:
        rid = req.request_id
        if rid in self._requests:
            raise ClientRequestError(f"duplicate request id {rid!r}", param="request_id")
        try:
            priority = Priority(req.priority)
        except ValueError as exc:
            raise ClientRequestError(
                f"priority must be 0, 1 or 2, got {req.priority}", param="priority"
            ) from exc
        chain, tokens = self.chain_for(req)
        # no max_tokens asked: the node generates what fits, so the prompt needs one more
        output = req.max_tokens if req.max_tokens_given else 1
        need = tokens + output
        estimated = req.prompt_tokens is None and not self.hasher.counts_exact
        verdict = self.admission.admit(
            AdmissionRequest(
                request_id=rid,
                tenant=req.tenant,
                priority=priority,
                bypass=req.bypass,
                prompt_tokens=need,
                output_tokens=output,
                max_seq_len=self.nodes.max_model_len(req.model),
                prompt_estimated=estimated,
            ),
            now,
        )
        if isinstance(verdict, Rejected):
            self.stats.rejects[verdict.reason.value] += 1
            return Reject(request_id=rid, rejected=verdict)
        ctx = self.contexts.build(
            chain, tokens, req, now, math.ceil(need / ESTIMATE_SLACK) if estimated else need
        )
        record = _Request(
            request_id=rid, ctx=ctx, arrived=req, excluded=set(req.excluded_nodes), arrived_at=now
        )
        self._requests[rid] = record
        if isinstance(verdict, Queued):
            return Hold(request_id=rid, deadline=verdict.deadline)
        return self._dispatch_or_reject(record, verdict.ticket, now)

    # ------------------------------------------------------------------ routing
    def candidates(
        self, ctx: RouteContext, excluded: set[NodeId] | frozenset[NodeId], now: float
    ) -> list[NodeState]:
        # Health, drain and model filters are cached by the node table (they change on
        # membership/health events, not per request); only what varies per request is
        # filtered here, and usually nothing is: no exclusion and every node fits.
        pool, min_len = self.nodes.eligible(ctx.model)
        need = ctx.context_tokens or ctx.prompt_tokens + ctx.max_tokens
        fits = pool if need <= min_len else (s for s in pool if s.spec.max_model_len >= need)
        out = list(fits)
        if excluded:
            out = [s for s in out if s.spec.node_id not in excluded]
        if left_out := self.refusals.left_out(now):
            # nodes that keep refusing, unless nobody else is left to take it
            out = [s for s in out if s.spec.node_id not in left_out] or out
        if self.admission.degraded:
            # Safe mode: the global view is gone, so only nodes that say they have room.
            out = self.nodes.with_room(out, now, self.config.safe_mode_max_queue)
        return out

    def route(
        self,
        ctx: RouteContext,
        now: float,
        excluded: set[NodeId] | frozenset[NodeId] = frozenset(),
    ) -> RouteDecision | None:
        """Filter, match and score: one routing decision, with no side effect on the index."""
        cands = self.candidates(ctx, excluded, now)
        if not cands:
            return None
        if not self.policy.uses_cache:
            matches: Mapping[NodeId, int] = {}
        elif self.routed is not None:
            matches = self.routed.match(ctx.chain)
        else:
            matches = self.index.match(ctx.chain, now)
        return self.policy.select(ctx, cands, matches, self.nodes, self.rng, now)

    def _dispatch_or_reject(self, record: _Request, ticket: Ticket, now: float) -> Decision:
        """A first attempt: sent, or rejected as overloaded when no node can take it."""
        sent = self._dispatch(record, ticket, now)
        return sent if sent is not None else self._finish_rejected(record, now)

    def _dispatch(self, record: _Request, ticket: Ticket, now: float) -> Dispatch | None:
        """Route and send ``record``; None when no node can take it (the caller says what
        then: overloaded for a first attempt, the attempt's own failure for a retry)."""
        record.ticket = ticket
        decision = None
        if record.ctx.ttft_target_s > 0.0 and now > record.arrived_at:
            # it waited (in the queue, or for a retry): what is left of the P0 SLO
            left = self.config.admission.slo.p0_ttft_p99_s - (now - record.arrived_at)
            record.ctx = replace(record.ctx, ttft_target_s=max(left, 0.0))
        tenant = record.arrived.tenant
        confined = self.floods.excluded_for(tenant, record.ctx.model, record.excluded, now)
        if confined is not None:
            decision = self.route(record.ctx, now, confined)
            self.stats.confined_dispatches += decision is not None
        if decision is None:
            decision = self._route_around_floods(record, now)
        if decision is None:
            return None
        node = self.nodes.get(decision.node_id)
        assert node is not None
        record.node = node
        record.sent_at = now
        record.attempts += 1
        record.first_byte = False
        ctx = record.ctx
        # the engine computes at least the prompt's last token (vLLM caps a hit at
        # num_tokens - 1, whole blocks): a prompt of exactly k cached blocks hits k - 1
        tpb = ctx.tokens_per_block
        record.predicted_hit_tokens = min(
            decision.matched_blocks * tpb, max(ctx.prompt_tokens - 1, 0) // tpb * tpb
        )
        q = ctx.prompt_tokens - record.predicted_hit_tokens
        self.nodes.on_sent(
            node,
            now=now,
            key=record.request_id,
            prefill_tokens=q,
            prefill_pairs=q * (record.predicted_hit_tokens + q / 2),
            context_tokens=ctx.prompt_tokens,
            tenant=record.arrived.tenant,
        )
        # approximate mode keeps what this dispatch teaches the index, to take it back if
        # the node never runs it (precise mode: guesses expire, events are the truth)
        record.learned = self.learning.learn(node.spec.node_id, ctx.chain, now)
        if self.routed is not None:
            self.routed.insert(node.spec.node_id, ctx.chain, ctx.tokens_per_block)
        self.stats.routed[decision.reason.value] += 1
        self.stats.recent.append(
            DecisionRecord(
                at=now,
                request_id=record.request_id,
                node_id=node.spec.node_id,
                reason=decision.reason.value,
                matched_blocks=decision.matched_blocks,
                best_matched_blocks=decision.best_matched_blocks,
                score=decision.score,
                attempt=record.attempts,
            )
        )
        return Dispatch(request_id=record.request_id, route=decision, attempt=record.attempts)

    def _route_around_floods(self, record: _Request, now: float) -> RouteDecision | None:
        """Route with the cache of the nodes other tenants' floods are confined to counted
        at ``evicting_cache_weight`` (the request's ``cache_discount``) while they have
        prefill queued: the request leaves them (a miss) rather than waits behind the
        flood."""
        ctx = record.ctx
        if held := self.floods.flood_nodes(record.arrived.tenant, record.ctx.model, now):
            weight = self.config.evicting_cache_weight
            ctx = replace(ctx, cache_discount={s.spec.node_id: weight for s in held})
        return self.route(ctx, now, record.excluded)

    def _finish_rejected(
        self, record: _Request, now: float, freed: deque[Admitted] | None = None
    ) -> Decision:
        """No node can take the request: give the credit back and say why. The queued
        requests the credit admits join ``freed`` (``_after_release``'s work), or when
        there is none are dispatched now, their decisions going out with the next call
        that returns a list (this one returns one decision)."""
        self._requests.pop(record.request_id, None)
        if self._aborts:
            self._aborts.pop(record.request_id, None)
        if record.ticket is not None:
            self.admission.record_ignored(now)  # admitted, never ran: no outcome (a probe back)
            admitted = self.admission.release(record.ticket, now)
            if freed is not None:
                freed.extendleft(reversed(admitted))  # next, in their order
            else:
                self._deferred.extend(self._after_release(admitted, now))
        rejected = self._no_node_rejection(record)
        self.stats.rejects[rejected.reason.value] += 1
        ticket = record.ticket
        priority = ticket.priority if ticket is not None else Priority(record.arrived.priority)
        self.admission.count_rejection(rejected.reason, priority)
        return Reject(request_id=record.request_id, rejected=rejected)

    # ------------------------------------------------------------------ outcomes
    def on_first_byte(self, request_id: RequestId, now: float) -> None:
        record = self._requests.get(request_id)
        if record is None or record.first_byte:
            return
        record.first_byte = True
        if record.node is not None:
            self.refusals.took(record.node.spec.node_id)
            self.nodes.on_prefilled(record.node, record.request_id, now=now)
            if self._is_current(record.node):
                self.policy.on_first_token(record.node.spec.node_id, now, record.request_id)
        if record.ticket is not None and record.attempts == 1:
            # the SLO is the client's TTFT: a wait in our queue for a credit counts too
            # (a P0 request queued behind credits P1 or P2 hold is what the loop must see)
            self.admission.record_ttft(record.ticket.priority, now - record.arrived_at, now)

    def on_finished(
        self,
        request_id: RequestId,
        now: float,
        *,
        cached_tokens: int | None = None,
        usage_reported: bool = False,
    ) -> list[Decision]:
        """The request completed; returns queued requests dispatched with its credit.
        ``cached_tokens``: what the engine's usage said was cached (None: not said);
        ``usage_reported``: the answer carried a usage at all."""
        record = self._requests.pop(request_id, None)
        if record is None:
            return []
        node = record.node
        if node is not None:
            node.consecutive_failures = 0
            if not record.first_byte:  # a whole answer at once (not streamed): it took it
                self.refusals.took(node.spec.node_id)
        if record.attempts:
            self.stats.count_hits(
                node,
                record.ctx.prompt_tokens,
                record.predicted_hit_tokens,
                cached_tokens,
                usage_reported,
            )
        self.stats.outcomes["completed"] += 1
        self.admission.record_outcome(True, now)
        return self._close(record, now)

    def on_cancelled(self, request_id: RequestId, now: float) -> list[Decision]:
        """The client went away (or a queued request expired in the driver)."""
        record = self._requests.pop(request_id, None)
        if record is None:
            return []
        self.stats.outcomes["cancelled"] += 1
        if record.ticket is not None:
            # says nothing of the cluster's health; a half-open breaker gets its probe back
            self.admission.record_ignored(now)
        return self._close(record, now)

    def on_failed(
        self,
        request_id: RequestId,
        failure: FailureKind,
        now: float,
        *,
        before_first_byte: bool,
    ) -> list[Decision]:
        """An attempt failed. First decision: the retry (Dispatch) or the Fail."""
        record = self._requests.get(request_id)
        if record is None:
            return []
        node = record.node
        self.stats.failures[failure.value] += 1
        if node is not None:
            if self._release_node(record, node, now):
                if self.ejections.failed(node, failure, now):
                    self.set_healthy(node.spec.node_id, False, now)
                if failure in REFUSALS and node.reported_waiting == 0:
                    # refusing while it says nothing waits there: not busy, broken (a
                    # busy node's refusal is backpressure, which the load score reads)
                    self.refusals.refused(node.spec.node_id, now)
                if record.learned is not None and before_first_byte and failure in _NEVER_RAN:
                    # the node computed nothing of the prompt: unlearn what it was taught
                    self._unlearn(node, record)
            record.learned = None
            record.excluded.add(node.spec.node_id)
            record.node = None
        if record.attempts == 2:
            self._retries_in_flight = max(0, self._retries_in_flight - 1)
        may_retry = self.retry_policy.decide(
            failure,
            before_first_byte=before_first_byte,
            attempts_so_far=record.attempts,
            # only names of nodes we know: any other value is no sign of a client retry
            client_named_excluded_node=any(n in self.nodes for n in record.arrived.excluded_nodes),
            # those on a node: a queue does not widen the budget (with 500 queued,
            # every attempt in flight could be retried, 2x load under overload)
            active_requests=len(self._requests) - self.admission.queued_total,
            retries_in_flight=self._retries_in_flight,
        )
        if may_retry and record.ticket is not None:
            retried = self._dispatch(record, record.ticket, now)
            if retried is not None:
                self._retries_in_flight += 1
                self.stats.retries[failure.value] += 1
                return [retried]
            # no other node can take it: the request fails with what failed it (a 503
            # the client may retry when no node ran it), not as a cluster overload,
            # which tells the client not to retry
        self._requests.pop(request_id, None)
        self.stats.outcomes["failed"] += 1
        if failure in _FAULTS:
            self.admission.record_outcome(False, now)
        else:
            # a client's bad request, or a node busy: one client's 400s or one class's
            # flood never open the breaker for every tenant and class
            self.admission.record_ignored(now)
        out: list[Decision] = [
            Fail(
                request_id=request_id,
                reason=failure.value,
                http_status=503 if failure in NOT_RUN_FAILURES else 502,
                node_id=node.spec.node_id if node is not None else None,
            )
        ]
        out.extend(self._close(record, now, node_done=False))
        return out

    def _release_node(self, record: _Request, node: NodeState, now: float) -> bool:
        """``record``'s attempt on ``node`` is over: the node's load forgets it and, when
        the node is still in the table, so does the policy. Whether it is."""
        self.nodes.on_done(
            node,
            sent_at=record.sent_at,
            now=now,
            key=record.request_id,
            context_tokens=record.ctx.prompt_tokens,
            tenant=record.arrived.tenant,
        )
        if not self._is_current(node):
            return False
        self.policy.on_finished(node.spec.node_id, now, record.request_id)
        return True

    def _is_current(self, node: NodeState) -> bool:
        """Whether ``node`` is still in the table: once removed, a node added back under
        its id is a new one, which the old one's requests must not account to."""
        return self.nodes.get(node.spec.node_id) is node

    def _close(self, record: _Request, now: float, *, node_done: bool = True) -> list[Decision]:
        if self._aborts:  # the request is over: nothing left to abort
            self._aborts.pop(record.request_id, None)
        node = record.node
        if node_done and node is not None:
            self._release_node(record, node, now)
        if record.attempts == 2 and node_done:
            self._retries_in_flight = max(0, self._retries_in_flight - 1)
        if record.ticket is None:
            # Still queued: the admission queue must forget it too.
            self.admission.cancel(record.request_id, now)
            return []
        after = self._after_release(self.admission.release(record.ticket, now), now)
        return after + self._take_deferred()

    def _no_node_rejection(self, record: _Request) -> Rejected:
        """Why no node could take ``record``. When the request itself excluded every node
        serving its model (X-Kvgate-Exclude-Node), it says so. In safe mode (the
        coordinator out of reach) nodes without reported room are left out: degraded,
        retry soon (503, retryable), as room comes back with the next load reports.
        Otherwise no healthy node can: overloaded (503, do not retry)."""
        named = record.arrived.excluded_nodes
        if named:
            pool, _ = self.nodes.eligible(record.ctx.model)
            if pool and all(s.spec.node_id in named for s in pool):
                return overloaded_rejection(
                    "every healthy node serving this model is excluded by the request "
                    "(X-Kvgate-Exclude-Node)",
                    request_id=record.request_id,
                )
        if self.admission.degraded:
            return make_rejection(
                RejectReason.DEGRADED,
                "degraded: the coordinator is out of reach and no node reports room for "
                "this request",
                request_id=record.request_id,
                retry_after_s=1.0,
            )
        return overloaded_rejection(
            "no healthy node can take this request", request_id=record.request_id
        )

    def _after_release(self, admitted: list[Admitted], now: float) -> list[Decision]:
        """Dispatch the requests a released credit admitted. One that no node can take
        gives its credit back in turn, which may admit the next queued request: a loop
        over a work list, not a recursion (a queue of 330 requests no node could take,
        in safe mode under overload, overflowed the stack)."""
        out: list[Decision] = []
        work = deque(admitted)
        while work:
            a = work.popleft()
            record = self._requests.get(RequestId(a.ticket.request_id))
            if record is None:  # cancelled while queued; give the credit straight back
                work.extendleft(reversed(self.admission.release(a.ticket, now)))
                continue
            sent = self._dispatch(record, a.ticket, now)
            out.append(sent if sent is not None else self._finish_rejected(record, now, work))
        return out

    def _take_deferred(self) -> list[Decision]:
        out, self._deferred = self._deferred, []
        return out

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[Decision]:
        """Periodic work: queue deadlines, lease transitions, ejection expiry."""
        for node_id in self.ejections.due(now):
            self.set_healthy(node_id, True, now)
        out: list[Decision] = self._take_deferred()
        admitted: list[Admitted] = []
        for item in self.admission.poll(now):
            if isinstance(item, Admitted):
                admitted.append(item)
            else:
                record = self._requests.pop(RequestId(item.request_id), None)
                if record is not None:
                    self.stats.rejects[item.reason.value] += 1
                    if item.reason in _GAVE_UP_WAITING:
                        # the SLO loop sees the longest waits too: a P0 request that
                        # waited here until it was turned away counts its wait as TTFT
                        self.admission.record_ttft(
                            Priority(record.arrived.priority), now - record.arrived_at, now
                        )
                    out.append(Reject(request_id=record.request_id, rejected=item))
        out.extend(self._after_release(admitted, now))
        out.extend(self._reclaim_p2(now))
        return out

    def _reclaim_p2(self, now: float) -> list[Decision]:
        """End the P2 requests whose credits P0 / P1 requests wait for (see
        ``AdmissionConfig.reclaim_p2``): those that have sent the client nothing first
        (no output lost), then the youngest (the least decode thrown away). Each is a
        ``Preempt``; the credits it frees admit the waiting requests at once."""
        n = self.admission.p2_to_reclaim()
        if n <= 0:
            return []
        p2 = (
            r
            for r in self._requests.values()
            if (t := r.ticket) is not None
            and t.priority == Priority.P2
            and t.lane == "class"  # a bypass credit would free nothing a class waits for
            and r.node is not None
        )
        victims = heapq.nsmallest(n, p2, key=lambda r: (r.first_byte, -r.sent_at))
        cfg = self.config.admission
        out: list[Decision] = []
        for record in victims:
            node = record.node
            assert node is not None
            del self._requests[record.request_id]
            rejected = make_rejection(
                RejectReason.PREEMPTED,
                "This P2 request was ended to give its capacity back to higher-priority "
                "requests; retry later.",
                request_id=record.request_id,
                retry_after_s=cfg.reclaim_retry_after_s,
            )
            self.stats.rejects[RejectReason.PREEMPTED.value] += 1
            self.admission.count_rejection(RejectReason.PREEMPTED, Priority.P2)
            out.append(
                Preempt(request_id=record.request_id, node_id=node.spec.node_id, rejected=rejected)
            )
            out.extend(self._close(record, now))
        return out

    # ------------------------------------------------------------------ leases
    def refresh_due(self, now: float) -> bool:
        return self.admission.refresh_due(now)

    def make_refresh(self, now: float) -> RefreshRequest:
        return self.admission.make_refresh(now)

    def on_lease(self, grant: LeaseGrant, now: float) -> list[Decision]:
        out = self._after_release(self.admission.apply_grant(grant, now), now)
        return out + self._reclaim_p2(now)

    def on_refresh_failed(self, now: float) -> list[Decision]:
        self.admission.refresh_failed(now)
        return self.tick(now)

    def refresh_with(self, coordinator: Coordinator, now: float) -> list[Decision]:
        """Synchronous refresh against an in-process coordinator (simulator, tests, CLI)."""
        try:
            grant = coordinator.refresh(self.make_refresh(now), now)
        except CoordinatorUnavailable:
            return self.on_refresh_failed(now)
        return self.on_lease(grant, now)

    # ------------------------------------------------------------------ views
    def in_flight(self) -> int:
        return sum(1 for r in self._requests.values() if r.node is not None)

    def num_requests(self) -> int:
        return len(self._requests)


