"""The kvgate policy's ttft-form rules that move a request off the score's winner:
a new session's home in a fleet or its spread alone, the affinity slack that keeps
a request on its holder, and the tail guard that takes it off again. The policy
(:meth:`kvgate.core.routing.kvgate.KvgatePolicy._ttft_rules`) applies them in order;
``docs/kvgate-policy.md`` says why each is there and what it measured.

Each rule is a function of the scored candidates and the settings the policy passes
at the call; each returns the node the request goes to and its bonus, or None to
leave the winner as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvgate.core.ids import BlockChain, NodeId
from kvgate.core.nodes import NodeState, rendezvous_rank
from kvgate.core.routing.kvgate_explore import PrefillS
from kvgate.core.routing.kvgate_loads import PRESSURE_UTIL, Load, LoadScores

__all__ = ["Choice", "fleet_home", "spread_session", "under_tail", "within_slack"]

_INF = float("inf")

# a node and its bonus (the prefill seconds its cache saves this request)
Choice = tuple[Load, float]


def within_slack(
    best: Load,
    best_bonus: float,
    open_holders: list[Choice],
    costs: Mapping[NodeId, float],
    latest: float,
    *,
    slack_s: float,
    min_gain_s: float,
    short_gain_s: float,
    short_slack_s: float,
) -> Choice | None:
    """The affinity slack: the open holder that saves the most prefill (then the
    sooner first token, then the lower slot) among those saving at least
    ``min_gain_s`` more than the winner whose predicted TTFT is within ``slack_s`` of
    the winner's (within ``short_slack_s`` when it saves less than ``short_gain_s``
    more) and whose penalty less bonus is at most ``latest`` (the bounded wait); None
    if none. A holder above ``PRESSURE_UTIL`` KV utilisation is not held to.

    A predicted TTFT is the penalty plus the request's whole prefill less the bonus
    (the prefill the node's cache saves), so the prefill itself cancels out; a long
    prefill the blocking rule rescored also carries its blocking cost there."""
    start = best.penalty - best_bonus + costs.get(best.node_id, 0.0)
    limit = start + slack_s
    # a short gain (a short session's own turns) is worth only a short wait
    short_gain = best_bonus + short_gain_s
    short_limit = start + min(slack_s, short_slack_s)
    floor = best_bonus + min_gain_s
    kept: Choice | None = None
    kept_key = (-_INF, -_INF, 0)
    for load, bonus in open_holders:
        if bonus <= floor or load.util > PRESSURE_UTIL or load.penalty - bonus > latest:
            continue
        ttft = load.penalty - bonus + costs.get(load.node_id, 0.0)
        if ttft > (short_limit if bonus < short_gain else limit):
            continue
        if (key := (bonus, -ttft, -load.slot)) > kept_key:
            kept, kept_key = (load, bonus), key
    return kept


def under_tail(
    loads: LoadScores,
    cands: frozenset[NodeState],
    matches: Mapping[NodeId, int],
    open_holders: list[Choice],
    costs: Mapping[NodeId, float],
    w_cache: float,
    prompt: int,
    tpb: int,
    full: float,
    level: float,
    uncached_s: PrefillS,
) -> Choice | None:
    """The tail guard, once the winner's predicted first token (its wait plus the
    prefill its cache leaves) is past ``level``: the best scored (then the lower
    queue, then the lower slot) of the candidates whose first token is not, open
    holders with their bonus, non-holders with none. None if none. ``full`` is the
    request's prefill with nothing cached."""
    top: Choice | None = None
    top_key = (-_INF, 0, 0)
    for load, bonus in open_holders:
        if load.wait + uncached_s(prompt, matches[load.node_id] * tpb) <= level:
            score = w_cache * bonus - load.penalty - costs.get(load.node_id, 0.0)
            if (key := (score, -load.queue, -load.slot)) > top_key:
                top, top_key = (load, bonus), key
    for _, q, slot, load in loads.order:
        if load.wait + full <= level and load.state in cands and not matches.get(load.node_id):
            key = (-load.penalty - costs.get(load.node_id, 0.0), -q, -slot)
            if key > top_key:
                top, top_key = (load, 0.0), key
    return top


