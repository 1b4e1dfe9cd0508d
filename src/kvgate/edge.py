"""The HTTP/1.1 connection below both apps (the gateway's and the simulated engine's):
aiohttp's ``RequestHandler`` with its gaps filled.

aiohttp answers what its parser rejects (an oversized header, a junk request line,
an unsupported Content-Encoding ...) itself, before any middleware runs: a text/plain
400 that quotes the client's bytes, plus an ERROR traceback in ``aiohttp.server``.
It has no timeout on a request head (a connection that sends nothing, or half a
head, is kept for aiohttp's hour-long keep-alive). When a chunked body breaks
mid-way, its C parser drops the body without failing it, so the handler waits for
``body_timeout_s``. After an answer given before the body was read (a 401, a 413 ...)
it keeps reading the rest of the body through its parser for up to 10 s, inflating
a gzip body as it goes (a 1 MB gzip of 1 GiB burned seconds of CPU on the event
loop). :class:`EdgeRequestHandler` (one per connection; built by :class:`EdgeRunner`
through :class:`EdgeServer`, aiohttp's own ``Server`` with its protocol factory
overridden) fixes these:

* ``handle_error``: an OpenAI-shaped JSON error (431 oversized headers, 414 a
  too-long request line, 415 an unsupported Content-Encoding, 501 an unknown method,
  505 an HTTP version other than 1.x, else 400), no echo of the client's bytes, one
  INFO line instead of a traceback;
* header timeout: from connect, and again from the end of each response, a
  complete request head must arrive within ``server.header_timeout_s``, else the
  connection is closed (after a 408 if part of a head came). Disarmed while a
  request is handled, so long streams are untouched; it is also the idle
  keep-alive timeout;
* a parse error while a request's body is still being read fails that body
  (``RequestPayloadError``: the handler answers 400 at once);
* an answer given before the request's body was all in (refused early, a body
  that failed or timed out: see ``body.py``) says ``Connection: close`` and ends the
  connection: our side is shut at once, what the client still sends is dropped
  unparsed for at most ``DISCARD_S`` (so the answer is not lost to a reset), then
  the connection is closed;
* a request that says ``Connection: close`` (or HTTP/1.0) followed by more bytes in
  the same packet is answered, then the connection closed (aiohttp refused the
  whole packet with a 400), for the first request of a connection.

Beside it, what both apps answer alike: compact JSON responses (``json_response``),
aiohttp's own HTTP errors in OpenAI's shape (``http_exception_response``), the rule
for a client's X-Request-Id (``client_request_id``), the bodies they take
(:func:`kvgate.edge_body.read_body_within`: identity, gzip, x-gzip or deflate, at most
``client_max_size`` once decoded) and ``Expect`` (:func:`expect_handler`).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import re
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, cast

from aiohttp import HttpVersion10, HttpVersion11, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
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
from aiohttp.web_urldispatcher import MatchInfoError

from kvgate.edge_body import (
    ENCODING_MESSAGE,
    UnsupportedContentEncodingError,
    decodable,
)
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
    elif isinstance(exc, UnsupportedContentEncodingError):
        body = invalid_request_body(ENCODING_MESSAGE, code="unsupported_content_encoding")
    elif status >= 500:
        body = server_error_body()
    else:
        body = error_body(exc.reason or "Bad request.", "invalid_request_error")
    return json_response(status, body, headers)


# A route's own check before a client is invited to send its body: a response refuses it
ExpectCheck = Callable[[web.Request], "web.StreamResponse | None"]
# Set on a request the expect handling answered (before any middleware: the app cannot
# count it): the endpoint it is counted under, by the edge.
EXPECT_ANSWERED: web.RequestKey[str] = web.RequestKey("kvgate_expect_answered", str)
UNMATCHED = "unmatched"  # the endpoint of a request no route takes


def endpoint_of(request: web.Request) -> str:
    """The route a request is counted under: its resource's pattern, else UNMATCHED."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


