"""What one lease refresh costs a fleet sharing the Redis coordinator.

G gateways (spread over P processes, as a fleet would be) each refresh their lease
every ``period`` seconds (jittered +-10 %) for ``duration`` seconds against one Redis
key; every refresh is the real ``RedisCoordinator.refresh`` (WATCH, GET, TIME, the
in-process lease rules, MULTI/SET/EXEC). Prints refresh latency, the share of
refreshes that retried at least once after a conflict (``retried_share``; the raw
number of optimistic retries is ``conflicts``), and failures, per setting. The default
settings are the idle period (0.5 s) and the fastest early refreshes under load (0.05 s).

    python benchmarks/bench_redis_coordinator.py [--json] [--redis-url URL]

Uses its own key on the given Redis (default 127.0.0.1:6379) and deletes it after. An
unreachable Redis is one line on stderr and exit code 2, before anything is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
import uuid
from typing import Any

# (gateways, period): idle (0.5 s), the fastest early refreshes (0.05 s), and 0.2 s
SETTINGS = [(8, 0.5), (32, 0.5), (8, 0.05), (16, 0.05), (32, 0.05), (32, 0.2)]
PROCESSES = 8


def _worker(url: str, key: str, ids: list[int], period: float, duration: float,
            out: Any) -> None:
    from kvgate.core.admission import AdmissionConfig, GatewayAdmission
    from kvgate.gateway.redis_coordinator import RedisCoordinator

    cfg = AdmissionConfig(budget=1000)

    async def gateway(i: int) -> tuple[int, int, int, int, list[float]]:
        coord = RedisCoordinator(cfg, url, key=key)
        adm = GatewayAdmission(cfg, f"bench-{i}")
        rng = random.Random(i)
        calls = fails = retried = 0
        lat: list[float] = []
        await asyncio.sleep(rng.uniform(0, period))
        end = time.monotonic() + duration
        while time.monotonic() < end:
            t0 = time.perf_counter()
            now = time.monotonic()
            conflicts = coord.conflicts
            try:
                grant = await asyncio.wait_for(coord.refresh(adm.make_refresh(now), now), 1.0)
                adm.apply_grant(grant, now)
            except Exception:  # what the gateway would count as a failed refresh
                fails += 1
            calls += 1
            retried += coord.conflicts > conflicts  # this refresh retried at least once
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(period * rng.uniform(0.9, 1.1))
        await coord.close()
        return calls, fails, coord.conflicts, retried, lat

    async def main() -> None:
        out.put(await asyncio.gather(*(gateway(i) for i in ids)))

    asyncio.run(main())


class RedisUnavailable(Exception):
    """Redis does not answer at the URL: printed as one line, exit code 2."""


def check_redis(url: str, timeout_s: float = 2.0) -> None:
    """PING ``url`` once; RedisUnavailable (one line) when it does not answer."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
    except ValueError as exc:  # not a redis:// URL
        raise RedisUnavailable(f"bad --redis-url {url!r}: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnavailable(f"cannot reach Redis at {url}: {exc}") from None
    finally:
        client.close()


def measure(url: str, gateways: int, period: float, duration: float) -> dict[str, Any]:
    import redis

    key = f"kvgate-bench:{uuid.uuid4().hex}"
    procs = min(PROCESSES, gateways)
    queue: Any = mp.Queue()
    ids = [list(range(p, gateways, procs)) for p in range(procs)]
    workers = [mp.Process(target=_worker, args=(url, key, i, period, duration, queue))
               for i in ids]
    for w in workers:
        w.start()
    results = [r for _ in workers for r in queue.get()]
    for w in workers:
        w.join()
    client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        client.delete(key)
    except redis.RedisError:  # Redis went away during the run: the key expires anyway
        pass
    finally:
        client.close()
    return summarize(gateways, period, results)


def summarize(gateways: int, period: float,
              results: list[tuple[int, int, int, int, list[float]]]) -> dict[str, Any]:
    """One setting's row from its gateways' (calls, fails, conflicts, retried, latencies)."""
    calls = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[4])
    return {
        "gateways": gateways,
        "period_s": period,
        "refreshes": calls,
        "latency_p50_ms": round(statistics.median(lat) * 1e3, 2) if lat else None,
        "latency_p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2) if lat else None,
        # refreshes that retried at least once (a refresh may retry several times)
        "retried_share": round(sum(r[3] for r in results) / calls, 3) if calls else 0.0,
        "conflicts": sum(r[2] for r in results),  # optimistic retries, all refreshes
        "failed": sum(r[1] for r in results),
    }


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['gateways']:>3} gateways every {r['period_s']:>4} s: refresh p50 "
            f"{r['latency_p50_ms']} ms, p99 {r['latency_p99_ms']} ms, retried "
            f"{r['retried_share']:.1%} ({r['conflicts']} conflicts), failed {r['failed']} "
            f"of {r['refreshes']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per setting (4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        check_redis(args.redis_url)
    except RedisUnavailable as exc:
        print(f"bench_redis_coordinator: {exc}", file=sys.stderr)
        return 2
    rows = [measure(args.redis_url, g, p, args.duration) for g, p in SETTINGS]
    if args.json:
        print(json.dumps({"runs": rows}))
        return 0
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
