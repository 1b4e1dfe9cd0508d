"""Paired differences over replays: is a margin between two policies more than noise?

Why: the quality bar's checks compare single numbers, and on a long-context trace the
margins between the best policies (0.004 s of TTFT mean, 0.002 of hit ratio) are as
small as what one replay moves them by. Replays of one comparison give both policies
the same arrivals, so the difference is taken replay by replay (paired) and its mean
read with a Student t interval: an interval on one side of zero says the ordering
holds beyond the replays' noise, one that holds zero says it does not. The interval
assumes the replays' differences are independent draws of one distribution; it is a
guide to how far a mean can be trusted, not a proof. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["paired_difference", "t95", "verdict"]

# two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (from
    a table up to 30, then 1.96 + 2.4 / df, within 0.002 of the exact value)."""
    if df < 1:
        raise ValueError("t95 needs at least one degree of freedom")
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df


def paired_difference(
    ours: Sequence[float | None], theirs: Sequence[float | None]
) -> dict[str, Any] | None:
    """``ours[i] - theirs[i]`` summarised: their mean, its standard error and a 95 %
    interval. None with fewer than two pairs, or when a run measured nothing (a
    latency with no completed request) on either side."""
    if len(ours) != len(theirs):
        raise ValueError("paired_difference needs as many values on each side")
    diffs = [a - b for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None]
    n = len(diffs)
    if n < 2 or n < len(ours):  # one pair has no spread; a missing value spoils the pairing
        return None
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    stderr = math.sqrt(var / n)
    half = t95(n - 1) * stderr
    return {
        "n": n,
        "mean": round(mean, 6),
        "stderr": round(stderr, 6),
        "ci95": [round(mean - half, 6), round(mean + half, 6)],
    }


def verdict(diff: dict[str, Any], higher_is_better: bool) -> str:
    """``better`` or ``worse`` when the whole interval is on one side of zero,
    ``within noise`` when it holds zero (a tie included)."""
    lo, hi = diff["ci95"]
    if lo > 0.0:
        return "better" if higher_is_better else "worse"
    if hi < 0.0:
        return "worse" if higher_is_better else "better"
    return "within noise"
