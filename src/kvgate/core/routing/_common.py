"""Small helpers the baseline policies share.

Everything here is pure and deterministic: candidates are ordered by ``slot``
(a node's stable small integer), so a tie always resolves the same way no matter
in which order the controller listed the candidates.

Units: ``matches`` counts chain blocks; one chain block stands for
``ctx.tokens_per_block`` tokens; a match never counts for more than the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState
from kvgate.core.routing.base import RouteContext, RouteReason

LoadKey = Callable[[NodeState], float]


def by_slot(candidates: Sequence[NodeState]) -> list[NodeState]:
    """The candidates in their stable order (ascending slot)."""
    return sorted(candidates, key=_slot)


def _slot(state: NodeState) -> int:
    return state.slot


def least_loaded(candidates: Sequence[NodeState], *keys: LoadKey) -> NodeState:
    """The candidate minimising ``keys`` in order, ties broken by the lower slot."""
    if not candidates:
        raise ValueError("least_loaded needs at least one candidate")
    return min(candidates, key=lambda s: (*(k(s) for k in keys), s.slot))


def match_of(matches: Mapping[NodeId, int], node_id: NodeId) -> int:
    """A node's matched prefix length in chain blocks (0 when absent)."""
    return max(0, matches.get(node_id, 0))


def best_match(candidates: Sequence[NodeState], matches: Mapping[NodeId, int]) -> int:
    """The longest match among the candidates (non-candidates in ``matches`` do not count)."""
    if not matches:
        return 0
    return max((match_of(matches, s.node_id) for s in candidates), default=0)


def cached_tokens(ctx: RouteContext, blocks: int) -> int:
    """Prompt tokens covered by a match of ``blocks`` chain blocks, capped at the prompt."""
    prompt = max(0, ctx.prompt_tokens)
    return min(prompt, max(0, blocks) * max(0, ctx.tokens_per_block))


def uncached_tokens(ctx: RouteContext, blocks: int) -> int:
    """Prompt tokens a node with a match of ``blocks`` chain blocks still has to prefill."""
    return max(0, ctx.prompt_tokens) - cached_tokens(ctx, blocks)


def match_rate(ctx: RouteContext, blocks: int) -> float:
    """Matched tokens over prompt tokens, in [0, 1] (0 for an empty prompt)."""
    if ctx.prompt_tokens <= 0:
        return 0.0
    return cached_tokens(ctx, blocks) / ctx.prompt_tokens


def cache_reason(chosen: int, best: int, *, lost: RouteReason = RouteReason.LOAD) -> RouteReason:
    """Why a node was chosen, seen from the cache.

    The best holder → ``CACHE_HIT``; a shorter holder → ``SPREAD``; a miss although a
    holder existed → ``lost`` (the policy says why it walked away); no holder → ``LOAD``.
    """
    if best <= 0:
        return RouteReason.LOAD
    if chosen >= best:
        return RouteReason.CACHE_HIT
    if chosen > 0:
        return RouteReason.SPREAD
    return lost


def require(ok: bool, policy: str, message: str) -> None:
    """Raise :class:`ConfigError` for a bad policy parameter."""
    if not ok:
        raise ConfigError(f"routing policy {policy!r}: {message}")
