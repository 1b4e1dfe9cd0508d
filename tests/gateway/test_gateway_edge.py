"""The HTTP edge under hostile or broken clients: raw bytes over a socket.

Every answer is OpenAI-shaped JSON (never aiohttp's text/plain echo of the client's
bytes), nothing is a 500, nothing waits for a timeout it does not need, and a bad
client costs one log line, not a traceback.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
from typing import Any

import pytest
from aiohttp import http_parser, web

from kvgate.edge import MAX_REQUEST_ID_LEN, client_request_id, http_exception_response
from kvgate.testing import raw_exchange

CHAT = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}'


exchange = raw_exchange


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def assert_openai_error(raw: bytes, status: int) -> dict[str, Any]:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return dict(err)


def post(body: bytes, *headers: str, path: str = "/v1/chat/completions") -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


# --------------------------------------------------------------- 1. encoded bodies


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_badly_encoded_body_is_400_not_500(kit: Any, caplog: pytest.LogCaptureFixture,
                                           encoding: str) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(CHAT, f"Content-Encoding: {encoding}"))
            err = assert_openai_error(raw, 400)
            assert err["code"] == "invalid_body"
            assert "Content-Encoding" in err["message"]
            # a correctly encoded body still works
            status, _, _ = await c.post("/v1/chat/completions", gzip.compress(CHAT),
                                        {"Content-Encoding": "gzip",
                                         "Content-Type": "application/json"})
            assert status == 200

    caplog.set_level(logging.INFO)
    kit.run(body())
    no_traceback(caplog)


def test_unsupported_content_encoding_is_an_openai_415(
        kit: Any, caplog: pytest.LogCaptureFixture) -> None:
    missing = [e for e, ok in (("br", http_parser.HAS_BROTLI),
                               ("zstd", http_parser.HAS_ZSTD)) if not ok]
    if not missing:
        pytest.skip("aiohttp can decode br and zstd here")

    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, post(CHAT, f"Content-Encoding: {missing[0]}"))
            err = assert_openai_error(raw, 415)
            assert err["code"] == "unsupported_content_encoding"

    caplog.set_level(logging.INFO)
    kit.run(body())
    no_traceback(caplog)


# ------------------------------------------------------------ 2. chunked framing


def test_bad_chunk_mid_body_is_an_immediate_400(kit: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with kit.cluster(1, server={"body_timeout_s": 3.0}) as c:
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            # the junk chunk-size line arrives while the handler is reading the body
            raw, took = await exchange(c.url, head + b"5\r\n{\"mod\r\n", b"zz\r\nabc\r\n",
                                       pause=0.2)
            err = assert_openai_error(raw, 400)
            assert err["code"] == "invalid_body"
            assert raw.count(b"HTTP/1.") == 1
            assert took < 2.0  # not body_timeout_s, then a 408
            status, _, _ = await c.get("/health")
            assert status == 200

    caplog.set_level(logging.INFO)
    kit.run(body())
    no_traceback(caplog)


# ------------------------------------------------------------- 3. header timeout

HEAD_TIMEOUT = {"header_timeout_s": 0.3}


def test_idle_and_slow_head_connections_are_closed(kit: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with kit.cluster(1, server=HEAD_TIMEOUT) as c:
            # nothing sent: closed silently
            raw, took = await exchange(c.url, b"", timeout=3)
            assert raw == b"" and took < 2
            # half a head, then a byte every 0.1 s (slowloris): the clock is not reset
            raw, took = await exchange(
                c.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                *[b"X" for _ in range(10)], pause=0.1, timeout=3)
            err = assert_openai_error(raw, 408)
            assert err["code"] == "request_timeout"
            assert took < 2
            status, _, _ = await c.get("/health")
            assert status == 200
            # the connection's own answers, which no middleware sees, are counted too
            for _ in range(3):
                await exchange(c.url, b"GET /health HTTP/1.1\r\n", timeout=3)
            await exchange(c.url, b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=3)
            _, _, page = await c.get("/metrics")
            text = page.decode()
            assert 'kvgate_http_responses_total{endpoint="connection",code="408"} 4' in text
            assert 'kvgate_http_responses_total{endpoint="connection",code="400"} 1' in text

    caplog.set_level(logging.INFO)
    kit.run(body())
    no_traceback(caplog)
    # four head timeouts in a row: one line, the client cannot fill the log
    lines = [r for r in caplog.records if "no complete request head" in r.getMessage()]
    assert len(lines) == 1


def test_keep_alive_and_long_streams_outlive_the_header_timeout(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, server=HEAD_TIMEOUT) as c:
            reader, writer = await asyncio.open_connection(*_addr(c.url))
            try:
                for _ in range(3):  # one connection, requests 0.2 s apart
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
                    assert head.startswith(b"HTTP/1.1 200")
                    length = int(parse(head)[1]["content-length"])
                    await asyncio.wait_for(reader.readexactly(length), 3)
                    await asyncio.sleep(0.2)
                # then idle past the timeout: closed without a word
                assert await asyncio.wait_for(reader.read(), 3) == b""
            finally:
                writer.close()
                await writer.wait_closed()

            c.stub("n0").mode = "slow"  # a stream of 200 tokens, 50 ms apart
            req = {"model": kit.MODEL, "prompt": "x", "stream": True}
            async with c.session.post(c.url + "/v1/completions", json=req) as r:
                assert r.status == 200
                start, events = time.monotonic(), 0
                async for line in r.content:
                    events += line.startswith(b"data: ")
                    if time.monotonic() - start > 1.0:  # > 3 header timeouts
                        break
                assert events >= 10

    kit.run(body())


# ------------------------------------------------------------ 4. parser errors

JUNK = "j" * 9000
PARSER_ERRORS = [
    ("9 KB header", post(CHAT, f"X-Junk: {JUNK}"), 431),
    ("9 KB URL", post(CHAT, path="/v1/" + JUNK), 414),
    ("150 headers", post(CHAT, *[f"X-H{i}: jjj" for i in range(150)]), 431),
    ("junk request line", b"jjjj jjjj jjjj\r\n\r\n", 400),
    ("junk method", b"GET / HTTP/1.1\r\n\r\nj\x01j /jjjj HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("Content-Length and Transfer-Encoding",
     post(b"5\r\njjjjj\r\n0\r\n\r\n", "Transfer-Encoding: chunked"), 400),
    ("NUL in a header", post(CHAT, "X-Junk: jj\x00jj"), 400),
    ("duplicate Content-Length", post(CHAT, "Content-Length: 3"), 400),
]


@pytest.mark.parametrize(("name", "raw_request", "status"), PARSER_ERRORS,
                         ids=[e[0] for e in PARSER_ERRORS])
def test_parser_errors_are_openai_json_with_one_log_line(
        kit: Any, caplog: pytest.LogCaptureFixture, name: str, raw_request: bytes,
        status: int) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            raw, _ = await exchange(c.url, raw_request)
            # the last answer on the connection is the parser's (a junk second request
            # follows a good one on the same connection in one case)
            last = raw[raw.rindex(b"HTTP/1."):]
            assert_openai_error(last, status)
            assert b"jjj" not in raw  # the client's bytes are not echoed
            status_ok, _, _ = await c.get("/health")
            assert status_ok == 200

    caplog.set_level(logging.INFO)
    kit.run(body())
    no_traceback(caplog)
    lines = [r for r in caplog.records if r.getMessage().startswith("rejected a request")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


# ---------------------------------------------------------------- 5. Expect headers


def _expect_head(expect: str, *headers: str, length: int = len(CHAT)) -> bytes:
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: x", "Content-Type: application/json",
            f"Content-Length: {length}", f"Expect: {expect}", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def test_expect_is_answered_only_for_a_body_the_gateway_would_take(kit: Any) -> None:
    """aiohttp answered 'Expect: 100-continue' with a 100 before any check, inviting an
    unknown caller's body, or one past client_max_size, and any other expectation with a
    text/plain 417 quoting it. Now: 401 / 413 / 417 as OpenAI JSON, and a 100 only for a
    known caller's body of an acceptable size."""

    async def body() -> None:
        keys = {"keys": {"sk-good-key": {"tenant": "t"}}}
        async with kit.cluster(1, auth=keys) as c:
            raw, _ = await exchange(c.url, _expect_head("100-continue"))
            assert not raw.startswith(b"HTTP/1.1 100"), raw[:100]
            assert parse(raw)[0] == 401
            raw, _ = await exchange(c.url, _expect_head(
                "100-continue", "Authorization: Bearer sk-good-key", length=10**9))
            assert assert_openai_error(raw, 413)["code"] == "request_too_large"
            raw, _ = await exchange(c.url, _expect_head(
                "the-moon", "Authorization: Bearer sk-good-key"))
            err = assert_openai_error(raw, 417)
            assert err["code"] == "expectation_failed" and "the-moon" not in err["message"]
            raw, _ = await exchange(
                c.url, _expect_head("100-continue", "Authorization: Bearer sk-good-key"), CHAT,
                pause=0.2)
            assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200"), raw[:120]
            # a GET route too: aiohttp's own text/plain 417 quoted the header
            for path in ("/health", "/v1/models", "/metrics", "/admin/nodes", "/dashboard"):
                raw, _ = await exchange(c.url, (
                    f"GET {path} HTTP/1.1\r\nHost: x\r\nExpect: the-moon\r\n"
                    "Connection: close\r\n\r\n").encode())
                err = assert_openai_error(raw, 417)
                assert err["code"] == "expectation_failed" and "the-moon" not in err["message"]

    kit.run(body())


