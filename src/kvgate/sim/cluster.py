"""N simulated nodes and G gateways on one virtual clock, driving the real core.

Theory of operation
-------------------
Each gateway runs its own :class:`~kvgate.core.controller.Controller` with its
own, deliberately imperfect view of the cluster:

* load reports: every node's metrics snapshot reaches every gateway every
  ``report_interval_s``, ``report_delay_s`` late;
* KV events (precise mode) and eviction announcements arrive ``event_delay_s`` late;
* health: a crashed node is noticed by the next health check (``health_interval_s``),
  or at once when a dispatch to it fails;
* its own in-flight counts are exact (they are its own).

All gateways share one in-process coordinator (refreshing every
``refresh_interval_s`` unless a scenario cuts them off). Nodes are
:class:`~kvgate.engine.SimEngine`s stepped by the loop: a step starting at ``t``
delivers its results at ``t + duration`` and the next step starts then. Steps in
which every running request just decodes a token are most of a run and change only
time, so a node runs them at once (``SimEngine.run_decodes``, up to the next finish
or block boundary) and, when a request reaches it meanwhile, takes back the steps
that had not started (``_settle``): the same results as one event per step, bit for
bit (tests/sim/test_decode_runs.py), three to four times faster.

Requests arrive at their planned ``arrival_s`` (gateways in turn), except a
closed-loop request (``after`` set), which arrives ``think_s`` after the request it
waits for has ended; latencies count from the real arrival (``arrived_s``).

Every request ends with exactly one terminal outcome (completed, rejected with
a reason, failed with a reason); :meth:`SimCluster.check_outcomes` verifies it.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import get_args

from kvgate.core.admission import FailureKind, InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Decision, Dispatch, Fail, Hold, Preempt, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId, TenantId
from kvgate.core.nodes import NodeSpec
from kvgate.core.rng import Rng
from kvgate.engine import (
    AdmissionStatus,
    EngineConfig,
    EngineRequest,
    EvictionAnnounced,
    EvictionDone,
    FinishedRequest,
    RejectKind,
    SchedulingPolicy,
    SimEngine,
    StepOutput,
    get_profile,
)
from kvgate.engine.eviction import EvictionConfig
from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.engine.node_admission import NodeAdmissionConfig
from kvgate.sim.funnel import count_blocks
from kvgate.sim.loop import EventLoop, Timer
from kvgate.sim.workload import SimRequest, Workload, leading_run

# Virtual seconds with no arrival, no end and no engine step while requests are open:
# one was lost (a simulator bug), and the run stops instead of ticking forever.
STALL_S = 3600.0
# With nothing open and nothing due for more than IDLE_SKIP_S of virtual time, the
# housekeeping (ticks, load reports, health checks) jumps ahead by whole periods to
# IDLE_KEEP_S before the next arrival or hook: each idle period cost wall time, and a
# trace with one far-off timestamp ran for hours. The last IDLE_KEEP_S run as usual, so
# leases, reports and health are fresh when the next request comes.
IDLE_SKIP_S = 600.0
IDLE_KEEP_S = 60.0
# ended requests between two progress reports (SimCluster.on_progress)
PROGRESS_EVERY = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    nodes: int = 8
    gateways: int = 1
    profile: str = "a100-8b"
    cache_blocks: int = 1000  # per node, in blocks of the workload's block size
    node_capacity: int = 64  # concurrent requests a node is counted for in the budget
    scheduling_policy: SchedulingPolicy = "priority"
    report_interval_s: float = 0.5
    report_delay_s: float = 0.05
    event_delay_s: float = 0.1
    network_delay_s: float = 0.001
    tick_interval_s: float = 0.05
    health_interval_s: float = 1.0
    node_admission: NodeAdmissionConfig = field(default_factory=NodeAdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # run a node's decode-only steps at once (engine/decode_run.py): the same results
    # bit for bit, several times faster; off, every step is an event (the reference)
    decode_runs: bool = True

    def __post_init__(self) -> None:
        # the simulator's own knobs (the engine's and the controller's configs check
        # theirs): a zero period loops forever at one virtual instant, no gateway
        # divides by zero, a NaN delay breaks the event heap
        for name in ("nodes", "gateways", "cache_blocks", "node_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("report_interval_s", "tick_interval_s", "health_interval_s"):
            if not (math.isfinite(v := getattr(self, name)) and v > 0):
                raise ValueError(f"ClusterConfig.{name} must be a finite number > 0, got {v}")
        for name in ("report_delay_s", "event_delay_s", "network_delay_s"):
            if not (math.isfinite(v := getattr(self, name)) and v >= 0):
                raise ValueError(f"ClusterConfig.{name} must be a finite number >= 0, got {v}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(
                f"ClusterConfig.scheduling_policy must be one of "
                f"{', '.join(get_args(SchedulingPolicy))}, got {self.scheduling_policy!r}"
            )


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one workload request (the report's raw material)."""

    req: SimRequest
    gateway: int
    arrived_s: float = 0.0  # when it reached its gateway (req.arrival_s unless closed loop)
    status: str = ""  # "completed" | "rejected" | "failed"; "" while open
    reason: str = ""
    node: str = ""
    attempts: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    ended_s: float | None = None
    # when the node first scheduled the prompt of the attempt that completed (its queue
    # time ends there, its prefill begins: vLLM's scheduled_ts); None until it completes
    prefill_started_s: float | None = None
    # the routing decision of the last attempt sent: why that node, and the prefix (in
    # chain blocks) the index matched there and at best anywhere (the request log's)
    route_reason: str = ""
    matched_blocks: int = 0
    best_matched_blocks: int = 0


