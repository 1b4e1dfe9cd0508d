"""Carry a request through admission, the node attempts and back to the client.

The loop over decisions (:meth:`Relay.run`)::

    admit ─► Reject / Fail ─────────────────────────► error response (no retry)
          └► Dispatch ─► attempt ─► 2xx ─► relay ────► on_finished(cached_tokens)
                                 └► failure before the first byte ─► on_failed
                                    (or aborted: its node was marked down, NODE_DOWN)
                                       └► Dispatch (the one retry) ─► attempt ...
                                       └► Fail / Reject ─► error response

"First byte" is the first data event of a stream (``data:``; comment blocks such
as ``: keep-alive`` are not): the client has seen nothing before it, the attempt
stays abortable (its node marked down: NODE_DOWN, retried elsewhere) until it,
and ``on_first_byte`` feeds the P0 TTFT SLO and the TTFT metrics from it. The
client's response (status and headers) starts with it, so comments sent before it
are dropped; comments after it are forwarded. A non-streamed answer has no such
moment; a failure while reading it is reported as after the first byte (work was
done, no retry). After the first byte of a stream a failure ends it with an
OpenAI error event and ``data: [DONE]``.

An engine's error answer (>= 400) whose body is a JSON object is passed through.
One with no body or a body that is not JSON (an HTML page from a proxy) gets an
OpenAI-shaped body of ours: a 4xx (not 429) keeps the engine's status with an
``invalid_request_error`` and ``x-should-retry: false``; anything else is
answered as a failed attempt (502/503 with Retry-After).

Every admitted request ends in exactly one terminal core call: ``on_finished``,
a final ``on_failed`` or, from the ``finally`` of :meth:`Relay.run`, ``on_cancelled``
(client gone, or any error of ours). The upstream response is released when it was
read to the end and closed otherwise, which aborts the request at the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.core.admission import FailureKind, Rejected, shutting_down_rejection
from kvgate.core.decisions import Decision, Dispatch, Fail, Reject
from kvgate.core.errors import InvariantViolation
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.edge import REQUEST_ID_HEADER, LogEvery, json_response, reset_transport
from kvgate.gateway.driver import Driver
from kvgate.gateway.errors import (
    ANSWERED,
    CLIENT_GONE,
    NODE_HEADER,
    REASON_HEADER,
    SHOULD_RETRY_HEADER,
    fail_response,
    reject_response,
)
from kvgate.gateway.metrics_text import GatewayMetrics
from kvgate.gateway.node_watcher import NodeWatcher
from kvgate.gateway.upstream import (
    Upstream,
    UpstreamResponse,
    classify_exception,
    classify_status,
)
from kvgate.protocol import (
    DONE_EVENT,
    ProtocolError,
    SSEParser,
    error_event,
    error_status,
    invalid_request_body,
    is_error_chunk,
    is_usage_only_chunk,
    parse_usage,
    server_error_body,
    usage_of_body,
)

log = logging.getLogger("kvgate.gateway")
# a chunk that may carry a usage object: older SGLang writes "usage": null into every
# token chunk, which is not worth parsing
_USAGE_OBJECT = re.compile(r'"usage"\s*:\s*\{')

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an engine's error body passed through
FAST_WRITE_MAX = 16 * 1024  # a write this small to an empty send buffer never blocks
UNARY_CHUNK = 64 * 1024  # a whole answer is written in writes this large, each bounded


@dataclass(slots=True)
class Flight:
    """One client request on its way through the gateway."""

    rid: RequestId  # the core's id (ours, unique)
    client_rid: str  # X-Request-Id forwarded to the node and echoed
    path: str
    body: bytes  # what is sent upstream
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk itself
    headers: dict[str, str]
    priority: int = 1  # P2 attempts are preemptible
    done: bool = False  # the core has seen this request's terminal event
    node: NodeId | None = None
    reason: str = ""
    response: web.StreamResponse | None = None  # the client's stream, once it began
    shutting_down: bool = False  # its stream was ended because the gateway stops


class StreamFilter:
    """SSE events in, bytes to forward out; takes the usage chunk's cached_tokens and
    drops that chunk when the gateway (not the client) asked for it.

    ``started`` turns true at the first data event (the stream's first byte); comment
    blocks (``: keep-alive``) before it are dropped, after it forwarded."""

    __slots__ = (
        "_parser",
        "cached",
        "done",
        "error_status",
        "saw_error",
        "started",
        "usage_seen",
        "wants_usage",
    )

    def __init__(self, wants_usage: bool) -> None:
        self._parser = SSEParser(comments=True)
        self.wants_usage = wants_usage
        self.cached: int | None = None
        self.usage_seen = False  # a usage came, with or without its cached tokens
        self.done = False
        self.saw_error = False
        self.error_status: int | None = None  # the HTTP status the error event states
        self.started = False

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        for ev in self._parser.feed(chunk):
            if self.done:
                continue
            if ev.comment:
                if self.started:
                    out.append(ev.raw)
                continue
            self.started = True
            if ev.is_done:
                self.done = True
                out.append(ev.raw)
                continue
            data = ev.data
            if ('"usage"' in data and _USAGE_OBJECT.search(data)) or '"error"' in data:
                obj = ev.json()
                if obj is not None:
                    if is_error_chunk(obj):
                        self.saw_error = True
                        self.error_status = error_status(obj)
                    usage = parse_usage(obj)
                    if usage is not None:
                        self.usage_seen = True
                        if usage.cached_tokens is not None:
                            self.cached = usage.cached_tokens
                    if not self.wants_usage and is_usage_only_chunk(obj):
                        continue
            out.append(ev.raw)
        return b"".join(out)


class Relay:
    def __init__(
        self,
        driver: Driver,
        watcher: NodeWatcher,
        upstream: Upstream,
        metrics: GatewayMetrics,
        *,
        route_headers: bool,
    ) -> None:
        self.driver = driver
        self.watcher = watcher
        self.upstream = upstream
        self.metrics = metrics
        self.route_headers = route_headers
        self.max_response_bytes = upstream.config.max_response_bytes
        # a stream is idle on either side past this: the node sends nothing, or the
        # client takes nothing (it stopped reading but keeps the connection open); a
        # whole answer's writes are bounded by it too
        self.write_timeout_s = upstream.config.stream_idle_timeout_s
        # keep-alive comments reset the idle timer: this bounds the wait for real data
        self.first_event_timeout_s = upstream.config.first_event_timeout_s
        # the streams being relayed, with their node's response: what end_streams() ends
        self._streams: dict[RequestId, tuple[Flight, UpstreamResponse]] = {}
        self._stopping = False  # end_streams() ran: unanswered attempts end as refused
        # clients that stop reading their stream: a client can cause these lines
        self._stalled_log = LogEvery(log)

    def end_streams(self) -> int:
        """The gateway stops: every stream still relayed ends now with an error event
        coded ``shutting_down`` and ``[DONE]`` (closing its node's response aborts the
        node's work), instead of being cut mid-event when its handler is cancelled, and
        every attempt still waiting for its first byte is answered 503 shutting_down
        (it was closed without an answer). Returns how many."""
        self._stopping = True
        # attempts still waiting for their node's first byte: the client has seen
        # nothing and may send the request elsewhere (answered 503 shutting_down)
        waiting = self.driver.abort_all_unanswered()
        streams = list(self._streams.values())
        for flight, resp in streams:
            flight.shutting_down = True
            # wake the relay waiting on the node's next chunk (closing the connection
            # alone does not reach a reader the client detached)
            resp.content.set_exception(aiohttp.ClientConnectionError("gateway stopping"))
            resp.close()
        return len(streams) + waiting

    def stopping(self) -> bool:
        """Whether end_streams() has run (read anew after each await)."""
        return self._stopping

    def _refused_stopping(self, flight: Flight) -> Reject:
        """The gateway stops: the request is forgotten (its node is not blamed) and
        answered 503 shutting_down, which the client may send elsewhere."""
        self.driver.cancel(flight.rid)
        return Reject(request_id=flight.rid, rejected=shutting_down_rejection(flight.rid))

    async def run(
        self, request: web.Request, flight: Flight, arrived: RequestArrived
    ) -> web.StreamResponse:
        try:
            return await self._deliver(request, await self._answer(request, flight, arrived))
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            if ANSWERED not in request:  # not after its whole answer: that is no loss
                self.metrics.client_disconnects += 1
            raise
        finally:
            if not flight.done:
                flight.done = True
                self.driver.cancel(flight.rid)
            elif flight.priority == 2:  # a preemption that landed after the answer ended
                self.driver.take_preempted(flight.rid)

    async def _answer(
        self, request: web.Request, flight: Flight, arrived: RequestArrived
    ) -> web.StreamResponse:
        """Admission, the attempts and their retry: the client's answer (a stream has
        been relayed already, anything else is still to be written)."""
        decision = await self.driver.admit(arrived)
        while True:
            if isinstance(decision, Reject):
                flight.done = True
                headers = self._headers(flight)
                if flight.node is not None:  # the retry found no node: name the failed one
                    headers[NODE_HEADER] = flight.node
                return reject_response(decision.rejected, headers)
            if isinstance(decision, Fail):
                flight.done = True
                return fail_response(decision, {REQUEST_ID_HEADER: flight.client_rid})
            if not isinstance(decision, Dispatch):
                raise InvariantViolation(f"unexpected decision {decision!r}")
            result = await self._attempt(request, flight, decision)
            if isinstance(result, web.StreamResponse):
                return result
            decision = result

    async def _deliver(
        self, request: web.Request, resp: web.StreamResponse
    ) -> web.StreamResponse:
        """Write a whole (not streamed) answer, each write bounded as a stream's are
        (``stream_idle_timeout_s``): left to aiohttp, it waits without end for a client
        that reads none of it, holding the connection and the answer (up to
        ``max_response_bytes``). Such a client is dropped (a reset) and counted as gone."""
        if resp.prepared or not isinstance(resp, web.Response):
            return resp  # a stream: written already
        body = resp.body
        if not isinstance(body, bytes):
            return resp
        out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=resp.headers)
        out.content_length = len(body)
        send = _ClientWriter(request, out, self.write_timeout_s, self._stalled_log)
        try:
            await out.prepare(request)
            for start in range(0, len(body), UNARY_CHUNK):
                await send(body[start:start + UNARY_CHUNK])
            await send(None)
        except ConnectionResetError:  # the client is gone, or took nothing: a 499
            self.metrics.client_disconnects += 1
            request[CLIENT_GONE] = True
            return out
        request[ANSWERED] = out.status
        return out

    def _headers(self, flight: Flight) -> dict[str, str]:
        # nosniff: a browser takes the answer as the JSON or event stream it is labelled
        headers = {REQUEST_ID_HEADER: flight.client_rid, "X-Content-Type-Options": "nosniff"}
        if self.route_headers and flight.node is not None:
            headers[NODE_HEADER] = flight.node
            headers[REASON_HEADER] = flight.reason
        return headers

    def _next(self, flight: Flight, kind: FailureKind, *, before_first_byte: bool = True
              ) -> Decision:
        """Report a failed attempt; the request's next decision (the core's retry rule
        never retries after the first byte)."""
        d = self.driver.failed(flight.rid, kind, before_first_byte=before_first_byte)
        if d is None:  # the core no longer knows the request: nothing to retry
            flight.done = True
            return Fail(request_id=flight.rid, reason=kind.value, node_id=flight.node)
        return d

    async def _attempt(
        self, request: web.Request, flight: Flight, dispatch: Dispatch
    ) -> web.StreamResponse | Decision:
        """One attempt; the core may preempt it (P2 only) from send to the answer's end:
        the driver then expires ``scope``, the upstream response is closed (which
        aborts the engine's work) and the client is told."""
        if flight.priority != 2:
            return await self._attempt_once(request, flight, dispatch)
        rejected = self.driver.take_preempted(flight.rid)
        if rejected is not None:  # preempted with (or before) its Dispatch: never sent
            return await self._preempted(request, flight, rejected)
        scope = asyncio.timeout(None)
        try:
            async with scope:
                self.driver.preemptible(flight.rid, scope)
                try:
                    return await self._attempt_once(request, flight, dispatch)
                finally:
                    self.driver.unpreemptible(flight.rid)
        except TimeoutError:
            rejected = self.driver.take_preempted(flight.rid)
            if rejected is None or not scope.expired():
                raise
            if flight.done and flight.response is not None:
                # the answer had reached its end (the core no longer knew the request)
                # before the preemption landed: nothing more goes to the client
                return flight.response
            return await self._preempted(request, flight, rejected)

    async def _preempted(
        self, request: web.Request, flight: Flight, rejected: Rejected
    ) -> web.StreamResponse:
        """The core ended this P2 request (its credit is already given back): 503 with
        Retry-After if the client has seen nothing, else an error event ends the stream."""
        flight.done = True
        out = flight.response
        if out is None or not out.prepared:
            return reject_response(rejected, self._headers(flight))
        send = _ClientWriter(request, out, self.write_timeout_s, self._stalled_log)
        try:
            await send(error_event(rejected.message, code=rejected.reason.value))
            await send(None)
        except ConnectionResetError:  # the client is gone as well
            self.metrics.client_disconnects += 1
            request[CLIENT_GONE] = True
        return out

    async def _attempt_once(
        self, request: web.Request, flight: Flight, dispatch: Dispatch
    ) -> web.StreamResponse | Decision:
        flight.node = dispatch.node_id
        flight.reason = dispatch.route.reason.value
        if self.stopping():  # past the stop's deadline (a retry, a late admission)
            return self._refused_stopping(flight)
        rt = self.watcher.get(dispatch.node_id)
        if rt is None:  # removed between the decision and now: nothing is sent (nor
            # counted, which would bring back the removed node's attempts series)
            return self._next(flight, FailureKind.CONNECT_ERROR)
        self.metrics.attempts[dispatch.node_id] += 1
        headers = {**flight.headers, **rt.headers} if rt.headers else flight.headers
        resp: UpstreamResponse | None = None
        first = b""
        filt: StreamFilter | None = None
        # Until the answer starts (headers; a stream's first data event) the driver may
        # abort the attempt through this handle: its node was marked down, e.g. a hung
        # engine (or one that only sends keep-alive comments).
        guard = asyncio.timeout(None)
        try:
            async with guard:
                self.driver.guard(flight.rid, dispatch.node_id, guard)
                try:
                    resp = await self.upstream.post(
                        self.upstream.url(rt.url, flight.path), flight.body, headers,
                        stream=flight.stream,
                    )
                    if (resp.status < 300 and flight.stream
                            and resp.content_type == "text/event-stream"):
                        filt = StreamFilter(flight.wants_usage)
                        async with asyncio.timeout(self.first_event_timeout_s):
                            first = await _first_event(resp.content, filt)
                finally:
                    self.driver.unguard(flight.rid)
        except ProtocolError:  # an oversized event before the first: the engine misbehaves
            if resp is not None:
                resp.close()
            return self._next(flight, FailureKind.UPSTREAM_ERROR)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if resp is not None:
                resp.close()
            if guard.expired() and self.stopping():  # ended by end_streams(), not the node
                return self._refused_stopping(flight)
            return self._next(
                flight, FailureKind.NODE_DOWN if guard.expired() else classify_exception(exc)
            )
        except BaseException:  # the client went away
            if resp is not None:
                resp.close()
            raise
        clean = False
        try:
            if resp.status >= 300:
                result = await self._upstream_error(flight, resp)
            elif filt is not None:
                result = await self._relay_stream(request, flight, resp, filt, first)
            else:
                result = await self._relay_unary(flight, resp)
            clean = resp.content.at_eof()
            return result
        finally:
            if clean:
                resp.release()
            else:
                resp.close()  # aborts the engine's work on this request

    async def _upstream_error(
        self, flight: Flight, resp: UpstreamResponse
    ) -> web.StreamResponse | Decision:
        kind = classify_status(resp.status, resp.headers)
        try:
            async with asyncio.timeout(self.upstream.config.connect_timeout_s):
                body, complete = await _read_limited(resp.content, ERROR_BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, OSError):
            body, complete = b"", False
        decision = self._next(flight, kind)
        if not (isinstance(decision, Fail) and kind in (
            FailureKind.CLIENT_ERROR, FailureKind.RATE_LIMITED, FailureKind.UPSTREAM_ERROR
        ) and resp.status >= 400):  # a 3xx (no Location passed) is our 502
            return decision
        client_error = kind is FailureKind.CLIENT_ERROR
        node = decision.node_id or flight.node or ""
        headers = self._headers(flight)
        headers[NODE_HEADER] = node
        if client_error:  # the request itself is bad: resending it is no use
            headers[SHOULD_RETRY_HEADER] = "false"
        if body and complete and _is_error_body(body):  # the engine's own, passed through
            flight.done = True
            # JSON, whatever the node called it: an engine's text/html must not become a
            # page of the gateway's origin
            headers["Content-Type"] = "application/json"
            if resp.status in (429, 503):  # the client's back-off hint: the node's, or ours
                headers["Retry-After"] = _node_retry_after(resp.headers.get("Retry-After"))
            return web.Response(status=resp.status, body=body, headers=headers)
        if body and not complete:  # its first ERROR_BODY_LIMIT bytes would be broken JSON
            flight.done = True
            return json_response(resp.status, _cut_error_body(resp.status, kind), headers)
        if client_error:  # no body, or not JSON (an HTML page): ours, OpenAI-shaped
            flight.done = True
            return json_response(resp.status, _engine_refusal_body(resp.status, node, kind),
                                 headers)
        # a 5xx or 429 with no usable body: answered as the failed attempt it is
        # (502/503, Retry-After; fail_response builds the OpenAI-shaped body)
        return decision

    async def _relay_unary(
        self, flight: Flight, resp: UpstreamResponse
    ) -> web.StreamResponse | Decision:
        # No on_first_byte here: a non-streamed answer arrives whole, and its latency
        # is not a time to first token (it would skew the P0 TTFT SLO loop).
        try:
            body, complete = await _read_limited(resp.content, self.max_response_bytes)
            if not complete:
                raise aiohttp.ClientPayloadError("response too large")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return self._next(flight, classify_exception(exc), before_first_byte=False)
        is_json = resp.content_type == "application/json"
        usage = usage_of_body(body) if is_json else None
        flight.done = True
        self.driver.finish(flight.rid, usage.cached_tokens if usage else None,
                           usage_seen=usage is not None)
        headers = self._headers(flight)
        # the node's own type only when it says JSON (its text/html would be a page of
        # the gateway's origin)
        headers["Content-Type"] = (resp.headers.get("Content-Type", "application/json")
                                   if is_json else "application/json")
        return web.Response(status=resp.status, body=body, headers=headers)

    async def _relay_stream(
        self, request: web.Request, flight: Flight, resp: UpstreamResponse,
        filt: StreamFilter, data: bytes,
    ) -> web.StreamResponse | Decision:
        """``data``: what ``filt`` gave for the chunks up to the first data event."""
        content = resp.content
        if not filt.started:  # the stream ended before its first data event
            return self._next(flight, FailureKind.UPSTREAM_ERROR)
        self.driver.first_byte(flight.rid)
        headers = self._headers(flight)
        headers["Content-Type"] = resp.headers.get("Content-Type", "text/event-stream")
        headers["Cache-Control"] = "no-cache"
        out = flight.response = web.StreamResponse(status=200, headers=headers)
        self._streams[flight.rid] = (flight, resp)
        try:
            await self._pump(request, flight, content, filt, data, out)
        except ConnectionResetError:  # the client went away; run() forgets the request
            self.metrics.client_disconnects += 1
            request[CLIENT_GONE] = True  # a 499, however the disconnect was noticed
        finally:
            self._streams.pop(flight.rid, None)
        return out  # already prepared: aiohttp only finishes it

    async def _pump(self, request: web.Request, flight: Flight, content: aiohttp.StreamReader,
                    filt: StreamFilter, data: bytes, out: web.StreamResponse) -> None:
        await out.prepare(request)
        send = _ClientWriter(request, out, self.write_timeout_s, self._stalled_log)
        failure: FailureKind | None = None
        while True:
            if data:
                await send(data)
            if filt.done:
                break
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                failure = classify_exception(exc)
                break
            if not chunk:  # EOF without [DONE]
                failure = FailureKind.UPSTREAM_ERROR
                break
            try:
                data = filt.feed(chunk)
            except ProtocolError:  # an oversized event: the engine misbehaves
                failure = FailureKind.UPSTREAM_ERROR
                break
        flight.done = True
        if flight.shutting_down:  # ended by end_streams(): the node did nothing wrong
            self.driver.cancel(flight.rid)
            if not filt.done:
                refused = shutting_down_rejection(flight.rid)
                await send(error_event(refused.message, code=refused.reason.value))
        elif failure is None and not filt.saw_error:
            self.driver.finish(flight.rid, filt.cached, usage_seen=filt.usage_seen)
        else:
            self._next(flight, failure or _stream_error_kind(filt), before_first_byte=False)
            if not filt.done:
                if filt.saw_error:  # the engine's error event went out already
                    await send(DONE_EVENT)
                else:
                    kind = failure or FailureKind.UPSTREAM_ERROR
                    what = (f"sent nothing for {self.write_timeout_s:g} s"
                            if kind is FailureKind.TIMEOUT else "failed during generation")
                    await send(error_event(
                        f"The inference node {flight.node} {what}.", code=kind.value,
                    ))
        await send(None)  # the end
        request[ANSWERED] = out.status
        if filt.done and not content.at_eof():
            # Read the chunked terminator so the connection goes back to the pool.
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with asyncio.timeout(0.1):
                    await _read_limited(content, ERROR_BODY_LIMIT)


async def _first_event(content: aiohttp.StreamReader, filt: StreamFilter) -> bytes:
    """Read until ``filt`` has seen the stream's first data event (or the end); what it
    gives to forward. Comment blocks before it (keep-alives during a long prefill) are
    no first byte: they are dropped and the attempt stays retryable until the data."""
    while True:
        chunk = await content.readany()
        if not chunk:
            return b""
        data = filt.feed(chunk)
        if filt.started:
            return data


def _is_error_body(body: bytes) -> bool:
    """An error body in OpenAI's shape (or vLLM's older one), fit to pass on: a client
    reads ``error.message``; ``{"error": "Unauthorized"}`` or an HTML page it cannot."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (or UTF-16/32)
        return False
    return isinstance(obj, dict) and is_error_chunk(obj)


def _stream_error_kind(filt: StreamFilter) -> FailureKind:
    """What an engine's error event mid-stream says failed: the status it states read as
    an answer's status would be (vLLM streams a request it finds invalid only once
    generating: the client's own bad request, which must not eject the node nor open the
    breaker for every tenant); anything else after the first byte is the node's."""
    status = filt.error_status
    if status is not None and classify_status(status, {}) is FailureKind.CLIENT_ERROR:
        return FailureKind.CLIENT_ERROR
    return FailureKind.UPSTREAM_ERROR


