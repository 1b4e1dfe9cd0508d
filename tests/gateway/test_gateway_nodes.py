"""The node watcher: models, load scraping, health transitions, eviction announcements."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvgate.core.hashing import TokenBlockHasher, make_hasher
from kvgate.core.ids import NodeId
from kvgate.core.nodes import fleet_order
from kvgate.gateway import NodeConfig
from kvgate.gateway.kv_watch import NodeKvWatch, remembered_blocks
from kvgate.gateway.node_probe import parse_evictions, parse_load, parse_models

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
vllm:prefix_cache_hits_total{model_name="m"} 1e6
"""

SGLANG = """\
sglang:num_running_reqs{model_name="m"} 4
sglang:num_queue_reqs{model_name="m"} 2 1712345678000
sglang:token_usage{model_name="m"} 0.9
sglang:cache_hit_rate{model_name="m"} 0.3
"""


def test_parse_load_vllm_sglang_and_garbage() -> None:
    v = parse_load(VLLM)
    assert v is not None and (v.running, v.waiting) == (5, 8) and v.kv_util == 0.375
    s = parse_load(SGLANG)
    assert s is not None and (s.running, s.waiting, s.kv_util) == (4, 2, 0.9)
    old = parse_load("vllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc 0.5\n")
    assert old is not None and old.waiting == 2 and old.kv_util == 0.5
    assert parse_load("") is None
    assert parse_load("foo 1\n# vllm:num_requests_waiting 3\n") is None
    bad = parse_load("vllm:num_requests_waiting{x=\"1\"} NaN\nvllm:num_requests_running zz\n"
                     "vllm:num_requests_running{broken 3\nvllm:num_requests_running 1\n")
    assert bad is not None and (bad.running, bad.waiting, bad.kv_util) == (1, 0, None)


def test_parse_models_and_evictions_defensively() -> None:
    info = parse_models({"object": "list", "data": [
        {"id": "a", "max_model_len": 2048}, {"id": "b", "max_model_len": 8192},
        {"id": 3}, "junk", {"id": "c", "max_model_len": True}]})
    assert info is not None and info.ids == ("a", "b", "c") and info.max_model_len == 8192
    assert parse_models([]) is None and parse_models({"data": "x"}) is None
    events, cursor = parse_evictions([{"seq": 2, "type": "done"}, {"seq": 1, "type": "announced"},
                                      {"seq": "x", "type": "done"}, {"type": "announced"}, 7])
    assert [(e.seq, e.kind) for e in events] == [(1, "announced"), (2, "done")]
    assert cursor is None
    events, cursor = parse_evictions({"events": [{"seq": 5, "type": "EvictionAnnounced"}],
                                      "next": 6})
    assert [(e.seq, e.kind) for e in events] == [(5, "announced")] and cursor == 6
    assert parse_evictions(None) == ([], None)
    assert parse_evictions({"events": "nope"}) == ([], None)
    # a done's size in tokens is kept (the index forgets that much); junk counts as none
    events, _ = parse_evictions([
        {"seq": 1, "type": "EvictionDone", "num_tokens_evicted": 4096},
        {"seq": 2, "type": "EvictionDone", "num_tokens_evicted": -3},
        {"seq": 3, "type": "EvictionDone", "num_tokens_evicted": True},
        {"seq": 4, "type": "EvictionDone"}])
    assert [e.tokens_evicted for e in events] == [4096, 0, 0, 0]


def test_load_reports_reach_the_node_table(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"waiting": 6, "running": 4, "kv": 0.4}) as c:
            state = c.gw.controller.nodes.get("n0")
            assert state is not None
            await kit.eventually(lambda: state.reported_waiting == 6)
            assert state.reported_running == 4 and state.kv_util == 0.4
            assert state.spec.max_model_len == 4096
            assert state.spec.models == frozenset({kit.MODEL})
            c.stubs[0].waiting = 1
            await kit.eventually(lambda: state.reported_waiting == 1)

    kit.run(body())


def test_unreachable_node_starts_out_and_flapping_node_leaves_and_returns(kit: Any) -> None:
    async def body() -> None:
        dead = {"id": "dead", "url": f"http://127.0.0.1:{kit.closed_port()}"}
        async with kit.cluster(1, extra_nodes=[dead]) as c:
            ctl = c.gw.controller
            assert ctl.nodes.get("dead").healthy is False  # type: ignore[union-attr]
            assert ctl.admission.c_eff == 64  # only n0's capacity counts
            for _ in range(4):
                status, h, _ = await c.post("/v1/completions", {"model": kit.MODEL,
                                                                "prompt": "x"})
                assert status == 200 and h["X-Kvgate-Node"] == "n0"
            errors = dict(((n, k), v) for n, k, v in c.gw.gateway.watcher.error_counts())
            assert errors.get(("dead", "health"), 0) >= 1

            stub = c.stubs[0]
            n0 = ctl.nodes.get("n0")
            assert n0 is not None
            stub.healthy = False
            await kit.eventually(lambda: not n0.healthy)
            stub.healthy = True
            await kit.eventually(lambda: n0.healthy)

    kit.run(body())


