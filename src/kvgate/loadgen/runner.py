"""Drive a workload against an endpoint: schedule, concurrency, time bound, progress.

Schedules (:class:`LoadConfig`):

* ``schedule="rate"``: requests in workload order at ``rate`` per second, first at 0,
  the gaps from ``random.Random(seed)``: gamma-distributed with shape ``burstiness``
  and scale ``1 / (rate * burstiness)`` as ``vllm bench serve --burstiness`` (1, the
  default, is Poisson: exponential gaps; below 1 burstier, above 1 more even), then
  rescaled, as vLLM does, so their mean is exactly ``1 / rate`` (the realised rate
  does not depend on the seed). ``rate=inf`` sends all at once.
* ``schedule="trace"``: at the workload's own arrival times (relative to its first
  request) divided by ``speedup``. A Mooncake trace's requests that share a bucketed
  timestamp arrive as its loader placed them (``kvgate bench --bucket``: spread evenly
  to the next timestamp, or all at it).
* ``concurrency=N`` caps requests in flight in either schedule (a request due while N
  are running waits for a slot, as vLLM's ``--max-concurrency``). With ``rate=inf``
  this is a closed loop of N users.
* Closed-loop sessions: a request whose ``after`` is an earlier request of the run (the
  chat and agent generators' ``closed_loop``) is not scheduled: it is sent when that
  request has ended (answered, failed or refused) plus its ``think_s`` divided by
  ``speedup``, as the simulator does. Requests without ``after`` follow the schedule
  (under ``rate``, at their own places in the Poisson sequence: a follower's place is
  left empty, so the offered rate stays about ``rate`` while sessions keep up).

The run sends the first ``num_requests`` requests of the workload and stops at
``max_seconds``: nothing is sent after it and requests still running are cancelled and
reported as *incomplete*. The benchmark duration runs from the first send to the end of
the last request (or the time bound). One ``aiohttp.ClientSession`` serves all requests;
its connector allows ``concurrency`` connections (unlimited without a cap); aiohttp
sets ``TCP_NODELAY`` on its sockets.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TextIO

import aiohttp

from kvgate.loadgen.client import (
    build_payload,
    check_base_url,
    endpoint_url,
    first_model,
    send_request,
)
from kvgate.loadgen.prompts import check_block_chars, make_spec
from kvgate.loadgen.report import SLO_METRICS, LoadReport, RequestResult, build_report
from kvgate.sim.workload import SimRequest, Workload

Schedule = Literal["rate", "trace"]


@dataclass(frozen=True, slots=True)
class _Sent:
    """What the report needs of a sent request besides its task's result (the prompt
    is not kept: every prompt of the run was, until its end)."""

    task: asyncio.Task[RequestResult]
    request_id: str
    prompt_tokens: int
    at: float  # perf_counter() when sent


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    """Everything :func:`run_load` needs; the defaults mirror ``kvgate bench``."""

    workload: Workload
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    stream: bool = True
    schedule: Schedule = "rate"
    rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    speedup: float = 1.0
    num_requests: int = 200
    max_seconds: float = 120.0
    seed: int = 0
    chars_per_token: int = 4
    max_prompt_tokens: int | None = None
    output_tokens_cap: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)
    progress: bool = False
    # where the workload came from, recorded so a saved report says how to repeat it
    source: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if self.schedule not in ("rate", "trace"):
            raise ValueError("schedule must be 'rate' or 'trace'")
        if math.isnan(self.rate) or self.rate <= 0:
            raise ValueError("rate must be > 0 (or inf)")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError("burstiness must be a finite number > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not (math.isfinite(self.speedup) and self.speedup > 0):
            raise ValueError("speedup must be a finite number > 0")
        if self.num_requests < 0:
            raise ValueError("num_requests must be >= 0")
        if not self.max_seconds > 0:
            raise ValueError("max_seconds must be > 0")
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        for name, cap in (("max_prompt_tokens", self.max_prompt_tokens),
                          ("output_tokens_cap", self.output_tokens_cap)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1")
        # before any request: every prompt would fail the same way in make_spec
        check_block_chars(self.workload.block_tokens, self.chars_per_token)
        bad = set(self.goodput_slos_ms) - set(SLO_METRICS)
        if bad:
            raise ValueError(f"unknown SLO metrics {sorted(bad)}; expected {SLO_METRICS}")

    def settings(self, model: str) -> dict[str, object]:
        """The run's settings as JSON-safe values (``rate`` inf is the string "inf")."""
        return {
            "base_url": self.base_url,
            "endpoint": self.endpoint,
            "model": model,
            "stream": self.stream,
            "workload": self.workload.name,
            "workload_requests": len(self.workload.requests),
            "closed_loop": bool(self.workload.waits()),
            "block_tokens": self.workload.block_tokens,
            "schedule": self.schedule,
            "rate": "inf" if math.isinf(self.rate) else self.rate,
            "burstiness": self.burstiness,
            "concurrency": self.concurrency,
            "speedup": self.speedup,
            "num_requests": self.num_requests,
            "max_seconds": self.max_seconds,
            "seed": self.seed,
            "chars_per_token": self.chars_per_token,
            "max_prompt_tokens": self.max_prompt_tokens,
            "output_tokens_cap": self.output_tokens_cap,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            **self.source,
        }