def _engine_refusal_body(status: int, node: str | None, kind: FailureKind) -> dict[str, Any]:
    """Ours, for a node's 4xx with no body or a body that is not JSON."""
    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    message = (
        f"The inference node {node or ''} refused the request: HTTP {status}{phrase}, "
        "with no error message."
    )
    return invalid_request_body(message, code=kind.value)


def _cut_error_body(status: int, kind: FailureKind) -> dict[str, Any]:
    """Ours, for a node's error body too large to pass on whole."""
    message = (
        f"The inference node answered {status} with an error body over "
        f"{ERROR_BODY_LIMIT} bytes, not passed on."
    )
    if status < 500:
        return invalid_request_body(message, code=kind.value)
    return server_error_body(message, code=kind.value)


class _ClientWriter:
    """Writes to a response (a stream, or a whole answer in pieces), each bounded in
    time: a client that takes no byte for ``timeout_s`` is dropped (its connection
    aborted) and reported as gone with ``ConnectionResetError``, as one that closed its
    connection."""

    __slots__ = ("_out", "_request", "_stalled", "_timeout_s")

    def __init__(
        self, request: web.Request, out: web.StreamResponse, timeout_s: float, stalled: LogEvery
    ) -> None:
        self._stalled = stalled
        self._request = request
        self._out = out
        self._timeout_s = timeout_s

    async def __call__(self, data: bytes | None) -> None:
        """Write ``data``; ``None`` ends the response."""
        transport = self._request.transport
        if (data is not None and len(data) <= FAST_WRITE_MAX and transport is not None
                and not transport.get_write_buffer_size()):
            # Cannot block: the socket took all before, this chunk alone stays below the
            # transport's high-water mark. Spares a timer per token on the hot path.
            await self._out.write(data)
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                if data is None:
                    await self._out.write_eof()
                else:
                    await self._out.write(data)
        except TimeoutError:
            if transport is not None:
                # close() would wait for the client to read the buffer, then send a FIN
                # that reads as the end of a complete (truncated) answer
                reset_transport(transport)
            self._stalled.info("dropped a client that took no byte of its answer for "
                               "%g s (%s)", self._timeout_s, self._request.remote)
            raise ConnectionResetError("the client stopped reading its answer") from None


def _node_retry_after(value: str | None) -> str:
    """A node's Retry-After when it is whole seconds (at most a day), else 1 s: a date
    or garbage is not passed on."""
    seconds = (value or "").strip()
    # ASCII digits only: str.isdigit also takes "²", which int() refuses
    if seconds.isascii() and seconds.isdigit() and int(seconds) <= 86_400:
        return str(int(seconds))
    return "1"


async def _read_limited(content: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes; (data, True) if that was the whole body."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await content.read(65536)
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf[:limit]), False
