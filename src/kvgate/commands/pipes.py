"""Standard output whose reader went away (``kvgate simulate ... | head``)."""

from __future__ import annotations

import os
import sys

# the exit status of a process killed by SIGPIPE, as a shell reports it (128 + 13)
EXIT_BROKEN_PIPE = 141


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so that what is still to be
    printed, and the interpreter's last flush, do not raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
