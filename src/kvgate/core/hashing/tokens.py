"""The precise-mode hasher: blocks of ``block_size`` token ids from a local tokenizer."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from os import PathLike, fspath
from typing import ClassVar, Protocol

from xxhash import xxh3_64_hexdigest

from kvgate.core.errors import ClientRequestError, ConfigError
from kvgate.core.hashing.base import Message, chain_bytes, check_int, root_seed
from kvgate.core.ids import BlockChain, BlockHash

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"

_BIG_ENDIAN = sys.byteorder == "big"
_U32 = "I" if array("I").itemsize == 4 else "L"  # "I" is 4 bytes on every mainstream ABI


class TokenEncoder(Protocol):
    """The tokenizer a :class:`TokenBlockHasher` needs (``from_file`` wraps HF ``tokenizers``)."""

    @property
    def fingerprint(self) -> str:
        """Identifies the vocabulary: equal fingerprints give equal ids for equal text."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool) -> Sequence[int]: ...


class _EncodingLike(Protocol):
    @property
    def ids(self) -> list[int]: ...


class _HFTokenizerLike(Protocol):
    def to_str(self) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> _EncodingLike: ...


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` as a :class:`TokenEncoder`; fingerprint = xxh3 of its JSON."""

    __slots__ = ("_fingerprint", "_tok")

    def __init__(self, tok: _HFTokenizerLike) -> None:
        self._tok = tok
        self._fingerprint = xxh3_64_hexdigest(tok.to_str().encode("utf-8"))

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str, *, add_special_tokens: bool) -> Sequence[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids


def load_tokenizer(path: str | PathLike[str]) -> HFTokenizer:
    """Load a local ``tokenizer.json``; :class:`ConfigError` if missing, bad, or no extra."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ConfigError(
            "the token hasher needs the 'tokenizers' package: pip install 'kvgate[tokenizers]'"
        ) from exc
    p = fspath(path)
    try:
        tok = Tokenizer.from_file(p)
    except Exception as exc:  # the Rust side raises a bare Exception on a missing/bad file
        raise ConfigError(f"cannot load tokenizer file {p!r}: {exc}", param="path") from exc
    return HFTokenizer(tok)


def _check_template(template: object) -> str:
    if not isinstance(template, str):
        raise ConfigError("chat_template must be a str", param="chat_template")
    try:
        template.format(role="r", content="c")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"chat_template must be a format string using only {{role}} and {{content}}: {exc}",
            param="chat_template",
        ) from exc
    return template


class TokenBlockHasher:
    """Blocks of ``block_size`` token ids, each block packed as little-endian u32.

    Key space ``tokens<block_size>:<tokenizer fingerprint>``: two tokenizers or
    block sizes never mix. The chat template is not part of it, since keys name
    token sequences, whoever rendered them.

    * Prompts are tokenized with special tokens (vLLM adds BOS for completions).
    * Messages are rendered with a per-message format string (default
      :data:`DEFAULT_CHAT_TEMPLATE`, ``"<|role|>\\ncontent\\n"``), concatenated and
      tokenized once without special tokens. This is NOT the model's chat
      template: precise mode (matching engine KV events) needs the model's real
      template, or the engine's ``/tokenize`` / render endpoints, to get the
      engine's exact ids.

    The last tokenization is memoised, so ``chain_for_*`` followed by
    ``estimate_tokens_*`` (exact counts) tokenizes once.
    """

    __slots__ = ("_block_size", "_encoder", "_key_space", "_last", "_root", "_template")
    counts_exact: ClassVar[bool] = True  # the tokenizer's own count

    def __init__(
        self,
        tokenizer: TokenEncoder,
        block_size: int = 16,
        *,
        chat_template: str | None = None,
    ) -> None:
        self._block_size = check_int(block_size, "block_size", minimum=1, what="token hasher")
        self._encoder = tokenizer
        self._template = _check_template(
            DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template
        )
        self._key_space = f"tokens{block_size}:{tokenizer.fingerprint}"
        self._root = root_seed(self._key_space)
        self._last: tuple[object, Sequence[int]] = ((), ())

    @classmethod
    def from_file(
        cls,
        path: str | PathLike[str],
        block_size: int = 16,
        chat_template: str | None = None,
    ) -> TokenBlockHasher:
        """Load a local ``tokenizer.json`` (HF ``tokenizers``, extra ``kvgate[tokenizers]``)."""
        return cls(load_tokenizer(path), block_size, chat_template=chat_template)

    def __repr__(self) -> str:
        return f"TokenBlockHasher(key_space={self._key_space!r})"

    @property
    def key_space(self) -> str:
        return self._key_space

    @property
    def tokens_per_block(self) -> int:
        return self._block_size

    @property
    def block_size(self) -> int:
        return self._block_size

    def chain_for_tokens(
        self, ids: Sequence[int], *, parent: BlockHash | None = None, model: str = ""
    ) -> BlockChain:
        """Chain over the full blocks of ``ids``.

        ``parent`` continues a chain whose last key is known (an engine
        ``BlockStored`` event carries the tokens of the blocks after
        ``parent_block_hash``); ``None`` starts from the key space's root, or from
        ``model``'s root when a model (or LoRA adapter) name is given.
        Ids outside ``[0, 2**32)`` raise :class:`ClientRequestError`.
        """
        try:
            packed = array(_U32, ids)
        except (OverflowError, TypeError) as exc:
            # Python's own text ("unsigned int is greater than maximum") is no answer
            raise ClientRequestError(
                "token ids must be integers >= 0 and < 2**32", param="token_ids"
            ) from exc
        if _BIG_ENDIAN:
            packed.byteswap()
        if parent is not None:
            seed = parent
        else:
            seed = root_seed(self._key_space, model) if model else self._root
        return chain_bytes(packed.tobytes(), 4 * self._block_size, seed)

    def render_messages(self, messages: Sequence[Message]) -> str:
        """The text the messages are tokenized from (the simple template, per message)."""
        template = self._template
        return "".join([template.format(role=r, content=c) for r, c in messages])

    def tokens_for_prompt(self, text: str) -> Sequence[int]:
        key = ("p", text)
        last_key, last_ids = self._last
        if key == last_key:
            return last_ids
        return self._remember(key, self._encoder.encode(text, add_special_tokens=True))

    def tokens_for_messages(self, messages: Sequence[Message]) -> Sequence[int]:
        key = ("m", tuple(messages))
        last_key, last_ids = self._last
        if key == last_key:
            return last_ids
        text = self.render_messages(messages)
        return self._remember(key, self._encoder.encode(text, add_special_tokens=False))

    def _remember(self, key: object, ids: Sequence[int]) -> Sequence[int]:
        self._last = (key, ids)  # one atomic store: safe if hashed off the event loop
        return ids

    def chain_for_prompt(self, text: str, model: str = "") -> BlockChain:
        return self.chain_for_tokens(self.tokens_for_prompt(text), model=model)

    def chain_for_messages(self, messages: Sequence[Message], model: str = "") -> BlockChain:
        return self.chain_for_tokens(self.tokens_for_messages(messages), model=model)

    def estimate_tokens_prompt(self, text: str) -> int:
        """Exact token count."""
        return len(self.tokens_for_prompt(text))

    def estimate_tokens_messages(self, messages: Sequence[Message]) -> int:
        """Exact token count of the rendered messages."""
        return len(self.tokens_for_messages(messages))
