"""`kvgate simulate`: the saturation options, --policies and --plot refuse what they
cannot do, with exit code 2 and a message, instead of guessing."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvgate.cli import main
from kvgate.commands.sim_plot import _flatten
from kvgate.commands.simulate import keeps_up, sheds
from kvgate.sim.workload import SimRequest, Workload

SMALL = ["simulate", "--workload", "gsp", "--limit", "40", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--saturation", "3"], "--saturation needs --at-saturation"),
        (
            ["--saturation", "3", "--find-saturation", "--at-saturation", "0.5"],
            "--find-saturation searches for it: use one",
        ),
        (["--policies", ","], "no policy given"),
        (["--policies", "round_robin,round_robin"], "named more than once: ['round_robin']"),
        (["--find-saturation", "--plot", "r.png"], "add --at-saturation"),
        # options that would be ignored without a word
        (["--speedup", "2", "--saturation", "3", "--at-saturation", "0.5"],
         "--speedup gives one run's speed-up"),
        (["--speedup", "2", "--find-saturation"], "--speedup gives one run's speed-up"),
        (["--bucket", "jitter"], "a synthetic workload has none"),
    ],
)
def test_refused_before_any_run(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "policy" not in captured.out


def test_saturation_search_says_when_the_cluster_is_too_small(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One node of 2 cache blocks cannot hold a gsp prompt: round robin sheds at x0.25,
    and the search says so instead of reporting x0.25 as the point."""
    args = [*SMALL, "--nodes", "1", "--cache-blocks", "2", "--policies", "round_robin"]
    assert main([*args, "--find-saturation", "--at-saturation", "1"]) == 2
    err = capsys.readouterr().err
    assert "does not keep up with this workload even at x0.25" in err


def test_saturation_search_says_when_it_never_found_the_point(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One request: round robin keeps up at every probe up to x16."""
    args = ["simulate", "--workload", "gsp", "--limit", "1", "--no-progress"]
    assert main([*args, "--policies", "round_robin", "--find-saturation"]) == 2
    assert "keeps up at every speed-up probed" in capsys.readouterr().err


def test_a_given_saturation_is_marked_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    args = [*SMALL, "--policies", "round_robin", "--saturation", "2", "--at-saturation", "0.5"]
    assert main([*args, "--json", str(out)]) == 0
    assert "round robin saturation speed-up: x2.0 (given)" in capsys.readouterr().out
    assert '"saturation_found": false' in out.read_text()


def test_the_plot_finds_every_run_of_a_scenario_at_fractions_of_saturation() -> None:
    row: dict[str, Any] = {"policies": {"kvgate": {}}, "bounds": {}}
    report = {
        "runs": {
            "0.5": {"scenario": "tenant_flood", "variants": {"flood": row, "no_flood": row}},
            "0.8": {"scenario": "tenant_flood", "variants": {"flood": row, "no_flood": row}},
        }
    }
    assert list(_flatten(report)) == [
        "x0.5 sat flood",
        "x0.5 sat no_flood",
        "x0.8 sat flood",
        "x0.8 sat no_flood",
    ]
    assert list(_flatten({"variants": {"nodes_fail": row}})) == ["nodes_fail"]
    assert list(_flatten(row)) == [""]
    assert _flatten({"runs": {}}) == {}


def test_a_scenario_at_a_fraction_of_saturation_is_plotted(tmp_path: Path) -> None:
    plot = tmp_path / "s.png"
    args = [*SMALL, "--nodes", "2", "--policies", "kvgate,round_robin"]
    args += ["--scenario", "traffic_double", "--saturation", "1", "--at-saturation", "0.5"]
    assert main([*args, "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000


def test_a_run_where_nothing_completes_is_plotted_and_fails_its_load_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One cache block per node: every prompt is too long and refused. The plot says so
    without matplotlib's empty-legend warning, and the load check fails (no token was
    processed) instead of passing at 0.000."""
    plot = tmp_path / "none.png"
    args = [*SMALL, "--cache-blocks", "1", "--policies", "kvgate,random"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's UserWarning would fail the test
        assert main([*args, "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "FAIL load_max_over_mean        none  no token processed" in out


def test_a_reader_that_goes_away_stops_it_quietly(tmp_path: Path) -> None:
    """`kvgate simulate ... | head`: no traceback, the JSON asked for still written,
    and the shell's broken-pipe status."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvgate.cli", *SMALL, "--policies", "kvgate,round_robin"]
    proc = subprocess.Popen(
        [*cmd, "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the table is printed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert b"Traceback" not in err and out.stat().st_size > 1000


def test_rate_with_a_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, '
                     '"hash_ids": [1]}\n')
    assert main(["simulate", "--trace", str(trace), "--rate", "4", "--no-progress"]) == 2
    assert "a trace has its own timestamps" in capsys.readouterr().err


def test_keeping_up_means_shedding_under_1_percent_and_draining_at_once() -> None:
    """The saturation search's rule, on hand-made reports of a 100-request workload that
    arrives over 100 s: an unloaded run's drain allowance of 5 s lets the run end by
    1.1 x 100 + 5 s after the first arrival; later, the backlog grew; 1 refusal in 100
    is shedding."""
    reqs = tuple(
        SimRequest(request_id=f"r{i}", arrival_s=float(i), prompt_tokens=16, output_tokens=1,
                   block_ids=())
        for i in range(101)
    )  # fmt: skip
    w = Workload(name="w", block_tokens=512, requests=reqs)
    assert w.duration_s == 100.0

    def rep(span: float, rejected: int = 0, failed: int = 0) -> dict[str, Any]:
        return {"span_s": span, "rejected": rejected, "failed": failed}

    assert keeps_up(rep(115.0), w, 5.0)
    assert keeps_up(rep(115.01), w, 5.0)  # the report rounds the span to 10 ms
    assert not keeps_up(rep(115.1), w, 5.0)  # drained late: the queue grew
    assert keeps_up(rep(125.0), w, 15.0)  # a longer unloaded drain allows more
    assert not sheds(rep(100.0), w) and keeps_up(rep(100.0), w, 5.0)
    assert sheds(rep(100.0, rejected=1, failed=1), w)  # 2 of 101: >= 1 %
    assert not sheds(rep(100.0, failed=1), w)  # 1 of 101: under 1 %
    assert not keeps_up(rep(100.0, rejected=2), w, 5.0)  # on time, but it shed
