"""Cache affinity, the one retry, client exclusion, mid-stream failures, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import aiohttp
import pytest

SYSTEM = "You are a careful assistant. " * 200  # ~5600 characters shared by every request


def _req(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": SYSTEM + f"question {i}", "max_tokens": 4, **extra}


def test_shared_prefix_lands_on_the_same_node(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(3) as c:
            nodes = set()
            for i in range(8):
                status, headers, _ = await c.post("/v1/completions", _req(i))
                assert status == 200
                nodes.add(headers["X-Kvgate-Node"])
            assert len(nodes) == 1
            assert sorted(s.attempts for s in c.stubs) == [0, 0, 8]
            assert c.gw.controller.stats.routed["cache_hit"] >= 7
            hits = c.gw.controller.stats.hits
            assert sum(h.predicted_hit_tokens for h in hits.values()) > 0
            # a different prefix is free to go elsewhere, but a repeat goes back home
            status, headers, _ = await c.post("/v1/completions", _req(99))
            assert headers["X-Kvgate-Node"] in nodes

    kit.run(body())


def test_retry_once_on_another_node_and_never_more(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(3, stub={"mode": "503"}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1))
            assert status == 503  # no node ran it: the client may retry (Retry-After)
            assert headers["Retry-After"] == "1" and "x-should-retry" not in headers
            assert sum(s.attempts for s in c.stubs) == 2  # first try + one retry
            assert sorted(s.attempts for s in c.stubs) == [0, 1, 1]
            failed = headers["X-Kvgate-Node"]
            assert c.stub(failed).attempts == 1
            assert json.loads(raw)["error"]["type"] == "server_error"
            assert c.gw.controller.stats.retries["http_503"] == 1
            assert c.gw.controller.num_requests() == 0

            # the client's own retry names the failed node: routed around it, no retry
            for s in c.stubs:
                s.seen.clear()
            status, headers, _ = await c.post("/v1/completions", _req(2),
                                              {"X-Kvgate-Exclude-Node": failed})
            assert status == 503
            assert c.stub(failed).attempts == 0
            assert sum(s.attempts for s in c.stubs) == 1

    kit.run(body())


def test_retry_elsewhere_succeeds_on_the_second_node(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            status, headers, _ = await c.post("/v1/completions", _req(1))
            home = headers["X-Kvgate-Node"]
            c.stub(home).mode = "retry-elsewhere"
            status, headers, _ = await c.post("/v1/completions", _req(2))
            assert status == 200 and headers["X-Kvgate-Node"] != home
            assert c.stub(home).attempts == 2
            assert c.gw.controller.stats.retries["retry_elsewhere"] == 1

    kit.run(body())


def test_pool_overloaded_is_not_retried(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "pool-overloaded"}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1))
            assert status == 503
            assert headers["x-should-retry"] == "false" and headers["Retry-After"] == "1"
            assert headers["X-Kvgate-Node"] in ("n0", "n1")
            assert json.loads(raw)["error"]["code"] == "pool_overloaded"
            assert sum(s.attempts for s in c.stubs) == 1

    kit.run(body())


def test_connect_refused_retries_on_another_node(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, nodes={"health_interval_s": 30.0}) as c:
            _, headers, _ = await c.post("/v1/completions", _req(1))
            home = headers["X-Kvgate-Node"]
            await c.stub(home).stop()  # the port is closed now; health checks are slow
            status, headers, _ = await c.post("/v1/completions", _req(2))
            assert status == 200 and headers["X-Kvgate-Node"] != home
            assert c.gw.controller.stats.retries["connect_error"] == 1

    kit.run(body())


def test_engine_4xx_passed_through_without_retry(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "400"}) as c:
            status, _, raw = await c.post("/v1/completions", _req(1))
            assert status == 400
            assert json.loads(raw)["error"]["message"] == "engine says 400"
            assert sum(s.attempts for s in c.stubs) == 1

    kit.run(body())


def test_engine_error_body_too_large_to_pass_through_is_not_cut_into_bad_json(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "400-large"}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1))
            assert status == 400  # still the client's own error, not retried
            assert headers["Content-Type"].startswith("application/json")
            err = json.loads(raw)["error"]  # whole JSON, not the first 64 KiB of the node's
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["code"] == "client_error"
            assert sum(s.attempts for s in c.stubs) == 1
            assert c.gw.controller.num_requests() == 0

    kit.run(body())


def test_engine_redirect_is_a_502_not_passed_through(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "redirect"}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1))
            assert status == 502  # the node is misconfigured: not the client's to follow
            assert "Location" not in headers
            err = json.loads(raw)["error"]
            assert err["type"] == "server_error" and err["code"] == "upstream_error"
            assert c.gw.controller.num_requests() == 0

    kit.run(body())


def test_timeout_before_first_byte_is_not_retried(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "hang"},
                               upstream={"request_timeout_s": 0.3}) as c:
            status, _, raw = await c.post("/v1/completions", _req(1))
            assert status == 502
            assert json.loads(raw)["error"]["code"] == "timeout"
            assert sum(s.attempts for s in c.stubs) == 1
            await kit.eventually(lambda: sum(s.disconnects for s in c.stubs) == 1)

    kit.run(body())


def test_stream_broken_after_first_byte_ends_with_error_event(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "die-mid-stream"}) as c:
            status, _, raw = await c.post("/v1/chat/completions", {
                "model": kit.MODEL, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[0].startswith("data: {") and '"t0 "' in events[0]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: "):])
            assert err["error"]["type"] == "server_error"
            assert sum(s.attempts for s in c.stubs) == 1  # no retry after bytes went out
            ctl = c.gw.controller
            assert ctl.stats.failures["upstream_error"] == 1
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

    kit.run(body())


def test_client_disconnect_cancels_upstream_and_frees_the_credit(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}) as c:
            ctl = c.gw.controller
            stub = c.stubs[0]
            async with aiohttp.ClientSession() as s:
                resp = await s.post(c.url + "/v1/completions", json=_req(1, stream=True))
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                assert ctl.admission.inuse_total == 1 and ctl.num_requests() == 1
                resp.close()
            await kit.eventually(lambda: stub.disconnects == 1)
            await kit.eventually(lambda: ctl.num_requests() == 0)
            assert ctl.admission.inuse_total == 0
            assert ctl.stats.outcomes["cancelled"] == 1
            assert c.gw.gateway.metrics.client_disconnects == 1

            # non-streamed: the client gives up while the node is still working
            async with aiohttp.ClientSession() as s:
                try:
                    async with asyncio.timeout(0.3):
                        await s.post(c.url + "/v1/completions", json=_req(2))
                except TimeoutError:
                    pass
            await kit.eventually(lambda: stub.disconnects == 2)
            await kit.eventually(lambda: ctl.num_requests() == 0)
            assert ctl.admission.inuse_total == 0
            assert ctl.nodes.get(stub.name).inflight == 0  # type: ignore[union-attr]

    kit.run(body())


def test_a_client_that_stops_reading_a_stream_is_gone_after_the_idle_timeout(
    kit: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that keeps its connection open but reads nothing must not hold its
    credit, the node's work and the connection forever. It is reset, not closed: a
    close queued a FIN behind megabytes of buffered stream, which the client could
    later read as a complete-looking but truncated answer; and it is logged."""
    caplog.set_level(logging.INFO, logger="kvgate.gateway")

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "firehose"},
                               upstream={"stream_idle_timeout_s": 0.5}) as c:
            ctl = c.gw.controller
            loop = asyncio.get_running_loop()
            req = json.dumps({"model": kit.MODEL, "prompt": "p", "stream": True}).encode()
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", int(c.url.rsplit(":", 1)[1])))
                await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                                        b"Content-Type: application/json\r\n"
                                        b"Content-Length: %d\r\n\r\n%s" % (len(req), req))
                assert (await loop.sock_recv(sock, 64)).startswith(b"HTTP/1.1 200")
                assert ctl.num_requests() == 1
                # ... and reads nothing more: the gateway's writes stall
                await kit.eventually(lambda: ctl.num_requests() == 0, 5.0)
                assert ctl.admission.inuse_total == 0
                await kit.eventually(lambda: c.stubs[0].disconnects == 1)  # upstream aborted
                metrics = c.gw.gateway.metrics
                assert metrics.client_disconnects == 1
                await kit.eventually(lambda: metrics.responses[("/v1/completions", 499)] == 1)
                with pytest.raises(ConnectionResetError):  # not a quiet EOF after the data
                    async with asyncio.timeout(5.0):
                        while await loop.sock_recv(sock, 1 << 16):
                            pass
        assert any("dropped a client that took no byte" in r.getMessage()
                   for r in caplog.records)

    kit.run(body())


