"""Fixtures for the engine server tests: servers on 127.0.0.1 port 0, an HTTP session, SSE.

The suite runs with --import-mode=importlib, so shared helpers are fixtures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvgate.engine import EngineProfile
from kvgate.engine.server import EngineServer, EngineServerConfig, start_engine_server
from kvgate.protocol import SSEParser
from kvgate.testing import read_sse as read_all_sse

StartServer = Callable[..., Awaitable[EngineServer]]

# One running sequence at a time, 10 ms + 1 ms per token a step: easy to hold a request
# running or queued.
ONE_SEQ = EngineProfile(name="one-seq", t0_s=0.010, a_s_per_token=0.001, c_s_per_pair=0.0,
                        k_s_per_ctx_token=0.0, max_num_batched_tokens=8192, max_num_seqs=1)


@pytest.fixture
def one_seq_profile() -> EngineProfile:
    return ONE_SEQ


@pytest_asyncio.fixture
async def start_server() -> AsyncIterator[StartServer]:
    servers: list[EngineServer] = []

    async def start(**overrides: Any) -> EngineServer:
        fields: dict[str, Any] = {"port": 0, "speedup": 100.0, **overrides}
        server = await start_engine_server(EngineServerConfig(**fields))
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


@pytest.fixture
def read_sse() -> Callable[[aiohttp.ClientResponse], Awaitable[list[Any]]]:
    return read_all_sse


async def _next_event(resp: aiohttp.ClientResponse, parser: SSEParser,
                      backlog: list[Any]) -> Any:
    while not backlog:
        chunk = await resp.content.readany()
        if not chunk:
            raise EOFError("stream ended")
        backlog.extend("[DONE]" if e.is_done else e.json() for e in parser.feed(chunk))
    return backlog.pop(0)


class SSEReader:
    """Reads a stream event by event (to act in the middle of it)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self._parser = SSEParser()
        self._backlog: list[Any] = []

    async def next(self) -> Any:
        return await _next_event(self.resp, self._parser, self._backlog)

    async def rest(self) -> list[Any]:
        out: list[Any] = []
        while True:
            try:
                out.append(await self.next())
            except EOFError:
                return out


@pytest.fixture
def sse_reader() -> Callable[[aiohttp.ClientResponse], SSEReader]:
    return SSEReader
