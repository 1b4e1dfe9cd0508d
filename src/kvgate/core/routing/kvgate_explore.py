"""Where the kvgate policy sends a cache hit instead of its winner: exploration (an
idle node that misses warms up), busy exploration (with none idle, the least loaded
non-holder takes a shared prefix) and the target of hot-prefix replication. See
:mod:`kvgate.core.routing.kvgate` for the rules and ``docs/kvgate-policy.md`` for
why each clause is there.

The policy passes its settings at each call (they are plain attributes a caller may
change) and two of its predictions: ``uncached_s(prompt, cached)``, a prompt's
prefill seconds with ``cached`` tokens cached, and ``blocking_s(prompt, cached, node,
now)``, the blocking cost of that prefill on a node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState
from kvgate.core.routing.base import RouteContext
from kvgate.core.routing.kvgate_loads import Load, LoadScores

__all__ = [
    "BlockingS",
    "PrefillS",
    "explore_target",
    "is_idle",
    "least_loaded",
    "most_idle",
    "no_later_at",
    "shared_hit",
]

_INF = float("inf")

# (prompt tokens, cached tokens) -> predicted seconds: the prefill those cached tokens
# leave (the policy's uncached_s) or save (its saved_s)
PrefillS = Callable[[int, int], float]
# (prompt tokens, cached tokens, node, now) -> that prefill's blocking cost on the node
BlockingS = Callable[[int, int, NodeId, float], float]


def explore_target(
    ctx: RouteContext,
    candidates: Sequence[NodeState],
    loads: LoadScores,
    cands: frozenset[NodeState],
    matches: Mapping[NodeId, int],
    best: Load,
    loss: float,
    new_session: bool,
    now: float,
    *,
    ttft: bool,
    idle_queue: int,
    idle_util: float,
    explore_busy: bool,
    min_gain_s: float,
    uncached_s: PrefillS,
    blocking_s: BlockingS,
) -> NodeState | None:
    """Where exploration sends a cache hit instead of its winner ``best`` (``loss``:
    the prefill seconds the hit would have saved), or None to keep it. ``ttft``: the
    policy's score is the ttft form; ``min_gain_s``: its ``affinity_min_gain_s``."""
    by_id = loads.by_id
    prompt, tpb = ctx.prompt_tokens, ctx.tokens_per_block
    chosen = best.state
    chosen_match = matches.get(best.node_id, 0)
    idle = most_idle(candidates, matches, by_id, idle_queue, idle_util)
    # the longest match of any other candidate (only here: exploration is rare)
    other = max(
        (
            m
            for nid, m in matches.items()
            if nid != best.node_id and (o := by_id.get(nid)) is not None and o.state in cands
        ),
        default=0,
    )
    shared = shared_hit(
        prompt, tpb, chosen_match, other, ttft=ttft, min_gain_s=min_gain_s, uncached_s=uncached_s
    )
    # The winner is idle itself, so nobody waits for its hit: only a prefix another
    # node holds in full is copied on (a system prompt warming a third node). A
    # first copy or a longer match waits until its holder is busy: on a quiet
    # cluster a chat session's second turn went to an idle node, and each later
    # turn whose new part was under the minimum gain went on again (index audit:
    # 3 engines, 12 sessions x 5 turns, 36 of 48 later turns explored, measured
    # hit ratio 0.18; with this rule 3-10 and 0.56-0.69 in two runs; with
    # epsilon 0, 0.72)
    keep = other < chosen_match and is_idle(
        chosen, by_id[chosen.spec.node_id], idle_queue, idle_util
    )
    if idle is not None and (
        keep
        or not (
            shared
            # a context of its own leaves only for a first token no later than there
            or (
                ttft
                and no_later_at(by_id[idle.spec.node_id], best, loss, prompt, now, blocking_s)
            )
        )
    ):
        idle = None
    if idle is None and not keep and ttft and explore_busy and shared and (not new_session):
        # no node is idle: the least loaded node that would answer no later still
        # gets a prefix other nodes hold too
        idle = _underused(
            loads, cands, matches, ctx.cache_discount, best, loss, prompt, now, blocking_s
        )
    return idle


