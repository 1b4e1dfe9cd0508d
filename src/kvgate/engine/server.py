"""`kvgate engine`: the pure simulated engine served over vLLM's OpenAI API (the I/O shell).

Theory of operation
-------------------
One :class:`EngineServer` owns one `SimEngine` and drives it in real time. The
engine's clock is virtual: ``now = (monotonic - start) * speedup``, so a
modelled step of d seconds takes d / speedup wall seconds. A single task runs
the engine loop:

    out = engine.step(now)          # plan + execute one iteration (pure)
    publish engine.take_events()    # vLLM KV events (ZMQ), eviction notices (log)
    sleep until out.end (scaled)    # the step "runs"
    deliver out.tokens / finished / rejected to the waiting handlers
    nothing to do? wait for a submission, a fault action or next_timer_at()

Sleeps shorter than 1 ms are skipped (the virtual clock is then held at
``out.end``, slightly ahead of wall time) so timer granularity never slows a
high-speedup run; the lag is made up by the next sleep that is long enough.

Every engine call happens on the event-loop thread between awaits, so each is
atomic. Request handlers tokenize (server_tokens.py), `submit`, then read an
asyncio queue their results are delivered to; a REJECTED submission is a 503
with ``X-Kvgate-Reject`` (or 400 for BAD_REQUEST). A streamed response sends
its headers only with the first token, so a queued request that expires or a
crash before the first token is still a clean 503 (``retry-elsewhere``).
When the client goes away, aiohttp cancels the handler (``handler_cancellation``)
or a write fails, and the handler's ``finally`` aborts the engine request, which
frees its blocks (they stay cached). Fault injection: server_config.py. KV
events and the eviction log: server_events.py. Bodies and metrics:
server_openai.py.

``GET /kvgate/evictions?since=N`` serves kvgate's eviction pre-announcements
(`EvictionAnnounced` / `EvictionDone`, not vLLM events) for gateways to poll;
shape in :meth:`EvictionLog.page`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import zmq
from aiohttp import web

from kvgate.edge import (
    REQUEST_ID_HEADER,
    EdgeRunner,
    client_request_id,
    expect_handler,
    http_exception_response,
    reset_transport,
)
from kvgate.edge import json_response as _json  # the gateway's compact JSON answers
from kvgate.edge_body import read_body_within
from kvgate.engine.api import (
    EngineConfig,
    EngineMetrics,
    EngineRequest,
    FinishedRequest,
    RejectedRequest,
    StepOutput,
)
from kvgate.engine.engine import SimEngine
from kvgate.engine.kv_events import KvEvent
from kvgate.engine.node_admission import NodeAdmission
from kvgate.engine.profiles import get_profile
from kvgate.engine.server_cli import add_engine_parser, config_from_args
from kvgate.engine.server_config import EngineServerConfig, FaultSpec, WireFaults
from kvgate.engine.server_events import (
    EvictionLog,
    KvEventEncoder,
    binds_endpoint,
    to_wire_events,
)
from kvgate.engine.server_histograms import RequestTimer
from kvgate.engine.server_openai import (
    ResponseShape,
    models_body,
    parse_generate,
    render_metrics,
)
from kvgate.engine.server_tokens import (
    PromptTokenizer,
    SimTokens,
    generated_text,
    tokenize_body,
)
from kvgate.protocol import (
    KVEvent,
    ProtocolError,
    RequestTooLargeError,
    invalid_request_body,
    not_found_body,
    overloaded_body,
)
from kvgate.protocol.errors import BodyTimeoutError
from kvgate.protocol.node_reject import REJECT_HEADER, RejectKind
from kvgate.protocol.openai_schema import parse_json_object
from kvgate.protocol.sse import DONE_EVENT, encode_json_event, error_event

__all__ = [
    "EngineServer",
    "EngineServerConfig",
    "add_engine_parser",
    "run_engine",
    "start_engine_server",
]

log = logging.getLogger("kvgate.engine.server")

_MIN_SLEEP_S = 0.001
# a /tokenize body past this is tokenized on a worker thread (about 4 ms of work inline)
_INLINE_TOKENIZE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Failed:
    """A request the engine lost (crash, shutdown, driver error)."""

    message: str
    code: str


_Item = int | FinishedRequest | RejectedRequest | _Failed


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _body_timed_out() -> BodyTimeoutError:
    return BodyTimeoutError("Timed out reading the request body.")


@web.middleware
async def _http_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """aiohttp's own 404 (unknown URL), 405 (method) and the like are raised, as
    text/plain: answer them in OpenAI's JSON shape, as the gateway does. Responses the
    handlers return (their own JSON errors included) pass through untouched."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_exception_response(exc)


