"""The routing contract: one small Protocol every policy implements.

A policy is handed the request (:class:`RouteContext`), the candidate nodes that
survived filtering (healthy, not draining, not excluded, serving the model, able
to fit the request), the index's per-node prefix match, and the load view. It
returns a :class:`RouteDecision` (the node plus why, with its score parts), or
``None`` when it has no candidate. Policies keep their own small state (a
round-robin cursor, a breaker's hysteresis) and never touch the index or the node
table directly: the controller owns those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import ClassVar, Literal, Protocol

from kvgate.core.ids import BlockChain, NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng


class RouteReason(StrEnum):
    CACHE_HIT = "cache_hit"  # the best cache holder won on score
    SPREAD = "spread"  # another holder of the same prefix, chosen by load
    BREAKER = "breaker"  # the holder was overloaded; its cache bonus was dropped
    EXPLORATION = "exploration"  # an idle node that misses, on purpose
    REPLICATION = "replication"  # a hot prefix given one more holder
    LOAD = "load"  # no useful match: chosen by load
    FALLBACK = "fallback"  # a baseline's default branch / nothing better to say
    HASH = "hash"  # consistent hashing placement
    ROTATION = "rotation"  # round robin / random


# Where a cache-aware policy's ``matches`` come from: the cache location table
# ("index", the default), or only what this gateway routed, never evicted, in either
# index mode ("routed": kvgate.core.routed_tree, SGLang's HTTP-mode tree).
CacheView = Literal["index", "routed"]


def cache_view(policy: object) -> CacheView:
    """The policy's ``cache_view`` attribute, "index" when it has none."""
    return "routed" if getattr(policy, "cache_view", "index") == "routed" else "index"


_NO_DISCOUNT: Mapping[NodeId, float] = MappingProxyType({})  # shared: nothing allocated


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteContext:
    """What a policy may know about the request."""

    chain: BlockChain  # full-block hashes of the prompt (the index's key space)
    prompt_tokens: int  # estimated prompt tokens
    tokens_per_block: int  # tokens one chain block stands for (about 64 for 256 chars)
    max_tokens: int = 256  # requested output tokens
    # the context a serving node must fit: the prompt plus max_tokens asked for (plus
    # one token when none was: the node generates what fits), an estimated prompt taken
    # at 1 / ESTIMATE_SLACK of its estimate; 0: prompt_tokens + max_tokens
    context_tokens: int = 0
    model: str = ""
    # set by the controller so policies need not repeat the work
    hot_key: int | None = None  # the prefix key hot-prefix tracking counts
    hot_blocks: int = 0  # the hot key's depth in chain blocks (chain[hot_blocks - 1])
    hot_rate: float = 0.0  # requests/s for that prefix over the tracker's window
    # per node, a factor on its cache bonus for this request alone (on top of the node's
    # cache_weight): the nodes another tenant's flood is confined to count less
    cache_discount: Mapping[NodeId, float] = field(default_factory=lambda: _NO_DISCOUNT)
    # this gateway is one of a fleet (expected_gateways > 1): the others route the same
    # prefixes without telling it, so where an unknown prefix goes should be agreed on
    fleet: bool = False
    # seconds left for this request's first token under its class's TTFT SLO (P0: the
    # admission SLO less its wait in the local queue); 0: no target
    ttft_target_s: float = 0.0
    # the request's id, for a policy that follows each request it routed (the same id
    # comes back in on_first_token / on_finished); "" when there is none
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteDecision:
    node_id: NodeId
    reason: RouteReason
    matched_blocks: int = 0  # the chosen node's matched prefix length, in chain blocks
    best_matched_blocks: int = 0  # the longest match anywhere among candidates
    score: float = 0.0
    parts: Mapping[str, float] = field(default_factory=dict)  # score parts, for explaining


class RoutingPolicy(Protocol):
    """One routing algorithm. ``name`` is its key in :data:`kvgate.core.routing.POLICIES`."""

    name: ClassVar[str]
    uses_cache: ClassVar[bool]  # False: the controller may skip the index match

    @property
    def uses_hot_rate(self) -> bool:
        """Whether ``select`` reads ``ctx.hot_rate``; the controller tracks prefix
        arrival rates only for a policy that does (it costs every arrival)."""
        ...

    def select(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        matches: Mapping[NodeId, int],
        nodes: NodeTable,
        rng: Rng,
        now: float,
    ) -> RouteDecision | None:
        """Pick one of ``candidates`` (never another node), or None if there are none.

        ``matches`` maps a node id to its matched prefix length in chain blocks; nodes
        absent from it match nothing. It may include nodes that are not candidates.
        It is the cache location table's match, or the routed tree's for a policy
        whose ``cache_view`` (:func:`cache_view`) says "routed".
        """
        ...

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        """Request ``request_id`` (``RouteContext.request_id``), routed by this policy
        to ``node_id``, produced its first token there (its prefill is done); most
        policies ignore it."""
        ...

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        """Request ``request_id`` (``RouteContext.request_id``; "" when unknown), routed
        by this policy, left ``node_id``; most policies ignore it."""
        ...

    def on_node_removed(self, node_id: NodeId) -> None:
        """``node_id`` left the cluster: forget what is kept about it (node ids come and
        go, e.g. a new pod name per restart, so per-node state must not pile up)."""
        ...
