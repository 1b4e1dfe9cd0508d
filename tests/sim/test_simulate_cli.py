"""`kvgate simulate` end to end on small synthetic workloads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.commands.simulate import _config, _load_workload
from kvgate.commands.simulate_args import add_simulate_parser


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
    # the quality bar, read from this very table (round_robin is no cache-aware baseline)
    checks = rep["ordering"]["checks"]
    assert checks["ttft_p99_s"]["against"] == "round_robin" and "hit_ratio" not in checks
    assert checks["ttft_p99_s"]["ok"] == (
        rep["policies"]["kvgate"]["ttft_p99_s"] < rep["policies"]["round_robin"]["ttft_p99_s"]
    )
    assert "kvgate against the other policies:" in text


def test_simulate_finds_round_robin_saturation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
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
            "kvgate,least_loaded",
            "--find-saturation",
            "--at-saturation",
            "0.5,0.9",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "round robin saturation speed-up: x" in text and "0.5 of saturation" in text
    # the quality-bar checks of both runs, tallied
    rep = json.loads(out.read_text())
    tally = rep["ordering_tally"]
    assert tally["runs"] == 2
    held = sum(r["ordering"]["checks"]["ttft_p99_s"]["ok"] for r in rep["runs"].values())
    assert tally["held"]["ttft_p99_s"] == held
    assert "checks held over 2 runs" in text


def test_the_saturation_search_allows_a_slow_last_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Five requests of one timestamp, the last a 60k-token prompt: every speed-up is the
    same run, so round robin keeps up at every probe (the drain allowance was the
    unloaded E2E p99, below that prompt's own time: every probe failed and x0.25 came
    out as found)."""
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 512, "output_length": 16, "hash_ids": [i]}
             for i in range(4)]
    lines.append({"timestamp": 0, "input_length": 60_000, "output_length": 16,
                  "hash_ids": list(range(100, 100 + 118))})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["simulate", "--trace", str(trace), "--find-saturation", "--policies",
            "round_robin", "--no-progress"]
    assert main(argv) == 2
    assert "keeps up at every speed-up probed" in capsys.readouterr().err


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


def test_an_empty_prompt_in_a_trace_is_refused_at_load_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [(0, 600, [1, 2]), (10, 0, [])]
    trace.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": 5, "hash_ids": ids}) + "\n"
        for t, n, ids in rows
    ))
    assert main(["simulate", "--trace", str(trace), "--policies", "kvgate", "--no-progress"]) == 2
    assert f"{trace}:2: 'input_length' must be >= 1, got 0" in capsys.readouterr().err


