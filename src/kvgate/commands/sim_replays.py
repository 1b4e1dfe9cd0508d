"""``kvgate simulate --replays N``: each point of a comparison run N times, summarised.

Why: one run of a long-context trace is one draw. On the conversation trace a policy's
TTFT p99 moves by about 0.1 s and its hit ratio by about 0.001 from one replay of
the same arrivals to the next (the requests sharing a bucketed timestamp placed
differently), as much as the margins between the best policies, so whether a check
holds in one run says little. N replays give each policy's means and say in how many
replays each check held, and each check against another policy gets the paired
difference (ours less theirs, replay by replay) with a 95 % interval
(:mod:`kvgate.sim.paired`): whether the margin is more than the replays' noise.

Replay r runs with seed ``--seed`` + r. A synthetic workload draws a new workload from
each seed. A trace's timestamps are fixed, so replay 0 is the run as asked
(``--bucket spread`` or ``jitter``) and the others place each bucket's requests at
random offsets drawn from their seed (``--bucket jitter``). ``--bucket burst`` has no
randomness to replay and is refused. Pure apart from the runs it is handed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from kvgate.sim.ordering import (
    HIGHER_IS_BETTER,
    decimals,
    format_ordering,
    format_tally,
    ordering,
    tally,
)
from kvgate.sim.paired import paired_difference, verdict

__all__ = [
    "MEAN_KEYS",
    "check_replay_args",
    "format_point",
    "orderings",
    "replay_args",
    "run_point",
]

# the columns of the means table: report key, header, format
MEAN_KEYS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50_s", "ttft_p50", "{:>8.3f}"),
    ("ttft_p99_s", "ttft_p99", "{:>8.3f}"),
    ("ttft_mean_s", "ttft_mean", "{:>9.3f}"),
    ("tpot_p99_s", "tpot_p99", "{:>8.4f}"),
    ("goodput_rps", "goodput", "{:>8.3f}"),
    ("goodput_strict_rps", "strict", "{:>8.3f}"),
    ("hit_ratio", "hit", "{:>7.4f}"),
    ("load_max_over_mean", "ld_max/mean", "{:>11.3f}"),
)
# the bounds averaged for the checks on the means (a jittered replay may reorder requests)
_BOUND_KEYS = ("ideal_hit_ratio", "pooled_lru_hit_ratio", "balanced_hit_ratio")

RunOnce = Callable[[argparse.Namespace, float, str], dict[str, Any]]


def check_replay_args(args: argparse.Namespace) -> None:
    """What ``--replays`` cannot do (``--find-saturation`` alone: the command's own
    check). Raises ValueError."""
    if args.replays == 1:
        return
    if args.scenario != "none":
        raise ValueError(
            "--replays repeats comparisons; a scenario checks its criteria run by run: "
            "run the scenario once per --seed instead"
        )
    if args.trace is not None and args.bucket == "burst":
        raise ValueError(
            "--replays with --bucket burst would run the same replay N times (a burst "
            "has no randomness): use --bucket spread or jitter"
        )


def replay_args(args: argparse.Namespace, r: int) -> argparse.Namespace:
    """The arguments of replay ``r``: seed + r, and a trace's buckets jittered after the
    first replay."""
    out = argparse.Namespace(**vars(args))
    out.seed = args.seed + r
    if r and args.trace is not None:
        out.bucket = "jitter"
    return out


def run_point(args: argparse.Namespace, speedup: float, run_once: RunOnce) -> dict[str, Any]:
    """``args.replays`` runs of one comparison at ``speedup`` (``run_once(args, speedup,
    label)`` makes one), with each policy's means and the checks held per replay."""
    runs: dict[str, dict[str, Any]] = {}
    for r in range(args.replays):
        a = replay_args(args, r)
        runs[str(a.seed)] = run_once(a, speedup, f", replay {r + 1}/{args.replays}")
    point: dict[str, Any] = {"speedup": speedup, "replays": runs, "mean": _means(runs)}
    checked = orderings(point)
    if checked:
        point["ordering_tally"] = tally(checked)
        on_means = ordering(
            {"policies": point["mean"], "bounds": _mean_bounds(runs)}, checked[0]["policy"]
        )
        if on_means is not None:
            point["ordering_of_means"] = on_means
            point["paired_differences"] = _paired(runs, on_means)
    return point


