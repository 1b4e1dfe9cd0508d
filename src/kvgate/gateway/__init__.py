"""The gateway: kvgate's only network I/O in front of the inference nodes.

An asyncio + aiohttp server speaking OpenAI's API, driving the pure core
(:class:`kvgate.core.controller.Controller`) from the event loop's thread:

* ``config.py`` / ``config_load.py``: :class:`GatewayConfig` from YAML, env, flags;
* ``app.py``: :class:`Gateway` (the parts), routes, :func:`start_gateway`;
* ``proxy.py`` (request intake) and ``relay.py`` (attempts, retries, streaming);
* ``driver.py``: decisions carried out, waiters for held requests, the lease loop;
* ``node_watcher.py`` / ``node_probe.py``: models, health, load, evictions;
* ``upstream.py``: pooled sessions and the failure kinds; ``errors.py``: the edge;
* ``identity.py``: API keys, tenants, priority caps; ``metrics_text.py``: /metrics;
* ``serve.py``: ``kvgate serve`` (:func:`add_serve_parser`, :func:`run_serve`).
"""

from kvgate.core.errors import ConfigError
from kvgate.gateway.app import GATEWAY_KEY, Gateway, GatewayServer, build_app, start_gateway
from kvgate.gateway.config import (
    AdmissionSection,
    ApiKey,
    AuthConfig,
    GatewayConfig,
    NodeConfig,
    NodesConfig,
    RoutingConfig,
    ServerConfig,
    UpstreamConfig,
)
from kvgate.gateway.config_load import load_config
from kvgate.gateway.serve import add_serve_parser, run_serve

__all__ = [
    "GATEWAY_KEY",
    "AdmissionSection",
    "ApiKey",
    "AuthConfig",
    "ConfigError",
    "Gateway",
    "GatewayConfig",
    "GatewayServer",
    "NodeConfig",
    "NodesConfig",
    "RoutingConfig",
    "ServerConfig",
    "UpstreamConfig",
    "add_serve_parser",
    "build_app",
    "load_config",
    "run_serve",
    "start_gateway",
]
