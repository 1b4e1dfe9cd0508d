"""A minimal, fast stand-in for a vLLM node, for measuring the gateway's own cost.

    python benchmarks/stub_upstream.py [--host 127.0.0.1] [--port 8100] [--model stub-model]

It speaks just enough of vLLM's OpenAI server for kvgate's gateway and for wrk:

* ``GET /health``: 200, empty body
* ``GET /v1/models``: one model with ``max_model_len``
* ``GET /metrics``: vLLM's load gauges, all zero
* ``POST /v1/completions`` and ``POST /v1/chat/completions``: a small fixed answer
  with ``usage.prompt_tokens_details.cached_tokens``; with ``"stream": true`` a few
  SSE chunks (chunked transfer encoding, one write per event), the usage chunk when
  ``stream_options.include_usage`` is true (as vLLM), then ``data: [DONE]``
* anything else: 404 (so the gateway stops polling ``/kvgate/evictions``)

It is a raw :class:`asyncio.Protocol` HTTP/1.1 server (uvloop when installed) with
keep-alive, not kvgate's engine server: every answer is precomputed bytes, so the
stub costs a few microseconds per request and the gateway's cost stands out. It
reads Content-Length and chunked bodies (a malformed one is a 400 and the connection
closed); it does not do pipelining tricks beyond answering requests on one connection
in order. It prints one line,
``stub upstream listening on http://HOST:PORT``, once it accepts connections (port 0
picks a free port), and stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import socket
import sys
from typing import cast

MODEL = "stub-model"
MAX_MODEL_LEN = 32768
PROMPT_TOKENS = 400
CACHED_TOKENS = 384
COMPLETION_TOKENS = 4
MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_USAGE_RE = re.compile(rb'"include_usage"\s*:\s*true')


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(status: str, body: bytes, content_type: str, *, close: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    )
    return head.encode() + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _usage() -> dict[str, object]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
    }


class Answers:
    """Every answer the stub gives, as bytes computed once."""

    def __init__(self, model: str = MODEL, max_model_len: int = MAX_MODEL_LEN,
                 stream_chunks: int = COMPLETION_TOKENS) -> None:
        json_ct = "application/json"
        self.health = _response("200 OK", b"", json_ct)
        self.models = _response("200 OK", _json({
            "object": "list",
            "data": [{
                "id": model, "object": "model", "created": 0, "owned_by": "stub",
                "root": model, "parent": None, "max_model_len": max_model_len,
            }],
        }), json_ct)
        metrics = "".join(
            f"# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} 0.0\n"
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                         "vllm:kv_cache_usage_perc")
        ) + (
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total{{model_name=\"{model}\"}} 0.0\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total{{model_name=\"{model}\"}} 0.0\n"
        )
        self.metrics = _response("200 OK", metrics.encode(), "text/plain; version=0.0.4")
        self.not_found = _response("404 Not Found", _json({"detail": "Not Found"}), json_ct)
        self.bad_request = _response(
            "400 Bad Request", _json({"detail": "bad request"}), json_ct, close=True
        )
        text = " tok" * stream_chunks
        self.completion = _response("200 OK", _json({
            "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}],
            "usage": _usage(),
        }), json_ct)
        self.chat = _response("200 OK", _json({
            "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": "length"}],
            "usage": _usage(),
        }), json_ct)
        self.completion_stream = self._stream(model, stream_chunks, chat=False)
        self.chat_stream = self._stream(model, stream_chunks, chat=True)

    @staticmethod
    def _stream(model: str, n: int, *, chat: bool) -> tuple[bytes, list[bytes], bytes]:
        """(headers + first event, the other events, usage event); each a chunk."""
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        base = {"id": "chatcmpl-stub" if chat else "cmpl-stub",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": model}
        events: list[bytes] = []
        for i in range(n):
            last = i == n - 1
            if chat:
                choice: dict[str, object] = {
                    "index": 0, "delta": {"content": " tok"}, "logprobs": None,
                    "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": " tok", "logprobs": None,
                          "finish_reason": "length" if last else None, "stop_reason": None}
            events.append(_chunk(b"data: " + _json({**base, "choices": [choice]}) + b"\n\n"))
        usage = _chunk(b"data: " + _json({**base, "choices": [], "usage": _usage()}) + b"\n\n")
        done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        return head + events[0], [*events[1:], done], usage


class StubProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: requests answered in order, keep-alive by default."""

    __slots__ = ("answers", "buf", "transport")

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while self.transport is not None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail()
                return
            got = self._request(buf, end)
            if got is None:  # body not complete yet
                return
            consumed, method, target, body, close = got
            del buf[:consumed]
            self._answer(method, target, body)
            if close and self.transport is not None:
                self.transport.close()

    def _request(self, buf: bytearray, end: int
                 ) -> tuple[int, bytes, bytes, bytes, bool] | None:
        lines = bytes(buf[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            self._fail()
            return None
        method, target, version = parts
        length = 0
        chunked = False
        close = version == b"HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._fail()
                    return None
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                v = value.strip().lower()
                close = v == b"close" or (close and v != b"keep-alive")
        start = end + 4
        if chunked:
            try:
                decoded = _dechunk(buf, start)
            except BadChunk:
                self._fail()
                return None
            if decoded is None:
                if len(buf) - start > MAX_BODY:
                    self._fail()
                return None
            body, consumed = decoded
            return consumed, method, target, body, close
        if length < 0 or length > MAX_BODY:
            self._fail()
            return None
        if len(buf) < start + length:
            return None
        return start + length, method, target, bytes(buf[start:start + length]), close

    def _answer(self, method: bytes, target: bytes, body: bytes) -> None:
        t = self.transport
        assert t is not None
        a = self.answers
        path = target.split(b"?", 1)[0]
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            chat = path == b"/v1/chat/completions"
            if _STREAM_RE.search(body) is None:
                t.write(a.chat if chat else a.completion)
                return
            first, rest, usage = a.chat_stream if chat else a.completion_stream
            t.write(first)
            for i, ev in enumerate(rest):
                if i == len(rest) - 1 and _USAGE_RE.search(body) is not None:
                    t.write(usage)
                t.write(ev)
        elif method == b"GET" and path == b"/health":
            t.write(a.health)
        elif method == b"GET" and path == b"/v1/models":
            t.write(a.models)
        elif method == b"GET" and path == b"/metrics":
            t.write(a.metrics)
        else:
            t.write(a.not_found)

    def _fail(self) -> None:
        if self.transport is not None:
            self.transport.write(self.answers.bad_request)
            self.transport.close()
            self.transport = None


class BadChunk(ValueError):
    """A malformed chunked body: answered 400 and the connection closed."""


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """A complete chunked body from ``pos``: (body, end offset), else None (more to
    come). BadChunk for a size line that is not hex digits (optionally followed by
    ``;extensions``), a body over MAX_BODY, or chunk data not followed by CRLF."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > 1024:  # a size line does not run this long
                raise BadChunk("chunk size line too long")
            return None
        field = bytes(buf[pos:eol]).split(b";", 1)[0].strip(b" \t")
        if _CHUNK_SIZE_RE.fullmatch(field) is None:
            raise BadChunk(f"bad chunk size {field[:40]!r}")
        size = int(field, 16)
        if len(out) + size > MAX_BODY:
            raise BadChunk("chunked body too large")
        pos = eol + 2
        if size == 0:
            # trailers (none expected) end with an empty line
            end = buf.find(b"\r\n", pos)
            while end > pos:
                pos = end + 2
                end = buf.find(b"\r\n", pos)
            return (bytes(out), end + 2) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        if buf[pos + size:pos + size + 2] != b"\r\n":
            raise BadChunk("chunk data not followed by CRLF")
        out += buf[pos:pos + size]
        pos += size + 2


async def start_stub(host: str = "127.0.0.1", port: int = 0, *, model: str = MODEL,
                     max_model_len: int = MAX_MODEL_LEN,
                     stream_chunks: int = COMPLETION_TOKENS) -> asyncio.Server:
    """Serve on ``host:port`` in the running loop; ``bound_port(server)`` tells the port."""
    answers = Answers(model, max_model_len, stream_chunks)
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: StubProtocol(answers), host, port, reuse_address=True, backlog=4096
    )


def bound_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


async def _main(args: argparse.Namespace) -> None:
    server = await start_stub(args.host, args.port, model=args.model,
                              max_model_len=args.max_model_len,
                              stream_chunks=args.stream_chunks)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub upstream listening on http://{args.host}:{bound_port(server)}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A minimal, fast vLLM stand-in for benchmarks.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--stream-chunks", type=int, default=COMPLETION_TOKENS,
                   help="content events per streamed answer (default 4)")
    args = p.parse_args(argv)
    if args.stream_chunks < 1:
        p.error("--stream-chunks must be >= 1")
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