def test_held_request_dispatched_when_a_credit_frees(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, admission={"budget": 1}) as c:
            ctl = c.gw.controller
            stub = c.stubs[0]
            async with aiohttp.ClientSession() as s:
                first = await s.post(c.url + "/v1/completions",
                                     json=_req(1, stream=True), headers={"X-Kvgate-Priority": "0"})
                await first.content.readany()
                stub.mode = "ok"
                second = asyncio.ensure_future(s.post(
                    c.url + "/v1/completions", json=_req(2), headers={"X-Kvgate-Priority": "0"}))
                await kit.eventually(lambda: c.gw.gateway.driver.held == 1)
                assert ctl.admission.queued_total == 1
                first.close()  # frees the credit: the held request goes out
                resp = await second
                assert resp.status == 200
                await resp.read()
                resp.release()
            assert c.gw.gateway.metrics.queue_wait.count == 1
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

    kit.run(body())


def test_held_request_whose_client_leaves_is_forgotten(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, admission={"budget": 1}) as c:
            ctl = c.gw.controller
            p0 = {"X-Kvgate-Priority": "0"}
            async with aiohttp.ClientSession() as s:
                first = await s.post(c.url + "/v1/completions", json=_req(1, stream=True),
                                     headers=p0)
                await first.content.readany()
                try:
                    async with asyncio.timeout(0.3):
                        await s.post(c.url + "/v1/completions", json=_req(2), headers=p0)
                except TimeoutError:
                    pass
                await kit.eventually(lambda: ctl.admission.queued_total == 0)
                assert c.gw.gateway.driver.held == 0 and ctl.num_requests() == 1
                first.close()
            await kit.eventually(lambda: ctl.num_requests() == 0)
            assert ctl.admission.inuse_total == 0
            assert c.stubs[0].attempts == 1  # the abandoned request never reached the node
            assert ctl.stats.outcomes["cancelled"] == 2

    kit.run(body())


