"""The engine child processes of ``kvgate up``: spawned each in its own session and
process group (a terminal's Ctrl-C reaches only ``kvgate up``), with the kernel asked
to SIGTERM them if their parent dies (Linux), output to a log file each; waited on
until ``/health`` answers; stopped by PID (SIGTERM, a bounded wait, SIGKILL, reaped).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from kvgate.core.errors import KvgateError

log = logging.getLogger("kvgate.up")

STOP_TIMEOUT_S = 5.0  # SIGTERM -> wait this long -> SIGKILL


class ClusterStartError(KvgateError):
    """An engine or the gateway did not come up in time (the message says which)."""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when we die (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return preexec


@dataclass(slots=True)
class EngineProcess:
    """One ``kvgate engine`` child process."""

    node_id: str
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    kv_events: str | None = None  # its KV events' PUB endpoint (precise mode)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        with contextlib.suppress(OSError):
            self.log_file.flush()
            return self.log_path.read_text("utf-8", "replace")[-limit:].strip()
        return ""


def spawn_engine(
    node_id: str,
    *,
    host: str,
    port: int,
    speedup: float,
    model: str,
    num_blocks: int | None,
    log_dir: Path,
    extra_args: tuple[str, ...] = (),
    kv_events: str | None = None,
) -> EngineProcess:
    """Start ``python -m kvgate.cli engine`` in its own session; output to a log file.
    ``kv_events``: a tcp://host:port its KV events are published on (bound there)."""
    cmd = [
        sys.executable,
        "-m",
        "kvgate.cli",
        "engine",
        "--host",
        host,
        "--port",
        str(port),
        "--node-id",
        node_id,
        "--speedup",
        repr(float(speedup)),
        "--model",
        model,
    ]
    if num_blocks is not None:
        cmd += ["--num-blocks", str(num_blocks)]
    if kv_events is not None:
        cmd += ["--kv-events-endpoint", kv_events]
    cmd += list(extra_args)
    log_path = log_dir / f"{node_id}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by stop_engines
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session and process group
            preexec_fn=_parent_death_signal(),  # only calls prctl (no locks, no allocation)
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except BaseException:
        log_file.close()
        raise
    return EngineProcess(node_id, host, port, proc, log_path, log_file, kv_events)


async def stop_engines(engines: list[EngineProcess], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every engine by PID, wait (bounded), SIGKILL the rest, reap all."""
    for e in engines:
        if e.alive():
            with contextlib.suppress(ProcessLookupError):
                e.proc.terminate()
    deadline = time.monotonic() + timeout
    while any(e.alive() for e in engines) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for e in engines:
        if e.alive():
            log.warning("engine %s (pid %d) ignored SIGTERM; killing it", e.node_id, e.pid)
            with contextlib.suppress(ProcessLookupError):
                e.proc.kill()
    for e in engines:
        with contextlib.suppress(subprocess.TimeoutExpired):
            # Reaps the child (no zombie, no ResourceWarning); after SIGKILL it is quick.
            e.proc.wait(timeout=2.0)
        e.log_file.close()


async def get_status(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def wait_healthy(
    session: aiohttp.ClientSession, engine: EngineProcess, deadline: float
) -> None:
    while True:
        if not engine.alive():
            raise ClusterStartError(
                f"engine {engine.node_id} exited with code {engine.proc.returncode} before "
                f"it was ready; its log ({engine.log_path}):\n{engine.log_tail()}"
            )
        if await get_status(session, engine.url + "/health") == 200:
            return
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"engine {engine.node_id} at {engine.url} did not answer /health in time; "
                f"its log ({engine.log_path}):\n{engine.log_tail()}"
            )
        await asyncio.sleep(0.05)
