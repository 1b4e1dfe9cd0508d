"""The node watcher's run-time add: a node removed, replaced or whose admin client
gave up while its first probe was running (no network: the probes are scripted)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.ids import NodeId
from kvgate.gateway.config import NodeConfig, NodesConfig
from kvgate.gateway.node_watcher import NodeRuntime, NodeWatcher
from kvgate.testing import run_bounded

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}).encode()
METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"


class ScriptedWatcher(NodeWatcher):
    """Probes of a URL listed in ``hang`` wait for ``release``, then fail; the others pass."""

    def __init__(self) -> None:
        ctl = Controller(ControllerConfig(), rng=random.Random(1))
        # long intervals: the loops exist but never probe during a test
        cfg = NodesConfig(health_interval_s=60, metrics_interval_s=60, evictions_interval_s=60,
                          startup_probe_timeout_s=30)
        super().__init__(ctl, cfg, upstream=None, clock=time.monotonic)  # type: ignore[arg-type]
        self.hang: set[str] = set()
        self.release = asyncio.Event()
        self.waiting = 0

    async def _get(self, rt: NodeRuntime, path: str, timeout: float) -> tuple[int, bytes] | None:
        if rt.url in self.hang:
            self.waiting += 1
            await self.release.wait()
            return None
        if path == "/health":
            return 200, b""
        if path == "/v1/models":
            return 200, MODELS
        if path == "/metrics":
            return 200, METRICS
        return 404, b""


async def _until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_a_node_deleted_while_being_added_leaves_nothing_behind() -> None:
    async def body() -> None:
        w = ScriptedWatcher()
        w.hang.add("http://old:1")
        first = asyncio.ensure_future(w.add(NodeConfig(id="X", url="http://old:1")))
        await _until(lambda: w.waiting >= 1)
        assert await w.remove(NodeId("X"))
        new = await w.add(NodeConfig(id="X", url="http://new:1"))
        state = w.controller.nodes.get(NodeId("X"))
        assert state is not None and state.healthy
        w.release.set()  # the old probe fails now
        old = await first
        assert old is not new and w.get("X") is new
        assert old.tasks == []  # no loops for the removed node
        assert state.healthy  # the old add did not mark the new node down
        # a stale runtime's probes never act on the node that took its id
        for _ in range(w.config.unhealthy_after + 1):
            await w.check_health(old)
        assert state.healthy
        await w.scrape(old)
        await w.stop()

    run_bounded(body())


def test_a_stale_runtime_loop_ends_instead_of_probing_its_successor() -> None:
    async def body() -> None:
        w = ScriptedWatcher()
        old = await w.add(NodeConfig(id="X", url="http://old:1"))
        w.nodes[NodeId("X")] = NodeRuntime(config=NodeConfig(id="X", url="http://new:1"),
                                           headers={})
        probed: list[NodeRuntime] = []

        async def probe(rt: NodeRuntime) -> None:
            probed.append(rt)

        await asyncio.wait_for(w._every(0.001, old, probe), 5)  # returns: not current
        assert probed == []
        await w.stop()
        for t in old.tasks:
            t.cancel()

    run_bounded(body())


def test_an_add_whose_caller_is_cancelled_still_completes() -> None:
    async def body() -> None:
        w = ScriptedWatcher()
        w.hang.add("http://slow:1")
        task = asyncio.ensure_future(w.add(NodeConfig(id="Y", url="http://slow:1")))
        await _until(lambda: w.waiting >= 1)
        task.cancel()  # the admin client gave up: aiohttp cancels the handler
        await asyncio.gather(task, return_exceptions=True)
        rt = w.get("Y")
        state = w.controller.nodes.get(NodeId("Y"))
        if rt is None:
            assert state is None
        else:  # fully added: probed by its loops, out until a health check passes
            assert state is not None and not state.healthy
            assert len(rt.tasks) == 3 and not any(t.done() for t in rt.tasks)
        w.release.set()
        await w.stop()

    run_bounded(body())


def test_a_probe_that_raises_still_leaves_the_node_fully_added_and_held_out() -> None:
    """A first probe raising (a parser bug: finite gauges summing to infinity did) went
    through NodeWatcher.add to the admin API as a 500, the node added but unprobed."""

    async def body() -> None:
        w = ScriptedWatcher()

        async def broken(rt: NodeRuntime) -> None:
            raise OverflowError("cannot convert float infinity to integer")

        w.scrape = broken  # type: ignore[method-assign]
        rt = await w.add(NodeConfig(id="n1", url="http://n1:1"))
        try:
            assert w.get("n1") is rt and len(rt.tasks) == 3  # its loops run
            state = w.controller.nodes.get(NodeId("n1"))
            assert state is not None and not state.healthy  # out until a probe passes
        finally:
            await w.stop()

    run_bounded(body())