def test_burst_through_a_small_budget_completes_and_returns_every_credit(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(3, admission={"budget": 4}) as c:
            ctl = c.gw.controller

            async def one(i: int) -> int:
                status, _, _ = await c.post("/v1/completions", _req(i % 5, stream=i % 2 == 0),
                                            {"X-Kvgate-Priority": "0"})
                return status

            statuses = await asyncio.gather(*(one(i) for i in range(60)))
            assert statuses == [200] * 60
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0
            assert ctl.admission.queued_total == 0 and c.gw.gateway.driver.held == 0
            assert ctl.stats.outcomes["completed"] == 60
            assert sum(s.attempts for s in c.stubs) == 60
            assert all(s.inflight == 0 for s in ctl.nodes)

    kit.run(body())


def test_single_node_503_has_nowhere_to_retry(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "503"}, server={"route_headers": False}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1))
            assert status == 503 and headers["X-Kvgate-Node"] == "n0"
            # the node's own failure, which the client may retry after Retry-After (it
            # was "overloaded", do not retry: a cluster-wide verdict one node's 503 is not)
            assert "x-should-retry" not in headers and "Retry-After" in headers
            assert json.loads(raw)["error"]["code"] == "http_503"
            assert c.stubs[0].attempts == 1
            assert c.gw.controller.num_requests() == 0
            assert c.gw.controller.admission.inuse_total == 0

    kit.run(body())