@dataclass(slots=True)
class _Attempt:
    outcome: RequestOutcome
    gateway: int
    node: int
    attempt: int
    own_blocks: int = 0  # longest prefix the target node itself really held at submit
    best_other_blocks: int = 0  # longest prefix any other live node really held at submit
    stored_blocks: int = 0  # longest prefix some node had cached at some time before submit
    first_byte: bool = False
    done: bool = False


def _engine_id(request_id: str, attempt: int) -> str:
    """The engine's id for one attempt of a request (a retry is a new engine request)."""
    return f"{request_id}#{attempt}"


class SimNode:
    """One simulated engine plus the loop plumbing that steps it."""

    def __init__(self, index: int, engine: SimEngine) -> None:
        self.index = index
        self.node_id = NodeId(f"node-{index}")
        self.engine = engine
        self.stepping = False
        self.step_timer: Timer | None = None  # the end of the step (or decode run) running
        self.timer_at: float | None = None
        self.crashed = False
        # crashes so far: a step scheduled before a crash ends with nothing to report,
        # even when the node has recovered by then (see _step_done)
        self.epoch = 0
        self.prefill_tokens = 0  # processed (uncached) prefill tokens, for load balance
        self.decode_tokens = 0


def _check_engine_rules(workload: Workload) -> None:
    """Refuse, before the run, a request the engines would refuse in the middle of it:
    an empty prompt, or fewer block ids than the prompt's full blocks (a Mooncake trace
    read with ``strict=False`` may hold such lines)."""
    for r in workload.requests:
        full = r.prompt_tokens // workload.block_tokens
        if r.prompt_tokens < 1 or len(r.block_ids) < full:
            raise ValueError(
                f"workload {workload.name!r}: request {r.request_id!r} has "
                f"{r.prompt_tokens} prompt tokens and {len(r.block_ids)} block ids; the "
                f"engines need a prompt of at least 1 token and one id per full "
                f"{workload.block_tokens}-token block ({full})"
            )


