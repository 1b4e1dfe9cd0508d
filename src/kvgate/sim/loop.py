"""A discrete-event loop on a virtual clock.

Events are (time, seq, callback) on a heap; ``seq`` is a global counter, so two
events at the same instant run in the order they were scheduled. Nothing here
reads a clock or draws a random number: the same schedule gives the same run,
bit for bit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Timer:
    """A scheduled callback, and the handle to cancel it. The heap orders ``(at, seq,
    timer)`` tuples, so ordering is a C-level tuple comparison that never reaches the
    timer (``seq`` is unique)."""

    __slots__ = ("at", "cancelled", "fn")

    def __init__(self, at: float, fn: Callable[[], None]) -> None:
        self.at = at
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self.now = 0.0
        self.events_run = 0

    def at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` at virtual time ``when`` (never in the past)."""
        self._seq += 1
        timer = Timer(max(when, self.now), fn)
        heapq.heappush(self._heap, (timer.at, self._seq, timer))
        return timer

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.at(self.now + delay, fn)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            at, _, timer = heap[0]
            if until is not None and at > until:
                self.now = until
                return
            pop(heap)
            if timer.cancelled:
                continue
            self.now = at
            self.events_run += 1
            timer.fn()

    def pending(self) -> int:
        return sum(1 for _, _, t in self._heap if not t.cancelled)