def test_an_empty_trace_is_an_error_not_an_empty_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["simulate", "--trace", str(empty), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "the trace holds no requests" in captured.err and "policy" not in captured.out


def test_policy_params_reach_only_their_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--policy-param sets one policy's knob; the report records it, and it changes that
    policy's run (here: kvgate with its cache bonus and affinity slack off spreads load
    like least-loaded)."""
    base = ["simulate", "--workload", "gsp", "--limit", "200", "--nodes", "4", "--no-progress"]
    runs = {}
    for label, extra in (
        ("default", []),
        (
            "no_cache",
            [
                *("--policy-param", "kvgate.cache_gain=0"),
                *("--policy-param", "kvgate.affinity_slack_s=0"),
                *("--policy-param", "kvgate.form=ttft"),
            ],
        ),
    ):
        out = tmp_path / f"{label}.json"
        code = main([*base, "--policies", "kvgate,round_robin", *extra, "--json", str(out)])
        assert code == 0
        runs[label] = json.loads(out.read_text())
    assert "policy_params" not in runs["default"]
    assert runs["no_cache"]["policy_params"] == {
        "kvgate": {"affinity_slack_s": 0, "cache_gain": 0, "form": "ttft"}
    }
    k0, k1 = runs["default"]["policies"]["kvgate"], runs["no_cache"]["policies"]["kvgate"]
    assert k1["hit_ratio"] < k0["hit_ratio"]
    rr0, rr1 = (
        runs["default"]["policies"]["round_robin"],
        runs["no_cache"]["policies"]["round_robin"],
    )
    assert rr0["hit_ratio"] == rr1["hit_ratio"] and rr0["ttft_p99_s"] == rr1["ttft_p99_s"]
    capsys.readouterr()


@pytest.mark.parametrize(
    "item, message",
    [
        ("kvgate", "expected POLICY.NAME=VALUE"),
        ("kvgate.nope=1", "unexpected keyword argument 'nope'"),
        ("nosuch.x=1", "unknown routing policy 'nosuch'"),
        ("kvgate.epsilon=2", "epsilon must be in [0, 1]"),
        # the report records its parameters, and JSON has no Infinity
        ("kvgate.affinity_slack_s=inf", "the value must be a finite number"),
        # a policy the run leaves out: recorded in the settings and never used
        ("dynamo_cost.overlap_weight=2", "dynamo_cost, which --policies does not run"),
    ],
)
def test_bad_policy_params_fail_before_simulating(
    item: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--workload", "gsp", "--find-saturation", "--policies", "kvgate,random"]
    code = main([*argv, "--policy-param", item])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "simulating" not in err


def test_closed_loop_runs_sessions_on_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--closed-loop sends an agent's next step on the previous answer; the saturation
    search stays on the open-loop plan, so both runs share one speed-up."""
    reports = []
    for extra in ([], ["--closed-loop"]):
        out = tmp_path / f"r{len(reports)}.json"
        argv = ["simulate", "--workload", "agent", "--limit", "80", "--nodes", "2"]
        argv += ["--policies", "round_robin", "--find-saturation", "--at-saturation", "0.9"]
        assert main([*argv, *extra, "--no-progress", "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    opened, closed = reports
    assert opened["round_robin_saturation_speedup"] == closed["round_robin_saturation_speedup"]
    o, c = (r["runs"]["0.9"]["policies"]["round_robin"] for r in reports)
    assert o["completed"] == c["completed"] == 80
    assert c["span_s"] > o["span_s"]  # each step waits for the answer before it
    assert c["ttft_p99_s"] < o["ttft_p99_s"]  # and no longer queues behind its own task
    capsys.readouterr()
    bad = ["simulate", "--workload", "gsp", "--closed-loop", "--limit", "5", "--no-progress"]
    assert main(bad) == 2
    assert "--closed-loop applies to the session workloads" in capsys.readouterr().err


def test_help_gives_every_option_a_default_and_lists_profiles_and_scenarios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvgate.engine.profiles import PROFILES
    from kvgate.sim.scenarios import SCENARIOS, describe

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's lines
    text = text.split("options:", 1)[1]  # past the usage lines
    for option, default in (
        ("--nodes NODES", "(default 8)"),
        ("--gateways GATEWAYS", "(default 1)"),
        ("--index-mode {approximate,precise}", "(default approximate)"),
        ("--seed SEED", "(default 0)"),
        ("--scenario {none,", "default none)"),
        ("--profile {" + ",".join(sorted(PROFILES)) + "}", "(default a100-8b)"),
    ):
        assert option in text and default in text.split(option, 1)[1].split(" --", 1)[0]
    for name in SCENARIOS:
        assert f"{name}: {describe(name)}" in text


def test_bad_profile_is_a_usage_error_before_simulating(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--workload", "gsp", "--limit", "5", "--profile", "b200-8b"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --profile: invalid choice: 'b200-8b'" in err and "simulating" not in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--nodes", "0", "argument --nodes: must be >= 1, got 0"),
        ("--gateways", "0", "argument --gateways: must be >= 1, got 0"),
        ("--limit", "0", "argument --limit: must be >= 1, got 0"),
        ("--cache-blocks", "0", "argument --cache-blocks: must be >= 1, got 0"),
        ("--budget", "0", "argument --budget: must be >= 1, got 0"),
        ("--speedup", "0", "argument --speedup: must be a finite number > 0, got 0"),
        ("--rate", "nan", "argument --rate: must be a finite number > 0, got nan"),
        ("--slo-ttft", "0", "argument --slo-ttft: must be a finite number > 0, got 0"),
        ("--at-saturation", "0.8,x", "argument --at-saturation: 'x' is not a number"),
        ("--at-saturation", ",", "argument --at-saturation: expected comma-separated numbers"),
        # each fraction names its run (runs.0.8): two that print alike ran twice, kept one
        ("--at-saturation", "0.8,0.8000001", "fractions must differ at 6 significant digits"),
    ],
)
def test_bad_numbers_are_usage_errors_before_simulating(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--workload", "gsp", "--limit", "5", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "simulating" not in err and "Traceback" not in err


def test_unwritable_outputs_fail_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--workload", "gsp", "--limit", "5", "--no-progress"]
    cases = [
        (["--json", str(tmp_path / "missing" / "r.json")], "does not exist"),
        (["--json", str(tmp_path)], "is a folder, not a file"),
        (["--plot", str(tmp_path / "r.txt")], "must end in .png or .svg or .pdf"),
        # a folder that exists but takes no file: found by trying, before the run
        (["--json", "/proc/kvgate-report.json"], "cannot be written"),
    ]
    for extra, message in cases:
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "simulating" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_plot_without_matplotlib_fails_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    argv = ["simulate", "--workload", "gsp", "--limit", "5", "--no-progress"]
    assert main([*argv, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "simulating" not in err


def test_unknown_policy_fails_before_the_saturation_search(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--workload", "gsp", "--find-saturation", "--policies", "kvgate,nope"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown policies ['nope']" in err and "simulating" not in err


def test_scenario_prints_its_name_once_and_its_pass_criteria(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--workload", "chat", "--limit", "30", "--nodes", "2", "--no-progress"]
    argv += ["--policies", "kvgate,round_robin", "--scenario", "p2_flood", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "== scenario p2_flood ==" in text and "p2_flood: p2_flood" not in text
    rep = json.loads(out.read_text())
    for policy in ("kvgate", "round_robin"):
        check = rep["criteria"][policy]["checks"]["p0_ttft_p99_s"]
        p0 = rep["variants"]["p2_flood"]["policies"][policy]["by_priority"]["P0"]
        assert check["value"] == p0["ttft_p99_s"] and check["threshold"] == 5.0
        mark = "ok  " if check["ok"] else "FAIL"
        assert f"  {mark} p0_ttft_p99_s " in text
        assert f"p2_flood pass criteria, {policy}: " in text
    # a variant's report has a single run's keys, its speed-up too
    variant = rep["variants"]["p2_flood"]
    assert variant["speedup"] == rep["speedup"] == 1.0
    # every class is there, one without requests too (p2_flood sends no P1)
    row = variant["policies"]["kvgate"]
    assert list(row["by_priority"]) == ["P0", "P1", "P2"]
    assert row["by_priority"]["P1"]["requests"] == 0
    assert row["by_priority"]["P1"]["ttft_p99_s"] is None


WALL_CLOCK_KEYS = ("wall_s", "sim_requests_per_wall_s")  # the README names these


def _without_wall_clock(node: object) -> object:
    if isinstance(node, dict):
        return {k: _without_wall_clock(v) for k, v in node.items() if k not in WALL_CLOCK_KEYS}
    if isinstance(node, list):
        return [_without_wall_clock(v) for v in node]
    return node


@pytest.mark.parametrize("extra", [[], ["--scenario", "tenant_flood"]])
def test_same_seed_same_report_but_the_wall_clock_fields(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--workload", "chat", "--limit", "30", "--nodes", "2", "--seed", "4"]
    argv += ["--policies", "kvgate,round_robin", "--no-progress", *extra]
    reports = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main([*argv, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert _without_wall_clock(reports[0]) == _without_wall_clock(reports[1])


def _trace_args(path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    return parser.parse_args(["simulate", "--trace", str(path), *extra])


def test_bucket_jitter_replays_the_trace_differently_per_seed(tmp_path: Path) -> None:
    """--bucket jitter draws a bucket's offsets from --seed: the same seed replays the same
    arrivals, another seed others, each within its bucket; spread ignores the seed."""
    path = tmp_path / "t.jsonl"
    rows = [(0, [1, 2]), (0, [1, 3]), (0, [4]), (3000, [5]), (3000, [1, 6])]
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": ts,
                    "input_length": 512 * len(ids),
                    "output_length": 4,
                    "hash_ids": ids,
                }
            )
            + "\n"
            for ts, ids in rows
        )
    )

    def arrivals(*extra: str) -> list[float]:
        w = _load_workload(_trace_args(path, *extra), 1.0)
        return [r.arrival_s for r in w.requests]

    even = arrivals("--seed", "1")
    assert even == arrivals("--seed", "2") == pytest.approx([0, 1, 2, 3, 4.5])
    one = arrivals("--bucket", "jitter", "--seed", "1")
    two = arrivals("--bucket", "jitter", "--seed", "2")
    assert one == arrivals("--bucket", "jitter", "--seed", "1")
    assert one != two and one != even
    for ts in (one, two):
        assert all(0 <= t < 3 for t in ts[:3]) and all(3 <= t < 6 for t in ts[3:])
        assert ts == sorted(ts)


def test_the_json_report_records_how_it_was_run(tmp_path: Path) -> None:
    """A saved report carries its settings: with them the run can be repeated exactly."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": ts, "input_length": 1024, "output_length": 4, "hash_ids": ids})
            + "\n"
            for ts, ids in [(0, [1, 2]), (0, [1, 3]), (1000, [1, 2]), (2000, [4, 5])]
        )
    )
    first, again = tmp_path / "a.json", tmp_path / "b.json"
    argv = ["simulate", "--trace", str(path), "--bucket", "jitter", "--seed", "7", "--nodes", "2"]
    argv += ["--policies", "kvgate,round_robin", "--policy-param", "kvgate.epsilon=0.5"]
    assert main([*argv, "--no-progress", "--json", str(first)]) == 0
    settings = json.loads(first.read_text())["settings"]
    assert settings["trace"] == str(path) and settings["workload"] is None
    assert (settings["bucket"], settings["seed"], settings["nodes"]) == ("jitter", 7, 2)
    assert settings["policies"] == ["kvgate", "round_robin"]
    assert settings["policy_params"] == {"kvgate": {"epsilon": 0.5}}
    assert settings["budget"] == 2 * settings["node_capacity"] and settings["speedup"] == 1.0
    # the settings, read back as arguments, give the same report
    again_argv = ["simulate", "--trace", settings["trace"], "--bucket", settings["bucket"]]
    again_argv += ["--seed", str(settings["seed"]), "--nodes", str(settings["nodes"])]
    again_argv += ["--policies", ",".join(settings["policies"])]
    again_argv += ["--policy-param", "kvgate.epsilon=0.5", "--no-progress", "--json", str(again)]
    assert main(again_argv) == 0
    strip = ("wall_s", "sim_requests_per_wall_s")

    def stable(text: str) -> object:
        rep = json.loads(text)
        rep.pop("wall_s")
        for row in rep["policies"].values():
            for key in strip:
                row.pop(key, None)
        return rep

    assert stable(first.read_text()) == stable(again.read_text())


def test_a_synthetic_report_records_the_effective_rate(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--workload", "agent", "--limit", "20", "--nodes", "2", "--closed-loop"]
    assert main([*argv, "--policies", "round_robin", "--no-progress", "--json", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["workload"], settings["rate"], settings["closed_loop"]) == ("agent", 0.2, True)
    assert settings["trace"] is None and settings["bucket"] is None


def test_a_simulated_fleet_says_how_many_gateways_share_the_budget(tmp_path: Path) -> None:
    """As README asks of a real fleet: before its first grant, each of G gateways admits
    budget / G, not the whole budget."""
    for gateways in (1, 3):
        args = _trace_args(tmp_path / "t.jsonl", "--gateways", str(gateways))
        lease = _config(args).controller.admission.lease
        assert lease.expected_gateways == gateways
