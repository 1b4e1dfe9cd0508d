"""SimEngine: a pure, deterministic simulated inference engine (vLLM v1 style).

Theory of operation
-------------------
The engine is driven from outside: `submit(req, now)` runs second-stage
admission, `step(now)` plans, "executes" (the cost model gives the duration)
and updates one iteration, `take_events()` drains KV cache events. Nothing
reads a clock or draws a random number; the same calls give the same results.

    driver:  out = engine.step(now)        # None: nothing to do
             ... deliver out.* at out.end, then engine.step(out.end)
             idle? step again at a submit or at engine.next_timer_at()

`step(now)`:
1. runs due bulk-eviction batches, expires admission-queue entries past their
   TTL (reported in `rejected`, as entries displaced by a submit since the last
   step are), moves admissible queued requests to the scheduler
   (node_admission.py);
2. `Scheduler.schedule()` plans decodes + prefill chunks (scheduler.py), then
   `commit()` caches the blocks the plan fills (`BlockStored` now, at
   schedule time, as vLLM does);
3. duration = step_time(profile, chunks, decodes) * slow factor;
4. every sequence whose known tokens are all in KV samples one token; a
   sequence with `max_tokens` tokens finishes and frees its blocks in reverse
   order (they stay cached in the LRU).

The engine mutates its state at `now` and reports results for `end`; a call
made between `now` and `end` (submit, abort) sees the post-step state, which
is how vLLM applies aborts between steps too.

Invariant: every submitted request ends in exactly one terminal outcome (see
api.py), and `self._seqs` holds exactly the requests that have none yet.
"""

from __future__ import annotations

import math
from itertools import chain, repeat

from kvgate.engine.api import (
    EngineConfig,
    EngineMetrics,
    EngineRequest,
    FinishedRequest,
    RejectedRequest,
    StepOutput,
)
from kvgate.engine.block_pool import BlockPool
from kvgate.engine.decode_run import DecodeRun, plan_run
from kvgate.engine.eviction import BulkEvictor
from kvgate.engine.faults import FaultState
from kvgate.engine.kv_events import KvEvent
from kvgate.engine.node_admission import (
    AdmissionQueue,
    NodeAdmission,
    NodeLoad,
    RejectKind,
    can_enter_scheduler,
    decide_admission,
)
from kvgate.engine.profiles import DEFAULT_PROFILE, PROFILES, EngineProfile, step_time_of_sums
from kvgate.engine.scheduler import Plan, Scheduler
from kvgate.engine.sequence import ReqStatus, SeqState

__all__ = ["SimEngine"]


