"""The percentile definition every benchmark of this folder uses (nearest rank).

``percentile(samples, p)`` is the sample of rank ``ceil(p / 100 * n)`` in ascending
order (1-based; rank 1 for p = 0): the smallest sample that at least p % of the
samples do not exceed. It is always one of the samples, never an interpolation, so
p50 of an even count is the lower middle sample (not ``statistics.median``'s mean of
the two), and p99 of fewer than 100 samples is the largest.

bench_gateway.py reports wrk's own percentiles, which rank ``floor(p / 100 * n) + 1``
(wrk's ``stats_percentile``) over 1 us buckets: the same sample except when
``p / 100 * n`` is a whole number, where wrk's is one rank higher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], p: float) -> float:
    """Nearest-rank ``p``-th percentile (0 <= p <= 100) of non-empty ``samples``."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is outside 0..100")
    s = sorted(samples)
    # the epsilon keeps float noise (99.9 * 1000 / 100 = 999.0000000000001) off a rank
    rank = math.ceil(p * len(s) / 100.0 - 1e-9)
    return s[min(len(s), max(1, rank)) - 1]
