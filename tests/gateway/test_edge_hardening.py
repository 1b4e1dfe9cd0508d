"""The HTTP edge against what a client sends around a request: bodies answered before
they are read (a gzip bomb among them), codings, pipelined bytes after a "close"
request, Expect on unknown routes, request lines the parser takes or refuses, and a
client that reads none of a whole (non-streamed) answer. Raw bytes over a socket."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import zlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine

from kvgate.edge import EdgeRunner, parse_error
from kvgate.edge_body import read_body_within
from kvgate.gateway import GatewayServer, start_gateway
from kvgate.testing import raw_exchange as exchange

BODY = b'{"model":"stub-model","prompt":"hi","max_tokens":2}'
KEYS = {"keys": {"sk-good-key": {"tenant": "t"}}}


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def post(body: bytes, *headers: str, path: str = "/v1/completions",
         length: int | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every answer in ``raw`` (status, lower-cased headers, body by Content-Length)."""
    out = []
    while raw.startswith(b"HTTP/1."):
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        status = int(lines[0].split(" ")[1])
        if status == 100:
            out.append((status, headers, b""))
            raw = rest
            continue
        n = int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def error_code(body: bytes) -> str | None:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["code"]  # type: ignore[no-any-return]


def gzip_bomb(inflated_mib: int) -> bytes:
    """A gzip body of ``inflated_mib`` MiB of 'a' (about 1 KiB per MiB compressed)."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    mib = b"a" * (1 << 20)
    return b"".join([co.compress(mib) for _ in range(inflated_mib)] + [co.flush()])


async def metrics(c: Any) -> str:
    _, _, page = await c.get("/metrics")
    return page.decode()


# -------------------------------------------- 1. an answer before the body is all in


@pytest.mark.parametrize("refusal", ["401 bad key", "413 inflates past the limit"])
def test_an_answer_before_the_body_ends_closes_without_reading_the_rest(
        kit: Any, refusal: str) -> None:
    """aiohttp kept reading (and inflating) the rest of the body for up to 10 s after
    the answer, to keep the connection: a gzip of 1 GiB burned seconds of the event
    loop. Now the answer says Connection: close and our side is shut at once (a FIN)
    while the client has not sent the rest: it is never read."""

    async def body() -> None:
        bomb = gzip_bomb(1024)
        key = "sk-nope" if refusal.startswith("401") else "sk-good-key"
        async with kit.cluster(1, auth=KEYS, server={"client_max_size": 1 << 20}) as c:
            reader, writer = await asyncio.open_connection(*_addr(c.url))
            try:
                # a third of the body: inflates to ~340 MiB, the rest is held back
                writer.write(post(bomb[: len(bomb) // 3], "Content-Encoding: gzip",
                                  f"Authorization: Bearer {key}", length=len(bomb)))
                await writer.drain()
                raw = await asyncio.wait_for(reader.read(), 5.0)  # EOF: the gateway's FIN
            finally:
                writer.close()
            [(status, headers, answer)] = answers(raw)
            assert status == int(refusal[:3]), raw[:200]
            assert headers["connection"] == "close"
            if status == 413:
                assert error_code(answer) == "request_too_large"
            # the gateway is fine, and a body that came whole keeps its connection
            reader, writer = await asyncio.open_connection(*_addr(c.url))
            try:
                small = gzip.compress(BODY)
                for _ in range(2):
                    writer.write(post(small, "Content-Encoding: gzip",
                                      "Authorization: Bearer sk-nope"))
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
                    assert head.startswith(b"HTTP/1.1 401") and b"close" not in head.lower()
                    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(n)
            finally:
                writer.close()

    kit.run(body())


def test_a_gzip_body_is_refused_as_soon_as_it_inflates_past_the_limit() -> None:
    """aiohttp's read() raised the parser's inflate step to client_max_size, and gave no
    turn between steps: 5x the limit inflated (the event loop blocked meanwhile) before
    its 413. read_body_within stops a few of its 64 KiB steps past the limit."""
    limit = 4 << 20
    seen: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        try:
            await read_body_within(request, 10.0, TimeoutError)
        except web.HTTPRequestEntityTooLarge:
            seen["inflated"] = request.content.total_bytes
            return web.Response(status=413)
        return web.Response()

    async def body() -> None:
        app = web.Application(client_max_size=limit)
        app.router.add_post("/", handler)
        runner = EdgeRunner(app, header_timeout_s=5.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            bomb = gzip_bomb(256)
            raw, _ = await exchange(f"http://127.0.0.1:{port}", b"POST / HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                                    % (len(bomb), bomb))
            assert raw.startswith(b"HTTP/1.1 413")
        finally:
            await runner.cleanup()
        assert limit < seen["inflated"] <= limit + (2 << 20)  # it was limit + 17 MB

    asyncio.run(asyncio.wait_for(body(), 20))


def test_no_408_for_the_tail_of_a_body_answered_before_it_came(kit: Any) -> None:
    """The end of a body refused 413 came after the answer: it was taken as half a
    request head, and an unsolicited 408 followed, counted in /metrics."""

    async def body() -> None:
        limit = 64 * 1024
        async with kit.cluster(1, server={"client_max_size": limit,
                                          "header_timeout_s": 0.3}) as c:
            big = b'{"model":"stub-model","prompt":"' + b"a" * (2 * limit) + b'"}'
            request = post(big)
            raw, _ = await exchange(c.url, request[:-1000], request[-1000:], pause=0.3)
            assert [a[0] for a in answers(raw)] == [413], raw[:300]
            assert not raw.split(b"\r\n\r\n", 1)[1].count(b"HTTP/1.")
            await asyncio.sleep(0.5)  # past the head timeout: no 408 came, nor is counted
            assert 'endpoint="connection",code="408"' not in await metrics(c)

    kit.run(body())


# ------------------------------------------------- 2. a whole answer nobody reads


def test_a_client_that_reads_none_of_a_whole_answer_is_dropped(kit: Any) -> None:
    """A non-streamed answer was left to aiohttp, which waits without end for the client
    to take it: the connection and the answer (up to max_response_bytes) were held for
    good. Its writes are now bounded as a stream's (stream_idle_timeout_s)."""

    class BigAnswer(kit.StubEngine):  # type: ignore[misc]
        async def _answer(self, request: web.Request) -> web.StreamResponse:
            await request.read()
            text = "a" * (4 << 20)
            return web.json_response({"id": "c", "object": "text_completion", "created": 1,
                                      "model": kit.MODEL, "choices": [{"index": 0,
                                      "text": text, "finish_reason": "length"}]})

    async def body() -> None:
        stub = await BigAnswer(name="n0").start()
        gw: GatewayServer | None = None
        try:
            gw = await start_gateway(kit.config([{"id": "n0", "url": stub.url}],
                                                upstream={"stream_idle_timeout_s": 0.5}))
            loop = asyncio.get_running_loop()
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await loop.sock_connect(sock, _addr(gw.url))
                await loop.sock_sendall(sock, post(BODY))
                # ... and reads nothing: dropped once its writes stall for 0.5 s
                m = gw.gateway.metrics
                await kit.eventually(lambda: m.responses[("/v1/completions", 499)] == 1, 10.0)
                assert m.client_disconnects == 1
                with pytest.raises(ConnectionResetError):  # reset, not a quiet EOF
                    async with asyncio.timeout(5.0):
                        while await loop.sock_recv(sock, 1 << 16):
                            pass
            # a client that reads gets the whole answer
            async with aiohttp.ClientSession() as s, s.post(
                    gw.url + "/v1/completions", data=BODY,
                    headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                assert len((await r.json())["choices"][0]["text"]) == 4 << 20
        finally:
            if gw is not None:
                await gw.stop()
            await stub.stop()

    kit.run(body())


# --------------------------------------------------------- 3. Content-Encoding


@pytest.mark.parametrize("coding", ["foo", "gzip, gzip", "compress", "br;q=1", "GZIP\r\n"
                                    "Content-Encoding: gzip"])
def test_an_unknown_content_encoding_is_a_415(kit: Any, coding: str) -> None:
    """Read as identity ("foo": the node got the bytes as if plain) or a misleading "not
    valid JSON" 400: now an OpenAI 415, as br and zstd got from the parser."""

    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(gzip.compress(BODY), "Connection: close",
                                                f"Content-Encoding: {coding}"))
            [(status, _, answer)] = answers(raw)
            assert status == 415
            assert error_code(answer) == "unsupported_content_encoding"
            assert c.stubs[0].attempts == 0

    kit.run(body())


