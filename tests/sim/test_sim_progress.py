"""`kvgate simulate`'s progress: the simulator reports ended requests, the CLI draws a bar."""

from __future__ import annotations

import io
import json

import pytest

from kvgate.cli import main
from kvgate.commands.sim_progress import BAR_WIDTH, SimProgress
from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.sim.cluster import PROGRESS_EVERY, ClusterConfig
from kvgate.sim.runner import SeededRng, run_policy
from kvgate.sim.synthetic import shared_prefix_groups


def small_config() -> ClusterConfig:
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=128))
    return ClusterConfig(nodes=4, cache_blocks=400, node_capacity=32, controller=ctl)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_simulator_reports_ended_requests_without_changing_the_run() -> None:
    w = shared_prefix_groups(rng=SeededRng(1), arrivals=8.0, num_groups=10, prompts_per_group=20)
    n = len(w.requests)
    seen: list[tuple[int, int]] = []
    _, with_bar = run_policy(
        w, small_config(), "kvgate", seed=3, on_progress=lambda e, t: seen.append((e, t))
    )
    _, without = run_policy(w, small_config(), "kvgate", seed=3)
    assert with_bar == without  # a progress feed is no input to the simulation
    assert seen[-1] == (n, n) and all(t == n for _, t in seen)
    ended = [e for e, _ in seen]
    assert ended == sorted(set(ended))  # each report is further on
    # every PROGRESS_EVERY ended requests, and the last
    expected = list(range(PROGRESS_EVERY, n + 1, PROGRESS_EVERY))
    assert ended == (expected if expected[-1] == n else [*expected, n])


def test_a_terminal_gets_one_line_with_a_bar_redrawn_at_most_ten_times_a_second() -> None:
    out, clock = Tty(), Clock()
    p = SimProgress(True, out=out, clock=clock)
    clock.t = 1.0
    p("kvgate at x0.8352")
    assert out.getvalue() == "\r[   1.0s] simulating kvgate at x0.8352"
    clock.t = 1.05
    p.requests(64, 1000)  # too soon after the last draw: nothing
    assert out.getvalue().count("\r") == 1
    clock.t = 1.2
    p.requests(500, 1000)
    half = "#" * (BAR_WIDTH // 2) + "." * (BAR_WIDTH - BAR_WIDTH // 2)
    assert out.getvalue().endswith(
        f"\r[   1.2s] simulating kvgate at x0.8352 [{half}] 500/1,000 requests"
    )
    clock.t = 1.21
    p.requests(1000, 1000)  # the last one is always drawn
    assert out.getvalue().endswith(f"[{'#' * BAR_WIDTH}] 1,000/1,000 requests")
    long = len(out.getvalue().rsplit("\r", 1)[1])
    p("dynamo_cost at x0.8352")  # shorter: its tail is blanked
    last = out.getvalue().rsplit("\r", 1)[1]
    assert last.startswith("[   1.2s] simulating dynamo_cost at x0.8352") and len(last) == long
    assert last.rstrip() == "[   1.2s] simulating dynamo_cost at x0.8352"
    p.done()
    assert out.getvalue().endswith("\n")


def test_elsewhere_one_line_per_run_and_no_bar() -> None:
    out = io.StringIO()  # a file or a pipe
    p = SimProgress(True, out=out)
    p("kvgate at x1")
    p.requests(1000, 1000)
    p.done()
    assert out.getvalue() == "simulating kvgate at x1\n"
    quiet = Tty()
    q = SimProgress(False, out=quiet)  # --no-progress on a terminal
    q("kvgate at x1")
    q.requests(10, 10)
    q.done()
    assert quiet.getvalue() == "simulating kvgate at x1\n"


def test_simulate_on_a_terminal_draws_every_run_to_its_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    out = tmp_path / "r.json"
    argv = ["simulate", "--workload", "gsp", "--limit", "100", "--nodes", "3"]
    assert main([*argv, "--policies", "kvgate,round_robin", "--json", str(out)]) == 0
    text = err.getvalue()
    for name in ("kvgate", "round_robin"):
        assert f"simulating {name} at x1 [{'#' * BAR_WIDTH}] 100/100 requests" in text
    assert text.endswith("\n") and "Traceback" not in text
    assert "policy" in capsys.readouterr().out  # the table still goes to stdout
    assert json.loads(out.read_text())["requests"] == 100