def send_offsets(config: LoadConfig, requests: Sequence[SimRequest]) -> list[float]:
    """Seconds after the start at which each request is due."""
    if not requests:
        return []
    if config.schedule == "trace":
        first = requests[0].arrival_s
        return [(r.arrival_s - first) / config.speedup for r in requests]
    if math.isinf(config.rate):
        return [0.0] * len(requests)
    rng = random.Random(config.seed)
    shape = config.burstiness
    scale = 1.0 / (config.rate * shape)  # mean gap 1 / rate whatever the shape
    out = [0.0]
    for _ in range(len(requests) - 1):
        out.append(out[-1] + rng.gammavariate(shape, scale))
    # vLLM's normalisation: N random gaps summed drift a few % from N / rate, so the
    # realised rate depended on the seed. vLLM waits a gap before its first request and
    # ends at N / rate; ours is sent at 0, so N - 1 gaps end at (N - 1) / rate: the
    # same mean gap, 1 / rate.
    if out[-1] > 0:  # all gaps 0 can happen only with a vanishing shape
        factor = (len(out) - 1) / config.rate / out[-1]
        out = [t * factor for t in out]
    return out


class Progress:
    """A one-line ``\\r`` progress bar on a text stream (stderr), redrawn <= 10x/s."""

    def __init__(self, total: int, *, enabled: bool, out: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.out = out if out is not None else sys.stderr
        self.done = 0
        self.failed = 0
        self._t0 = time.perf_counter()
        self._drawn = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * width)
        self.out.write(f"\r[{bar:<{width}}] {self.done}/{self.total} done, "
                       f"{self.failed} failed, {now - self._t0:6.1f} s")
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.out.write("\n")
            self.out.flush()