@pytest.mark.parametrize(("coding", "encode"), [
    ("x-gzip", gzip.compress), ("X-Gzip", gzip.compress), ("GZIP", gzip.compress),
    ("identity", bytes), (" deflate ", zlib.compress),
])
def test_the_codings_we_take(kit: Any, coding: str, encode: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(encode(BODY), f"Content-Encoding: {coding}",
                                                "Connection: close"))
            assert answers(raw)[0][0] == 200, raw[:300]
            assert c.stubs[0].seen[0].body["prompt"] == "hi"

    kit.run(body())


def test_x_gzip_that_does_not_decode_or_inflates_too_far(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, server={"client_max_size": 1 << 20}) as c:
            x_gzip = ("Content-Encoding: x-gzip", "Connection: close")
            raw, _ = await exchange(c.url, post(b"not gzip", *x_gzip))
            [(status, _, answer)] = answers(raw)
            assert (status, error_code(answer)) == (400, "invalid_body")
            truncated = gzip.compress(BODY)[:-6]
            raw, _ = await exchange(c.url, post(truncated, *x_gzip))
            assert answers(raw)[0][0] == 400
            bomb = gzip_bomb(64)
            raw, _ = await exchange(c.url, post(bomb, *x_gzip))
            [(status, _, answer)] = answers(raw)
            assert (status, error_code(answer)) == (413, "request_too_large")

    kit.run(body())


