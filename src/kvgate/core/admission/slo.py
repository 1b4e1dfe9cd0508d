"""The P0 TTFT SLO loop: gateways measure, the coordinator steers the P1 ceiling.

Gateway side, :class:`TtftWindow`: P0 time-to-first-token samples (from the
request's arrival at the gateway, its wait in the local queue included) go into a
log-bucketed histogram per window (``window_s``, aligned to multiples of it on the
gateway's monotonic clock). A refresh carries the p99 of the last complete window
and that window's index, so the coordinator counts each window once. Buckets are
2 % wide; the p99 reported is the bucket's upper edge (at most 2 % high). A window
with fewer than ``min_samples`` samples (but some) has no p99 worth the name: it
reports no data (healthy) when its slowest sample is within the healthy fraction of
the SLO, and otherwise that sample capped at the SLO, which keeps the loop in its band
(neither streak grows) without breaching on its own: one slow P0 request does not cut
P1, and a handful of P0 requests 5x over the SLO no longer count as healthy and let P2
double (admission audit: four P0 streams at 11 s to first token, 3-4 samples a window,
took P2 from 0.1 to 0.8).

Coordinator side, :class:`SloController`, one step per closed window (AIMD with a
hysteresis band, admission-anchors 8.4):

- breached (p99 > SLO): after ``breach_windows`` (2) consecutive ones the P1
  ceiling is multiplied by ``decrease`` (0.8), floored at ``floor`` (0.1);
- healthy (p99 <= ``healthy_fraction`` x SLO, or no data): after ``healthy_windows``
  (3) consecutive ones the ceiling rises by ``increase`` (0.05), capped at 1.0;
- in between (0.9-1.0 x SLO): neither; both streaks reset. This band is what keeps
  the loop from oscillating around a bare threshold (GIE PR #2062).

P2 is held off (ceiling 0) from the first breached window until ``healthy_windows``
healthy windows in a row have passed; it then restarts at ``p2_start`` (0.1) of the
idle capacity and doubles every healthy window up to all of it, as it does at
start-up (slow start). A P2 request holds its credit for its whole life (seconds to
minutes of decode), so P2 let back all at once refills the cluster before the next
window can show what that did to P0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvgate.core.admission.config import SloConfig

_BUCKET_BASE = 1.02
_BUCKET_MIN_S = 0.001
_LOG_BASE = math.log(_BUCKET_BASE)


def _bucket(value_s: float) -> int:
    if value_s <= _BUCKET_MIN_S:
        return 0
    return math.ceil(math.log(value_s / _BUCKET_MIN_S) / _LOG_BASE - 1e-9)


def _bucket_upper(index: int) -> float:
    return float(_BUCKET_MIN_S * _BUCKET_BASE**index)


def histogram_quantile(counts: dict[int, int], q: float) -> float | None:
    total = sum(counts.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return _bucket_upper(index)
    return _bucket_upper(max(counts))  # pragma: no cover - unreachable


@dataclass(slots=True)
class TtftWindow:
    """P0 TTFT per window on one gateway; ``last(now)`` is what a refresh reports."""

    window_s: float
    min_samples: int = 5
    slo_s: float = math.inf  # the P0 TTFT SLO: a sparse window reports at most this
    healthy_s: float = math.inf  # a sparse window whose samples are all within is healthy
    _current: int = -1
    _counts: dict[int, int] = field(default_factory=dict)
    _samples: int = 0
    _last_index: int = -1
    _last_p99: float | None = None

    def _roll(self, now: float) -> None:
        index = math.floor(now / self.window_s)
        if index == self._current:
            return
        if self._current >= 0 and index == self._current + 1:
            self._last_index = self._current
            self._last_p99 = self._report()
        else:  # first use, or one or more empty windows passed
            self._last_index = index - 1
            self._last_p99 = None
        self._current = index
        self._counts = {}
        self._samples = 0

    @classmethod
    def for_slo(cls, slo: SloConfig) -> TtftWindow:
        """The window a gateway keeps for the SLO loop ``slo`` configures."""
        return cls(
            window_s=slo.window_s,
            min_samples=slo.min_samples,
            slo_s=slo.p0_ttft_p99_s,
            healthy_s=slo.healthy_fraction * slo.p0_ttft_p99_s,
        )

    def _report(self) -> float | None:
        """What the window just closed reports: its p99, or for a sparse one (fewer than
        ``min_samples``) None when its slowest sample is healthy, else that sample capped
        at the SLO (the band: it holds the loop, never breaches alone)."""
        if self._samples >= self.min_samples:
            return histogram_quantile(self._counts, 0.99)
        if not self._counts:
            return None
        slowest = _bucket_upper(max(self._counts))
        return None if slowest <= self.healthy_s else min(slowest, self.slo_s)

    def add(self, ttft_s: float, now: float) -> None:
        self._roll(now)
        b = _bucket(ttft_s)
        self._counts[b] = self._counts.get(b, 0) + 1
        self._samples += 1

    def last(self, now: float) -> tuple[int, float | None]:
        """(index, p99) of the last complete window; p99 None for no data (none, or a few
        healthy samples)."""
        self._roll(now)
        return self._last_index, self._last_p99


@dataclass(slots=True)
class SloController:
    """AIMD on the P1 ceiling from one p99 per window (None = no P0 traffic = healthy)."""

    config: SloConfig
    p1_ceiling: float = 1.0
    p2_ceiling: float = 1.0  # 0: held off; set to config.p2_start at construction
    breach_streak: int = 0
    healthy_streak: int = 0
    windows: int = 0
    decreases: int = 0
    increases: int = 0

    def __post_init__(self) -> None:
        self.p1_ceiling = self.config.cap
        self.p2_ceiling = self.config.p2_start

    @property
    def p2_on(self) -> bool:
        return self.p2_ceiling > 0.0

    @property
    def ceilings(self) -> tuple[float, float, float]:
        return (1.0, self.p1_ceiling, self.p2_ceiling)

    def classify(self, p99: float | None) -> str:
        """ "breach", "healthy" or "band" (the hysteresis band between the two)."""
        cfg = self.config
        if p99 is None or p99 <= cfg.healthy_fraction * cfg.p0_ttft_p99_s:
            return "healthy"
        if p99 > cfg.p0_ttft_p99_s:
            return "breach"
        return "band"

    def observe_window(self, p99: float | None) -> float:
        """Close one window; returns the new P1 ceiling."""
        cfg = self.config
        self.windows += 1
        kind = self.classify(p99)
        if kind == "breach":
            self.healthy_streak = 0
            self.breach_streak += 1
            self.p2_ceiling = 0.0
            if self.breach_streak >= cfg.breach_windows:
                self.breach_streak = 0
                new = max(cfg.floor, round(self.p1_ceiling * cfg.decrease, 6))
                if new < self.p1_ceiling:
                    self.decreases += 1
                self.p1_ceiling = new
        elif kind == "healthy":
            self.breach_streak = 0
            self.healthy_streak += 1
            if 0.0 < self.p2_ceiling < 1.0:
                self.p2_ceiling = min(1.0, 2 * self.p2_ceiling)
            if self.healthy_streak >= cfg.healthy_windows:
                self.healthy_streak = 0
                if self.p2_ceiling == 0.0:
                    self.p2_ceiling = cfg.p2_start
                if self.p1_ceiling < cfg.cap:
                    self.increases += 1
                    self.p1_ceiling = min(cfg.cap, round(self.p1_ceiling + cfg.increase, 6))
        else:
            self.breach_streak = 0
            self.healthy_streak = 0
        return self.p1_ceiling
