"""vLLM KV-cache events on the wire: msgpack decoding and byte-exact encoding.

A ZMQ PUB message from vLLM's ``ZmqEventPublisher`` has three frames:
``[topic (UTF-8), seq (8-byte big-endian unsigned), payload (msgpack)]``. The
payload is msgspec's encoding of ``KVEventBatch``, always the 3-element array
``[ts: float64, events: array, data_parallel_rank: int | nil]``. Each event is a
msgspec tagged union:

* array layout (vLLM <= 0.23): ``["BlockStored", block_hashes, parent, ...]``,
  every declared field present, trailing ``nil``s included;
* map layout (vLLM >= 0.24): ``{"type": "BlockStored", "block_hashes": ..., ...}``,
  fields without a default always present, defaulted fields omitted when they
  equal their default (``None``).

Block hashes are ``uint64`` ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the
default) or raw 32-byte digests. Decoding accepts every variant; encoding
reproduces msgspec's bytes for a chosen vLLM version (see
:data:`kvgate.protocol.kv_events.SCHEMAS`),
including msgspec's choice of map header, which is sized for the *declared*
number of fields (a 0.33 ``BlockStored`` gets a ``map16`` header even when it
carries 11 entries). Everything here is pure: frames are ``list[bytes]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import msgpack  # type: ignore[import-untyped]

from kvgate.protocol.errors import KvEventWireError
from kvgate.protocol.kv_events import (
    CORE_FIELDS,
    LATEST_VLLM_VERSION,
    NEWEST_SCHEMA,
    SCHEMAS,
    U64,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    Layout,
    WireSchema,
    block_hash_to_int,
    gpu_block_removed,
    gpu_block_stored,
    schema_for,
)

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
    "decode_batch",
    "decode_frames",
    "decode_seq",
    "encode_batch",
    "encode_frames",
    "encode_seq",
    "gpu_block_removed",
    "gpu_block_stored",
    "schema_for",
]

# ----------------------------------------------------------------------------- decoding


def encode_seq(seq: int) -> bytes:
    if not 0 <= seq <= U64:
        raise KvEventWireError(f"seq {seq} does not fit in 8 unsigned bytes", param="seq")
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventWireError(f"seq frame must be 8 bytes, got {len(frame)}", param="seq")
    return int.from_bytes(frame, "big")


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, KVEventBatch]:
    """``[topic, seq, payload]`` of one PUB message -> ``(topic, seq, batch)``."""
    if len(frames) != 3:
        raise KvEventWireError(f"expected 3 frames, got {len(frames)}", param="frames")
    topic_frame, seq_frame, payload = frames
    try:
        topic = bytes(topic_frame).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvEventWireError("topic frame is not UTF-8", param="topic") from exc
    return topic, decode_seq(bytes(seq_frame)), decode_batch(bytes(payload))


def _unpack(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, RecursionError) as exc:
        raise KvEventWireError(f"bad msgpack payload: {exc}", param="payload") from exc


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return {k: _freeze(v) for k, v in value.items()}
    return value


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a msgpack ``KVEventBatch`` in either event layout and either hash kind."""
    obj = _unpack(payload)
    if not isinstance(obj, list) or len(obj) < 2:
        raise KvEventWireError("batch must be an array [ts, events, dp_rank]", param="batch")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if not (_is_int(ts) or isinstance(ts, float)):
        raise KvEventWireError("batch ts must be a number", param="ts")
    if not isinstance(events, list):
        raise KvEventWireError("batch events must be an array", param="events")
    if rank is not None and not _is_int(rank):
        raise KvEventWireError("data_parallel_rank must be an int or nil",
                               param="data_parallel_rank")
    return KVEventBatch(ts=float(ts),
                        events=tuple(_decode_event(ev, i) for i, ev in enumerate(events)),
                        data_parallel_rank=rank)


