"""Trace replay: requests carry ready block ids (Mooncake ``hash_ids``), not text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NoReturn

from kvgate.core.errors import ConfigError
from kvgate.core.hashing.base import Message, check_int
from kvgate.core.ids import BlockChain


def chain_from_ids(ids: Sequence[int]) -> BlockChain:
    """Ready block ids already chain (an id names its whole prefix), so keep them."""
    return tuple(ids)


class ReadyIdsHasher:
    """Key space ``trace<tokens_per_block>`` (Mooncake: 512 tokens a block).

    A trace deployment has no text: ``chain_for_*`` and ``estimate_tokens_*``
    raise :class:`ConfigError`; use :meth:`chain_from_ids` and the trace's
    token counts.
    """

    __slots__ = ("_tokens_per_block",)
    counts_exact: ClassVar[bool] = True  # the trace's own counts

    def __init__(self, tokens_per_block: int = 512) -> None:
        self._tokens_per_block = check_int(
            tokens_per_block, "tokens_per_block", minimum=1, what="trace hasher"
        )

    def __repr__(self) -> str:
        return f"ReadyIdsHasher(tokens_per_block={self._tokens_per_block})"

    @property
    def key_space(self) -> str:
        return f"trace{self._tokens_per_block}"

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    def chain_from_ids(self, ids: Sequence[int]) -> BlockChain:
        return chain_from_ids(ids)

    def _no_text(self) -> NoReturn:
        raise ConfigError(
            f"key space {self.key_space!r} replays trace block ids and has no text: "
            "use chain_from_ids and the trace's token counts"
        )

    def chain_for_prompt(self, text: str, model: str = "") -> BlockChain:
        self._no_text()

    def chain_for_messages(self, messages: Sequence[Message], model: str = "") -> BlockChain:
        self._no_text()

    def estimate_tokens_prompt(self, text: str) -> int:
        self._no_text()

    def estimate_tokens_messages(self, messages: Sequence[Message]) -> int:
        self._no_text()
