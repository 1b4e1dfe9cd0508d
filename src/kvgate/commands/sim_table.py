"""`kvgate simulate`'s printed output: the comparison table of one run, and a whole
report (saturation fractions, replays, scenario variants) with the checks under it."""

from __future__ import annotations

from typing import Any

from kvgate.commands.sim_replays import format_point
from kvgate.sim.ordering import format_ordering, format_tally
from kvgate.sim.scenario_checks import format_criteria

__all__ = ["COLUMNS", "format_table", "print_report"]

COLUMNS = (
    ("policy", "{:<18}"),
    ("completed", "{:>9}"),
    ("rejected", "{:>8}"),
    ("failed", "{:>6}"),
    ("ttft_p50_s", "{:>10.3f}"),
    ("ttft_p99_s", "{:>10.3f}"),
    ("ttft_mean_s", "{:>11.3f}"),
    ("tpot_p99_s", "{:>10.4f}"),
    ("goodput_rps", "{:>11.3f}"),
    ("goodput_strict_rps", "{:>8.3f}"),
    ("hit_ratio", "{:>9.4f}"),
    ("load_max_over_mean", "{:>8.3f}"),
    ("attempts_per_request", "{:>8.3f}"),
)


def format_table(report: dict[str, Any]) -> str:
    heads = [
        "policy",
        "done",
        "rejected",
        "failed",
        "ttft_p50",
        "ttft_p99",
        "ttft_mean",
        "tpot_p99",
        "goodput",
        "strict",
        "hit",
        "ld_max/mean",
        "attempts",
    ]
    widths = [18, 9, 8, 6, 10, 10, 11, 10, 11, 8, 9, 8, 8]
    lines = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(heads, widths, strict=True))
        )
    ]
    for name, rep in report["policies"].items():
        cells = []
        for (key, fmt), w in zip(COLUMNS, widths, strict=True):
            value = name if key == "policy" else rep[key]
            # a latency with no completed request behind it is None: shown as "-"
            cells.append("-".rjust(w) if value is None else fmt.format(value))
        lines.append("  ".join(cells))
    speeds = ", ".join(
        f"{name} {rep['sim_requests_per_wall_s']:.0f}" for name, rep in report["policies"].items()
    )
    lines.append(f"requests simulated per wall second: {speeds}")
    b = report["bounds"]
    lines.append(
        f"bounds: ideal hit ratio {b['ideal_hit_ratio']:.4f}, pooled LRU "
        f"({b['pooled_lru_capacity_blocks']} blocks) {b['pooled_lru_hit_ratio']:.4f}; "
        f"{report['requests']} requests, wall {report['wall_s']} s"
    )
    if b.get("balanced_hit_ratio") is not None:
        lines.append(
            f"balanced bound: the most any policy with load max/mean <= "
            f"{b['balanced_load_limit']} ({b['balanced_busy_nodes']} or more of "
            f"{report['nodes']} nodes busy) can hit: {b['balanced_hit_ratio']:.4f}"
        )
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    """Print a report as ``kvgate simulate`` does: the table of each run, with the
    ordering checks under it, or a scenario's criteria, or the means over replays."""
    if "round_robin_saturation_speedup" in report:
        how = "found" if report.get("saturation_found", True) else "given"
        print(
            f"round robin saturation speed-up: x{report['round_robin_saturation_speedup']} "
            f"({how})"
        )
        for frac, rep in report["runs"].items():
            print(f"\n== {frac} of saturation (speed-up x{rep['speedup']:.3f}) ==")
            print_report(rep)
        if "ordering_tally" in report:
            print("\n" + format_tally(report["ordering_tally"]))
        return
    if "replays" in report:
        print(format_point(report))
        return
    if "variants" in report:
        name = report["scenario"]
        for label, rep in report["variants"].items():
            # a one-run scenario's only variant is named after it: say the name once
            print(
                f"\n== scenario {name} ==" if label == name else f"\n== scenario {name}: {label} =="
            )
            print(format_table(rep))
        if "criteria" in report:
            print(format_criteria(name, report["criteria"]))
        return
    print(format_table(report))
    if "ordering" in report:
        print(format_ordering(report["ordering"]))
