"""The lean upstream client (kvgate.gateway.lean_http): pooling, parsing, failures.

Most tests talk to a raw asyncio HTTP/1.1 server defined here, which answers with
exactly the bytes a test gives it (chunk boundaries included), so what the client
does with them is visible: reuse, chunked SSE, early closes, malformed answers.
The gateway tests elsewhere run with the lean client (the default); the last tests
here run the main paths through ``upstream.client: aiohttp`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate.core.admission import FailureKind
from kvgate.gateway import lean_http
from kvgate.gateway.config import NodesConfig, UpstreamConfig
from kvgate.gateway.lean_http import LeanClient, Target, UpstreamProtocolError
from kvgate.gateway.upstream import Upstream, classify_exception, classify_status

Handler = Callable[["RawConn", bytes, bytes], Awaitable[None]]


class RawConn:
    """One accepted connection of :class:`RawServer`, as seen by a handler."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 index: int) -> None:
        self.reader = reader
        self.writer = writer
        self.index = index  # 0 for the first connection the server accepted
        self.requests = 0  # requests read on this connection so far

    async def wait_closed(self) -> None:
        """Until the client closes the connection (instead of answering)."""
        await self.reader.read()

    async def send(self, *parts: bytes, gap: float = 0.0) -> None:
        for p in parts:
            self.writer.write(p)
            await self.writer.drain()
            if gap:
                await asyncio.sleep(gap)