def test_expect_100_continue_with_an_unknown_coding_gets_415_not_100(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(b"", "Content-Encoding: foo",
                                                "Expect: 100-continue", length=len(BODY)))
            [(status, _, answer)] = answers(raw)
            assert (status, error_code(answer)) == (415, "unsupported_content_encoding")
            assert 'endpoint="/v1/completions",code="415"} 1' in await metrics(c)

    kit.run(body())


# -------------------------------------------- 4. bytes after a "close" request


@pytest.mark.parametrize("close", ["Connection: close", "HTTP/1.0"])
def test_a_close_request_with_more_bytes_behind_it_is_answered(kit: Any, close: str) -> None:
    """aiohttp refused the whole packet (a 400: "Data after Connection: close") and the
    request itself was lost. RFC 9112 9.6: answer it, then close, the rest unread."""

    async def body() -> None:
        async with kit.cluster(1) as c:
            request = post(BODY, "Connection: close")
            if close == "HTTP/1.0":
                request = request.replace(b"HTTP/1.1", b"HTTP/1.0").replace(
                    b"Connection: close\r\n", b"")
            pipelined = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            raw, _ = await exchange(c.url, request + pipelined)
            [(status, headers, _)] = answers(raw)
            assert status == 200, raw[:300]
            assert headers.get("connection", "close") == "close"
            assert c.stubs[0].attempts == 1
            # the head split over two packets, the body and more in the second
            split = request.index(b"\r\n", 20)
            raw, _ = await exchange(c.url, request[:split], request[split:] + b"junk junk",
                                    pause=0.1)
            assert [a[0] for a in answers(raw)] == [200], raw[:300]
            assert c.stubs[0].attempts == 2
            # two HTTP/1.0 GETs in one packet: the first answered, the second dropped
            raw, _ = await exchange(c.url, b"GET /health HTTP/1.0\r\n\r\n" * 2)
            assert [a[0] for a in answers(raw)] == [200]

    kit.run(body())


def test_a_keep_alive_request_before_the_close_one_is_answered_too(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(BODY) + post(BODY, "Connection: close")
                                    + b"GET /health HTTP/1.1\r\n\r\n")
            assert [a[0] for a in answers(raw)] == [200, 200], raw[:300]
            assert c.stubs[0].attempts == 2

    kit.run(body())


# ------------------------------------------------------- 6/7. Expect and its counts


