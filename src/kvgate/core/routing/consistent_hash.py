"""Consistent hashing on the prompt prefix, with bounded loads (CHWBL).

Algorithm
---------
KubeAI's ``PrefixHash`` strategy (``internal/loadbalancer/balance_chwbl.go``,
routing-anchors.md §8) is Consistent Hashing With Bounded Loads: hash a prefix
key onto a ring of virtual nodes, walk clockwise from the key's position and
take the first endpoint whose in-flight load passes ``chwblLoadOK``::

    ok  iff  total_inflight == 0  or  inflight + 1 <= load_factor * (total_inflight + 1) / n

(the ``+1`` s stand for the request being placed; ``n`` = endpoints, here the
candidates). SMG's ``prefix_hash`` is the same scheme keyed on the first 256
tokens with a 1.25 × mean bound (§1 "Other policies").

Defaults and where they come from
---------------------------------
* ``virtual_nodes = 256``: KubeAI's replicas per endpoint (vllm-router's
  ``consistent_hash`` uses 160, §2(a); KubeAI is chosen because the bounded load
  is KubeAI's). Virtual node ``v`` of node ``id`` sits at ``xxh3_64(f"{id}#{v}")``.
* ``load_factor = 1.25``: KubeAI ``meanLoadFactor`` 125 (and SMG prefix_hash).
* ``prefix_tokens = 256``: SMG ``prefix_hash`` hashes the first 256 tokens (KubeAI
  the first 100 characters of the first user message). The key is the chain hash
  of block ``k - 1`` with ``k = ceil(prefix_tokens / tokens_per_block)`` (fewer if
  the prompt is shorter): chain hashes are chained, so that one value already
  stands for the whole first ``k`` blocks. It is re-hashed with xxh3 together with
  the model name, so the ring position is stable across processes and gateways.

The ring is built from every node id the table knows (plus the candidates),
cached, and rebuilt only when that set changes; non-candidates are skipped on the
walk, so a node that is down or excluded hands its keys to its ring successors
and every other key stays where it was (~1/N keys move per node). Load is the
gateway's own in-flight count (``state.inflight``), as in KubeAI.

When no candidate passes the bound the request goes to the first candidate of
the walk, the key's owner (reason ``FALLBACK``): KubeAI's ``defaultEndpoint``,
SMG prefix_hash's "all workers overloaded, use initial worker anyway". This is
common, not rare: at light load (total in flight + 1 < n / load_factor) even an
idle owner fails the bound. A prompt shorter than one block has no key: it goes
to the least in-flight candidate (reason ``FALLBACK``; KubeAI always has a key,
SMG falls back to least load without tokens). ``uses_cache = False``; reason
``HASH``; ``parts["hops"]`` counts the candidates skipped for load.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import ClassVar

import xxhash

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable
from kvgate.core.rng import Rng
from kvgate.core.routing._common import best_match, least_loaded, match_of, require
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason

_MASK64 = (1 << 64) - 1


def load_ok(load: int, total: int, n: int, load_factor: float) -> bool:
    """KubeAI's ``chwblLoadOK``: may a node at ``load`` take one more request?"""
    if total == 0:
        return True
    return load + 1 <= load_factor * (total + 1) / n


class ConsistentHashPolicy:
    """Prefix-keyed consistent hash ring with KubeAI's bounded-load walk."""

    name: ClassVar[str] = "consistent_hash"
    uses_cache: ClassVar[bool] = False
    uses_hot_rate: ClassVar[bool] = False

    def __init__(
        self, *, prefix_tokens: int = 256, virtual_nodes: int = 256, load_factor: float = 1.25
    ) -> None:
        require(prefix_tokens >= 1, self.name, "prefix_tokens must be >= 1")
        require(virtual_nodes >= 1, self.name, "virtual_nodes must be >= 1")
        require(load_factor >= 1.0, self.name, "load_factor must be >= 1.0")
        self.prefix_tokens = prefix_tokens
        self.virtual_nodes = virtual_nodes
        self.load_factor = load_factor
        self._members: frozenset[NodeId] | None = None
        self._positions: list[int] = []
        self._owners: list[NodeId] = []

    def _ring(self, members: frozenset[NodeId]) -> None:
        if members == self._members:
            return
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{node_id}#{v}".encode()), node_id)
            for node_id in members
            for v in range(self.virtual_nodes)
        )
        self._positions = [p for p, _ in points]
        self._owners = [o for _, o in points]
        self._members = members

    def key(self, ctx: RouteContext) -> int | None:
        """The ring position of the request's prefix, or None for a sub-block prompt."""
        if not ctx.chain:
            return None
        tpb = max(1, ctx.tokens_per_block)
        k = min(len(ctx.chain), max(1, -(-self.prefix_tokens // tpb)))
        raw = (ctx.chain[k - 1] & _MASK64).to_bytes(8, "little")
        return xxhash.xxh3_64_intdigest(ctx.model.encode() + b"\0" + raw)

    def select(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        matches: Mapping[NodeId, int],
        nodes: NodeTable,
        rng: Rng,
        now: float,
    ) -> RouteDecision | None:
        if not candidates:
            return None
        by_id = {s.node_id: s for s in candidates}
        total = sum(s.inflight for s in candidates)
        n = len(candidates)
        best = best_match(candidates, matches)
        threshold = self.load_factor * (total + 1) / n
        position = self.key(ctx)
        owner_state: NodeState | None = None  # first candidate of the walk
        if position is not None:
            self._ring(frozenset([*(s.node_id for s in nodes), *by_id]))
            size = len(self._positions)
            start = bisect.bisect_left(self._positions, position)
            seen: set[NodeId] = set()
            for i in range(size):
                owner = self._owners[(start + i) % size]
                state = by_id.get(owner)
                if state is None or owner in seen:
                    continue
                if owner_state is None:
                    owner_state = state
                if load_ok(state.inflight, total, n, self.load_factor):
                    return RouteDecision(
                        node_id=owner,
                        reason=RouteReason.HASH,
                        matched_blocks=match_of(matches, owner),
                        best_matched_blocks=best,
                        score=float(state.inflight),
                        parts={
                            "inflight": float(state.inflight),
                            "threshold": threshold,
                            "hops": float(len(seen)),
                        },
                    )
                seen.add(owner)
                if len(seen) == n:
                    break
        if owner_state is not None:
            chosen = owner_state  # nobody within the bound: keep the key's owner
        else:
            chosen = least_loaded(candidates, lambda s: float(s.inflight))
        return RouteDecision(
            node_id=chosen.node_id,
            reason=RouteReason.FALLBACK,
            matched_blocks=match_of(matches, chosen.node_id),
            best_matched_blocks=best,
            score=float(chosen.inflight),
            parts={
                "inflight": float(chosen.inflight),
                "threshold": threshold,
                "hops": float(n if position is not None else 0),
                "no_key": 1.0 if position is None else 0.0,
            },
        )

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        return None
