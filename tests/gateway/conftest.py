"""A stub vLLM and a gateway harness on real sockets, handed out as one `kit` fixture.

The suite runs with --import-mode=importlib, so tests cannot import a helper module;
`kit.run(coro)`, `kit.cluster(...)` and `kit.stub(...)` are what they use. Every test
body runs in its own event loop under a hard timeout, and every session, runner and
socket is closed on the way out (pytest turns ResourceWarnings into errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from kvgate.gateway import GatewayServer, start_gateway
from kvgate.testing import eventually, fast_gateway_config
from kvgate.testing import run_bounded as run

T = TypeVar("T")
MODEL = "stub-model"


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class StubEngine:
    """Pretends to be vLLM's OpenAI server; behaviour set by `mode`.

    modes: ok, 503, retry-elsewhere, pool-overloaded, 400, 500, 400-large (an error
    body over the gateway's 64 KiB pass-through limit), redirect (a 308), die-mid-stream,
    slow (a long stream / a long wait), hang (never answers), stall (a stream's
    headers, then nothing), burst (a long stream written at once, then no end),
    firehose (a stream that never ends, written as fast as it is taken), done-then-wait
    (a stream whose body ends 50 ms after its ``[DONE]``), html (a 200 page of text/html),
    400-html-json (a JSON error body labelled ``text/html; x=json``).
    """

    name: str
    models: tuple[str, ...] = (MODEL,)
    max_model_len: int = 4096
    mode: str = "ok"
    cached: int | None = 16
    healthy: bool = True
    evictions: list[dict[str, Any]] | None = None  # None = no /kvgate/evictions (404)
    waiting: int = 0
    running: int = 0
    kv: float = 0.25
    # of 16 tokens, the node's whole cache: as vLLM, the same total on each DP rank's
    # vllm:cache_config_info line
    gpu_blocks: int | None = None
    seen: list[Seen] = field(default_factory=list)
    disconnects: int = 0
    delay_s: float = 0.0  # every completion waits this long before answering
    health_delay_s: float = 0.0  # /health answers this late (SGLang's: at least 1 s)
    inflight: int = 0  # completions being answered now
    peak_inflight: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    @property
    def attempts(self) -> int:
        return sum(1 for s in self.seen if s.path.startswith("/v1/") and s.path != "/v1/models")

    async def start(self) -> StubEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvgate/evictions", self._evictions)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": m,
                "object": "model",
                "owned_by": "vllm",
                "root": m,
                "max_model_len": self.max_model_len,
            }
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP vllm:num_requests_running x", "# TYPE vllm:num_requests_running gauge"]
        for engine in ("0", "1"):  # two DP ranks: counts sum, usage averages
            lines.append(
                f'vllm:num_requests_running{{engine="{engine}",model_name="m"}} {self.running / 2}'
            )
            lines.append(
                f'vllm:num_requests_waiting{{engine="{engine}",model_name="m"}} {self.waiting / 2}'
            )
            lines.append(f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} {self.kv}')
            if self.gpu_blocks is not None:
                lines.append(f'vllm:cache_config_info{{block_size="16",engine="{engine}",'
                             f'num_gpu_blocks="{self.gpu_blocks}"}} 1.0')
        return web.Response(text="\n".join(lines) + "\n")

    async def _evictions(self, request: web.Request) -> web.Response:
        if self.evictions is None:
            raise web.HTTPNotFound()
        since = int(request.query.get("since", "0"))
        return web.json_response([e for e in self.evictions if e["seq"] > since])

    def _usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await self._answer(request)
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, dict(request.headers)))
        chat = request.path.endswith("chat/completions")
        mode = self.mode
        if mode in ("503", "retry-elsewhere", "pool-overloaded"):
            headers = {} if mode == "503" else {"X-Kvgate-Reject": mode}
            return web.json_response(
                {"error": {"message": "busy", "type": "x", "code": 503}},
                status=503,
                headers=headers,
            )
        if mode == "html":  # a hostile or broken node's page, as a 200
            return web.Response(text="<html><script>alert(1)</script></html>",
                                content_type="text/html")
        if mode == "400-html-json":  # a JSON error labelled as a page
            return web.Response(status=400, text='{"error": {"message": "<script>"}}',
                                headers={"Content-Type": "text/html; x=json"})
        if mode == "redirect":  # e.g. an ingress sending plain http to https
            return web.Response(status=308, text="<html>moved</html>", content_type="text/html",
                                headers={"Location": "https://elsewhere/v1/completions"})
        if mode in ("400", "500", "400-large"):
            status = int(mode[:3])
            return web.json_response(
                {
                    "error": {
                        "message": "x" * 100_000 if mode == "400-large" else f"engine says {mode}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": status,
                    }
                },
                status=status,
            )
        try:
            if mode == "hang":
                await asyncio.sleep(30)
            if body.get("stream"):
                return await self._stream(request, body, chat)
            if mode == "slow":
                await asyncio.sleep(30)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "hi there"}
        else:
            choice["text"] = "hi there"
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
                "usage": self._usage(),
            }
        )

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "stall":
            await asyncio.sleep(30)
        if self.mode == "firehose":
            event = b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n' % (b"x" * 1000)
            while True:
                await resp.write(event)
        n = {"slow": 200, "burst": 3000}.get(self.mode, 3)
        for i in range(n):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": f"t{i} "}
            else:
                choice["text"] = f"t{i} "
            chunk = {
                "id": "c1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.mode == "die-mid-stream" and i == 1:
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.mode == "slow":
                await asyncio.sleep(0.05)
        if self.mode == "burst":
            await asyncio.sleep(30)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "id": "c1",
                "object": "x",
                "created": 1,
                "model": body["model"],
                "choices": [],
                "usage": self._usage(),
            }
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        if self.mode == "done-then-wait":  # the end of the body comes a moment later
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    gw: GatewayServer
    stubs: list[StubEngine]
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.gw.url

    def stub(self, node_id: str) -> StubEngine:
        return next(s for s in self.stubs if s.name == node_id)

    async def post(
        self,
        path: str,
        body: Any,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers=headers) as r:
            return r.status, dict(r.headers), await r.read()

    async def get(
        self, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        async with self.session.get(self.url + path, headers=headers) as r:
            return r.status, dict(r.headers), await r.read()


def make_config(node_list: list[dict[str, Any]], **sections: dict[str, Any]) -> Any:
    return fast_gateway_config(node_list, **sections)


@contextlib.asynccontextmanager
async def cluster(
    n: int = 2,
    *,
    stub: dict[str, Any] | None = None,
    extra_nodes: list[dict[str, Any]] | None = None,
    **sections: dict[str, Any],
) -> AsyncIterator[Cluster]:
    stubs = [await StubEngine(name=f"n{i}", **(stub or {})).start() for i in range(n)]
    session = aiohttp.ClientSession()
    gw: GatewayServer | None = None
    try:
        nodes = [{"id": s.name, "url": s.url} for s in stubs] + (extra_nodes or [])
        gw = await start_gateway(make_config(nodes, **sections))
        yield Cluster(gw, stubs, session)
    finally:
        if gw is not None:
            await gw.stop()
        await session.close()
        for s in stubs:
            await s.stop()


class Kit:
    MODEL = MODEL
    StubEngine = StubEngine
    run = staticmethod(run)
    cluster = staticmethod(cluster)
    config = staticmethod(make_config)
    eventually = staticmethod(eventually)
    closed_port = staticmethod(closed_port)


@pytest.fixture
def kit() -> type[Kit]:
    return Kit


# ------------------------------------------------------------------------------ Redis
def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url() -> Any:
    """A Redis for the fleet tests: REDIS_URL, else 127.0.0.1:6379, else a redis-server
    from PATH started on a free port for this session. Outside CI, skip if none."""
    import os
    import shutil
    import subprocess
    import time

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if _redis_answers(url):
        yield url
        return
    server = shutil.which("redis-server")
    if server is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Redis at {url} and no redis-server on PATH (CI must run these)")
        pytest.skip(f"no Redis at {url} and no redis-server on PATH")
    port = closed_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10.0
        while not _redis_answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
