"""Hypothesis properties of the simulated engine, and determinism across hash seeds."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineProfile,
    EngineRequest,
    EvictionAnnounced,
    EvictionConfig,
    EvictionDone,
    KvEvent,
    NodeAdmissionConfig,
    SimEngine,
    StepOutput,
)

BLOCK_SIZE = 4


@dataclass(frozen=True)
class Submit:
    prompt_tokens: int
    doc: int  # requests of one doc share a prefix chain
    max_tokens: int
    priority: int
    with_token_ids: bool


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class Abort:
    index: int


@dataclass(frozen=True)
class Advance:
    dt: float


@dataclass(frozen=True)
class Evict:
    fraction: float


@dataclass(frozen=True)
class Crash:
    pass


@dataclass(frozen=True)
class Recover:
    pass


OPS = st.one_of(
    st.builds(
        Submit,
        st.integers(1, 24),
        st.integers(0, 3),
        st.integers(1, 8),
        st.integers(0, 2),
        st.booleans(),
    ),
    st.just(Step()),
    st.just(Step()),
    st.just(Step()),
    st.builds(Abort, st.integers(0, 40)),
    st.builds(Advance, st.floats(0.0, 0.8)),
    st.builds(Evict, st.floats(0.05, 0.6)),
    st.just(Crash()),
    st.just(Recover()),
)


@st.composite
def engines(draw: st.DrawFn) -> SimEngine:
    num_blocks = draw(st.integers(8, 14))
    profile = EngineProfile(
        name="prop",
        t0_s=0.01,
        a_s_per_token=0.001,
        c_s_per_pair=1e-6,
        k_s_per_ctx_token=1e-5,
        max_num_batched_tokens=draw(st.integers(4, 16)),
        max_num_seqs=draw(st.integers(1, 4)),
    )
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        admission=NodeAdmissionConfig(
            waiting_accept=draw(st.integers(0, 2)),
            queue_max=draw(st.integers(0, 3)),
            queue_ttl_s=0.3,
        ),
        eviction=EvictionConfig(announce_lead_s=draw(st.sampled_from([None, 0.0, 0.2]))),
    )
    return SimEngine(config, profile)


def make_request(op: Submit, request_id: str, now: float) -> EngineRequest:
    base = 1000 * (op.doc + 1)
    num_full = op.prompt_tokens // BLOCK_SIZE
    return EngineRequest(
        request_id=request_id,
        prompt_tokens=op.prompt_tokens,
        block_hashes=tuple(base + i for i in range(num_full)),
        token_ids=tuple(base + i for i in range(op.prompt_tokens)) if op.with_token_ids else (),
        max_tokens=op.max_tokens,
        priority=op.priority,
        arrival=now,
    )


class Mirror:
    """What a gateway's precise index learns from the engine's events alone."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.pending_announcements = 0

    def apply(self, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert not self.hashes & set(event.block_hashes)  # never stored twice
                assert len(event.token_ids) in (0, len(event.block_hashes) * BLOCK_SIZE)
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.hashes  # only real evictions
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()
                self.pending_announcements = 0
            elif isinstance(event, EvictionAnnounced):
                self.pending_announcements += 1
            elif isinstance(event, EvictionDone):
                self.pending_announcements -= 1
                assert self.pending_announcements >= 0


def check(engine: SimEngine, mirror: Mirror) -> None:
    engine.check_invariants()
    mirror.apply(engine.take_events())
    assert mirror.hashes == set(engine.pool.cached_hashes())
    pool = engine.pool
    assert pool.num_free_blocks == sum(pool.block(i).ref_cnt == 0 for i in range(pool.num_blocks))
    assert all(pool.block(i).ref_cnt >= 0 for i in range(pool.num_blocks))
    for block_hash, block_id in pool.cached_hashes().items():
        assert pool.block(block_id).block_hash == block_hash
    m = engine.metrics()
    assert 0.0 <= m.kv_cache_usage_perc <= 1.0
    assert m.num_requests_running <= engine.profile.max_num_seqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), ops=st.lists(OPS, max_size=60))
