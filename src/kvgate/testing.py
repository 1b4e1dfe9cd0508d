"""Small helpers for tests that drive kvgate's asyncio shells (gateway, engine server).

Kept in the package, like httpx's transports, so every test folder uses the same
bounded waits instead of its own copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from kvgate.engine.server import EngineServer, EngineServerConfig, start_engine_server
from kvgate.gateway.app import GatewayServer, start_gateway
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.config_load import build_config
from kvgate.protocol import SSEParser

T = TypeVar("T")
S = TypeVar("S", bound="EngineStack")


async def eventually(
    check: Callable[[], bool] | Callable[[], Awaitable[bool]], timeout: float = 3.0
) -> None:
    """Wait until ``check()`` (plain or async) holds, polling every 20 ms; AssertionError
    after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every event of a streamed response: JSON objects, and the string "[DONE]"."""
    parser = SSEParser()
    out: list[Any] = []
    async for chunk in resp.content.iter_any():
        for event in parser.feed(chunk):
            out.append("[DONE]" if event.is_done else event.json())
    return out


async def raw_exchange(
    url: str, *parts: bytes, pause: float = 0.0, timeout: float = 5.0
) -> tuple[bytes, float]:
    """Send ``parts`` (``pause`` s apart) over one raw connection to ``url``
    (``http://host:port``) and read until the server closes it: the bytes and the
    seconds from connect to close. For what a client library will not send (broken
    framing, a head or body that never completes)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.monotonic()

    async def send() -> None:  # alongside the read: the server may close mid-way
        for i, part in enumerate(parts):
            if i and pause:
                await asyncio.sleep(pause)
            writer.write(part)
            await writer.drain()

    sender = asyncio.ensure_future(send())
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
        return data, time.monotonic() - start
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def run_bounded(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run ``coro`` in a fresh event loop, failing after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def fast_gateway_config(
    node_list: list[dict[str, Any]],
    *,
    admin_token: str | None = None,
    request_timeout_s: float = 5.0,
    **sections: dict[str, Any],
) -> GatewayConfig:
    """A gateway config for tests: ephemeral port, fast probes, no exploration.

    ``sections`` are merged into the defaults section by section.
    """
    server: dict[str, Any] = {"port": 0, "seed": 1, "shutdown_timeout_s": 0.5}
    if admin_token is not None:
        server["admin_token"] = admin_token
    raw: dict[str, dict[str, Any]] = {
        "server": server,
        "nodes": {
            "static": node_list,
            "health_interval_s": 0.1,
            "health_timeout_s": 0.5,
            "metrics_interval_s": 0.1,
            "evictions_interval_s": 0.1,
            "unhealthy_after": 2,
            "healthy_after": 1,
            "startup_probe_timeout_s": 2.0,
        },
        "routing": {"params": {"epsilon": 0.0}},
        "upstream": {
            "connect_timeout_s": 1.0,
            "request_timeout_s": request_timeout_s,
            "stream_idle_timeout_s": request_timeout_s,
        },
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw)


@dataclass
class EngineStack:
    """A gateway in front of in-process engine servers, and a client session."""

    gw: GatewayServer
    engines: list[EngineServer]
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.gw.url

    def engine(self, node_id: str) -> EngineServer:
        return next(e for e in self.engines if e.node_id == node_id)


@contextlib.asynccontextmanager
async def engine_stack(
    kind: type[S],
    engine_configs: list[EngineServerConfig],
    gateway_config: Callable[[list[dict[str, Any]]], GatewayConfig],
    *,
    session_timeout_s: float = 15.0,
) -> AsyncIterator[S]:
    """Start the engines, then a gateway over them (``gateway_config(node_list)``);
    yield ``kind(gw, engines, session)``; close everything on the way out."""
    engines: list[EngineServer] = []
    gw: GatewayServer | None = None
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=session_timeout_s))
    try:
        for cfg in engine_configs:
            engines.append(await start_engine_server(cfg))
        nodes = [{"id": e.node_id, "url": e.url} for e in engines]
        gw = await start_gateway(gateway_config(nodes))
        yield kind(gw, engines, session)
    finally:
        if gw is not None:
            await gw.stop()
        await session.close()
        for e in engines:
            await e.stop()
