"""The cache-loss funnel: why each prompt block of a completed request was, or was not,
found cached. Pure arithmetic on what the simulator saw at submit; the cluster feeds it
and the report prints its counts (``cache_loss_funnel``).

A completed request's ``total`` blocks split into: ``hit`` (the engine found them),
``never_seen`` (in no earlier request), ``never_cached`` (only in earlier requests that
no node had computed when this one was sent, or a block no cache could give it: a
partial last block, or the last of a prompt of whole blocks), ``evicted`` (no live node held them at
submit, or the target did and lost them before the request ran there) and, for blocks
only another node held, the reason the route went elsewhere: ``breaker``,
``exploration``, ``replication``, or ``routed_away_by_load`` for every other reason.
"""

from __future__ import annotations

from collections import Counter

# the funnel's kinds of prompt block, each in every report (0 when none)
FUNNEL_KINDS = (
    "hit",
    "never_seen",
    "never_cached",
    "evicted",
    "routed_away_by_load",
    "breaker",
    "exploration",
    "replication",
)

# route reasons the funnel files apart when they sent a request away from its cache
_ROUTE_KINDS = frozenset({"breaker", "exploration", "replication"})


def count_blocks(
    funnel: Counter[str],
    *,
    total: int,
    seen: int,
    own: int,
    best_other: int,
    stored: int,
    got: int,
    route_reason: str,
    usable: int,
) -> None:
    """File the ``total`` prompt blocks of one completed attempt into ``funnel``.

    ``seen``: the leading blocks some earlier request had (the ideal cache's hit);
    ``own`` / ``best_other``: the longest prefix the target / any other live node really
    held at submit; ``stored``: the longest some node had cached at some time before
    submit; ``got``: what the engine found; ``route_reason``: the route's reason;
    ``usable``: the most blocks any cache could give the request (an engine computes at
    least the prompt's last token, so a prompt of whole blocks cannot hit its last).
    """
    # a hit was seen: a later arrival may have computed it first (it jumped the queue)
    ideal = max(min(seen, total), got)
    reach = max(min(ideal, usable), got)  # what any cache could have given
    best = max(min(max(own, best_other), reach), got)
    own = max(min(own, best), got)  # got <= own <= best
    stored = max(min(stored, reach), best)
    funnel["hit"] += got
    funnel["never_seen"] += total - ideal
    # seen in an earlier request, but no node ever cached it before this one was sent
    # (or it is the last block of a prompt of whole blocks, which no cache can give)
    funnel["never_cached"] += ideal - stored
    # no live node held it at submit, or the target did and evicted it meanwhile
    funnel["evicted"] += stored - best + own - got
    away = best - own  # only another node held it
    if away > 0:
        funnel[route_reason if route_reason in _ROUTE_KINDS else "routed_away_by_load"] += away


__all__ = ["FUNNEL_KINDS", "count_blocks"]
