"""Facts the drivers feed into the controller (past tense: they already happened)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.core.ids import DEFAULT_TENANT, NodeId, RequestId, TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived:
    """A client request reached the gateway.

    Exactly one prompt form is set: ``prompt`` (completions), ``messages`` (chat,
    as (role, content) pairs) or ``block_ids`` (trace replay: ready chained ids).
    """

    request_id: RequestId
    tenant: TenantId = DEFAULT_TENANT
    priority: int = 1  # 0 = P0 (most important) .. 2 = P2
    bypass: bool = False  # the caller holds the bypass role (probes, operators)
    model: str = ""
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    block_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None  # known token count (trace); else estimated
    # a completions prompt given as token ids (``prompt`` then holds them as text): a
    # token hasher chains the ids themselves, as the engine caches them
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 256
    # whether the client asked for max_tokens: without it vLLM generates what fits in
    # the context, so only the prompt must fit (max_tokens is then an output estimate)
    max_tokens_given: bool = True
    # A client's own retry names the node that failed it; the gateway routes around
    # it and does not retry this request again (one request, at most two attempts).
    excluded_nodes: frozenset[NodeId] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        forms = (
            (self.prompt is not None) + (self.messages is not None) + (self.block_ids is not None)
        )
        if forms != 1:
            raise ValueError("RequestArrived needs exactly one of prompt, messages, block_ids")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
