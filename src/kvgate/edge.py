"""The HTTP/1.1 connection below both apps (the gateway's and the simulated engine's):
aiohttp's ``RequestHandler`` with three fixes.

aiohttp answers what its parser rejects (an oversized header, a junk request line,
an unsupported Content-Encoding ...) itself, before any middleware runs: a text/plain
400 that quotes the client's bytes, plus an ERROR traceback in ``aiohttp.server``.
It has no timeout on a request head (a connection that sends nothing, or half a
head, is kept for aiohttp's hour-long keep-alive). And when a chunked body breaks
mid-way, its C parser drops the body without failing it, so the handler waits for
``body_timeout_s``. :class:`EdgeRequestHandler` (one per connection; built by
:class:`EdgeRunner` through :class:`EdgeServer`, aiohttp's own ``Server`` with its
protocol factory overridden) fixes all three:

* ``handle_error``: an OpenAI-shaped JSON error (431 oversized headers, 414 a
  too-long request line, 415 an unsupported Content-Encoding, else 400), no echo
  of the client's bytes, one INFO line instead of a traceback;
* header timeout: from connect, and again from the end of each response, a
  complete request head must arrive within ``server.header_timeout_s``, else the
  connection is closed (after a 408 if part of a head came). Disarmed while a
  request is handled, so long streams are untouched; it is also the idle
  keep-alive timeout;
* a parse error while a request's body is still being read fails that body
  (``RequestPayloadError``: the handler answers 400 at once); after the answer to a
  request whose body failed (that, a bad encoding, or a body timeout: see
  ``body.py``) the connection is closed, its framing being lost.

Beside it, what both apps answer alike: compact JSON responses (``json_response``),
aiohttp's own HTTP errors in OpenAI's shape (``http_exception_response``), and the
rule for a client's X-Request-Id (``client_request_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import (
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from kvgate.protocol import error_body, invalid_request_body, server_error_body

log = logging.getLogger("kvgate.gateway")


class LogEvery:
    """One log line per ``every_s`` at most, the next one saying how many were left out:
    the lines a client can cause (a connection with no complete head, a request the
    parser refuses) must not let it fill the log (100 such connections wrote 100 lines
    in one millisecond)."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._at = -float("inf")
        self._left_out = 0

    def info(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._at < self.every_s:
            self._left_out += 1
            return
        if self._left_out:
            msg += f" (and {self._left_out} more like it since the last one)"
        self._at, self._left_out = now, 0
        self.logger.info(msg, *args)




class EdgeLogs:
    """One server's lines a client can cause, each kind limited on its own."""

    def __init__(self) -> None:
        self.head_timeouts = LogEvery(log)
        self.parse_errors = LogEvery(log)

# Distinct limits so a LineTooLong says which was exceeded: the request line (URL,
# 414) or a header field (431). 8190 is aiohttp's default for both.
MAX_LINE_SIZE = 8192
MAX_FIELD_SIZE = 8190


def json_response(
    status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> web.Response:
    """A compact JSON response: how both apps (gateway and engine) answer."""
    return web.Response(
        status=status,
        body=json.dumps(body, separators=(",", ":")).encode("utf-8"),
        content_type="application/json",
        headers=headers,
    )


REQUEST_ID_HEADER = "X-Request-Id"
# A client's X-Request-Id is kept (echoed, forwarded, logged) only when it is at most
# this many characters of printable ASCII; otherwise the request gets a generated id.
MAX_REQUEST_ID_LEN = 128


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id if usable (see MAX_REQUEST_ID_LEN), else None: a header
    that is not valid UTF-8 (aiohttp hands it over with surrogate escapes), holds
    control characters or is too long gets a generated id, as no id at all does (vLLM
    takes any X-Request-Id and never refuses a request for it, so neither do we)."""
    if not value:
        return None
    value = value.strip()
    if not value or len(value) > MAX_REQUEST_ID_LEN:
        return None
    if not value.isascii() or not value.isprintable():
        return None
    return value


def http_exception_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's own HTTP errors (404 unknown URL, 405 method, 413 body too large ...)
    raise text/plain answers: the same error in OpenAI's JSON shape, for both apps."""
    status = exc.status
    headers: dict[str, str] = {}
    if status == 404:
        body = error_body("Unknown request URL. Please check the URL and method.",
                          "invalid_request_error", None, "unknown_url")
    elif status == 405:
        allow = exc.headers.get("Allow", "")
        body = error_body(f"Method not allowed. Allowed: {allow}.",
                          "invalid_request_error", None, "method_not_allowed")
        if allow:
            headers["Allow"] = allow
    elif status == 413:
        body = invalid_request_body("Request body too large.", code="request_too_large")
    elif status >= 500:
        body = server_error_body()
    else:
        body = error_body(exc.reason or "Bad request.", "invalid_request_error")
    return json_response(status, body, headers)


async def read_body_within(
    request: web.Request, timeout_s: float, timed_out: Callable[[], Exception]
) -> bytes:
    """The whole body, within ``timeout_s``; past it, the exception ``timed_out()`` makes
    fails the body and is raised. The rest of the body may still come: failed, its bytes
    are not read as the next request (the edge closes the connection after the answer).
    Both apps read bodies through it (the gateway's ``body.read_body``, the engine's)."""
    if request.content.is_eof():  # the whole body is in already: no timer needed
        return await request.read()
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError as exc:
        error = timed_out()
        request.content.set_exception(error)
        raise error from exc


# A route's own check before a client is invited to send its body: a response refuses it
ExpectCheck = Callable[[web.Request], "web.StreamResponse | None"]


def reset_transport(transport: asyncio.Transport) -> None:
    """Abort a connection with a TCP reset (RST), not a FIN: the kernel drops what it
    still buffers for the peer (up to megabytes) at once, and the peer sees an error,
    not an end that reads as a complete answer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # linger 0: close() resets the connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def expect_handler(
    max_body_bytes: int, check: ExpectCheck | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """An expect handler for a route that takes a body (aiohttp runs it before any
    middleware). aiohttp's own answers ``Expect: 100-continue`` with a 100 before any
    check, inviting a body certain to be refused (an unknown caller's, one past
    ``max_body_bytes``), and any other expectation with a text/plain 417 quoting it.
    Here: a JSON 417, a 413 past the limit, then ``check`` (the caller's identity),
    and only then the 100."""

    async def handle(request: web.Request) -> web.StreamResponse | None:
        refused: web.StreamResponse | None = None
        length = request.content_length
        if request.headers.get("Expect", "").lower() != "100-continue":
            refused = json_response(417, invalid_request_body(
                "Only 'Expect: 100-continue' is supported.", code="expectation_failed"))
        elif length is not None and length > max_body_bytes:
            refused = json_response(413, invalid_request_body(
                f"Request body is larger than {max_body_bytes} bytes.",
                code="request_too_large"))
        elif check is not None:
            refused = check(request)
        if refused is not None:
            # The client holds its body back until a 100 that will not come: the body is
            # failed, so the connection closes after this answer instead of waiting for
            # bytes that, if they came, must not be read as the next request.
            request.content.set_exception(web.HTTPExpectationFailed())
            return refused
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's: the answer has not begun
        return None

    return handle


def get_route_adder(
    router: web.UrlDispatcher, max_body_bytes: int
) -> Callable[..., web.AbstractRoute]:
    """``router.add_get`` whose routes answer an unknown ``Expect`` with our JSON 417
    (:func:`expect_handler`), not aiohttp's text/plain one quoting the header."""
    return partial(router.add_get, expect_handler=expect_handler(max_body_bytes))


def parse_error(exc: HttpProcessingError, line_limit: int = MAX_LINE_SIZE,
                field_limit: int = MAX_FIELD_SIZE) -> tuple[int, str, str]:
    """(status, message, code) for what aiohttp's parser rejected; our words only,
    since aiohttp's messages quote the client's bytes."""
    if isinstance(exc, ContentEncodingError):
        return (415, "Unsupported Content-Encoding: send the body as identity, gzip or "
                "deflate.", "unsupported_content_encoding")
    if isinstance(exc, LineTooLong):
        if line_limit != field_limit and len(exc.args) > 1 and exc.args[1] == line_limit:
            return 414, "Request URL too long.", "url_too_long"
        return 431, "Request header field too large.", "headers_too_large"
    if "too many headers" in str(exc).lower():
        return 431, "Too many request header fields.", "headers_too_large"
    if isinstance(exc, BadStatusLine):  # and BadHttpMethod
        return 400, "Malformed HTTP request line.", "malformed_request"
    if isinstance(exc, InvalidURLError):
        return 400, "Invalid request URL.", "malformed_request"
    if isinstance(exc, InvalidHeader):
        return 400, "Invalid HTTP header.", "malformed_request"
    return 400, "Malformed HTTP request.", "malformed_request"


def _timeout_408() -> bytes:
    body = json.dumps(invalid_request_body("Timed out reading the request headers.",
                                           code="request_timeout"),
                      separators=(",", ":")).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


TIMEOUT_408 = _timeout_408()


class EdgeRequestHandler(RequestHandler):
    """One client connection (see the module docstring)."""

    def __init__(
        self,
        manager: web.Server,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
        logs: EdgeLogs | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = header_timeout_s
        self._on_answer = on_answer  # told the status of each answer of its own
        self._logs = logs or EdgeLogs()  # its server's, shared by its connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # part of a request head came since the timer started
        self._busy = False  # a request is being handled (from its head to its response)
        self._body: StreamReader | None = None  # that request's body

    # ------------------------------------------------------------ header timeout
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def request_started(self, body: StreamReader) -> None:
        """A complete head was parsed (called by :class:`EdgeServer`'s request factory)."""
        self._disarm()
        self._busy = True
        self._body = body

    def _arm(self) -> None:
        self._disarm()
        if self.transport is not None:
            self._head_bytes = False
            self._head_timer = self._loop.call_later(self._head_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if self._busy or self._messages or self.transport is None:
            return  # handling a request, or a parsed one is about to start
        if self._body is not None and not self._body.is_eof():
            self._arm()  # aiohttp is draining the last body (bounded by its lingering_time)
            return
        peer = self.transport.get_extra_info("peername")
        if self._head_bytes:
            self._logs.head_timeouts.info(
                "closing a connection from %s: no complete request head in %g s",
                peer, self._head_timeout_s,
            )
            self.transport.write(TIMEOUT_408)
            self._answered(408)
        self.force_close()  # transport.close() still flushes the 408

    # --------------------------------------------------------- body parse errors
    def data_received(self, data: bytes) -> None:
        if data and not self._busy:
            self._head_bytes = True
        queued = len(self._messages)
        super().data_received(data)
        body = self._body
        if (self._busy and body is not None and len(self._messages) > queued
                and not body.is_eof() and body.exception() is None):
            # Nothing new can be parsed before this body ends, so the new message is
            # aiohttp's 400 for a broken chunked framing, queued behind this request
            # while the body waits forever: fail the body now.
            body.set_exception(web.RequestPayloadError("invalid chunked transfer encoding"))

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        broken = self._body is not None and self._body.exception() is not None
        if broken:
            resp.force_close()  # the connection's framing is lost: Connection: close
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._busy = False
            if broken:
                self.force_close()  # skip aiohttp's lingering read, which would re-raise
            else:
                self._arm()

    # ------------------------------------------------------------- parse errors
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            # a bug of ours that escaped the middleware: aiohttp logs it; our body
            status = super().handle_error(request, status, exc, message).status
            body = (server_error_body() if status >= 500
                    else error_body("Bad request.", "invalid_request_error"))
        else:
            if request.writer.output_size > 0:  # as aiohttp: too late for an answer
                raise ConnectionError("response already started")
            status, text, code = parse_error(exc, self.max_line_size, self.max_field_size)
            self._logs.parse_errors.info(
                "rejected a request from %s: %d %s (%s)", request.remote, status, code,
                type(exc).__name__,
            )
            body = invalid_request_body(text, code=code)
        resp = json_response(status, body)
        resp.force_close()
        self._answered(status)
        return resp

    def _answered(self, status: int) -> None:
        """An answer of the connection's own, which no middleware sees: counted."""
        if self._on_answer is not None:
            self._on_answer(status)


class EdgeServer(web.Server):
    """aiohttp's ``Server`` as the app runner built it, making our connections."""

    def __init__(
        self,
        base: web.Server,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
    ) -> None:
        self._inner_factory = base.request_factory
        super().__init__(
            base.request_handler,
            request_factory=self._make_edge_request,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )
        self._header_timeout_s = header_timeout_s
        self._on_answer = on_answer
        self._logs = EdgeLogs()

    def _make_edge_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        if isinstance(protocol, EdgeRequestHandler):
            protocol.request_started(payload)
        return self._inner_factory(message, payload, protocol, writer, task)

    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s,
            on_answer=self._on_answer, logs=self._logs, **self._kwargs,
        )


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`EdgeServer`; ``on_answer`` is told the
    status of every answer the connection gives itself (a 408 for a request head that
    never completed, a 400/414/415/431 for one the parser refused), which the app's
    middleware never sees."""

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("max_line_size", MAX_LINE_SIZE)
        kwargs.setdefault("max_field_size", MAX_FIELD_SIZE)
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._on_answer = on_answer

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return EdgeServer(base, header_timeout_s=self._header_timeout_s,
                          on_answer=self._on_answer)