class RawServer:
    """A tiny HTTP/1.1 server: reads Content-Length requests, a handler answers."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed_by_peer = 0  # connections the client closed (EOF seen by us)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:  # wakes handlers waiting in wait_closed()
            w.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = RawConn(reader, writer, self.connections)
        self._writers.append(writer)
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_peer += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                conn.requests += 1
                await self.handler(conn, head, body)
                if writer.is_closing():
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer += 1
        finally:
            writer.close()
            self._tasks.discard(task)


def answer(body: bytes, status: str = "200 OK", ctype: str = "application/json",
           extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def ok(conn: RawConn, head: bytes, body: bytes) -> None:
    await conn.send(answer(b'{"ok": %d}' % conn.requests))


async def read_all(resp: Any) -> bytes:
    out = b""
    while True:
        got = await resp.content.read(65536)
        if not got:
            return out
        out += got


async def fetch(c: LeanClient, t: Target, body: bytes = b"{}") -> bytes:
    """One whole exchange: send, read the answer to its end, give the connection back."""
    r = await c.request(t, body, {})
    out = await read_all(r)
    r.release()
    return out


@contextlib.asynccontextmanager
async def open_client(**kw: Any) -> AsyncIterator[LeanClient]:
    """A client with a short connect timeout, closed on the way out."""
    c = LeanClient(**{"connect_timeout_s": 1.0, **kw})
    try:
        yield c
    finally:
        await c.close()


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 20)

    return asyncio.run(bounded())


# --------------------------------------------------------------------------- the client
def test_keep_alive_reuse_and_request_bytes() -> None:
    async def body() -> None:
        async with RawServer(ok) as srv:
            async with open_client() as c:
                t = c.target(srv.url + "/v1/completions")
                for i in range(3):
                    r = await c.request(t, b'{"x": 1}', {"Content-Type": "application/json",
                                                         "X-Request-Id": f"r{i}"})
                    assert r.status == 200 and r.content_type == "application/json"
                    assert await read_all(r) == b'{"ok": %d}' % (i + 1)
                    r.release()
                assert c.connects == 1 and srv.connections == 1
                assert c.idle_connections == 1 and c.open_connections == 1
                head, sent = srv.requests[0]
                port = srv.url.rsplit(":", 1)[1]
                assert head == (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%s\r\n"
                                b"Content-Type: application/json\r\nX-Request-Id: r0\r\n"
                                b"Content-Length: 8\r\n\r\n" % port.encode())
                assert sent == b'{"x": 1}'
                # the connection goes back only after a complete response
                r = await c.request(t, b"{}", {})
                r.close()
                await fetch(c, t)
                assert c.connects == 2 and c.open_connections == 1
                # a large body (two writes) arrives whole
                big = b"x" * 200_000
                await fetch(c, t, big)
                assert srv.requests[-1][1] == big
            assert c.open_connections == 0

    run(body())


def test_connection_close_and_http10_answers_are_not_reused() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if conn.index == 0:
            await conn.send(answer(b"{}", extra="Connection: close\r\n"))
            conn.writer.close()
        else:
            await conn.send(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            for _ in range(3):
                assert await fetch(c, t) == b"{}"
            assert c.connects == 3 and c.idle_connections == 0

    run(body())


def test_empty_bodies_and_bodies_until_close() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        path = head.split(b" ")[1]
        if path == b"/empty":
            await conn.send(answer(b""))
        elif path == b"/204":
            await conn.send(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:  # neither Content-Length nor chunked: the body ends with the connection
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",
                            b'{"a":', b" 1}", gap=0.01)
            conn.writer.close()

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            for path in ("/empty", "/204", "/empty"):
                r = await c.request(c.target(srv.url + path), b"{}", {})
                assert await read_all(r) == b"" and r.content.at_eof()
                r.release()
            assert c.connects == 1  # empty answers keep the connection
            r = await c.request(c.target(srv.url + "/eof"), b"{}", {})
            assert await read_all(r) == b'{"a": 1}'
            r.release()
            assert c.open_connections == 0  # the /eof one (the pooled one) is gone
            # header values pass through as the client sent them (bytes kept)
            r = await c.request(c.target(srv.url + "/empty"), b"{}",
                                {"X-Session-ID": "caf\udcc3\udca9"})
            await read_all(r)
            r.release()
            assert b"X-Session-ID: caf\xc3\xa9\r\n" in srv.requests[-1][0]

    run(body())


def test_chunked_sse_is_read_byte_exact_across_odd_chunk_boundaries() -> None:
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
              b"data: [DONE]\n\n"]
    stream = b"".join(events)

    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
        cuts = [0, 5, 6, 40, 41, 70, len(stream)]  # events split mid-line and mid-chunk
        wire = b"".join(chunk(stream[a:b]) for a, b in itertools.pairwise(cuts))
        await conn.send(wire[:3], wire[3:17], wire[17:], b"0\r\n\r\n", gap=0.01)

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/v1/completions")
            r = await c.request(t, b"{}", {}, read_timeout=2.0)
            assert r.status == 200 and r.content_type == "text/event-stream"
            assert await read_all(r) == stream
            assert r.content.at_eof()
            r.release()
            assert c.idle_connections == 1  # the terminator was read: reusable

    run(body())


def test_stale_keep_alive_connection_is_retried_once_on_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # closed as soon as read, i.e. right after our write; a busy shared machine may
    # pause this process past the default window, which is not what is tested here
    monkeypatch.setattr(lean_http, "STALE_WINDOW_S", 0.5)

    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if conn.requests == 2:  # the keep-alive race: closed without a byte
            conn.writer.close()
            return
        await conn.send(answer(b"{}"))

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            for _ in range(2):
                r = await c.request(t, b"{}", {})
                assert r.status == 200
                await read_all(r)
                r.release()
            assert c.connects == 2 and len(srv.requests) == 3 and c.resends == 1

    run(body())


async def _read_request(sock: socket.socket) -> bytes:
    """One Content-Length request from a raw non-blocking socket: its body."""
    loop = asyncio.get_running_loop()
    data = b""
    while b"\r\n\r\n" not in data:
        got = await loop.sock_recv(sock, 65536)
        assert got, "closed before a whole request head"
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(v) for n, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                  if n.strip().lower() == b"content-length")
    while len(body) < length:
        body += await loop.sock_recv(sock, 65536)
    return body


async def _serve_one(lsock: socket.socket) -> tuple[socket.socket, bytes]:
    """Accept a connection, read one request and answer it; the socket stays open
    and unread (an idle keep-alive connection) for the caller to close."""
    loop = asyncio.get_running_loop()
    sock, _ = await loop.sock_accept(lsock)
    try:
        got = await _read_request(sock)
        await loop.sock_sendall(sock, answer(b"{}"))
    except BaseException:
        sock.close()
        raise
    return sock, got


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_stale_pooled_connection_is_resent_once_transparently(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The node closed an idle pooled connection (its keep-alive timeout) and its FIN
    or RST is in our socket, but our loop has not read it yet: the pool hands the
    connection out, the write goes to a dead socket, and the request, which the node
    never read, goes once more on a new connection."""
    # the EOF/reset is seen one loop turn after the write; a busy shared machine may
    # pause this process past the default window, which is not what is tested here
    monkeypatch.setattr(lean_http, "STALE_WINDOW_S", 0.5)

    async def body() -> None:
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            lsock.setblocking(False)
            url = f"http://127.0.0.1:{lsock.getsockname()[1]}/x"
            async with open_client() as c:
                t = c.target(url)
                node = asyncio.ensure_future(_serve_one(lsock))
                r = await c.request(t, b'{"n": 1}', {})
                s1, got1 = await node
                with s1:
                    assert await read_all(r) == b"{}"
                    r.release()
                    assert got1 == b'{"n": 1}' and c.idle_connections == 1
                    if how == "rst":
                        s1.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      struct.pack("ii", 1, 0))
                    node = asyncio.ensure_future(_serve_one(lsock))
                # s1 is closed now, synchronously: the FIN (RST) is in our socket
                # before our loop runs again, and request() writes before it does
                r = await c.request(t, b'{"n": 2}', {})
                s2, got2 = await node
                with s2:
                    assert r.status == 200 and await read_all(r) == b"{}"
                    r.release()
                    assert got2 == b'{"n": 2}'  # processed once, on the new connection
                    assert c.resends == 1 and c.connects == 2

    run(body())


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_reused_connection_dropped_after_work_is_not_resent(how: str) -> None:
    """The node read the request on a reused connection, worked on it, then dropped
    the connection without a byte: the request may have run, so it is not sent
    again; the failure is raised as on a new connection (an upstream error, for the
    gateway's retry rule to judge)."""
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if conn.requests == 2:
            await asyncio.sleep(0.2)  # the generation runs
            if how == "close":
                conn.writer.close()
            else:
                conn.writer.transport.abort()
            return
        await conn.send(answer(b"{}"))

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            await fetch(c, t)
            with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) as err:
                await c.request(t, b"{}", {})
            assert classify_exception(err.value) is FailureKind.UPSTREAM_ERROR
            assert len(srv.requests) == 2 and srv.connections == 1
            assert c.connects == 1 and c.resends == 0 and c.open_connections == 0

    run(body())


