"""A discrete-event loop on a virtual clock.

Events are (time, seq, callback) on a heap; ``seq`` is a global counter, so two
events at the same instant run in the order they were scheduled. Nothing here
reads a clock or draws a random number: the same schedule gives the same run,
bit for bit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class _Entry:
    """A scheduled callback; the heap orders ``(at, seq, entry)`` tuples, so ordering
    is a C-level tuple comparison that never reaches the entry (``seq`` is unique)."""

    __slots__ = ("at", "cancelled", "fn")

    def __init__(self, at: float, fn: Callable[[], None]) -> None:
        self.at = at
        self.fn = fn
        self.cancelled = False


class Timer:
    """A handle to cancel a scheduled callback."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    def cancel(self) -> None:
        self._entry.cancelled = True

    @property
    def at(self) -> float:
        return self._entry.at


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Entry]] = []
        self._seq = 0
        self.now = 0.0
        self.events_run = 0

    def at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` at virtual time ``when`` (never in the past)."""
        self._seq += 1
        entry = _Entry(max(when, self.now), fn)
        heapq.heappush(self._heap, (entry.at, self._seq, entry))
        return Timer(entry)

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.at(self.now + delay, fn)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            at, _, entry = heap[0]
            if until is not None and at > until:
                self.now = until
                return
            pop(heap)
            if entry.cancelled:
                continue
            self.now = at
            self.events_run += 1
            entry.fn()

    def pending(self) -> int:
        return sum(1 for _, _, e in self._heap if not e.cancelled)
