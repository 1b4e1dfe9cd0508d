"""`kvgate engine` command-line arguments -> :class:`EngineServerConfig` (pure).

The runner itself, `run_engine(args)`, lives in engine/server.py (it owns the
event loop); both are re-exported there.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvgate.commands.argtypes import positive_float, positive_int
from kvgate.engine.api import EngineConfig
from kvgate.engine.profiles import DEFAULT_PROFILE, PROFILES
from kvgate.engine.server_config import EngineServerConfig, FaultSpec, parse_fault_flag

__all__ = ["add_engine_parser", "config_from_args"]

_DEFAULTS = EngineServerConfig()


def _fault(text: str) -> FaultSpec:
    try:
        return parse_fault_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_parser(subparsers: Any) -> None:
    """Add the ``engine`` sub-command to an ``argparse`` sub-parsers object."""
    p = subparsers.add_parser(
        "engine",
        help="serve a simulated inference engine over vLLM's OpenAI API",
        description="Serve kvgate's simulated engine (paged KV cache with prefix caching, "
        "continuous batching, a per-GPU timing model) over vLLM's OpenAI-compatible HTTP "
        "API, with vLLM metric names, vLLM KV events over ZMQ and fault injection "
        "(POST /admin/fault).",
    )
    p.add_argument("--host", default=_DEFAULTS.host, help="bind address (default %(default)s)")
    p.add_argument(
        "--port",
        type=int,
        default=_DEFAULTS.port,
        help="port, 0 for any free one (default %(default)s)",
    )
    p.add_argument(
        "--model", default=_DEFAULTS.model, help="served model name (default %(default)s)"
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help="timing profile (default %(default)s)",
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=EngineConfig().num_blocks,
        help="KV cache size in blocks (default %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=_DEFAULTS.block_size,
        help="tokens per KV block (default %(default)s)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + output in tokens (default: the KV pool's capacity)",
    )
    p.add_argument(
        "--speedup",
        type=positive_float,
        default=_DEFAULTS.speedup,
        help="run the modelled time this many times faster than wall time (default %(default)s)",
    )
    p.add_argument(
        "--node-id", default=None, help="node id in logs and /kvgate/evictions (default host:port)"
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="publish vLLM KV events on a ZMQ PUB socket, e.g. tcp://*:5557 (bind) "
        "or tcp://router:5557 (connect), as vLLM does; off by default",
    )
    p.add_argument(
        "--kv-events-layout",
        choices=("map", "array"),
        default=_DEFAULTS.kv_events_layout,
        help="event encoding: map = vLLM >= 0.24 (0.33's bytes), array = vLLM <= 0.23 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--kv-events-topic",
        default=_DEFAULTS.kv_events_topic,
        help="ZMQ topic frame (vLLM's default: empty)",
    )
    p.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="ACTION[:VALUE]",
        help="inject a fault at start (repeatable): crash, slow:K, reject, "
        "mass_evict:X, midstream_error[:N], reset_connection[:COUNT], "
        "slow_first_byte:S",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("priority", "fcfs"),
        default=_DEFAULTS.scheduling_policy,
        help="engine scheduling policy (default %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> EngineServerConfig:
    """The config the parsed ``engine`` arguments describe (ValueError if inconsistent)."""
    return EngineServerConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        profile=args.profile,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        speedup=args.speedup,
        node_id=args.node_id,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_layout=args.kv_events_layout,
        kv_events_topic=args.kv_events_topic,
        faults=tuple(args.fault),
        scheduling_policy=args.scheduling_policy,
    )
