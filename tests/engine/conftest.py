"""Builders shared by the engine tests, handed out as one `kit` fixture.

The suite runs with --import-mode=importlib, so tests cannot import a helper
module; `kit.req(...)`, `kit.tiny_engine(...)` etc. are plain functions.
"""

from __future__ import annotations

import pytest

from kvgate.engine import (
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineProfile,
    EngineRequest,
    KvEvent,
    SimEngine,
    StepOutput,
)

# Easy arithmetic: a step costs 10 ms + 1 ms per token, no attention terms.
TINY = EngineProfile(
    name="tiny",
    t0_s=0.010,
    a_s_per_token=0.001,
    c_s_per_pair=0.0,
    k_s_per_ctx_token=0.0,
    max_num_batched_tokens=64,
    max_num_seqs=4,
)


def tiny_profile(**overrides: int) -> EngineProfile:
    fields = {
        "max_num_batched_tokens": TINY.max_num_batched_tokens,
        "max_num_seqs": TINY.max_num_seqs,
    }
    fields.update(overrides)
    return EngineProfile(
        name="tiny",
        t0_s=TINY.t0_s,
        a_s_per_token=TINY.a_s_per_token,
        c_s_per_pair=0.0,
        k_s_per_ctx_token=0.0,
        **fields,
    )


def tiny_engine(
    *, num_blocks: int = 10, block_size: int = 4, profile: EngineProfile = TINY, **cfg: object
) -> SimEngine:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, **cfg)  # type: ignore[arg-type]
    return SimEngine(config, profile)


def chain(base: int, num_blocks: int) -> tuple[int, ...]:
    """Readable fake block hashes: base+1, base+2, ... (opaque ints to the engine)."""
    return tuple(base + i + 1 for i in range(num_blocks))


def req(
    request_id: str,
    prompt_tokens: int,
    *,
    base: int,
    max_tokens: int = 1,
    block_size: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    token_ids: tuple[int, ...] = (),
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        block_hashes=chain(base, prompt_tokens // block_size),
        token_ids=token_ids,
        max_tokens=max_tokens,
        priority=priority,
        arrival=arrival,
    )


def drive(engine: SimEngine, now: float, max_steps: int = 10_000) -> tuple[list[StepOutput], float]:
    """Step until the engine has nothing to do; return the outputs and the end time."""
    outputs: list[StepOutput] = []
    for _ in range(max_steps):
        out = engine.step(now)
        if out is None:
            return outputs, now
        outputs.append(out)
        now = out.end
    raise AssertionError("engine did not go idle")


def ttft(engine: SimEngine, request: EngineRequest, now: float) -> float:
    """Submit `request` at `now` to an idle engine and return its time to first token."""
    assert engine.submit(request, now).accepted
    outputs, _ = drive(engine, now)
    for out in outputs:
        if request.request_id in out.first_token_ids:
            return out.end - now
    raise AssertionError("no first token")


def cache_events(events: list[KvEvent]) -> list[KvEvent]:
    return [e for e in events if isinstance(e, BlockStored | BlockRemoved)]


class Kit:
    """The helpers above, as attributes of the `kit` fixture."""

    TINY = TINY
    tiny_profile = staticmethod(tiny_profile)
    tiny_engine = staticmethod(tiny_engine)
    chain = staticmethod(chain)
    req = staticmethod(req)
    drive = staticmethod(drive)
    ttft = staticmethod(ttft)
    cache_events = staticmethod(cache_events)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    return Kit
