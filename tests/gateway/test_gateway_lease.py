"""The lease loop against a remote coordinator: client errors, stalls, shutdown.

Driver-level tests on a fake clock where time matters to the core, with a fake
:class:`AsyncCoordinator` standing in for Redis (no sockets).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import aiohttp
import pytest

from kvgate.core.admission import (
    AdmissionConfig,
    ClassConfig,
    InProcessCoordinator,
    LeaseConfig,
    LeaseGrant,
    LeaseState,
    RefreshRequest,
    RejectReason,
)
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Decision, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec
from kvgate.gateway import start_gateway
from kvgate.gateway.driver import Driver, RemoteLeaseClient
from kvgate.gateway.metrics_text import GatewayMetrics
from kvgate.testing import run_bounded


class RedisConnectionError(Exception):
    """Like redis-py's ``redis.exceptions.ConnectionError``: an Exception, not OSError."""


class BrokenRemote:
    """Every call raises the next error of ``errors`` (a client library's own)."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        raise self.errors.pop(0)

    async def release_gateway(self, gateway_id: str) -> None:
        raise self.errors.pop(0)


def controller(nodes: int = 2, admission: AdmissionConfig | None = None) -> Controller:
    cc = ControllerConfig(hasher="trace", admission=admission or AdmissionConfig())
    ctl = Controller(cc, rng=random.Random(1), gateway_id="g")
    for i in range(nodes):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}"), cache_blocks=40), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    return ctl


def test_any_client_error_is_a_failed_refresh_logged_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = [
        aiohttp.ServerDisconnectedError(),
        RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        RedisConnectionError("Connection reset by peer"),
    ]
    client = RemoteLeaseClient(BrokenRemote(errors), timeout_s=0.5, warn_every_s=60.0)
    ctl = controller()
    now = [0.0]

    async def body() -> None:
        with caplog.at_level(logging.INFO, logger="kvgate.gateway"):
            assert ctl.refresh_due(now[0])
            await client.refresh(ctl, lambda: now[0])
            assert ctl.admission.stats().refresh_failures == 1
            now[0] = 0.51  # the periodic schedule, not one ttl later: nothing left in flight
            assert ctl.refresh_due(now[0])
            await client.refresh(ctl, lambda: now[0])
            assert ctl.admission.stats().refresh_failures == 2
            await client.close("g")  # does not raise either

    run_bounded(body(), 5.0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # rate-limited + close
    assert all(r.exc_info is None for r in warnings)  # one line, no traceback
    assert "ServerDisconnectedError" in warnings[0].getMessage()
    assert "release" in warnings[1].getMessage()
    assert ctl.admission.lease_state is LeaseState.NO_ASSIGNMENT
    assert client.failing == 2


def test_a_refresh_after_failures_logs_the_recovery(caplog: pytest.LogCaptureFixture) -> None:
    ctl = controller()
    remote = BrokenRemote([RedisConnectionError("down")])
    inner = InProcessCoordinator(ctl.config.admission)

    async def refresh(req: RefreshRequest, now: float) -> LeaseGrant:
        if remote.errors:
            raise remote.errors.pop(0)
        return inner.refresh(req, now)

    remote.refresh = refresh  # type: ignore[method-assign]
    client = RemoteLeaseClient(remote, timeout_s=0.5)

    async def body() -> None:
        with caplog.at_level(logging.INFO, logger="kvgate.gateway"):
            await client.refresh(ctl, lambda: 0.0)
            await client.refresh(ctl, lambda: 0.6)

    run_bounded(body(), 5.0)
    assert ctl.admission.lease_state is LeaseState.ACTIVE and client.failing == 0
    assert "reachable again after 1 failed" in caplog.records[-1].getMessage()


class HangingRemote:
    """A stalled coordinator: a refresh never answers (until cancelled)."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = 0

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")

    async def release_gateway(self, gateway_id: str) -> None:
        return None


def test_ticks_go_on_while_a_remote_refresh_hangs() -> None:
    """A queued request's deadline, and the tick itself, keep their time while the
    coordinator stalls; one refresh in flight at most; stop cancels it cleanly."""
    short = ClassConfig(share=0.3, lendable=1.0, queue_timeout_s=0.2)
    cfg = AdmissionConfig(
        classes=(AdmissionConfig().classes[0], short, AdmissionConfig().classes[2]),
        lease=LeaseConfig(refresh_s=0.05, ttl_s=0.1, margin_s=0.02, reuse_timeout_s=0.1),
    )
    ctl = controller(admission=cfg)
    ticks: list[float] = []
    tick = ctl.tick

    def counting_tick(now: float) -> list[Decision]:
        ticks.append(now)
        return tick(now)

    ctl.tick = counting_tick  # type: ignore[method-assign]
    remote = HangingRemote()
    t0 = time.monotonic()
    driver = Driver(ctl, RemoteLeaseClient(remote, timeout_s=10.0), GatewayMetrics(),
                    tick_interval_s=0.01, clock=lambda: time.monotonic() - t0)

    async def body() -> None:
        loop = asyncio.ensure_future(driver.run())
        try:
            # No lease yet (NO_ASSIGNMENT): a P1 request waits for one, until its deadline.
            start = time.monotonic()
            d = await driver.admit(RequestArrived(request_id=RequestId("p1"), block_ids=(1, 2),
                                                  prompt_tokens=32, priority=1))
            waited = time.monotonic() - start
            assert isinstance(d, Reject) and d.rejected.reason is RejectReason.QUEUE_TIMEOUT
            assert waited < 0.6, waited  # 0.2 s + a tick, not the refresh's 10 s timeout
            await asyncio.sleep(0.2)
            assert len(ticks) >= 20  # ~every 10 ms all along
            assert remote.calls == 1  # the core would refresh again (ttl 0.1 s): one at a time
        finally:
            loop.cancel()
            await asyncio.wait({loop})
            await driver.stop()
        assert remote.cancelled == 1

    run_bounded(body(), 5.0)
    assert ctl.admission.lease_state is LeaseState.NO_ASSIGNMENT



class DownRemote:
    """A coordinator nobody can reach."""

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        raise RedisConnectionError("Connection refused")

    async def release_gateway(self, gateway_id: str) -> None:
        raise RedisConnectionError("Connection refused")


def test_without_its_coordinator_a_gateway_is_ready_degraded_and_serves_p0(kit: Any) -> None:
    """/ready is 200 in every lease state while a node is healthy; the lease state
    and ``degraded`` are in its body (a blip must not unready the whole fleet)."""

    async def body() -> None:
        async with kit.cluster(1) as c:
            srv = await start_gateway(c.gw.gateway.config, lease=RemoteLeaseClient(DownRemote()))
            try:
                assert srv.controller.admission.lease_state is LeaseState.NO_ASSIGNMENT
                async with c.session.get(srv.url + "/ready") as r:
                    assert r.status == 200
                    detail = await r.json()
                assert detail["lease_state"] == "no_assignment" and detail["degraded"] is True
                async with c.session.post(srv.url + "/v1/completions",
                                          json={"model": kit.MODEL, "prompt": "x"},
                                          headers={"X-Kvgate-Priority": "0"}) as r:
                    assert r.status == 200  # P0 from the start-up allowance
                c.stubs[0].healthy = False  # unready only when it cannot serve at all
                await kit.eventually(lambda: srv.gateway.watcher.healthy_count() == 0)
                async with c.session.get(srv.url + "/ready") as r:
                    assert r.status == 503
            finally:
                await srv.stop()

    kit.run(body())