def test_eviction_announcements_lower_the_cache_weight(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            stub = c.stub("n0")
            stub.evictions = []
            ctl = c.gw.controller
            n0, n1 = ctl.nodes.get("n0"), ctl.nodes.get("n1")
            assert n0 is not None and n1 is not None
            stub.evictions.append({"seq": 1, "type": "announced", "blocks": 100})
            await kit.eventually(lambda: n0.cache_weight < 1.0)
            assert ctl.stats.eviction_warnings == 1
            stub.evictions.append({"seq": 2, "type": "done"})
            await kit.eventually(lambda: n0.cache_weight == 1.0)
            assert ctl.stats.eviction_warnings == 1  # seen once, not once per poll
            watcher = c.gw.gateway.watcher
            assert watcher.get("n0").evictions_supported  # type: ignore[union-attr]
            await kit.eventually(lambda: not watcher.get("n1").evictions_supported)  # type: ignore[union-attr]
            assert n1.cache_weight == 1.0

    kit.run(body())


def test_a_fleet_gateway_gives_its_configured_nodes_slots_in_its_own_order(kit: Any) -> None:
    """The lowest slot breaks ties between equally idle nodes. A gateway that is one of
    several (admission.expected_gateways above 1) orders its nodes by a hash of its
    gateway id, so the fleet's gateways do not all send their first requests to the same
    node; a lone gateway keeps the configured order. Only slots move: the watcher keeps
    its nodes in the configured order (and the admin API lists them by id)."""

    def slots(c: Any) -> list[str]:
        return [s.node_id for s in sorted(c.gw.controller.nodes, key=lambda s: s.slot)]

    async def body() -> None:
        configured = [f"n{i}" for i in range(4)]
        async with kit.cluster(4) as c:
            assert slots(c) == configured
        fleet = {"expected_gateways": 2}
        server = {"gateway_id": "gw-a"}
        async with kit.cluster(4, admission=fleet, server=server) as c:
            specs = [c.gw.controller.nodes.get(n).spec for n in configured]
            assert slots(c) == [s.node_id for s in fleet_order("gw-a", specs)]
            assert slots(c) != configured
            assert list(c.gw.gateway.watcher.nodes) == configured

    kit.run(body())


def test_a_restarted_node_is_read_afresh(kit: Any) -> None:
    """A node's engine restarts: its notice log numbers from 0 again (the old cursor
    would skip every new notice) and the old process's announced eviction will never
    be done. The watcher sees the log's cursor go back, forgets the node's cache and
    pending evictions, and reads the new log from its start."""

    async def body() -> None:
        async with kit.cluster(2) as c:
            ctl = c.gw.controller
            watcher = c.gw.gateway.watcher
            rt = watcher.get("n0")
            n0 = ctl.nodes.get("n0")
            assert rt is not None and n0 is not None
            pages: list[dict[str, Any]] = []
            real_get = watcher._get

            async def fake_get(node: Any, path: str, timeout: float) -> Any:
                if node is not rt or not path.startswith("/kvgate/evictions"):
                    return await real_get(node, path, timeout)
                page = pages[-1] if pages else {"events": [], "next": rt.eviction_cursor}
                return 200, json.dumps(page).encode()

            watcher._get = fake_get  # type: ignore[method-assign]
            announced = {"seq": 41, "type": "EvictionAnnounced"}
            pages.append({"events": [announced], "next": 42})
            await watcher.poll_evictions(rt)
            assert n0.cache_weight < 1.0 and rt.eviction_cursor == 42
            pages.append({"events": [], "next": 0})  # restarted: an empty log
            await watcher.poll_evictions(rt)
            assert n0.cache_weight == 1.0 and (rt.eviction_cursor, rt.last_seq) == (0, -1)
            pages.append({"events": [{"seq": 0, "type": "EvictionAnnounced"}], "next": 1})
            await watcher.poll_evictions(rt)  # the new process's first notice counts
            assert n0.cache_weight < 1.0 and rt.eviction_cursor == 1

    kit.run(body())


def test_a_restart_is_seen_by_the_process_start_time_alone(kit: Any) -> None:
    """A fast restart (no health check failed, no eviction notice ever, so the notice
    log's cursor stays at 0) went unseen: the index kept the old process's cache. The
    process start time on /metrics (vLLM's process collector, kvgate engine's own)
    changing is a restart: the node's learnt blocks and pending evictions go."""

    async def body() -> None:
        async with kit.cluster(1, nodes={"metrics_interval_s": 0.05}) as c:
            ctl = c.gw.controller
            watcher = c.gw.gateway.watcher
            rt = watcher.get("n0")
            assert rt is not None
            pages = ["vllm:num_requests_running 0\nprocess_start_time_seconds 1700000000.5\n"]
            real_get = watcher._get

            async def fake_get(node: Any, path: str, timeout: float) -> Any:
                if node is not rt or path != "/metrics":
                    return await real_get(node, path, timeout)
                return 200, pages[-1].encode()

            watcher._get = fake_get  # type: ignore[method-assign]
            n0 = NodeId("n0")
            window = watcher._restart_window_s

            def page(started: float) -> None:
                pages.append(f"vllm:num_requests_running 0\nprocess_start_time_seconds {started}\n")

            await watcher.scrape(rt)
            assert rt.started_at == 1700000000.5
            ctl.index.insert(n0, [11, 12, 13], 0.0)
            await watcher.scrape(rt)  # the same process: nothing forgotten
            assert ctl.index.node_entries(n0) == 3
            page(1700000042.25)
            await watcher.scrape(rt)
            assert ctl.index.node_entries(n0) == 0
            assert rt.started_at == 1700000042.25
            # a second signal of the same restart (its notice log going back, a poll
            # later) must not drop what the new process cached meanwhile
            ctl.index.insert(n0, [14], 0.0)
            watcher._restarted(rt, "its eviction log went back")
            assert ctl.index.node_entries(n0) == 1
            await asyncio.sleep(window + 0.05)
            # behind a load balancer an older process answers: no restart
            page(1700000010.0)
            await watcher.scrape(rt)
            assert ctl.index.node_entries(n0) == 1 and rt.started_at == 1700000042.25
            # precise mode, the new process's KV events said so first (their sequence
            # started again) and the index already follows it: not cleared again
            h = make_hasher("sim", block_size=16)
            assert isinstance(h, TokenBlockHasher)
            rt.kv = NodeKvWatch(n0, h, ["ipc:///nowhere"])
            rt.kv.ingest.counts["restarts"] = 1
            rt.kv.note_restarts(watcher.clock())
            ctl.index.insert(n0, [21, 22], 0.0)
            page(1700000099.0)
            await watcher.scrape(rt)
            assert ctl.index.node_entries(n0) == 3
            await asyncio.sleep(window + 0.05)
            page(1700000123.0)
            await watcher.scrape(rt)  # a restart the events did not report: cleared
            assert ctl.index.node_entries(n0) == 0

    kit.run(body())


def test_a_node_back_from_unhealthy_reads_its_notices_afresh(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            watcher = c.gw.gateway.watcher
            rt = watcher.get("n0")
            assert rt is not None
            rt.eviction_cursor, rt.last_seq, rt.evictions_supported = 57, 56, False
            watcher._mark(rt, healthy=False)
            assert rt.eviction_cursor == 57  # down: nothing read meanwhile
            watcher._mark(rt, healthy=True)
            assert (rt.eviction_cursor, rt.last_seq, rt.evictions_supported) == (0, -1, True)

    kit.run(body())


def test_parse_load_counts_each_sglang_batch_once_across_parallel_ranks() -> None:
    """--enable-metrics-for-all-schedulers: every TP (and PP) rank logs its data-parallel
    rank's batch; summed, two TP ranks read as twice the load and the cache."""
    labels = 'model_name="m",engine_type="unified",tp_rank="{tp}",pp_rank="0",dp_rank="{dp}"'
    lines = []
    for dp, running in ((0, 3), (1, 5)):
        for tp in (0, 1):
            lab = labels.format(tp=tp, dp=dp)
            lines += [f"sglang:num_running_reqs{{{lab}}} {running}",
                      f"sglang:num_queue_reqs{{{lab}}} 1",
                      f"sglang:max_total_num_tokens{{{lab}}} 1000"]
    sample = parse_load("\n".join(lines) + "\n")
    assert sample is not None
    # the two data-parallel ranks add up; their tensor-parallel copies do not
    assert (sample.running, sample.waiting, sample.cache_tokens) == (8, 2, 2000)


def test_parse_load_reads_the_cache_size_from_vllm_and_sglang_metrics() -> None:
    def cache_tokens(page: str) -> int | None:
        sample = parse_load("vllm:num_requests_running 1\n" + page)
        assert sample is not None
        return sample.cache_tokens

    vllm = ('# HELP vllm:cache_config_info x\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0\n')
    # two data-parallel ranks of 500 blocks: vLLM's front end sums them into one cache
    # config and writes it once per rank (it was read as twice the cache)
    assert cache_tokens(vllm) == 16_000
    assert cache_tokens('sglang:max_total_num_tokens{model="m"} 500000.0\n') == 500_000
    assert cache_tokens("sglang:max_total_num_tokens 123\n") == 123
    for bad in ("", "vllm:num_requests_waiting 3\n",
                'vllm:cache_config_info{block_size="x",num_gpu_blocks="9"} 1\n',
                'vllm:cache_config_info{num_gpu_blocks="9"} 1\n',
                "sglang:max_total_num_tokens NaN\n", "sglang:max_total_num_tokens\n",
                "sglang:max_total_num_tokens 1e308\nsglang:max_total_num_tokens 1e308\n"):
        assert cache_tokens(bad) is None, bad
    sample = parse_load("vllm:num_requests_running 1\nprocess_start_time_seconds 17.5\n")
    assert sample is not None and sample.started_at == 17.5
    # finite gauges adding up to infinity are no reading (it was an OverflowError)
    assert parse_load("vllm:num_requests_running 1e308\nvllm:num_requests_running 1e308\n") is None


def test_index_capacity_follows_the_node_cache_unless_configured(kit: Any) -> None:
    """cache_blocks left out: the node's KV cache (num_gpu_blocks x block_size, the
    total its two ranks' lines each give) in index blocks, read at every scrape;
    configured: as is."""
    from kvgate.testing import eventually

    async def body() -> None:
        async with kit.cluster(1, stub={"gpu_blocks": 2048},
                               nodes={"metrics_interval_s": 0.05}) as c:
            url = c.stubs[0].url
            await c.gw.gateway.watcher.add(NodeConfig(id="set", url=url, cache_blocks=77))
            ctl = c.gw.controller
            tpb = ctl.hasher.tokens_per_block

            def blocks(node: str) -> int:
                state = ctl.nodes.get(NodeId(node))
                return -1 if state is None else int(state.spec.cache_blocks)

            await eventually(lambda: blocks("n0") == 2048 * 16 // tpb)
            # a KV-event mapper's memory bound follows the cache size too (precise mode)
            rt = c.gw.gateway.watcher.get("n0")
            assert rt is not None
            h = make_hasher("sim", block_size=16)
            assert isinstance(h, TokenBlockHasher)
            rt.kv = NodeKvWatch(NodeId("n0"), h, ["ipc:///nowhere"])
            assert rt.kv.ingest.max_blocks == remembered_blocks(None) == 16_384
            c.stubs[0].gpu_blocks = 64 * 1024  # restarted with a larger cache
            big = 64 * 1024 * 16 // tpb
            await eventually(lambda: blocks("n0") == big)
            assert rt.kv.ingest.max_blocks == remembered_blocks(big) == max(16_384, 4 * big)
            c.stubs[0].gpu_blocks = 1024  # restarted with a smaller cache
            await eventually(lambda: blocks("n0") == 1024 * 16 // tpb)
            assert ctl.index.capacity(NodeId("n0")) == 1024 * 16 // tpb
            assert rt.kv.ingest.max_blocks == 16_384  # the floor
            await eventually(lambda: blocks("set") == 77)
            await asyncio.sleep(0.2)  # several scrapes later: still as configured
            assert blocks("set") == 77 and ctl.index.capacity(NodeId("set")) == 77

    kit.run(body())


def test_a_node_going_down_is_logged_with_what_its_health_check_got(
        kit: Any, caplog: Any) -> None:
    """The line said only "node n0 is unhealthy": refused, timed out or an HTTP status
    are told apart now (without the URL, which may hold a password)."""
    import logging

    import aiohttp

    from kvgate.gateway.node_watcher import _probe_error
    from kvgate.testing import eventually

    async def body() -> None:
        async with kit.cluster(1) as c:
            caplog.set_level(logging.WARNING, logger="kvgate.gateway.nodes")
            c.stubs[0].healthy = False
            await eventually(lambda: not c.gw.controller.nodes.get(NodeId("n0")).healthy)
            assert "node n0 is unhealthy (health check: HTTP 503)" in caplog.text

    kit.run(body())
    refused = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "Connection refused"))
    assert _probe_error(refused, 3.0) == "cannot connect (Connection refused)"
    assert _probe_error(TimeoutError(), 3.0) == "no answer within 3 s"


def test_a_node_configured_for_a_model_it_does_not_serve_is_logged(
        kit: Any, caplog: Any) -> None:
    """models: set for a node that serves another model: its requests all got the node's
    404 and nothing was logged."""
    import logging

    async def body() -> None:
        caplog.set_level(logging.WARNING, logger="kvgate.gateway.nodes")
        async with kit.cluster(1, extra_nodes=[]) as c:
            url = c.stubs[0].url
            await c.gw.gateway.watcher.add(NodeConfig(id="mis", url=url, models=("other",)))
            assert (f"node mis is configured for model(s) other but serves {kit.MODEL}"
                    in caplog.text)
            assert "node n0 is configured" not in caplog.text

    kit.run(body())
