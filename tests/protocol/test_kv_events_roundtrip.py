"""The KV-event codec without the shared vectors: round trips, tolerance, rejection."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import KvEventWireError, ProtocolError
from kvgate.protocol.kv_events import (
    SCHEMAS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    block_hash_to_int,
    gpu_block_stored,
    schema_for,
)
from kvgate.protocol.kv_events_replay import (
    END_SEQ,
    ReplayBatch,
    ReplayEnd,
    build_replay_end,
    build_replay_reply,
    build_replay_request,
    parse_replay_reply,
    parse_replay_request,
)
from kvgate.protocol.kv_events_wire import (
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
)

U64 = (1 << 64) - 1
hashes = st.one_of(st.integers(0, U64), st.binary(min_size=32, max_size=32))
text = st.text(max_size=12)
STORED_EXTRA = {
    "lora_name": text,
    "extra_keys": st.lists(st.one_of(st.none(), text), max_size=3).map(tuple),
    "group_idx": st.integers(0, 8),
    "kv_cache_spec_kind": st.sampled_from(["full_attention", "sliding_window"]),
    "kv_cache_spec_sliding_window": st.integers(1, 4096),
    "locality": text,
    "ownership": text,
    "session_id": text,
    "lookahead_token_ids": st.lists(st.integers(0, 200_000), max_size=4).map(tuple),
}
REMOVED_EXTRA = {k: STORED_EXTRA[k] for k in ("group_idx", "locality", "ownership")}

stored = st.builds(
    lambda hs, parent, bs, lora, medium, extra, data: BlockStored(
        block_hashes=tuple(hs), parent_block_hash=parent,
        token_ids=tuple(data.draw(st.lists(st.integers(0, 2**31), min_size=len(hs) * bs,
                                           max_size=len(hs) * bs))),
        block_size=bs, lora_id=lora, medium=medium, extra=extra),
    st.lists(hashes, max_size=4), st.none() | hashes, st.integers(0, 4),
    st.none() | st.integers(0, 100), st.none() | st.sampled_from(["GPU", "CPU", "STORAGE"]),
    st.fixed_dictionaries({}, optional=STORED_EXTRA), st.data(),
)
removed = st.builds(
    lambda hs, medium, extra: BlockRemoved(block_hashes=tuple(hs), medium=medium, extra=extra),
    st.lists(hashes, min_size=1, max_size=4), st.none() | st.just("GPU"),
    st.fixed_dictionaries({}, optional=REMOVED_EXTRA),
)
events = st.one_of(stored, removed, st.just(AllBlocksCleared()))
batches = st.builds(
    lambda ts, evs, rank: KVEventBatch(ts=ts, events=tuple(evs), data_parallel_rank=rank),
    st.floats(allow_nan=False, allow_infinity=False), st.lists(events, max_size=5),
    st.none() | st.integers(0, 64),
)
VERSIONS = [".".join(map(str, s.since)) for s in SCHEMAS]


def _project(event: KVEvent, version: str) -> KVEvent:
    """What survives encoding with ``version``: only the fields it declares."""
    schema = schema_for(version)
    if isinstance(event, BlockStored):
        keep = set(schema.stored_fields)
        return BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size, lora_id=event.lora_id,
            medium=event.medium if "medium" in keep else None,
            extra={k: v for k, v in event.extra.items() if k in keep})
    if isinstance(event, BlockRemoved):
        keep = set(schema.removed_fields)
        return BlockRemoved(block_hashes=event.block_hashes,
                            medium=event.medium if "medium" in keep else None,
                            extra={k: v for k, v in event.extra.items() if k in keep})
    return event


@settings(max_examples=100, deadline=None)
@given(batch=batches, layout=st.sampled_from(["array", "map"]))
def test_round_trip_newest(batch: KVEventBatch, layout: Any) -> None:
    payload = encode_batch(batch, layout)
    assert decode_batch(payload) == batch
    assert encode_batch(decode_batch(payload), layout) == payload


@settings(max_examples=100, deadline=None)
@given(batch=batches, version=st.sampled_from(VERSIONS))
def test_round_trip_each_version_keeps_its_fields(batch: KVEventBatch, version: str) -> None:
    decoded = decode_batch(encode_batch(batch, vllm_version=version))
    assert decoded.events == tuple(_project(ev, version) for ev in batch.events)
    assert (decoded.ts, decoded.data_parallel_rank) == (batch.ts, batch.data_parallel_rank)


@settings(max_examples=50, deadline=None)
@given(batch=batches, topic=text, seq=st.integers(0, U64))
def test_frames_round_trip(batch: KVEventBatch, topic: str, seq: int) -> None:
    frames = encode_frames(topic, seq, batch)
    assert len(frames) == 3 and len(frames[1]) == 8
    assert decode_frames(frames) == (topic, seq, batch)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_batch(data)


@settings(max_examples=100, deadline=None)
@given(batch=batches, data=st.data())
def test_corrupted_payloads_raise_only_protocol_errors(batch: KVEventBatch, data: Any) -> None:
    payload = bytearray(encode_batch(batch, data.draw(st.sampled_from(["array", "map"]))))
    cut = data.draw(st.integers(0, len(payload)))
    pos = data.draw(st.integers(0, len(payload) - 1))
    payload[pos] = data.draw(st.integers(0, 255))
    for candidate in (bytes(payload), bytes(payload[:cut])):
        with contextlib.suppress(ProtocolError):
            decode_batch(candidate)


def test_uint64_hashes_above_int64() -> None:
    big = (1 << 63) + 5
    batch = KVEventBatch(ts=1.0, events=(gpu_block_stored([big, U64], big - 1, [], 0),))
    payload = encode_batch(batch)
    assert b"\xcf" + big.to_bytes(8, "big") in payload
    assert decode_batch(payload) == batch


def test_block_hash_to_int() -> None:
    digest = bytes(range(32))
    assert block_hash_to_int(digest) == int.from_bytes(digest[-8:], "big")
    assert block_hash_to_int(-1) == U64
    assert block_hash_to_int(7) == 7


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


STORED_MAP = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU"}


def test_tolerates_unknown_and_missing_fields() -> None:
    future = {**STORED_MAP, "group_idx": 1, "shiny_new_field": [1, 2]}
    del future["lora_id"], future["medium"]
    ev = decode_batch(_pack([2.0, [future], 0])).events[0]
    assert isinstance(ev, BlockStored)
    assert ev.group_idx == 1 and ev.medium is None and ev.lora_id is None
    assert ev.extra == {"group_idx": 1, "shiny_new_field": (1, 2)}
    # array layout: 0.10 had no medium; appended unknown positions are ignored
    old = decode_batch(_pack([2, [["BlockStored", [9], None, [5], 1, None]], None]))
    assert old.events[0] == BlockStored(block_hashes=(9,), parent_block_hash=None,
                                        token_ids=(5,), block_size=1)
    assert old.ts == 2.0 and isinstance(old.ts, float)
    longer = ["BlockStored", [9], 7, [5], 1, 3, "CPU", *([None] * 9), "extra", "more"]
    ev = decode_batch(_pack([1.0, [longer]])).events[0]
    assert ev == BlockStored(block_hashes=(9,), parent_block_hash=7, token_ids=(5,),
                             block_size=1, lora_id=3, medium="CPU")
    removed_ev = decode_batch(_pack([1.0, [["BlockRemoved", [b"\x01" * 32]]], 3])).events[0]
    assert removed_ev == BlockRemoved(block_hashes=(b"\x01" * 32,))
    assert decode_batch(_pack([1.0, [{"type": "AllBlocksCleared", "x": 1}], 0])).events == (
        AllBlocksCleared(),)


BAD_PAYLOADS = [
    (b"", "payload"),
    (b"\xc1", "payload"),
    (_pack({"ts": 1.0}), "batch"),
    (_pack([1.0]), "batch"),
    (_pack([True, [], 0]), "ts"),
    (_pack(["1.0", [], 0]), "ts"),
    (_pack([1.0, {}, 0]), "events"),
    (_pack([1.0, [], "0"]), "data_parallel_rank"),
    (_pack([1.0, [7], 0]), "events[0]"),
    (_pack([1.0, [[]], 0]), "events[0]"),
    (_pack([1.0, [[3, 4]], 0]), "events[0]"),
    (_pack([1.0, [{"block_hashes": []}], 0]), "events[0]"),
    (_pack([1.0, [["BlockEvicted", [1]]], 0]), "events[0]"),
    (_pack([1.0, [{**STORED_MAP, "type": "Nope"}], 0]), "events[0]"),
    (_pack([1.0, [{**STORED_MAP, "block_hashes": ["ab"]}], 0]), "events[0].block_hashes"),
    (_pack([1.0, [{**STORED_MAP, "block_hashes": None}], 0]), "events[0].block_hashes"),
    (_pack([1.0, [{**STORED_MAP, "parent_block_hash": "x"}], 0]),
     "events[0].parent_block_hash"),
    (_pack([1.0, [{**STORED_MAP, "token_ids": [1, "2"]}], 0]), "events[0].token_ids"),
    # out of any vocabulary: the hasher refused it after the batch was half applied
    (_pack([1.0, [{**STORED_MAP, "token_ids": [1, -1]}], 0]), "events[0].token_ids"),
    (_pack([1.0, [{**STORED_MAP, "token_ids": [2**32]}], 0]), "events[0].token_ids"),
    (_pack([1.0, [{**STORED_MAP, "block_size": None}], 0]), "events[0].block_size"),
    (_pack([1.0, [{**STORED_MAP, "lora_id": "a"}], 0]), "events[0].lora_id"),
    (_pack([1.0, [{**STORED_MAP, "medium": 1}], 0]), "events[0].medium"),
    (_pack([1.0, [["BlockRemoved"]], 0]), "events[0].block_hashes"),
    (b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\x01\x02\x00", "payload"),  # int map key
]


@pytest.mark.parametrize(("payload", "param"), BAD_PAYLOADS)
def test_malformed_payloads(payload: bytes, param: str) -> None:
    with pytest.raises(KvEventWireError) as info:
        decode_batch(payload)
    assert info.value.param == param


GOOD = encode_batch(KVEventBatch(ts=1.0, events=(), data_parallel_rank=0))


@pytest.mark.parametrize(("frames", "param"), [
    ([b"", b"\x00" * 8], "frames"),
    ([b"", b"\x00" * 8, GOOD, b""], "frames"),
    ([b"", b"\x00" * 7, GOOD], "seq"),
    ([b"", b"\x00" * 9, GOOD], "seq"),
    ([b"\xff", b"\x00" * 8, GOOD], "topic"),
    ([b"", b"\x00" * 8, b"\x00"], "batch"),
])
def test_malformed_frames(frames: list[bytes], param: str) -> None:
    with pytest.raises(KvEventWireError) as info:
        decode_frames(frames)
    assert info.value.param == param


def test_encoder_rejects_unencodable_values() -> None:
    batch = KVEventBatch(ts=0.0, events=(BlockRemoved(block_hashes=(1 << 64,)),))
    with pytest.raises(KvEventWireError):
        encode_batch(batch)
    with pytest.raises(KvEventWireError):
        encode_frames("", -1, batch)
    with pytest.raises(KvEventWireError):
        encode_batch(batch, "json")  # type: ignore[arg-type]
    with pytest.raises(KvEventWireError):
        schema_for("0.9.0")
    with pytest.raises(KvEventWireError):
        schema_for("latest")


def test_map_header_follows_declared_field_count() -> None:
    ev = BlockRemoved(block_hashes=(1,))
    stored_ev = gpu_block_stored([1], None, [1], 1)
    # 0.33 BlockStored declares 15 fields + tag: msgspec reserves a map16 header
    assert encode_batch(KVEventBatch(ts=0.0, events=(stored_ev,)))[10:13] == b"\x91\xde\x00"
    # 0.25 BlockStored declares 11 + tag: a fixmap
    assert encode_batch(KVEventBatch(ts=0.0, events=(stored_ev,)), vllm_version="0.25.1")[10] == (
        0x91)
    assert encode_batch(KVEventBatch(ts=0.0, events=(stored_ev,)),
                        vllm_version="0.25.1")[11] & 0xF0 == 0x80
    # required fields are present even when nil; defaulted ones are omitted
    payload = encode_batch(KVEventBatch(ts=0.0, events=(ev,)))
    assert msgpack.unpackb(payload)[1] == [
        {"type": "BlockRemoved", "block_hashes": [1], "medium": None}]
    # array layout always writes every declared field
    payload = encode_batch(KVEventBatch(ts=0.0, events=(ev,)), vllm_version="0.23.0")
    assert msgpack.unpackb(payload)[1] == [["BlockRemoved", [1], None, None]]


@given(seq=st.integers(0, U64 - 1), topic=text, batch=batches, new=st.booleans())
@settings(max_examples=50, deadline=None)
def test_replay_round_trip(seq: int, topic: str, batch: KVEventBatch, new: bool) -> None:
    assert parse_replay_request([b"id", *build_replay_request(seq)]) == (b"id", seq)
    reply = build_replay_reply(b"id", topic, seq, encode_batch(batch), topic_frame=new)
    assert parse_replay_reply(reply[1:]) == ReplayBatch(
        seq=seq, batch=batch, topic=topic if new else None)
    assert parse_replay_reply(reply[2:], delimiter=False) == ReplayBatch(
        seq=seq, batch=batch, topic=topic if new else None)
    assert parse_replay_reply(build_replay_end(b"id", topic_frame=new)[1:]) == ReplayEnd(
        topic_frame=new)


@pytest.mark.parametrize("frames", [
    [],
    [b"x", b"\x00" * 8, GOOD],
    [b""],
    [b"", b"\x00" * 8],
    [b"", b"", b"", b"\x00" * 8, GOOD],
    [b"", b"\x00" * 3, GOOD],
    [b"", b"\xff\xfe", b"\x00" * 8, GOOD],
])
def test_malformed_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(KvEventWireError):
        parse_replay_reply(frames)


@pytest.mark.parametrize("frames", [[b"id", b"", b"\x00" * 7], [b"id", b"x", b"\x00" * 8],
                                    [b"", b"\x00" * 8]])
def test_malformed_replay_requests(frames: list[bytes]) -> None:
    with pytest.raises(KvEventWireError):
        parse_replay_request(frames)


def test_deeply_nested_extra_is_a_protocol_error() -> None:
    nested: list[Any] = []
    for _ in range(900):
        nested = [nested]
    with pytest.raises(KvEventWireError):
        decode_batch(_pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "x": nested}]]))


def test_end_marker_is_minus_one() -> None:
    with pytest.raises(KvEventWireError):
        build_replay_reply(b"id", "", U64, GOOD)
    assert (-1).to_bytes(8, "big", signed=True) == END_SEQ
    assert parse_replay_reply([b"", b"\x00" * 8, b""]) == ReplayEnd(topic_frame=False)
