"""Load a Mooncake-format trace (JSON Lines) as a :class:`Workload`.

Format (``shared/traces/README.md``): one JSON object per line with ``timestamp`` (ms
from the start of the trace), ``input_length`` (at least 1: an empty prompt is refused),
``output_length`` (0 is read as 1: an engine's prefill always makes the first token, and
vLLM refuses ``max_tokens`` 0 too) and ``hash_ids`` (one chained id per block of the
prompt, ``len == ceil(input_length / block_tokens)``, each in [0, 2**64): the engine
chains them as 64-bit block hashes).
Blank lines and a UTF-8 byte-order mark are skipped; any other malformed line (bytes
that are not UTF-8 included) raises :class:`ValueError` naming the file and line number.

Arrivals: ``(timestamp - the earliest timestamp) / 1000 / speedup`` seconds, so a
trace stamped in epoch milliseconds starts at 0 too (the simulator would otherwise step
its housekeeping through 50 years of idle time). The conversation trace's timestamps
are bucketed (about 10 requests per value, values about 3 s apart), so requests sharing
one timestamp form a *bucket*:

* ``"burst"``: every request of a bucket arrives at the bucket's timestamp.
* ``"spread"`` (default): the *i*-th of the *n* requests of a bucket (file order) arrives
  at ``t + i/n * gap``, where ``gap`` is the time to the next distinct timestamp, so a
  bucket is spread evenly over its interval. Deterministic. The last bucket uses the
  median gap between distinct timestamps. If ``rng`` is given, the offsets are instead
  ``gap * u`` for uniform ``u`` (sorted, then assigned in file order: a jittered replay).

A trace whose timestamps are all distinct is replayed unchanged in either mode.
"""

from __future__ import annotations

import json
import math
import os
from itertools import pairwise
from pathlib import Path
from typing import Literal

from kvgate.core.rng import Rng
from kvgate.sim.workload_types import SimRequest, Workload

BucketMode = Literal["burst", "spread"]

# hash ids are 64-bit block hashes in the engine
_HASH_LIMIT = 1 << 64


def _fail(path: object, lineno: int, msg: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {msg}")


def _int_field(obj: dict[str, object], key: str, path: object, lineno: int) -> int:
    if key not in obj:
        raise _fail(path, lineno, f"{key!r} is missing")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, lineno, f"{key!r} must be an integer, got {v!r}")
    if v < 0:
        raise _fail(path, lineno, f"{key!r} must be >= 0, got {v}")
    return v


def _finite(x: int | float) -> bool:
    """Whether ``x`` is a finite float (an integer of 400 digits is not: it overflows)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _parse_line(
    line: str, path: object, lineno: int, block_tokens: int, strict: bool
) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _fail(path, lineno, f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise _fail(path, lineno, "not a trace record (JSON nested too deeply)") from None
    if not isinstance(obj, dict):
        raise _fail(path, lineno, "expected a JSON object")
    if "timestamp" not in obj:
        raise _fail(path, lineno, "'timestamp' is missing")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not _finite(ts) or ts < 0:
        raise _fail(path, lineno, f"'timestamp' must be a number >= 0, got {repr(ts)[:40]}")
    inp = _int_field(obj, "input_length", path, lineno)
    if inp < 1:  # the engines refuse an empty prompt: say so here, with the line
        raise _fail(path, lineno, f"'input_length' must be >= 1, got {inp}")
    out = _int_field(obj, "output_length", path, lineno)
    raw = obj.get("hash_ids")
    if not isinstance(raw, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in raw):
        raise _fail(path, lineno, "'hash_ids' must be a list of integers")
    if (bad := next((h for h in raw if not 0 <= h < _HASH_LIMIT), None)) is not None:
        raise _fail(path, lineno, f"'hash_ids' must be in [0, 2**64), got {bad}")
    want = -(-inp // block_tokens)
    if strict and len(raw) != want:
        raise _fail(
            path,
            lineno,
            f"len(hash_ids) = {len(raw)} but ceil(input_length / {block_tokens}) = {want}"
            f" (one hash id per {block_tokens}-token block of the prompt)",
        )
    return float(ts), inp, max(out, 1), tuple(raw)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _arrivals(stamps_s: list[float], mode: BucketMode, rng: Rng | None) -> list[float]:
    """Arrival times for requests already sorted (stably) by timestamp."""
    if mode == "burst" or not stamps_s:
        return list(stamps_s)
    distinct: list[float] = []
    for t in stamps_s:
        if not distinct or t != distinct[-1]:
            distinct.append(t)
    gaps = [b - a for a, b in pairwise(distinct)]
    last_gap = _median(gaps) if gaps else 0.0
    next_of = {
        t: (distinct[i + 1] - t if i + 1 < len(distinct) else last_gap)
        for i, t in enumerate(distinct)
    }
    out: list[float] = []
    i = 0
    while i < len(stamps_s):
        t = stamps_s[i]
        j = i
        while j < len(stamps_s) and stamps_s[j] == t:
            j += 1
        n = j - i
        gap = next_of[t]
        if rng is None:
            offsets = [k / n * gap for k in range(n)]
        else:
            offsets = sorted(rng.random() * gap for _ in range(n))
        out.extend(t + o for o in offsets)
        i = j
    return out


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    speedup: float = 1.0,
    bucket_mode: BucketMode = "spread",
    limit: int | None = None,
    rng: Rng | None = None,
    block_tokens: int = 512,
    strict: bool = True,
    name: str | None = None,
) -> Workload:
    """Read a Mooncake JSONL trace; see the module docstring for arrivals and checks.

    ``limit`` keeps the first ``limit`` requests of the file. ``strict=False`` accepts
    lines whose ``hash_ids`` length disagrees with ``input_length`` (ids kept as given).
    Request ids are ``r<k>`` with *k* the 0-based request index in the file; the
    workload is named after the file's stem unless ``name`` is given.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError("speedup must be a finite number > 0")
    if bucket_mode not in ("burst", "spread"):
        raise ValueError(f"bucket_mode must be 'burst' or 'spread', got {bucket_mode!r}")
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    p = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise _fail(p, lineno, "not valid UTF-8") from None
            if not line.strip():
                continue
            rows.append(_parse_line(line, p, lineno, block_tokens, strict))
    order = sorted(range(len(rows)), key=lambda k: rows[k][0])
    start = rows[order[0]][0] if rows else 0.0
    stamps = [(rows[k][0] - start) / 1000.0 / speedup for k in order]
    arrivals = _arrivals(stamps, bucket_mode, rng)
    requests = tuple(
        SimRequest(
            request_id=f"r{k}",
            arrival_s=t,
            prompt_tokens=rows[k][1],
            output_tokens=rows[k][2],
            block_ids=rows[k][3],
        )
        for k, t in zip(order, arrivals, strict=True)
    )
    return Workload(
        name=name if name is not None else p.stem, block_tokens=block_tokens, requests=requests
    )
