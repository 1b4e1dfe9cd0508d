"""/metrics, TCP_NODELAY on both sides, the extension hook and the lease seam."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from typing import Any

import pytest
from aiohttp import web

from kvgate.core.admission import (
    CoordinatorUnavailable,
    InProcessCoordinator,
    LeaseGrant,
    LeaseState,
    RefreshRequest,
)
from kvgate.gateway import GATEWAY_KEY, start_gateway
from kvgate.gateway.driver import RemoteLeaseClient
from kvgate.gateway.metrics_text import FAMILIES


def test_metrics_page_declares_every_documented_name(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"waiting": 2}) as c:
            for i in range(3):
                await c.post("/v1/completions", {"model": kit.MODEL, "prompt": f"p{i}"})
            await c.post("/v1/completions", {"model": kit.MODEL, "prompt": 3})
            await kit.eventually(
                lambda: all(s.report_time is not None for s in c.gw.controller.nodes))
            status, headers, raw = await c.get("/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            text = raw.decode()
            for name, fam in FAMILIES.items():
                assert name.startswith("kvgate_")
                assert f"# TYPE {name} {fam.kind}\n" in text, name
            names = set(re.findall(r"^(kvgate_[a-z0-9_]+?)(?:_bucket|_sum|_count)?[{ ]",
                                   text, re.M))
            assert names <= set(FAMILIES)
            assert 'kvgate_requests_total{outcome="completed"} 3' in text
            assert 'kvgate_http_responses_total{endpoint="/v1/completions",code="400"} 1' in text
            assert "kvgate_decision_latency_seconds_count 4" not in text  # the 400 never arrived
            assert "kvgate_decision_latency_seconds_count 3" in text
            assert 'kvgate_lease_state{state="active"} 1' in text
            assert 'kvgate_node_healthy{node="n0"} 1' in text
            age = re.search(r'kvgate_node_report_age_seconds\{node="n0"\} ([0-9.]+)', text)
            assert age is not None and float(age.group(1)) < 1.0
            assert re.search(r'kvgate_node_queue\{node="n1"\} 2\b', text)
            assert 'kvgate_prefix_hit_ratio{bucket="lt1k",source="measured"}' in text
            assert 'kvgate_cached_tokens_total{bucket="lt1k",source="confirmed"}' in text

    kit.run(body())


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
def test_tcp_nodelay_and_setup_hook(kit: Any, client: str) -> None:
    """Both sides of the gateway set TCP_NODELAY, with either upstream client."""
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"},  # holds its connection
                               upstream={"client": client}) as c:
            cfg = c.gw.gateway.config
            assert cfg.upstream.client == client
            stub_url = c.stubs[0].url

            async def probe(request: web.Request) -> web.Response:
                gw = request.app[GATEWAY_KEY]
                assert request.transport is not None
                server_side = request.transport.get_extra_info("socket")
                body = b'{"model": "stub-model", "prompt": "x", "stream": true}'
                r = await gw.upstream.post(stub_url + "/v1/completions", body,
                                           {"Content-Type": "application/json"}, stream=True)
                try:
                    assert r.connection is not None and r.connection.transport is not None
                    client_side = r.connection.transport.get_extra_info("socket")
                    flags = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                             for s in (server_side, client_side)]
                finally:
                    r.close()
                return web.json_response({"nodelay": flags, "nodes": len(gw.controller.nodes)})

            def setup(app: web.Application) -> None:
                app.router.add_get("/test/probe", probe)

            srv = await start_gateway(cfg, setup=setup)
            try:
                async with c.session.get(srv.url + "/test/probe") as r:
                    got = await r.json()
                assert got["nodelay"][0] and got["nodelay"][1] and got["nodes"] == 1
            finally:
                await srv.stop()

    kit.run(body())


class FlakyRemote:
    """An awaited coordinator (the seam a Redis client will fill)."""

    def __init__(self, inner: InProcessCoordinator) -> None:
        self.inner = inner
        self.down = False
        self.released: list[str] = []

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        await asyncio.sleep(0.001)
        if self.down:
            raise CoordinatorUnavailable("down")
        return self.inner.refresh(req, now)

    async def release_gateway(self, gateway_id: str) -> None:
        self.released.append(gateway_id)


def test_remote_lease_client_and_readiness(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            cfg = c.gw.gateway.config
            remote = FlakyRemote(InProcessCoordinator(cfg.controller_config().admission))
            srv = await start_gateway(cfg, lease=RemoteLeaseClient(remote, timeout_s=0.5))
            try:
                adm = srv.controller.admission
                assert adm.lease_state is LeaseState.ACTIVE
                async with c.session.get(srv.url + "/ready") as r:
                    assert r.status == 200
                async with c.session.post(srv.url + "/v1/completions",
                                          json={"model": kit.MODEL, "prompt": "x"}) as r:
                    assert r.status == 200
                remote.down = True
                await kit.eventually(lambda: adm.lease_state is not LeaseState.ACTIVE, 5.0)
                async with c.session.get(srv.url + "/ready") as r:
                    # still ready: it serves from its last lease (a coordinator blip must
                    # not take every gateway out of the load balancer at once)
                    assert r.status == 200
                    detail = await r.json()
                assert detail["lease_state"] in ("expired_reusing", "safe")
                assert detail["degraded"] is (detail["lease_state"] == "safe")
                assert srv.controller.admission.stats().refresh_failures >= 1
                remote.down = False
                await kit.eventually(lambda: adm.lease_state is LeaseState.ACTIVE, 5.0)
            finally:
                await srv.stop()
            assert remote.released == ["gw0"]

    kit.run(body())


def test_a_client_gone_mid_stream_is_always_a_499(kit: Any) -> None:
    """However the gateway notices (its handler cancelled, or a write failing first,
    the usual case while it relays a burst), it is a 499."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "burst"}) as c:
            port = int(c.url.rsplit(":", 1)[1])
            req = b'{"model": "stub-model", "prompt": "hi", "stream": true}'
            n = 10
            for _ in range(n):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(req), req))
                assert (await reader.read(4096)).startswith(b"HTTP/1.1 200")
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()  # a reset, mid-stream
            ctl = c.gw.controller
            responses = c.gw.gateway.metrics.responses
            await kit.eventually(
                lambda: sum(v for (e, _), v in responses.items() if e == "/v1/completions") == n
            )
            assert ctl.num_requests() == 0
            assert responses[("/v1/completions", 499)] == n
            assert responses[("/v1/completions", 200)] == 0
            assert c.gw.gateway.metrics.client_disconnects == n
            assert ctl.stats.outcomes["cancelled"] == n

    kit.run(body())