def _decode_event(raw: Any, index: int) -> KVEvent:
    where = f"events[{index}]"
    tag: object
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KvEventWireError(f"{where}: array event needs a tag string", param=where)
        tag = raw[0]
        names = (NEWEST_SCHEMA.stored_fields if tag == "BlockStored" else
                 NEWEST_SCHEMA.removed_fields if tag == "BlockRemoved" else ())
        fields = dict(zip(names, raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventWireError(f"{where}: map event needs a 'type' string", param=where)
        fields = {k: v for k, v in raw.items() if k != "type"}
    else:
        raise KvEventWireError(f"{where}: event must be an array or a map", param=where)
    if tag == "BlockStored":
        return _decode_stored(fields, where)
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields, where),
                            medium=_opt_str(fields, "medium", where),
                            extra=_extra(fields, ("block_hashes", "medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventWireError(f"{where}: unknown event tag {tag!r}", param=where)


_TOKEN_LIMIT = 1 << 32


def _decode_stored(fields: dict[str, Any], where: str) -> BlockStored:
    parent = fields.get("parent_block_hash")
    if parent is not None and not (_is_int(parent) or isinstance(parent, bytes)):
        raise KvEventWireError(f"{where}.parent_block_hash must be int, bytes or nil",
                               param=f"{where}.parent_block_hash")
    tokens = fields.get("token_ids")
    # token ids as a request's are (vLLM's vocabularies fit 32 bits): one outside would
    # fail the hasher after the batch was half applied
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < _TOKEN_LIMIT
                                               for t in tokens):
        raise KvEventWireError(f"{where}.token_ids must be an array of ints in [0, 2**32)",
                               param=f"{where}.token_ids")
    block_size = fields.get("block_size")
    if not _is_int(block_size):
        raise KvEventWireError(f"{where}.block_size must be an int", param=f"{where}.block_size")
    lora_id = fields.get("lora_id")
    if lora_id is not None and not _is_int(lora_id):
        raise KvEventWireError(f"{where}.lora_id must be an int or nil", param=f"{where}.lora_id")
    return BlockStored(
        block_hashes=_hashes(fields, where), parent_block_hash=parent,
        token_ids=tuple(tokens), block_size=block_size, lora_id=lora_id,
        medium=_opt_str(fields, "medium", where), extra=_extra(fields, (*CORE_FIELDS, "medium")),
    )


def _hashes(fields: dict[str, Any], where: str) -> tuple[BlockHash, ...]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not all(
        _is_int(h) or isinstance(h, bytes) for h in hashes
    ):
        raise KvEventWireError(f"{where}.block_hashes must be an array of ints or bytes",
                               param=f"{where}.block_hashes")
    return tuple(hashes)


def _opt_str(fields: dict[str, Any], name: str, where: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise KvEventWireError(f"{where}.{name} must be a string or nil", param=f"{where}.{name}")
    return value


def _extra(fields: dict[str, Any], core: tuple[str, ...]) -> dict[str, Any]:
    try:
        return {k: _freeze(v) for k, v in fields.items() if k not in core and v is not None}
    except RecursionError as exc:
        raise KvEventWireError("event field nested too deeply", param="payload") from exc


# ----------------------------------------------------------------------------- encoding


def _packb(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]
    except (OverflowError, TypeError, ValueError) as exc:
        raise KvEventWireError(f"cannot encode {value!r}: {exc}", param="payload") from exc


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _map_header(n: int, declared: int) -> bytes:
    # msgspec reserves the header for the declared entry count, then patches n in.
    if declared < 16:
        return bytes([0x80 | n])
    if declared < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def _values(event: KVEvent) -> tuple[str, Mapping[str, Any]]:
    if isinstance(event, BlockStored):
        core: dict[str, Any] = {
            "block_hashes": list(event.block_hashes), "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids), "block_size": event.block_size,
            "lora_id": event.lora_id, "medium": event.medium,
        }
        return "BlockStored", {**event.extra, **core}
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", {**event.extra, "block_hashes": list(event.block_hashes),
                                "medium": event.medium}
    return "AllBlocksCleared", {}


def _encode_event(event: KVEvent, schema: WireSchema, layout: Layout) -> bytes:
    tag, values = _values(event)
    if tag == "BlockStored":
        names, required = schema.stored_fields, schema.stored_required
    elif tag == "BlockRemoved":
        names, required = schema.removed_fields, schema.removed_required
    else:
        names, required = (), 0
    if layout == "array":
        parts = [_array_header(len(names) + 1), _packb(tag)]
        parts.extend(_packb(values.get(name)) for name in names)
        return b"".join(parts)
    body = [_packb("type"), _packb(tag)]
    count = 1
    for i, name in enumerate(names):
        value = values.get(name)
        if value is None and i >= required:
            continue
        body += (_packb(name), _packb(value))
        count += 1
    return _map_header(count, len(names) + 1) + b"".join(body)


def encode_batch(batch: KVEventBatch, layout: Layout | None = None, *,
                 vllm_version: str = LATEST_VLLM_VERSION) -> bytes:
    """msgspec's bytes for ``batch`` as ``vllm_version`` encodes it.

    ``layout`` defaults to that version's own (array up to 0.23, map from 0.24);
    fields the version does not declare are dropped, declared fields missing from
    the event are written as ``nil`` (array) or omitted when defaulted (map).
    """
    if layout not in (None, "array", "map"):
        raise KvEventWireError(f"unknown layout {layout!r}", param="layout")
    schema = schema_for(vllm_version)
    chosen: Layout = layout if layout is not None else schema.layout
    parts = [b"\x93", _packb(float(batch.ts)), _array_header(len(batch.events))]
    parts.extend(_encode_event(ev, schema, chosen) for ev in batch.events)
    parts.append(_packb(batch.data_parallel_rank))
    return b"".join(parts)


def encode_frames(topic: str, seq: int, batch: KVEventBatch, layout: Layout | None = None, *,
                  vllm_version: str = LATEST_VLLM_VERSION) -> list[bytes]:
    """The three PUB frames ``[topic, seq, payload]`` vLLM sends for ``batch``."""
    return [topic.encode("utf-8"), encode_seq(seq),
            encode_batch(batch, layout, vllm_version=vllm_version)]
