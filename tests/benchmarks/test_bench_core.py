"""Smoke test of benchmarks/bench_core.py on a tiny setup (the timings are not checked)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--entries", "3000", "--prompts", "12", "--nodes", "16", "--reps", "2"]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_kvgate_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_core")

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