def test_a_reused_connection_closed_mid_answer_is_not_resent() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if conn.requests == 2:  # a byte of an answer went out: the node saw the request
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-")
            conn.writer.close()
            return
        await conn.send(answer(b"{}"))

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            await fetch(c, t)
            with pytest.raises(aiohttp.ClientError) as err:
                await c.request(t, b"{}", {})
            assert classify_exception(err.value) is FailureKind.UPSTREAM_ERROR
            assert len(srv.requests) == 2 and c.connects == 1

    run(body())


def test_a_first_request_closed_without_an_answer_is_not_resent() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        conn.writer.close()

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            with pytest.raises(aiohttp.ServerDisconnectedError) as err:
                await c.request(c.target(srv.url + "/x"), b"{}", {})
            assert classify_exception(err.value) is FailureKind.UPSTREAM_ERROR
            assert len(srv.requests) == 1 and c.open_connections == 0

    run(body())


def test_failures_map_to_the_same_kinds_as_aiohttp() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        path = head.split(b" ")[1]
        if path == b"/503":
            await conn.send(answer(b"{}", "503 Service Unavailable"))
        elif path == b"/reject":
            await conn.send(answer(b"{}", "503 Service Unavailable",
                                   extra="X-Kvgate-Reject: retry-elsewhere\r\n"))
        elif path == b"/garbage":
            await conn.send(b"HTTP/1.1 abc nonsense\r\n\r\n")
        elif path == b"/short":
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}")
            conn.writer.close()
        elif path == b"/hang":
            await conn.wait_closed()
        elif path == b"/trickle":
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                            chunk(b"data: x\n\n"))
            await conn.wait_closed()

    async def body() -> None:
        async with RawServer(handler) as srv:
            async with open_client() as c:
                def t(path: str) -> Any:
                    return c.target(srv.url + path)

                r = await c.request(t("/503"), b"{}", {})
                assert classify_status(r.status, r.headers) is FailureKind.HTTP_503
                r.close()
                r = await c.request(t("/reject"), b"{}", {})
                assert classify_status(r.status, r.headers) is FailureKind.RETRY_ELSEWHERE
                r.close()
                with pytest.raises(UpstreamProtocolError) as perr:
                    await c.request(t("/garbage"), b"{}", {})
                assert classify_exception(perr.value) is FailureKind.UPSTREAM_ERROR
                r = await c.request(t("/short"), b"{}", {})
                with pytest.raises(aiohttp.ClientPayloadError) as short:
                    await read_all(r)
                r.close()
                assert classify_exception(short.value) is FailureKind.UPSTREAM_ERROR

                # the total and the read (idle) timeout, each before the headers and
                # while reading a body (between chunks)
                for kind in ("total_timeout", "read_timeout"):
                    with pytest.raises(TimeoutError) as before:
                        await c.request(t("/hang"), b"{}", {}, **{kind: 0.2})
                    assert classify_exception(before.value) is FailureKind.TIMEOUT
                    r = await c.request(t("/trickle"), b"{}", {}, **{kind: 0.3})
                    assert await r.content.readany() == b"data: x\n\n"
                    with pytest.raises(TimeoutError):
                        await r.content.readany()
                    r.close()
                assert c.open_connections == 0  # every failed exchange was closed
            await asyncio.sleep(0.05)
            assert srv.closed_by_peer >= 4

    run(body())