async def _drive(
    session: aiohttp.ClientSession, config: LoadConfig, model: str
) -> tuple[list[RequestResult], float]:
    reqs = config.workload.requests[: config.num_requests]
    offsets = send_offsets(config, reqs)
    url = endpoint_url(config.base_url, config.endpoint)
    sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    progress = Progress(len(reqs), enabled=config.progress)
    sent: list[_Sent] = []
    # Closed loop: the requests others wait for, each with an event set when it ends
    # (the workload orders a predecessor before its followers, so it is in this slice).
    waits = config.workload.waits()
    ended = {waits[r.request_id]: asyncio.Event() for r in reqs if r.request_id in waits}
    t0 = time.perf_counter()

    async def one(payload: dict[str, object], request_id: str,
                  prompt_tokens: int) -> RequestResult:
        try:
            res = await send_request(session, url=url, payload=payload,
                                     request_id=request_id, prompt_tokens=prompt_tokens,
                                     t0=t0, chars_per_token=config.chars_per_token)
            progress.update(res.success)
            return res
        finally:
            if sem is not None:
                sem.release()
            if (event := ended.get(request_id)) is not None:
                event.set()

    deadline = t0 + config.max_seconds

    async def send(req: SimRequest) -> bool:
        """Send ``req``; False (not sent) once past the time bound, whose timer may fire
        late on a busy machine while the schedule sends what came due meanwhile."""
        if sem is not None:
            await sem.acquire()
        if time.perf_counter() >= deadline:
            if sem is not None:
                sem.release()
            return False
        spec = make_spec(req, block_tokens=config.workload.block_tokens,
                         chars_per_token=config.chars_per_token, seed=config.seed,
                         max_prompt_tokens=config.max_prompt_tokens,
                         output_tokens_cap=config.output_tokens_cap)
        # the prompt lives in the payload while the request runs, not in `sent`
        payload = build_payload(endpoint=config.endpoint, model=model, prompt=spec.prompt,
                                max_tokens=spec.max_tokens, stream=config.stream,
                                ignore_eos=config.ignore_eos, temperature=config.temperature)
        task = asyncio.create_task(one(payload, spec.request_id, spec.prompt_tokens))
        sent.append(_Sent(task, spec.request_id, spec.prompt_tokens, time.perf_counter()))
        return True

    async def follow(req: SimRequest, previous: asyncio.Event) -> None:
        await previous.wait()
        await asyncio.sleep(req.think_s / config.speedup)
        await send(req)

    async def dispatch() -> None:
        followers = [asyncio.create_task(follow(r, ended[waits[r.request_id]]))
                     for r in reqs if r.request_id in waits]
        try:
            for req, offset in zip(reqs, offsets, strict=True):
                if req.request_id in waits:
                    continue  # sent by its follow() task
                wait = t0 + offset - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not await send(req):
                    break
            if followers:
                await asyncio.gather(*followers)
            if sent:
                await asyncio.wait([s.task for s in sent])
        finally:
            for task in followers:  # at the time bound: nothing more is sent
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)

    dispatcher = asyncio.create_task(dispatch())
    try:
        await asyncio.wait({dispatcher}, timeout=config.max_seconds)
    finally:
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)  # stops the followers
        for s in sent:
            s.task.cancel()
        await asyncio.gather(*(s.task for s in sent), return_exceptions=True)
        progress.close()
    end = time.perf_counter()
    results: list[RequestResult] = []
    for s in sent:
        if s.task.cancelled():
            error, detail = "cancelled", "still running at the time bound"
        elif (exc := s.task.exception()) is not None:  # a bug, not a server problem
            error, detail = "internal", f"{type(exc).__name__}: {exc}"[:300]
        else:
            results.append(s.task.result())
            continue
        results.append(RequestResult(
            request_id=s.request_id, success=False, status=0, error=error,
            error_detail=detail, start_s=s.at - t0, end_s=end - t0,
            prompt_tokens=s.prompt_tokens))
    return results, end - t0


async def discover_model(session: aiohttp.ClientSession, config: LoadConfig) -> str:
    """The endpoint's first model (``GET /v1/models``), waited for at most
    ``min(max_seconds, request_timeout_s)``; RuntimeError (one line) on a timeout."""
    limit = min(config.max_seconds, config.request_timeout_s)
    try:
        return await asyncio.wait_for(first_model(session, config.base_url), limit)
    except TimeoutError:
        raise RuntimeError(
            f"GET /v1/models did not answer within {limit:g} s "
            "(min of --max-seconds and --request-timeout); pass --model"
        ) from None


async def run_load(config: LoadConfig) -> LoadReport:
    """Run the benchmark described by ``config`` and aggregate it (see module doc)."""
    connector = aiohttp.TCPConnector(limit=config.concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:
        model = config.model or await discover_model(session, config)
        results, duration = await _drive(session, config, model)
    return build_report(results, duration_s=duration, goodput_slos_ms=config.goodput_slos_ms,
                        settings=config.settings(model))
