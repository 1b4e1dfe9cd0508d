"""The default, tokenizer-free hasher: blocks of N characters of a canonical string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvgate.core.hashing.base import (
    CHARS_PER_TOKEN,
    Message,
    ceil_div,
    chain_bytes,
    check_int,
    root_seed,
)
from kvgate.core.ids import BlockChain


def canonical_messages(messages: Sequence[Message]) -> str:
    """The canonical string of a chat history that :class:`TextChunkHasher` cuts.

    Each message is ``RS len(role) US role len(content) US content`` with
    ``RS = "\\x1e"``, ``US = "\\x1f"`` and lengths in decimal characters. Both
    fields are length-prefixed, so the encoding is injective for any strings,
    and nothing depends on a message being last, so a conversation's string is a
    prefix of its continuation's (the property prefix caching needs).
    """
    return "".join([f"\x1e{len(r)}\x1f{r}{len(c)}\x1f{c}" for r, c in messages])


def _canonical_messages_len(messages: Sequence[Message]) -> int:
    return sum(3 + len(r) + len(c) + len(str(len(r))) + len(str(len(c))) for r, c in messages)


class TextChunkHasher:
    """Blocks of ``block_chars`` characters; ``block_chars // 4`` tokens a block.

    Blocks are N **characters** (code points) of the canonical string, not bytes,
    so they never split a character. Each block is hashed as the UTF-32-LE bytes
    of its characters (lone surrogates kept with ``surrogatepass``, so every
    ``str`` is accepted): a block's bytes depend on its characters only, never on
    the rest of the prompt, and the string is encoded once then sliced, at the
    same speed for ASCII and non-ASCII text (~40 us for 32k characters).

    A completion prompt is its own canonical string; chat messages use
    :func:`canonical_messages`. The two are seeded differently, so a raw prompt
    never collides with a serialised chat. 256 characters ~ 64 tokens, the
    granularity of llm-d's approximate prefix index.
    """

    __slots__ = ("_block_chars", "_key_space", "_seed_messages", "_seed_prompt", "_width")
    counts_exact: ClassVar[bool] = False  # characters / 4

    def __init__(self, block_chars: int = 256) -> None:
        self._block_chars = check_int(
            block_chars, "block_chars", minimum=CHARS_PER_TOKEN, what="text hasher"
        )
        self._width = 4 * block_chars  # UTF-32 bytes per block
        self._key_space = f"text{block_chars}"
        self._seed_prompt = root_seed(self._key_space, "prompt")
        self._seed_messages = root_seed(self._key_space, "messages")

    def __repr__(self) -> str:
        return f"TextChunkHasher(block_chars={self._block_chars})"

    @property
    def key_space(self) -> str:
        return self._key_space

    @property
    def tokens_per_block(self) -> int:
        return self._block_chars // CHARS_PER_TOKEN

    @property
    def block_chars(self) -> int:
        return self._block_chars

    def _chain(self, text: str, seed: int) -> BlockChain:
        if len(text) < self._block_chars:
            return ()
        return chain_bytes(text.encode("utf-32-le", "surrogatepass"), self._width, seed)

    def chain_for_prompt(self, text: str, model: str = "") -> BlockChain:
        seed = root_seed(self._key_space, "prompt", model) if model else self._seed_prompt
        return self._chain(text, seed)

    def chain_for_messages(self, messages: Sequence[Message], model: str = "") -> BlockChain:
        seed = root_seed(self._key_space, "messages", model) if model else self._seed_messages
        return self._chain(canonical_messages(messages), seed)

    def estimate_tokens_prompt(self, text: str) -> int:
        """Characters / 4, rounded up."""
        return ceil_div(len(text), CHARS_PER_TOKEN)

    def estimate_tokens_messages(self, messages: Sequence[Message]) -> int:
        """Characters of the canonical string / 4, rounded up (headers stand for the template)."""
        return ceil_div(_canonical_messages_len(messages), CHARS_PER_TOKEN)
