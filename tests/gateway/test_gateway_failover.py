"""Whose fault a failure is, and failing over from a node that stops answering."""

from __future__ import annotations

import json
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from kvgate.core.admission import BreakerState, FailureKind
from kvgate.gateway.upstream import classify_status


def _req(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": f"question {i}", "max_tokens": 3, **extra}


def test_status_classes() -> None:
    none: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
    assert classify_status(400, none) is FailureKind.CLIENT_ERROR
    assert classify_status(422, none) is FailureKind.CLIENT_ERROR
    assert classify_status(429, none) is FailureKind.RATE_LIMITED  # the node sheds load
    assert classify_status(500, none) is FailureKind.UPSTREAM_ERROR


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
