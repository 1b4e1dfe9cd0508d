"""``kvgate serve``: run the gateway until SIGINT, SIGTERM or SIGHUP (a second one
during the drain exits at once).

The lead wires it into ``kvgate.cli``::

    from kvgate.gateway.serve import add_serve_parser, run_serve
    add_serve_parser(sub)                     # in _build_parser
    if args.command == "serve": return run_serve(args)

Flags override the environment, which overrides the YAML file (see config.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from kvgate.core.errors import ConfigError
from kvgate.gateway.config import (
    AdmissionSection,
    GatewayConfig,
    NodesConfig,
    RoutingConfig,
    ServerConfig,
)
from kvgate.gateway.config_load import load_config, parse_nodes

log = logging.getLogger("kvgate.gateway")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``parser.add_subparsers()``'s result."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible, cache-aware, admission-controlled gateway",
        description="Serve /v1/completions and /v1/chat/completions in front of vLLM, "
        "SGLang or `kvgate engine` nodes. Precedence: flags > KVGATE_<SECTION>_<KEY> "
        "environment variables > the YAML file > defaults.",
    )
    # the defaults shown are read from the config's own, so the help stays true
    server, nodes = ServerConfig(), NodesConfig()
    budget, policy = AdmissionSection().budget, RoutingConfig().policy
    p.add_argument("--config", metavar="FILE", help="YAML configuration file")
    p.add_argument("--host", help=f"listen address (server.host, default {server.host})")
    p.add_argument("--port", type=int, help=f"listen port (server.port, default {server.port})")
    p.add_argument("--node", action="append", metavar="[NAME=]URL",
                   help="an inference node, repeatable; replaces nodes.static")
    p.add_argument("--policy", help=f"routing policy (routing.policy, default {policy})")
    p.add_argument("--budget", type=int,
                   help=f"cluster concurrency budget (admission.budget, default {budget})")
    p.add_argument("--admin-token", help="bearer token of the admin API (server.admin_token)")
    p.add_argument("--route-headers", action=argparse.BooleanOptionalAction, default=None,
                   help="add X-Kvgate-Node / X-Kvgate-Route-Reason to responses "
                   f"(server.route_headers, default {'on' if server.route_headers else 'off'})")
    p.add_argument("--metrics-interval", type=float, metavar="SECONDS",
                   help="node /metrics scrape interval "
                   f"(nodes.metrics_interval_s, default {nodes.metrics_interval_s:g})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"),
                   help=f"server.log_level (default {server.log_level})")
    return p


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags the user gave, as config sections (absent flags are not overrides)."""
    out: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            out.setdefault(section, {})[key] = value

    put("server", "host", getattr(args, "host", None))
    put("server", "port", getattr(args, "port", None))
    put("server", "admin_token", getattr(args, "admin_token", None))
    put("server", "route_headers", getattr(args, "route_headers", None))
    put("server", "log_level", getattr(args, "log_level", None))
    put("routing", "policy", getattr(args, "policy", None))
    put("admission", "budget", getattr(args, "budget", None))
    put("nodes", "metrics_interval_s", getattr(args, "metrics_interval", None))
    nodes = getattr(args, "node", None)
    if nodes:
        put("nodes", "static", parse_nodes(list(nodes)))
    return out


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return load_config(getattr(args, "config", None), overrides=flag_overrides(args))


def run_serve(args: argparse.Namespace) -> int:
    """Blocks until SIGINT/SIGTERM; 0 on a clean stop, 2 on a configuration error."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvgate serve: configuration error: {exc.message}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not config.nodes.static:
        log.warning("no nodes configured (--node URL or nodes.static): every request gets 503")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional
        runner = asyncio.run
    try:
        runner(_serve(config))
    except OSError as exc:  # e.g. the port is taken
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 1
    return 0


def on_stop_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
    """Call ``callback(signal name)`` on SIGINT, SIGTERM and SIGHUP (a closed terminal, a
    supervisor's reload: as for SIGTERM, where Python's default ended the process at
    once, cutting every stream), but not SIGHUP under nohup (it is ignored there: a
    closed terminal must not stop the process). ``kvgate serve`` and ``kvgate up``."""
    hup = getattr(signal, "SIGHUP", None)
    if hup is not None and signal.getsignal(hup) is signal.SIG_IGN:
        hup = None
    for sig in (signal.SIGINT, signal.SIGTERM, hup):
        if sig is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, callback, sig.name)


async def _serve(config: GatewayConfig) -> None:
    from kvgate.gateway.app import start_gateway

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        if stop.is_set():  # a second one during the drain: the operator means it
            log.warning("%s again while draining: exiting now", name)
            os._exit(1)
        log.info("%s: stopping", name)
        stop.set()

    on_stop_signals(loop, on_signal)
    server = await start_gateway(config)
    print(f"kvgate gateway serving on {server.url} ({len(server.nodes)} node(s))", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping: draining in-flight requests")
        await server.stop()
