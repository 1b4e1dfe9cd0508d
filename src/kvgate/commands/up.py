"""``kvgate up``: a whole local cluster in one command (N simulated engines + a gateway).

Starts ``--nodes`` engine servers as child processes (``python -m kvgate.cli engine``,
each on a free port of 127.0.0.1, each in its own process group and session so a
terminal's Ctrl-C reaches only ``kvgate up``), waits until every engine answers
``/health``, starts the gateway in this process in front of them (in-process
coordinator), waits until its ``/ready`` answers, prints the URLs and an example
request, and serves until SIGINT, SIGTERM or SIGHUP (its terminal closing; a
closed stdout does not stop the teardown either). Then it stops the gateway (draining
in-flight requests, bounded) and every engine: SIGTERM by PID, a bounded wait, then
SIGKILL for any that did not exit. The same teardown runs when start-up fails or is
interrupted, so no process is left behind; on Linux the engines also get SIGTERM
from the kernel if ``kvgate up`` itself is killed (``PR_SET_PDEATHSIG``).

Engines run their timing model ``--engine-speedup`` times faster than wall time
(default 10): a 2K-token prompt's prefill then takes ~15 ms and each decode step
~1.1 ms, so a 2K-token chat request with ``max_tokens`` 32 answers in ~60 ms and
one with vLLM's default of 256 output tokens in ~0.35 s on an ordinary machine.

Tests use :func:`start_cluster` (``await cluster.stop()``) in their own event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.commands.argtypes import positive_float, positive_int
from kvgate.commands.engine_processes import (
    STOP_TIMEOUT_S,
    ClusterStartError,
    EngineProcess,
    free_port,
    get_status,
    spawn_engine,
    stop_engines,
    wait_healthy,
)
from kvgate.commands.pipes import silence_stdout
from kvgate.core.config import INDEX_MODES
from kvgate.core.errors import ConfigError, KvgateError
from kvgate.core.hashing import make_hasher
from kvgate.gateway.app import GatewayServer, start_gateway
from kvgate.gateway.config import GatewayConfig, ServerConfig
from kvgate.gateway.config_load import build_config
from kvgate.gateway.serve import on_stop_signals

log = logging.getLogger("kvgate.up")


def admin_token_arg(text: str) -> str:
    """``--admin-token``, checked by the gateway's own rule, in the flag's words (the
    config's message named ``server.admin_token``, which `kvgate up` has no file for)."""
    try:
        ServerConfig(admin_token=text)
    except ConfigError as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise argparse.ArgumentTypeError(message.replace("server.admin_token ", "")) from None
    return text

DEFAULT_NODES = 4
MAX_NODES = 64  # engine processes one `kvgate up` starts at most
DEFAULT_ENGINE_SPEEDUP = 10.0
DEFAULT_ENGINE_NUM_BLOCKS = 8192  # x 16 tokens = 131 072 tokens of KV cache per engine
DEFAULT_MODEL = "kvgate-sim"
ENGINE_BLOCK_SIZE = 16  # the engine's default tokens per KV block


# ----------------------------------------------------------------------------- cluster


@dataclass(slots=True)
class Cluster:
    """A running local cluster: ``.gateway_url``, ``.engine_urls``; ``await .stop()``."""

    gateway: GatewayServer
    engines: list[EngineProcess]
    admin_token: str
    log_dir: Path
    own_log_dir: bool = False
    socket_dir: Path | None = None  # precise mode: the engines' KV event sockets (ipc)
    _stopped: bool = field(default=False, repr=False)

    @property
    def gateway_url(self) -> str:
        return self.gateway.url

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def engine_pids(self) -> list[int]:
        return [e.pid for e in self.engines]

    async def stop(self) -> None:
        """Stop the gateway (bounded drain), then every engine; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.gateway.stop()
        finally:
            await stop_engines(self.engines)
            if self.own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
            if self.socket_dir is not None:
                shutil.rmtree(self.socket_dir, ignore_errors=True)


def gateway_config(
    engines: list[tuple[str, str]],
    *,
    host: str,
    port: int,
    policy: str,
    admin_token: str,
    num_blocks: int,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    kv_events: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """The gateway's config for ``engines`` [(id, url)]; the index mirrors each engine's
    KV capacity (its tokens in index blocks). ``kv_events`` (engine id -> its KV events
    endpoint) makes the gateway's index precise: fed by those events, keyed by the
    engines' own tokenizer (hasher ``sim``)."""
    raw: dict[str, dict[str, Any]] = {
        "server": {
            "host": host,
            "port": port,
            "admin_token": admin_token,
            "shutdown_timeout_s": STOP_TIMEOUT_S,
        },
        "routing": {"policy": policy},
        "nodes": {"static": []},
    }
    if kv_events is not None:
        raw["routing"].update(
            index_mode="precise", hasher="sim", hasher_params={"block_size": ENGINE_BLOCK_SIZE}
        )
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    cc = build_config(raw).controller_config()
    index_block_tokens = make_hasher(cc.hasher, **dict(cc.hasher_params)).tokens_per_block
    cache_blocks = max(1, num_blocks * ENGINE_BLOCK_SIZE // max(1, index_block_tokens))
    raw["nodes"]["static"] = [
        {"id": node_id, "url": url, "cache_blocks": cache_blocks}
        | ({"kv_events": kv_events[node_id]} if kv_events else {})
        for node_id, url in engines
    ]
    return build_config(raw)


async def start_cluster(
    *,
    nodes: int = DEFAULT_NODES,
    host: str = "127.0.0.1",
    port: int = 0,
    engine_speedup: float = DEFAULT_ENGINE_SPEEDUP,
    policy: str = "kvgate",
    admin_token: str | None = None,
    engine_num_blocks: int = DEFAULT_ENGINE_NUM_BLOCKS,
    model: str = DEFAULT_MODEL,
    ready_timeout_s: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
    engine_args: tuple[str, ...] = (),
    gateway_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    index_mode: str = "approximate",
) -> Cluster:
    """Start ``nodes`` engine processes and an in-process gateway; ready when it returns.

    Raises :class:`ClusterStartError` (or ConfigError / OSError) after stopping
    whatever it had started; cancellation also stops everything.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise ConfigError(f"nodes must be in [1, {MAX_NODES}], got {nodes}")
    if not engine_speedup > 0:
        raise ConfigError("engine_speedup must be > 0")
    if not model.strip():
        raise ConfigError("model must not be empty")
    if index_mode not in INDEX_MODES:
        raise ConfigError(f"index_mode must be 'approximate' or 'precise', got {index_mode!r}")
    precise = index_mode == "precise"
    token = admin_token or secrets.token_urlsafe(24)
    # the gateway's settings are checked before any engine starts: a bad port or policy
    # failed only once every engine was up, seconds later
    gateway_config([], host=host, port=port, policy=policy, admin_token=token,
                   num_blocks=engine_num_blocks, overrides=gateway_overrides,
                   kv_events={} if precise else None)
    own_dir = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="kvgate-up-")) if log_dir is None else Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # KV events go over Unix sockets in a private directory: only this machine's
    # gateway reads them (a tcp://*: publisher would serve prompts' token ids to the
    # network), and the path stays short enough for ipc:// (about 100 bytes)
    sockets = Path(tempfile.mkdtemp(prefix="kvgate-kv-")) if precise else None
    engines: list[EngineProcess] = []
    server: GatewayServer | None = None
    deadline = time.monotonic() + ready_timeout_s

    given: set[int] = set()

    def port_of_its_own() -> int:
        # the OS may hand the same free port out twice in a row: two engines on one port
        # passed each other's /health and the cluster failed as a config error
        while (port := free_port("127.0.0.1")) in given:
            pass
        given.add(port)
        return port

    async def launch(session: aiohttp.ClientSession, node_id: str) -> None:
        # A free port can be taken between our probe and the engine's bind: one retry.
        for attempt in (1, 2):
            engine = spawn_engine(
                node_id,
                host="127.0.0.1",
                port=port_of_its_own(),
                speedup=engine_speedup,
                model=model,
                num_blocks=engine_num_blocks,
                log_dir=logs,
                extra_args=engine_args,
                kv_events=f"ipc://{sockets}/{node_id}-{attempt}" if sockets else None,
            )
            engines.append(engine)
            try:
                await wait_healthy(session, engine, deadline)
                return
            except ClusterStartError:
                if attempt == 2 or engine.alive():
                    raise
                log.warning("engine %s exited at start; retrying on another port", node_id)
                engines.remove(engine)
                await stop_engines([engine])

    try:
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.ensure_future(launch(session, f"engine-{i}")) for i in range(nodes)]
            try:
                await asyncio.gather(*tasks)
            finally:  # one failed (or we were cancelled): stop waiting for the others
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            engines.sort(key=lambda e: int(e.node_id.rsplit("-", 1)[1]))
            config = gateway_config(
                [(e.node_id, e.url) for e in engines],
                host=host,
                port=port,
                policy=policy,
                admin_token=token,
                num_blocks=engine_num_blocks,
                overrides=gateway_overrides,
                kv_events={e.node_id: e.kv_events for e in engines if e.kv_events}
                if precise
                else None,
            )
            server = await start_gateway(config)
            while await get_status(session, server.url + "/ready") != 200:
                if time.monotonic() > deadline:
                    raise ClusterStartError(
                        f"the gateway at {server.url} was not ready in {ready_timeout_s:g} s"
                    )
                await asyncio.sleep(0.05)
    except BaseException:
        try:
            if server is not None:
                await server.stop()
        finally:
            await stop_engines(engines)
            if own_dir:
                shutil.rmtree(logs, ignore_errors=True)
            if sockets is not None:
                shutil.rmtree(sockets, ignore_errors=True)
        raise
    return Cluster(
        gateway=server, engines=engines, admin_token=token, log_dir=logs, own_log_dir=own_dir,
        socket_dir=sockets,
    )


# ----------------------------------------------------------------------------- CLI


def _node_count(text: str) -> int:
    """--nodes: 1 to MAX_NODES (1 000 asked for launched 613 engines, ~57 MB each, before
    the kernel's out-of-memory killer stopped it on a 24 GB machine)."""
    value = positive_int(text)
    if value > MAX_NODES:
        raise argparse.ArgumentTypeError(f"at most {MAX_NODES}, got {value}")
    return value


def add_up_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``up`` to ``parser.add_subparsers()``'s result."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "up",
        help="start a local cluster: N simulated engines behind one kvgate gateway",
        description="Start --nodes simulated inference engines (kvgate engine, as child "
        "processes) and one gateway in front of them, print the URLs, and serve until "
        "Ctrl-C, SIGTERM or SIGHUP; then stop everything.",
    )
    p.add_argument(
        "--nodes",
        type=_node_count,
        default=DEFAULT_NODES,
        help=f"number of engine processes, at most {MAX_NODES} (each is a process of about "
        "60 MB) (default %(default)s)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="gateway listen address (default %(default)s; engines always listen on 127.0.0.1)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="gateway port, 0 for any free one (default %(default)s)",
    )
    p.add_argument("--policy", default="kvgate", help="routing policy (default %(default)s)")
    p.add_argument(
        "--admin-token",
        type=admin_token_arg,
        default=None,
        help="bearer token of the admin API (default: a random one, printed)",
    )
    p.add_argument(
        "--engine-speedup",
        type=positive_float,
        default=DEFAULT_ENGINE_SPEEDUP,
        help="engines run their A100 timing model this many times faster than "
        "wall time (default %(default)s: a 2K-token prompt with 32 output tokens "
        "answers in ~60 ms)",
    )
    p.add_argument(
        "--engine-num-blocks",
        type=positive_int,
        default=DEFAULT_ENGINE_NUM_BLOCKS,
        help="KV cache blocks (16 tokens each) per engine (default %(default)s)",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="model name the engines serve (default %(default)s)"
    )
    p.add_argument(
        "--index-mode",
        choices=INDEX_MODES,
        default="approximate",
        help="how the gateway learns where prompts are cached: approximate, from its own "
        "routing (default), or precise, from the engines' KV cache events over ZMQ",
    )
    p.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="give up if the cluster is not ready in this time (default %(default)s)",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="keep the engines' logs here (default: a temporary directory, removed on exit)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error", "critical"),
        help="gateway log level (default %(default)s)",
    )
    return p


