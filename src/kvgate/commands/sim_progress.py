"""`kvgate simulate`'s progress on stderr: which run is going, and how far it is.

A conversation-trace run takes 10-20 s of wall time per policy and ``--policies all``
runs nine of them per speed-up, so on a terminal one ``\\r`` line shows the elapsed
time, the run (policy and speed-up) and a bar of its requests ended so far. The
simulator reports ended requests through a callback (it never reads a clock itself);
the line is redrawn at most 10 times a second. Written to a log or a pipe, there is
no bar: one ``simulating <run>`` line per run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.1  # at most 10 redraws a second, however fast requests end


class SimProgress:
    def __init__(
        self,
        enabled: bool,
        *,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.out = out if out is not None else sys.stderr
        self.enabled = enabled and self.out.isatty()
        self.clock = clock
        self.t0 = clock()
        self.label = ""
        self._drawn = -float("inf")
        self._width = 0  # of the last line drawn, so a shorter one blanks its tail

    def __call__(self, label: str) -> None:
        """A run starts: name it."""
        self.label = label
        if self.enabled:
            self._draw("")
        else:
            print(f"simulating {label}", file=self.out, flush=True)

    def requests(self, ended: int, total: int) -> None:
        """The current run has ended ``ended`` of its ``total`` requests."""
        if not self.enabled:
            return
        now = self.clock()
        if now - self._drawn < REDRAW_S and ended < total:
            return
        frac = ended / total if total > 0 else 1.0
        filled = min(BAR_WIDTH, int(frac * BAR_WIDTH))
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self._draw(f" [{bar}] {ended:,}/{total:,} requests", now)

    def done(self) -> None:
        """The runs are over: end the line so the table starts on its own."""
        if self.enabled and self._width:
            print(file=self.out, flush=True)
            self._width = 0

    def _draw(self, tail: str, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self._drawn = now
        line = f"[{now - self.t0:6.1f}s] simulating {self.label}{tail}"
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        self.out.write(f"\r{line}{pad}")
        self.out.flush()
