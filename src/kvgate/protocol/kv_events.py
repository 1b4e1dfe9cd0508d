"""vLLM KV-cache event values and the per-version field sets of vLLM's event structs.

The values mirror vLLM's msgspec structs (``vllm/distributed/kv_events.py``):
``KVEventBatch`` holding ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``. Only the fields every consumer needs are attributes; all
other non-``None`` fields (``lora_name``, ``extra_keys``, ``group_idx``,
``kv_cache_spec_kind``, ``session_id``, ... and unknown future ones) are kept in
``extra``, so decoding and re-encoding loses nothing the chosen version knows.

:data:`SCHEMAS` lists which fields each vLLM release declares, in declaration
order (the array position in the array layout), how many of them have no
default (always emitted in the map layout) and the release's layout and replay
framing. New fields were only ever appended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.protocol.errors import KvEventWireError

__all__ = [
    "LATEST_VLLM_VERSION",
    "SCHEMAS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "Layout",
    "WireSchema",
    "block_hash_to_int",
    "gpu_block_removed",
    "gpu_block_stored",
    "schema_for",
]

BlockHash = int | bytes
Layout = Literal["array", "map"]
U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks entered the prefix cache. Hash ``i``'s parent is hash ``i-1``; the
    first hash's parent is ``parent_block_hash`` (``None`` = start of sequence).

    ``extra`` holds every other field that is not ``None`` (``lora_name``,
    ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ..., unknown future
    fields too), with arrays as tuples.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def group_idx(self) -> int | None:
        value = self.extra.get("group_idx")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def lora_name(self) -> str | None:
        value = self.extra.get("lora_name")
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Blocks were evicted (one hash per block; vLLM's GPU pool sends one per event)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def group_idx(self) -> int | None:
        value = self.extra.get("group_idx")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """The engine (this DP rank) emptied its prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventBatch:
    """One scheduler step's events, in the order they must be applied."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WireSchema:
    """The event field lists (declaration order) of a range of vLLM releases.

    The first ``*_required`` fields have no default: the map layout always emits
    them; the rest are omitted when ``None``.
    """

    since: tuple[int, ...]
    stored_fields: tuple[str, ...]
    stored_required: int
    removed_fields: tuple[str, ...]
    removed_required: int
    layout: Layout
    replay_topic_frame: bool


CORE_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_S20 = (*CORE_FIELDS, "medium", "lora_name", "extra_keys", "group_idx")
_S22 = (*_S20, "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_S26 = (*_S22, "locality")
_S30 = (*_S26, "ownership", "session_id")
_S33 = (*_S30, "lookahead_token_ids")
_R20 = ("block_hashes", "medium", "group_idx")


def _schema(since: tuple[int, ...], stored: tuple[str, ...], s_req: int,
            removed: tuple[str, ...], r_req: int, layout: Layout, topic: bool) -> WireSchema:
    return WireSchema(since=since, stored_fields=stored, stored_required=s_req,
                      removed_fields=removed, removed_required=r_req, layout=layout,
                      replay_topic_frame=topic)


#: Field sets by the first vLLM release that has them (releases examined:
#: 0.10.0, 0.11.0, 0.20.0, 0.22.0-0.26.0, 0.28.0, 0.30.0, 0.33.0).
SCHEMAS: tuple[WireSchema, ...] = (
    _schema((0, 10, 0), CORE_FIELDS, 5, ("block_hashes",), 1, "array", False),
    _schema((0, 11, 0), (*CORE_FIELDS, "medium"), 6, ("block_hashes", "medium"), 2, "array", False),
    _schema((0, 20, 0), _S20, 7, _R20, 2, "array", False),
    _schema((0, 22, 0), _S22, 7, _R20, 2, "array", False),
    _schema((0, 24, 0), _S22, 7, _R20, 2, "map", False),
    _schema((0, 26, 0), _S26, 7, (*_R20, "locality"), 2, "map", True),
    _schema((0, 30, 0), _S30, 7, (*_R20, "locality", "ownership"), 2, "map", True),
    _schema((0, 33, 0), _S33, 7, (*_R20, "locality", "ownership"), 2, "map", True),
)
LATEST_VLLM_VERSION = "0.33.0"
NEWEST_SCHEMA = SCHEMAS[-1]


def _parse_version(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.strip().lstrip("v").split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            raise KvEventWireError(f"unparseable vLLM version {version!r}", param="vllm_version")
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def schema_for(vllm_version: str = LATEST_VLLM_VERSION) -> WireSchema:
    """The field set of ``vllm_version`` (the newest known set at or below it)."""
    wanted = _parse_version(vllm_version)
    found = None
    for schema in SCHEMAS:
        if schema.since <= wanted:
            found = schema
    if found is None:
        raise KvEventWireError(f"vLLM {vllm_version} predates KV events", param="vllm_version")
    return found


def gpu_block_stored(block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
                     token_ids: Sequence[int], block_size: int, *, group_idx: int = 0,
                     kv_cache_spec_kind: str = "full_attention",
                     extra_keys: Sequence[tuple[str, ...] | None] | None = None) -> BlockStored:
    """A ``BlockStored`` with the field values vLLM's GPU block pool sets for a
    full-attention model without LoRA; ``extra_keys`` per block (a cache_salt on the
    first), else none."""
    extra = (None,) * len(block_hashes) if extra_keys is None else tuple(extra_keys)
    return BlockStored(
        block_hashes=tuple(block_hashes), parent_block_hash=parent_block_hash,
        token_ids=tuple(token_ids), block_size=block_size, lora_id=None, medium="GPU",
        extra={"extra_keys": extra, "group_idx": group_idx,
               "kv_cache_spec_kind": kv_cache_spec_kind},
    )


def gpu_block_removed(block_hashes: Sequence[BlockHash], *, group_idx: int = 0) -> BlockRemoved:
    """A ``BlockRemoved`` as vLLM's GPU block pool sends it."""
    return BlockRemoved(block_hashes=tuple(block_hashes), medium="GPU",
                        extra={"group_idx": group_idx})


def block_hash_to_int(block_hash: BlockHash) -> int:
    """Normalise a hash to vLLM's int form: the low 64 bits (last 8 bytes big-endian)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & U64

