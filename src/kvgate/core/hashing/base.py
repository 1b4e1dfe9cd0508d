"""The :class:`Hasher` protocol and the chaining primitive every hasher shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from xxhash import xxh3_64_intdigest

from kvgate.core.errors import ConfigError
from kvgate.core.ids import BlockChain

# Bump when a serialisation or seed derivation changes, so that old and new
# gateways sharing an index (e.g. in Redis) never compare incompatible keys.
FORMAT_VERSION = "kvgate-v1"
CHARS_PER_TOKEN = 4

Message = tuple[str, str]  # (role, content)


class Hasher(Protocol):
    """Turns a request into its block chain. One index holds one key space."""

    # whether estimate_tokens_* count exactly (a tokenizer) or estimate (characters)
    counts_exact: ClassVar[bool]

    @property
    def key_space(self) -> str:
        """e.g. ``"text256"``, ``"tokens16:<tokenizer fingerprint>"``, ``"trace512"``."""
        ...

    @property
    def tokens_per_block(self) -> int:
        """Tokens one chain block stands for."""
        ...

    # ``model``: the requested model (or LoRA adapter) name. A non-empty one seeds the
    # chain, so one node's caches of two models (a base model and its adapters) never
    # match each other's requests; "" is the unscoped chain.
    def chain_for_prompt(self, text: str, model: str = "") -> BlockChain: ...

    def chain_for_messages(self, messages: Sequence[Message], model: str = "") -> BlockChain: ...

    def estimate_tokens_prompt(self, text: str) -> int: ...

    def estimate_tokens_messages(self, messages: Sequence[Message]) -> int: ...


def ensure_same_key_space(a: Hasher | str, b: Hasher | str) -> None:
    """Raise :class:`ConfigError` unless ``a`` and ``b`` share one key space."""
    ka = a if isinstance(a, str) else a.key_space
    kb = b if isinstance(b, str) else b.key_space
    if ka != kb:
        raise ConfigError(f"key spaces differ: {ka!r} vs {kb!r}; one index holds one key space")


def root_seed(*parts: str) -> int:
    """The seed of block 0: a constant of the key space (and of the input kind)."""
    return xxh3_64_intdigest("/".join((FORMAT_VERSION, *parts)).encode("utf-8"))


def chain_bytes(data: bytes, width: int, h: int) -> BlockChain:
    """``h_i = xxh3_64(block_i, seed=h_{i-1})`` over each full ``width``-byte block of ``data``.

    ``h`` is the seed of block 0. The trailing partial block is not a cache block.
    One memoryview slice and one xxh3 call per block.
    """
    view = memoryview(data)
    out: list[int] = []
    append = out.append
    hash_ = xxh3_64_intdigest
    for start in range(0, len(data) - width + 1, width):
        h = hash_(view[start : start + width], h)
        append(h)
    return tuple(out)


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def check_int(value: object, name: str, *, minimum: int, what: str) -> int:
    """``value`` as an int >= ``minimum`` (bools refused), else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}: {name} must be an int >= {minimum}, got {value!r}", param=name)
    return value
