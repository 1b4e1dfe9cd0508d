"""The most a balanced routing can hit: an upper bound on the block hit ratio of any
policy that keeps load max/mean at or under a limit.

Why it exists
-------------
A cache-aware policy can reach the ideal hit ratio by never leaving a prefix's first
holder, at the price of load: on the simulator's agent workload, whose every prompt
starts with one of four tool prefixes, ``preble_e2`` hits 0.8827 (the ideal) with load
max/mean 2.25, i.e. on about four of eight nodes. The quality bar asks both for a hit
ratio at least the best cache-aware baseline's and for load max/mean <= 1.5. This
bound says when the two cannot hold together: a baseline above it bought its hits
with load.

The argument
------------
Each node's share of the work is at most ``limit / N`` of the total when load
max/mean <= ``limit``, so at least ``k = ceil(N / limit)`` nodes get work (6 of 8 at
1.5). A node's first request finds its cache empty and misses every block. A node
caches a block only after it computed it, so across the run every distinct block (a
prefix: a node of the trie of block-id chains) misses at least once, and a block
carried by ``c`` of the ``k`` first requests misses at least ``c`` times, once per
node. Hence, with ``V`` the distinct blocks and ``S`` the ``k`` first requests::

    misses >= V + sum over blocks (c(S) - 1)+      hits <= total - V - that sum

and the bound takes the ``S`` that overlaps least (:func:`forced_misses`, exact, by
a min-plus merge over the trie). On a workload whose ``k`` least-overlapping prompts
share nothing the bound is the ideal hit ratio. It assumes every request completes
on its first attempt (a failed attempt's misses do not count in the hit ratio) and
that caches start empty, as in a simulation without a scenario.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.sim.workload_types import Workload

__all__ = ["balanced_hit_ratio", "busy_nodes_needed", "forced_misses"]

_INF = math.inf


def busy_nodes_needed(nodes: int, limit: float) -> int:
    """How many of ``nodes`` must get work for load max/mean to be <= ``limit``."""
    if nodes < 1 or limit <= 0:
        raise ValueError("need nodes >= 1 and limit > 0")
    # shares sum to 1 and each is <= limit / nodes; the epsilon keeps 8 / 2.0 at 4
    return max(1, min(nodes, math.ceil(nodes / limit - 1e-9)))


def forced_misses(chains: Sequence[Sequence[int]], k: int) -> tuple[int, int]:
    """``(distinct, extra)``: the distinct blocks (prefixes) of ``chains`` and the
    fewest blocks that ``k`` distinct chains, each computed on its own cold node,
    must compute more than once: min over k-subsets S of sum over prefixes
    ``(count in S - 1)+``. ``extra`` is -1 when there are fewer than ``k`` chains."""
    if k < 1:
        raise ValueError("need k >= 1")
    distinct = _distinct_prefixes(chains)
    if len(chains) < k:
        return distinct, -1
    best = _min_overlap(chains, k)
    return distinct, int(best[k])


def balanced_hit_ratio(workload: Workload, nodes: int, limit: float) -> float | None:
    """The highest block hit ratio any routing of ``workload`` over ``nodes`` cold nodes
    can reach while keeping load max/mean <= ``limit`` (None: too few requests to
    keep it at all)."""
    chains = [r.block_ids for r in workload.requests]
    total = sum(len(c) for c in chains)
    if not total:
        return 0.0
    distinct, extra = forced_misses(chains, busy_nodes_needed(nodes, limit))
    if extra < 0:
        return None
    return max(0, total - distinct - extra) / total


def _distinct_prefixes(chains: Sequence[Sequence[int]]) -> int:
    """The number of distinct non-empty prefixes, i.e. of trie nodes."""
    # a prefix is named by (its parent prefix's number, its last block)
    names: dict[tuple[int, int], int] = {}
    for chain in chains:
        parent = 0
        for block in chain:
            key = (parent, block)
            name = names.get(key)
            if name is None:
                name = names[key] = len(names) + 1
            parent = name
    return len(names)


@dataclass(slots=True)
class _Group:
    """Chains sharing a prefix up to ``depth``; once opened, what its merge needs."""

    members: list[int]
    depth: int
    opened: bool = False
    shared: int = 0  # blocks every member has past ``depth`` (the group's own trie nodes)
    singles: int = 0  # branches of one chain each (one costs nothing)
    subgroups: int = 0  # branches of several chains, opened on the stack
    first_result: int = 0  # where their results start in the results list


def _min_overlap(chains: Sequence[Sequence[int]], k: int) -> list[float]:
    """``f[j]`` for j = 0..k: the least sum of ``(count - 1)+`` over the trie's nodes for
    j chains taken from ``chains`` (inf when there are fewer than j).

    The trie is walked with an explicit stack (a chain may be thousands of blocks
    long). A group of chains sharing a prefix first runs down the blocks they all share
    (``shared`` of them: choosing j of the group repeats each j - 1 times), then splits
    into the chains that end there and the subgroups by next block. With ``b`` such
    branches, j <= b chains can share nothing more, so a group is opened further only
    when fewer than ``k`` branches leave it."""
    stack = [_Group(list(range(len(chains))), 0)]
    results: list[list[float]] = []  # f tables of finished groups, in finishing order
    while stack:
        group = stack[-1]
        if not group.opened:
            members = group.members
            end = _common_end(chains, members, group.depth)
            group.shared = end - group.depth
            ending = sum(1 for i in members if len(chains[i]) == end)
            branches: dict[int, list[int]] = {}
            for i in members:
                if len(chains[i]) > end:
                    branches.setdefault(chains[i][end], []).append(i)
            need = min(k, len(members))
            if ending + len(branches) >= need:  # j <= need chains, all from other branches
                results.append(_shifted([0.0] * (need + 1), group.shared, k))
                stack.pop()
                continue
            big = [b for b in branches.values() if len(b) > 1]
            group.opened = True
            group.singles = ending + len(branches) - len(big)
            group.subgroups = len(big)
            group.first_result = len(results)
            stack.extend(_Group(b, end) for b in big)
            continue
        # every subgroup is done: min-plus merge of the lone chains and their tables
        singles = min(group.singles, k)
        merged = [0.0] * (singles + 1) + [_INF] * (k - singles)
        start = group.first_result
        for sub in results[start : start + group.subgroups]:
            merged = _merge(merged, sub, k)
        del results[start:]
        results.append(_shifted(merged, group.shared, k))
        stack.pop()
    f = results[0]
    return f + [_INF] * (k + 1 - len(f))


def _common_end(chains: Sequence[Sequence[int]], members: list[int], depth: int) -> int:
    """The first position at which the chains of ``members`` differ or one ends."""
    first = chains[members[0]]
    end = depth
    shortest = min(len(chains[i]) for i in members)
    while end < shortest:
        block = first[end]
        if any(chains[i][end] != block for i in members):
            break
        end += 1
    return end


def _shifted(g: list[float], w: int, k: int) -> list[float]:
    """A group's ``f[j] = g[j] + (j - 1) * w`` for j >= 1, padded to ``k + 1``."""
    f = [0.0] + [g[j] + (j - 1) * w for j in range(1, len(g))]
    return f + [_INF] * (k + 1 - len(f))


def _merge(a: list[float], b: list[float], k: int) -> list[float]:
    """Min-plus convolution of two ``f`` tables, up to ``k`` chains."""
    out = [_INF] * (k + 1)
    for i, x in enumerate(a):
        if x == _INF:
            continue
        for j, y in enumerate(b):
            if i + j > k:
                break
            if x + y < out[i + j]:
                out[i + j] = x + y
    return out
