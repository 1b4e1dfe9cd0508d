"""The simulated engine's tokenizer, as a ``TokenEncoder`` the gateway can use too.

``kvgate engine`` has no tokenizer file: it cuts text into pieces of
``CHARS_PER_TOKEN`` characters (code points; the last piece may be shorter), one
token per piece, id ``xxh3_64(piece as UTF-8, seed=TOKEN_SEED) % SIM_VOCAB_SIZE``,
no special tokens. It lives in the core, not in the engine, because a gateway in
precise mode must tokenize prompts exactly as its engines do: hasher ``sim``
(``make_hasher("sim", block_size=16)``) is a :class:`TokenBlockHasher` over it, so the
keys a request's chain gives and the keys rebuilt from the engine's ``BlockStored``
token ids are the same.
"""

from __future__ import annotations

from typing import Final

from xxhash import xxh3_64_intdigest

from kvgate.core.hashing.base import CHARS_PER_TOKEN

__all__ = ["SIM_VOCAB_SIZE", "TOKEN_SEED", "SimTokenizer"]

SIM_VOCAB_SIZE: Final = 32_000  # Llama-2-sized vocabulary
TOKEN_SEED: Final = 0x6B76_6761_7465  # "kvgate"


class SimTokenizer:
    """The deterministic 4-characters-a-token encoder (a ``TokenEncoder``)."""

    __slots__ = ()

    @property
    def fingerprint(self) -> str:
        return f"kvgate-sim-c{CHARS_PER_TOKEN}-v{SIM_VOCAB_SIZE}-s{TOKEN_SEED:x}"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` is accepted and ignored."""
        h = xxh3_64_intdigest
        vocab = SIM_VOCAB_SIZE
        seed = TOKEN_SEED
        return [
            h(text[i : i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass"), seed) % vocab
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]