def _reject_response(kind: RejectKind, reason: str, headers: dict[str, str]) -> web.Response:
    if kind is RejectKind.BAD_REQUEST:
        return _json(400, invalid_request_body(reason, code="context_length_exceeded"), headers)
    return _json(503, overloaded_body(reason, code=kind.value.replace("-", "_")),
                 {**headers, REJECT_HEADER: kind.value})


class _KvPublisher:
    """A ZMQ PUB socket sending vLLM KV-event batches; never blocks (PUB drops at HWM)."""

    def __init__(self, endpoint: str, encoder: KvEventEncoder) -> None:
        self.encoder = encoder
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            if binds_endpoint(endpoint):
                self._sock.bind(endpoint)
                self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sock.connect(endpoint)
                self.endpoint = endpoint
        except zmq.ZMQError:
            self.close()
            raise

    def publish(self, events: list[KVEvent], ts: float) -> None:
        frames = self.encoder.encode(events, ts)
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class EngineServer:
    """One simulated engine behind vLLM's HTTP API. Build with :func:`start_engine_server`."""

    def __init__(self, config: EngineServerConfig) -> None:
        self.config = config
        profile = (get_profile(config.profile) if isinstance(config.profile, str)
                   else config.profile)
        self.engine = SimEngine(
            EngineConfig(
                num_blocks=config.num_blocks, block_size=config.block_size,
                scheduling_policy=config.scheduling_policy, max_model_len=config.max_model_len,
                admission=config.admission, eviction=config.eviction,
            ),
            profile,
        )
        self.max_model_len = self.engine.config.model_len_limit
        # vLLM's per-request histograms, in wall seconds (engine time / speed-up)
        self.timer = RequestTimer(self.max_model_len, lambda dt: dt / config.speedup)
        self.wire_faults = WireFaults()
        self.evictions = EvictionLog(block_size=config.block_size)
        self.port = 0
        self.node_id = config.node_id or ""
        self._tokens = PromptTokenizer(config.block_size)
        self._pending: dict[str, asyncio.Queue[_Item]] = {}
        self._wake = asyncio.Event()
        self._fault_changed = asyncio.Event()  # wakes a step's sleep (_sleep_until)
        self._changed = asyncio.Event()
        self._t0 = time.monotonic()
        self._vnow = 0.0
        self._started_at = time.time()  # /metrics' process_start_time_seconds
        self._created = int(self._started_at)
        self._publisher: _KvPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._task: asyncio.Task[None] | None = None
        self._driver_error: BaseException | None = None
        self._crashes = 0  # crash actions so far: a step's sleep that saw one is void
        # finished requests the engine counted and no client has had: those of the step
        # being slept out, and those of steps a crash voided (see metrics())
        self._answering = 0
        self._voided = 0
        self.app = self._build_app()

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The resolved PUB endpoint (a bound ``*`` port filled in), or None."""
        return self._publisher.endpoint if self._publisher is not None else None

    async def start(self) -> None:
        cfg = self.config
        if cfg.kv_events_endpoint:
            encoder = KvEventEncoder(topic=cfg.kv_events_topic, layout=cfg.kv_events_layout)
            self._publisher = _KvPublisher(cfg.kv_events_endpoint, encoder)
        # the gateway's edge: what the HTTP parser rejects gets an OpenAI-shaped JSON
        # error (not aiohttp's text/plain echo of the bytes), and a stalled head times out
        self._runner = EdgeRunner(self.app, header_timeout_s=cfg.header_timeout_s,
                                  handler_cancellation=True, access_log=None,
                                  shutdown_timeout=2.0)
        try:
            await self._runner.setup()
            await web.TCPSite(self._runner, cfg.host, cfg.port).start()
        except BaseException:
            await self.stop()
            raise
        self.port = int(self._runner.addresses[0][1])
        self.node_id = cfg.node_id or f"{cfg.host}:{self.port}"
        self._t0 = time.monotonic()
        for spec in cfg.faults:
            self.apply_fault(spec)
        self._task = asyncio.get_running_loop().create_task(self._drive(), name="kvgate-engine")

    async def stop(self) -> None:
        """Fail what is in flight, stop the loop, close the listener and the ZMQ socket."""
        for rid in list(self._pending):
            self._fail(rid, "engine server shutting down", "shutdown")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    # --------------------------------------------------------------- clock
    def now(self) -> float:
        """Engine (virtual) time; never goes backwards."""
        self._vnow = max(self._vnow, (time.monotonic() - self._t0) * self.config.speedup)
        return self._vnow

    async def _sleep_until(self, vt: float) -> None:
        """Sleep out the step in progress, to its end ``vt``. A fault action during the
        sleep re-plans it: after a crash the step ends at once (its requests have
        failed); a new slow factor scales the time the step has left (so ``recover``
        ends a ``slow:1000`` step promptly instead of after its thousandfold time)."""
        factor = self.engine.faults.slow_factor  # the step was planned with it
        while True:
            delay = self._t0 + vt / self.config.speedup - time.monotonic()
            if delay <= _MIN_SLEEP_S:
                await asyncio.sleep(0)
                break
            changed = self._fault_changed
            changed.clear()
            try:
                async with asyncio.timeout(delay):
                    await changed.wait()
            except TimeoutError:
                break
            faults = self.engine.faults
            if faults.crashed:
                return
            if faults.slow_factor != factor:
                now = self.now()
                vt = now + max(vt - now, 0.0) * faults.slow_factor / factor
                factor = faults.slow_factor
        self._vnow = max(self._vnow, vt)

    # --------------------------------------------------------- engine loop
    async def _drive(self) -> None:
        try:
            while True:
                now = self.now()
                out = self.engine.step(now)
                self._drain_events(now)
                if out is None:
                    await self._idle()
                    continue
                results: list[FinishedRequest | RejectedRequest] = [*out.finished, *out.rejected]
                # The handlers the step's outputs are for, fixed before the sleep: during
                # it a request may end (client gone, crash) and a new one take its id.
                pending = self._pending
                owners = {rid: q for rid in out.tokens if (q := pending.get(rid)) is not None}
                for res in results:
                    if (q := pending.get(res.request_id)) is not None:
                        owners[res.request_id] = q
                crashes = self._crashes
                self._answering = len(out.finished)
                if out.duration_s > 0:
                    await self._sleep_until(out.end)
                self._answering = 0
                if self._crashes != crashes:
                    self._void(out, results, owners)
                    continue
                timer = self.timer
                timer.step(out.num_prefill_tokens + out.num_decode_seqs)
                for rid, n in out.tokens.items():
                    queue = owners.get(rid)
                    if queue is not None:  # a handler that left reads it no more
                        queue.put_nowait(n)
                        timer.tokens(rid, out.end)
                for res in results:
                    if isinstance(res, FinishedRequest) and res.request_id in owners:
                        timer.finished(res.request_id, out.end, res.prompt_tokens,
                                       res.output_tokens, res.scheduled_at)
                    done = owners.get(res.request_id)
                    if done is not None:
                        if pending.get(res.request_id) is done:
                            del pending[res.request_id]
                        done.put_nowait(res)
                self._notify()
                if out.duration_s == 0:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the engine: fail loudly, not silently
            log.exception("engine loop failed")
            self._driver_error = exc
            for rid in list(self._pending):
                self._fail(rid, f"engine loop failed: {exc!r}", "engine_error")

    def _void(self, out: StepOutput, results: list[FinishedRequest | RejectedRequest],
              owners: dict[str, asyncio.Queue[_Item]]) -> None:
        """A crash came while ``out``'s step ran: the crash failed what was still in the
        engine, but what the step retired (finished or refused) had left it, and its
        answer never leaves the node either: it fails too, and the step's tokens go
        nowhere (the simulator's driver does the same, ``SimCluster._step_done``)."""
        self._voided += len(out.finished)
        for res in results:
            rid = res.request_id
            queue = owners.get(rid)
            if queue is not None and self._pending.get(rid) is queue:
                self._fail(rid, "the engine crashed", "engine_crashed")
        self._notify()

    async def _idle(self) -> None:
        self._wake.clear()
        timer = self.engine.next_timer_at()
        if timer is None:
            await self._wake.wait()
            return
        delay = self._t0 + timer / self.config.speedup - time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(delay, 0.0)):
                await self._wake.wait()
                return
        self._vnow = max(self._vnow, timer)

    def _drain_events(self, now: float) -> None:
        events: list[KvEvent] = self.engine.take_events()
        if not events:
            return
        self._notify()
        self.evictions.add(events, now)
        if self._publisher is not None:
            wire = to_wire_events(events)
            if wire:
                self._publisher.publish(wire, time.time())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait (bounded) until `predicate()` holds; re-checked after every engine change."""
        async with asyncio.timeout(timeout):
            while True:
                changed = self._changed
                if predicate():
                    return
                await changed.wait()

    def _fail(self, rid: str, message: str, code: str) -> None:
        queue = self._pending.pop(rid, None)
        if queue is not None:
            queue.put_nowait(_Failed(message, code))

    def metrics(self) -> EngineMetrics:
        """The engine's counters as this node's clients see them. The engine counts a
        request finished when it plans the step that ends it; until the step has been
        slept out it is not answered, and a crash meanwhile fails it: counted finished
        only once answered, a counter never goes down (Prometheus reads a drop as a
        reset)."""
        m = self.engine.metrics()
        unanswered = self._answering + self._voided
        if not unanswered:
            return m
        return replace(m, num_requests_finished=m.num_requests_finished - unanswered,
                       num_requests_failed=m.num_requests_failed + self._voided)

    # -------------------------------------------------------------- faults
    @property
    def healthy(self) -> bool:
        return not self.engine.faults.crashed and self._driver_error is None

    def apply_fault(self, spec: FaultSpec) -> None:
        """Apply one fault action now (see server_config.py for the vocabulary)."""
        now = self.now()
        if spec.action == "crash":
            self._crashes += 1
            for rid in self.engine.crash(now):
                self._fail(rid, "the engine crashed", "engine_crashed")
        elif spec.action == "slow":
            self.engine.slow(spec.factor)
        elif spec.action == "reject":
            self.engine.reject_all(spec.on)
        elif spec.action == "mass_evict":
            # a share of the cache, not of the pool, announced whatever its size
            self.engine.flush(spec.fraction, now, spec.reason)
        elif spec.action == "recover":
            self.engine.recover(now)
            self.wire_faults.heal()
        else:
            self.wire_faults.arm(spec)
        self._drain_events(now)
        self._wake.set()
        self._fault_changed.set()
        self._notify()

    def fault_state(self) -> dict[str, Any]:
        f = self.engine.faults
        return {"crashed": f.crashed, "slow_factor": f.slow_factor, "reject_all": f.reject_all,
                **self.wire_faults.as_json()}

    # ------------------------------------------------------------ the app
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[_http_errors])
        expect = expect_handler(self.config.max_body_bytes)  # 417 / 413 as JSON, then 100
        get = partial(app.router.add_get, expect_handler=expect)  # GETs: the same JSON 417
        app.router.add_post("/v1/completions", self._completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self._chat, expect_handler=expect)
        get("/v1/models", self._models)
        get("/health", self._health)
        get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize, expect_handler=expect)
        get("/kvgate/evictions", self._evictions)
        get("/kv_event_sources", self._kv_event_sources)
        app.router.add_post("/admin/fault", self._admin_fault, expect_handler=expect)
        get("/admin/fault", self._admin_state)
        return app

    async def _read_json(self, request: web.Request) -> bytes:
        try:
            # bounded: a body that trickles in, or never comes, held the connection for good
            return await read_body_within(request, self.config.body_timeout_s, _body_timed_out)
        except web.HTTPRequestEntityTooLarge:
            raise RequestTooLargeError(
                f"Request body is larger than {self.config.max_body_bytes} bytes.",
                code="request_too_large") from None
        except web.RequestPayloadError:
            # a gzip/deflate body that does not decode, a broken chunked framing: the
            # client's fault, a 400 (aiohttp's own text may quote the client's bytes)
            raise ProtocolError("The request body could not be read as sent "
                                "(Content-Encoding or framing).", code="invalid_body") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _request_id(self, request: web.Request, kind: str) -> str:
        """The client's X-Request-Id (vLLM-prefixed) if usable and not in flight, else a
        fresh one. Claimed by the submission that follows with no await between (an id
        found free could otherwise be taken twice)."""
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        given = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        if given is not None:
            rid = given if given.startswith(prefix) else prefix + given
            if rid not in self._pending and self.engine.request_status(rid) is None:
                return rid
        return prefix + uuid.uuid4().hex

    async def _generate(self, request: web.Request,
                        kind: Literal["completion", "chat"]) -> web.StreamResponse:
        cfg = self.config
        try:
            gen = parse_generate(
                kind, await self._read_json(request), tokens=self._tokens, model=cfg.model,
                max_model_len=self.max_model_len, max_body_bytes=cfg.max_body_bytes,
                default_max_tokens=(cfg.default_max_tokens_chat if kind == "chat"
                                    else cfg.default_max_tokens_completion))
        except ProtocolError as exc:
            return _json(exc.http_status, exc.body())
        parsed, max_tokens = gen.request, gen.max_tokens
        if self.wire_faults.reset_connection.take() is not None:
            return await self._reset(request)
        delay = self.wire_faults.slow_first_byte.take()
        if delay:
            await asyncio.sleep(delay)
        # no await from here to the queue's registration: the id is ours once picked
        rid = self._request_id(request, kind)
        headers = {REQUEST_ID_HEADER: rid}
        decision = self._submit(rid, gen.tokens, max_tokens, parsed.priority or 0)
        if decision.rejected:
            assert decision.reject_kind is not None
            return _reject_response(decision.reject_kind, decision.reason, headers)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._pending[rid] = queue
        self.timer.arrived(rid, self.now(), max_tokens)
        self._wake.set()
        self._notify()
        shape = ResponseShape(kind=kind, request_id=rid, model=self.config.model,
                              created=int(time.time()))
        try:
            if parsed.stream:
                return await self._stream(request, queue, shape, max_tokens,
                                          parsed.include_usage, headers)
            return await self._unary(queue, shape, headers)
        finally:
            # client gone or mid-stream fault: abort, if the id is still ours. Once the
            # engine has finished it (the queue was taken out of _pending), a new request
            # may hold the id while we still write to a slow client.
            if self._pending.get(rid) is queue:
                del self._pending[rid]
                self.engine.abort(rid, self.now())
                self._notify()
            if rid not in self._pending:  # ended, one way or another: no timing left
                self.timer.forget(rid)

    def _submit(self, rid: str, tokens: SimTokens, max_tokens: int,
                priority: int) -> NodeAdmission:
        if self._driver_error is not None:  # nobody would step the engine
            return NodeAdmission.reject(RejectKind.RETRY_ELSEWHERE, "engine loop failed")
        now = self.now()
        req = EngineRequest(request_id=rid, prompt_tokens=tokens.num_tokens,
                            block_hashes=tokens.block_hashes, token_ids=tokens.token_ids,
                            max_tokens=max_tokens, priority=priority, arrival=now,
                            cache_salt=tokens.cache_salt)
        decision = self.engine.submit(req, now)
        self._drain_events(now)
        return decision

    async def _reset(self, request: web.Request) -> web.StreamResponse:
        """Fault: reset the TCP connection (RST) before any byte of the response."""
        if request.transport is not None:
            reset_transport(request.transport)
        await asyncio.sleep(5)  # handler_cancellation cancels us as the connection drops
        raise web.HTTPServiceUnavailable()  # pragma: no cover - only if no cancellation came

    async def _unary(self, queue: asyncio.Queue[_Item], shape: ResponseShape,
                     headers: dict[str, str]) -> web.StreamResponse:
        texts: list[str] = []
        while True:
            item = await queue.get()
            if isinstance(item, int):
                texts += generated_text(shape.request_id, len(texts), item)
            elif isinstance(item, FinishedRequest):
                return _json(200, shape.full_body("".join(texts), item), headers)
            elif isinstance(item, RejectedRequest):
                return _reject_response(item.reject_kind, item.reason, headers)
            else:
                return _json(503, overloaded_body(item.message, code=item.code),
                             {**headers, REJECT_HEADER: RejectKind.RETRY_ELSEWHERE.value})

    async def _stream(self, request: web.Request, queue: asyncio.Queue[_Item],
                      shape: ResponseShape, max_tokens: int, include_usage: bool,
                      headers: dict[str, str]) -> web.StreamResponse:
        item = await queue.get()  # headers go out with the first token, not before
        if isinstance(item, RejectedRequest):
            return _reject_response(item.reject_kind, item.reason, headers)
        if isinstance(item, _Failed):
            return _json(503, overloaded_body(item.message, code=item.code),
                         {**headers, REJECT_HEADER: RejectKind.RETRY_ELSEWHERE.value})
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        break_after = self.wire_faults.midstream_error.take()
        sent = 0
        buf = bytearray()
        first = shape.first_chunk()
        if first is not None:
            buf += encode_json_event(first)
        try:
            await resp.prepare(request)
            while True:
                if isinstance(item, int):
                    for text in generated_text(shape.request_id, sent, item):
                        sent += 1
                        buf += encode_json_event(shape.token_chunk(text, sent >= max_tokens))
                        if break_after is not None and sent >= break_after:
                            buf += error_event("injected mid-stream error", code="midstream_error")
                            await resp.write(bytes(buf))
                            return resp
                elif isinstance(item, FinishedRequest):
                    if include_usage:
                        buf += encode_json_event(shape.usage_chunk(item))
                    buf += DONE_EVENT
                    await resp.write(bytes(buf))
                    await resp.write_eof()
                    return resp
                else:
                    message = item.message if isinstance(item, _Failed) else item.reason
                    code = item.code if isinstance(item, _Failed) else item.reject_kind.value
                    buf += error_event(message, code=code)
                    await resp.write(bytes(buf))
                    return resp
                await resp.write(bytes(buf))
                buf.clear()
                item = await queue.get()
        except ConnectionError:  # the client went away mid-write; `finally` aborts
            return resp

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return _json(200, models_body(self.config.model, self.max_model_len, self._created))

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.healthy:
            return web.Response(status=200)
        reason = "engine crashed" if self.engine.faults.crashed else "engine loop failed"
        return _json(503, overloaded_body(reason, code="unhealthy"))

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        extra: dict[str, tuple[str, int]] = {}
        if self._publisher is not None:
            extra["kvgate:kv_event_batches"] = ("KV-event batches published.",
                                                self._publisher.encoder.seq)
        text = render_metrics(self.metrics(), model=self.config.model,
                              extra_counters=extra, started_at=self._started_at,
                              timer=self.timer)
        return web.Response(body=text.encode("utf-8"),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        """vLLM ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> count and ids."""
        try:
            body = await self._read_json(request)
            obj = parse_json_object(body, max_body_bytes=self.config.max_body_bytes)
            # validated first (a model that is no string is a 400), then the model named
            # (404), as the generation routes do. vLLM tokenizes any length here (no
            # max_model_len check), off the event loop: a 16 MB prompt takes the
            # simulated tokenizer over a second, which would stall every stream
            tokenize = partial(tokenize_body, body, obj, self._tokens, self.config.model)
            if len(body) > _INLINE_TOKENIZE_BYTES:
                tokens = await asyncio.get_running_loop().run_in_executor(None, tokenize)
            else:
                tokens = tokenize()
        except ProtocolError as exc:
            return _json(exc.http_status, exc.body())
        model = obj.get("model")
        if model is not None and model != self.config.model:
            return _json(404, not_found_body(model))
        return _json(200, {"count": tokens.num_tokens, "max_model_len": self.max_model_len,
                           "tokens": list(tokens.token_ids)})

    async def _evictions(self, request: web.Request) -> web.StreamResponse:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _json(400, invalid_request_body("'since' must be an integer", param="since"))
        return _json(200, self.evictions.page(since, now=self.now(), speedup=self.config.speedup,
                                              node_id=self.node_id))

    async def _kv_event_sources(self, request: web.Request) -> web.StreamResponse:
        """vLLM 0.33's discovery endpoint: ``{dp_rank: KVEventsConfig}``."""
        if self._publisher is None:
            return _json(200, {})
        return _json(200, {"0": {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": self._publisher.endpoint, "replay_endpoint": None,
            "topic": self.config.kv_events_topic,
        }})

    async def _admin_fault(self, request: web.Request) -> web.StreamResponse:
        try:
            obj = parse_json_object(await self._read_json(request))
            spec = FaultSpec.from_json(obj)
        except ProtocolError as exc:
            return _json(exc.http_status, exc.body())
        except ValueError as exc:  # an unknown action, or FaultParamError naming the param
            return _json(400, invalid_request_body(str(exc),
                                                   param=getattr(exc, "param", "action")))
        self.apply_fault(spec)
        return _json(200, {"ok": True, "faults": self.fault_state()})

    async def _admin_state(self, request: web.Request) -> web.StreamResponse:
        return _json(200, {"faults": self.fault_state()})


async def start_engine_server(config: EngineServerConfig) -> EngineServer:
    """Build, bind and start a server (``config.port=0`` picks a free port)."""
    server = EngineServer(config)
    await server.start()
    return server


async def _serve(config: EngineServerConfig) -> int:
    try:
        server = await start_engine_server(config)
    except (ValueError, OSError, zmq.ZMQError) as exc:  # bad settings, port in use
        print(f"kvgate engine: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    events = f", KV events on {server.kv_events_endpoint}" if server.kv_events_endpoint else ""
    print(f"kvgate engine {config.model!r} ({server.node_id}) serving on {server.url}"
          f"{events}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0


def run_engine(args: Any) -> int:
    """`kvgate engine ...`: serve until SIGINT/SIGTERM, then exit cleanly (0)."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvgate engine: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # optional: faster, same behaviour
    except ImportError:
        return asyncio.run(_serve(config))
    return uvloop.run(_serve(config))
