"""P2 gives back what it borrowed: a P0 request waiting for a credit P2 holds beyond its
share ends the youngest P2 request, with a 503 or, mid-stream, an error event."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

# Budget 4, no bypass pool: P0's unlendable reserve is 2, so P2 may borrow the other 2.
ADMISSION = {"budget": 4, "bypass_fraction": 0.0, "p2_start": 1.0}


def _body(kit: Any, i: int, stream: bool) -> dict[str, Any]:
    return {"model": kit.MODEL, "prompt": f"request {i}", "max_tokens": 8, "stream": stream}


async def _open(c: Any, kit: Any, i: int, priority: int) -> aiohttp.ClientResponse:
    """A streamed request whose first chunk has arrived (it holds a credit, on a node)."""
    r = await c.session.post(c.url + "/v1/completions", json=_body(kit, i, True),
                             headers={"X-Kvgate-Priority": str(priority)})
    assert r.status == 200
    assert await r.content.readany()
    return r


def _preempted(c: Any) -> float:
    return c.gw.controller.stats.rejects["preempted"]


def test_a_waiting_p0_request_ends_the_youngest_p2_stream(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, admission=ADMISSION) as c:
            opened = [await _open(c, kit, 0, 2), await _open(c, kit, 1, 2)]
            opened += [await _open(c, kit, 2, 0), await _open(c, kit, 3, 0)]  # 4 of 4
            assert _preempted(c) == 0
            # a third P0 request waits for a credit: the younger P2 stream gives it back
            opened.append(await _open(c, kit, 4, 0))
            assert _preempted(c) == 1
            rest = (await asyncio.wait_for(opened[1].read(), 5.0)).decode()
            events = [e for e in rest.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: "):])["error"]
            assert error["code"] == "preempted" and "P2" in error["message"]
            assert not opened[0].content.at_eof()  # the older P2 stream goes on
            # the node's work on it was aborted (the gateway closed the upstream request)
            await kit.eventually(lambda: c.stubs[0].disconnects >= 1)
            for r in opened:
                r.close()

    kit.run(body())


def test_a_p2_request_preempted_before_its_first_byte_is_a_retryable_503(kit: Any) -> None:
    async def body() -> None:
        # every answer waits 3 s: the P2 requests have sent the client nothing yet
        async with kit.cluster(1, stub={"delay_s": 3.0}, admission=ADMISSION) as c:

            async def post(i: int, priority: int) -> tuple[int, dict[str, str], bytes]:
                return await c.post("/v1/completions", _body(kit, i, False),
                                    {"X-Kvgate-Priority": str(priority)})

            tasks = []
            for i, priority in enumerate((2, 2, 0, 0)):
                tasks.append(asyncio.ensure_future(post(i, priority)))
                await kit.eventually(lambda n=i + 1: c.stubs[0].inflight == n)
            waiting_p0 = asyncio.ensure_future(post(4, 0))
            status, headers, raw = await asyncio.wait_for(tasks[1], 2.5)
            assert status == 503 and headers["Retry-After"] == "5"
            assert "x-should-retry" not in {k.lower() for k in headers}  # it may retry
            assert json.loads(raw)["error"]["code"] == "preempted"
            await kit.eventually(lambda: c.stubs[0].inflight == 4)  # the P0 request's turn
            assert [s for s, _, _ in await asyncio.gather(*tasks[::2], tasks[3], waiting_p0)] \
                == [200, 200, 200, 200]

    kit.run(body())


def test_no_preemption_when_reclaim_p2_is_off(kit: Any) -> None:
    async def body() -> None:
        admission = {**ADMISSION, "reclaim_p2": False, "queue_timeout_s": 0.5}
        async with kit.cluster(1, stub={"mode": "slow"}, admission=admission) as c:
            opened = [await _open(c, kit, i, p) for i, p in enumerate((2, 2, 0, 0))]
            status, _, raw = await c.post("/v1/completions", _body(kit, 4, False),
                                          {"X-Kvgate-Priority": "0"})
            assert status == 429 and json.loads(raw)["error"]["code"] == "queue_timeout"
            assert _preempted(c) == 0 and not opened[1].content.at_eof()
            for r in opened:
                r.close()

    kit.run(body())


def _preempt_now(ctl: Any, rid: str) -> list[Any]:
    """What the controller's reclaim does to one P2 request, at an awkward moment."""
    from kvgate.core.admission import RejectReason, make_rejection
    from kvgate.core.decisions import Preempt

    record = ctl._requests.pop(rid)
    rejected = make_rejection(RejectReason.PREEMPTED, "preempted", request_id=rid)
    node = record.node.spec.node_id
    return [Preempt(request_id=rid, node_id=node, rejected=rejected), *ctl._close(record, 0.0)]


def test_a_preemption_landing_after_the_stream_ended_changes_nothing(
    kit: Any, caplog: Any
) -> None:
    """The core ends the request just as its [DONE] went out: the client keeps its whole
    answer, nothing is written after the end (no error logged), and the driver keeps no
    record of it."""

    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "done-then-wait"}, admission=ADMISSION) as c:
            drv = c.gw.gateway.driver
            finish = drv.finish

            def finish_after_a_preemption(rid: Any, cached: Any, **usage: Any) -> None:
                drv.apply(_preempt_now(drv.controller, rid))
                finish(rid, cached, **usage)

            drv.finish = finish_after_a_preemption
            status, _, raw = await c.post("/v1/completions", _body(kit, 0, True),
                                          {"X-Kvgate-Priority": "2"})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            assert b"preempted" not in raw
            await kit.eventually(lambda: not drv._preempted and not drv._preemptible)

    with caplog.at_level(logging.ERROR, logger="kvgate"):
        kit.run(body())
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_request_preempted_with_its_dispatch_is_never_sent(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, admission=ADMISSION) as c:
            drv = c.gw.gateway.driver
            ctl = drv.controller
            on_lease = ctl.on_lease

            def with_a_preemption(grant: Any, now: float) -> list[Any]:
                out = on_lease(grant, now)
                p2 = [d.request_id for d in out if d.request_id in ctl._requests
                      and ctl._requests[d.request_id].ticket.priority == 2]
                return out + [x for rid in p2 for x in _preempt_now(ctl, rid)]

            ctl.on_lease = with_a_preemption
            # a pooled upstream connection: a request would go out before any suspension
            status, _, _ = await c.post("/v1/completions", _body(kit, 0, False),
                                        {"X-Kvgate-Priority": "0"})
            assert status == 200 and c.stubs[0].attempts == 1
            # the first P2 request waits for a grant; the Dispatch and the Preempt come
            # out of the same refresh
            status, _, raw = await c.post("/v1/completions", _body(kit, 1, False),
                                          {"X-Kvgate-Priority": "2"})
            assert status == 503 and json.loads(raw)["error"]["code"] == "preempted"
            assert c.stubs[0].attempts == 1 and not drv._preempted

    kit.run(body())
