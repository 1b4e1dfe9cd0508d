"""The gateway as an object: its parts, its routes, start and stop.

:class:`Gateway` owns the controller (the core), the node watcher, the upstream
sessions, the driver (waiters and the lease loop) and the metrics. The aiohttp
application keeps it under :data:`GATEWAY_KEY`, so later layers (the admin API,
the dashboard) reach ``app[GATEWAY_KEY].controller`` and ``.controller.nodes``
and add their routes through ``start_gateway(config, setup=...)``.

Routes (all in :func:`register_routes`)::

    POST /v1/completions, /v1/chat/completions   the proxy (proxy.py, relay.py)
    GET  /v1/models     union of the nodes' models
    GET  /health        liveness; never touches the limiter
    GET  /ready         200 while a node is healthy (any lease state), else 503
    GET  /metrics       Prometheus text (metrics_text.py)
    /admin/...          the admin API (admin.py)
    GET  /dashboard     the live dashboard (dashboard.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest

from kvgate.core.admission import AdmissionConfig, InProcessCoordinator
from kvgate.core.controller import Controller
from kvgate.core.errors import AuthError
from kvgate.core.nodes import NodeTable
from kvgate.edge import EdgeRunner, expect_handler, get_route_adder, json_response
from kvgate.gateway.admin import register_admin
from kvgate.gateway.body import UnsupportedMediaTypeError, check_json_body_type
from kvgate.gateway.config import DEFAULT_GATEWAY_ID, GatewayConfig
from kvgate.gateway.dashboard import register_dashboard
from kvgate.gateway.driver import Driver, InProcessLeaseClient, LeaseClient, RemoteLeaseClient
from kvgate.gateway.errors import edge_middleware, refusing
from kvgate.gateway.identity import Authenticator
from kvgate.gateway.metrics_text import GatewayMetrics, render
from kvgate.gateway.node_watcher import NodeWatcher
from kvgate.gateway.proxy import CompletionsHandler
from kvgate.gateway.redis_coordinator import RedisCoordinator
from kvgate.gateway.relay import Relay
from kvgate.gateway.upstream import Upstream
from kvgate.protocol.errors import not_found_body

log = logging.getLogger("kvgate.gateway")


def fleet_gateway_id(config: GatewayConfig) -> str:
    """``server.gateway_id``; with a shared (Redis) coordinator, the default "gw0" becomes
    host-pid-random: two gateways under one id would share one lease record and so,
    together, admit twice their share."""
    gid = config.server.gateway_id
    if config.admission.coordinator == "redis" and gid == DEFAULT_GATEWAY_ID:
        # plus a random part: in containers the pid is often 1 and hosts may share names
        return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return gid


def _redis_coordinator(
    config: GatewayConfig, admission: AdmissionConfig
) -> RedisCoordinator | None:
    """The fleet's coordinator when ``admission.coordinator`` is redis, else None."""
    a = config.admission
    if a.coordinator != "redis":
        return None
    if a.expected_gateways == 1:
        log.warning(
            "admission.coordinator is redis but admission.expected_gateways is 1: if Redis "
            "is down when the fleet starts, every gateway may admit the whole budget; set "
            "it to the number of gateways"
        )
    return RedisCoordinator(admission, a.redis_url, key=a.redis_key)


