"""End-to-end harness: real sockets on 127.0.0.1, real engine servers, one gateway.

Handed out as the `e2e` fixture (the suite runs with --import-mode=importlib).
Each test body runs in its own event loop under a hard timeout; servers, sessions
and child processes are closed on the way out.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
import pytest

from kvgate.engine.server import EngineServerConfig
from kvgate.testing import (
    EngineStack,
    engine_stack,
    eventually,
    fast_gateway_config,
    read_sse,
    run_bounded,
)

T = TypeVar("T")
MODEL = "kvgate-sim"
TOKEN = "e2e-admin-token-123"


class Stack(EngineStack):
    async def fault(self, node_id: str, action: str, **params: Any) -> None:
        async with self.session.post(
            self.engine(node_id).url + "/admin/fault", json={"action": action, **params}
        ) as r:
            assert r.status == 200, await r.text()

    async def engine_metric(self, node_id: str, name: str) -> float:
        return await metric(self.session, self.engine(node_id).url, name)


async def metric(session: aiohttp.ClientSession, base_url: str, name: str) -> float:
    """Sum of the samples of ``name`` on a Prometheus page (0 if absent)."""
    async with session.get(base_url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


def gateway_config(node_list: list[dict[str, Any]], **sections: dict[str, Any]) -> Any:
    return fast_gateway_config(node_list, admin_token=TOKEN, request_timeout_s=10.0, **sections)


def stack(
    n: int = 2, *, speedup: float = 20.0, num_blocks: int = 4000, **sections: dict[str, Any]
) -> contextlib.AbstractAsyncContextManager[Stack]:
    engines = [
        EngineServerConfig(
            port=0, speedup=speedup, node_id=f"e{i}", model=MODEL, num_blocks=num_blocks
        )
        for i in range(n)
    ]
    return engine_stack(Stack, engines, lambda nodes: gateway_config(nodes, **sections))


def pid_alive(pid: int) -> bool:
    """True while the PID exists (a zombie counts: nobody reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process reused the PID
        return True
    return True


def run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    return run_bounded(coro, timeout)


class E2E:
    MODEL = MODEL
    TOKEN = TOKEN
    run = staticmethod(run)
    stack = staticmethod(stack)
    metric = staticmethod(metric)
    read_sse = staticmethod(read_sse)
    eventually = staticmethod(eventually)
    pid_alive = staticmethod(pid_alive)


@pytest.fixture
def e2e() -> type[E2E]:
    return E2E


@pytest.fixture
def chromium() -> str:
    """Path of a Chromium binary; skipped only when absent outside CI."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI") != "true":
        pytest.skip("chromium is not installed (apt-get install chromium)")
    pytest.fail("chromium is required under CI=true (apt-get install chromium)")
