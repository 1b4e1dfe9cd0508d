"""`kvgate simulate --arrivals/--burstiness/--tenants/--priorities`: the issue's bursty
arrivals and tenants and priority classes by share, from the command line."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.commands.simulate import _load_workload
from kvgate.commands.simulate_args import add_simulate_parser
from kvgate.sim.workload import Workload

CHAT = ["--workload", "chat", "--limit", "300"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    return parser.parse_args(["simulate", *argv])


def _load(*argv: str) -> Workload:
    return _load_workload(_args(*argv), 1.0)


def _trace(path: Path, n: int = 400) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": 100 * i, "input_length": 1024, "output_length": 4,
                 "hash_ids": [i % 7, 1000 + i]}
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_classes_are_drawn_by_share_and_a_session_keeps_its_own() -> None:
    w = _load(*CHAT, "--tenants", "alpha=3,beta=1", "--priorities", "P0=0.2,P1=0.5,P2=0.3")
    plain = _load(*CHAT)
    # the same requests at the same times: only the classes were drawn
    assert [(r.request_id, r.arrival_s, r.block_ids) for r in w.requests] == [
        (r.request_id, r.arrival_s, r.block_ids) for r in plain.requests
    ]
    sessions: dict[str | None, set[tuple[str, int]]] = {}
    for r in w.requests:
        sessions.setdefault(r.session, set()).add((r.tenant, r.priority))
    assert all(len(classes) == 1 for classes in sessions.values())
    per_session = Counter(next(iter(c)) for c in sessions.values())
    tenants = Counter(t for t, _ in per_session.elements())
    priorities = Counter(p for _, p in per_session.elements())
    assert set(tenants) == {"alpha", "beta"} and tenants["alpha"] > 2 * tenants["beta"]
    assert set(priorities) == {0, 1, 2} and priorities[1] > max(priorities[0], priorities[2])
    # 0=, 1=, 2= spell the same classes; a class left out gets none
    assert _load(*CHAT, "--priorities", "0=0.2,1=0.5,2=0.3") == _load(
        *CHAT, "--priorities", "P0=0.2,P1=0.5,P2=0.3"
    )
    assert {r.priority for r in _load(*CHAT, "--priorities", "p0=1,P2=1").requests} == {0, 2}


def test_trace_requests_draw_their_classes_one_by_one(tmp_path: Path) -> None:
    trace = str(_trace(tmp_path / "t.jsonl"))
    w = _load("--trace", trace, "--tenants", "a=1,b=1", "--priorities", "P0=1,P1=1")
    assert all(r.session is None for r in w.requests)
    tenants = Counter(r.tenant for r in w.requests)
    priorities = Counter(r.priority for r in w.requests)
    assert set(tenants) == {"a", "b"} and min(tenants.values()) > 150
    assert set(priorities) == {0, 1} and min(priorities.values()) > 150
    plain = _load("--trace", trace)
    assert [r.arrival_s for r in w.requests] == [r.arrival_s for r in plain.requests]


def test_without_the_options_the_workload_is_unchanged_and_the_seed_decides(
    tmp_path: Path,
) -> None:
    """The class draw has a generator of its own: runs without the options draw exactly
    what they drew before, and so do the workload's own draws with them."""
    assert _load(*CHAT) == _load(*CHAT, "--arrivals", "poisson")
    one = _load(*CHAT, "--priorities", "P0=1,P1=1", "--seed", "1")
    two = _load(*CHAT, "--priorities", "P0=1,P1=1", "--seed", "2")
    assert [r.priority for r in one.requests] != [r.priority for r in two.requests]
    assert one == _load(*CHAT, "--priorities", "P0=1,P1=1", "--seed", "1")


def test_bursty_arrivals_keep_the_rate_and_bunch_up() -> None:
    """Bursty session starts: the same mean rate, gaps far more variable than Poisson's."""
    argv = ["--workload", "gsp", "--limit", "1000"]
    poisson, bursty = _load(*argv), _load(*argv, "--arrivals", "bursty", "--burstiness", "8")

    def gaps(w: Workload) -> list[float]:
        times = [r.arrival_s for r in w.requests]
        return [b - a for a, b in pairwise(times)]

    def cv2(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs) / mean**2

    assert 0.5 < bursty.duration_s / poisson.duration_s < 2.0
    assert cv2(gaps(poisson)) < 1.5 < 4 < cv2(gaps(bursty))


