"""What the kvgate policy remembers across requests: per node, decayed seconds (the
cache value of the blocking rule, the recent work of the new-session spread) and the
tail level (the tail guard); see :mod:`kvgate.core.routing.kvgate`. All bounded in
memory."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque

from kvgate.core.ids import NodeId

__all__ = ["DecayedSeconds", "TailLevel"]

_INF = float("inf")


class DecayedSeconds:
    """Per node, seconds added over time and decayed with ``tau_s``; ``rate`` is their
    decayed average per second. The policy keeps two: the prefill seconds our hits on a
    node saved (how much traffic depends on its cache now) and the prefill seconds sent
    to a node (how busy its recent sessions keep it)."""

    __slots__ = ("_saved", "tau_s")

    # More nodes remembered than this: forget those whose value has decayed away.
    _MAX_NODES = 4096

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._saved: dict[NodeId, tuple[float, float]] = {}  # node -> (seconds, as of)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        seconds, at = entry
        return seconds * math.exp(-max(0.0, now - at) / self.tau_s)

    def rate(self, node_id: NodeId, now: float) -> float:
        """Seconds per second (a decayed average over ``tau_s``)."""
        entry = self._saved.get(node_id)
        return self._decayed(entry, now) / self.tau_s if entry is not None else 0.0

    def forget(self, node_id: NodeId) -> None:
        self._saved.pop(node_id, None)

    def add(self, node_id: NodeId, seconds: float, now: float) -> None:
        saved = self._saved
        entry = saved.get(node_id)
        saved[node_id] = ((self._decayed(entry, now) if entry else 0.0) + seconds, now)
        if len(saved) > self._MAX_NODES:
            for nid in [n for n, e in saved.items() if self._decayed(e, now) < 1e-6]:
                del saved[nid]


class TailLevel:
    """The ``quantile`` of the last ``window`` requests' predicted full prefill times
    (no cache anywhere): how long the slowest requests take however they are routed.
    Memory and time per request are bounded by ``window`` (a ring and a sorted list)."""

    __slots__ = ("_rank", "_ring", "_sorted", "window")

    def __init__(self, quantile: float, window: int) -> None:
        self.window = window
        self._rank = min(window - 1, int(quantile * window))  # the level's place in a full window
        self._ring: deque[float] = deque()
        self._sorted: list[float] = []

    def observe(self, seconds: float) -> float:
        """The level before this request (infinite until a window is seen); then the
        request's ``seconds`` join the window."""
        ordered = self._sorted
        level = ordered[self._rank] if len(ordered) == self.window else _INF
        self._ring.append(seconds)
        insort(ordered, seconds)
        if len(self._ring) > self.window:
            del ordered[bisect_left(ordered, self._ring.popleft())]
        return level
