"""Whose fault a failure is, and failing over from a node that stops answering."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from kvgate.core.admission import BreakerState, FailureKind
from kvgate.gateway.upstream import classify_status
from kvgate.protocol.node_reject import REJECT_HEADER, RejectKind


def _req(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": f"question {i}", "max_tokens": 3, **extra}


def test_status_classes() -> None:
    none: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
    assert classify_status(400, none) is FailureKind.CLIENT_ERROR
    assert classify_status(422, none) is FailureKind.CLIENT_ERROR
    assert classify_status(429, none) is FailureKind.RATE_LIMITED  # the node sheds load
    assert classify_status(500, none) is FailureKind.UPSTREAM_ERROR


def test_a_nodes_refusal_header_says_where_the_request_may_go() -> None:
    def refused(kind: str) -> FailureKind:
        return classify_status(503, CIMultiDictProxy(CIMultiDict({REJECT_HEADER: kind})))

    # the values the engine sends, read by the gateway through the same names
    assert refused(RejectKind.RETRY_ELSEWHERE.value) is FailureKind.RETRY_ELSEWHERE
    assert refused(RejectKind.POOL_OVERLOADED.value) is FailureKind.POOL_OVERLOADED
    assert refused(" Pool-Overloaded ") is FailureKind.POOL_OVERLOADED  # case, spaces
    # a 503 without a kind the gateway knows is vLLM's own 503
    assert refused("something-else") is FailureKind.HTTP_503
    assert classify_status(503, CIMultiDictProxy(CIMultiDict())) is FailureKind.HTTP_503


def test_a_clients_bad_requests_do_not_open_the_cluster_breaker(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "400"}) as c:
            for i in range(25):
                status, _, raw = await c.post("/v1/completions", _req(i))
                assert status == 400
                assert json.loads(raw)["error"]["message"] == "engine says 400"
            assert sum(s.attempts for s in c.stubs) == 25  # never retried
            ctl = c.gw.controller
            assert ctl.admission.breaker_state is BreakerState.CLOSED
            assert all(s.healthy and s.consecutive_failures == 0 for s in ctl.nodes)
            for s in c.stubs:
                s.mode = "ok"
            status, _, _ = await c.post("/v1/completions", _req(99))
            assert status == 200

    kit.run(body())


def test_refused_everywhere_is_a_retryable_503_and_unknown_exclusions_keep_the_retry(
    kit: Any,
) -> None:
    async def body() -> None:
        async with kit.cluster(3, stub={"mode": "retry-elsewhere"}) as c:
            status, headers, raw = await c.post("/v1/completions", _req(1),
                                                {"X-Kvgate-Exclude-Node": "no-such-node"})
            assert status == 503
            assert headers["Retry-After"] == "1" and "x-should-retry" not in headers
            err = json.loads(raw)["error"]
            assert err["code"] == "retry_elsewhere" and err["type"] == "server_error"
            assert sum(s.attempts for s in c.stubs) == 2  # the gateway still retried once
            assert c.gw.controller.stats.retries["retry_elsewhere"] == 1

    kit.run(body())


SLOW = {"request_timeout_s": 30.0, "stream_idle_timeout_s": 30.0}  # far past the test
SHARED = "You are a careful assistant. " * 100  # cache affinity: one home node


def _shared(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": SHARED + f"q{i}", "max_tokens": 3, **extra}


def test_attempts_waiting_on_a_node_marked_down_fail_over_at_once(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, upstream=SLOW) as c:
            ctl = c.gw.controller
            _, headers, _ = await c.post("/v1/completions", _shared(0))
            home = c.stub(headers["X-Kvgate-Node"])
            other = next(s for s in c.stubs if s is not home)
            home.mode = "hang"  # like kill -STOP: takes requests, never answers
            home.seen.clear()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            calls = [asyncio.ensure_future(c.post("/v1/completions", _shared(i, stream=i % 2 == 0)))
                     for i in range(1, 5)]
            await kit.eventually(lambda: home.attempts >= 2)
            hung = home.attempts
            home.healthy = False  # its health probes fail: the watcher marks it down
            async with asyncio.timeout(5):
                results = await asyncio.gather(*calls)
            assert loop.time() - t0 < 5  # not the 30 s upstream timeouts
            # the retry budget (at least 3 in flight) takes up to 3; past it a clean 503
            retried = min(hung, 3)
            assert sorted(r[0] for r in results) == [200] * (4 - hung + retried) + [503] * (
                hung - retried)
            for status, headers, raw in results:
                if status == 200:
                    assert headers["X-Kvgate-Node"] == other.name
                    assert raw.endswith(b"data: [DONE]\n\n") or b'"choices"' in raw
                else:
                    assert json.loads(raw)["error"]["code"] == "node_down"
                    assert headers["Retry-After"] == "1" and "x-should-retry" not in headers
            assert ctl.stats.retries["node_down"] == retried
            assert ctl.stats.failures["node_down"] == hung
            await kit.eventually(lambda: home.disconnects == hung)  # upstream aborted
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

    kit.run(body())


def test_a_stream_with_headers_but_no_first_byte_fails_over_too(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2, upstream=SLOW) as c:
            _, headers, _ = await c.post("/v1/completions", _shared(0))
            home = c.stub(headers["X-Kvgate-Node"])
            home.mode = "stall"
            home.seen.clear()
            call = asyncio.ensure_future(c.post("/v1/completions", _shared(1, stream=True)))
            await kit.eventually(lambda: home.attempts == 1)
            home.healthy = False
            async with asyncio.timeout(5):
                status, headers, raw = await call
            assert status == 200 and headers["X-Kvgate-Node"] != home.name
            assert raw.endswith(b"data: [DONE]\n\n")
            assert c.gw.controller.stats.retries["node_down"] == 1

    kit.run(body())


def test_an_ejected_node_gives_up_the_attempts_waiting_on_it(kit: Any, caplog: Any) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="kvgate.gateway")

    async def body() -> None:
        async with kit.cluster(2, upstream=SLOW, routing={"eject_after_failures": 1}) as c:
            _, headers, _ = await c.post("/v1/completions", _shared(0))
            home = c.stub(headers["X-Kvgate-Node"])
            other = next(s for s in c.stubs if s is not home)
            home.mode = "hang"
            home.seen.clear()
            call = asyncio.ensure_future(c.post("/v1/completions", _shared(1)))
            await kit.eventually(lambda: home.attempts == 1)
            home.mode = "500"  # its next answer is an error: the node is ejected
            status, _, _ = await c.post("/v1/completions", _shared(2),
                                        {"X-Kvgate-Exclude-Node": other.name})
            assert status == 500
            assert not c.gw.controller.nodes.get(home.name).healthy  # type: ignore[union-attr]
            async with asyncio.timeout(5):
                status, headers, _ = await call
            assert status == 200 and headers["X-Kvgate-Node"] == other.name
            assert c.gw.controller.stats.retries["node_down"] == 1
            # the ejection is logged, as the health watcher's verdicts are (it was not)
            assert f"node {home.name} is out for 30 s after 1 failed attempt(s) in a row" in (
                caplog.text)

    kit.run(body())


def test_node_down_with_nowhere_to_retry_is_a_prompt_503(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "hang"}, upstream=SLOW) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", _shared(1)))
            await kit.eventually(lambda: c.stubs[0].attempts == 1)
            c.stubs[0].healthy = False
            async with asyncio.timeout(5):
                status, headers, raw = await call
            assert status == 503 and "Retry-After" in headers
            assert json.loads(raw)["error"]["type"] == "server_error"
            ctl = c.gw.controller
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

    kit.run(body())


def test_a_stream_already_answering_is_left_alone_when_its_node_is_marked_down(
    kit: Any,
) -> None:
    async def body() -> None:
        async with kit.cluster(2, stub={"mode": "slow"}, upstream=SLOW) as c:
            ctl = c.gw.controller
            async with aiohttp.ClientSession() as s:
                resp = await s.post(c.url + "/v1/completions", json=_shared(1, stream=True))
                assert (await resp.content.readany()).startswith(b"data: ")
                node = c.stub(resp.headers["X-Kvgate-Node"])
                node.healthy = False
                await kit.eventually(
                    lambda: not ctl.nodes.get(node.name).healthy  # type: ignore[union-attr]
                )
                await asyncio.sleep(0.2)
                more = await resp.content.readany()  # still streaming from the same node
                assert more.startswith(b"data: ") and b"error" not in more
                assert ctl.stats.failures["node_down"] == 0
                resp.close()
            await kit.eventually(lambda: ctl.num_requests() == 0)

    kit.run(body())
