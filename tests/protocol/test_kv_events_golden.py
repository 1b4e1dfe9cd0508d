"""The KV-event codec against vLLM's own frames (../shared/vectors/vllm-kv-events).

Every set is decoded frame by frame and compared with expected.json, then
re-encoded with that set's vLLM version and compared byte for byte with the
frames on disk. Skips cleanly when the shared vectors are not beside the repo.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.protocol.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    block_hash_to_int,
    gpu_block_removed,
    gpu_block_stored,
    schema_for,
)
from kvgate.protocol.kv_events_replay import (
    ReplayBatch,
    ReplayEnd,
    build_replay_end,
    build_replay_reply,
    build_replay_request,
    parse_replay_reply,
    replay_has_topic_frame,
)
from kvgate.protocol.kv_events_wire import decode_batch, decode_frames, encode_batch, encode_frames

VECTORS = Path(__file__).resolve().parents[2].parent / "shared" / "vectors" / "vllm-kv-events"
SETS = sorted(p for p in VECTORS.iterdir() if p.is_dir()) if VECTORS.is_dir() else []
SET_PARAMS = [pytest.param(p, id=p.name) for p in SETS] or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"golden vectors not found at {VECTORS}"))
]


def _load(set_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((set_dir / "expected.json").read_text())
    return data


def _spell(h: BlockHash | None) -> str | None:
    """A hash as expected.json writes it: uint64 as decimal, bytes as lowercase hex."""
    if h is None:
        return None
    return h.hex() if isinstance(h, bytes) else str(h)


def _as_expected(event: object, fields: dict[str, list[str]]) -> dict[str, Any]:
    """A decoded event flattened to expected.json's shape (every declared field)."""
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    assert isinstance(event, BlockStored | BlockRemoved)
    values: dict[str, Any] = {**event.extra, "medium": event.medium,
                              "block_hashes": [_spell(h) for h in event.block_hashes]}
    if isinstance(event, BlockStored):
        values.update(parent_block_hash=_spell(event.parent_block_hash),
                      token_ids=list(event.token_ids), block_size=event.block_size,
                      lora_id=event.lora_id)
    name = type(event).__name__
    out: dict[str, Any] = {"type": name}
    for f in fields[name]:
        v = values.get(f)
        out[f] = list(v) if isinstance(v, tuple) else v
    return out


def _message_frames(set_dir: Path, message: dict[str, Any]) -> list[bytes]:
    return [(set_dir / f).read_bytes() for f in message["files"]]


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_decode_matches_expected(set_dir: Path) -> None:
    exp = _load(set_dir)
    assert len(exp["messages"]) == 7
    for message in exp["messages"]:
        frames = _message_frames(set_dir, message)
        assert [base64.b64decode(message["frames"][k]) for k in
                ("topic_b64", "seq_b64", "payload_b64")] == frames
        topic, seq, batch = decode_frames(frames)
        assert (topic, seq) == (message["topic"], message["seq"])
        want = message["batch"]
        assert batch.ts == want["ts"]
        assert batch.data_parallel_rank == want["data_parallel_rank"]
        got = [_as_expected(ev, exp["struct_fields"]) for ev in batch.events]
        drop = {"blocks", "parent_block"}
        assert got == [{k: v for k, v in ev.items() if k not in drop} for ev in want["events"]]


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_reencode_is_byte_identical(set_dir: Path) -> None:
    exp = _load(set_dir)
    version = exp["vllm_version"]
    assert schema_for(version).layout == exp["layout"]
    for message in exp["messages"]:
        frames = _message_frames(set_dir, message)
        topic, seq, batch = decode_frames(frames)
        assert encode_frames(topic, seq, batch, vllm_version=version) == frames
        assert encode_frames(topic, seq, batch, exp["layout"], vllm_version=version) == frames
    direct = (set_dir / "frames" / "direct_step0_no_dp_rank_payload.bin").read_bytes()
    batch = decode_batch(direct)
    assert batch.data_parallel_rank is None
    assert encode_batch(batch, vllm_version=version) == direct


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_gpu_helpers_publish_what_vllm_publishes(set_dir: Path) -> None:
    """Building events with the engine-side helpers gives vLLM's exact bytes."""
    exp = _load(set_dir)
    for message in exp["messages"]:
        frames = _message_frames(set_dir, message)
        decoded = decode_batch(frames[2])
        rebuilt: list[KVEvent] = []
        for ev in decoded.events:
            if isinstance(ev, BlockStored):
                rebuilt.append(gpu_block_stored(ev.block_hashes, ev.parent_block_hash,
                                                ev.token_ids, ev.block_size))
            elif isinstance(ev, BlockRemoved):
                rebuilt.append(gpu_block_removed(ev.block_hashes))
            else:
                rebuilt.append(AllBlocksCleared())
        batch = KVEventBatch(ts=decoded.ts, events=tuple(rebuilt),
                             data_parallel_rank=decoded.data_parallel_rank)
        assert encode_batch(batch, vllm_version=exp["vllm_version"]) == frames[2]