def test_stop_with_a_request_in_flight_takes_at_most_the_shutdown_timeout(kit: Any) -> None:
    """aiohttp waits its timeout for handlers, then as long again for the connections it
    closes: a stop with one request hung at its node took twice server.shutdown_timeout_s
    (20.1 s for the default 10 s)."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "hang"},
                               server={"shutdown_timeout_s": 2.0}) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", _req(1)))
            await kit.eventually(lambda: c.stubs[0].attempts == 1)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await c.gw.stop()
            took = loop.time() - t0
            assert took < 3.0, took  # about 2 s; it was 4
            with contextlib.suppress(Exception):
                await call

    kit.run(body())


def test_a_stop_drains_refusing_new_and_queued_requests_and_ends_streams_cleanly(
        kit: Any) -> None:
    """On stop: /ready turns 503 while the port still listens (server.drain_delay_s), new
    and queued requests get a retryable 503 shutting_down (queued ones were left without
    any answer, or admitted during the drain only to be cut), and a stream still running
    at the deadline ends with an error event and [DONE] (it was cut mid-stream)."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, admission={"budget": 1},
                               server={"drain_delay_s": 0.5, "shutdown_timeout_s": 1.0}) as c:
            stream = asyncio.ensure_future(c.post("/v1/completions", _req(1, stream=True)))
            await kit.eventually(lambda: c.stubs[0].attempts == 1)
            queued = asyncio.ensure_future(c.post("/v1/completions", _req(2)))
            await kit.eventually(lambda: c.gw.gateway.driver.held == 1)
            stop = asyncio.ensure_future(c.gw.stop())
            status, headers, raw = await queued
            assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
            assert headers["Retry-After"] and "x-should-retry" not in headers
            # still listening during the drain delay: unready, and new requests refused
            status, _, raw = await c.get("/ready")
            assert status == 503 and json.loads(raw)["status"] == "draining"
            status, _, raw = await c.post("/v1/completions", _req(3))
            assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
            status, _, raw = await stream
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
            await stop
            assert c.stubs[0].attempts == 1  # nothing was sent to the node after the stop

    kit.run(body())


def test_a_stop_answers_a_request_its_node_has_not_answered_yet(kit: Any) -> None:
    """At the stop's deadline a request still waiting for its node's first byte gets a
    retryable 503 shutting_down (its connection was closed with no answer at all)."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "hang"},
                               server={"shutdown_timeout_s": 1.0}) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", _req(1, stream=True)))
            await kit.eventually(lambda: c.stubs[0].attempts == 1)
            await c.gw.stop()
            status, headers, raw = await call
            assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
            assert "x-should-retry" not in headers
            assert c.gw.controller.stats.failures == {}  # the node is not blamed

    kit.run(body())


def test_a_request_whose_body_arrives_during_the_stop_is_refused(kit: Any) -> None:
    """Its head came before the stop, its body after: it passed the first check and was
    queued, then sent to the node once the stop freed a credit, and cut with no answer."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, admission={"budget": 1},
                               server={"drain_delay_s": 0.3, "shutdown_timeout_s": 1.0}) as c:
            stream = asyncio.ensure_future(c.post("/v1/completions", _req(1, stream=True)))
            await kit.eventually(lambda: c.stubs[0].attempts == 1)
            host, port = c.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            payload = json.dumps(_req(2)).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload))
            await writer.drain()
            await asyncio.sleep(0.1)  # the handler waits for the body
            stop = asyncio.ensure_future(c.gw.stop())
            await kit.eventually(lambda: c.gw.gateway.draining)
            writer.write(payload)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
            assert b"shutting_down" in answer
            await stream
            await stop
            assert c.stubs[0].attempts == 1

    kit.run(body())


def test_nothing_is_held_or_sent_once_the_stop_began() -> None:
    """Below the proxy: an arrival the core would hold, or an attempt past the deadline
    (a retry, a late admission), is refused shutting_down, not queued or sent."""
    import random

    from kvgate.core.admission import InProcessCoordinator, RejectReason
    from kvgate.core.config import ControllerConfig
    from kvgate.core.controller import Controller
    from kvgate.core.decisions import Hold, Reject
    from kvgate.core.events import RequestArrived
    from kvgate.core.ids import RequestId
    from kvgate.gateway.driver import Driver, InProcessLeaseClient
    from kvgate.gateway.metrics_text import GatewayMetrics

    async def body() -> None:
        ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
        drv = Driver(ctl, InProcessLeaseClient(InProcessCoordinator(ctl.config.admission)),
                     GatewayMetrics(), clock=lambda: 0.0)
        arrived = RequestArrived(request_id=RequestId("r1"), block_ids=(1,), prompt_tokens=10)
        # no node and no lease yet: the core holds P1
        assert isinstance(ctl.on_arrival(arrived, 0.0), Hold)
        ctl.on_cancelled(RequestId("r1"), 0.0)
        drv.begin_drain()
        late = RequestArrived(request_id=RequestId("r2"), block_ids=(1,), prompt_tokens=10)
        out = await drv.admit(late)
        assert isinstance(out, Reject) and out.rejected.reason is RejectReason.SHUTTING_DOWN
        assert drv.held == 0 and ctl.num_requests() == 0

    asyncio.run(body())
