"""What routing is told of an arriving request: its block chain, its token count and
the :class:`~kvgate.core.routing.RouteContext` every policy scores it by.

The controller hashes the prompt before admission (stage 1 needs its token count) and
builds the context only for requests stage 1 let in, so a refused request never counts
toward a hot prefix's arrival rate.
"""

from __future__ import annotations

from kvgate.core.config import ControllerConfig
from kvgate.core.events import RequestArrived
from kvgate.core.hashing import Hasher, TokenBlockHasher, chain_from_ids
from kvgate.core.ids import BlockChain
from kvgate.core.index import HotPrefixTracker
from kvgate.core.routing import RouteContext


def prompt_chain(hasher: Hasher, req: RequestArrived) -> tuple[BlockChain, int]:
    """The request's block chain and its prompt token count (estimated if unknown), from
    the most exact form the request carries: trace block ids, chat messages, token ids
    (a token hasher only), or the prompt text."""
    if req.block_ids is not None:
        chain = chain_from_ids(req.block_ids)
        tokens = req.prompt_tokens
        if tokens is None:
            tokens = len(chain) * hasher.tokens_per_block
    elif req.messages is not None:
        chain = hasher.chain_for_messages(req.messages, req.model)
        tokens = req.prompt_tokens or hasher.estimate_tokens_messages(req.messages)
    elif req.prompt_token_ids is not None and isinstance(hasher, TokenBlockHasher):
        chain = hasher.chain_for_tokens(req.prompt_token_ids, model=req.model)
        tokens = len(req.prompt_token_ids)
    else:
        assert req.prompt is not None
        chain = hasher.chain_for_prompt(req.prompt, req.model)
        tokens = req.prompt_tokens or hasher.estimate_tokens_prompt(req.prompt)
    return chain, tokens


class RouteContexts:
    """Builds each admitted request's :class:`RouteContext`, and keeps the arrival rate
    of hot prefixes (for replication) when the policy reads it."""

    def __init__(
        self, config: ControllerConfig, hasher: Hasher, *, hot_rate: bool, fleet: bool
    ) -> None:
        self.config = config
        self.hasher = hasher
        self.hot = HotPrefixTracker(window_s=config.hot_window_s)
        self._hot_rate = hot_rate  # the policy reads hot_rate: record every arrival
        self._fleet = fleet

    def build(
        self,
        chain: BlockChain,
        tokens: int,
        req: RequestArrived,
        now: float,
        context_tokens: int,
    ) -> RouteContext:
        """``context_tokens``: what the request may take of a node's context window
        (prompt plus output; an estimated prompt's with the estimate's slack)."""
        hot_key: int | None = None
        hot_blocks = 0
        rate = 0.0
        if chain:
            hot_blocks = min(self.config.hot_prefix_blocks, len(chain))
            hot_key = chain[hot_blocks - 1]
            if self._hot_rate:
                self.hot.record(hot_key, now)
                rate = self.hot.rate(hot_key, now)
        return RouteContext(
            chain=chain,
            prompt_tokens=tokens,
            tokens_per_block=self.hasher.tokens_per_block,
            max_tokens=req.max_tokens,
            context_tokens=context_tokens,
            model=req.model,
            hot_key=hot_key,
            hot_blocks=hot_blocks,
            hot_rate=rate,
            fleet=self._fleet,
            request_id=req.request_id,
            # P0's first token is owed within the P0 TTFT SLO from its arrival
            ttft_target_s=self.config.admission.slo.p0_ttft_p99_s
            if req.priority == 0 and not req.bypass
            else 0.0,
        )
