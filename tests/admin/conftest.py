"""A gateway in front of real in-process engine servers, for the admin API and dashboard.

The suite runs with --import-mode=importlib, so the harness is handed out as the
`admin_kit` fixture. Every test body runs in its own event loop under a hard
timeout; every server and session is closed on the way out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import pytest

from kvgate.engine.server import EngineServer, EngineServerConfig, start_engine_server
from kvgate.gateway import GatewayServer, start_gateway
from kvgate.testing import eventually, fast_gateway_config
from kvgate.testing import run_bounded as run

T = TypeVar("T")
TOKEN = "admin-secret-token-1234"
MODEL = "kvgate-sim"


@dataclass
class Stack:
    gw: GatewayServer
    engines: list[EngineServer]
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.gw.url

    def engine(self, node_id: str) -> EngineServer:
        return next(e for e in self.engines if e.node_id == node_id)

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = TOKEN,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        data = (
            None
            if body is None
            else (body if isinstance(body, bytes) else json.dumps(body).encode())
        )
        async with self.session.request(method, self.url + path, data=data, headers=h) as r:
            raw = await r.read()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw.decode("utf-8", "replace")
            return r.status, parsed, dict(r.headers)

    async def chat(self, content: str, max_tokens: int = 4) -> tuple[int, str | None]:
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        }
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status, r.headers.get("X-Kvgate-Node")


async def start_engine(node_id: str, **overrides: Any) -> EngineServer:
    fields: dict[str, Any] = {
        "port": 0,
        "speedup": 50.0,
        "node_id": node_id,
        "model": MODEL,
        **overrides,
    }
    return await start_engine_server(EngineServerConfig(**fields))


def gateway_config(node_list: list[dict[str, Any]], **sections: dict[str, Any]) -> Any:
    return fast_gateway_config(node_list, admin_token=TOKEN, **sections)


@contextlib.asynccontextmanager
async def stack(n: int = 2, **sections: dict[str, Any]) -> AsyncIterator[Stack]:
    engines: list[EngineServer] = []
    gw: GatewayServer | None = None
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        for i in range(n):
            engines.append(await start_engine(f"e{i}"))
        nodes = [{"id": e.node_id, "url": e.url} for e in engines]
        gw = await start_gateway(gateway_config(nodes, **sections))
        yield Stack(gw, engines, session)
    finally:
        if gw is not None:
            await gw.stop()
        await session.close()
        for e in engines:
            await e.stop()


class AdminKit:
    TOKEN = TOKEN
    MODEL = MODEL
    run = staticmethod(run)
    stack = staticmethod(stack)
    start_engine = staticmethod(start_engine)
    eventually = staticmethod(eventually)


@pytest.fixture
def admin_kit() -> type[AdminKit]:
    return AdminKit
