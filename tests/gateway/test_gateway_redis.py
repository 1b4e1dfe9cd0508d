"""A fleet of gateways sharing one budget through the Redis coordinator (real Redis).

Every test uses its own key (and deletes it), so a shared Redis is left as it was.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvgate.core.admission import (
    AdmissionConfig,
    AdmissionRequest,
    Admitted,
    CoordinatorUnavailable,
    GatewayAdmission,
    LeaseConfig,
    LeaseState,
    Ticket,
)
from kvgate.core.admission.types import Priority
from kvgate.core.errors import ConfigError
from kvgate.gateway import start_gateway
from kvgate.gateway.config import AdmissionSection
from kvgate.gateway.redis_coordinator import RedisCoordinator


@asynccontextmanager
async def fleet_key(url: str) -> AsyncIterator[str]:
    key = f"kvgate-test:{uuid.uuid4().hex}"
    try:
        yield key
    finally:
        client = aioredis.Redis.from_url(url)
        await client.delete(key)
        await client.aclose()


def test_gateways_share_one_budget_and_converge_to_fair_shares(kit: Any, redis_url: str) -> None:
    cfg = AdmissionConfig(budget=103)  # K = 100 class credits, 3 bypass

    async def body() -> None:
        async with fleet_key(redis_url) as key:
            coords = [RedisCoordinator(cfg, redis_url, key=key) for _ in range(3)]
            gws = [GatewayAdmission(cfg, f"g{i}") for i in range(3)]
            try:
                settled = 0  # rounds in a row at the fair shares
                for rnd in range(40):
                    now = rnd * 0.5

                    async def refresh(i: int, now: float = now) -> None:
                        grant = await coords[i].refresh(gws[i].make_refresh(now), now)
                        gws[i].apply_grant(grant, now)

                    # all three at once: the optimistic transaction serialises them
                    await asyncio.gather(*(refresh(i) for i in range(3)))
                    leases = [gw.stats().lease_total for gw in gws]
                    assert sum(leases) <= 100, (rnd, leases)
                    # after the learning TTL (2 s of Redis's clock), max-min fair shares
                    settled = settled + 1 if sorted(leases) == [32, 34, 34] else 0
                    if settled == 3:
                        break
                    await asyncio.sleep(0.2)
                assert settled == 3, leases
                assert all(gw.lease_state is LeaseState.ACTIVE for gw in gws)
            finally:
                for c in coords:
                    await c.close()

    kit.run(body())


def test_two_gateways_under_one_id_hold_two_records(kit: Any, redis_url: str) -> None:
    """One gateway_id for the whole fleet (one template): both processes refreshed one
    record, each was granted the whole share it reported, and together they held
    twice it (150 in flight for K = 100 with a third gateway). Each process's record
    now carries a suffix of its own, so the budget holds whatever the ids."""
    cfg = AdmissionConfig(budget=103, lease=LeaseConfig(expected_gateways=3))  # K = 100

    async def body() -> None:
        async with fleet_key(redis_url) as key:
            coords = [RedisCoordinator(cfg, redis_url, key=key) for _ in range(3)]
            gws = [GatewayAdmission(cfg, gid) for gid in ("gw-a", "gw-a", "gw-b")]
            try:
                peak = 0
                for rnd in range(12):
                    now = rnd * 0.5
                    for i, (coord, gw) in enumerate(zip(coords, gws, strict=True)):
                        for n in range(60):  # demand far above the budget, never ending
                            gw.admit(AdmissionRequest(
                                request_id=f"{i}-{rnd}-{n}", tenant="t", priority=Priority.P0,
                                prompt_tokens=10), now)
                        gw.apply_grant(await coord.refresh(gw.make_refresh(now), now), now)
                    inflight = sum(gw.stats().inuse_total for gw in gws)
                    peak = max(peak, inflight)
                    assert inflight <= 100, (rnd, inflight)
                    await asyncio.sleep(0.25)
                assert peak >= 90  # the budget is used, not only respected
                client = aioredis.Redis.from_url(redis_url)
                state = await client.get(key)
                await client.aclose()
                assert state is not None and state.count(b'"gw-a#') == 2
            finally:
                for c in coords:
                    await c.close()

    kit.run(body())


def test_in_flight_across_gateways_never_exceeds_the_budget(kit: Any, redis_url: str) -> None:
    # Each gateway wants far more than the budget and releases some of what it runs
    # each round; every credit a gateway holds is reported, so no other is granted it.
    cfg = AdmissionConfig(budget=31, lease=LeaseConfig(expected_gateways=3))  # K = 30

    async def body() -> None:
        async with fleet_key(redis_url) as key:
            coords = [RedisCoordinator(cfg, redis_url, key=key) for _ in range(3)]
            gws = [GatewayAdmission(cfg, f"g{i}") for i in range(3)]
            tickets: list[list[Ticket]] = [[], [], []]
            peak = 0
            try:
                for rnd in range(12):
                    now = rnd * 0.5
                    for i, gw in enumerate(gws):
                        for t in tickets[i][: len(tickets[i]) // 3]:  # some finish
                            gw.release(t, now)
                        del tickets[i][: len(tickets[i]) // 3]
                        for n in range(20):  # new demand, far above the budget
                            d = gw.admit(AdmissionRequest(
                                request_id=f"g{i}-{rnd}-{n}", tenant="t",
                                priority=Priority(n % 2), prompt_tokens=10), now)
                            if isinstance(d, Admitted):
                                tickets[i].append(d.ticket)

                    async def refresh(i: int, now: float = now) -> None:
                        grant = await coords[i].refresh(gws[i].make_refresh(now), now)
                        admitted = gws[i].apply_grant(grant, now)
                        tickets[i].extend(a.ticket for a in admitted)

                    await asyncio.gather(*(refresh(i) for i in range(3)))
                    inflight = sum(gw.stats().inuse_total for gw in gws)
                    peak = max(peak, inflight)
                    assert inflight <= 30, (rnd, inflight)
                    await asyncio.sleep(0.2)
                assert peak >= 25  # the budget is used, not only respected
            finally:
                for c in coords:
                    await c.close()

    kit.run(body())


def test_lost_state_starts_a_new_epoch_in_learning_mode(kit: Any, redis_url: str) -> None:
    cfg = AdmissionConfig(budget=103)

    async def body() -> None:
        async with fleet_key(redis_url) as key:
            coord = RedisCoordinator(cfg, redis_url, key=key)
            gw = GatewayAdmission(cfg, "g0")
            try:
                first = await coord.refresh(gw.make_refresh(0.0), 0.0)
                gw.apply_grant(first, 0.0)
                assert first.learning  # a new fleet: nobody knows what others hold
                raw = aioredis.Redis.from_url(redis_url)
                await raw.delete(key)  # Redis restarted without its state
                await raw.aclose()
                second = await coord.refresh(gw.make_refresh(0.5), 0.5)
                assert second.epoch != first.epoch and second.learning
                # a gateway leaving when there is no state writes none
                raw = aioredis.Redis.from_url(redis_url)
                await raw.delete(key)
                await coord.release_gateway("g0")
                assert await raw.exists(key) == 0
                await raw.aclose()
            finally:
                await coord.close()

    kit.run(body())


def test_unreachable_or_unreadable_redis_is_coordinator_unavailable(
    kit: Any, redis_url: str
) -> None:
    cfg = AdmissionConfig(budget=10)

    async def body() -> None:
        gone = RedisCoordinator(
            cfg, f"redis://127.0.0.1:{kit.closed_port()}/0", socket_timeout_s=0.5
        )
        with pytest.raises(CoordinatorUnavailable):
            await gone.refresh(GatewayAdmission(cfg, "g").make_refresh(0.0), 0.0)
        await gone.close()
        async with fleet_key(redis_url) as key:
            raw = aioredis.Redis.from_url(redis_url)
            await raw.set(key, b"not json")  # never overwritten: it may be someone's
            coord = RedisCoordinator(cfg, redis_url, key=key)
            with pytest.raises(CoordinatorUnavailable, match="unreadable state"):
                await coord.refresh(GatewayAdmission(cfg, "g").make_refresh(0.0), 0.0)
            assert await raw.get(key) == b"not json"
            await coord.close()
            await raw.aclose()

    kit.run(body())


@asynccontextmanager
async def cut_at_exec(url: str) -> AsyncIterator[str]:
    """A TCP proxy to the Redis at ``url`` that drops every connection when the client
    sends EXEC (nothing of it reaches Redis): a connection lost mid-transaction."""
    target = aioredis.Redis.from_url(url).connection_pool.connection_kwargs

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                   other: asyncio.StreamWriter, cut: bool) -> None:
        try:
            while data := await src.read(65536):
                if cut and b"EXEC" in data:
                    break
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()
            other.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        r_reader, r_writer = await asyncio.open_connection(target["host"], target["port"])
        await asyncio.gather(pipe(reader, r_writer, writer, True),
                             pipe(r_reader, writer, r_writer, False))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/{target.get('db', 0)}"
    finally:
        server.close()
        await server.wait_closed()


def test_a_connection_lost_while_watching_is_an_outage_not_a_conflict(
    kit: Any, redis_url: str
) -> None:
    # redis-py raises a WatchError for a connection lost inside WATCH..EXEC, chained
    # to the ConnectionError implicitly: it must fail the refresh at once, not be
    # retried as MAX_ATTEMPTS conflicts (nor counted in the conflicts metric).
    cfg = AdmissionConfig(budget=10)

    async def body() -> None:
        async with fleet_key(redis_url) as key, cut_at_exec(redis_url) as proxied:
            coord = RedisCoordinator(cfg, proxied, key=key, socket_timeout_s=0.5)
            try:
                with pytest.raises(CoordinatorUnavailable) as info:
                    await coord.refresh(GatewayAdmission(cfg, "g").make_refresh(0.0), 0.0)
                assert "conflicting" not in str(info.value)
                assert coord.conflicts == 0
            finally:
                await coord.close()

    kit.run(body())


def test_redis_coordinator_config() -> None:
    assert AdmissionSection(coordinator="redis").redis_url == "redis://127.0.0.1:6379/0"
    with pytest.raises(ConfigError, match="redis_url"):
        AdmissionSection(coordinator="redis", redis_url="http://x")
    # a bad port was a 49-line traceback at start-up; a database that is no number
    # (a typo) was ignored by redis-py, the fleet's state landing in database 0
    for bad, why in (("redis://127.0.0.1:notaport/0", "bad host or port"),
                     ("redis://:s3cret#x@127.0.0.1:6379/0", "bad host or port"),
                     ("redis://:s3cret@127.0.0.1:6379/l3", "database, a number")):
        with pytest.raises(ConfigError, match=why) as err:
            AdmissionSection(coordinator="redis", redis_url=bad)
        assert "s3cret" not in str(err.value)
    for good in ("redis://h:6379", "redis://h:6379/3", "rediss://h/", "unix:///tmp/r.sock?db=2"):
        assert AdmissionSection(coordinator="redis", redis_url=good).redis_url == good
    with pytest.raises(ConfigError, match="coordinator"):
        AdmissionSection(coordinator="zookeeper")  # type: ignore[arg-type]


def test_two_gateways_on_redis_serve_within_one_budget(kit: Any, redis_url: str) -> None:
    # Two real gateways in front of the same slow stub engines, one Redis budget of
    # 8 (7 class credits + 1 bypass): however hard both are pushed, the engines never
    # run more than 7 of their requests at once.
    async def body() -> None:
        async with fleet_key(redis_url) as key:
            stubs = [await kit.StubEngine(name=f"n{i}", delay_s=0.15).start() for i in range(2)]
            nodes = [{"id": s.name, "url": s.url} for s in stubs]
            admission = {"budget": 8, "coordinator": "redis", "redis_url": redis_url,
                         "redis_key": key, "queue_timeout_s": 3.0}
            gws = []
            try:
                for gid in ("gw-a", "gw-b"):
                    cfg = kit.config(nodes, server={"gateway_id": gid}, admission=admission)
                    gws.append(await start_gateway(cfg))
                peak = 0
                stop = asyncio.Event()

                async def watch() -> None:
                    nonlocal peak
                    while not stop.is_set():
                        peak = max(peak, sum(s.inflight for s in stubs))
                        await asyncio.sleep(0.005)

                async def one(gw: Any, n: int) -> int:
                    body = {"model": kit.MODEL, "prompt": f"p{n}", "max_tokens": 4}
                    async with session.post(gw.url + "/v1/completions", json=body) as r:
                        await r.read()
                        return r.status

                import aiohttp

                async with aiohttp.ClientSession() as session:
                    watcher = asyncio.create_task(watch())
                    statuses = await asyncio.gather(
                        *(one(gws[n % 2], n) for n in range(40))
                    )
                    stop.set()
                    await watcher
                assert peak <= 7, peak
                assert statuses.count(200) >= 20, statuses  # served, not only refused
                async with aiohttp.ClientSession() as session, session.get(
                    gws[0].url + "/metrics"
                ) as r:
                    page = await r.text()
                assert "kvgate_coordinator_refresh_conflicts_total " in page
                assert "kvgate_lease_loop_errors_total 0" in page
            finally:
                for gw in gws:
                    await gw.stop()
                for s in stubs:
                    await s.stop()

    kit.run(body(), timeout=60)


def test_the_redis_benchmark_measures_real_refreshes(redis_url: str) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_redis_coordinator.py"
    spec = importlib.util.spec_from_file_location("bench_redis_coordinator", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure(redis_url, 2, 0.1, 0.5)
    assert row["gateways"] == 2 and row["refreshes"] >= 6 and row["failed"] == 0
    assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"]