def test_log_every_says_how_many_lines_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    from kvgate.edge import LogEvery

    logger = logging.getLogger("kvgate.test.log_every")
    lines = LogEvery(logger, every_s=0.05)
    caplog.set_level(logging.INFO, logger=logger.name)
    for i in range(5):
        lines.info("closing %d", i)
    time.sleep(0.06)
    lines.info("closing %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "closing 0",
        "closing 5 (and 4 more like it since the last one)",
    ]


def test_client_request_id_keeps_only_short_printable_ascii() -> None:
    # one rule for both apps (gateway and engine): anything else gets a generated id
    assert client_request_id("trace-42") == "trace-42"
    assert client_request_id("  trace 42 ") == "trace 42"
    assert client_request_id("x" * MAX_REQUEST_ID_LEN) == "x" * MAX_REQUEST_ID_LEN
    for bad in (None, "", "   ", "x" * (MAX_REQUEST_ID_LEN + 1), "caf\u00e9", "a\x01b",
                "bad\udcff"):
        assert client_request_id(bad) is None, bad


def test_aiohttp_http_errors_become_openai_bodies() -> None:
    def body(exc: web.HTTPException) -> tuple[int, dict[str, Any], str | None]:
        resp = http_exception_response(exc)
        assert resp.content_type == "application/json"
        assert isinstance(resp.body, bytes)
        return resp.status, json.loads(resp.body)["error"], resp.headers.get("Allow")

    assert body(web.HTTPNotFound())[:2] == (404, {
        "message": "Unknown request URL. Please check the URL and method.",
        "type": "invalid_request_error", "param": None, "code": "unknown_url"})
    status, err, allow = body(web.HTTPMethodNotAllowed("PUT", ["GET", "POST"]))
    assert (status, err["code"], allow) == (405, "method_not_allowed", "GET,POST")
    assert err["message"] == "Method not allowed. Allowed: GET,POST."
    status, err, _ = body(web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20))
    assert (status, err["code"]) == (413, "request_too_large")
    status, err, _ = body(web.HTTPServiceUnavailable())
    assert status == 503 and err["type"] != "invalid_request_error"
    status, err, _ = body(web.HTTPBadRequest(reason="nope"))
    assert (status, err["message"], err["type"]) == (400, "nope", "invalid_request_error")
