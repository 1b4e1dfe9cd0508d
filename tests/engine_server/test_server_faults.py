"""Second-stage admission on the wire, fault injection and client disconnects."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import pytest

from kvgate.engine import NodeAdmissionConfig

pytestmark = pytest.mark.asyncio

MODEL = "kvgate-sim"


def _body(prompt: str = "hello", max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def _fault(http: aiohttp.ClientSession, server: Any, **action: Any) -> dict[str, Any]:
    async with http.post(f"{server.url}/admin/fault", json=action) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def test_reject_fault_answers_503_retry_elsewhere(start_server: Any,
                                                        http: aiohttp.ClientSession) -> None:
    server = await start_server()
    await _fault(http, server, action="reject")
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 503
        assert resp.headers["X-Kvgate-Reject"] == "retry-elsewhere"
        error = (await resp.json())["error"]
        assert error["type"] == "server_error" and error["code"] == "retry_elsewhere"
    await _fault(http, server, action="recover")
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 200


@pytest.mark.parametrize(("prompt_tokens", "kind"),
                         [(520, "retry-elsewhere"), (600, "pool-overloaded")])
async def test_pool_pressure_rejects_with_kind(start_server: Any, http: aiohttp.ClientSession,
                                               sse_reader: Any, prompt_tokens: int,
                                               kind: str) -> None:
    # 40 blocks of 16 = 640 tokens; a running request holding >= 80 % (95 %) of the pool
    # keeps newcomers out, and with no admission queue they are refused.
    server = await start_server(num_blocks=40, speedup=1.0,
                                admission=NodeAdmissionConfig(queue_max=0))
    holder = await http.post(f"{server.url}/v1/completions",
                             json=_body("y" * (4 * prompt_tokens), 30, stream=True))
    try:
        reader = sse_reader(holder)
        assert (await reader.next())["choices"]
        async with http.post(f"{server.url}/v1/completions", json=_body("hi")) as resp:
            assert resp.status == 503
            assert resp.headers["X-Kvgate-Reject"] == kind
    finally:
        holder.close()
    # The disconnect aborts the holder and frees its blocks.
    await server.wait_until(lambda: server.engine.metrics().num_requests_running == 0)
    assert server.engine.metrics().num_requests_aborted == 1


async def test_queued_request_expiring_is_503_retry_elsewhere(
    start_server: Any, http: aiohttp.ClientSession, sse_reader: Any, one_seq_profile: Any
) -> None:
    server = await start_server(
        profile=one_seq_profile, speedup=100.0,
        admission=NodeAdmissionConfig(waiting_accept=0, queue_ttl_s=0.5))
    holder = await http.post(f"{server.url}/v1/completions",
                             json=_body("z" * 64, 5000, stream=True))
    try:
        await sse_reader(holder).next()
        for stream in (False, True):
            async with http.post(f"{server.url}/v1/completions",
                                 json=_body("queued", 2, stream=stream)) as resp:
                assert resp.status == 503
                assert resp.headers["X-Kvgate-Reject"] == "retry-elsewhere"
    finally:
        holder.close()
    await server.wait_until(lambda: not server.engine.has_unfinished_requests())


async def test_client_disconnect_aborts_the_engine_request(
    start_server: Any, http: aiohttp.ClientSession, sse_reader: Any
) -> None:
    server = await start_server(speedup=20.0)
    resp = await http.post(f"{server.url}/v1/completions", json=_body("w" * 800, 5000, True))
    await sse_reader(resp).next()
    assert server.engine.metrics().num_requests_running == 1
    assert server.engine.pool.num_used_blocks > 0
    resp.close()
    await server.wait_until(lambda: server.engine.metrics().num_requests_running == 0)
    metrics = server.engine.metrics()
    assert metrics.num_requests_aborted == 1
    assert server.engine.pool.num_used_blocks == 0
    assert metrics.num_cached_blocks >= 800 // 4 // 16  # freed blocks stay cached
    server.engine.check_invariants()


async def test_disconnect_of_a_unary_request_aborts_too(
    start_server: Any, http: aiohttp.ClientSession
) -> None:
    server = await start_server(speedup=20.0)
    task = asyncio.create_task(http.post(f"{server.url}/v1/completions",
                                         json=_body("v" * 80, 5000)))
    await server.wait_until(lambda: server.engine.metrics().num_requests_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await server.wait_until(lambda: server.engine.metrics().num_requests_aborted == 1)
    assert server.engine.metrics().num_requests_running == 0


async def test_crash_ends_streams_with_an_error_and_fails_health(
    start_server: Any, http: aiohttp.ClientSession, sse_reader: Any
) -> None:
    server = await start_server(speedup=20.0)
    stream = await http.post(f"{server.url}/v1/completions", json=_body("s" * 64, 5000, True))
    reader = sse_reader(stream)
    await reader.next()
    unary = asyncio.create_task(http.post(f"{server.url}/v1/completions",
                                          json=_body("u" * 64, 5000)))
    await server.wait_until(lambda: server.engine.metrics().num_requests_running == 2)
    state = await _fault(http, server, action="crash")
    assert state["faults"]["crashed"] is True
    rest = await reader.rest()
    stream.close()
    assert rest[-1] == "[DONE]"
    assert rest[-2]["error"]["code"] == "engine_crashed"
    async with await unary as resp:
        assert resp.status == 503
        assert resp.headers["X-Kvgate-Reject"] == "retry-elsewhere"
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 503
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 503
        assert resp.headers["X-Kvgate-Reject"] == "retry-elsewhere"
    await _fault(http, server, action="recover")
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 200
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 200
    assert server.engine.metrics().num_requests_failed == 2


async def test_midstream_error_breaks_the_next_stream_only(
    start_server: Any, http: aiohttp.ClientSession, read_sse: Any
) -> None:
    server = await start_server()
    await _fault(http, server, action="midstream_error", after=2)
    async with http.post(f"{server.url}/v1/completions", json=_body("m", 10, True)) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    assert len(events) == 4
    assert [bool(e["choices"][0]["text"]) for e in events[:2]] == [True, True]
    assert events[2]["error"]["code"] == "midstream_error" and events[3] == "[DONE]"
    await server.wait_until(lambda: not server.engine.has_unfinished_requests())
    assert server.engine.metrics().num_requests_aborted == 1
    async with http.post(f"{server.url}/v1/completions", json=_body("m", 10, True)) as resp:
        events = await read_sse(resp)
    assert len(events) == 11


async def test_reset_connection_before_first_byte(start_server: Any,
                                                  http: aiohttp.ClientSession) -> None:
    server = await start_server()
    await _fault(http, server, action="reset_connection")
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
            await resp.read()
    assert server.engine.metrics().num_requests_finished == 0
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 200


async def test_slow_first_byte_and_slow_steps(start_server: Any,
                                              http: aiohttp.ClientSession) -> None:
    server = await start_server()
    await _fault(http, server, action="slow_first_byte", seconds=0.3)
    t0 = time.perf_counter()
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 200
    assert time.perf_counter() - t0 >= 0.3
    state = await _fault(http, server, action="slow", factor=4)
    assert state["faults"]["slow_factor"] == 4.0
    assert state["faults"]["slow_first_byte"] is None  # count 1 is used up


async def test_mass_evict_is_announced_and_logged(start_server: Any,
                                                  http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.post(f"{server.url}/v1/completions",
                         json=_body("e" * (4 * 16 * 300), 1)) as resp:
        assert resp.status == 200
    cached = server.engine.metrics().num_cached_blocks
    assert cached >= 300
    # half of what is cached (not of the pool), announced as a forced flush
    await _fault(http, server, action="mass_evict", fraction=0.5)
    async with http.get(f"{server.url}/kvgate/evictions") as resp:
        page = await resp.json()
    announced = page["events"][0]
    assert announced["type"] == "EvictionAnnounced" and announced["seq"] == 0
    assert announced["num_blocks"] == math.ceil(cached / 2) and announced["prefixes"]
    assert announced["starts_at"] > page["now"] - 1e-9 or page["pending"] == 0
    assert page["node_id"] == server.node_id and page["speedup"] == 100.0
    await server.wait_until(lambda: server.evictions.pending == 0)
    async with http.get(f"{server.url}/kvgate/evictions", params={"since": 1}) as resp:
        page = await resp.json()
    assert [e["type"] for e in page["events"]] == ["EvictionDone"]
    assert page["events"][0]["num_blocks_evicted"] == math.ceil(cached / 2)
    # in tokens too, so a gateway with index blocks of another size can forget as many
    done = page["events"][0]
    assert done["num_tokens_evicted"] == done["num_blocks_evicted"] * 16
    assert page["next"] == 2 and page["pending"] == 0 and not page["truncated"]
    assert server.engine.metrics().num_cached_blocks == cached - math.ceil(cached / 2)


async def test_admin_fault_validation(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    for bad in ({"action": "explode"}, {"action": "slow", "factor": -1},
                {"action": "crash", "extra": 1}, {"action": "mass_evict", "fraction": 2}):
        async with http.post(f"{server.url}/admin/fault", json=bad) as resp:
            assert resp.status == 400, bad
    async with http.get(f"{server.url}/admin/fault") as resp:
        assert (await resp.json())["faults"]["crashed"] is False


async def test_startup_faults_from_config(start_server: Any, http: aiohttp.ClientSession) -> None:
    from kvgate.engine.server_config import parse_fault_flag

    server = await start_server(faults=(parse_fault_flag("reject"),))
    async with http.post(f"{server.url}/v1/completions", json=_body()) as resp:
        assert resp.status == 503


async def test_priority_is_forwarded_to_the_engine(
    start_server: Any, http: aiohttp.ClientSession, sse_reader: Any, one_seq_profile: Any
) -> None:
    server = await start_server(profile=one_seq_profile, speedup=50.0)
    holder = await http.post(f"{server.url}/v1/completions", json=_body("h" * 64, 40, True))
    await sse_reader(holder).next()
    finished: list[str] = []

    async def run(name: str, priority: int) -> None:
        body = {**_body(name, 2), "priority": priority}
        async with http.post(f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        finished.append(name)

    low = asyncio.create_task(run("low", 10))
    await server.wait_until(lambda: server.engine.metrics().num_requests_waiting == 1)
    high = asyncio.create_task(run("high", -5))
    await server.wait_until(lambda: server.engine.metrics().num_requests_waiting == 2)
    holder.close()  # frees the only sequence slot; the better priority goes first
    await asyncio.gather(low, high)
    assert finished == ["high", "low"]


async def test_disconnect_while_queued_removes_the_request(
    start_server: Any, http: aiohttp.ClientSession, sse_reader: Any, one_seq_profile: Any
) -> None:
    server = await start_server(profile=one_seq_profile,
                                admission=NodeAdmissionConfig(waiting_accept=0))
    holder = await http.post(f"{server.url}/v1/completions", json=_body("h" * 64, 5000, True))
    try:
        await sse_reader(holder).next()
        queued = asyncio.create_task(http.post(f"{server.url}/v1/completions",
                                               json=_body("q", 2, True)))
        await server.wait_until(lambda: server.engine.metrics().num_requests_queued == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await server.wait_until(lambda: server.engine.metrics().num_requests_queued == 0)
        assert server.engine.metrics().num_requests_aborted == 1
        assert server.engine.metrics().num_requests_running == 1
    finally:
        holder.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_crash_mid_step_fails_what_that_step_finished(
    start_server: Any, http: aiohttp.ClientSession, stream: bool
) -> None:
    # The step that produces the only token is slowed to seconds; the engine has retired
    # the request when the step was planned, so the crash during its sleep does not list
    # it: it must fail all the same (its answer never left the node), not succeed early.
    server = await start_server(speedup=1.0)
    await _fault(http, server, action="slow", factor=300.0)
    task = asyncio.create_task(http.post(f"{server.url}/v1/completions",
                                         json=_body("c" * 64, 1, stream)))
    deadline = time.monotonic() + 5.0
    while server.engine.metrics().num_requests_finished == 0:  # planned, being slept out
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # not answered yet: not counted finished (a crash would take it back: a counter down)
    assert server.metrics().num_requests_finished == 0
    await _fault(http, server, action="crash")
    async with await task as resp:  # a stream too: its first token never came
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "engine_crashed"
    metrics = server.metrics()
    assert (metrics.num_requests_finished, metrics.num_requests_failed) == (0, 1)
    async with http.get(f"{server.url}/metrics") as resp:
        text = await resp.text()
    assert 'finished_reason="length"} 0' in text or "request_success_total" not in text
