"""`kvgate engine` shares the gateway's HTTP edge (kvgate.edge): the same answers to
unknown codings, a gzip body answered before it is all in, bytes after a "close"
request and request lines it does not speak (each failed before)."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from typing import Any

import pytest

from kvgate.testing import raw_exchange as exchange

pytestmark = pytest.mark.asyncio

BODY = b'{"model":"kvgate-sim","prompt":"hi","max_tokens":2}'


def post(body: bytes, *headers: str, length: int | None = None) -> bytes:
    head = ["POST /v1/completions HTTP/1.1", "Host: x", "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def status_and_code(raw: bytes) -> tuple[int, str | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]["code"]


async def test_an_unknown_content_encoding_is_a_415(start_server: Any) -> None:
    server = await start_server()
    raw, _ = await exchange(server.url, post(BODY, "Content-Encoding: foo",
                                             "Connection: close"))
    assert status_and_code(raw) == (415, "unsupported_content_encoding")
    raw, _ = await exchange(server.url, post(gzip.compress(BODY), "Content-Encoding: x-gzip",
                                             "Connection: close"))
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]


async def test_a_gzip_body_past_the_limit_ends_its_connection(start_server: Any) -> None:
    """413 once it inflates past max_body_bytes, and the rest of the body (held back
    here) is not waited for: the connection ends at once."""
    server = await start_server(max_body_bytes=1 << 20)
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join([co.compress(b"a" * (1 << 20)) for _ in range(256)] + [co.flush()])
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(post(bomb[: len(bomb) // 2], "Content-Encoding: gzip", length=len(bomb)))
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
    assert status_and_code(raw) == (413, "request_too_large")


async def test_a_close_request_with_bytes_behind_it_and_http2_lines(
        start_server: Any) -> None:
    server = await start_server()
    raw, _ = await exchange(server.url, post(BODY, "Connection: close")
                            + b"GET /health HTTP/1.1\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.") == 1, raw[:200]
    raw, _ = await exchange(server.url, b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 505")
    assert status_and_code(raw) == (505, "http_version_not_supported")
    raw, _ = await exchange(server.url, b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_and_code(raw) == (501, "method_not_implemented")
