"""A gateway in front of real in-process engine servers, for the admin API and dashboard.

The suite runs with --import-mode=importlib, so the harness is handed out as the
`admin_kit` fixture. Every test body runs in its own event loop under a hard
timeout; every server and session is closed on the way out.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, TypeVar

import pytest

from kvgate.engine.server import EngineServer, EngineServerConfig, start_engine_server
from kvgate.testing import EngineStack, engine_stack, eventually, fast_gateway_config
from kvgate.testing import run_bounded as run

T = TypeVar("T")
TOKEN = "admin-secret-token-1234"
MODEL = "kvgate-sim"


class Stack(EngineStack):
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


def engine_config(node_id: str, **overrides: Any) -> EngineServerConfig:
    fields: dict[str, Any] = {
        "port": 0,
        "speedup": 50.0,
        "node_id": node_id,
        "model": MODEL,
        **overrides,
    }
    return EngineServerConfig(**fields)


async def start_engine(node_id: str, **overrides: Any) -> EngineServer:
    return await start_engine_server(engine_config(node_id, **overrides))


def gateway_config(node_list: list[dict[str, Any]], **sections: dict[str, Any]) -> Any:
    return fast_gateway_config(node_list, admin_token=TOKEN, **sections)


def stack(n: int = 2, **sections: dict[str, Any]) -> contextlib.AbstractAsyncContextManager[Stack]:
    return engine_stack(
        Stack,
        [engine_config(f"e{i}") for i in range(n)],
        lambda nodes: gateway_config(nodes, **sections),
        session_timeout_s=10.0,
    )


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