def test_the_report_records_the_options_and_shows_the_classes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", *CHAT, "--nodes", "2", "--policies", "kvgate", "--no-progress"]
    argv += ["--arrivals", "bursty", "--burstiness", "3", "--tenants", "alpha=3,beta=1"]
    argv += ["--priorities", "0=0.2,P1=0.8", "--json", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    s = rep["settings"]
    assert (s["arrivals"], s["burstiness"]) == ("bursty", 3.0)
    assert s["tenants"] == {"alpha": 3.0, "beta": 1.0}
    assert s["priorities"] == {"P0": 0.2, "P1": 0.8}
    row = rep["policies"]["kvgate"]
    assert set(row["by_tenant"]) == {"alpha", "beta"}
    assert {p for p, v in row["by_priority"].items() if v["requests"]} == {"P0", "P1"}
    assert sum(t["requests"] for t in row["by_tenant"].values()) == rep["requests"]
    plain = tmp_path / "p.json"
    assert main(["simulate", *CHAT, "--nodes", "2", "--policies", "kvgate", "--no-progress",
                 "--json", str(plain)]) == 0
    s = json.loads(plain.read_text())["settings"]
    assert (s["arrivals"], s["burstiness"], s["tenants"], s["priorities"]) == (
        "poisson", None, None, None
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tenants", "a=1,a=2"], "argument --tenants: 'a' is given twice"),
        (["--tenants", "alpha"], "argument --tenants: 'alpha': expected NAME=SHARE,..."),
        (["--tenants", "a=x"], "argument --tenants: 'a=x': the share 'x' is not a number"),
        (["--tenants", "a=-1"], "a share must be a finite number >= 0"),
        (["--tenants", "a=0,b=0"], "the shares are all 0"),
        # each finite, their sum not: every request went to one tenant
        (["--tenants", "a=1e308,b=1e308"], "the shares add up past a float"),
        (["--tenants", ","], "argument --tenants: expected NAME=SHARE,..."),
        (["--priorities", "P3=1"], "'P3' is not a priority class: use P0, P1, P2 (or 0, 1, 2)"),
        (["--priorities", "P0=1,0=1"], "P0 is given twice"),
        (["--priorities", "P1=nan"], "a share must be a finite number >= 0"),
        (["--burstiness", "1"], "argument --burstiness: must be a peak-to-mean ratio > 1"),
        (["--burstiness", "inf"], "must be a finite number > 0, got inf"),
        (["--arrivals", "gamma"], "argument --arrivals: invalid choice: 'gamma'"),
    ],
)
def test_bad_values_are_one_line_usage_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--workload", "gsp", "--limit", "5", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and "simulating" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--burstiness", "3"], "--burstiness sets the bursty arrivals' peak-to-mean ratio: "
         "add --arrivals bursty"),
        (["--arrivals", "bursty"], "--arrivals bursty needs --burstiness B"),
        (["--priorities", "P0=1", "--scenario", "p2_flood"],
         "--priorities: the p2_flood scenario assigns the priorities itself"),
        (["--priorities", "P0=1", "--scenario", "coordinator_down"],
         "the coordinator_down scenario assigns the priorities itself"),
        (["--tenants", "a=1", "--scenario", "tenant_flood"],
         "--tenants: the tenant_flood scenario assigns the tenants itself"),
    ],
)
def test_options_that_would_be_ignored_are_refused(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--workload", "gsp", "--limit", "5", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--arrivals", "poisson"], ["--burstiness", "2"]])
def test_a_trace_has_its_own_arrivals(
    option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace(tmp_path / "t.jsonl", n=3))
    assert main(["simulate", "--trace", trace, *option, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{option[0]} draws a synthetic workload's arrival times" in err
    assert "a trace has its own timestamps" in err and err.count("\n") == 1


def test_help_describes_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--arrivals {poisson,bursty}",
        "(default poisson;",
        "--burstiness B",
        "the peak-to-mean rate ratio, > 1",
        "--tenants NAME=SHARE,...",
        "alpha=3,beta=1",
        "--priorities P0=SHARE,P1=SHARE,P2=SHARE",
        "(default: every request P1)",
    ):
        assert needle in text, needle
