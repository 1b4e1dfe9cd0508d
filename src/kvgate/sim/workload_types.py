"""Simulated requests, workloads, and cache-only statistics over them.

A :class:`SimRequest` carries no text: its prompt is a chain of block ids, one per
``block_tokens`` tokens (the last block usually partial), exactly like Mooncake's
``hash_ids``. Equal ids at position *i* mean an equal prefix up to block *i*.

Hit ratios here model caches only (no queueing, no time) and follow the convention of
``shared/traces/README.md``: prefix matches only (a request reuses the leading run of
its blocks that is cached), weighted by blocks, and **every** id counts, the partial
last block included (it is a block of the trace like any other). This reproduces the
README's table exactly (conversation trace, one LRU: 4.45 % at 1 000 blocks, 17.81 %
at 8 000 blocks; ideal 36.6 %).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

PRIORITIES = (0, 1, 2)
"""Priority classes: 0 = P0 (most important) .. 2 = P2 (best effort)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRequest:
    """One request of a workload: lengths, arrival time and prompt block ids.

    ``after`` makes the request closed loop: it is the next step of a session that
    cannot be sent before the answer to request ``after`` (an agent's next step carries
    the previous step's output), so it arrives ``think_s`` after that request ends,
    whatever ``arrival_s`` says. ``arrival_s`` is then the open-loop plan: it orders the
    workload and is used if ``after`` is not in the workload (cut out by a window).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    tenant: str = "default"
    priority: int = 1
    session: str | None = None
    model: str = ""
    after: str | None = None
    think_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("SimRequest needs a non-empty request_id")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"{self.request_id}: think_s must be finite and >= 0")
        if self.after == self.request_id:
            raise ValueError(f"{self.request_id}: a request cannot wait for itself")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"{self.request_id}: arrival_s must be finite and >= 0")
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"{self.request_id}: token counts must be >= 0")
        if self.priority not in PRIORITIES:
            raise ValueError(f"{self.request_id}: priority must be 0, 1 or 2")


def _by_arrival(r: SimRequest) -> float:
    return r.arrival_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A named, arrival-ordered tuple of requests sharing one block size.

    ``requests`` is sorted by arrival on construction (stable: ties keep their
    given order); request ids must be unique.
    """

    name: str
    block_tokens: int
    requests: tuple[SimRequest, ...]

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        reqs = tuple(self.requests)
        if any(a.arrival_s > b.arrival_s for a, b in pairwise(reqs)):
            reqs = tuple(sorted(reqs, key=_by_arrival))
        object.__setattr__(self, "requests", reqs)
        ids = {r.request_id for r in reqs}
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in seen:
                raise ValueError(f"workload {self.name!r}: duplicate request_id {r.request_id!r}")
            if r.after in ids and r.after not in seen:  # so a chain can never loop
                raise ValueError(
                    f"workload {self.name!r}: {r.request_id!r} waits for {r.after!r}, "
                    "which is planned after it"
                )
            seen.add(r.request_id)

    def waits(self) -> dict[str, str]:
        """Closed loop: request id -> the id of the request it waits for, for every
        request whose ``after`` is in this workload (one whose ``after`` was cut out, by a
        window or a limit, keeps its planned ``arrival_s``)."""
        ids = {r.request_id for r in self.requests}
        return {r.request_id: r.after for r in self.requests if r.after in ids}

    @property
    def duration_s(self) -> float:
        """First to last arrival, in seconds (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def describe(self) -> dict[str, float | int | str]:
        """Summary statistics, as in the table of ``shared/traces/README.md``.

        ``rate_rps`` = requests / duration; percentiles interpolate linearly;
        ``ideal_hit_ratio`` is in blocks (infinite cache), ``ideal_hit_ratio_tokens``
        weights each hit block by its tokens (the partial last block by its size).
        """
        reqs = self.requests
        ins = sorted(r.prompt_tokens for r in reqs)
        outs = sorted(r.output_tokens for r in reqs)
        dur = self.duration_s
        blocks_total = sum(len(r.block_ids) for r in reqs)
        unique: set[int] = set()
        for r in reqs:
            unique.update(r.block_ids)
        return {
            "name": self.name,
            "requests": len(reqs),
            "duration_s": dur,
            "rate_rps": len(reqs) / dur if dur > 0 else 0.0,
            "input_tokens_mean": _mean(ins),
            "input_tokens_p50": percentile(ins, 50),
            "input_tokens_p99": percentile(ins, 99),
            "input_tokens_max": ins[-1] if ins else 0,
            "output_tokens_mean": _mean(outs),
            "output_tokens_p50": percentile(outs, 50),
            "output_tokens_p99": percentile(outs, 99),
            "output_tokens_max": outs[-1] if outs else 0,
            "blocks_total": blocks_total,
            "unique_blocks": len(unique),
            "ideal_hit_ratio": ideal_hit_ratio(self),
            "ideal_hit_ratio_tokens": ideal_hit_ratio(self, by_tokens=True),
            "tenants": len({r.tenant for r in reqs}),
            "sessions": len({r.session for r in reqs if r.session is not None}),
        }


def _mean(xs: Sequence[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def percentile(sorted_xs: Sequence[int] | Sequence[float], q: float) -> float:
    """The q-th percentile of an ascending sequence, linear interpolation (numpy's default)."""
    if not sorted_xs:
        return 0.0
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    frac = pos - lo
    return float(sorted_xs[lo]) + (float(sorted_xs[hi]) - float(sorted_xs[lo])) * frac


def _block_tokens_at(r: SimRequest, i: int, block_tokens: int) -> int:
    return max(0, min(block_tokens, r.prompt_tokens - i * block_tokens))


def ideal_hit_ratio(workload: Workload, *, by_tokens: bool = False) -> float:
    """Prefix hit ratio of an infinite cache shared by all requests.

    A request hits the leading run of its blocks whose ids appeared in any earlier
    request (ids chain, so "seen before" is a prefix match). Block-weighted by default;
    ``by_tokens`` weights each block by its token count instead.
    """
    seen: set[int] = set()
    hit = 0
    total = 0
    bt = workload.block_tokens
    for r in workload.requests:
        n = leading_run(r.block_ids, seen)
        if by_tokens:
            hit += sum(_block_tokens_at(r, i, bt) for i in range(n))
            total += r.prompt_tokens
        else:
            hit += n
            total += len(r.block_ids)
        seen.update(r.block_ids)
    return hit / total if total else 0.0


def leading_run(ids: Sequence[int], cache: set[int] | OrderedDict[int, None]) -> int:
    """How many of ``ids``, from the first, are in ``cache`` (ids chain: a prefix)."""
    n = 0
    for b in ids:
        if b not in cache:
            break
        n += 1
    return n


def pooled_lru_hit_ratio(workload: Workload, capacity_blocks: int) -> float:
    """Block-weighted prefix hit ratio of one LRU cache of ``capacity_blocks`` blocks.

    For each request in arrival order: hits = the leading run of its block ids present
    in the cache; then its blocks are touched/inserted **last to first** (so a prefix's
    root is the most recent and is evicted last), evicting the least recently used.
    Every id counts and is inserted, the partial last block included (the README
    convention); ratio = sum(hits) / sum(len(block_ids)).
    """
    if capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0")
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    total = 0
    for r in workload.requests:
        ids = r.block_ids
        total += len(ids)
        if capacity_blocks == 0:
            continue
        hit += leading_run(ids, cache)
        for b in reversed(ids):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hit / total if total else 0.0