def _underused(
    loads: LoadScores,
    cands: frozenset[NodeState],
    matches: Mapping[NodeId, int],
    discount: Mapping[NodeId, float],
    best: Load,
    loss: float,
    prompt: int,
    now: float,
    blocking_s: BlockingS,
) -> NodeState | None:
    """The least loaded candidate non-holder (the first in rank order; not a node
    another tenant's flood is confined to, which ``discount`` marks) if it would
    answer no later than the winner (:func:`no_later_at`), else None."""
    for _, _, _, load in loads.order:
        if (
            load.state in cands
            and not matches.get(load.node_id)
            and not (discount and load.node_id in discount)
        ):
            if no_later_at(load, best, loss, prompt, now, blocking_s):
                return load.state
            return None
    return None


def no_later_at(
    idle: Load, best: Load, loss: float, prompt: int, now: float, blocking_s: BlockingS
) -> bool:
    """Whether the idle node would answer no later than the winner: its penalty, plus
    the prefill the lost hit would have saved, plus the blocking cost of the whole
    prefill there (the idle node's own sessions come back to its cache and queue
    behind it) is at most the winner's penalty."""
    blocking = blocking_s(prompt, 0, idle.node_id, now)
    return idle.penalty + loss + blocking <= best.penalty


def shared_hit(
    prompt: int,
    tpb: int,
    chosen_match: int,
    other: int,
    *,
    ttft: bool,
    min_gain_s: float,
    uncached_s: PrefillS,
) -> bool:
    """Whether the winner's hit of ``chosen_match`` blocks is a prefix exploration may
    copy as shared: what it holds beyond the longest match of another candidate,
    ``other`` blocks, saves at most ``min_gain_s`` of prefill (less than a block: no
    context of its own). A first copy (no other candidate holds any of it) cannot be
    told from a session's own context: the brief form copies it (how exploration
    starts there), the ttft form holds it to the no-later clause."""
    if not other:
        return not ttft
    beyond = uncached_s(prompt, min(other, chosen_match) * tpb) - uncached_s(
        prompt, chosen_match * tpb
    )
    return beyond <= min_gain_s


def least_loaded(
    candidates: Sequence[NodeState], matches: Mapping[NodeId, int], by_id: Mapping[NodeId, Load]
) -> NodeState | None:
    """The non-holder candidate with the lowest penalty, then the lowest slot (where
    hot-prefix replication puts one more replica)."""
    least: NodeState | None = None
    least_key = (_INF, 0)
    for s in candidates:
        if not matches.get(s.spec.node_id):
            key = (by_id[s.spec.node_id].penalty, s.slot)
            if key < least_key:
                least, least_key = s, key
    return least


def is_idle(state: NodeState, load: Load, idle_queue: int, max_util: float) -> bool:
    """Really idle: queue <= idle_queue, nothing of ours in flight, KV utilisation <=
    max_util."""
    return load.queue <= idle_queue and load.util <= max_util and state.inflight == 0


def most_idle(
    candidates: Sequence[NodeState],
    matches: Mapping[NodeId, int],
    by_id: Mapping[NodeId, Load],
    idle_queue: int,
    max_util: float,
) -> NodeState | None:
    """The least-utilised non-holder that is really idle: queue <= idle_queue, nothing of
    ours in flight, KV utilisation <= max_util (a busy cluster has none, and then
    exploration costs no hits)."""
    idle: NodeState | None = None
    idle_util = _INF
    for s in candidates:
        if not matches.get(s.spec.node_id):
            load = by_id[s.spec.node_id]
            if load.util < idle_util and is_idle(s, load, idle_queue, max_util):
                idle, idle_util = s, load.util
    return idle