def test_no_node_for_the_request_shows_in_the_admission_rejections(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL, "prompt": "p"},
                                        {"X-Kvgate-Exclude-Node": "n0,n1"})
            assert status == 503
            _, _, raw = await c.get("/metrics")
            text = raw.decode()
            assert 'kvgate_rejections_total{reason="overloaded"} 1' in text
            assert 'kvgate_admission_rejected_total{reason="overloaded",class="P1"} 1' in text

    kit.run(body())


def test_an_attempt_at_a_node_removed_meanwhile_is_not_counted(kit: Any) -> None:
    """A decision resolved just after DELETE /admin/nodes/{id}: nothing is sent, so no
    kvgate_upstream_attempts_total series comes back for the removed node."""
    from kvgate.core.decisions import Dispatch, Fail
    from kvgate.core.ids import NodeId, RequestId
    from kvgate.core.routing.base import RouteDecision, RouteReason
    from kvgate.gateway.relay import Flight

    async def body() -> None:
        async with kit.cluster(1) as c:
            relay = c.gw.gateway.relay
            flight = Flight(rid=RequestId("r-gone"), client_rid="r-gone", path="/v1/completions",
                            body=b"{}", stream=False, wants_usage=False, headers={})
            route = RouteDecision(node_id=NodeId("gone"), reason=RouteReason.LOAD)
            out = await relay._attempt_once(None, flight, Dispatch(request_id=flight.rid,
                                                                   route=route))
            assert isinstance(out, Fail) and out.reason == "connect_error"
            assert "gone" not in relay.metrics.attempts
            _, _, raw = await c.get("/metrics")
            assert 'node="gone"' not in raw.decode()

    kit.run(body())


def test_the_access_log_names_request_id_node_and_time_and_skips_probes(
        kit: Any, caplog: Any) -> None:
    """server.access_log: aiohttp's default line had no request id, node or duration, and
    logged every health check and scrape."""
    import logging

    async def body() -> None:
        caplog.set_level(logging.INFO, logger="kvgate.access")
        async with kit.cluster(1, server={"access_log": True}) as c:
            status, _, _ = await c.post("/v1/completions",
                                        {"model": kit.MODEL, "prompt": "x"},
                                        {"X-Request-Id": "abc-123"})
            assert status == 200
            for path in ("/health", "/ready", "/metrics"):
                await c.get(path)
        lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
        assert len(lines) == 1, lines
        assert '"POST /v1/completions HTTP/1.1" 200' in lines[0]
        assert "rid=abc-123 node=n0 reason=" in lines[0]
        seconds = lines[0].split('" 200 ')[1].split()[1]
        assert 0 < float(seconds) < 5

    kit.run(body())