@pytest.mark.parametrize("style", ["int", "bytes"])
def test_newest_batches_encode_as_every_older_version(style: str) -> None:
    newest = VECTORS / f"vllm-0.33.0_map_{style}"
    if not newest.is_dir():
        pytest.skip(f"golden vectors not found at {VECTORS}")
    older = [p for p in SETS if p.name.endswith(style) and p != newest]
    assert older
    for target in older:
        version = _load(target)["vllm_version"]
        for payload in sorted((newest / "frames").glob("*payload.bin")):
            batch = decode_batch(payload.read_bytes())
            want = (target / "frames" / payload.name).read_bytes()
            assert encode_batch(batch, vllm_version=version) == want, (target.name, payload.name)


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_events_rebuild_expected_index(set_dir: Path) -> None:
    """Applying the decoded events per DP rank gives expected.json's index."""
    exp = _load(set_dir)
    names = {b["hash"]: name for name, b in exp["blocks"].items()}
    index: dict[str, set[str]] = {}
    for message in exp["messages"]:
        _, _, batch = decode_frames(_message_frames(set_dir, message))
        rank = f"dp{batch.data_parallel_rank}"
        held = index.setdefault(rank, set())
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held.update(names[str(_spell(h))] for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(names[str(_spell(h))] for h in ev.block_hashes)
            else:
                held.clear()
        assert {r: sorted(v) for r, v in index.items()} == {
            r: sorted(v) for r, v in message["index_after"].items()
        }


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_int_hash_is_low_64_bits_of_digest(set_dir: Path) -> None:
    for block in _load(set_dir)["blocks"].values():
        raw = bytes.fromhex(block["raw_sha256_hex"])
        assert len(raw) == 32
        spelled = block["hash"]
        h: BlockHash = raw if len(spelled) == 64 else int(spelled)
        assert block_hash_to_int(h) == block_hash_to_int(raw) == int.from_bytes(raw[-8:], "big")


@pytest.mark.parametrize("set_dir", SET_PARAMS)
def test_replay_exchange(set_dir: Path) -> None:
    exp = _load(set_dir)
    version = exp["vllm_version"]
    replay = exp["replay"]
    request = [base64.b64decode(f) for f in replay["request"]["frames_sent_by_dealer_b64"]]
    assert request == build_replay_request(2)
    live = {}
    for message in exp["messages"]:
        frames = _message_frames(set_dir, message)
        if message["stream"] == "dp0":
            live[message["seq"]] = frames
    topic_frame = replay_has_topic_frame(version)
    replies = replay["replies_as_received_by_dealer"]
    for reply in replies[:-1]:
        frames = [base64.b64decode(f) for f in reply["frames_b64"]]
        parsed = parse_replay_reply(frames)
        assert isinstance(parsed, ReplayBatch)
        assert parsed.seq == reply["seq"]
        assert parsed.topic == ("" if topic_frame else None)
        topic, seq, batch = decode_frames(live[parsed.seq])
        assert parsed.batch == batch
        sent = build_replay_reply(b"client-id", topic, seq, live[seq][2], topic_frame=topic_frame)
        assert sent[0] == b"client-id" and sent[1:] == frames
    end = [base64.b64decode(f) for f in replies[-1]["frames_b64"]]
    assert replies[-1]["seq"] == -1
    assert parse_replay_reply(end) == ReplayEnd(topic_frame=topic_frame)
    assert build_replay_end(b"client-id", topic_frame=topic_frame)[1:] == end
    assert [r["seq"] for r in replies] == [2, 3, 4, 5, -1]
