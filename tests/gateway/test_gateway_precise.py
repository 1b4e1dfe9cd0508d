"""Precise mode end to end: engine KV events over ZMQ feed the gateway's index."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvgate.core.hashing import Message, make_hasher
from kvgate.core.hashing.tokens import TokenBlockHasher
from kvgate.core.ids import NodeId
from kvgate.engine.server import EngineServerConfig
from kvgate.gateway.kv_ingest import NodeKvIngest
from kvgate.gateway.kv_subscriber import follow_kv_events
from kvgate.protocol import KVEventBatch, encode_frames, gpu_block_stored
from kvgate.testing import EngineStack, engine_stack, eventually, fast_gateway_config
from kvgate.testing import run_bounded as run

MODEL = "kvgate-sim"
SYSTEM = "You are the helpful assistant of a bookshop; answer briefly. " * 30


@pytest.fixture
def sockets() -> Iterator[Path]:
    # ipc:// paths must stay under ~100 bytes: pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="kvgt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stack(
    sockets: Path, n: int = 2, **routing: Any
) -> contextlib.AbstractAsyncContextManager[EngineStack]:
    endpoints = {f"e{i}": f"ipc://{sockets}/e{i}" for i in range(n)}
    engines = [
        EngineServerConfig(port=0, speedup=50.0, node_id=nid, model=MODEL, kv_events_endpoint=ep)
        for nid, ep in endpoints.items()
    ]

    def gateway(nodes: list[dict[str, Any]]) -> Any:
        for node in nodes:
            node["kv_events"] = endpoints[node["id"]]
        return fast_gateway_config(
            nodes,
            routing={"params": {"epsilon": 0.0}, "index_mode": "precise", "hasher": "sim",
                     **routing},
        )

    return engine_stack(EngineStack, engines, gateway)


async def _chat(st: EngineStack, question: str) -> tuple[str, str, int]:
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    async with st.session.post(st.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        return (r.headers["X-Kvgate-Node"], r.headers["X-Kvgate-Route-Reason"],
                usage["prompt_tokens_details"]["cached_tokens"])


def _chain(question: str) -> tuple[int, ...]:
    h = make_hasher("sim", block_size=16)
    messages: list[Message] = [("system", SYSTEM), ("user", question)]
    return tuple(h.chain_for_messages(messages, MODEL))


def test_the_index_learns_a_prompt_from_its_engines_events(sockets: Path) -> None:
    async def body() -> None:
        async with _stack(sockets) as st:
            node, _, cached = await _chat(st, "Where is my order?")
            assert cached == 0
            ctl = st.gw.gateway.controller
            chain = _chain("Where is my order?")
            # the engine's BlockStored events confirm every block of the prompt, on that
            # node only, and leave nothing speculative (the routing guess) behind
            await eventually(
                lambda: ctl.index.match(chain, 0.0).get(NodeId(node)) == len(chain)
                and ctl.index.speculative_entries(NodeId(node)) == 0
            )
            rt = st.gw.gateway.watcher.nodes[NodeId(node)]
            assert rt.kv is not None and rt.kv.ingest.counts["stored_blocks"] >= len(chain)
            # the next question shares the system prompt: to its holder, from its cache
            node2, reason, cached2 = await _chat(st, "Do you sell gift cards?")
            assert (node2, reason) == (node, "cache_hit")
            assert cached2 >= 16 * (len(SYSTEM) // 4 // 16 - 1)
            async with st.session.get(st.url + "/metrics") as r:
                text = await r.text()
            assert f'kvgate_kv_event_blocks_total{{node="{node}",kind="stored"}}' in text

    run(body())


def test_a_prompt_of_token_ids_is_keyed_as_the_engine_caches_it(sockets: Path) -> None:
    """A completions prompt given as token ids was chained as the text "1 2 3 ...":
    no event ever confirmed its guesses, and its repeats went wherever load said."""

    async def body() -> None:
        async with _stack(sockets) as st:
            ids = [(7 * i) % 32_000 for i in range(40 * 16 + 5)]
            body = {"model": MODEL, "max_tokens": 4, "prompt": ids}
            ctl = st.gw.gateway.controller
            h = make_hasher("sim", block_size=16)
            assert isinstance(h, TokenBlockHasher)
            chain = h.chain_for_tokens(ids, model=MODEL)
            seen = []
            for _ in range(2):
                async with st.session.post(st.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    cached = (await r.json())["usage"]["prompt_tokens_details"]
                    seen.append((r.headers["X-Kvgate-Node"], r.headers["X-Kvgate-Route-Reason"],
                                 cached["cached_tokens"]))
                node = NodeId(seen[0][0])
                await eventually(lambda: ctl.index.match(chain, 0.0).get(node) == 40  # noqa: B023
                                 and ctl.index.speculative_entries(node) == 0)  # noqa: B023
            assert seen[1][0] == seen[0][0] and seen[1][1] == "cache_hit"
            assert seen[1][2] == 40 * 16

    run(body())


def test_a_salted_prompt_is_no_hit_for_the_plain_one(sockets: Path) -> None:
    """A cache_salt roots the engine's chain apart, and vLLM names it in the first
    block's extra_keys; kvgate engine did not, and the gateway keyed the salted blocks
    by their tokens alone: the same prompt without the salt was routed to them for a
    hit the engine could not give."""

    async def body() -> None:
        async with _stack(sockets, n=1) as st:
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "salted?"}]
            body = {"model": MODEL, "max_tokens": 4, "messages": messages,
                    "cache_salt": "tenant-a-secret"}
            async with st.session.post(st.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            rt = next(iter(st.gw.gateway.watcher.nodes.values()))
            assert rt.kv is not None
            ingest = rt.kv.ingest
            await eventually(lambda: ingest.counts["extra_keys_blocks"] >= 1)
            assert ingest.counts["stored_blocks"] == 0
            ctl = st.gw.gateway.controller
            assert not ctl.index.match(_chain("salted?"), 0.0)  # nothing confirmed for it

    run(body())


def test_an_engine_eviction_leaves_the_index(sockets: Path) -> None:
    async def body() -> None:
        async with _stack(sockets, n=1) as st:
            node, _, _ = await _chat(st, "Can I return a book?")
            ctl = st.gw.gateway.controller
            chain = _chain("Can I return a book?")
            await eventually(lambda: ctl.index.match(chain, 0.0).get(NodeId(node)) == len(chain))
            fault = {"action": "mass_evict", "fraction": 1.0}
            async with st.session.post(st.engine(node).url + "/admin/fault", json=fault) as r:
                assert r.status == 200, await r.text()
            # its BlockRemoved events take every block back out of the index
            await eventually(lambda: not ctl.index.match(chain, 0.0).get(NodeId(node)))

    run(body())


def test_a_bad_message_is_counted_and_the_stream_goes_on(sockets: Path) -> None:
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        endpoint = f"ipc://{sockets}/pub"
        pub.bind(endpoint)
        h = make_hasher("sim", block_size=16)
        assert isinstance(h, TokenBlockHasher)
        ingest = NodeKvIngest(h)
        applied: list[object] = []
        task = asyncio.ensure_future(follow_kv_events(
            endpoint, ingest, model=lambda: MODEL, apply=applied.extend, current=lambda: True,
            context=ctx,
        ))
        try:
            good = KVEventBatch(ts=0.0, events=(
                gpu_block_stored([11], None, list(range(16)), 16),), data_parallel_rank=0)
            for _ in range(200):  # a SUB joins late: publish until it hears
                await pub.send_multipart([b"", b"short", b"\x81"])  # a 5-byte seq frame
                await pub.send_multipart(encode_frames("", 0, good))
                await asyncio.sleep(0.01)
                if applied:
                    break
            assert applied, "no batch arrived"
            assert ingest.counts["malformed"] >= 1
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            pub.close(linger=0)
            ctx.term()

    run(body())



def test_a_node_takes_one_kv_events_endpoint_per_data_parallel_rank(sockets: Path) -> None:
    """vLLM's data-parallel rank r publishes on the endpoint's port + r: a node took one
    endpoint, so only rank 0's cache was ever seen. A comma-separated list subscribes
    to each, into the node's one mapper (ranks told apart by their batches)."""
    from kvgate.core.config import ControllerConfig
    from kvgate.core.controller import Controller
    from kvgate.core.errors import ConfigError
    from kvgate.gateway.config import NodeConfig, NodesConfig
    from kvgate.gateway.node_watcher import NodeWatcher

    cfg = NodeConfig(id="a", url="http://a:1", kv_events=f"ipc://{sockets}/r0, ipc://{sockets}/r1")
    assert cfg.kv_events_endpoints == (f"ipc://{sockets}/r0", f"ipc://{sockets}/r1")
    with pytest.raises(ConfigError, match="kv_events"):
        NodeConfig(id="a", url="http://a:1", kv_events="tcp://h:5557,http://h:5558")
    # vLLM's default endpoint is where the engine binds: nothing to connect to (it was
    # accepted, and the subscription failed every second for good)
    for wildcard in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"):
        with pytest.raises(ConfigError, match="wildcard"):
            NodeConfig(id="a", url="http://a:1", kv_events=wildcard)

    async def body() -> None:
        ctl = Controller(ControllerConfig(index_mode="precise", hasher="sim"),
                         rng=random.Random(1))
        w = NodeWatcher(ctl, NodesConfig(health_interval_s=60, metrics_interval_s=60,
                                         evictions_interval_s=60), upstream=None,  # type: ignore[arg-type]
                        clock=lambda: 0.0)
        rt = w._register(cfg)
        w._spawn(rt)
        try:
            assert rt.kv is not None and len(rt.kv.connected) == 2
            assert len(rt.tasks) == 5  # health, metrics, evictions + one per rank
        finally:
            await w.stop()

    run(body())


