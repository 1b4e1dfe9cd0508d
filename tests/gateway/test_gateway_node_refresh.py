"""The node watcher re-reads a node's models after a restart and now and then, bounds
what it reads from a node, and says when a healthy node's scrapes keep failing."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp import web

from kvgate.core.ids import NodeId
from kvgate.gateway import node_watcher

# probes only when a test calls them: no background loop races the assertions
SLOW_LOOPS = {"health_interval_s": 60.0, "metrics_interval_s": 60.0,
              "evictions_interval_s": 60.0}
SLOW_ROUTING = {"stale_after_s": 120.0}


def _page(started: float) -> bytes:
    return f"vllm:num_requests_running 0\nprocess_start_time_seconds {started}\n".encode()


def test_a_node_restarted_with_another_model_is_routed_that_model(kit: Any) -> None:
    """An engine restarted fast (no health check failed) with another model: the watcher
    saw the restart (its process start time moved on) but never re-read /v1/models, and
    every request for the new model got 404 model_not_found for good."""

    async def body() -> None:
        async with kit.cluster(1, stub={"models": ("model-a",), "max_model_len": 4096},
                               nodes=SLOW_LOOPS, routing=SLOW_ROUTING) as c:
            watcher = c.gw.gateway.watcher
            rt = watcher.get("n0")
            assert rt is not None
            started = [1700000000.0]
            real_get = watcher._get

            async def fake_get(node: Any, path: str, timeout: float) -> Any:
                if path == "/metrics":
                    return 200, _page(started[-1])
                return await real_get(node, path, timeout)

            watcher._get = fake_get  # type: ignore[method-assign]
            await watcher.scrape(rt)
            status, _, _ = await c.post("/v1/completions", {"model": "model-b", "prompt": "hi"})
            assert status == 404
            # the engine restarts with model-b and a longer context
            c.stubs[0].models, c.stubs[0].max_model_len = ("model-b",), 8192
            started.append(1700000050.0)
            await watcher.scrape(rt)  # the restart is seen here
            await watcher.check_health(rt)  # and the models read on the next check
            spec = c.gw.controller.nodes.get(NodeId("n0")).spec
            assert spec.models == frozenset({"model-b"}) and spec.max_model_len == 8192
            status, _, raw = await c.post("/v1/completions",
                                          {"model": "model-b", "prompt": "hi"})
            assert status == 200, raw
            _, _, listed = await c.get("/v1/models")
            assert b"model-b" in listed and b"model-a" not in listed

    kit.run(body())


def test_models_are_re_read_every_so_many_health_checks(kit: Any) -> None:
    """A model swapped behind the URL with no restart signal at all (no process start
    time on /metrics) is picked up within a bounded number of health checks."""

    async def body() -> None:
        async with kit.cluster(1, stub={"models": ("model-a",)}, nodes=SLOW_LOOPS,
                               routing=SLOW_ROUTING) as c:
            watcher = c.gw.gateway.watcher
            rt = watcher.get("n0")
            assert rt is not None
            c.stubs[0].models = ("model-b",)
            seen = frozenset({"model-a"})
            for _ in range(60):  # at most this many checks (the default interval: 60 s)
                await watcher.check_health(rt)
                seen = c.gw.controller.nodes.get(NodeId("n0")).spec.models
                if seen != frozenset({"model-a"}):
                    break
            assert seen == frozenset({"model-b"})

    kit.run(body())


async def _odd_node(kit: Any, pages: list[bytes]) -> Any:
    """A stub engine whose /metrics answers the last of ``pages``."""
    stub = kit.StubEngine(name="odd")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=pages[-1])

    stub._metrics = metrics  # bound by start()
    return await stub.start()


def test_an_oversized_probe_answer_is_refused_and_counted(
    kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /metrics page larger than the cap is not read whole: it counts as a scrape
    error, and the node's load stays as it was."""
    monkeypatch.setattr(node_watcher, "MAX_PROBE_BYTES", 64 * 1024, raising=False)
    page = b"vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n"
    page += b"# padding\n" * 20_000  # 200 KB

    async def body() -> None:
        odd = await _odd_node(kit, [page])
        try:
            async with kit.cluster(0, extra_nodes=[{"id": "odd", "url": odd.url}],
                                   nodes=SLOW_LOOPS, routing=SLOW_ROUTING) as c:
                watcher = c.gw.gateway.watcher
                rt = watcher.get("odd")
                assert rt is not None
                before = rt.errors["metrics"]
                await watcher.scrape(rt)
                assert rt.errors["metrics"] == before + 1
                assert c.gw.controller.nodes.get(NodeId("odd")).reported_running != 7
        finally:
            await odd.stop()

    kit.run(body())


def test_a_healthy_node_whose_scrapes_keep_failing_is_logged_once(
    kit: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose /metrics never parses was only counted in
    kvgate_node_scrape_errors_total: one warning now says so (not one per scrape)."""
    caplog.set_level(logging.INFO, logger="kvgate.gateway.nodes")
    pages = [b"<html>hello</html>\n"]

    async def body() -> None:
        odd = await _odd_node(kit, pages)
        try:
            async with kit.cluster(0, extra_nodes=[{"id": "odd", "url": odd.url}],
                                   nodes=SLOW_LOOPS, routing=SLOW_ROUTING) as c:
                watcher = c.gw.gateway.watcher
                rt = watcher.get("odd")
                assert rt is not None
                for _ in range(10):
                    await watcher.scrape(rt)

                def lines(text: str) -> list[str]:
                    return [r.getMessage() for r in caplog.records
                            if "odd" in r.getMessage() and text in r.getMessage()]

                warned = lines("scrapes of /metrics in a row failed")
                assert len(warned) == 1 and "no load gauges" in warned[0], warned
                pages.append(b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
                await watcher.scrape(rt)
                assert len(lines("work again")) == 1
                pages.append(b"garbage\n")
                for _ in range(10):  # failing again at once: not warned again so soon
                    await watcher.scrape(rt)
                assert len(lines("scrapes of /metrics in a row failed")) == 1
        finally:
            await odd.stop()

    kit.run(body())
