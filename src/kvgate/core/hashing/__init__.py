"""Prompt -> chain of 64-bit block hashes: the cache location table's key space.

A prompt is cut into fixed blocks; block *i* gets ``h_i = xxh3_64(block_i, seed=h_{i-1})``
and block 0 is seeded with a constant of the key space. Only **full** blocks are
keys (as in vLLM/SGLang): the trailing partial block is not a cache block. Equal
prefixes share their leading hashes, and ``h_i`` stands for the whole prefix up
to block *i*. One index holds one key space (:func:`ensure_same_key_space`):

* :class:`TextChunkHasher` ``"text256"`` (default, approximate mode): blocks of N
  characters of a canonical string (:func:`canonical_messages` for chats); no tokenizer.
* :class:`TokenBlockHasher` ``"tokens16:<fingerprint>"`` (precise mode): blocks of
  token ids packed as little-endian u32, from a local tokenizer file.
* :class:`ReadyIdsHasher` ``"trace512"``: trace replay ids (:func:`chain_from_ids`).

:func:`make_hasher` builds one from config.
"""

from __future__ import annotations

from os import PathLike

from kvgate.core.errors import ConfigError
from kvgate.core.hashing.base import Hasher, Message, check_int, ensure_same_key_space
from kvgate.core.hashing.sim_tokens import SimTokenizer
from kvgate.core.hashing.text import TextChunkHasher, canonical_messages
from kvgate.core.hashing.tokens import (
    DEFAULT_CHAT_TEMPLATE,
    HFTokenizer,
    TokenBlockHasher,
    TokenEncoder,
    load_tokenizer,
)
from kvgate.core.hashing.trace import ReadyIdsHasher, chain_from_ids

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "HFTokenizer",
    "Hasher",
    "Message",
    "ReadyIdsHasher",
    "TextChunkHasher",
    "TokenBlockHasher",
    "TokenEncoder",
    "canonical_messages",
    "chain_from_ids",
    "ensure_same_key_space",
    "load_tokenizer",
    "make_hasher",
]

_PARAMS: dict[str, frozenset[str]] = {
    "text": frozenset({"block_chars"}),
    "tokens": frozenset({"path", "block_size", "chat_template"}),
    "trace": frozenset({"tokens_per_block"}),
    "sim": frozenset({"block_size", "chat_template"}),
}


def make_hasher(kind: str, **params: object) -> Hasher:
    """Build a hasher from config; unknown kinds or params raise :class:`ConfigError`.

    * ``"text"``: ``block_chars=256``
    * ``"tokens"``: ``path`` (tokenizer.json, required), ``block_size=16``, ``chat_template=None``
    * ``"trace"``: ``tokens_per_block=512``
    * ``"sim"``: ``block_size=16``, ``chat_template=None``: the token hasher over
      ``kvgate engine``'s own tokenizer (precise mode in front of simulated engines)
    """
    allowed = _PARAMS.get(kind)
    if allowed is None:
        raise ConfigError(
            f"unknown hasher kind {kind!r}; expected one of {sorted(_PARAMS)}", param="kind"
        )
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown params for hasher {kind!r}: {unknown}; allowed: {sorted(allowed)}",
            param=unknown[0],
        )
    if kind == "text":
        return TextChunkHasher(
            check_int(params.get("block_chars", 256), "block_chars", minimum=4, what="text hasher")
        )
    if kind == "trace":
        return ReadyIdsHasher(
            check_int(
                params.get("tokens_per_block", 512),
                "tokens_per_block",
                minimum=1,
                what="trace hasher",
            )
        )
    template = params.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ConfigError("hasher param 'chat_template' must be a str", param="chat_template")
    block_size = check_int(
        params.get("block_size", 16), "block_size", minimum=1, what="token hasher"
    )
    if kind == "sim":
        return TokenBlockHasher(SimTokenizer(), block_size, chat_template=template)
    path = params.get("path")
    if not isinstance(path, str | PathLike):
        raise ConfigError("hasher 'tokens' needs 'path' to a tokenizer.json file", param="path")
    return TokenBlockHasher.from_file(path, block_size, template)
