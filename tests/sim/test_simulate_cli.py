"""`kvgate simulate` end to end on small synthetic workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.cli import main


def test_simulate_prints_a_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    plot = tmp_path / "r.png"
    code = main(
        [
            "simulate",
            "--workload",
            "gsp",
            "--limit",
            "80",
            "--nodes",
            "3",
            "--policies",
            "kvgate,round_robin",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert (
        "kvgate" in text and "round_robin" in text and "requests simulated per wall second" in text
    )
    rep = json.loads(out.read_text())
    assert rep["requests"] == 80
    assert {"ideal_hit_ratio", "pooled_lru_hit_ratio"} <= rep["bounds"].keys()
    assert set(rep["policies"]) == {"kvgate", "round_robin"}
    assert plot.stat().st_size > 1000


def test_simulate_finds_round_robin_saturation(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--workload",
            "gsp",
            "--limit",
            "120",
            "--nodes",
            "2",
            "--policies",
            "kvgate",
            "--find-saturation",
            "--at-saturation",
            "0.5",
            "--no-progress",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "round robin saturation speed-up: x" in text and "0.5 of saturation" in text


def test_simulate_scenario_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "simulate",
                "--workload",
                "chat",
                "--limit",
                "60",
                "--nodes",
                "3",
                "--policies",
                "kvgate",
                "--scenario",
                "mass_eviction",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "announced" in capsys.readouterr().out
    assert main(["simulate", "--policies", "nope", "--limit", "5", "--no-progress"]) == 2
    assert main(["simulate", "--trace", "/nonexistent.jsonl", "--no-progress"]) == 2