def fleet_home(
    loads: LoadScores,
    cands: frozenset[NodeState],
    matches: Mapping[NodeId, int],
    open_holders: list[Choice],
    winner: Choice,
    best_match: int,
    chain: BlockChain,
    discount: Mapping[NodeId, float],
    window_s: float,
) -> Choice | None:
    """In a fleet, where a request whose cache no single holder has goes: among the
    candidates whose predicted first token (penalty less bonus) is within
    ``window_s`` of the winner's, the one with the highest xxh3 hash of (the prompt's
    first block past the shared match, node id) (:func:`rendezvous_rank`, as a
    pressing tenant's home node is chosen). Gateways that know the same shared prefix
    pick the same block, so the fleet sends a new session to the same node without a
    word, and its next request finds the cache there whichever gateway routes it. A
    node the request's ``discount`` marks (another tenant's flood is confined there)
    is nobody's home. None when the winner holds more of the prompt than the shared
    match (a context of its own) or the prompt has no full block, or no node
    qualifies."""
    best, best_bonus = winner
    if not chain or matches.get(best.node_id, 0) not in (0, best_match):
        return None
    key = chain[min(best_match, len(chain) - 1)]
    limit = best.penalty - best_bonus + window_s
    bonus_of = {load.node_id: bonus for load, bonus in open_holders}
    top: Choice | None = None
    top_rank = -1
    for load in loads.by_id.values():
        if load.state not in cands or (discount and load.node_id in discount):
            continue
        bonus = bonus_of.get(load.node_id, 0.0)
        if load.penalty - bonus <= limit:
            rank = rendezvous_rank(key, load.node_id)
            if rank > top_rank:
                top, top_rank = (load, bonus), rank
    return top


def spread_session(
    loads: LoadScores,
    cands: frozenset[NodeState],
    matches: Mapping[NodeId, int],
    open_holders: list[Choice],
    winner: Choice,
    best_match: int,
    prompt: int,
    tpb: int,
    now: float,
    *,
    window_s: float,
    shared_window_s: float,
    min_shared_s: float,
    saved_s: PrefillS,
    recent_work: Callable[[NodeId, float], float],
) -> Choice | None:
    """When the request starts a new session, the node it goes to and its bonus;
    None when it does not. A new session's cache is nowhere (the winner holds
    nothing), or is a shared prefix of at least ``min_shared_s`` of prefill (a system
    prompt, an agent's tool preamble; ``saved_s(prompt, cached)`` predicts it) that
    two or more open holders hold in full, the winner's whole match. Of the nodes it
    could start on (the non-holders, or those holders) whose predicted first token
    (penalty less bonus) is within ``window_s`` of the winner's (``shared_window_s``
    on a shared prefix), it goes to the one with the least ``recent_work(node, now)``
    (then the sooner first token, then the lower slot)."""
    best, best_bonus = winner
    m_best = matches.get(best.node_id, 0)
    # a session on a shared prefix (an agent task on its tool preamble) looks further
    window = shared_window_s if m_best else window_s
    limit = best.penalty - best_bonus + window
    pool: list[Choice]
    if m_best:
        shared_s = saved_s(prompt, m_best * tpb)
        if m_best != best_match or shared_s < min_shared_s:
            return None
        holders = [lb for lb in open_holders if matches[lb[0].node_id] == m_best]
        if len(holders) < 2:
            return None
        pool = [lb for lb in holders if lb[0].penalty - lb[1] <= limit]
    else:
        pool = []
        for _, _, _, load in loads.order:  # ascending penalty among non-holders
            if load.penalty > limit:
                break
            if load.state in cands and not matches.get(load.node_id):
                pool.append((load, 0.0))
    top = min(
        pool,
        key=lambda lb: (recent_work(lb[0].node_id, now), lb[0].penalty - lb[1], lb[0].slot),
        default=None,
    )
    return top if top is not None else winner