def _paired(runs: Mapping[str, Mapping[str, Any]], result: Mapping[str, Any]) -> dict[str, Any]:
    """Per check against another policy (the one the check on the means names): the
    checked policy's value less that policy's, replay by replay, summarised."""
    reps = list(runs.values())
    policy = result["policy"]
    out: dict[str, Any] = {}
    for key, c in result["checks"].items():
        if "against" not in c:
            continue
        diff = paired_difference(
            [rep["policies"][policy][key] for rep in reps],
            [rep["policies"][c["against"]][key] for rep in reps],
        )
        if diff is not None:
            said = verdict(diff, key in HIGHER_IS_BETTER)
            out[key] = {"against": c["against"], **diff, "verdict": said}
    return out


def orderings(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The check results of a comparison: its own, or each of its replays'."""
    runs = report["replays"].values() if "replays" in report else [report]
    return [rep["ordering"] for rep in runs if "ordering" in rep]


def _mean(values: list[Any]) -> float | None:
    """The mean, or None when a run measured nothing (a latency with no completion)."""
    if not values or any(v is None for v in values):
        return None
    return round(float(sum(values)) / len(values), 6)


def _means(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    reps = list(runs.values())
    names = list(reps[0]["policies"])
    return {
        name: {key: _mean([rep["policies"][name][key] for rep in reps]) for key, _, _ in MEAN_KEYS}
        for name in names
    }


def _mean_bounds(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    reps = list(runs.values())
    return {key: _mean([rep["bounds"].get(key) for rep in reps]) for key in _BOUND_KEYS}


def format_point(point: Mapping[str, Any]) -> str:
    """The means table, then what held: replay by replay, and on the means."""
    runs = point["replays"]
    seeds = list(runs)
    heads = "  ".join(head.rjust(len(fmt.format(0.0))) for _, head, fmt in MEAN_KEYS)
    lines = [
        f"means over {len(seeds)} replays (seeds {seeds[0]}-{seeds[-1]}):",
        f"{'policy':<18}  {heads}",
    ]
    for name, row in point["mean"].items():
        cells = [
            "-".rjust(len(fmt.format(0.0))) if row[key] is None else fmt.format(row[key])
            for key, _, fmt in MEAN_KEYS
        ]
        lines.append(f"{name:<18}  " + "  ".join(cells))
    for seed, rep in runs.items():
        if "ordering" in rep:
            lines.append(f"seed {seed}: {_failed_checks(rep['ordering'])}")
    if "ordering_tally" in point:
        t = point["ordering_tally"]
        lines.append(format_tally(t) + f"; all checks in {t['all']} of {t['runs']}")
    if "ordering_of_means" in point:
        lines.append("on the means: " + format_ordering(point["ordering_of_means"]))
    if point.get("paired_differences"):
        lines.extend(_format_paired(point))
    return "\n".join(lines)


def _format_paired(point: Mapping[str, Any]) -> list[str]:
    """A line per check: the mean paired difference, its interval and what it says."""
    policy = point["ordering_of_means"]["policy"]
    diffs = point["paired_differences"]
    n = next(iter(diffs.values()))["n"]
    lines = [
        f"paired over {n} replays, {policy} less the policy each check names "
        "(mean, 95 % interval):"
    ]
    for key, d in diffs.items():
        digits = decimals(key)
        lo, hi = d["ci95"]
        lines.append(
            f"  {key:<20} {d['mean']:>+9.{digits}f}  ({lo:+.{digits}f} .. {hi:+.{digits}f})"
            f"  against {d['against']}: {d['verdict']}"
        )
    return lines


def _failed_checks(result: Mapping[str, Any]) -> str:
    """One line: the checks held, or those that failed and against whom."""
    failed = [
        f"{key} ({c['against']})" if "against" in c else key
        for key, c in result["checks"].items()
        if not c["ok"]
    ]
    return "every check holds" if not failed else "fails " + ", ".join(failed)
