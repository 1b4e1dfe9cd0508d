"""``--plot``'s drawing: what the axes say, read from the figure itself."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from kvgate.commands.sim_plot import _log_seconds_axis, draw_report  # noqa: E402


@pytest.mark.parametrize(
    ("low", "high", "labels"),
    [
        # under a few decades: 1, 2 and 5 of each, as plain numbers, minor ticks unlabelled
        (0.02, 0.45, ["0.02", "0.05", "0.1", "0.2"]),
        # wider: the decades alone, so the labels do not crowd
        (0.01, 90.0, ["0.01", "0.1", "1", "10"]),
    ],
)
def test_ttft_axis_labels_are_plain_seconds(low: float, high: float, labels: list[str]) -> None:
    fig, ax = plt.subplots()
    try:
        ax.plot([low, high], [0.0, 1.0])
        ax.set_xscale("log")
        _log_seconds_axis(ax)
        fig.canvas.draw()
        shown = [
            t.get_text()
            for t, x in zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
            if low <= x <= high
        ]
        assert shown == labels
        minor = [t.get_text() for t in ax.get_xticklabels(minor=True)]
        assert all(not text for text in minor)
    finally:
        plt.close(fig)


def test_the_hit_ratio_legend_hides_no_bar() -> None:
    """Bars as high as the bounds (a cache-aware policy at the ideal): the legend sits
    in the headroom above them, not over the first bars."""
    policy = {"ttft_samples_s": [0.05, 0.1, 0.2], "hit_ratio": 0.67}
    report = {
        "policies": {name: dict(policy) for name in ("kvgate", "dynamo_cost", "round_robin")},
        "bounds": {"ideal_hit_ratio": 0.67, "pooled_lru_hit_ratio": 0.6,
                   "balanced_hit_ratio": 0.67},
    }  # fmt: skip
    fig = draw_report(report)
    try:
        fig.canvas.draw()
        ax_h = fig.axes[1]
        legend = ax_h.get_legend().get_window_extent()
        bars = [bar.get_window_extent() for bar in ax_h.patches]
        assert len(bars) == 3
        assert not any(legend.overlaps(bar) for bar in bars)
    finally:
        plt.close(fig)