def test_connect_refused_and_connect_timeout_are_connect_errors() -> None:
    async def body() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with open_client() as c:
            with pytest.raises(aiohttp.ClientError) as refused:
                await c.request(c.target(f"http://127.0.0.1:{port}/x"), b"{}", {})
            assert isinstance(refused.value, OSError)
            assert classify_exception(refused.value) is FailureKind.CONNECT_ERROR
            assert c.open_connections == 0
        async with open_client(connect_timeout_s=1e-9) as c:
            with pytest.raises(aiohttp.ConnectionTimeoutError) as slow:
                await c.request(c.target(f"http://127.0.0.1:{port}/x"), b"{}", {})
            assert classify_exception(slow.value) is FailureKind.CONNECT_ERROR
            assert c.open_connections == 0

    run(body())


def test_cancellation_closes_the_connection() -> None:
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                        chunk(b"data: x\n\n"))
        await conn.wait_closed()

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            task = asyncio.ensure_future(c.request(t, b"{}", {"A": "b"}))
            await asyncio.sleep(0)
            task.cancel()  # before the answer: the client closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task
            r = await c.request(t, b"{}", {})
            await r.content.readany()
            r.close()  # mid-body: closed, not pooled
            assert c.open_connections == 0 and c.idle_connections == 0
            for _ in range(50):
                if srv.closed_by_peer == 2:
                    break
                await asyncio.sleep(0.02)
            assert srv.closed_by_peer == 2

    run(body())


def test_pool_limit_waits_for_a_free_connection() -> None:
    async def body() -> None:
        async with RawServer(ok) as srv, open_client(limit=1) as c:
            t = c.target(srv.url + "/x")
            t2 = c.target(srv.url.replace("127.0.0.1", "localhost") + "/y")
            first = await c.request(t, b"{}", {})
            waiting = asyncio.ensure_future(c.request(t2, b"{}", {}))
            await asyncio.sleep(0.05)
            assert not waiting.done() and c.open_connections == 1
            await read_all(first)
            first.release()  # pooled for t, then evicted for t2's waiter
            second = await waiting
            await read_all(second)
            second.release()
            assert c.open_connections == 1 and c.connects == 2

    run(body())


def test_bad_header_values_and_urls_are_refused() -> None:
    async def body() -> None:
        async with open_client() as c:
            t = c.target("http://127.0.0.1:1/x")
            with pytest.raises(ValueError):
                await c.request(t, b"{}", {"X-Evil": "a\r\nInjected: 1"})
            with pytest.raises(ValueError):
                c.target("ftp://host/x")
            assert c.target("https://h/v1/x?a=1").head == b"POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\n"
            assert c.target("http://[::1]:8000/v").head.endswith(b"Host: [::1]:8000\r\n")

    run(body())


def test_idle_connections_past_keepalive_are_not_reused() -> None:
    async def body() -> None:
        async with RawServer(ok) as srv, open_client(keepalive_s=0.05) as c:
            t = c.target(srv.url + "/x")
            for _ in range(2):
                await fetch(c, t)
                await asyncio.sleep(0.1)
            assert c.connects == 2 and c.open_connections == 0

    run(body())


