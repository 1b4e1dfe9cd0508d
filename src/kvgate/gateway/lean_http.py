"""A lean HTTP/1.1 client for the gateway's hop to the nodes: keep-alive pools, no frills.

The gateway sends one kind of request (``POST`` of a JSON body it already holds in
memory) to a handful of known nodes, and reads back either a JSON answer or an SSE
stream. :class:`aiohttp.ClientSession` does much more per request (URL joining,
header multidicts, cookie and redirect logic, tracing, a payload registry, a write
task, timer contexts), and that general machinery cost a quarter of the gateway's
CPU. This client keeps only what the hop needs:

* one pool of keep-alive connections per (host, port, tls), last used first, with
  a total limit across nodes (``upstream.pool_limit``); an idle connection older
  than ``keepalive_s`` is closed instead of reused (below the 5 s keep-alive of
  uvicorn, which serves vLLM), and one the node closed is dropped when met; a timer
  closes idle connections once they pass ``keepalive_s``, so the sockets a burst
  opened do not stay open until the node hangs up (which may be never);
* request heads built as text: ``POST <path> HTTP/1.1`` and ``Host`` computed once
  per target, then the caller's headers and a ``Content-Length``; the head and the
  body go out in one write (``TCP_NODELAY`` is set on connect);
* responses read by aiohttp's own protocol and parser (``ResponseHandler``, the C
  ``HttpResponseParser`` when built): status line, headers, ``Content-Length`` and
  chunked bodies, read timeouts, flow control, and the same exceptions aiohttp's
  client raises, so :func:`kvgate.gateway.upstream.classify_exception` maps both
  clients' failures alike. The body is an :class:`aiohttp.StreamReader`;
* a connection goes back to the pool only after a complete response (the caller's
  :meth:`LeanResponse.release`; the protocol's own ``should_close`` must agree: no
  ``Connection: close``, nothing unread, no error); on any error, timeout or
  cancellation it is closed, which is how an engine learns that its client left;
* timeouts: ``connect_timeout`` for the TCP connect (:class:`aiohttp.ConnectionTimeoutError`),
  ``read_timeout`` for any silence while waiting for or reading the response
  (streams; aiohttp's ``SocketTimeoutError``) and ``total_timeout`` from the call
  until the response is released (non-streamed answers; :class:`aiohttp.ServerTimeoutError`;
  checked every ``SWEEP_S`` by one timer for all requests, so it may fire that late);
* a request sent on a *reused* connection that the node closed or reset within
  ``STALE_WINDOW_S`` of our write, before a byte of an answer (the keep-alive race:
  the node timed the idle connection out as we wrote, so it never processed the
  request), is sent once more on a new connection (counted in ``resends``). Any
  other close before the first byte (the node read the request and worked on it)
  is raised as on a new connection (``ServerDisconnectedError`` or
  ``ClientOSError``: ``UPSTREAM_ERROR``), so the gateway's retry rule decides and
  its metrics count it; a generation is never run twice behind its back. Once any
  byte of an answer arrived nothing is ever sent again.

The connection's parser (made on connect) reads every response on it. The client
depends on two aiohttp modules beyond the public API (``aiohttp.client_proto`` and
``aiohttp.http_exceptions``); ``tests/gateway/test_lean_http.py`` exercises every
path above, so an aiohttp upgrade that changes them fails there first, and
``upstream.client: aiohttp`` is the fallback.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl as ssl_mod
from collections.abc import Mapping

from aiohttp import (
    ClientConnectionError,
    ClientError,
    ClientOSError,
    ConnectionTimeoutError,
    ServerDisconnectedError,
    ServerTimeoutError,
    StreamReader,
)
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDictProxy
from yarl import URL

READ_BUFSIZE = 2**16  # the body reader's high-water mark is twice this
SWEEP_S = 0.1  # how often total timeouts are checked
# A reused connection the node closed or reset at most this long after our write,
# without a byte of answer, was stale (its FIN/RST raced the write: already in our
# socket, or on the wire for one round trip, well under 1 ms inside a cluster, plus
# the loop turns before we see it, which on a busy gateway take tens of ms), so the
# request is sent once more. Past it the node may have read the request and worked
# on it: sending it again could run a generation twice, so the failure is raised
# instead. 50 ms: a stale socket seen late on a loaded loop is still re-sent (not a
# 502), and a node dropping a request it read within this spent at most that on it.
STALE_WINDOW_S = 0.05


class UpstreamConnectError(ClientOSError):
    """The TCP (or TLS) connection to the node could not be made (an ``OSError``, as
    aiohttp's ``ClientConnectorError``)."""


class UpstreamProtocolError(ClientError):
    """The node's answer is not valid HTTP/1.1."""


class Target:
    """Where to send: the pool key and the request line + ``Host`` as bytes."""

    __slots__ = ("head", "host", "key", "port", "ssl", "url")

    def __init__(self, url: str | URL, method: str = "POST") -> None:
        u = url if isinstance(url, URL) else URL(url)
        if u.scheme not in ("http", "https") or not u.raw_host:
            raise ValueError(f"not an http(s) URL: {url}")
        self.url = str(u)
        self.host: str = u.raw_host
        self.ssl = u.scheme == "https"
        self.port: int = u.port or (443 if self.ssl else 80)
        self.key = (self.host, self.port, self.ssl)
        host = f"[{self.host}]" if ":" in self.host else self.host
        if u.explicit_port is not None and u.explicit_port != (443 if self.ssl else 80):
            host = f"{host}:{u.explicit_port}"
        target = u.raw_path_qs or "/"
        head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"
        if u.raw_user is not None or u.raw_password is not None:
            # http://user:pw@host (or http://:token@host): Basic auth, as aiohttp sends it
            head += f"Authorization: {_basic_auth(u.user or '', u.password or '')}\r\n"
        self.head = head.encode("ascii")


def _basic_auth(user: str, password: str) -> str:
    """The Basic credentials of a URL's user and password (Latin-1, as aiohttp encodes
    them, else UTF-8)."""
    pair = f"{user}:{password}"
    try:
        raw = pair.encode("latin-1")
    except UnicodeEncodeError:
        raw = pair.encode("utf-8")
    return "Basic " + base64.b64encode(raw).decode("ascii")


class _Protocol(ResponseHandler):
    """aiohttp's client protocol, noting whether the current answer sent any byte and
    when the node's EOF or reset was first seen."""

    answered = False
    lost_at: float | None = None  # loop time of the EOF or the connection's loss

    def data_received(self, data: bytes) -> None:
        self.answered = True
        super().data_received(data)

    def eof_received(self) -> None:
        if self.lost_at is None:
            self.lost_at = self._loop.time()
        super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.lost_at is None:
            self.lost_at = self._loop.time()
        super().connection_lost(exc)

    def stale(self, sent_at: float | None) -> bool:
        """Whether this reused connection, failed before a byte of answer, was stale:
        the node closed or reset it no later than ``STALE_WINDOW_S`` after our write."""
        if self.answered:
            return False
        if sent_at is None:  # failed before anything was written
            return True
        lost_at = self._loop.time() if self.lost_at is None else self.lost_at
        return lost_at - sent_at <= STALE_WINDOW_S


class _Conn:
    __slots__ = ("idle_since", "key", "proto")

    def __init__(self, proto: _Protocol, key: tuple[str, int, bool]) -> None:
        self.proto = proto
        self.key = key
        self.idle_since = 0.0


class LeanResponse:
    """One answer's status, headers and body; ``release()`` or ``close()`` it once.

    The attributes the relay uses are those of :class:`aiohttp.ClientResponse`
    (``status``, ``reason``, ``headers``, ``content``, ``content_type``,
    ``connection.transport``), so both clients fit one relay.
    """

    __slots__ = ("_client", "_conn", "_ctype", "_timed", "connection", "content", "headers",
                 "reason", "status")

    status: int
    reason: str | None
    headers: CIMultiDictProxy[str]
    content: StreamReader

    def __init__(self, client: LeanClient, conn: _Conn) -> None:
        self._client = client
        self._conn: _Conn | None = conn
        self.connection: ResponseHandler | None = conn.proto  # .transport, as aiohttp's
        self._timed = False  # registered with the client's deadline sweep
        self._ctype: str | None = None

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (aiohttp's default if none)."""
        ct = self._ctype
        if ct is None:
            raw = self.headers.get("Content-Type")
            ct = raw.partition(";")[0].strip().lower() if raw else "application/octet-stream"
            self._ctype = ct
        return ct

    def _expire(self) -> None:
        """The total timeout: fail whoever waits (headers or body) and drop the connection."""
        conn = self._conn
        if conn is None:
            return
        exc = ServerTimeoutError("Timeout: the node's answer took too long")
        conn.proto.set_exception(exc)
        content = getattr(self, "content", None)
        if content is not None and not content.is_eof():
            content.set_exception(exc)
        self.close()

    def release(self) -> None:
        """Done with the response: pool the connection if the exchange is complete."""
        conn = self._detach()
        if conn is None:
            return
        content = getattr(self, "content", None)
        complete = content is not None and content.is_eof() and not conn.proto.should_close
        self._client._put_back(conn, complete)

    def close(self) -> None:
        """Abandon the response: the connection is closed (the node aborts the request)."""
        conn = self._detach()
        if conn is not None:
            self._client._put_back(conn, False)

    def _detach(self) -> _Conn | None:
        """Take the connection off this response (once) and stop its deadline."""
        conn = self._conn
        if conn is None:
            return None
        self._conn = None
        self.connection = None
        if self._timed:
            self._timed = False
            self._client._deadlines.pop(self, None)
        return conn


class LeanClient:
    """Keep-alive connection pools to the nodes; create inside the running loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        limit: int = 1024,
        keepalive_s: float = 4.0,
        read_bufsize: int = READ_BUFSIZE,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.read_bufsize = read_bufsize
        self._idle: dict[tuple[str, int, bool], collections.deque[_Conn]] = {}
        self._open = 0  # connections counted against the limit (in use + idle)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, Target] = {}
        self._ssl: ssl_mod.SSLContext | None = None
        self._closed = False
        # Total timeouts: response -> deadline, checked every SWEEP_S by one timer
        # (cheaper than a timer per request; a deadline fires up to SWEEP_S late).
        self._deadlines: dict[LeanResponse, float] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._reaper: asyncio.TimerHandle | None = None  # closes expired idle connections
        self.connects = 0  # new connections made (tests read it)
        self.resends = 0  # requests sent again after a stale pooled connection

    # ------------------------------------------------------------------ targets
    def target(self, url: str | URL) -> Target:
        """A parsed URL, cached (the node URLs and paths are few)."""
        key = str(url)
        t = self._targets.get(key)
        if t is None:
            if len(self._targets) > 4096:  # nodes come and go: never grow without bound
                self._targets.clear()
            t = self._targets[key] = Target(url)
        return t

    # ------------------------------------------------------------------ requests
    async def request(
        self,
        target: Target,
        body: bytes,
        headers: Mapping[str, str],
        *,
        read_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> LeanResponse:
        """Send ``body`` to ``target``; returns once the response headers are in.

        Raises aiohttp's client exceptions (``ClientError`` subclasses, some also
        ``OSError`` or ``TimeoutError``) and ``ValueError`` for a bad header.
        """
        loop = self._loop
        deadline = None if total_timeout is None else loop.time() + total_timeout
        lines = [f"{k}: {v}\r\n" for k, v in headers.items()]
        text = "".join(lines)
        if text.count("\n") != len(lines) or text.count("\r") != len(lines):
            raise ValueError("a CR or LF character in an upstream request header")
        # surrogateescape: header values go out as the client's bytes came in
        fields = text.encode("utf-8", "surrogateescape")
        head = b"%s%sContent-Length: %d\r\n\r\n" % (target.head, fields, len(body))
        payload = head + body if len(body) < 65536 else None
        for attempt in (0, 1):
            conn, reused = await self._acquire(target, deadline, reuse=attempt == 0)
            resp = LeanResponse(self, conn)
            if deadline is not None:
                self._add_deadline(resp, deadline)
            proto = conn.proto
            sent_at: float | None = None
            try:
                if not reused:
                    # The parser made here reads every response on this connection.
                    proto.set_response_params(
                        read_timeout=read_timeout, read_bufsize=self.read_bufsize,
                        auto_decompress=True, read_until_eof=True,  # as aiohttp's client
                    )
                elif proto.read_timeout != read_timeout:
                    proto.read_timeout = read_timeout
                transport = proto.transport
                assert transport is not None
                proto.answered = False
                if payload is not None:
                    transport.write(payload)
                else:
                    transport.writelines((head, body))
                sent_at = loop.time()
                if read_timeout is not None:
                    proto.start_timeout()
                while True:
                    message, content = await proto.read()
                    if message.code < 100 or message.code > 199 or message.code == 101:
                        break
                    if read_timeout is not None:  # a 1xx ended the timer: the answer
                        proto.start_timeout()  # proper must come in time too
            except (ServerDisconnectedError, ClientOSError):
                resp.close()
                if reused and attempt == 0 and not self._closed and proto.stale(sent_at):
                    self.resends += 1
                    continue  # the node closed the idle connection as we wrote: once more
                raise  # as a new connection's failure: the gateway's retry rule decides
            except HttpProcessingError as exc:
                resp.close()
                raise UpstreamProtocolError(f"bad response from {target.url}: {exc}") from exc
            except BaseException:
                resp.close()
                raise
            resp.status = message.code
            resp.reason = message.reason
            resp.headers = message.headers
            resp.content = content
            return resp
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ deadlines
    def _add_deadline(self, resp: LeanResponse, deadline: float) -> None:
        resp._timed = True
        self._deadlines[resp] = deadline
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = self._loop.time()
        expired = [r for r, d in self._deadlines.items() if d <= now]
        for r in expired:
            r._expire()
        if self._deadlines and not self._closed:
            self._sweeper = self._loop.call_later(SWEEP_S, self._sweep)

    # ------------------------------------------------------------------ the pool
    async def _acquire(
        self, target: Target, deadline: float | None, *, reuse: bool = True
    ) -> tuple[_Conn, bool]:
        loop = self._loop
        waited = False
        while True:
            if self._closed:
                raise ClientConnectionError("the upstream client is closed")
            idle = self._idle.get(target.key)
            if idle and reuse:
                now = loop.time()
                while idle:
                    conn = idle.pop()
                    proto = conn.proto
                    # should_close: the node said something unasked (a 408 and Connection:
                    # close) on the idle connection, which must not read as our answer
                    if (now - conn.idle_since < self.keepalive_s and proto.is_connected()
                            and not proto.should_close):
                        return conn, True
                    self._discard(conn)
            if self._open < self.limit or self._evict_idle():
                break
            fut: asyncio.Future[None] = loop.create_future()
            if waited:  # woken, but the slot went to another: first in line again
                self._waiters.appendleft(fut)
            else:
                self._waiters.append(fut)
            try:
                if deadline is None:
                    await fut
                else:
                    async with asyncio.timeout_at(deadline):
                        await fut
            except BaseException:
                if fut.done():
                    self._wake()  # woken but leaving: pass the free slot on
                else:
                    fut.cancel()
                    self._waiters.remove(fut)
                raise
            waited = True
        self._open += 1
        try:
            return await self._connect(target, deadline), False
        except BaseException:
            self._open -= 1
            self._wake()
            raise

    async def _connect(self, target: Target, deadline: float | None) -> _Conn:
        timeout = self.connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - self._loop.time()))
        ssl: ssl_mod.SSLContext | None = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl_mod.create_default_context()
            ssl = self._ssl
        loop = self._loop
        try:
            async with asyncio.timeout(timeout):
                _, proto = await loop.create_connection(
                    lambda: _Protocol(loop), target.host, target.port, ssl=ssl,
                    server_hostname=target.host if ssl is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectionTimeoutError(f"Connection timeout to {target.url}") from exc
        except OSError as exc:
            raise UpstreamConnectError(
                exc.errno, f"Cannot connect to {target.url}: {exc.strerror or exc}"
            ) from exc
        self.connects += 1
        return _Conn(proto, target.key)

    def _put_back(self, conn: _Conn, reusable: bool) -> None:
        transport = conn.proto.transport
        # bytes of our request still unsent (a node that answered before reading the whole
        # body, e.g. a 413): the next request would queue behind them
        if (not reusable or self._closed or not conn.proto.is_connected()
                or (transport is not None and transport.get_write_buffer_size() > 0)):
            self._discard(conn)
            return
        now = self._loop.time()
        conn.idle_since = now
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = collections.deque()
        elif idle and now - idle[0].idle_since >= self.keepalive_s:
            self._discard(idle.popleft())  # the coldest one expired: amortised cleanup
        idle.append(conn)
        if self._reaper is None:
            self._reaper = self._loop.call_later(self.keepalive_s, self._reap)
        self._wake()

    def _reap(self) -> None:
        """Close the idle connections past ``keepalive_s``; again when the next one is."""
        self._reaper = None
        if self._closed:
            return
        now = self._loop.time()
        oldest = None
        for key in list(self._idle):
            idle = self._idle[key]
            # oldest on the left: put back on the right, taken from the right
            while idle and now - idle[0].idle_since >= self.keepalive_s:
                self._discard(idle.popleft())
            if idle:
                since = idle[0].idle_since
                oldest = since if oldest is None else min(oldest, since)
            else:
                del self._idle[key]  # a removed node's pool goes with its last connection
        if oldest is not None:
            self._reaper = self._loop.call_later(
                max(oldest + self.keepalive_s - now, SWEEP_S), self._reap
            )

    def _discard(self, conn: _Conn) -> None:
        conn.proto.close()
        self._open -= 1
        self._wake()

    def _evict_idle(self) -> bool:
        """At the limit: close the coldest idle connection of any node, if any."""
        for idle in self._idle.values():
            if idle:
                self._discard(idle.popleft())
                return True
        return False

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    @property
    def idle_connections(self) -> int:
        return sum(len(d) for d in self._idle.values())

    @property
    def open_connections(self) -> int:
        return self._open

    async def close(self) -> None:
        """Close every idle connection; ones in use close when their response does."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                self._discard(idle.popleft())
        self._idle.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
        await asyncio.sleep(0)  # let the transports run connection_lost


__all__ = [
    "LeanClient",
    "LeanResponse",
    "Target",
    "UpstreamConnectError",
    "UpstreamProtocolError",
]