class SimCluster:
    def __init__(self, config: ClusterConfig, workload: Workload, *, rng: Rng) -> None:
        self.config = config
        self.workload = workload
        self.loop = EventLoop()
        self.rng = rng
        profile = get_profile(config.profile)
        block = workload.block_tokens
        _check_engine_rules(workload)
        self.block_tokens = block
        self.nodes = [
            SimNode(
                i,
                SimEngine(
                    EngineConfig(
                        num_blocks=config.cache_blocks,
                        block_size=block,
                        scheduling_policy=config.scheduling_policy,
                        admission=config.node_admission,
                        eviction=config.eviction,
                    ),
                    profile,
                ),
            )
            for i in range(config.nodes)
        ]
        self.max_model_len = config.cache_blocks * block
        self.coordinator = InProcessCoordinator(config.controller.admission)
        self.coordinator_up = True
        ctl_cfg = config.controller
        self.gateways = [
            Controller(ctl_cfg, rng=rng, gateway_id=f"gw{g}") for g in range(config.gateways)
        ]
        specs = [
            NodeSpec(
                node_id=n.node_id,
                max_model_len=self.max_model_len,
                capacity=config.node_capacity,
                cache_blocks=config.cache_blocks,
            )
            for n in self.nodes
        ]
        for ctl in self.gateways:
            ctl.add_nodes(specs, 0.0)
        self.outcomes: dict[str, RequestOutcome] = {}
        self._attempts: dict[str, _Attempt] = {}  # engine request id -> attempt
        self._open = 0
        self._arrivals_left = len(workload.requests)
        self._progress_s = 0.0  # the last arrival, end or engine step: see busy()
        # told (ended, total) every PROGRESS_EVERY ended requests and at the last: a
        # progress bar's feed (the simulation itself reads no clock)
        self.on_progress: Callable[[int, int], None] | None = None
        self.hooks: list[tuple[float, Callable[[SimCluster], None]]] = []
        # told (gateway index, attempt, requests in flight over all gateways) at every
        # dispatch, once it is counted in flight: a probe of what admission let in, exact
        # where a sampling hook could miss a peak
        self.on_dispatch: list[Callable[[int, int, int], None]] = []
        self.max_inflight_total = 0
        # cache-loss funnel (blocks): why each prompt block was or was not a hit
        self.funnel: Counter[str] = Counter()
        self._seen_blocks: set[int] = set()
        # every block hash any node ever cached: a miss on a block no node ever had (seen
        # only in a refused or still uncomputed request) is not an eviction
        self._stored_blocks: set[int] = set()
        self._ideal: dict[str, int] = {}
        # closed loop: the requests waiting for each request's end, with their gateways
        self._followers: dict[str, list[tuple[SimRequest, int]]] = {}
        # when the arrivals scheduled and not yet come are due (a heap), and the hooks
        self._due_arrivals: list[float] = []
        self._hook_times: list[float] = []

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        loop = self.loop
        # Housekeeping first, so that at t=0 the gateways already hold a lease and the
        # first load reports are on their way before the first arrival.
        loop.at(0.0, self._report)
        for g in range(len(self.gateways)):
            loop.at(0.0, partial(self._tick, g))
        loop.at(0.0, self._health)
        for at, fn in self.hooks:
            loop.at(at, partial(fn, self))
        self._hook_times = sorted(at for at, _ in self.hooks)
        waits = self.workload.waits()
        for i, req in enumerate(self.workload.requests):
            g = i % len(self.gateways)
            if (after := waits.get(req.request_id)) is not None:  # closed loop: on its answer
                self._followers.setdefault(after, []).append((req, g))
            else:
                loop.at(req.arrival_s, partial(self._arrive, req, g))
                self._due_arrivals.append(req.arrival_s)
        heapq.heapify(self._due_arrivals)
        loop.run()

    def busy(self) -> bool:
        """Requests still to come or open, and not stalled: with nothing but
        housekeeping left for STALL_S of virtual time a request was lost, so the
        housekeeping stops and :meth:`check_outcomes` names it instead of the run
        going on forever."""
        if self._open == 0:  # idle: every request still to come has its event queued
            return self._arrivals_left > 0
        return self.loop.now - self._progress_s < STALL_S

    def _next_run_in(self, period: float) -> float:
        """The delay to a housekeeping callback's next run: one ``period``, or whole
        periods up to IDLE_KEEP_S before the next arrival or hook when nothing is open,
        no engine has work and that is more than IDLE_SKIP_S away."""
        if self._open or any(n.stepping or n.timer_at is not None for n in self.nodes):
            return period
        now = self.loop.now
        due = self._due_arrivals[0] if self._due_arrivals else math.inf
        hooks = self._hook_times
        if (h := bisect_left(hooks, now)) < len(hooks):
            due = min(due, hooks[h])
        if due - now <= IDLE_SKIP_S or math.isinf(due):
            return period
        return max(1, math.floor((due - IDLE_KEEP_S - now) / period)) * period

    # ------------------------------------------------------------------ gateways
    def _arrive(self, req: SimRequest, g: int) -> None:
        self._arrivals_left -= 1
        heapq.heappop(self._due_arrivals)  # the soonest due: this one (or a tie)
        out = RequestOutcome(req=req, gateway=g, arrived_s=self.loop.now)
        self.outcomes[req.request_id] = out
        seen = self._seen_blocks
        self._ideal[req.request_id] = leading_run(req.block_ids, seen)
        seen.update(req.block_ids)
        self._open += 1
        self._progress_s = self.loop.now
        ctl = self.gateways[g]
        event = RequestArrived(
            request_id=RequestId(req.request_id),
            tenant=TenantId(req.tenant),
            priority=req.priority,
            model=req.model,
            block_ids=req.block_ids[: req.prompt_tokens // self.block_tokens],
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.output_tokens,
        )
        self._apply(g, [ctl.on_arrival(event, self.loop.now)])

    def _apply(self, g: int, decisions: Sequence[Decision]) -> None:
        now = self.loop.now
        for d in decisions:
            if isinstance(d, Dispatch):
                self._send(g, d)
            elif isinstance(d, Reject):
                self._end(d.request_id, "rejected", d.rejected.reason.value, now)
            elif isinstance(d, Fail):
                self._end(d.request_id, "failed", d.reason, now)
            elif isinstance(d, Preempt):
                self._preempt(d, now)
            elif isinstance(d, Hold):
                pass  # the controller dispatches or rejects it later

    def _preempt(self, d: Preempt, now: float) -> None:
        """The gateway ended a running P2 request: abort it at its node (the engine frees
        its blocks and batch slot) and end it rejected, whatever it had streamed."""
        eid = _engine_id(d.request_id, self.outcomes[d.request_id].attempts)
        att = self._attempts.pop(eid, None)
        if att is not None and not att.done:
            att.done = True
            node = self.nodes[att.node]
            if not node.crashed:
                self._settle(node)
                node.engine.abort(eid, now)
                self._kick(node)
        self._end(d.request_id, "rejected", d.rejected.reason.value, now)

    def _end(self, request_id: str, status: str, reason: str, now: float) -> None:
        out = self.outcomes[request_id]
        if out.status:
            raise AssertionError(f"request {request_id} ended twice ({out.status}, {status})")
        out.status, out.reason, out.ended_s = status, reason, now
        self._open -= 1
        self._progress_s = now
        if self.on_progress is not None:
            total = len(self.workload.requests)
            ended = total - self._arrivals_left - self._open  # arrived and not open
            if ended % PROGRESS_EVERY == 0 or ended == total:
                self.on_progress(ended, total)
        for req, g in self._followers.pop(request_id, ()):  # the session's next step
            self.loop.after(req.think_s, partial(self._arrive, req, g))
            heapq.heappush(self._due_arrivals, now + req.think_s)

    def _send(self, g: int, d: Dispatch) -> None:
        out = self.outcomes[d.request_id]
        out.attempts = d.attempt
        out.route_reason = d.route.reason.value
        out.node = str(d.node_id)  # the last attempt's node, whatever becomes of it
        out.matched_blocks = d.route.matched_blocks
        out.best_matched_blocks = d.route.best_matched_blocks
        node_index = int(d.node_id.rsplit("-", 1)[1])
        eid = _engine_id(d.request_id, d.attempt)
        att = _Attempt(outcome=out, gateway=g, node=node_index, attempt=d.attempt)
        self._attempts[eid] = att
        self.loop.after(self.config.network_delay_s, lambda: self._submit(eid))
        inflight = sum(c.in_flight() for c in self.gateways)
        self.max_inflight_total = max(self.max_inflight_total, inflight)
        for observe in self.on_dispatch:
            observe(g, d.attempt, inflight)

    def _tick(self, g: int) -> None:
        """Gateway housekeeping: queue deadlines, lease refresh when due."""
        ctl = self.gateways[g]
        now = self.loop.now
        if ctl.refresh_due(now):
            if self.coordinator_up:
                self._apply(g, ctl.refresh_with(self.coordinator, now))
            else:
                self._apply(g, ctl.on_refresh_failed(now))
        self._apply(g, ctl.tick(now))
        if self.busy():
            self.loop.after(self._next_run_in(self.config.tick_interval_s), lambda: self._tick(g))

    def _report(self) -> None:
        delay = self.config.report_delay_s
        for n in self.nodes:
            if n.crashed:
                continue
            m = n.engine.metrics()
            snap = (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage_perc)
            self.loop.after(delay, partial(self._deliver_report, n, snap))
        if self.busy():
            self.loop.after(self._next_run_in(self.config.report_interval_s), self._report)

    def _deliver_report(self, n: SimNode, snap: tuple[int, int, float]) -> None:
        # the report reaches every gateway report_delay_s after it was taken
        now = self.loop.now
        for ctl in self.gateways:
            ctl.on_load_report(
                n.node_id, waiting=snap[0], running=snap[1], kv_util=snap[2], now=now
            )

    def _health(self) -> None:
        now = self.loop.now
        for g, ctl in enumerate(self.gateways):
            for n in self.nodes:
                state = ctl.nodes.get(n.node_id)
                if state is not None and state.healthy == n.crashed:
                    ctl.set_healthy(n.node_id, not n.crashed, now)
            self._apply(g, ctl.tick(now))
        if self.busy():
            self.loop.after(self._next_run_in(self.config.health_interval_s), self._health)

    # ------------------------------------------------------------------ nodes
    def _submit(self, eid: str) -> None:
        att = self._attempts.get(eid)
        if att is None or att.done:  # preempted on its way to the node
            return
        node = self.nodes[att.node]
        now = self.loop.now
        if node.crashed:
            self._attempt_failed(eid, FailureKind.CONNECT_ERROR)
            return
        req = att.outcome.req
        full = req.prompt_tokens // self.block_tokens
        hashes = req.block_ids[:full]
        # the target's own prefix apart: what it held and lost while the request queued
        # there was evicted, not routed away
        att.own_blocks = len(node.engine.pool.find_prefix(hashes, full))
        att.best_other_blocks = max(
            (
                len(n.engine.pool.find_prefix(hashes, full))
                for n in self.nodes
                if not n.crashed and n is not node
            ),
            default=0,
        )
        att.stored_blocks = leading_run(hashes, self._stored_blocks)
        self._settle(node)
        verdict = node.engine.submit(
            EngineRequest(
                request_id=eid,
                prompt_tokens=req.prompt_tokens,
                block_hashes=req.block_ids[:full],
                max_tokens=max(1, req.output_tokens),
                priority=req.priority,
                arrival=att.outcome.arrived_s,
            ),
            now,
        )
        if verdict.status is AdmissionStatus.REJECTED:
            self._attempt_failed(eid, _failure_of(verdict.reject_kind))
            return
        self._kick(node)

    def _kick(self, node: SimNode) -> None:
        if not node.stepping and not node.crashed:
            node.stepping = True
            self.loop.after(0.0, lambda: self._step(node))

    def _step(self, node: SimNode) -> None:
        node.stepping = False
        if node.crashed:
            return
        now = self.loop.now
        # decode-only steps run at once until something reaches the node (_settle)
        out = node.engine.run_decodes(now) if self.config.decode_runs else None
        if out is None:
            out = node.engine.step(now)
        self._drain_events(node)
        if out is None:
            nxt = node.engine.next_timer_at()
            if nxt is not None and (node.timer_at is None or node.timer_at <= now):
                node.timer_at = nxt
                self.loop.at(nxt, lambda: self._timer(node))
            return
        node.stepping = True
        node.step_timer = self.loop.at(out.end, partial(self._step_done, node, out, node.epoch))

    def _settle(self, node: SimNode) -> None:
        """Before anything reaches a node's engine: cut its decode run at now (the
        steps not started yet are taken back), and end the step where it now ends."""
        out = node.engine.settle(self.loop.now)
        if out is not None:
            assert node.step_timer is not None  # a run in progress has its end scheduled
            node.step_timer.cancel()
            node.step_timer = self.loop.at(
                out.end, partial(self._step_done, node, out, node.epoch)
            )

    def _timer(self, node: SimNode) -> None:
        node.timer_at = None
        self._kick(node)

    def _step_done(self, node: SimNode, out: StepOutput, epoch: int) -> None:
        node.stepping = False
        self._progress_s = self.loop.now
        if epoch != node.epoch:
            # A crash came mid-step (the node may be back by now: the step's work is lost
            # all the same): what this step retired (finished or refused) had already
            # left the engine, so the crash did not fail it; its answer never leaves the
            # node either, so it fails here.
            retired = [f.request_id for f in out.finished] + [r.request_id for r in out.rejected]
            for eid in retired:
                self.loop.after(
                    self.config.network_delay_s,
                    partial(self._attempt_failed, eid, FailureKind.UPSTREAM_ERROR),
                )
            if not node.crashed:  # recovered meanwhile: its kick waited for this step
                self._step(node)
            return
        node.prefill_tokens += out.num_prefill_tokens
        node.decode_tokens += out.num_decode_seqs
        delay = self.config.network_delay_s
        for eid in out.first_token_ids:
            self.loop.after(delay, partial(self._first_byte, eid))
        for fin in out.finished:
            self.loop.after(delay, partial(self._finished, fin))
        for rej in out.rejected:
            kind = _failure_of(rej.reject_kind)
            self.loop.after(delay, partial(self._attempt_failed, rej.request_id, kind))
        self._step(node)

    def _drain_events(self, node: SimNode) -> None:
        events = node.engine.take_events()
        if not events:
            return
        precise = self.config.controller.index_mode == "precise"
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored_blocks.update(ev.block_hashes)
            if isinstance(ev, EvictionAnnounced | EvictionDone) or precise:
                self.loop.after(self.config.event_delay_s, partial(self._deliver_event, node, ev))

    def _deliver_event(self, node: SimNode, ev: object) -> None:
        now = self.loop.now
        for ctl in self.gateways:
            if isinstance(ev, EvictionAnnounced):
                ctl.on_eviction_warning(node.node_id, now)
            elif isinstance(ev, EvictionDone):
                ctl.on_eviction_done(node.node_id, now, ev.num_blocks_evicted * self.block_tokens)
            elif isinstance(ev, BlockStored):
                ctl.on_blocks_stored(node.node_id, ev.block_hashes, now)
            elif isinstance(ev, BlockRemoved):
                ctl.on_blocks_removed(node.node_id, ev.block_hashes, now)
            elif isinstance(ev, AllBlocksCleared):
                ctl.on_cache_cleared(node.node_id, now)

    # ------------------------------------------------------------------ attempt results
    def _first_byte(self, eid: str) -> None:
        att = self._attempts.get(eid)
        if att is None or att.done:
            return
        att.first_byte = True
        if att.outcome.first_token_s is None:
            att.outcome.first_token_s = self.loop.now
        self.gateways[att.gateway].on_first_byte(
            RequestId(att.outcome.req.request_id), self.loop.now
        )

    def _finished(self, fin: FinishedRequest) -> None:
        att = self._attempts.pop(fin.request_id, None)
        if att is None or att.done:
            return
        att.done = True
        out = att.outcome
        now = self.loop.now
        cached = fin.cached_tokens
        out.cached_tokens, out.output_tokens, out.finished_s = cached, fin.output_tokens, now
        if fin.scheduled_at >= 0.0:  # the engine's clock is the simulation's
            out.prefill_started_s = fin.scheduled_at
        self._count_funnel(att, cached // self.block_tokens)
        rid = RequestId(out.req.request_id)
        decisions = self.gateways[att.gateway].on_finished(rid, now, cached_tokens=cached)
        self._end(rid, "completed", "", now)
        self._apply(att.gateway, decisions)

    def _attempt_failed(self, eid: str, kind: FailureKind) -> None:
        att = self._attempts.pop(eid, None)
        if att is None or att.done:
            return
        att.done = True
        out = att.outcome
        if not att.first_byte:
            out.first_token_s = None
        rid = RequestId(out.req.request_id)
        decisions = self.gateways[att.gateway].on_failed(
            rid, kind, self.loop.now, before_first_byte=not att.first_byte
        )
        self._apply(att.gateway, decisions)

    def _count_funnel(self, att: _Attempt, got: int) -> None:
        """File each prompt block of a completed attempt that got ``got`` blocks from
        the cache into the cache-loss funnel (``kvgate.sim.funnel``). The completed
        attempt is the request's last one sent: its route is the outcome's."""
        req = att.outcome.req
        count_blocks(
            self.funnel,
            total=len(req.block_ids),
            seen=self._ideal.get(req.request_id, 0),
            own=att.own_blocks,
            best_other=att.best_other_blocks,
            stored=att.stored_blocks,
            got=got,
            route_reason=att.outcome.route_reason,
            usable=(req.prompt_tokens - 1) // self.block_tokens,
        )

    # ------------------------------------------------------------------ faults (scenarios)
    # Inject faults through these wrappers, not through a node's engine: each settles
    # the node's decode run first (the steps planned and not started by now are taken
    # back), without which a fault reaching a node mid-run would wait for the run's
    # end (with ClusterConfig.decode_runs, the default) and the results would differ
    # from one step at a time.
    def crash_node(self, index: int) -> None:
        node = self.nodes[index]
        self._settle(node)
        if (run := node.engine.decode_run) is not None:
            # one by one, the steps before the last would have ended (and counted)
            node.decode_tokens += len(run.seqs) * (run.steps - 1)
        node.crashed = True
        node.epoch += 1
        failed = node.engine.crash(self.loop.now)
        self._drain_events(node)
        for eid in failed:
            self.loop.after(
                self.config.network_delay_s,
                partial(self._attempt_failed, eid, FailureKind.UPSTREAM_ERROR),
            )

    def bulk_evict(self, index: int, fraction: float, reason: str = "flush") -> int:
        """Have a node evict ``fraction`` of its pool now, at most every cached block not
        in use (``SimEngine.bulk_evict``); returns the blocks chosen."""
        return self._evict_now(index, lambda e, now: e.bulk_evict(fraction, now, reason))

    def flush_node(self, index: int, share: float, reason: str = "flush") -> int:
        """Have a node flush ``share`` of what it caches now (``SimEngine.flush``: the
        cached blocks not in use, least recently used first, announced whatever the bulk
        threshold unless announcements are off); returns the blocks chosen."""
        return self._evict_now(index, lambda e, now: e.flush(share, now, reason))

    def _evict_now(self, index: int, evict: Callable[[SimEngine, float], int]) -> int:
        """``evict`` on a node's settled engine; the announcement (or the blocks removed
        at once) goes out now and the node is kicked, so an idle node runs its batches
        on time instead of at its next request."""
        node = self.nodes[index]
        self._settle(node)
        chosen = evict(node.engine, self.loop.now)
        self._drain_events(node)
        self._kick(node)
        return chosen

    def slow_node(self, index: int, factor: float) -> None:
        """Have a node's steps take ``factor`` times their modelled time from now on
        (``SimEngine.slow``; 1.0 restores). The steps of a decode run that had not
        started were planned at the old speed: they are taken back first, so the fault
        applies from the next step on, as it does one step at a time."""
        if not factor > 0:  # before the run is touched
            raise ValueError(f"slow factor must be > 0, got {factor}")
        node = self.nodes[index]
        self._settle(node)
        node.engine.slow(factor)

    def reject_all_node(self, index: int, on: bool = True) -> None:
        """Have a node refuse (``on``) or stop refusing every submission with "retry
        elsewhere" (``SimEngine.reject_all``), its decode run settled first like every
        other fault's."""
        node = self.nodes[index]
        self._settle(node)
        node.engine.reject_all(on)

    def recover_node(self, index: int) -> None:
        """Heal every fault of a node (crash, slow, reject-all): a slowed node's decode
        run was planned at the slow speed, so it is settled first."""
        node = self.nodes[index]
        self._settle(node)
        node.engine.recover(self.loop.now)
        node.crashed = False
        self._kick(node)

    def check_outcomes(self) -> None:
        """Every request ended exactly once; nothing is lost."""
        open_ = [r for r, o in self.outcomes.items() if not o.status]
        missing = len(self.workload.requests) - len(self.outcomes)
        if open_ or missing:
            raise AssertionError(f"{len(open_)} requests never ended, {missing} never arrived")


def _failure_of(kind: RejectKind | None) -> FailureKind:
    if kind is RejectKind.POOL_OVERLOADED:
        return FailureKind.POOL_OVERLOADED
    if kind is RejectKind.BAD_REQUEST:
        return FailureKind.CLIENT_ERROR
    return FailureKind.RETRY_ELSEWHERE