def test_idle_connections_are_closed_once_past_keepalive() -> None:
    """A burst's connections close once idle past keepalive_s, with no request to meet
    them: they used to stay open until the node hung up (which may be never)."""

    async def body() -> None:
        async with RawServer(ok) as srv, open_client(keepalive_s=0.2) as c:
            t = c.target(srv.url + "/x")

            await asyncio.gather(*(fetch(c, t) for _ in range(3)))
            assert c.connects == 3 and c.open_connections == 3
            async with asyncio.timeout(5):  # closed by the timer, with no request to meet them
                while c.open_connections:
                    await asyncio.sleep(0.05)
            assert not c._idle
            await fetch(c, t)  # a new connection, and the pool works on
            assert c.connects == 4 and c.open_connections == 1

    run(body())


def test_upstream_picks_the_client_by_config() -> None:
    async def body() -> None:
        async with RawServer(ok) as srv:
            for kind in ("lean", "aiohttp"):
                up = Upstream(UpstreamConfig(client=kind), NodesConfig())  # type: ignore[arg-type]
                try:
                    assert (up.lean is not None) == (kind == "lean")
                    assert (up.session is not None) == (kind == "aiohttp")
                    r = await up.post(up.url(srv.url, "/v1/completions"), b"{}", {},
                                      stream=False)
                    assert r.status == 200 and json.loads(await r.content.read()) == {"ok": 1}
                    r.release()
                finally:
                    await up.close()

    run(body())


# --------------------------------------------------------------------------- via the gateway
def _completion(model: str) -> bytes:
    """A whole HTTP answer: a one-token completion."""
    return answer(json.dumps({
        "id": "x", "object": "text_completion", "model": model,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
    ).encode())


async def _probe_answers(conn: RawConn, head: bytes) -> bool:
    """The node watcher's GETs (health, models, metrics); True if ``head`` was one."""
    if not head.startswith(b"GET "):
        return False
    path = head.split(b" ")[1]
    if path == b"/health":
        await conn.send(answer(b""))
    elif path == b"/v1/models":
        await conn.send(answer(json.dumps({"object": "list", "data": [
            {"id": "stub-model", "object": "model", "max_model_len": 4096}]}).encode()))
    else:
        await conn.send(answer(b"", "404 Not Found"))
    return True


@pytest.mark.parametrize("kind", ["lean", "aiohttp"])
def test_gateway_relays_chunked_sse_byte_exact(kit: Any, kind: str) -> None:
    """The client asked for usage, so nothing is dropped: the bytes the node sent,
    however they were chunked, are the bytes the client gets."""
    events = [b'data: {"id":"c1","choices":[{"index":0,"text":"t%d "}]}\n\n' % i
              for i in range(3)]
    events.append(b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":5,'
                  b'"completion_tokens":3,"total_tokens":8,'
                  b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n')
    events.append(b"data: [DONE]\n\n")
    stream = b"".join(events)
    posted_on: set[int] = set()

    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if await _probe_answers(conn, head):
            return
        posted_on.add(conn.index)
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
        cuts = [0, 7, 60, 61, 150, len(stream) - 3, len(stream)]
        for a, b in itertools.pairwise(cuts):
            await conn.send(chunk(stream[a:b]), gap=0.005)
        await conn.send(b"0\r\n\r\n")

    async def body() -> None:
        async with RawServer(handler) as srv, kit.cluster(
                0, extra_nodes=[{"id": "raw", "url": srv.url}],
                upstream={"client": kind}, nodes={"health_interval_s": 30.0}) as c:
            for _ in range(2):
                status, headers, raw = await c.post("/v1/completions", {
                    "model": kit.MODEL, "prompt": "x", "stream": True,
                    "stream_options": {"include_usage": True}})
                assert status == 200 and headers["X-Kvgate-Node"] == "raw"
                assert raw == stream
            assert len(posted_on) == 1  # one connection, kept alive between the two
            hits = c.gw.controller.stats.hits
            assert sum(h.measured_hit_tokens for h in hits.values()) > 0  # usage was read

    kit.run(body())


@pytest.mark.parametrize("kind", ["lean", "aiohttp"])
def test_gateway_does_not_resend_a_request_the_node_dropped_after_work(
        kit: Any, kind: str) -> None:
    """The audit's case: the node reads the second POST on a kept-alive connection,
    works on it, then drops the connection without a byte. The generation must not
    run twice: the gateway answers 502, counted as an upstream failure, like aiohttp."""
    prompts: list[str] = []
    posts_on: dict[int, int] = {}

    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if await _probe_answers(conn, head):
            return
        prompts.append(json.loads(body)["prompt"])
        posts_on[conn.index] = posts_on.get(conn.index, 0) + 1
        if posts_on[conn.index] == 2:
            await asyncio.sleep(0.2)  # the generation runs, then the connection drops
            conn.writer.transport.abort()
            return
        await conn.send(_completion(kit.MODEL))

    async def body() -> None:
        async with RawServer(handler) as srv, kit.cluster(
                0, extra_nodes=[{"id": "raw", "url": srv.url}],
                upstream={"client": kind}, nodes={"health_interval_s": 30.0}) as c:
            status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL,
                                                            "prompt": "first"})
            assert status == 200
            status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL,
                                                            "prompt": "second"})
            assert status == 502
            assert prompts == ["first", "second"]  # the second one ran once
            st = c.gw.controller.stats
            assert st.failures["upstream_error"] == 1 and sum(st.retries.values()) == 0
            lean = c.gw.gateway.upstream.lean
            if lean is not None:
                assert lean.resends == 0

    kit.run(body())


