"""Value types at the simulated engine's boundary: config, requests, outputs.

Theory of operation
-------------------
Everything here is a frozen value. `EngineRequest` is what a driver submits,
`StepOutput` is what one `SimEngine.step(now)` returns (all of it effective
at `end`), `EngineMetrics` is a snapshot with vLLM's metric meanings
(research/engine-integration.md 4.1). Every submitted request ends in exactly
one terminal outcome: rejected at submit (a REJECTED `NodeAdmission`),
expired in or displaced from the admission queue (`StepOutput.rejected`), finished
(`StepOutput.finished`), aborted (`SimEngine.abort` returned True) or failed
(returned by `SimEngine.crash`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvgate.engine.eviction import EvictionConfig
from kvgate.engine.node_admission import NodeAdmissionConfig, RejectKind

__all__ = [
    "EngineConfig",
    "EngineMetrics",
    "EngineRequest",
    "FinishedRequest",
    "RejectedRequest",
    "SchedulingPolicy",
    "StepOutput",
]

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Static configuration of one simulated engine.

    Attributes:
        num_blocks: KV pool size in blocks (vLLM `num_gpu_blocks`). The
            simulator's A100-8B node holds about 800 blocks of 512 tokens
            (workloads.md 3.2); the default suits unit-scale runs.
        block_size: tokens per block: 16 as vLLM's default; the simulator
            uses 512 so that one Mooncake trace hash is one block.
        scheduling_policy: "fcfs" (vLLM default) or "priority" (lower
            `priority` value first, then arrival; preemption takes the
            lowest-priority, newest running request).
        max_model_len: longest prompt + output accepted; default (None) is
            the pool's capacity, and it may not exceed it (a request that
            cannot fit in an empty pool would never run).
        admission: second-stage admission thresholds.
        eviction: bulk-eviction pacing and announcement.
    """

    num_blocks: int = 1000
    block_size: int = 16
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_model_len: int | None = None
    admission: NodeAdmissionConfig = field(default_factory=NodeAdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len is not None and not 1 <= self.max_model_len <= capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} must be in [1, {capacity}] "
                "(num_blocks * block_size)"
            )

    @property
    def model_len_limit(self) -> int:
        """`max_model_len`, or the pool capacity when it is None."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One generation request as the engine sees it.

    Attributes:
        request_id: unique among the engine's in-flight requests.
        prompt_tokens: prompt length in tokens.
        block_hashes: chained hashes of the prompt's FULL blocks at the
            engine's block size (len == prompt_tokens // block_size); the
            trailing partial block is not a cache block.
        token_ids: the prompt's token ids if known (then copied into
            `BlockStored` events), else empty.
        max_tokens: output tokens to generate; the engine generates exactly this many.
        priority: lower value is served first (vLLM semantics).
        arrival: arrival time in seconds (tie-break of the priority order).
        cache_salt: the request's ``cache_salt`` (its block hashes are already salted):
            as vLLM's, the first block's ``BlockStored`` names it in ``extra_keys``.
    """

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    max_tokens: int
    priority: int = 0
    arrival: float
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # arrival orders the "priority" queue; a NaN there breaks the sort. Only this
        # float is checked: a scan of the whole request would walk its token ids.
        if not math.isfinite(self.arrival):
            raise ValueError(f"EngineRequest.arrival must be a finite number, got {self.arrival}")
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.token_ids and len(self.token_ids) != self.prompt_tokens:
            raise ValueError("token_ids must be empty or hold exactly prompt_tokens ids")


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedRequest:
    """A request that produced all its tokens in this step."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prefix-cache hit at its first scheduling (usage.cached_tokens)
    output_tokens: int
    num_preemptions: int = 0
    # engine time it was first scheduled (vLLM's scheduled_ts: its queue time ends, its
    # prefill begins); not part of equality, a timing detail
    scheduled_at: float = field(default=-1.0, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectedRequest:
    """A queued request dropped by the node (TTL expiry, or displaced by a
    higher-priority arrival) before any work started."""

    request_id: str
    reject_kind: RejectKind
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    """What one engine iteration did; every result is effective at `end`.

    Attributes:
        start: the `now` the step was called with.
        duration_s: modelled step time (0 when only timers fired).
        first_token_ids: requests whose first output token this step produced.
        tokens: request id -> output tokens produced this step (1 per sequence).
        finished: requests completed this step (their blocks are freed).
        rejected: admission-queue entries that expired, or were displaced by a
            higher-priority submit since the last step, before any work started.
        preempted: running requests sent back to waiting (recomputed later).
        num_prefill_tokens: uncached prompt (or recompute) tokens computed.
        num_decode_seqs: sequences that decoded one token.
    """

    start: float
    duration_s: float
    first_token_ids: tuple[str, ...] = ()
    tokens: Mapping[str, int] = field(default_factory=dict)
    finished: tuple[FinishedRequest, ...] = ()
    rejected: tuple[RejectedRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration_s


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMetrics:
    """Snapshot with vLLM's metric meanings (counters are totals since start).

    `num_requests_waiting` counts the scheduler's waiting queue plus the
    admission queue (both are "not yet running" to an outside observer);
    `num_requests_queued` is the admission-queue part alone.
    `kv_cache_usage_perc` counts blocks with a reference only, as vLLM does.
    """

    num_requests_running: int
    num_requests_waiting: int
    num_requests_queued: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of requests that produced a first token
    generation_tokens: int
    num_requests_finished: int
    num_requests_aborted: int
    num_requests_rejected: int  # at submit, by TTL or displaced
    num_requests_failed: int
    num_gpu_blocks: int
    block_size: int
    num_cached_blocks: int
    num_evicted_blocks: int  # lazy evictions (bulk ones are in the events)