def test_orphan_blocks_make_routing_teach_the_index_until_they_stop() -> None:
    """Events that continue prefixes the gateway never heard stored (it started after
    the engine) cannot be keyed: while they come, routing teaches the index for that
    node too, and ORPHAN_QUIET_S after the last one it stops."""
    from kvgate.core.config import ControllerConfig
    from kvgate.core.controller import Controller
    from kvgate.core.nodes import NodeSpec
    from kvgate.gateway.kv_watch import ORPHAN_QUIET_S, NodeKvWatch
    from kvgate.protocol import KVEventBatch, gpu_block_stored

    ctl = Controller(ControllerConfig(index_mode="precise", hasher="sim"), rng=random.Random(1))
    n0 = NodeId("n0")
    ctl.add_node(NodeSpec(node_id=n0), 0.0)
    h = make_hasher("sim", block_size=16)
    assert isinstance(h, TokenBlockHasher)
    watch = NodeKvWatch(n0, h, ["ipc:///nowhere"])
    known = KVEventBatch(ts=0.0, events=(gpu_block_stored([1], None, list(range(16)), 16),))
    watch.ingest.feed(0, known, MODEL)
    watch.note_orphans(ctl, 1.0)
    assert n0 not in ctl.routing_learns  # every block keyed: events alone
    orphan = KVEventBatch(ts=0.0, events=(gpu_block_stored([9], 8, list(range(16)), 16),))
    watch.ingest.feed(1, orphan, MODEL)
    watch.note_orphans(ctl, 2.0)
    assert n0 in ctl.routing_learns
    watch.note_orphans(ctl, 2.0 + ORPHAN_QUIET_S / 2)
    assert n0 in ctl.routing_learns
    watch.note_orphans(ctl, 2.0 + ORPHAN_QUIET_S + 1)
    assert n0 not in ctl.routing_learns


