"""`kvgate simulate --replays N`: each comparison run N times, with each policy's
means and the checks held per replay; a replay is the very run `--seed` gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.cli import main
from kvgate.commands.sim_plot import _flatten
from kvgate.commands.sim_replays import _paired

SMALL = ["simulate", "--workload", "gsp", "--limit", "60", "--nodes", "3", "--no-progress"]
POLICIES = ["--policies", "kvgate,round_robin,sglang_cache_aware"]
# the parts of a report the wall clock writes
_WALL = ("wall_s", "sim_requests_per_wall_s")


def _stable(rep: dict[str, Any]) -> dict[str, Any]:
    rep = json.loads(json.dumps(rep))
    rep.pop("wall_s", None)
    rep.pop("settings", None)
    for row in rep["policies"].values():
        for key in _WALL:
            row.pop(key, None)
    return rep


def _trace(path: Path) -> Path:
    rows = [(0, [1, 2]), (0, [1, 3]), (0, [4]), (0, [1, 2, 5]), (1000, [6]), (1000, [1, 3, 7])]
    rows += [(2000, [4, 8]), (2000, [1, 2, 5, 9]), (2000, [10])]
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": ts, "input_length": 512 * len(ids), "output_length": 8,
                 "hash_ids": ids}
            )
            + "\n"
            for ts, ids in rows
        )
    )  # fmt: skip
    return path


def test_replays_are_the_runs_their_seeds_give_and_the_means_are_theirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert main([*SMALL, *POLICIES, "--seed", "4", "--replays", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert list(rep["replays"]) == ["4", "5", "6"] and rep["settings"]["replays"] == 3
    # each replay is the run of its seed, bit for bit
    single = tmp_path / "one.json"
    assert main([*SMALL, *POLICIES, "--seed", "5", "--json", str(single)]) == 0
    assert _stable(rep["replays"]["5"]) == _stable(json.loads(single.read_text()))
    # the means are the replays' means
    runs = list(rep["replays"].values())
    for name in ("kvgate", "round_robin"):
        for key in ("ttft_p99_s", "ttft_mean_s", "goodput_rps", "hit_ratio"):
            want = sum(r["policies"][name][key] for r in runs) / 3
            assert rep["mean"][name][key] == pytest.approx(want, abs=1e-6)
    # what held, replay by replay, is counted from each replay's own checks
    tally = rep["ordering_tally"]
    assert tally["runs"] == 3
    for key in ("ttft_p99_s", "hit_ratio"):
        assert tally["held"][key] == sum(r["ordering"]["checks"][key]["ok"] for r in runs)
    assert tally["all"] == sum(r["ordering"]["holds"] for r in runs)
    # and the checks on the means read the means
    means = rep["ordering_of_means"]["checks"]
    assert means["ttft_mean_s"]["value"] == rep["mean"]["kvgate"]["ttft_mean_s"]
    assert means["hit_ratio"]["against"] == "sglang_cache_aware"
    # each check against a policy gets the paired difference with that policy, taken
    # replay by replay from the replays' own rows
    paired = rep["paired_differences"]
    assert set(paired) == {"ttft_p99_s", "ttft_mean_s", "goodput_rps", "hit_ratio"}
    for key, d in paired.items():
        rival = means[key]["against"]
        assert d["against"] == rival and d["n"] == 3
        diffs = [r["policies"]["kvgate"][key] - r["policies"][rival][key] for r in runs]
        assert d["mean"] == pytest.approx(sum(diffs) / 3, abs=1e-6)
        assert d["ci95"][0] <= d["mean"] <= d["ci95"][1]
        assert d["verdict"] in ("better", "worse", "within noise")
        assert f"against {rival}: {d['verdict']}" in text
    assert "paired over 3 replays, kvgate less the policy each check names" in text
    assert "means over 3 replays (seeds 4-6)" in text
    assert "seed 4: " in text and "seed 6: " in text and "on the means: kvgate" in text
    assert "checks held over 3 runs" in text


def test_a_trace_replays_its_buckets_jittered_after_the_first(tmp_path: Path) -> None:
    """Replay 0 is the run as asked (spread); replay 1 is --bucket jitter --seed 1."""
    trace = _trace(tmp_path / "t.jsonl")
    base = ["simulate", "--trace", str(trace), "--nodes", "2", *POLICIES, "--no-progress"]
    out, spread, jitter = tmp_path / "r.json", tmp_path / "s.json", tmp_path / "j.json"
    assert main([*base, "--replays", "2", "--json", str(out)]) == 0
    assert main([*base, "--json", str(spread)]) == 0
    assert main([*base, "--bucket", "jitter", "--seed", "1", "--json", str(jitter)]) == 0
    rep = json.loads(out.read_text())
    assert _stable(rep["replays"]["0"]) == _stable(json.loads(spread.read_text()))
    assert _stable(rep["replays"]["1"]) == _stable(json.loads(jitter.read_text()))


def test_replays_at_fractions_of_saturation_are_tallied_together(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [*SMALL, "--policies", "kvgate,least_loaded", "--saturation", "2"]
    assert main([*argv, "--at-saturation", "0.5,0.9", "--replays", "2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert list(rep["runs"]) == ["0.5", "0.9"]
    for frac, point in rep["runs"].items():
        assert point["speedup"] == pytest.approx(2 * float(frac))
        assert list(point["replays"]) == ["0", "1"]
    assert rep["ordering_tally"]["runs"] == 4  # two fractions x two replays
    # the plot finds every replay
    assert list(_flatten(rep)) == [
        "x0.5 sat seed 0", "x0.5 sat seed 1", "x0.9 sat seed 0", "x0.9 sat seed 1"
    ]  # fmt: skip


def test_one_replay_is_the_plain_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main([*SMALL, *POLICIES, "--replays", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert "policies" in rep and "replays" not in rep


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--replays", "2", "--scenario", "p2_flood"], "run the scenario once per --seed"),
        (["--replays", "2", "--find-saturation"], "add --at-saturation"),
    ],
)
def test_refused_before_any_run(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "simulating" not in captured.err
    assert "policy" not in captured.out


def test_no_replay_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--replays", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--replays" in err and "simulating" not in err and "Traceback" not in err


def test_a_burst_has_nothing_to_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    argv = ["simulate", "--trace", str(trace), "--bucket", "burst", "--replays", "2"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "use --bucket spread or jitter" in err and "simulating" not in err


def test_paired_verdicts_read_each_check_in_its_own_direction() -> None:
    # kvgate's hit ratio is steadily higher (better) and its TTFT mean steadily higher
    # (worse) than the policy each check names; its goodput moves both ways (noise)
    def rep(hit: float, mean: float, goodput: float) -> dict[str, Any]:
        row = {"hit_ratio": hit, "ttft_mean_s": mean, "goodput_rps": goodput}
        other = {"hit_ratio": 0.5, "ttft_mean_s": 1.0, "goodput_rps": 10.0}
        return {"policies": {"kvgate": row, "dynamo_cost": other}}

    runs = {
        "0": rep(0.61, 1.10, 10.5),
        "1": rep(0.62, 1.12, 9.5),
        "2": rep(0.60, 1.11, 10.2),
    }
    checks = {
        key: {"against": "dynamo_cost", "ok": True}
        for key in ("hit_ratio", "ttft_mean_s", "goodput_rps")
    }
    checks["load_max_over_mean"] = {"value": 1.0, "limit": 1.5, "ok": True}  # no rival
    paired = _paired(runs, {"policy": "kvgate", "checks": checks})
    assert set(paired) == {"hit_ratio", "ttft_mean_s", "goodput_rps"}
    assert paired["hit_ratio"]["verdict"] == "better"
    assert paired["ttft_mean_s"]["verdict"] == "worse"
    assert paired["goodput_rps"]["verdict"] == "within noise"
    assert paired["ttft_mean_s"]["mean"] == pytest.approx(0.11)
