"""benchmarks/benchstats.py: the one percentile definition of the benchmarks."""

from __future__ import annotations

import pytest
from benchlib import load_bench

stats = load_bench("benchstats")


def test_nearest_rank() -> None:
    hundred = [float(x) for x in range(100, 0, -1)]  # unsorted on purpose
    assert stats.percentile(hundred, 99) == 99.0  # not the max: rank ceil(0.99 * 100)
    assert stats.percentile(hundred, 50) == 50.0  # a sample, not 50.5
    assert stats.percentile(hundred, 100) == 100.0
    assert stats.percentile(hundred, 0) == 1.0
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert stats.percentile([float(x) for x in range(1, 1001)], 99.9) == 999.0
    assert stats.percentile([float(x) for x in range(1, 51)], 99) == 50.0  # < 100: max
    assert stats.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_every_script_uses_it() -> None:
    """bench_core's p99 was s[int(0.99 * n)], the max for n <= 100; the Redis
    benchmark's was s[int(0.99 * (n - 1))] and its p50 the interpolated median."""
    core = load_bench("bench_core")
    redis_bench = load_bench("bench_redis_coordinator")
    samples = [float(x) for x in range(1, 101)]
    assert core.percentile(samples, 99) == 99.0
    row = redis_bench.summarize(1, 0.5, [(100, 0, 0, 0, [x / 1000 for x in samples])])
    assert row["latency_p50_ms"] == 50.0 and row["latency_p99_ms"] == 99.0
