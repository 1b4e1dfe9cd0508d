"""Smoke test of benchmarks/bench_core.py on a tiny setup (the timings are not checked)."""

from __future__ import annotations

import json

import pytest
from benchlib import load_bench

TINY = ["--entries", "3000", "--prompts", "12", "--nodes", "16", "--reps", "2"]




bench = load_bench("bench_core")

ROUTE_KEYS = {"route_p50_us", "route_p99_us", "route_safe_mode_p50_us",
              "route_safe_mode_p99_us", "route_samples", "route_prompts_with_a_holder",
              "index_entries"}


def test_the_whole_request_path_is_timed_beside_route(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """route_p50 times route() on a frozen index: the inserts and load bookkeeping every
    request pays (on_arrival + on_finished) had no key."""
    assert bench.main([*TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert ROUTE_KEYS | {"arrival_p50_us", "arrival_p99_us"} <= set(out)
    assert 0 < out["arrival_p50_us"] <= out["arrival_p99_us"]
    assert out["route_samples"] == 12  # the warm-up pass is not counted
    assert bench.main(TINY) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    at = keys.index("route_p99_us")
    assert keys[at + 1: at + 3] == ["arrival_p50_us", "arrival_p99_us"]

