"""Distributions built from uniform draws of an injected :class:`Rng`.

Only ``rng.random()`` (a float in [0, 1)) is used, so any seeded source works and the
same seed gives the same sample sequence. Each helper documents how many draws it takes.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import TypeVar

from kvgate.core.rng import Rng, pick_index

T = TypeVar("T")


def exponential(rng: Rng, mean: float) -> float:
    """Exponential with the given mean, by inversion (one draw)."""
    return -mean * math.log(1.0 - rng.random())


def uniform(rng: Rng, lo: float, hi: float) -> float:
    """Uniform in [lo, hi) (one draw)."""
    return lo + (hi - lo) * rng.random()


def uniform_int(rng: Rng, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi], both included (one draw)."""
    if hi < lo:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    return lo + pick_index(rng, hi - lo + 1)


def shuffle(rng: Rng, items: list[T]) -> None:
    """Fisher-Yates in place (len - 1 draws)."""
    for i in range(len(items) - 1, 0, -1):
        j = pick_index(rng, i + 1)
        items[i], items[j] = items[j], items[i]


class Categorical:
    """Index ``k`` with probability ``weights[k] / sum(weights)``: a precomputed
    cumulative table searched with bisect (one draw per sample)."""

    __slots__ = ("_cum", "_total")

    def __init__(self, weights: Sequence[float]) -> None:
        if not weights:
            raise ValueError("Categorical needs at least one weight")
        cum: list[float] = []
        acc = 0.0
        for w in weights:
            if not math.isfinite(w) or w < 0:
                raise ValueError("weights must be finite and >= 0")
            acc += w
            cum.append(acc)
        if acc <= 0:
            raise ValueError("weights must not all be zero")
        self._cum = cum
        self._total = acc

    def __len__(self) -> int:
        return len(self._cum)

    def sample(self, rng: Rng) -> int:
        k = bisect_right(self._cum, rng.random() * self._total)
        # Guard float edges; never return a zero-weight trailing index.
        n = len(self._cum)
        while k >= n or (k > 0 and self._cum[k] == self._cum[k - 1]):
            k -= 1
        return k


def zipf(n: int, s: float) -> Categorical:
    """Zipf popularity over ranks 0..n-1: P(k) proportional to 1 / (k + 1) ** s."""
    if n < 1:
        raise ValueError("zipf needs n >= 1")
    if not s >= 0:
        raise ValueError("zipf exponent must be >= 0")
    return Categorical([1.0 / (k + 1) ** s for k in range(n)])
