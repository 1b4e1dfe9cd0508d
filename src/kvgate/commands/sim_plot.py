"""Draw a simulation report: TTFT distributions (CDF) and hit ratios per policy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _flatten(report: dict[str, Any], label: str = "") -> dict[str, dict[str, Any]]:
    """Every comparison (a report with ``policies``) in ``report``, by a label saying
    where it sits: a scenario's variants, the runs at fractions of saturation, their
    replays, or a mix."""
    if "policies" in report:
        return {label: report}
    out: dict[str, dict[str, Any]] = {}
    if "variants" in report:
        for name, rep in report["variants"].items():
            out.update(_flatten(rep, f"{label} {name}".strip()))
    if "runs" in report:
        for frac, rep in report["runs"].items():
            out.update(_flatten(rep, f"{label} x{frac} sat".strip()))
    if "replays" in report:  # --replays: each replay, by its seed
        for seed, rep in report["replays"].items():
            out.update(_flatten(rep, f"{label} seed {seed}".strip()))
    return out


def _log_seconds_axis(ax: Any) -> None:
    """Label the log x axis of seconds with plain numbers (0.05, 0.1, 0.2, ...): on a
    range of the plotted data under a few decades matplotlib labels the minor ticks too,
    in 2x10^-2 form, and the labels run into each other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = ax.dataLim.intervalx
    decades = math.log10(high / low) if 0 < low < high else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 3 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_report(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw_report(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_report(report: dict[str, Any]) -> Any:
    """The figure of ``report`` (a matplotlib Figure; the caller saves and closes it):
    per comparison, a TTFT CDF per policy and the hit ratios against the bounds."""
    import matplotlib.pyplot as plt

    runs = _flatten(report)
    if not runs:
        raise ValueError("the report holds no run to plot")
    fig, axes = plt.subplots(len(runs) or 1, 2, figsize=(12, 4 * max(1, len(runs))), squeeze=False)
    for row, (label, rep) in enumerate(runs.items()):
        ax_t, ax_h = axes[row]
        names = list(rep["policies"])
        drawn = 0
        for name in names:
            ttfts = sorted(rep["policies"][name].get("ttft_samples_s", []))
            if ttfts:
                ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ax_t.plot(ttfts, ys, label=name)
                drawn += 1
        ax_t.set_xlabel("TTFT (s)")
        ax_t.set_ylabel("CDF")
        ax_t.set_title(f"TTFT {label}".strip())
        if drawn:
            ax_t.set_xscale("log")
            _log_seconds_axis(ax_t)
            ax_t.legend(fontsize=7)
        else:  # every request refused or failed: say so rather than draw an empty legend
            ax_t.text(0.5, 0.5, "no request completed", ha="center", va="center",
                      transform=ax_t.transAxes)
        # a policy with no completed request has no hit ratio (null): no bar
        hits = [rep["policies"][n]["hit_ratio"] or 0.0 for n in names]
        ax_h.bar(range(len(names)), hits)
        b = rep["bounds"]
        ax_h.axhline(b["ideal_hit_ratio"], linestyle="--", color="k", label="ideal")
        ax_h.axhline(b["pooled_lru_hit_ratio"], linestyle=":", color="r", label="pooled LRU")
        if b.get("balanced_hit_ratio") is not None:
            ax_h.axhline(
                b["balanced_hit_ratio"], linestyle="-.", color="g", label="balanced bound"
            )
        ax_h.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax_h.set_ylabel("block hit ratio")
        # headroom above the bars and the bounds for the legend, so it hides no bar
        top = max([*hits, b["ideal_hit_ratio"], b["pooled_lru_hit_ratio"]], default=0.0)
        ax_h.set_ylim(0.0, max(top, 0.01) * 1.3)
        ax_h.legend(fontsize=7, loc="upper right", ncol=3)
    fig.tight_layout()
    return fig