def test_a_gateway_started_after_its_engine_still_sees_the_old_prefixes(sockets: Path) -> None:
    """The engine cached a system prompt before the gateway connected: the events of
    every prompt continuing it are orphans. Precise mode alone never saw that prefix
    (routing's guesses expire in 2 s); with the orphans routing teaches the index, and
    a later request sharing the prompt still goes to its holder."""
    from kvgate.engine.server import start_engine_server
    from kvgate.gateway import start_gateway

    async def body() -> None:
        endpoints = {f"e{i}": f"ipc://{sockets}/late{i}" for i in range(2)}
        engines = [await start_engine_server(EngineServerConfig(
            port=0, speedup=50.0, node_id=nid, model=MODEL, kv_events_endpoint=ep))
            for nid, ep in endpoints.items()]
        gw = None
        try:
            async with aiohttp.ClientSession() as session:
                async def chat(url: str, question: str, **headers: str) -> tuple[str, str, int]:
                    body = {"model": MODEL, "max_tokens": 4, "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}]}
                    async with session.post(url + "/v1/chat/completions", json=body,
                                            headers=headers) as r:
                        assert r.status == 200, await r.text()
                        usage = (await r.json())["usage"]
                        return (r.headers.get("X-Kvgate-Node", ""),
                                r.headers.get("X-Kvgate-Route-Reason", ""),
                                usage["prompt_tokens_details"]["cached_tokens"])

                await chat(engines[0].url, "before the gateway")  # e0 holds the prompt
                # e1 first in slot order: a tie on load goes there, not to the holder
                nodes = [{"id": e.node_id, "url": e.url, "kv_events": endpoints[e.node_id]}
                         for e in reversed(engines)]
                gw = await start_gateway(fast_gateway_config(
                    nodes, routing={"params": {"epsilon": 0.0}, "index_mode": "precise",
                                    "hasher": "sim"}))
                ctl = gw.gateway.controller
                # a first request through the gateway on e0: its blocks continue the old
                # prompt, so its events are orphans
                assert (await chat(gw.url, "first", **{"X-Kvgate-Exclude-Node": "e1"}))[0] == "e0"
                await eventually(lambda: NodeId("e0") in ctl.routing_learns)
                async with session.get(gw.url + "/metrics") as r:
                    text = await r.text()
                assert 'kvgate_kv_event_routing_learns{node="e0"} 1' in text
                assert 'kvgate_kv_event_routing_learns{node="e1"} 0' in text
                await chat(gw.url, "taught")  # a dispatch routing now learns from
                await asyncio.sleep(2.5)  # past every speculative entry's 2 s
                node, reason, cached = await chat(gw.url, "much later")
                assert (node, reason) == ("e0", "cache_hit") and cached > 0
        finally:
            if gw is not None:
                await gw.stop()
            for e in engines:
                await e.stop()

    run(body(), timeout=30)
