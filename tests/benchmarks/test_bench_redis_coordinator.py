"""benchmarks/bench_redis_coordinator.py: what its rows mean, and a Redis that is not there.

(tests/gateway/test_gateway_redis.py runs a real measurement on the fleet tests' Redis.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from benchlib import load_bench

bench = load_bench("bench_redis_coordinator")


def test_retried_is_the_share_of_refreshes_that_retried() -> None:
    """'retried' was conflicts / refreshes: 25 retries over 10 refreshes printed 250 %."""
    results = [
        # calls, fails, conflicts, refreshes that retried, latencies (s)
        (10, 0, 25, 4, [0.001] * 10),
        (10, 1, 0, 0, [0.003] * 10),
    ]
    row = bench.summarize(2, 0.05, results)
    assert row["refreshes"] == 20 and row["failed"] == 1
    assert row["retried_share"] == 0.2 and row["conflicts"] == 25
    # nearest rank (benchstats): p50 of 20 samples is the 10th, not the mean of 10th/11th
    assert row["latency_p50_ms"] == 1.0 and row["latency_p99_ms"] == 3.0
    line = bench.format_row(row)
    assert "retried 20.0% (25 conflicts)" in line and "failed 1 of 20" in line
    empty = bench.summarize(1, 0.5, [(0, 0, 0, 0, [])])
    assert empty["retried_share"] == 0.0 and empty["latency_p50_ms"] is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def test_unreachable_redis_fails_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    """It timed 4 s of failed refreshes per setting, then died at client.delete."""
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    t0 = time.monotonic()
    assert bench.main(["--redis-url", url, "--duration", "0.2"]) == 2
    assert time.monotonic() - t0 < 10.0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"bench_redis_coordinator: cannot reach Redis at {url}: ")
    assert bench.main(["--redis-url", "http://127.0.0.1:1"]) == 2
    assert "bad --redis-url" in capsys.readouterr().err


def test_a_real_measurement_counts_retried_refreshes() -> None:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        bench.check_redis(url, timeout_s=1.0)
    except bench.RedisUnavailable as exc:
        pytest.skip(str(exc))
    row = bench.measure(url, 4, 0.05, 0.5)
    assert row["refreshes"] >= 20 and row["failed"] == 0
    assert 0.0 <= row["retried_share"] <= 1.0
    # a refresh that retried had at least one conflict (the share is rounded to 0.001)
    assert row["retried_share"] * row["refreshes"] <= row["conflicts"] + 0.001 * row["refreshes"]


def _redis_url() -> str:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        bench.check_redis(url, timeout_s=1.0)
    except bench.RedisUnavailable as exc:
        pytest.skip(str(exc))
    return url


def test_each_gateways_cold_first_refresh_is_not_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every gateway's first refresh (TCP connect, the state's creation) was timed
    and made the p99 of the fleet's row."""
    url = _redis_url()
    from kvgate.gateway import redis_coordinator

    calls = mp.Value("i", 0)  # shared with the forked workers
    real = redis_coordinator.RedisCoordinator.refresh

    async def counted(self: Any, req: Any, now: float) -> Any:
        with calls.get_lock():
            calls.value += 1
        return await real(self, req, now)

    monkeypatch.setattr(redis_coordinator.RedisCoordinator, "refresh", counted)
    row = bench.measure(url, 4, 0.05, 0.4)
    assert row["failed"] == 0 and row["refreshes"] >= 4
    assert calls.value == row["refreshes"] + 4  # one untimed warm-up per gateway


KILL_ONE_WORKER = """
import multiprocessing as mp, os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
from benchlib import load_bench
bench = load_bench("bench_redis_coordinator")

def kill_one():
    time.sleep(1.5)  # all 8 started: the first setting's workers are warm or timing
    kids = mp.active_children()
    print(" ".join(str(k.pid) for k in kids), flush=True)
    os.kill(kids[0].pid, signal.SIGKILL)  # as the OOM killer would

threading.Thread(target=kill_one, daemon=True).start()
sys.exit(bench.main(["--redis-url", {url!r}, "--duration", "5"]))
"""


def test_a_dead_worker_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    """queue.get() without a timeout: a worker that died never put its result, and
    the benchmark waited for it forever."""
    url = _redis_url()
    script = tmp_path / "kill_one.py"
    script.write_text(KILL_ONE_WORKER.format(tests=str(Path(__file__).parent), url=url))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the benchmark still waited 40 s after one of its workers died")
    assert proc.returncode == 1, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("bench_redis_coordinator: worker ")
    assert "was killed by SIGKILL before its result; stopped the other workers" in lines[0]
    workers = [int(p) for p in out.split()]
    assert len(workers) == 8

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 5.0
    while any(running(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in workers)
