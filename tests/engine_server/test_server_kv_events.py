"""KV events: vLLM's ZMQ frames from a live server, and byte equality with vLLM's own vectors."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from kvgate.engine import kv_events as ek
from kvgate.engine.server_events import EvictionLog, KvEventEncoder, to_wire_events
from kvgate.engine.server_tokens import PromptTokenizer
from kvgate.protocol import AllBlocksCleared, BlockRemoved, BlockStored, decode_frames

VECTORS = Path("/work/shared/vectors/vllm-kv-events")
MODEL = "kvgate-sim"


@pytest_asyncio.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def _post(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200


async def _subscribed(sub: zmq.asyncio.Socket, http: aiohttp.ClientSession, url: str) -> None:
    """Beat the slow-joiner race: send throwaway requests until one batch arrives."""
    for attempt in range(50):
        await _post(http, url, f"warm-up {attempt} " * 8)
        if await sub.poll(100):
            return
    raise AssertionError("no KV event reached the subscriber")


async def _frames_until(sub: zmq.asyncio.Socket, want: Any) -> list[tuple[str, int, Any]]:
    got: list[tuple[str, int, Any]] = []
    async with asyncio.timeout(5):
        while True:
            decoded = decode_frames(await sub.recv_multipart())
            got.append(decoded)
            if want(decoded[2]):
                return got


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["map", "array"])
async def test_published_batches_decode_to_the_prompt_blocks(
    start_server: Any, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context, layout: str
) -> None:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    try:
        # No '*': the engine connects to us, as vLLM does with such an endpoint.
        server = await start_server(kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                    kv_events_layout=layout, kv_events_topic="kv@sim")
        await _subscribed(sub, http, server.url)
        prompt = "The quick brown fox jumps over the lazy dog. " * 10  # 450 chars, 113 tokens
        expected = PromptTokenizer(16).for_prompt(prompt)
        await _post(http, server.url, prompt)
        frames = await _frames_until(sub, lambda b: any(
            isinstance(e, BlockStored) and e.block_hashes[0] == expected.block_hashes[0]
            for e in b.events))
        topic, _, batch = frames[-1]
        assert topic == "kv@sim"
        seqs = [s for _, s, _ in frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert batch.data_parallel_rank == 0
        (stored,) = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored.block_hashes == expected.block_hashes  # 7 full blocks
        assert stored.parent_block_hash is None
        assert stored.token_ids == expected.token_ids[: 7 * 16]
        assert stored.block_size == 16 and stored.medium == "GPU"
        assert stored.extra["group_idx"] == 0
        async with http.get(f"{server.url}/kv_event_sources") as resp:
            assert (await resp.json())["0"]["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        sub.close(linger=0)


@pytest.mark.asyncio
async def test_bind_endpoint_and_cleared_on_crash(
    start_server: Any, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    server = await start_server(kv_events_endpoint="tcp://127.0.0.1:*")
    endpoint = server.kv_events_endpoint
    assert endpoint is not None and not endpoint.endswith(":*")
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        await _subscribed(sub, http, server.url)
        async with http.post(f"{server.url}/admin/fault", json={"action": "crash"}) as resp:
            assert resp.status == 200
        await _frames_until(sub, lambda b: any(isinstance(e, AllBlocksCleared)
                                               for e in b.events))
    finally:
        sub.close(linger=0)


def _vector_set(name: str) -> dict[str, Any]:
    path = VECTORS / name / "expected.json"
    if not path.is_file():
        pytest.skip(f"golden vectors absent: {path}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize(("name", "layout"), [("vllm-0.33.0_map_int", "map"),
                                              ("vllm-0.23.0_array_int", "array")])
def test_encoder_bytes_equal_vllm_golden_vectors(name: str, layout: Any) -> None:
    data = _vector_set(name)
    blocks = data["blocks"]

    def h(block: str) -> int:
        return int(blocks[block]["hash"])

    def stored(names: list[str], parent: str | None) -> ek.BlockStored:
        return ek.BlockStored(
            block_hashes=tuple(h(n) for n in names),
            parent_block_hash=h(parent) if parent else None,
            token_ids=tuple(t for n in names for t in blocks[n]["token_ids"]), block_size=16)

    steps: list[list[ek.KvEvent]] = [  # messages 0-5 of the vectors (rank 0), as engine events
        [stored(["A1", "A2", "A3"], None)],
        [stored(["B3", "B4"], "A2")],
        [ek.BlockRemoved(block_hashes=(h("A3"),)),
         ek.BlockRemoved(block_hashes=(h("B4"), h("B3")))],
        [ek.BlockRemoved(block_hashes=(h("A2"),)), stored(["C1", "C2"], None)],
        [ek.AllBlocksCleared()],
        [stored(["A1", "A2", "A3"], None)],
    ]
    encoder = KvEventEncoder(topic=data["topic"], layout=layout)
    for step, message in zip(steps, data["messages"], strict=False):
        frames = encoder.encode(to_wire_events(step), message["batch"]["ts"])
        gold = [base64.b64decode(message["frames"][k])
                for k in ("topic_b64", "seq_b64", "payload_b64")]
        assert frames == gold, message["step"]
    assert encoder.seq == len(steps)


def test_announcements_stay_off_the_wire_and_go_to_the_log() -> None:
    announced = ek.EvictionAnnounced(num_blocks=3, prefixes=(7,), starts_at=2.0, done_by=2.5,
                                     reason="flush")
    events: list[ek.KvEvent] = [announced, ek.BlockRemoved(block_hashes=(7, 8)),
                                ek.EvictionDone(num_blocks_evicted=2)]
    wire = to_wire_events(events)
    assert len(wire) == 1 and isinstance(wire[0], BlockRemoved)
    log = EvictionLog(capacity=2)
    log.add(events[:1], at=0.0)
    assert log.pending == 1
    log.add(events, at=1.0)
    assert log.pending == 1  # two announced, one done
    log.add([ek.AllBlocksCleared()], at=2.0)
    assert log.pending == 0
    page = log.page(0, now=3.0, speedup=1.0, node_id="n")
    assert [e["seq"] for e in page["events"]] == [1, 2] and page["truncated"]
    assert page["next"] == 3
    assert page["events"][0]["prefixes"] == [7] and page["events"][0]["at"] == 1.0
    assert log.page(3, now=3.0, speedup=1.0, node_id="n")["events"] == []
