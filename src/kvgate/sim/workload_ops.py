"""Small transformations of workloads used to build scenarios.

Examples: a P2 flood at 10x merged with a steady P0 stream
(``merge(with_priority(scale_rate(w, 10), 2), with_priority(w, 0))``), one tenant
flooding (``merge(w, with_tenant(scale_rate(w2, 5), "noisy"))``).

Every function returns a new :class:`Workload`; inputs are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

from kvgate.core.rng import Rng
from kvgate.sim.synthetic_random import Categorical
from kvgate.sim.workload_types import PRIORITIES, SimRequest, Workload

K = TypeVar("K", str, int)


def _categorical(shares: Mapping[K, float], what: str) -> tuple[list[K], Categorical] | None:
    if not shares:
        return None
    keys = list(shares)
    weights = [float(shares[k]) for k in keys]
    total = sum(weights)
    if any(not math.isfinite(w) or w < 0 for w in weights) or not 0 < total < math.inf:
        raise ValueError(f"{what} shares must be finite, >= 0, not all zero, with a finite sum")
    return keys, Categorical(weights)


def assign_classes(
    workload: Workload,
    *,
    tenants: Mapping[str, float],
    priorities: Mapping[int, float],
    rng: Rng,
    by_session: bool = True,
) -> Workload:
    """Assign tenants and priority classes by share (shares need not sum to 1).

    Requests are visited in arrival order; each draws a tenant then a priority
    (mapping iteration order defines the categories). With ``by_session``, the first
    request of a session draws and later requests of that session reuse its tenant and
    priority; requests with ``session=None`` (e.g. trace replay) draw on their own.
    An empty mapping leaves that attribute unchanged.
    """
    for p in priorities:
        if p not in PRIORITIES:
            raise ValueError(f"priority classes are 0, 1, 2; got {p!r}")
    t_cat = _categorical(tenants, "tenant")
    p_cat = _categorical(priorities, "priority")
    memo: dict[str, tuple[str, int]] = {}
    out: list[SimRequest] = []
    for r in workload.requests:
        key = r.session if by_session else None
        if key is not None and key in memo:
            tenant, prio = memo[key]
        else:
            tenant = t_cat[0][t_cat[1].sample(rng)] if t_cat else r.tenant
            prio = p_cat[0][p_cat[1].sample(rng)] if p_cat else r.priority
            if key is not None:
                memo[key] = (tenant, prio)
        out.append(replace(r, tenant=tenant, priority=prio))
    return replace(workload, requests=tuple(out))


def scale_rate(workload: Workload, factor: float) -> Workload:
    """Multiply the arrival rate by ``factor`` (arrival times, and the think times of
    closed-loop requests, divided by it)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError("factor must be a finite number > 0")
    reqs = tuple(
        replace(r, arrival_s=r.arrival_s / factor, think_s=r.think_s / factor)
        for r in workload.requests
    )
    return replace(workload, requests=reqs)


def time_window(
    workload: Workload, start_s: float, end_s: float, *, rebase: bool = True
) -> Workload:
    """Requests arriving in ``[start_s, end_s)``; with ``rebase`` times restart at 0."""
    if not end_s >= start_s >= 0:
        raise ValueError("need 0 <= start_s <= end_s")
    shift = start_s if rebase else 0.0
    reqs = tuple(
        replace(r, arrival_s=max(0.0, r.arrival_s - shift))
        for r in workload.requests
        if start_s <= r.arrival_s < end_s
    )
    return replace(workload, requests=reqs)


def with_priority(workload: Workload, priority: int) -> Workload:
    """Every request gets priority class ``priority`` (0 = P0 .. 2 = P2)."""
    return replace(
        workload, requests=tuple(replace(r, priority=priority) for r in workload.requests)
    )


def with_tenant(workload: Workload, tenant: str) -> Workload:
    """Every request belongs to ``tenant``."""
    return replace(workload, requests=tuple(replace(r, tenant=tenant) for r in workload.requests))


def _prefixes(workloads: Sequence[Workload]) -> list[str]:
    names = [w.name for w in workloads]
    if all(names) and len(set(names)) == len(names):
        return [f"{n}:" for n in names]
    return [f"{i}.{n}:" for i, n in enumerate(names)]


def _combine(
    workloads: Sequence[Workload],
    offsets_s: Sequence[float],
    name: str | None,
    disjoint_blocks: bool,
) -> Workload:
    if not workloads:
        raise ValueError("need at least one workload")
    bt = workloads[0].block_tokens
    if any(w.block_tokens != bt for w in workloads):
        raise ValueError("workloads must share block_tokens")
    reqs: list[SimRequest] = []
    next_id = 0
    for w, prefix, off in zip(workloads, _prefixes(workloads), offsets_s, strict=True):
        # Kept apart, each workload's ids are renumbered by rank above the previous
        # one's: a shift of a dense range, and still within 64 bits when a trace's ids
        # are sparse hashes (a shift by the previous maximum overflowed the engine's).
        renumber: dict[int, int] = {}
        if disjoint_blocks:
            unique = sorted({b for r in w.requests for b in r.block_ids})
            renumber = {b: next_id + i for i, b in enumerate(unique)}
            next_id += len(unique)
        reqs.extend(
            replace(
                r,
                request_id=prefix + r.request_id,
                arrival_s=r.arrival_s + off,
                block_ids=tuple(renumber[b] for b in r.block_ids) if renumber else r.block_ids,
                session=None if r.session is None else prefix + r.session,
                after=None if r.after is None else prefix + r.after,
            )
            for r in w.requests
        )
    default = "+".join(w.name for w in workloads)
    return Workload(name=name or default, block_tokens=bt, requests=tuple(reqs))


def merge(*workloads: Workload, name: str | None = None, disjoint_blocks: bool = True) -> Workload:
    """Interleave workloads by arrival (ties: argument order, then each one's order).

    Request ids and sessions are prefixed with ``"<name>:"`` (``"<i>.<name>:"`` if
    names repeat) so they stay unique. With ``disjoint_blocks`` (default) block ids are
    shifted so different workloads share no block (independently generated workloads
    reuse small ids by accident); pass False to keep ids, e.g. two slices of one trace.
    """
    return _combine(workloads, [0.0] * len(workloads), name, disjoint_blocks)


def concat(
    *workloads: Workload,
    gap_s: float = 0.0,
    name: str | None = None,
    disjoint_blocks: bool = True,
) -> Workload:
    """Play workloads one after another: each one's time 0 is placed ``gap_s`` after the
    previous one's last arrival. Ids, sessions and blocks as in :func:`merge`."""
    if not (math.isfinite(gap_s) and gap_s >= 0):
        raise ValueError("gap_s must be >= 0")
    offsets: list[float] = []
    t = 0.0
    for i, w in enumerate(workloads):
        if i > 0:
            t += gap_s
        offsets.append(t)
        if w.requests:
            t += w.requests[-1].arrival_s
    return _combine(workloads, offsets, name, disjoint_blocks)