class Gateway:
    """Every part of one gateway. Construct inside the running event loop."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        lease: LeaseClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        cc = config.controller_config()
        self.gateway_id = fleet_gateway_id(config)
        self.controller = Controller(
            cc, rng=random.Random(config.server.seed), gateway_id=self.gateway_id
        )
        # a fleet shares one budget through Redis; one gateway keeps it in process
        self.redis = _redis_coordinator(config, cc.admission) if lease is None else None
        if lease is None:
            lease = (RemoteLeaseClient(self.redis) if self.redis is not None
                     else InProcessLeaseClient(InProcessCoordinator(cc.admission)))
        self.lease: LeaseClient = lease
        self.metrics = GatewayMetrics()
        if self.redis is not None:
            redis = self.redis
            self.metrics.coordinator_conflicts = lambda: redis.conflicts
        self.auth = Authenticator(config.auth)
        self.upstream = Upstream(config.upstream, config.nodes)
        upstream = self.upstream
        self.metrics.upstream_resends = lambda: upstream.lean.resends if upstream.lean else 0
        self.driver = Driver(
            self.controller, self.lease, self.metrics,
            tick_interval_s=config.admission.tick_interval_s, clock=clock,
        )
        self.watcher = NodeWatcher(self.controller, config.nodes, self.upstream, clock,
                                   after_down=self.driver.abort_unanswered)
        self.relay = Relay(
            self.driver, self.watcher, self.upstream, self.metrics,
            route_headers=config.server.route_headers,
        )
        self.handler = CompletionsHandler(config, self.auth, self.watcher, self.relay)
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def nodes(self) -> NodeTable:
        return self.controller.nodes

    async def start(self) -> None:
        """Probe the nodes, take a first lease, start the lease loop."""
        await self.watcher.start()
        await self.driver.step()
        await self.driver.wait_refresh()  # a remote first lease runs in the background
        self._loop_task = asyncio.ensure_future(self.driver.run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        await self.driver.stop()  # a remote refresh still in flight
        await self.watcher.stop()
        await self.lease.close(self.gateway_id)
        if self.redis is not None:
            await self.redis.close()
        await self.upstream.close()

    @property
    def draining(self) -> bool:
        return self.driver.draining

    def begin_drain(self) -> None:
        """Stopping: /ready turns 503, new requests are refused 503 shutting_down (their
        clients may retry elsewhere at once), and so are the ones held in the queue."""
        if self.driver.draining:
            return
        shed = self.driver.begin_drain()
        log.info("draining: %d request(s) in flight, %d queued one(s) refused 503",
                 self.controller.in_flight(), shed)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready while the gateway can admit. Every lease state admits (ACTIVE and
        EXPIRED_REUSING from the lease, SAFE from its safe limit, NO_ASSIGNMENT P0
        from the start-up allowance K / expected_gateways), and a coordinator blip
        hits every gateway at once: unready then, the load balancer would drop the
        whole fleet together. So the lease only shows in the body (``degraded``)."""
        healthy = self.watcher.healthy_count()
        adm = self.controller.admission
        return healthy > 0, {
            "healthy_nodes": healthy,
            "lease_state": adm.lease_state.value,
            "degraded": adm.degraded,
        }

    # ------------------------------------------------------------------ handlers
    async def health(self, request: web.Request) -> web.StreamResponse:
        return json_response(200, {"status": "ok"})

    async def ready_handler(self, request: web.Request) -> web.StreamResponse:
        ok, detail = self.ready()
        if self.draining:  # stopping: a load balancer must send nothing more here
            return json_response(503, {"status": "draining", **detail}, {"Retry-After": "1"})
        if ok:
            return json_response(200, {"status": "ready", **detail})
        return json_response(503, {"status": "not_ready", **detail}, {"Retry-After": "1"})

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.auth.identify(request.headers)
        return json_response(200, {"object": "list", "data": self._model_items()})

    async def model(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models/{model}`` (the openai SDK's ``models.retrieve``): the entry of
        a model some node serves, else 404 model_not_found."""
        self.auth.identify(request.headers)
        name = request.match_info["model"]
        for item in self._model_items():
            if item.get("id") == name:
                return json_response(200, item)
        return json_response(404, not_found_body(name))

    def _model_items(self) -> list[dict[str, Any]]:
        data = []
        for entry in self.watcher.model_entries():
            item = {"object": "model", "created": 0, "owned_by": "kvgate", **entry}
            item["object"] = "model"
            data.append(item)
        return data

    async def metrics_handler(self, request: web.Request) -> web.StreamResponse:
        text = render(self.controller, self.watcher, self.metrics, self.clock())
        return web.Response(
            body=text.encode("utf-8"),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("kvgate_gateway", Gateway)
# a stop ends the streams still running this long before aiohttp cancels their handlers
STREAM_END_MARGIN_S = 0.25
# one line per request: who, what, status, bytes, seconds, and the request id and node a
# client's report or a node's log can be matched with
ACCESS_LOG_FORMAT = ('%a "%r" %s %b %Tf rid=%{X-Request-Id}o node=%{X-Kvgate-Node}o '
                     'reason=%{X-Kvgate-Route-Reason}o')
# probes and scrapes, answered every second or so: not worth a line each
_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", "/dashboard/state"})


class AccessLog(AccessLogger):
    """aiohttp's access logger, without the probe and scrape paths."""

    def log(self, request: BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in _QUIET_PATHS:
            super().log(request, response, time)


def register_routes(app: web.Application, gw: Gateway) -> None:
    """Every route of the OpenAI surface and the probes, in one place."""
    # Expect: 100-continue is answered only for a caller, a size and a body type the proxy
    # would take: its first checks run before a body is invited (a 401 for an unknown
    # caller, a 415 for a form or text/plain)
    def proxy_would_read(request: web.Request) -> None:
        gw.auth.identify(request.headers)
        check_json_body_type(request.headers)

    known_caller = refusing(proxy_would_read, AuthError, UnsupportedMediaTypeError)
    expect = expect_handler(gw.config.server.client_max_size, known_caller)
    app.router.add_post("/v1/completions", gw.handler.completions, expect_handler=expect)
    app.router.add_post("/v1/chat/completions", gw.handler.chat, expect_handler=expect)
    get = get_route_adder(app.router, gw.config.server.client_max_size)
    get("/v1/models", gw.models)
    get("/v1/models/{model:.+}", gw.model)  # ids may hold '/'
    get("/health", gw.health)
    get("/ready", gw.ready_handler)
    get("/metrics", gw.metrics_handler)
    register_admin(app, gw)  # /admin/... (bearer admin token; 403 when none is set)
    if gw.config.server.dashboard:
        register_dashboard(app, gw)  # /dashboard, /dashboard/state (read-only, no secrets)


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(
        client_max_size=gw.config.server.client_max_size,
        middlewares=[edge_middleware(gw.metrics.responses)],  # errors + response counts
    )
    app[GATEWAY_KEY] = gw
    register_routes(app, gw)
    return app


class GatewayServer:
    """A running gateway: ``.url``, ``.port``, ``.controller``; ``await .stop()``."""

    def __init__(self, gateway: Gateway, app: web.Application, runner: web.AppRunner,
                 host: str, port: int) -> None:
        self.gateway = gateway
        self.app = app
        self.runner = runner
        self.host = host
        self.port = port

    @property
    def controller(self) -> Controller:
        return self.gateway.controller

    @property
    def nodes(self) -> NodeTable:
        return self.gateway.controller.nodes

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Drain and stop: refuse new and queued requests (503 shutting_down) and turn
        /ready to 503, still listening for ``server.drain_delay_s``; then stop accepting
        and let in-flight requests finish within ``server.shutdown_timeout_s``, ending
        the streams still running just before with an error event and ``[DONE]``; then
        stop the loops."""
        srv = self.gateway.config.server
        try:
            self.gateway.begin_drain()
            if srv.drain_delay_s > 0:
                await asyncio.sleep(srv.drain_delay_s)
            cleanup = asyncio.ensure_future(self.runner.cleanup())
            # aiohttp cancels the handlers after half the timeout (see start_gateway)
            grace = max(0.0, srv.shutdown_timeout_s / 2 - STREAM_END_MARGIN_S)
            done, _ = await asyncio.wait({cleanup}, timeout=grace)
            if not done:
                ended = self.gateway.relay.end_streams()
                if ended:
                    log.info("stopping: ended %d request(s) still running", ended)
            await cleanup
        finally:
            await self.gateway.stop()


async def start_gateway(
    config: GatewayConfig,
    *,
    setup: Callable[[web.Application], None] | None = None,
    lease: LeaseClient | None = None,
) -> GatewayServer:
    """Build, probe the nodes, bind and serve; ``setup(app)`` may add routes first."""
    gw = Gateway(config, lease=lease)
    runner: web.AppRunner | None = None
    try:
        await gw.start()
        app = build_app(gw)
        if setup is not None:
            setup(app)
        srv = config.server
        responses = gw.metrics.responses

        def count_own_answer(status: int) -> None:
            # the connection's own answers (a head timeout, a request line it refused)
            responses[("connection", status)] += 1

        def count_expect_answer(endpoint: str, status: int) -> None:
            # answers to an Expect given before the middleware (417, 413, 401 ...)
            responses[(endpoint, status)] += 1

        runner = EdgeRunner(
            app,
            header_timeout_s=srv.header_timeout_s,
            on_answer=count_own_answer,
            on_route_answer=count_expect_answer,
            handler_cancellation=True,
            access_log=logging.getLogger("kvgate.access") if srv.access_log else None,
            access_log_class=AccessLog,
            access_log_format=ACCESS_LOG_FORMAT,
            # aiohttp waits this long for handlers, then as long again for the
            # connections it closes: half each keeps the whole stop within the setting
            # (it took 20.1 s with one request in flight and the default 10 s)
            shutdown_timeout=srv.shutdown_timeout_s / 2,
        )
        await runner.setup()
        site = web.TCPSite(runner, srv.host, srv.port)
        await site.start()
        port = _bound_port(runner, srv.port)
    except BaseException:
        if runner is not None:
            await runner.cleanup()
        await gw.stop()
        raise
    log.info("kvgate gateway %s listening on %s:%d with %d node(s), %s coordinator",
             gw.gateway_id, srv.host, port, len(gw.watcher.nodes),
             gw.config.admission.coordinator)
    return GatewayServer(gw, app, runner, srv.host, port)


def _bound_port(runner: web.AppRunner, default: int) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return default
