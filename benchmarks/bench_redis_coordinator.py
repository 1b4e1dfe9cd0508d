"""What one lease refresh costs a fleet sharing the Redis coordinator.

G gateways (spread over P processes, as a fleet would be) each refresh their lease
every ``period`` seconds (jittered +-10 %) for ``duration`` seconds against one Redis
key; every refresh is the real ``RedisCoordinator.refresh`` (WATCH, GET, TIME, the
in-process lease rules, MULTI/SET/EXEC). Prints refresh latency, the share of
refreshes that retried at least once after a conflict (``retried_share``; the raw
number of optimistic retries is ``conflicts``), and failures, per setting. The default
settings are the idle period (0.5 s) and the fastest early refreshes under load (0.05 s).

    python benchmarks/bench_redis_coordinator.py [--json] [--redis-url URL] [--duration S]

Warm-up, not timed: every gateway first makes one refresh (its TCP connect, and the
state's creation for the first), and the window starts once all processes have done
theirs, so the timed refreshes are a running fleet's. Percentiles are nearest-rank
(benchmarks/benchstats.py).

Uses its own key on the given Redis (default 127.0.0.1:6379) and deletes it after. An
unreachable Redis is one line on stderr and exit code 2, before anything is measured;
a worker process that dies (or gives no result in time) stops the others and is one
line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# benchstats.py sits beside this file: importable when run as a script and when
# loaded by path (importlib), as tests do
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import percentile

# imported here, before the workers fork, so no worker pays (or times) the import
from kvgate.core.admission import AdmissionConfig, GatewayAdmission
from kvgate.gateway.redis_coordinator import RedisCoordinator

# (gateways, period): idle (0.5 s), the fastest early refreshes (0.05 s), and 0.2 s
SETTINGS = [(8, 0.5), (32, 0.5), (8, 0.05), (16, 0.05), (32, 0.05), (32, 0.2)]
PROCESSES = 8
START_TIMEOUT_S = 60.0  # workers' warm-up (connect, first refresh) must end by then
RESULT_SLACK_S = 30.0  # beyond the window, before a missing result counts as a failure
POLL_S = 0.2  # how often the parent looks at its workers while it waits


class WorkerFailed(Exception):
    """A worker died or gave no result in time: printed as one line, exit code 1."""


def _worker(url: str, key: str, index: int, ids: list[int], period: float,
            duration: float, out: Any, go: Any) -> None:
    """Gateways ``ids`` in one process: a warm-up refresh each, ``("ready", index)``,
    then (once the parent sets ``go``) the timed window, ``("result", index, rows)``."""
    cfg = AdmissionConfig(budget=1000)

    async def warm_up(coord: RedisCoordinator, adm: GatewayAdmission) -> None:
        now = time.monotonic()  # not timed: the TCP connect, the state's creation
        adm.apply_grant(await asyncio.wait_for(coord.refresh(adm.make_refresh(now), now),
                                               10.0), now)

    async def gateway(i: int, coord: RedisCoordinator, adm: GatewayAdmission
                      ) -> tuple[int, int, int, int, list[float]]:
        rng = random.Random(i)
        calls = fails = retried = 0
        warm_conflicts = coord.conflicts  # retries of the warm-up are not counted
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
        return calls, fails, coord.conflicts - warm_conflicts, retried, lat

    async def main() -> None:
        coords = [RedisCoordinator(cfg, url, key=key) for _ in ids]
        adms = [GatewayAdmission(cfg, f"bench-{i}") for i in ids]
        try:
            await asyncio.gather(*(warm_up(c, a) for c, a in zip(coords, adms, strict=True)))
            out.put(("ready", index))
            if not await asyncio.to_thread(go.wait, START_TIMEOUT_S):
                raise TimeoutError(f"not started after {START_TIMEOUT_S:g} s")
            rows = await asyncio.gather(*(gateway(i, c, a)
                                          for i, c, a in zip(ids, coords, adms, strict=True)))
        finally:
            for c in coords:
                await c.close()
        out.put(("result", index, rows))

    try:
        asyncio.run(main())
    except Exception as exc:  # one line here; the parent says which worker and stops
        print(f"bench_redis_coordinator: worker {index + 1}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        sys.exit(1)


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


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _collect(workers: list[Any], out: Any, go: Any, window_s: float) -> list[Any]:
    """Every worker's rows; sets ``go`` once all are warm. WorkerFailed when one exits
    without its result, or the results do not come in time (never blocks for good)."""
    ready: set[int] = set()
    rows: dict[int, Any] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(rows) < len(workers):
        try:
            msg = out.get(timeout=POLL_S)
        except queue.Empty:
            msg = None
        if msg is None:
            for i, w in enumerate(workers):
                if i not in rows and w.exitcode is not None and w.exitcode != 0:
                    raise WorkerFailed(
                        f"worker {i + 1} of {len(workers)} (pid {w.pid}) "
                        f"{_exit_text(w.exitcode)} before its result")
            if time.monotonic() > deadline:
                what = "ready" if len(ready) < len(workers) else "a result"
                missing = len(workers) - (len(ready) if what == "ready" else len(rows))
                raise WorkerFailed(f"{missing} of {len(workers)} workers gave no {what} "
                                   "in time")
            continue
        if msg[0] == "ready":
            ready.add(msg[1])
            if len(ready) == len(workers):
                go.set()
                deadline = time.monotonic() + window_s + RESULT_SLACK_S
        else:
            rows[msg[1]] = msg[2]
    return [r for i in sorted(rows) for r in rows[i]]


def _stop(workers: list[Any]) -> None:
    for w in workers:
        if w.is_alive():
            w.terminate()
    for w in workers:
        w.join(timeout=5.0)
        if w.is_alive():
            w.kill()
            w.join(timeout=5.0)


def measure(url: str, gateways: int, period: float, duration: float) -> dict[str, Any]:
    import redis

    key = f"kvgate-bench:{uuid.uuid4().hex}"
    procs = min(PROCESSES, gateways)
    out: Any = mp.Queue()
    go: Any = mp.Event()
    ids = [list(range(p, gateways, procs)) for p in range(procs)]
    workers = [mp.Process(target=_worker, args=(url, key, n, i, period, duration, out, go))
               for n, i in enumerate(ids)]
    try:
        for w in workers:
            w.start()
        # a window: the first refresh waits up to a period, the last sleeps up to 1.1 of
        # one, and one refresh times out after 1 s
        results = _collect(workers, out, go, duration + 2.1 * period + 1.0)
    finally:
        _stop(workers)
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
        "latency_p50_ms": round(percentile(lat, 50) * 1e3, 2) if lat else None,
        "latency_p99_ms": round(percentile(lat, 99) * 1e3, 2) if lat else None,
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
    ap.add_argument("--duration", type=float, default=4.0,
                    help="seconds per setting, 0.1..600 (4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not 0.1 <= args.duration <= 600:
        ap.error("--duration must be 0.1..600 seconds")
    try:
        check_redis(args.redis_url)
    except RedisUnavailable as exc:
        print(f"bench_redis_coordinator: {exc}", file=sys.stderr)
        return 2
    try:
        rows = [measure(args.redis_url, g, p, args.duration) for g, p in SETTINGS]
    except WorkerFailed as exc:
        print(f"bench_redis_coordinator: {exc}; stopped the other workers", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"runs": rows}))
        return 0
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
