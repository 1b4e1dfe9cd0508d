"""A stub OpenAI-compatible server for the load generator's tests.

It streams ``tokens`` one-character tokens ``delay_s`` apart (then, ``tail_delay_s``
later, the usage chunk and ``[DONE]``), reports usage with a prefix cache of its own
(cached tokens = longest common prefix with any earlier prompt, in 4-character tokens,
rounded down to 64-character blocks), can fail chosen requests with an HTTP status or
a mid-stream error, can answer ``GET /v1/models`` with HTML or not at all, can stream
a script of raw bytes instead (then reset the connection if asked), and records what it
received and on how many connections.

:class:`Raw` answers with bytes aiohttp's server will not write (a body ended by closing
the connection, one that never ends).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web


@dataclass
class Stub:
    tokens: int = 4
    delay_s: float = 0.005
    fail: Callable[[int], int | None] = lambda i: None  # request index -> status
    stream_error_at: int | None = None  # request index that errors mid-stream
    cached: bool = True
    usage: bool = True  # False: no usage anywhere (a server that reports none)
    empty_text: bool = False  # token chunks carry empty text (special tokens)
    tail_delay_s: float = 0.0  # streaming: pause after the last token, before usage/[DONE]
    # streaming: these bytes, each written delay_s apart, instead of chunks/usage/[DONE]
    script: tuple[bytes, ...] | None = None
    reset: bool = False  # with script: abort the connection after it (no end of body)
    models_mode: str = "ok"  # GET /v1/models: "ok", "html" (200 text/html) or "hang"
    models_calls: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    peers: set[object] = field(default_factory=set)  # (host, port) of each connection
    prompts: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    base_url: str = ""

    def _prompt(self, body: dict[str, Any]) -> str:
        if "messages" in body:
            return str(body["messages"][-1]["content"])
        return str(body["prompt"])

    def _cached_tokens(self, prompt: str) -> int:
        best = 0
        for p in self.prompts:
            n = 0
            for a, b in zip(p, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return (best // 64 * 64) // 4

    def _usage(self, prompt: str, n_out: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": len(prompt) // 4,
                                 "completion_tokens": n_out,
                                 "total_tokens": len(prompt) // 4 + n_out}
        if self.cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self._cached_tokens(prompt)}
        self.prompts.append(prompt)
        return usage

    async def models(self, request: web.Request) -> web.Response:
        self.models_calls += 1
        if self.models_mode == "html":
            return web.Response(text="<html>\n<body>gateway login</body>\n</html>",
                                content_type="text/html")
        if self.models_mode == "hang":
            await asyncio.sleep(60)  # cancelled when the server stops
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.received)
        self.received.append(body)
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername"))
        chat = request.path.endswith("/chat/completions")
        status = self.fail(index)
        if status is not None:
            return web.json_response({"error": {"message": "stub failure"}}, status=status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n_out = min(self.tokens, int(body.get("max_tokens", self.tokens)))
            prompt = self._prompt(body)
            if not body.get("stream"):
                await asyncio.sleep(self.delay_s * n_out)
                text = "x" * n_out
                choice: dict[str, Any] = ({"message": {"role": "assistant", "content": text}}
                                          if chat else {"text": text})
                answer: dict[str, Any] = {"choices": [choice]}
                if self.usage:
                    answer["usage"] = self._usage(prompt, n_out)
                return web.json_response(answer)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: object) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            try:
                if self.script is not None:
                    for part in self.script:
                        await resp.write(part)
                        await asyncio.sleep(self.delay_s)  # its own read on the client
                    if self.reset and request.transport is not None:
                        request.transport.abort()
                    else:
                        await resp.write_eof()
                    return resp
                if chat:
                    await send({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                    "content": ""}}]})
                for k in range(n_out):
                    await asyncio.sleep(self.delay_s)
                    if index == self.stream_error_at and k == 1:
                        await send({"error": {"message": "boom", "code": 500}})
                        break
                    token = "" if self.empty_text else "x"
                    piece = {"delta": {"content": token}} if chat else {"text": token}
                    await send({"choices": [{"index": 0, **piece}]})
                await asyncio.sleep(self.tail_delay_s)
                usage = self._usage(prompt, n_out)
                if self.usage and body.get("stream_options", {}).get("include_usage"):
                    await send({"choices": [], "usage": usage})
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            except ConnectionResetError:  # the client went away (time bound)
                return resp
        finally:
            self.in_flight -= 1


@asynccontextmanager
async def serve(stub: Stub) -> AsyncIterator[Stub]:
    app = web.Application()
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/v1/completions", stub.complete)
    app.router.add_post("/v1/chat/completions", stub.complete)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        stub.base_url = f"http://{host}:{port}"
        yield stub
    finally:
        await runner.cleanup()


@pytest.fixture
def stub_server() -> Callable[..., AbstractAsyncContextManager[Stub]]:
    """``async with stub_server(tokens=4, ...) as stub:`` runs a :class:`Stub` with those
    settings on 127.0.0.1, port 0 (``stub.base_url``)."""

    def make(**kw: Any) -> AbstractAsyncContextManager[Stub]:
        return serve(Stub(**kw))

    return make


@dataclass
class Raw:
    """Answers every request with ``reply`` as it is, then: ``"close"`` the connection
    (a body without length ends there), ``"hang"`` (send nothing more until the client
    goes: an endless body) or ``"keep"`` (read the next request)."""

    reply: bytes
    then: str = "close"
    requests: int = 0
    base_url: str = ""


@asynccontextmanager
async def serve_raw(raw: Raw) -> AsyncIterator[Raw]:
    open_writers: set[asyncio.StreamWriter] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_writers.add(writer)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.startswith("content-length:")), 0)
                await reader.readexactly(length)
                raw.requests += 1
                writer.write(raw.reply)
                await writer.drain()
                if raw.then == "hang":
                    await reader.read()  # until the client closes
                if raw.then != "keep":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            open_writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        raw.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        yield raw
    finally:
        server.close()
        for writer in list(open_writers):
            writer.transport.abort()
        await server.wait_closed()


@pytest.fixture
def raw_server() -> Callable[..., AbstractAsyncContextManager[Raw]]:
    """``async with raw_server(reply, then="close") as raw:`` on 127.0.0.1, port 0."""

    def make(reply: bytes, then: str = "close") -> AbstractAsyncContextManager[Raw]:
        return serve_raw(Raw(reply, then))

    return make
