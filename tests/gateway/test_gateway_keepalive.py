"""SSE comments (``: keep-alive``) from a node: not the stream's first byte (TTFT, the
P0 SLO loop, the attempt stays retryable), forwarded once the answer has started."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.gateway import GatewayServer, start_gateway

C = "/v1/completions"
EVENT = b'data: {"id":"x","choices":[{"index":0,"text":"t"}]}\n\n'
DONE = b"data: [DONE]\n\n"
Stream = Callable[["Fake", web.StreamResponse], Awaitable[None]]


@dataclass
class Fake:
    name: str
    stream: Stream
    healthy: bool = True
    attempts: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def _gateway_over(
    kit: Any, fakes: list[Fake], **sections: dict[str, Any]
) -> AsyncIterator[GatewayServer]:
    runners: list[web.AppRunner] = []
    nodes = []
    for fake in fakes:
        def routes(fake: Fake) -> web.Application:
            async def health(request: web.Request) -> web.Response:
                return web.Response(status=200 if fake.healthy else 503)

            async def models(request: web.Request) -> web.Response:
                return web.json_response({"object": "list", "data": [
                    {"id": kit.MODEL, "object": "model", "max_model_len": 4096}]})

            async def metrics(request: web.Request) -> web.Response:
                return web.Response(text="vllm:num_requests_running 0\n")

            async def complete(request: web.Request) -> web.StreamResponse:
                await request.read()
                fake.attempts += 1
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await fake.stream(fake, resp)
                await resp.write_eof()
                return resp

            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_get("/v1/models", models)
            app.router.add_get("/metrics", metrics)
            app.router.add_post(C, complete)
            return app

        runner = web.AppRunner(routes(fake), handler_cancellation=True, shutdown_timeout=0.2)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        nodes.append({"id": fake.name, "url": f"http://127.0.0.1:{runner.addresses[0][1]}"})
    gw = None
    try:
        gw = await start_gateway(kit.config(nodes, **sections))
        yield gw
    finally:
        if gw is not None:
            await gw.stop()
        for runner in runners:
            await runner.cleanup()


def test_comments_after_the_first_event_are_forwarded(kit: Any) -> None:
    async def stream(fake: Fake, resp: web.StreamResponse) -> None:
        await resp.write(EVENT)
        await resp.write(b": keep-alive\n\n")
        await resp.write(EVENT + b":ping\r\n\r\n" + DONE)

    async def body() -> None:
        async with _gateway_over(kit, [Fake("a", stream)]) as gw, \
                aiohttp.ClientSession() as s:
            async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                assert r.status == 200
                out = await r.read()
            assert out == EVENT + b": keep-alive\n\n" + EVENT + b":ping\r\n\r\n" + DONE

    kit.run(body())


def test_a_comment_is_not_the_first_byte(kit: Any) -> None:
    async def stream(fake: Fake, resp: web.StreamResponse) -> None:
        for _ in range(3):  # a long prefill, the line kept alive
            await resp.write(b": keep-alive\n\n")
            await asyncio.sleep(0.15)
        await resp.write(EVENT + DONE)

    async def body() -> None:
        async with _gateway_over(kit, [Fake("a", stream)]) as gw, \
                aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            ctl = gw.controller
            seen: list[float] = []
            on_first_byte = ctl.on_first_byte

            def record(rid: Any, now: float) -> None:
                seen.append(loop.time())
                on_first_byte(rid, now)

            ctl.on_first_byte = record  # type: ignore[method-assign]
            t0 = loop.time()
            async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                assert r.status == 200
                out = await r.read()
            # the leading comments went with the client's response not yet started
            assert out == EVENT + DONE
            assert len(seen) == 1 and seen[0] - t0 >= 0.4, [t - t0 for t in seen]

    kit.run(body())


def _first_attempt_only_comments(fakes: list[Fake], comments: int) -> Stream:
    """A stream: the first attempt at any of ``fakes`` gets ``comments`` keep-alives 20
    ms apart and nothing else (its fake is marked started); every other one an answer."""

    async def stream(fake: Fake, resp: web.StreamResponse) -> None:
        if not any(f.started.is_set() for f in fakes):
            fake.started.set()
            for _ in range(comments):
                await resp.write(b": keep-alive\n\n")
                await asyncio.sleep(0.02)
            return
        await resp.write(EVENT + DONE)

    return stream


def test_a_node_down_after_only_comments_is_retried_elsewhere(kit: Any) -> None:
    # the first attempt gets keep-alives and nothing else; its node is then marked down:
    # with no data sent the attempt is aborted and retried on the other node
    fakes: list[Fake] = []
    stream = _first_attempt_only_comments(fakes, 300)
    fakes += [Fake("a", stream), Fake("b", stream)]

    async def body() -> None:
        async with _gateway_over(kit, fakes) as gw, aiohttp.ClientSession() as s:
            async def mark_down() -> None:
                started = [asyncio.ensure_future(f.started.wait()) for f in fakes]
                await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
                for task in started:
                    task.cancel()
                hung = next(f for f in fakes if f.started.is_set())
                await asyncio.sleep(0.1)  # a few keep-alives go by
                hung.healthy = False

            marker = asyncio.ensure_future(mark_down())
            async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                out = await r.read()
                status, node = r.status, r.headers.get("X-Kvgate-Node")
            await marker
            hung = next(f for f in fakes if f.started.is_set())
            assert status == 200 and out == EVENT + DONE, out
            assert node is not None and node != hung.name
            assert [f.attempts for f in fakes] == [1, 1]
            assert gw.controller.stats.retries == {"node_down": 1}

    kit.run(body())


def test_a_healthy_node_sending_only_comments_times_out(kit: Any) -> None:
    """A node that stays healthy but answers with keep-alive comments and never data:
    the comments kept the idle timer from firing, so the request and its credit were
    held for good (the client saw no status line at all). The first event has its own
    deadline; then the attempt fails as a timeout: a 502 (a timeout is not retried, the
    deadline is spent) and the credit back."""
    fakes: list[Fake] = []
    stream = _first_attempt_only_comments(fakes, 500)  # 10 s, well past the deadline
    fakes += [Fake("a", stream), Fake("b", stream)]

    async def body() -> None:
        upstream = {"first_event_timeout_s": 0.5, "stream_idle_timeout_s": 5.0}
        async with _gateway_over(kit, fakes, upstream=upstream) as gw, \
                aiohttp.ClientSession() as s:
            async with asyncio.timeout(5.0):
                async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                     "stream": True}) as r:
                    body = await r.json()
                    status = r.status
            assert status == 502 and body["error"]["code"] == "timeout", body
            assert sum(f.attempts for f in fakes) == 1
            assert gw.controller.stats.failures["timeout"] == 1
            assert gw.controller.admission.inuse_total == 0
            # the next request is answered (by a node that sends data)
            async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                assert r.status == 200 and await r.read() == EVENT + DONE

    kit.run(body())


def test_a_node_silent_mid_stream_ends_it_with_a_timeout_error_event(kit: Any) -> None:
    """After the first event the node goes quiet past the idle timeout: the client gets
    an error event saying so, code ``timeout`` (it said ``upstream_error``, "failed
    during generation", whatever the failure), then ``[DONE]``."""

    async def stream(fake: Fake, resp: web.StreamResponse) -> None:
        await resp.write(EVENT)
        await asyncio.sleep(3.0)

    fakes = [Fake("a", stream)]

    async def body() -> None:
        async with _gateway_over(kit, fakes, upstream={"stream_idle_timeout_s": 0.3}) as gw, \
                aiohttp.ClientSession() as s:
            async with s.post(gw.url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                out = await r.read()
            events = [e for e in out.decode().split("\n\n") if e]
            assert events[0] == EVENT.decode().strip() and events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: "):])["error"]
            assert err["code"] == "timeout" and "sent nothing for 0.3 s" in err["message"]
            assert gw.controller.admission.inuse_total == 0

    kit.run(body())


def test_a_client_closing_on_done_is_no_disconnect(kit: Any) -> None:
    """The node writes [DONE] and ends its chunked body a moment later; the client
    closes as soon as it has [DONE]. The gateway, reading the node's terminator to
    reuse the connection, was cancelled then, and counted a whole answer as a 499 and a
    client disconnect (2 of 100 requests of a plain `kvgate bench` run)."""

    async def stream(fake: Fake, resp: web.StreamResponse) -> None:
        await resp.write(EVENT + DONE)
        await asyncio.sleep(0.3)  # then the end of the body

    fakes = [Fake("a", stream)]

    async def body() -> None:
        async with _gateway_over(kit, fakes) as gw:
            metrics = gw.gateway.metrics
            port = int(gw.url.rsplit(":", 1)[1])
            req = json.dumps({"model": kit.MODEL, "prompt": "x", "stream": True}).encode()
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                             b"\r\nContent-Length: %d\r\n\r\n%s" % (C.encode(), len(req), req))
                seen = b""
                while b"data: [DONE]" not in seen:
                    seen += await asyncio.wait_for(reader.read(65536), 5.0)
                assert seen.startswith(b"HTTP/1.1 200")
                writer.close()  # gone with [DONE]: the gateway is still tidying up
            await kit.eventually(lambda: metrics.responses[(C, 200)] == 3, 5.0)
            assert metrics.responses[(C, 499)] == 0 and metrics.client_disconnects == 0
            assert gw.controller.stats.outcomes["completed"] == 3

    kit.run(body())