def reset_transport(transport: asyncio.Transport) -> None:
    """Abort a connection with a TCP reset (RST), not a FIN: the kernel drops what it
    still buffers for the peer (up to megabytes) at once, and the peer sees an error,
    not an end that reads as a complete answer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # linger 0: close() resets the connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def expectation_failed() -> web.Response:
    return json_response(417, invalid_request_body(
        "Only 'Expect: 100-continue' is supported.", code="expectation_failed"))


def expect_handler(
    max_body_bytes: int, check: ExpectCheck | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """An expect handler for a route that takes a body (aiohttp runs it before any
    middleware). aiohttp's own answers ``Expect: 100-continue`` with a 100 before any
    check, inviting a body certain to be refused (an unknown caller's, one past
    ``max_body_bytes``), and any other expectation with a text/plain 417 quoting it.
    Here: a JSON 417, a 413 past the limit, then ``check`` (the caller's identity),
    a 415 for a Content-Encoding no app decodes, and only then the 100. Its answers
    are counted by the edge (:data:`EXPECT_ANSWERED`)."""

    async def handle(request: web.Request) -> web.StreamResponse | None:
        refused: web.StreamResponse | None = None
        length = request.content_length
        if request.headers.get("Expect", "").lower() != "100-continue":
            refused = expectation_failed()
        elif length is not None and length > max_body_bytes:
            refused = json_response(413, invalid_request_body(
                f"Request body is larger than {max_body_bytes} bytes.",
                code="request_too_large"))
        elif check is not None:
            refused = check(request)
        if refused is None and not decodable(request.headers):
            refused = http_exception_response(UnsupportedContentEncodingError())
        if refused is None:
            if request.version == HttpVersion11:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # as aiohttp's: the answer has not begun
            return None
        # The client holds its body back until a 100 that will not come: the body is
        # failed, so the connection closes after this answer instead of waiting for
        # bytes that, if they came, must not be read as the next request.
        request.content.set_exception(web.HTTPExpectationFailed())
        request[EXPECT_ANSWERED] = endpoint_of(request)
        return refused

    return handle


def get_route_adder(
    router: web.UrlDispatcher, max_body_bytes: int
) -> Callable[..., web.AbstractRoute]:
    """``router.add_get`` whose routes answer an unknown ``Expect`` with our JSON 417
    (:func:`expect_handler`), not aiohttp's text/plain one quoting the header."""
    return partial(router.add_get, expect_handler=expect_handler(max_body_bytes))


# A request line well formed but for its method or version (RFC 9112 3): the parser's
# message quotes it as a bytes literal (``b'FOO / HTTP/1.1'``)
_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ [\x21-\x7e]+ HTTP/[0-9]\.[0-9]")
_QUOTED = re.compile(r"""\n\n  (b'(?:[^'\\\n]|\\.)*'|b"(?:[^"\\\n]|\\.)*")\n""")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _quoted_request_line(exc: HttpProcessingError) -> bytes | None:
    """The request line quoted by llhttp's error message, if it is one."""
    found = _QUOTED.search(exc.message) if isinstance(exc.message, str) else None
    if found is None:
        return None
    with contextlib.suppress(ValueError, SyntaxError):
        line = ast.literal_eval(found.group(1))
        if isinstance(line, bytes) and _REQUEST_LINE.fullmatch(line):
            return line
    return None


def _unknown_method(exc: BadHttpMethod) -> bool:
    """A method token the parser does not know (RFC 9110 9.1: 501), not junk (400)."""
    if exc.line and _TOKEN.fullmatch(exc.line):  # the pure-Python parser's: the method
        return True
    return _quoted_request_line(exc) is not None


VERSION_REFUSAL = (505, "Only HTTP/1.0 and HTTP/1.1 are supported.",
                   "http_version_not_supported")


def parse_error(exc: HttpProcessingError, line_limit: int = MAX_LINE_SIZE,
                field_limit: int = MAX_FIELD_SIZE) -> tuple[int, str, str]:
    """(status, message, code) for what aiohttp's parser rejected; our words only,
    since aiohttp's messages quote the client's bytes."""
    if isinstance(exc, ContentEncodingError):
        return 415, ENCODING_MESSAGE, "unsupported_content_encoding"
    if isinstance(exc, LineTooLong):
        if line_limit != field_limit and len(exc.args) > 1 and exc.args[1] == line_limit:
            return 414, "Request URL too long.", "url_too_long"
        return 431, "Request header field too large.", "headers_too_large"
    if "too many headers" in str(exc).lower():
        return 431, "Too many request header fields.", "headers_too_large"
    if isinstance(exc, BadHttpMethod):
        if _unknown_method(exc):
            return 501, "Unknown request method.", "method_not_implemented"
        return 400, "Malformed HTTP request line.", "malformed_request"
    if isinstance(exc, BadStatusLine):
        if _quoted_request_line(exc) is not None:  # e.g. HTTP/3.0, HTTP/1.2
            return VERSION_REFUSAL
        return 400, "Malformed HTTP request line.", "malformed_request"
    if isinstance(exc, InvalidURLError):
        return 400, "Invalid request URL.", "malformed_request"
    if isinstance(exc, InvalidHeader):
        return 400, "Invalid HTTP header.", "malformed_request"
    return 400, "Malformed HTTP request.", "malformed_request"


def _refusal(status: int, text: str, code: str) -> web.Response:
    """One of the connection's own answers: JSON, and the connection ends after it."""
    resp = json_response(status, invalid_request_body(text, code=code))
    resp.force_close()
    return resp


def _timeout_408() -> bytes:
    body = json.dumps(invalid_request_body("Timed out reading the request headers.",
                                           code="request_timeout"),
                      separators=(",", ":")).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


TIMEOUT_408 = _timeout_408()
# After an answer given before the request's body was all in, what the client still
# sends is dropped (unparsed) this long before the connection is reset: time to read
# the answer, which closing at once could lose (a close() with unread bytes is a RST).
DISCARD_S = 2.0
# The bytes of a connection kept until its first request head is whole: enough for any
# head the parser takes, to answer a "Connection: close" request pipelined with more.
PRELUDE_MAX = 64 * 1024
_AFTER_CLOSE = "Data after `Connection: close`"


def _after_close(msg: object) -> bool:
    """Whether a queued message is aiohttp's 400 for bytes after a "close" request."""
    exc = getattr(msg, "exc", None)
    return isinstance(exc, BadHttpMessage) and _AFTER_CLOSE in exc.message


class _NoFlow:
    """The protocol of a parser that only finds where messages end: never paused."""

    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


_Parser = Any  # aiohttp's HttpRequestParser (C or Python): no common type to name


def _parses(parser: _Parser, data: bytes) -> bool:
    try:
        parser.feed_data(data)
    except HttpProcessingError:
        return False
    return True


def _through_close(data: bytes, probe: Callable[[], _Parser]) -> int | None:
    """The length of ``data`` up to the end of its first "close" request, when ``data``
    (a connection's first bytes) holds whole requests, the last saying "close",
    followed by bytes a fresh parser refuses; else None. Found by bisection on the
    prefixes a fresh parser takes without error."""
    if _parses(probe(), data):
        return None
    good, bad = 0, len(data)
    while bad - good > 1:
        mid = (good + bad) // 2
        if _parses(probe(), data[:mid]):
            good = mid
        else:
            bad = mid
    messages, _, _ = probe().feed_data(data[:good])
    if not messages or not messages[-1][0].should_close:
        return None
    if not all(payload.is_eof() for _, payload in messages):
        return None
    return good


class EdgeRequestHandler(RequestHandler):
    """One client connection (see the module docstring)."""

    def __init__(
        self,
        manager: web.Server,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
        on_route_answer: Callable[[str, int], None] | None = None,
        logs: EdgeLogs | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = header_timeout_s
        self._on_answer = on_answer  # told the status of each answer of its own
        self._on_route_answer = on_route_answer  # told (endpoint, status) of Expect answers
        self._logs = logs or EdgeLogs()  # its server's, shared by its connections
        self._auto_decompress: bool = kwargs.get("auto_decompress", True)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # part of a request head came since the timer started
        self._busy = False  # a request is being handled (from its head to its response)
        self._body: StreamReader | None = None  # that request's body
        self._discard_timer: asyncio.TimerHandle | None = None
        self._prelude: bytearray | None = bytearray()  # bytes before the first head
        self._input_done = False  # a "close" request came: what follows is dropped

    # ------------------------------------------------------------ header timeout
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._discard_timer is not None:
            self._discard_timer.cancel()
            self._discard_timer = None
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
        peer = self.transport.get_extra_info("peername")
        if self._head_bytes:
            self._logs.head_timeouts.info(
                "closing a connection from %s: no complete request head in %g s",
                peer, self._head_timeout_s,
            )
            self.transport.write(TIMEOUT_408)
            self._answered(408)
        self.force_close()  # transport.close() still flushes the 408

    # ------------------------------------------------------------ incoming bytes
    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or (self._input_done and data):
            return  # answered and closing: what comes is dropped, never parsed
        if data and not self._busy:
            self._head_bytes = True
        queued = len(self._messages)
        prelude = self._prelude
        super().data_received(data)
        if len(self._messages) > queued:
            self._prelude = None
            if prelude is not None and _after_close(self._messages[-1][0]):
                self._answer_before_close(bytes(prelude) + data)
        elif prelude is not None:
            prelude += data
            if len(prelude) > PRELUDE_MAX:
                self._prelude = None
        body = self._body
        if (self._busy and body is not None and len(self._messages) > queued
                and not body.is_eof() and body.exception() is None):
            # Nothing new can be parsed before this body ends, so the new message is
            # aiohttp's 400 for a broken chunked framing, queued behind this request
            # while the body waits forever: fail the body now.
            body.set_exception(web.RequestPayloadError("invalid chunked transfer encoding"))

    def _answer_before_close(self, data: bytes) -> None:
        """The connection's first bytes ``data`` hold requests up to one that says
        "close", then more: aiohttp's parser refused them all (a 400, queued last).
        RFC 9112 9.6: answer them, then close, the rest unread. They are parsed again,
        up to the close request's end, by a fresh parser that replaces the refusing one."""
        end = _through_close(data, self._probe_parser)
        if end is None:
            return  # not that case after all: the 400 stands
        refusing, self._parser = self._parser, self._new_parser(self, self._auto_decompress)
        try:  # the new parser in place first: its bodies' flow control pauses it
            messages, _, _ = self._parser.feed_data(data[:end])
        except HttpProcessingError:  # as the probes did not: the 400 stands
            self._parser = refusing
            return
        self._messages.pop()  # the 400
        self._request_count -= 1
        for message in messages:
            self._request_count += 1
            self._messages.append(message)
        self._input_done = True

    def _new_parser(self, protocol: Any, auto_decompress: bool) -> _Parser:
        """A parser like aiohttp's for this connection (same class and limits)."""
        parser_class: Any = type(self._parser)
        return parser_class(
            protocol, self._loop, self._read_bufsize,
            max_line_size=self.max_line_size, max_field_size=self.max_field_size,
            max_headers=self.max_headers, payload_exception=web.RequestPayloadError,
            auto_decompress=auto_decompress, max_msg_queue_size=self._max_msg_queue_size,
        )

    def _probe_parser(self) -> _Parser:
        return self._new_parser(_NoFlow(), False)  # framing only: bodies stay encoded

    # ------------------------------------------------------------ after an answer
    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        body = self._body
        # the body is not all in (or failed): the connection cannot go on
        unread = body is not None and (not body.is_eof() or body.exception() is not None)
        if unread:
            resp.force_close()  # Connection: close
        endpoint = request.get(EXPECT_ANSWERED)
        if endpoint is not None and self._on_route_answer is not None:
            self._on_route_answer(endpoint, resp.status)
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._busy = False
            if unread:
                self._close_unread()
            else:
                self._arm()

    def _close_unread(self) -> None:
        """End the connection after an answer given before the body was all in. aiohttp
        would read the rest through its parser for up to 10 s (inflating a gzip body
        on the event loop) to keep the connection: here our side is shut at once (the
        answer, then a FIN), what the client still sends is dropped unparsed, and the
        connection ends when the client closes it or after ``DISCARD_S``."""
        self._disarm()
        # aiohttp: no lingering read, no next request, the transport left to us
        self._force_close = True
        transport = self.transport
        if transport is None:
            return
        if not transport.can_write_eof():  # TLS: no half-close
            self.force_close()
            return
        transport.write_eof()
        transport.resume_reading()  # paused for the unread body: drain the socket
        self._discard_timer = self._loop.call_later(DISCARD_S, reset_transport, transport)

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


# A request in an HTTP version the parser takes but we do not speak (0.9, 2.0): 505
_BAD_VERSION: web.RequestKey[bool] = web.RequestKey("kvgate_bad_version", bool)


class EdgeServer(web.Server):
    """aiohttp's ``Server`` as the app runner built it, making our connections. Before
    the app sees a request it answers those no app should: an HTTP version other than
    1.x (505), an ``Expect`` on a URL or method no route takes (JSON, and no 100 for a
    certain 404/405: aiohttp's own expect handler answers those)."""

    def __init__(
        self,
        base: web.Server,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
        on_route_answer: Callable[[str, int], None] | None = None,
        router: web.UrlDispatcher | None = None,
    ) -> None:
        self._inner_factory = base.request_factory
        self._inner_handler = base.request_handler
        super().__init__(
            self._handle,
            request_factory=self._make_edge_request,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )
        self._header_timeout_s = header_timeout_s
        self._on_answer = on_answer
        self._on_route_answer = on_route_answer
        self._router = router
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
        bad_version = message.version not in (HttpVersion11, HttpVersion10)
        if bad_version:  # answered in HTTP/1.1 (aiohttp would echo "HTTP/2.0")
            message = message._replace(version=HttpVersion11, should_close=True)
        request = self._inner_factory(message, payload, protocol, writer, task)
        if bad_version:
            request[_BAD_VERSION] = True
        return request

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.get(_BAD_VERSION):
            self._logs.parse_errors.info("rejected a request from %s: 505 (HTTP version)",
                                         request.remote)
            if self._on_answer is not None:
                self._on_answer(505)
            return _refusal(*VERSION_REFUSAL)
        if self._router is not None and request.headers.get(hdrs.EXPECT):
            refused = await self._unmatched_expectation(cast(web.Request, request))
            if refused is not None:
                return refused
        return await self._inner_handler(request)

    async def _unmatched_expectation(self, request: web.Request) -> web.StreamResponse | None:
        """The answer to an ``Expect`` on a URL or method no route takes (None for a
        routed request: its route's expect handler answers): a JSON 417 for any
        expectation but 100-continue, else the 404/405 at once, with no 100 inviting a
        body that will be refused."""
        assert self._router is not None
        match_info = await self._router.resolve(request)
        if not isinstance(match_info, MatchInfoError):
            return None
        request[EXPECT_ANSWERED] = UNMATCHED
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            return expectation_failed()
        return http_exception_response(match_info.http_exception)

    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s,
            on_answer=self._on_answer, on_route_answer=self._on_route_answer,
            logs=self._logs, **self._kwargs,
        )


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`EdgeServer`; ``on_answer`` is told the
    status of every answer the connection gives itself (a 408 for a request head that
    never completed, a 400/414/415/431/501/505 for one the parser or the edge refused),
    ``on_route_answer`` the endpoint and status of every answer to an ``Expect`` given
    before the app's middleware (a 417, 413, 415 or the route's check): neither is seen
    by the middleware."""

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout_s: float,
        on_answer: Callable[[int], None] | None = None,
        on_route_answer: Callable[[str, int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("max_line_size", MAX_LINE_SIZE)
        kwargs.setdefault("max_field_size", MAX_FIELD_SIZE)
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._on_answer = on_answer
        self._on_route_answer = on_route_answer

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return EdgeServer(base, header_timeout_s=self._header_timeout_s,
                          on_answer=self._on_answer, on_route_answer=self._on_route_answer,
                          router=self.app.router)
