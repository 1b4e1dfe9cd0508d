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



SMALL = ["--entries", "400", "--prompts", "4", "--reps", "2"]


@pytest.mark.parametrize("argv", [
    ["--nodes", "8"],  # rng.sample of 16 holders out of 8 nodes: ValueError
    ["--nodes", "1", "--prompts", "1", "--entries", "1"],  # the smallest of each
])
def test_every_value_in_range_runs(argv: list[str], capsys: pytest.CaptureFixture[str]
                                   ) -> None:
    assert bench.main([*SMALL, *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["route_samples"] == int(argv[argv.index("--prompts") + 1]
                                       if "--prompts" in argv else 4)
    assert out["route_p50_us"] <= out["route_p99_us"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--reps", "1"], "--reps must be 2..1000 (the first pass is a warm-up)"),
    (["--prompts", "0"], "--prompts must be 1..100000"),
    (["--entries", "0"], "--entries must be 1..20000000"),
    (["--nodes", "0"], "--nodes must be 1..4096"),
])
def test_out_of_range_values_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """--reps 1 (median of no samples), --prompts 0 and --entries 0 (ZeroDivisionError)
    crashed with a traceback after seconds of work."""
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].endswith(f": error: {message}")  # argparse's usage, then one line
