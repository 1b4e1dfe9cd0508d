"""Arrival processes: Poisson, constant rate, and bursty (on/off modulated Poisson).

Every process starts at time 0 (its first arrival is at 0) and keeps a long-run mean
rate of ``rate_rps``. :meth:`Arrivals.times` draws ``n`` arrival times from an
:class:`Rng`.

``bursty(rate, burstiness)`` is an interrupted Poisson process (a two-state Markov-
modulated Poisson process): "on" periods (exponential, mean ``mean_on_s``) emit at
``burstiness * rate``; "off" periods (exponential, mean ``mean_on_s * (burstiness - 1)``)
emit nothing; the long-run rate stays ``rate``. ``burstiness`` is the peak-to-mean rate
ratio: 1 is Poisson, larger is burstier. Inter-arrival gaps are hyperexponential with
squared coefficient of variation ``1 + 2 * rate * mean_on_s * (b - 1)**2 / b``, i.e.
over-dispersed like a gamma with shape < 1, but with bursts correlated in time (real
overload periods). Note: vLLM's ``--burstiness`` is the gamma *shape* (smaller =
burstier); it is not the same parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvgate.core.rng import Rng
from kvgate.sim.synthetic_random import exponential

ArrivalKind = Literal["poisson", "constant", "bursty"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrivals:
    """An arrival process; build one with :func:`poisson`, :func:`constant`, :func:`bursty`."""

    kind: ArrivalKind
    rate_rps: float
    burstiness: float = 1.0
    mean_on_s: float = 5.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_rps) and self.rate_rps > 0):
            raise ValueError("rate_rps must be a finite number > 0")
        if not (math.isfinite(self.burstiness) and self.burstiness >= 1):
            raise ValueError(
                "burstiness is the peak-to-mean rate ratio and must be >= 1 "
                "(1 = Poisson); it is not vLLM's gamma shape"
            )
        if not (math.isfinite(self.mean_on_s) and self.mean_on_s > 0):
            raise ValueError("mean_on_s must be a finite number > 0")

    def times(self, n: int, rng: Rng) -> list[float]:
        """``n`` non-decreasing arrival times in seconds, the first at 0."""
        if n <= 0:
            return []
        if self.kind == "constant":
            return [i / self.rate_rps for i in range(n)]
        if self.kind == "poisson" or self.burstiness == 1:
            out = [0.0]
            t = 0.0
            for _ in range(n - 1):
                t += exponential(rng, 1.0 / self.rate_rps)
                out.append(t)
            return out
        return self._on_off_times(n, rng)

    def _on_off_times(self, n: int, rng: Rng) -> list[float]:
        b = self.burstiness
        peak_gap = 1.0 / (self.rate_rps * b)
        mean_off = self.mean_on_s * (b - 1.0)
        on = rng.random() < 1.0 / b  # start in the stationary state
        t = 0.0
        out: list[float] = []
        while len(out) < n:
            if not on:
                t += exponential(rng, mean_off)
                on = True
                continue
            left = exponential(rng, self.mean_on_s)
            while len(out) < n:
                g = exponential(rng, peak_gap)
                if g >= left:
                    t += left
                    break
                t += g
                left -= g
                out.append(t)
            on = False
        t0 = out[0]
        return [x - t0 for x in out]


def poisson(rate_rps: float) -> Arrivals:
    """Poisson arrivals (exponential gaps, mean ``1 / rate_rps``)."""
    return Arrivals(kind="poisson", rate_rps=rate_rps)


def constant(rate_rps: float) -> Arrivals:
    """Evenly spaced arrivals, ``1 / rate_rps`` apart."""
    return Arrivals(kind="constant", rate_rps=rate_rps)


def bursty(rate_rps: float, burstiness: float, *, mean_on_s: float = 5.0) -> Arrivals:
    """On/off modulated Poisson with mean rate ``rate_rps``; see the module docstring."""
    return Arrivals(kind="bursty", rate_rps=rate_rps, burstiness=burstiness, mean_on_s=mean_on_s)


def as_arrivals(arrivals: Arrivals | float) -> Arrivals:
    """A process as given, or a number read as a Poisson rate in requests per second."""
    if isinstance(arrivals, Arrivals):
        return arrivals
    return poisson(float(arrivals))