def test_gateway_counts_the_requests_it_resent_on_a_new_connection(
        kit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keep-alive race (the node closes a reused connection as the request arrives,
    without reading it) is resent once transparently; /metrics says how often (the
    client counted it, and nothing showed it)."""
    monkeypatch.setattr(lean_http, "STALE_WINDOW_S", 0.5)
    posts_on: dict[int, int] = {}

    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        if await _probe_answers(conn, head):
            return
        posts_on[conn.index] = posts_on.get(conn.index, 0) + 1
        if posts_on[conn.index] == 2:  # closed as soon as read: never processed
            conn.writer.close()
            return
        await conn.send(_completion(kit.MODEL))

    async def body() -> None:
        async with RawServer(handler) as srv, kit.cluster(
                0, extra_nodes=[{"id": "raw", "url": srv.url}],
                upstream={"client": "lean"}, nodes={"health_interval_s": 30.0}) as c:
            for prompt in ("first", "second"):
                status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL,
                                                                "prompt": prompt})
                assert status == 200
            _, _, page = await c.get("/metrics")
            assert "kvgate_upstream_resends_total 1\n" in page.decode()

    kit.run(body())


@pytest.mark.parametrize("kind", ["lean", "aiohttp"])
def test_gateway_paths_with_either_client(kit: Any, kind: str) -> None:
    """Unary, stream, 503 retry, connect refused and a client disconnect, per client."""
    async def body() -> None:
        async with kit.cluster(2, upstream={"client": kind}) as c:
            status, _, raw = await c.post("/v1/completions", {"model": kit.MODEL,
                                                              "prompt": "a"})
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == "hi there"
            status, _, raw = await c.post("/v1/completions", {"model": kit.MODEL,
                                                              "prompt": "b", "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            c.stubs[0].mode = "retry-elsewhere"
            c.stubs[1].mode = "503"
            status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL,
                                                             "prompt": "c"})
            assert status == 503  # both nodes said 503: the retry failed too, nothing ran
            st = c.gw.controller.stats
            assert st.failures["retry_elsewhere"] + st.failures["http_503"] == 2
            assert sum(st.retries.values()) == 1

        dead = {"id": "dead", "url": f"http://127.0.0.1:{kit.closed_port()}",
                "models": [kit.MODEL]}
        async with kit.cluster(1, upstream={"client": kind}, extra_nodes=[dead],
                               nodes={"health_interval_s": 30.0}) as c:
            ctl = c.gw.controller
            ctl.set_healthy("dead", True, 0.0)  # type: ignore[arg-type]
            status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL, "prompt": "d"},
                                        headers={"X-Kvgate-Exclude-Node": "n0"})
            assert status in (502, 503)
            assert ctl.stats.failures["connect_error"] == 1

        async with kit.cluster(1, stub={"mode": "slow"}, upstream={"client": kind}) as c:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(c.url + "/v1/completions", json={
                    "model": kit.MODEL, "prompt": "z", "stream": True})
                assert (await resp.content.readany()).startswith(b"data: ")
                resp.close()
            stub = c.stubs[0]
            await kit.eventually(lambda: stub.disconnects == 1)
            ctl = c.gw.controller
            await kit.eventually(lambda: ctl.num_requests() == 0)
            assert ctl.admission.inuse_total == 0
            lean = c.gw.gateway.upstream.lean
            if lean is not None:
                await kit.eventually(lambda: lean.open_connections == 0)

    kit.run(body())


# ----------------------------------------------------------- audit cases (helper session)
def test_credentials_in_the_node_url_are_sent_as_basic_auth() -> None:
    """A node URL http://user:pw@host: aiohttp (and so the health probes) sends Basic
    auth; the lean client dropped it, and every proxied request got the node's 401."""
    async def body() -> None:
        async with RawServer(ok) as srv, open_client() as c:
            url = srv.url.replace("http://", "http://user:secret@") + "/v1/completions"
            await fetch(c, c.target(url))
            head = srv.requests[0][0]
            assert b"\r\nAuthorization: Basic dXNlcjpzZWNyZXQ=\r\n" in head
            assert b"secret" not in head and b"user:" not in head
    # a token alone (http://:token@host), as aiohttp reads it: ":token"
    assert b"Authorization: Basic OnRva2Vu\r\n" in Target("http://:token@h:1/x").head

    run(body())


@contextlib.asynccontextmanager
async def _raw_server(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                        Awaitable[None]]) -> AsyncIterator[str]:
    """A server whose handler writes exact bytes; its URL. Handlers still running on the
    way out are cancelled and their connections closed."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(r, w)
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def test_a_connection_with_request_bytes_unsent_is_not_pooled() -> None:
    """The node answered (a 413) before reading a large body and kept the connection: the
    rest of the body was still queued, and the next request sent there queued behind it
    (the node read body bytes as its request line, and the request failed)."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\n{}")
        await w.drain()
        await asyncio.sleep(1.0)  # never reads the body

    async def body() -> None:
        async with _raw_server(handler) as url, open_client() as c:
            r = await c.request(c.target(url + "/x"), b"x" * (32 << 20), {})
            assert r.status == 413 and await read_all(r) == b"{}"
            r.release()
            assert c.idle_connections == 0 and c.open_connections == 0

    run(body())


