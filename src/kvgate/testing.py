"""Small helpers for tests that drive kvgate's asyncio shells (gateway, engine server).

Kept in the package, like httpx's transports, so every test folder uses the same
bounded waits instead of its own copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait until ``check()`` holds, polling every 20 ms; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def run_bounded(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run ``coro`` in a fresh event loop, failing after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())
