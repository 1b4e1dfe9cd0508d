"""Faults end to end: a node crashing mid-run, and a client going away."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvgate.protocol import SSEParser

PROMPT = "The incident report of the night the cache went cold. " * 60


def _chat(prompt: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "kvgate-sim", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": prompt}]}


def test_crash_retries_unstarted_requests_elsewhere(e2e: Any) -> None:
    async def body() -> None:
        # Slow health checks: the gateway learns of the crash from the requests themselves.
        # Load alone places the follow-ups (the crash cleared the holder's cache, and the
        # new-session spread would steer them off the node that just took a request), so
        # the crashed node, still thought healthy, is the lowest slot and is tried first.
        async with e2e.stack(
            2, nodes={"health_interval_s": 5.0}, routing={"params": {"session_spread_s": 0.0}}
        ) as s:
            async with s.session.post(s.url + "/v1/chat/completions",
                                      json=_chat(PROMPT, 4)) as r:
                assert r.status == 200
                holder = r.headers["X-Kvgate-Node"]
            other = ({"e0", "e1"} - {holder}).pop()
            await s.fault(holder, "crash")

            async def one(i: int) -> tuple[int, str, Any]:
                async with s.session.post(s.url + "/v1/chat/completions",
                                          json=_chat(PROMPT + f" follow-up {i}", 4)) as r:
                    return r.status, r.headers["X-Kvgate-Node"], await r.json()

            # three at once (the retry budget's floor is 3 retries in flight), then more
            results = await asyncio.gather(*(one(i) for i in range(3)))
            results += [await one(i) for i in range(3, 6)]
            for status, node, data in results:
                assert status == 200, data
                assert node == other
                assert data["usage"]["completion_tokens"] == 4
            stats = s.gw.controller.stats
            assert sum(stats.retries.values()) >= 1  # the crashed node was tried first
            assert stats.outcomes["failed"] == 0
            assert await e2e.metric(s.session, s.url, "kvgate_retries_total") >= 1

    e2e.run(body())


def test_crash_mid_stream_ends_with_error_event_and_done(e2e: Any) -> None:
    async def body() -> None:
        async with e2e.stack(2, speedup=5.0) as s:
            async with s.session.post(s.url + "/v1/chat/completions",
                                      json=_chat(PROMPT, 3000, stream=True)) as r:
                assert r.status == 200
                node = r.headers["X-Kvgate-Node"]
                parser = SSEParser()
                events: list[Any] = []
                while not any(isinstance(e, dict) and e.get("choices") for e in events):
                    chunk = await r.content.readany()
                    assert chunk, "stream ended before the first token"
                    events += ["[DONE]" if e.is_done else e.json() for e in parser.feed(chunk)]
                await s.fault(node, "crash")
                async with asyncio.timeout(5):
                    async for chunk in r.content.iter_any():
                        events += ["[DONE]" if e.is_done else e.json()
                                   for e in parser.feed(chunk)]
            assert events[-1] == "[DONE]"
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1
            assert {"message", "type", "code"} <= set(errors[0]["error"])
            # the next request is served by the surviving node
            async with s.session.post(s.url + "/v1/chat/completions",
                                      json=_chat(PROMPT, 4)) as r:
                assert r.status == 200
                assert r.headers["X-Kvgate-Node"] != node

    e2e.run(body())


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_reaches_the_engine(e2e: Any, stream: bool) -> None:
    async def body() -> None:
        async with e2e.stack(1, speedup=5.0) as s:
            before = await s.engine_metric("e0", "kvgate:requests_aborted_total")

            async def running() -> float:
                return await s.engine_metric("e0", "vllm:num_requests_running")

            # ~3000 decode steps at 5x: ~7 s if nobody aborts it
            req = s.session.post(s.url + "/v1/chat/completions",
                                 json=_chat("tell me everything", 3000, stream=stream))
            if stream:
                async with req as r:
                    assert r.status == 200
                    assert await r.content.readany()
                    assert await running() == 1
                # leaving the block without reading closes the connection
            else:
                task = asyncio.ensure_future(req)

                async def started() -> bool:
                    return await running() == 1

                await e2e.eventually(started, timeout=5.0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            async def aborted() -> bool:
                return (await running() == 0 and await s.engine_metric(
                    "e0", "kvgate:requests_aborted_total") == before + 1)

            await e2e.eventually(aborted, timeout=3.0)
            ctl = s.gw.controller

            async def released() -> bool:
                return ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

            await e2e.eventually(released, timeout=2.0)
            assert ctl.stats.outcomes["cancelled"] == 1

    e2e.run(body())


def test_unreachable_node_is_skipped_after_a_connect_error(e2e: Any) -> None:
    async def body() -> None:
        async with e2e.stack(2, nodes={"health_interval_s": 5.0}) as s:
            async with s.session.post(s.url + "/v1/chat/completions",
                                      json=_chat(PROMPT, 2)) as r:
                holder = r.headers["X-Kvgate-Node"]
            await s.engine(holder).stop()  # the port closes: connection refused
            async with s.session.post(s.url + "/v1/chat/completions",
                                      json=_chat(PROMPT, 2)) as r:
                assert r.status == 200
                assert r.headers["X-Kvgate-Node"] != holder
            assert s.gw.controller.stats.retries["connect_error"] == 1

    e2e.run(body())


_ = aiohttp  # the session type used through the fixture