def banner(
    cluster: Cluster, *, model: str, policy: str, speedup: float, token_generated: bool
) -> str:
    url = cluster.gateway_url
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "Hello, kvgate!"}],
        }
    )
    lines = [
        f"kvgate up: {len(cluster.engines)} engine(s) behind one gateway "
        f"(policy {policy}, engine speedup {speedup:g}x, "
        f"{'precise' if cluster.socket_dir else 'approximate'} cache index)",
        f"  gateway    {url}",
        f"  OpenAI API {url}/v1",
        f"  dashboard  {url}/dashboard",
        f"  metrics    {url}/metrics",
        f"  admin      {url}/admin/nodes  (Authorization: Bearer <admin token>)",
        f"  admin token{' (generated)' if token_generated else ''}: {cluster.admin_token}",
    ]
    for e in cluster.engines:
        events = f"  KV events {e.kv_events}" if e.kv_events else ""
        lines.append(f"  engine     {e.node_id}  {e.url}  (pid {e.pid}){events}")
    lines += [
        f"  engine logs {cluster.log_dir}",
        "",
        "Try:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{body}'",
        "",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def run_up(args: argparse.Namespace) -> int:
    """Blocks until SIGINT/SIGTERM/SIGHUP. 0 on a clean stop, 1 when start-up failed."""
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional
        runner = asyncio.run
    code: int = runner(_up(args))
    return code


async def _up(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP too: the terminal closing must stop the cluster, not kill us mid-run
    on_stop_signals(loop, lambda _name: stop.set())
    starting = asyncio.ensure_future(
        start_cluster(
            nodes=args.nodes,
            host=args.host,
            port=args.port,
            engine_speedup=args.engine_speedup,
            policy=args.policy,
            admin_token=args.admin_token,
            engine_num_blocks=args.engine_num_blocks,
            model=args.model,
            ready_timeout_s=args.ready_timeout,
            log_dir=args.log_dir,
            index_mode=args.index_mode,
        )
    )
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()  # start_cluster stops what it started
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        _say("kvgate up: interrupted during start-up; stopped", err=True)
        return 1
    try:
        cluster = starting.result()
    except (KvgateError, OSError) as exc:
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        _say(f"kvgate up: cannot start: {getattr(exc, 'message', None) or exc}", err=True)
        # a bad setting is found before anything starts: a usage error, as argparse's
        return 2 if isinstance(exc, ConfigError) else 1
    _say(
        banner(
            cluster,
            model=args.model,
            policy=args.policy,
            speedup=args.engine_speedup,
            token_generated=args.admin_token is None,
        )
    )
    watch = asyncio.ensure_future(_watch_engines(cluster))
    try:
        await stopping
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        _say("kvgate up: stopping")
        await cluster.stop()
    _say("kvgate up: stopped")
    return 0


def _say(text: str, *, err: bool = False) -> None:
    """Print a line; a stream that cannot take it (its reader gone, a full disk) is
    no reason to skip the teardown that comes after: it is silenced instead."""
    stream = sys.stderr if err else sys.stdout
    try:
        print(text, file=stream, flush=True)
    except OSError:
        if not err:
            silence_stdout()


async def _watch_engines(cluster: Cluster) -> None:
    """Say once when an engine process exits on its own (the gateway routes around it)."""
    reported: set[int] = set()
    while True:
        await asyncio.sleep(1.0)
        for e in cluster.engines:
            if not e.alive() and e.pid not in reported:
                reported.add(e.pid)
                _say(
                    f"kvgate up: engine {e.node_id} (pid {e.pid}) exited with code "
                    f"{e.proc.returncode}; see {e.log_path}"
                    + (" (removed when kvgate up exits; --log-dir keeps it)"
                       if cluster.own_log_dir else ""),
                    err=True,
                )
