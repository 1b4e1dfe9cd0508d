"""`kvgate simulate --requests`: one JSON line per request of every run, whose
numbers are the very ones the report aggregates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.core.routing.base import RouteReason
from kvgate.sim.report import pct
from kvgate.sim.request_log import REQUEST_LOG_KEYS

ARGV = ["simulate", "--workload", "chat", "--limit", "60", "--nodes", "3", "--no-progress"]


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_request_of_every_run_is_a_line_that_adds_up_to_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, rep_path = tmp_path / "requests.jsonl", tmp_path / "r.json"
    argv = [*ARGV, "--policies", "kvgate,round_robin", "--requests", str(log)]
    assert main([*argv, "--json", str(rep_path)]) == 0
    capsys.readouterr()
    rep = json.loads(rep_path.read_text())
    rows = _rows(log)
    assert len(rows) == 2 * 60
    assert all(list(r) == list(REQUEST_LOG_KEYS) for r in rows)
    reasons = {r.value for r in RouteReason}
    for policy in ("kvgate", "round_robin"):
        mine = [r for r in rows if r["policy"] == policy]
        assert [r["request_id"] for r in mine] == [f"chat-{i}" for i in range(60)]
        assert {(r["speedup"], r["seed"], r["variant"]) for r in mine} == {(1.0, 0, None)}
        done = [r for r in mine if r["status"] == "completed"]
        summary = rep["policies"][policy]
        assert len(done) == summary["completed"]
        ttfts = [float(r["ttft_s"]) for r in done]  # type: ignore[arg-type]
        assert pct(ttfts, 0.99) == pytest.approx(summary["ttft_p99_s"], abs=1e-4)
        assert sum(ttfts) / len(ttfts) == pytest.approx(summary["ttft_mean_s"], abs=1e-4)
        # to 4 decimals, as every rate (it was rounded to 1: 10 % off on small runs)
        tokens = sum(int(r["output_tokens"]) for r in done)  # type: ignore[call-overload]
        first = min(float(r["arrived_s"]) for r in mine)  # type: ignore[arg-type]
        last = max(float(r["arrived_s"]) + float(r["e2e_s"]) for r in done)  # type: ignore[arg-type]
        assert summary["output_tokens_per_s"] == pytest.approx(tokens / (last - first), abs=1e-3)
        for r in done:
            assert r["route_reason"] in reasons and r["node"] in {"node-0", "node-1", "node-2"}
            assert 0 <= r["matched_blocks"] <= r["best_matched_blocks"]  # type: ignore[operator]
            # its own prefill on an idle node is a floor; the queue is part of the rest
            assert r["prefill_alone_s"] <= r["ttft_s"]  # type: ignore[operator]
            assert 0 <= r["queued_s"] <= r["ttft_s"] - r["prefill_alone_s"] + 1e-6  # type: ignore[operator]
            assert r["e2e_s"] >= r["ttft_s"]  # type: ignore[operator]
    # round robin never routes by the cache; kvgate's hits are on its own lines
    assert {r["route_reason"] for r in rows if r["policy"] == "round_robin"} == {"rotation"}
    assert any(r["cached_tokens"] for r in rows if r["policy"] == "kvgate")


def test_a_request_that_did_not_complete_has_no_latency_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "requests.jsonl"
    argv = [*ARGV, "--policies", "kvgate", "--scenario", "tenant_flood", "--requests", str(log)]
    assert main(argv) == 0
    capsys.readouterr()
    rows = _rows(log)
    assert {r["variant"] for r in rows} == {"flood", "no_flood"}
    refused = [r for r in rows if r["status"] == "rejected"]
    assert refused, "the flood is refused beyond its quota"
    for r in refused:
        assert r["reason"] and r["ttft_s"] is None and r["queued_s"] is None
        assert r["prefill_alone_s"] is None and r["e2e_s"] is None


def test_replays_and_saturation_fractions_label_their_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "requests.jsonl"
    argv = [*ARGV, "--policies", "kvgate", "--replays", "2", "--requests", str(log)]
    argv += ["--saturation", "2", "--at-saturation", "0.5,1"]
    assert main(argv) == 0
    capsys.readouterr()
    runs = {(r["speedup"], r["seed"]) for r in _rows(log)}
    assert runs == {(1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1)}
    assert len(_rows(log)) == 4 * 60


def test_an_unwritable_log_fails_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, message in [
        (tmp_path / "missing" / "r.jsonl", "does not exist"),
        (tmp_path, "is a folder, not a file"),
    ]:
        assert main([*ARGV, "--requests", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and "simulating" not in err
    assert list(tmp_path.iterdir()) == []


def test_the_log_never_overwrites_the_trace_nor_an_old_log_when_the_run_cannot_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    line = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(line) + "\n")
    same = tmp_path / "." / "trace.jsonl"
    for argv, message in [
        (["--trace", str(trace), "--requests", str(same)], "is the same file as --trace"),
        (["--trace", str(trace), "--json", str(trace)], "is the same file as --trace"),
        (["--requests", str(trace), "--json", str(trace)], "--json"),
    ]:
        assert main(["simulate", "--no-progress", *argv]) == 2
        assert message in capsys.readouterr().err
        assert json.loads(trace.read_text()) == line
    old = tmp_path / "old.jsonl"
    old.write_text("kept\n")
    missing = tmp_path / "missing.jsonl"
    assert main(["simulate", "--no-progress", "--trace", str(missing), "--requests", str(old)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert old.read_text() == "kept\n"


def test_rows_keep_the_workloads_order_in_a_closed_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A closed loop's requests arrive out of the plan's order; the rows of two
    policies still line up request by request (they followed the arrivals)."""
    log = tmp_path / "requests.jsonl"
    argv = ["simulate", "--workload", "chat", "--closed-loop", "--limit", "80", "--speedup",
            "2", "--nodes", "3", "--no-progress", "--policies", "kvgate,round_robin",
            "--requests", str(log)]
    assert main(argv) == 0
    capsys.readouterr()
    rows = _rows(log)
    for policy in ("kvgate", "round_robin"):
        ids = [r["request_id"] for r in rows if r["policy"] == policy]
        assert ids == [f"chat-{i}" for i in range(80)]


def test_a_failed_request_names_the_node_it_failed_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under nodes_fail the log said which route a failed request took but not where."""
    log = tmp_path / "requests.jsonl"
    argv = ["simulate", "--workload", "zipf", "--limit", "300", "--rate", "8", "--nodes", "4",
            "--scenario", "nodes_fail", "--policies", "round_robin", "--no-progress",
            "--requests", str(log)]
    main(argv)
    capsys.readouterr()
    failed = [r for r in _rows(log) if r["status"] == "failed"]
    assert failed
    assert all(r["node"] in {f"node-{i}" for i in range(4)} for r in failed if r["attempts"])
