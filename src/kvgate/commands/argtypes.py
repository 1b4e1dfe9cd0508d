"""argparse value types and checks shared by the command-line shells."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


# the synthetic workloads made of sessions, the only ones --closed-loop applies to
SESSION_WORKLOADS = ("chat", "agent")


def check_closed_loop(args: argparse.Namespace) -> None:
    """``--closed-loop`` needs a workload made of sessions (``args.closed_loop``,
    ``args.trace``, ``args.workload``). Raises ValueError."""
    if args.closed_loop and (args.trace is not None or args.workload not in SESSION_WORKLOADS):
        raise ValueError(
            f"--closed-loop applies to the session workloads ({', '.join(SESSION_WORKLOADS)}); "
            "a trace or another workload has no sessions to close"
        )


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of finite numbers > 0 (at least one)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
    return [positive_float(t) for t in items]


def distinct_fractions(text: str) -> list[float]:
    """:func:`positive_floats` whose ``%g`` spellings differ: each names its run in a
    report (``runs.0.8``), so 0.8 and 0.8000001 would run twice and keep one."""
    values = positive_floats(text)
    keys = [f"{v:g}" for v in values]
    if len(set(keys)) != len(keys):
        raise argparse.ArgumentTypeError(
            f"fractions must differ at 6 significant digits (each names a run), got {text!r}"
        )
    return values


def check_distinct_files(inputs: dict[str, Path | None], outputs: dict[str, Path | None]) -> None:
    """Refuse an output that is one of the inputs or another output (by option name):
    ``--requests`` naming the trace emptied it before it was read. Raises ValueError."""
    seen = {path.resolve(): option for option, path in inputs.items() if path is not None}
    for option, path in outputs.items():
        if path is None:
            continue
        key = path.resolve()
        if key in seen:
            raise ValueError(f"{option} {path}: is the same file as {seen[key]}")
        seen[key] = option


def check_output_file(path: Path | None, option: str, suffixes: tuple[str, ...] = ()) -> None:
    """Fail before a long run, not after it, when ``path`` cannot be written: its folder
    is missing, it is a folder, or (``suffixes``) its format is not one we write.
    Raises ValueError."""
    if path is None:
        return
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a folder, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: the folder {parent} does not exist")
    # what only writing tells (a read-only folder, /proc): try it; a file that was not
    # there before is removed again
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot be written ({exc.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)
