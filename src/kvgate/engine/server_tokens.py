"""Text -> tokens for the simulated engine's HTTP shell, without a tokenizer file.

Theory of operation
-------------------
The engine needs a prompt's token count, the chained hashes of its FULL blocks
and (for vLLM-exact `BlockStored` events) its token ids. The shell derives all
three from text with a deterministic "tokenizer" (pure; stable across runs,
machines and PYTHONHASHSEED):

* the text is cut into pieces of 4 characters (code points; the last piece
  may be shorter), one token per piece: ``ceil(len(text) / 4)`` tokens, the
  same 4-characters-a-token rule the text-chunk hasher estimates with;
* token id = ``xxh3_64(piece as UTF-8, seed=TOKEN_SEED) % SIM_VOCAB_SIZE``
  (32 000 ids); no special tokens (no BOS);
* completions: the prompt string as it is; a prompt of token ids is used as
  it is (ids must be in ``[0, 2**32)``);
* chat: the messages rendered exactly as :class:`TokenBlockHasher` renders them
  (``DEFAULT_CHAT_TEMPLATE`` = ``"<|{role}|>\\n{content}\\n"`` per message,
  concatenated, no generation prompt), so a history renders to a prefix of its
  continuation;
* block hashes: ``TokenBlockHasher(SimTokenizer(), block_size).chain_for_tokens``
  over the token ids (xxh3 over little-endian u32 blocks, chained).

So identical prefixes give identical engine blocks (a repeated prompt hits the
prefix cache), and a gateway in precise mode that builds
``TokenBlockHasher(SimTokenizer(), block_size)`` (see :func:`sim_token_hasher`)
computes the same token ids as the engine and, for prompt blocks, keys equal
to the engine's own block hashes. Alignment caveat: pieces are cut from the
start of the whole rendered text, so tokens after a turn boundary that is not
a multiple of 4 characters shift; the cached prefix then ends at that boundary.

Generated tokens: output token ``i`` of a request has the engine's id
``generated_token_id(request_id, i)`` and the text :func:`token_text` of it,
a short word with a leading space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvgate.core.errors import ClientRequestError
from kvgate.core.hashing import Message, TokenBlockHasher
from kvgate.core.hashing.base import CHARS_PER_TOKEN
from kvgate.core.hashing.sim_tokens import TOKEN_SEED, SimTokenizer
from kvgate.engine.sequence import generated_token_id
from kvgate.protocol import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from kvgate.protocol.errors import InvalidValueError
from kvgate.protocol.openai_schema import edit_body

__all__ = [
    "CHARS_PER_TOKEN",
    "TOKEN_SEED",
    "PromptTokenizer",
    "SimTokenizer",
    "SimTokens",
    "generated_text",
    "sim_token_hasher",
    "token_text",
    "tokenize_body",
]

_WORDS: Final = (
    "the", "cache", "block", "token", "node", "route", "prefix", "batch",
    "queue", "model", "fast", "warm", "cold", "hit", "miss", "load",
    "step", "page", "pool", "lease", "score", "path", "gate", "flow",
    "chunk", "event", "stream", "reply", "quick", "brown", "fox", "jumps",
    "over", "lazy", "dog", "and", "then", "some", "more", "data",
    "of", "a", "to", "in", "is", "it", "on", "with",
    "as", "at", "by", "for", "from", "or", "an", "be",
    "this", "that", "we", "you", "they", "all", "new", "old",
)


def sim_token_hasher(block_size: int) -> TokenBlockHasher:
    """The precise-mode hasher that reproduces the simulated engine's tokens."""
    return TokenBlockHasher(SimTokenizer(), block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimTokens:
    """A prompt as the engine sees it."""

    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # one per FULL block
    cache_salt: str | None = None  # it roots the chain (and its first block's extra key)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PromptTokenizer:
    """Prompts and chats -> :class:`SimTokens` at one block size."""

    __slots__ = ("_encoder", "_hasher")

    def __init__(self, block_size: int) -> None:
        self._encoder = SimTokenizer()
        self._hasher = TokenBlockHasher(self._encoder, block_size)

    @property
    def block_size(self) -> int:
        return self._hasher.block_size

    def for_prompt(self, text: str, *, salt: str | None = None) -> SimTokens:
        return self.for_token_ids(self._encoder.encode(text), salt=salt)

    def source(self, parsed: CompletionRequest | ChatRequest) -> str | Sequence[int]:
        """What ``parsed``'s prompt is tokenized from: its text (a chat rendered by the
        template) or the token ids it gave. Cheap: nothing is encoded or hashed."""
        if isinstance(parsed, ChatRequest):
            return self._hasher.render_messages(parsed.messages)
        if parsed.prompt_token_ids is not None:
            return parsed.prompt_token_ids
        return parsed.prompt_text or ""

    @staticmethod
    def count(source: str | Sequence[int]) -> int:
        """The number of tokens :meth:`for_source` gives ``source``, without encoding it:
        the ids as given, or one token per 4 characters (code points, as
        :meth:`SimTokenizer.encode` cuts them), so a prompt too long for the model can
        be refused before it is tokenized."""
        if isinstance(source, str):
            return -(-len(source) // CHARS_PER_TOKEN)
        return len(source)

    def for_source(self, source: str | Sequence[int], *, salt: str | None = None) -> SimTokens:
        """``source`` tokenized and hashed; a ``cache_salt`` seeds the chain, so requests
        with another salt (or none) share no cached block with it, as in vLLM."""
        if isinstance(source, str):
            return self.for_prompt(source, salt=salt)
        return self.for_token_ids(source, salt=salt)

    def for_messages(self, messages: Sequence[Message]) -> SimTokens:
        return self.for_prompt(self._hasher.render_messages(messages))

    def for_completion(self, parsed: CompletionRequest) -> SimTokens:
        if parsed.prompt_token_ids is not None:
            return self.for_token_ids(parsed.prompt_token_ids)
        return self.for_prompt(parsed.prompt_text or "")

    def for_token_ids(self, ids: Sequence[int], param: str = "prompt", *,
                      salt: str | None = None) -> SimTokens:
        """Token ids as given; ids outside ``[0, 2**32)`` raise a 400-mapped error."""
        try:
            # a salt roots the chain apart (the hasher's per-name root, under a prefix
            # no model name of ours takes)
            chain = self._hasher.chain_for_tokens(ids, model=f"\0salt:{salt}" if salt else "")
        except ClientRequestError as exc:
            raise InvalidValueError(f"Invalid '{param}': {exc.message}", param=param) from exc
        return SimTokens(token_ids=tuple(ids), block_hashes=chain, cache_salt=salt or None)


def token_text(token_id: int) -> str:
    """The text of a generated token: a short word with a leading space."""
    return " " + _WORDS[token_id % len(_WORDS)]


def generated_text(request_id: str, start: int, count: int) -> list[str]:
    """Texts of output tokens ``start .. start+count-1`` of ``request_id``."""
    return [token_text(generated_token_id(request_id, i)) for i in range(start, start + count)]


def tokenize_body(body: bytes, obj: Mapping[str, Any], tokens: PromptTokenizer,
                  model: str) -> SimTokens:
    """vLLM ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` (validated as the
    generation endpoints validate them; ``model`` optional, and whether it names this
    engine's is the caller's check). ``obj`` is ``body`` parsed. Raises ProtocolError.

    The client's bytes are validated as sent; a missing ``model`` is spliced in
    (``edit_body``), never a re-serialisation of the client's structures (a deeply
    nested extra field cannot be written back: a 400 at worst, not a crash)."""
    filled = body if obj.get("model") is not None else edit_body(body, obj, {"model": model})
    if "messages" in obj:
        return tokens.for_messages(parse_chat_request(filled).messages)
    return tokens.for_completion(parse_completion_request(filled))