def test_expect_on_an_unknown_route_is_refused_in_json_and_counted(kit: Any) -> None:
    """aiohttp's own expect handler took a request no route matched: a text/plain 417
    quoting the header, or a 100 Continue inviting a body certain to get a 404/405."""

    async def body() -> None:
        async with kit.cluster(1) as c:
            for request, status, code in [
                (post(b"", "Expect: 100-continue", path="/v1/nope", length=900_000_000),
                 404, "unknown_url"),
                (post(b"", "Expect: 100-continue", length=5).replace(b"POST", b"PUT", 1),
                 405, "method_not_allowed"),
                (post(b"", "Expect: <b>hi</b>", path="/v1/nope", length=5), 417,
                 "expectation_failed"),
                (b"POST /health HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nContent-Length: 2\r\n\r\n",
                 417, "expectation_failed"),
            ]:
                raw, _ = await exchange(c.url, request)
                assert not raw.startswith(b"HTTP/1.1 100"), raw[:100]
                [(got, headers, answer)] = answers(raw)
                assert (got, error_code(answer)) == (status, code), raw[:300]
                assert headers["content-type"].startswith("application/json")
                assert b"<b>" not in raw
                if status == 405:
                    assert headers["allow"] == "POST"
            text = await metrics(c)
            assert 'endpoint="unmatched",code="404"} 1' in text
            assert 'endpoint="unmatched",code="405"} 1' in text
            assert 'endpoint="unmatched",code="417"} 2' in text

    kit.run(body())


def test_answers_of_the_expect_handler_are_counted(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, auth=KEYS) as c:
            for expect, length, key in [("foo", 10, "sk-good-key"),
                                        ("100-continue", 10**9, "sk-good-key"),
                                        ("100-continue", 10, "sk-nope")]:
                raw, _ = await exchange(c.url, post(b"", f"Expect: {expect}",
                                                    f"Authorization: Bearer {key}",
                                                    length=length))
                assert not raw.startswith(b"HTTP/1.1 100")
            text = await metrics(c)
            for status in (417, 413, 401):
                assert f'endpoint="/v1/completions",code="{status}"}} 1' in text, status
            raw, _ = await exchange(c.url, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                    b"Expect: foo\r\nConnection: close\r\n\r\n")
            assert answers(raw)[0][0] == 417
            assert 'endpoint="/health",code="417"} 1' in await metrics(c)

    kit.run(body())


# --------------------------------------------------------------- 8. request lines


def test_unsupported_versions_get_505_and_unknown_methods_501(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            for line, status, code in [
                (b"GET /health HTTP/2.0", 505, "http_version_not_supported"),
                (b"GET /health HTTP/0.9", 505, "http_version_not_supported"),
                (b"GET /health HTTP/3.0", 505, "http_version_not_supported"),
                (b"FOO /health HTTP/1.1", 501, "method_not_implemented"),
                (b"GETX /health HTTP/1.1", 501, "method_not_implemented"),
                (b"G\x01T /health HTTP/1.1", 400, "malformed_request"),
            ]:
                # answered, then closed (exchange reads until the gateway closes)
                raw, _ = await exchange(c.url, line + b"\r\nHost: x\r\n\r\n")
                [(got, _, answer)] = answers(raw)
                assert (got, error_code(answer)) == (status, code), (line, raw[:200])
                assert raw.startswith(b"HTTP/1."), raw[:20]  # never "HTTP/2.0 ..."
            text = await metrics(c)
            assert 'endpoint="connection",code="505"} 3' in text
            assert 'endpoint="connection",code="501"} 2' in text

    kit.run(body())


def test_parse_error_tells_an_unknown_method_and_version_from_junk() -> None:
    # the pure-Python parser names the method alone
    assert parse_error(BadHttpMethod("PROPFIND2"))[0] == 501
    assert parse_error(BadHttpMethod("\x16\x03\x01"))[0] == 400  # TLS on an HTTP port
    assert parse_error(BadHttpMethod(error="Received HTTPS traffic on an HTTP port"))[0] == 400
    c_style = "Invalid method encountered:\n\n  b'FOO / HTTP/1.1'\n  ^"
    assert parse_error(BadHttpMethod(error=c_style))[0] == 501
    junk = "Invalid method encountered:\n\n  b'j\\x01j /jjjj HTTP/1.1'\n    ^"
    assert parse_error(BadHttpMethod(error=junk))[0] == 400
    version = "Bad status line:\n  Invalid HTTP version:\n\n  b'GET / HTTP/1.2'\n    ^"
    assert parse_error(BadStatusLine(error=version))[0] == 505
    assert parse_error(BadStatusLine(error="Bad status line 'jjjj'"))[0] == 400
