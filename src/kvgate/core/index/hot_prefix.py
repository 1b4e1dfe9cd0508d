"""Request rate per prefix key over a sliding window, in bounded memory.

Theory of operation
-------------------
Time is cut into ``buckets`` sub-buckets of ``window_s / buckets`` seconds. A ring
of ``buckets + 1`` dicts holds, per sub-bucket, key -> requests recorded in it; a
ring slot is emptied when time reaches a new sub-bucket that maps to it. The rate
at ``now`` counts the current (partial) sub-bucket, the ``buckets - 1`` before
it, and the oldest one weighted by the part of it still inside the window, so the
estimate slides smoothly::

    rate = (sum of the last `buckets` sub-buckets + (1 - f) * oldest) / window_s

where ``f`` is how far ``now`` is into the current sub-bucket. A steady stream of
``r`` requests/s reads ``r`` (up to a sub-bucket's rounding).

Memory: an ``OrderedDict`` key -> last sub-bucket seen, least recently seen first.
Keys not seen within the window fall off its front; past ``max_keys`` the least
recently seen key is forgotten (and its counts with it). Each ring dict then
holds at most ``max_keys`` keys, so memory is O(max_keys * buckets) in the worst
case and O(distinct keys in the window) usually.

``now`` is expected to be non-decreasing; an earlier ``now`` is treated as the
latest one seen.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from kvgate.core.errors import ConfigError


class HotPrefixTracker:
    """Requests per second per prefix key over the last ``window_s`` seconds."""

    def __init__(
        self, window_s: float = 10.0, max_keys: int = 100_000, *, buckets: int = 10
    ) -> None:
        if not window_s > 0 or not math.isfinite(window_s):
            raise ConfigError(f"window_s must be a positive number, got {window_s!r}")
        if max_keys < 1:
            raise ConfigError(f"max_keys must be >= 1, got {max_keys}")
        if buckets < 1:
            raise ConfigError(f"buckets must be >= 1, got {buckets}")
        self.window_s = window_s
        self.max_keys = max_keys
        self._n = buckets
        self._width = window_s / buckets
        self._ring: list[dict[int, int]] = [{} for _ in range(buckets + 1)]
        self._epoch: list[int] = [-1] * (buckets + 1)  # sub-bucket number each slot holds
        self._last_seen: OrderedDict[int, int] = OrderedDict()  # key -> last sub-bucket
        self._latest = -math.inf  # the latest `now` seen

    def __len__(self) -> int:
        """Keys currently tracked (seen within about one window, at most ``max_keys``)."""
        return len(self._last_seen)

    def record(self, key: int, now: float) -> None:
        """One request for ``key`` at ``now``."""
        b, _ = self._position(now)
        size = self._n + 1
        slot = b % size
        counts = self._ring[slot]
        if self._epoch[slot] != b:
            counts = self._ring[slot] = {}
            self._epoch[slot] = b
        counts[key] = counts.get(key, 0) + 1
        last = self._last_seen
        if key in last:
            last.move_to_end(key)
        last[key] = b
        # forget keys not seen within the window, then the least recent past max_keys
        oldest = b - self._n
        while last:
            k, seen = next(iter(last.items()))
            if seen >= oldest:
                break
            del last[k]
        while len(last) > self.max_keys:
            k, _seen = last.popitem(last=False)
            for ring_counts in self._ring:
                ring_counts.pop(k, None)

    def rate(self, key: int, now: float) -> float:
        """Requests/s for ``key`` over the window ending at ``now``."""
        seen = self._last_seen.get(key)
        b, frac = self._position(now)
        if seen is None or seen < b - self._n:
            return 0.0
        return self._weighted_count(key, b, frac) / self.window_s

    def top(self, n: int, now: float) -> list[tuple[int, float]]:
        """The ``n`` keys with the highest rate at ``now``, as (key, requests/s), highest first."""
        if n <= 0:
            return []
        b, frac = self._position(now)
        totals: dict[int, float] = {}
        size = self._n + 1
        for k in range(b - self._n, b + 1):
            slot = k % size
            if self._epoch[slot] != k:
                continue
            weight = (1.0 - frac) if k == b - self._n else 1.0
            for key, c in self._ring[slot].items():
                totals[key] = totals.get(key, 0.0) + weight * c
        best = heapq.nlargest(n, totals.items(), key=lambda kv: (kv[1], -kv[0]))
        return [(key, c / self.window_s) for key, c in best if c > 0]

    # --- internals --------------------------------------------------------------------
    def _position(self, now: float) -> tuple[int, float]:
        """(sub-bucket number, fraction of it elapsed) for ``max(now, latest now)``."""
        if now > self._latest:
            self._latest = now
        x = self._latest / self._width
        b = math.floor(x)
        return b, x - b

    def _weighted_count(self, key: int, b: int, frac: float) -> float:
        size = self._n + 1
        total = 0.0
        for k in range(b - self._n, b + 1):
            slot = k % size
            if self._epoch[slot] == k:
                c = self._ring[slot].get(key, 0)
                if c:
                    total += (1.0 - frac) * c if k == b - self._n else c
        return total