def test_accounting_adds_up_and_every_request_ends_exactly_once(
    engine: SimEngine, ops: list[object]
) -> None:
    """Block accounting adds up after every call, an index fed only the KV events
    holds exactly the cached hashes, and every submitted request ends in exactly one
    terminal outcome (rejected, expired, finished, aborted, failed)."""
    mirror = Mirror()
    now = 0.0
    submitted: list[str] = []
    outcomes: Counter[str] = Counter()

    def record_step(out: StepOutput) -> None:
        for f in out.finished:
            outcomes[f.request_id] += 1
            assert f.output_tokens == next(
                o.max_tokens for o in requests if o.request_id == f.request_id
            )
        for r in out.rejected:
            outcomes[r.request_id] += 1

    requests: list[EngineRequest] = []
    for op in ops:
        if isinstance(op, Submit):
            request = make_request(op, f"r{len(submitted)}", now)
            decision = engine.submit(request, now)
            submitted.append(request.request_id)
            requests.append(request)
            if decision.rejected:
                outcomes[request.request_id] += 1
        elif isinstance(op, Step):
            out = engine.step(now)
            if out is not None:
                record_step(out)
                now = out.end
        elif isinstance(op, Abort) and submitted:
            request_id = submitted[op.index % len(submitted)]
            if engine.abort(request_id, now):
                outcomes[request_id] += 1
        elif isinstance(op, Advance):
            now += op.dt
        elif isinstance(op, Evict):
            engine.bulk_evict(op.fraction, now, "prop")
        elif isinstance(op, Crash):
            for request_id in engine.crash(now):
                outcomes[request_id] += 1
        elif isinstance(op, Recover):
            engine.recover(now)
        check(engine, mirror)
        assert all(n == 1 for n in outcomes.values())

    # drain: heal, then step (and wait for timers) until nothing is left
    engine.recover(now)
    for _ in range(5_000):
        out = engine.step(now)
        if out is not None:
            record_step(out)
            now = out.end
            continue
        if not engine.has_unfinished_requests() and engine.next_timer_at() is None:
            break
        now = engine.next_timer_at() or now + 1.0
    check(engine, mirror)
    assert not engine.has_unfinished_requests()
    assert mirror.pending_announcements == 0  # every announced eviction said it was done
    assert engine.pool.num_used_blocks == 0
    assert outcomes == Counter(submitted)


DETERMINISM_SCRIPT = r"""
import hashlib
from kvgate.engine import EngineConfig, EngineRequest, SimEngine, get_profile
engine = SimEngine(EngineConfig(num_blocks=40, block_size=16, scheduling_policy="priority"),
                   get_profile("h100-8b"))
log = []
now = 0.0
for i in range(60):
    doc = i % 3
    prompt = 40 + 13 * (i % 7)
    hashes = tuple(900 * doc + j for j in range(prompt // 16))
    ids = tuple((doc * 7 + j) % 500 for j in range(prompt))
    log.append(engine.submit(EngineRequest(request_id=f"req-{i}", prompt_tokens=prompt,
               block_hashes=hashes, token_ids=ids, max_tokens=5 + i % 11, priority=i % 3,
               arrival=now), now))
    for _ in range(3):
        out = engine.step(now)
        if out is not None:
            log.append(out)
            now = out.end
    if i == 30:
        engine.bulk_evict(0.3, now, "flush")
    log.extend(engine.take_events())
    now += 0.01
print(hashlib.sha256(repr(log).encode()).hexdigest())
"""


def test_runs_are_identical_under_any_pythonhashseed() -> None:
    digests = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", DETERMINISM_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        digests.add(res.stdout.strip())
    assert len(digests) == 1
    assert len(hashlib.sha256().hexdigest()) == len(digests.pop())