class SimEngine:
    """One simulated node: admission, paged KV with prefix cache, batching, faults."""

    def __init__(
        self, config: EngineConfig | None = None, profile: EngineProfile | None = None
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self.profile = profile if profile is not None else PROFILES[DEFAULT_PROFILE]
        self.pool = BlockPool(self.config.num_blocks, self.config.block_size)
        self._sched = Scheduler(self.pool, self.profile, self.config.scheduling_policy)
        self._evictor = BulkEvictor(self.config.eviction, self.pool)
        self._queue: AdmissionQueue[SeqState] = AdmissionQueue(self.config.admission.queue_ttl_s)
        self._faults = FaultState()
        self._seqs: dict[str, SeqState] = {}  # in flight: queued, waiting or running
        self._dropped: list[RejectedRequest] = []  # queue drops not yet reported
        self._num_submitted = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_finished = 0
        self._num_aborted = 0
        self._num_rejected = 0
        self._num_failed = 0
        self._run: DecodeRun | None = None  # the decode run in progress (run_decodes)

    # ------------------------------------------------------------ admission
    def submit(self, req: EngineRequest, now: float) -> NodeAdmission:
        """Second-stage admission of `req` (see node_admission.py).

        Raises:
            ValueError: duplicate in-flight request id, or `block_hashes` whose
                length is not prompt_tokens // block_size (caller bugs).
        """
        refusal = self._faults.submit_refusal()
        if refusal is not None:
            self._num_rejected += 1
            return refusal
        if req.request_id in self._seqs:
            raise ValueError(f"request {req.request_id!r} is already in flight")
        num_full = req.prompt_tokens // self.config.block_size
        if len(req.block_hashes) != num_full:
            raise ValueError(
                f"request {req.request_id!r}: {len(req.block_hashes)} block hashes for "
                f"{num_full} full blocks of {self.config.block_size} tokens"
            )
        limit = self.config.model_len_limit
        if req.prompt_tokens + req.max_tokens > limit:
            self._num_rejected += 1
            return NodeAdmission.reject(
                RejectKind.BAD_REQUEST,
                f"prompt ({req.prompt_tokens}) + max_tokens ({req.max_tokens}) exceeds "
                f"max_model_len ({limit})",
            )
        self._refresh_queue(now)
        decision = decide_admission(
            self.config.admission, self._load_for(req.priority), len(self._queue)
        )
        if decision.rejected:
            self._num_rejected += 1
            return decision
        seq = SeqState(request=req, seq_no=self._num_submitted)
        self._num_submitted += 1
        self._seqs[req.request_id] = seq
        if decision.accepted:
            self._sched.waiting.push(seq)
        else:
            if len(self._queue) >= self.config.admission.queue_max:
                # full, and req outranks the worst queued class: its newest entry makes room
                displaced = self._queue.displace()
                self._drop_queued(displaced, "displaced by a higher-priority request")
            seq.status = ReqStatus.QUEUED
            self._queue.push(req.request_id, req.priority, seq, now)
        return decision

    def _load_for(self, priority: int) -> NodeLoad:
        running = self._sched.running
        worst_queued = self._queue.worst_priority()
        return NodeLoad(
            num_running=len(running),
            max_num_seqs=self.profile.max_num_seqs,
            kv_usage=self.pool.usage(),
            num_waiting_ahead=self._sched.waiting.num_ahead_of(priority),
            num_queued_ahead=self._queue.num_at_or_better(priority),
            can_preempt=self.config.scheduling_policy == "priority"
            and any(s.request.priority > priority for s in running),
            can_displace=worst_queued is not None and worst_queued > priority,
        )

    def _refresh_queue(self, now: float) -> None:
        """Expire queued entries past their TTL, then move admissible ones in."""
        ttl = self.config.admission.queue_ttl_s
        for seq in self._queue.expire(now):
            self._drop_queued(seq, f"queued at the node for {ttl:g} s without starting")
        while (head := self._queue.peek()) is not None:
            priority, seq = head
            if not can_enter_scheduler(self.config.admission, self._load_for(priority)):
                break
            self._queue.pop()
            seq.status = ReqStatus.WAITING
            self._sched.waiting.push(seq)

    def _drop_queued(self, seq: SeqState, reason: str) -> None:
        """End a request taken out of the admission queue: no work has started on it,
        so another node may take it; reported in the next step's `rejected`."""
        del self._seqs[seq.request_id]
        self._num_rejected += 1
        self._dropped.append(
            RejectedRequest(
                request_id=seq.request_id, reject_kind=RejectKind.RETRY_ELSEWHERE, reason=reason
            )
        )

    # ----------------------------------------------------------------- step
    def step(self, now: float) -> StepOutput | None:
        """Run one iteration starting at `now`; None when there is nothing to do."""
        self._run = None
        if self._faults.crashed:
            return self._timer_only_output(now)
        self._evictor.poll(now)
        self._refresh_queue(now)
        plan = self._sched.schedule()
        if not plan:
            return self._timer_only_output(now, plan)
        self._sched.commit(plan)
        duration = self._duration(plan)
        return self._update(plan, now, duration)

    def run_decodes(self, now: float) -> StepOutput | None:
        """Run at once the decode-only steps that ``step()`` would run back to back
        from ``now`` if nothing came in (decode_run.py): every running sequence
        decodes, nothing waits or is queued, no eviction batch is pending; the run
        stops before a sequence would finish, fill a block or need one. None when
        fewer than two steps qualify: call ``step()``.

        The output reads as the steps' sum: ``tokens`` maps each request to the
        tokens it decoded, ``num_decode_seqs`` counts sequence-steps, and ``start``
        and ``duration_s`` are the last step's, so ``end`` is the float the steps one
        by one end at. Before anything reaches the engine during the run (a submit,
        an abort, a fault), call ``settle(now)``. For simulators; a server streaming
        tokens calls ``step()``."""
        self._run = None
        if (
            self._faults.crashed
            or len(self._sched.waiting)
            or len(self._queue)
            or self._dropped
            or self._evictor.next_due() is not None
        ):
            return None
        run = plan_run(
            self._sched.running,
            now=now,
            profile=self.profile,
            block_size=self.pool.block_size,
            slow_factor=self._faults.slow_factor,
        )
        if run is None:
            return None
        self._advance(run.seqs, run.steps)
        self._run = run
        return self._run_output(run)

    def settle(self, now: float) -> StepOutput | None:
        """Take back the steps of the decode run in progress that have not started by
        ``now``; the run's new output when some were, else None (nothing changed)."""
        run = self._run
        if run is None:
            return None
        dropped = run.cut(now)
        if not dropped:
            return None
        self._advance(run.seqs, -dropped)
        return self._run_output(run)

    @property
    def decode_run(self) -> DecodeRun | None:
        """The decode run in progress, if the last step call was a run."""
        return self._run

    def _advance(self, seqs: list[SeqState], steps: int) -> None:
        """Apply (or, negative, take back) ``steps`` decode steps of ``seqs``."""
        for seq in seqs:
            seq.num_computed_tokens += steps
            seq.num_tokens += steps
            seq.num_output_tokens += steps
        self._num_generation_tokens += len(seqs) * steps

    @staticmethod
    def _run_output(run: DecodeRun) -> StepOutput:
        steps = run.steps
        return StepOutput(
            start=run.starts[-1],
            duration_s=run.durations[-1],
            tokens={seq.request.request_id: steps for seq in run.seqs},
            num_decode_seqs=len(run.seqs) * steps,
        )

    def _duration(self, plan: Plan) -> float:
        # step_time's sums, before the step is applied (once per step: no lists); the
        # plan counts its tokens (prefill tokens plus one per decode)
        decodes = plan.decodes
        # each decode's context: what is in KV plus the fed-in token
        ctx_total = sum(seq.num_computed_tokens for seq in decodes) + len(decodes)
        pairs = 0.0
        for chunk in plan.chunks.values():
            q = chunk.num_new
            pairs += q * (chunk.num_computed + q / 2)
        duration = step_time_of_sums(self.profile, plan.num_tokens, pairs, ctx_total)
        return duration * self._faults.slow_factor

    def _update(self, plan: Plan, now: float, duration: float) -> StepOutput:
        for chunk in plan.chunks.values():  # first scheduled: its wait in queue ends
            if chunk.seq.scheduled_at < 0:
                chunk.seq.scheduled_at = now
        first: list[str] = []
        tokens: dict[str, int] = {}
        finished: list[FinishedRequest] = []
        # once per scheduled sequence per step: the simulator's hottest loop. Decodes
        # first (each computes its last known token and samples), then prefill chunks.
        scheduled = chain(
            zip(plan.decodes, repeat(1)), ((c.seq, c.num_new) for c in plan.chunks.values())
        )
        for seq, num_new in scheduled:
            computed = seq.num_computed_tokens = seq.num_computed_tokens + num_new
            if computed < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            seq.num_tokens += 1  # one sampled token: known and output tokens both grow
            out = seq.num_output_tokens = seq.num_output_tokens + 1
            request = seq.request
            tokens[request.request_id] = 1
            if out == 1:
                first.append(request.request_id)
                self._num_prompt_tokens += request.prompt_tokens
            if out >= request.max_tokens:
                self._sched.finish(seq)
                del self._seqs[seq.request_id]
                self._num_finished += 1
                finished.append(
                    FinishedRequest(
                        request_id=seq.request_id,
                        prompt_tokens=seq.request.prompt_tokens,
                        cached_tokens=max(seq.cached_tokens, 0),
                        output_tokens=seq.num_output_tokens,
                        num_preemptions=seq.num_preemptions,
                        scheduled_at=seq.scheduled_at,
                    )
                )
        self._num_generation_tokens += len(tokens)  # one per sequence that sampled
        return StepOutput(
            start=now,
            duration_s=duration,
            first_token_ids=tuple(first),
            tokens=tokens,
            finished=tuple(finished),
            rejected=self._take_dropped(),
            preempted=tuple(s.request_id for s in plan.preempted),
            num_prefill_tokens=plan.num_tokens - len(plan.decodes),
            num_decode_seqs=len(plan.decodes),
        )

    def _timer_only_output(self, now: float, plan: Plan | None = None) -> StepOutput | None:
        preempted = tuple(s.request_id for s in plan.preempted) if plan is not None else ()
        if not self._dropped and not preempted:
            return None
        return StepOutput(
            start=now, duration_s=0.0, rejected=self._take_dropped(), preempted=preempted
        )

    def _take_dropped(self) -> tuple[RejectedRequest, ...]:
        dropped, self._dropped = tuple(self._dropped), []
        return dropped

    # ---------------------------------------------------------- client side
    def abort(self, request_id: str, now: float) -> bool:
        """Client disconnect: drop the request, free its blocks (they stay cached).

        Returns False when the request is not in flight (unknown or already
        terminal), so a late abort is harmless.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is ReqStatus.QUEUED:
            self._queue.remove(request_id)
        else:
            self._sched.finish(seq)
        self._num_aborted += 1
        return True

    def take_events(self) -> list[KvEvent]:
        """Drain queued KV events (stored, removed, cleared, announcements)."""
        return self.pool.take_events()

    # ------------------------------------------------------------ cache ops
    def bulk_evict(self, fraction: float, now: float, reason: str = "flush") -> int:
        """Evict up to ceil(`fraction` * num_blocks) blocks: `fraction` of the pool, at
        most every cached block not in use (least recently used first; eviction.py).

        Announced and paced when it counts as bulk; returns the blocks chosen.
        """
        return self._evictor.evict(fraction, now, reason)

    def flush(self, share: float, now: float, reason: str = "flush") -> int:
        """A forced flush of ``share`` of what is cached: ceil(``share`` x cached blocks)
        blocks, least recently used first, at most every cached block not in use (a
        block in use cannot go). Forced, it is a bulk eviction whatever its size against
        the bulk threshold: announced, then paced in batches, as :meth:`bulk_evict`'s
        (evicted at once only when announcements are off). Returns the blocks chosen.
        """
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        count = math.ceil(round(share * self.pool.num_cached_blocks, 9))
        if count == 0:
            return 0
        return self._evictor.evict_blocks(count, now, reason, forced=True)

    def reset_prefix_cache(self) -> bool:
        """vLLM `reset_prefix_cache`: only while no block is in use."""
        if self.pool.num_used_blocks:
            return False
        self._evictor.clear()  # first: the pending plans' dones precede AllBlocksCleared
        return self.pool.reset_prefix_cache()

    # --------------------------------------------------------------- faults
    def crash(self, now: float) -> tuple[str, ...]:
        """Fail every in-flight request (returned, in submission order), clear the cache."""
        failed = tuple(s.request_id for s in sorted(self._seqs.values(), key=lambda s: s.seq_no))
        self._seqs.clear()
        self._queue.clear()
        self._sched.clear()
        self._run = None  # its sequences are gone
        self._evictor.clear()
        self.pool.clear_all()
        self._faults.crashed = True
        self._num_failed += len(failed)
        return failed

    # A decode run in progress (run_decodes) was planned under the faults in force when
    # it began: like anything else reaching the engine mid-run, a fault is injected
    # after settle(now), or the steps planned beyond now keep the old speed
    # (SimCluster's slow_node / reject_all_node / recover_node do this).
    def recover(self, now: float) -> None:
        """Heal every fault: accept submissions again at normal speed (during a decode
        run, ``settle(now)`` first)."""
        self._faults.heal()

    def slow(self, factor: float) -> None:
        """Multiply every step's duration by `factor` (1.0 restores); a step already
        started keeps its duration (during a decode run, ``settle(now)`` first)."""
        self._faults.set_slow(factor)

    def reject_all(self, on: bool) -> None:
        """Refuse (or stop refusing) every submission with RETRY_ELSEWHERE (during a
        decode run, ``settle(now)`` first)."""
        self._faults.reject_all = on

    @property
    def faults(self) -> FaultState:
        return self._faults

    # ---------------------------------------------------------------- views
    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def next_timer_at(self) -> float | None:
        """Earliest time an idle engine needs a `step()` (TTL expiry, eviction batch)."""
        times = [t for t in (self._queue.next_expiry(), self._evictor.next_due()) if t is not None]
        return min(times, default=None)

    def request_status(self, request_id: str) -> ReqStatus | None:
        seq = self._seqs.get(request_id)
        return seq.status if seq is not None else None

    def check_invariants(self) -> None:
        """Raise AssertionError unless the engine's bookkeeping adds up.

        Pool accounting holds (block_pool.py); every reference is held by a
        running sequence's block table (no leak); queued and waiting requests
        hold no blocks; the in-flight map is exactly queued + waiting + running.
        """
        self.pool.check_invariants()
        sched = self._sched
        held: dict[int, int] = {}
        for seq in sched.running:
            for block in seq.blocks:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            if self.pool.block(block_id).ref_cnt != held.get(block_id, 0):
                raise AssertionError(f"block {block_id}: ref_cnt disagrees with block tables")
        parked = [*sched.waiting, *self._queue.items()]
        if any(seq.blocks for seq in parked):
            raise AssertionError("a request that is not running holds blocks")
        if len(sched.running) > self.profile.max_num_seqs:
            raise AssertionError("more running sequences than max_num_seqs")
        tracked = {id(s) for s in (*sched.running, *parked)}
        if tracked != {id(s) for s in self._seqs.values()} or len(tracked) != len(self._seqs):
            raise AssertionError("in-flight map disagrees with the queues")

    def metrics(self) -> EngineMetrics:
        sched = self._sched
        return EngineMetrics(
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting) + len(self._queue),
            num_requests_queued=len(self._queue),
            kv_cache_usage_perc=self.pool.usage(),
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            num_requests_finished=self._num_finished,
            num_requests_aborted=self._num_aborted,
            num_requests_rejected=self._num_rejected,
            num_requests_failed=self._num_failed,
            num_gpu_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_evicted_blocks=self.pool.num_lazy_evictions,
        )