def test_a_read_timeout_still_runs_after_a_1xx() -> None:
    """A 100 Continue or 103 Early Hints, then silence: the timer had ended with the 1xx,
    so the answer proper was waited for without end."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
        await w.drain()
        await asyncio.sleep(3.0)

    async def body() -> None:
        async with _raw_server(handler) as url, open_client() as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(aiohttp.ServerTimeoutError):
                r = await c.request(c.target(url + "/x"), b"{}", {}, read_timeout=0.3)
                await read_all(r)
            assert loop.time() - t0 < 1.5

    run(body())


def test_an_answer_nobody_asked_for_is_not_taken_for_the_next_one() -> None:
    """The node says "408, Connection: close" on an idle pooled connection and has not
    closed it yet: the next request went out there and was handed that 408."""
    async def handler(conn: RawConn, head: bytes, body: bytes) -> None:
        await conn.send(answer(b"{}"))
        if conn.requests == 1:
            await asyncio.sleep(0.05)
            await conn.send(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                            b"Content-Length: 0\r\n\r\n")

    async def body() -> None:
        async with RawServer(handler) as srv, open_client() as c:
            t = c.target(srv.url + "/x")
            await fetch(c, t)
            await asyncio.sleep(0.2)
            r = await c.request(t, b"{}", {})
            assert r.status == 200
            await read_all(r)
            r.release()
            assert srv.connections == 2 and len(srv.requests) == 2

    run(body())


def test_a_woken_waiter_that_loses_the_connection_stays_first_in_line() -> None:
    """limit 1: W1 then W2 wait; a request arriving just as the connection is given back
    takes it; W1 must still go before W2 (it went to the back of the line)."""
    async def slow(conn: RawConn, head: bytes, body: bytes) -> None:
        await asyncio.sleep(0.05)
        await conn.send(answer(b"{}"))

    async def body() -> None:
        async with RawServer(slow) as srv, open_client(limit=1) as c:
            t = c.target(srv.url + "/x")
            done: list[str] = []
            held = await c.request(t, b"{}", {})

            async def one(name: str) -> None:
                await fetch(c, t)
                done.append(name)

            w1 = asyncio.ensure_future(one("W1"))
            await asyncio.sleep(0.01)
            w2 = asyncio.ensure_future(one("W2"))
            await asyncio.sleep(0.01)
            await read_all(held)
            late = asyncio.ensure_future(one("late"))
            held.release()
            await asyncio.gather(w1, w2, late)
            assert done == ["late", "W1", "W2"]

    run(body())
