"""benchmarks/bench_redis_coordinator.py: what its rows mean, and a Redis that is not there.

(tests/gateway/test_gateway_redis.py runs a real measurement on the fleet tests' Redis.)
"""

from __future__ import annotations

import os
import socket
import time

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
    assert row["latency_p50_ms"] == 2.0 and row["latency_p99_ms"] == 3.0
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
