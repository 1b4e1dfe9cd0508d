"""The official openai client against the gateway, streaming and not."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from kvgate.core.errors import ConfigError


def test_openai_sdk_completions_and_chat(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="k", max_retries=0)
            try:
                comp = await client.completions.create(model=kit.MODEL, prompt="Say hi",
                                                       max_tokens=8)
                assert comp.choices[0].text == "hi there"
                chat = await client.chat.completions.create(
                    model=kit.MODEL, messages=[{"role": "user", "content": "hello"}])
                assert chat.choices[0].message.content == "hi there"
                assert chat.usage is not None and chat.usage.prompt_tokens == 100

                stream = await client.chat.completions.create(
                    model=kit.MODEL, messages=[{"role": "user", "content": "hello"}],
                    stream=True)
                parts = [ch.choices[0].delta.content async for ch in stream if ch.choices]
                assert "".join(p or "" for p in parts) == "t0 t1 t2 "

                cstream = await client.completions.create(
                    model=kit.MODEL, prompt="x", stream=True,
                    stream_options={"include_usage": True})
                chunks = [ch async for ch in cstream]
                assert chunks[-1].choices == [] and chunks[-1].usage is not None
                assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "t0 t1 t2 "

                raw = await client.completions.with_raw_response.create(
                    model=kit.MODEL, prompt="x", extra_headers={"X-Request-Id": "my-id-1"})
                assert raw.headers["x-request-id"] == "my-id-1"
                assert raw.headers["x-kvgate-node"] in ("n0", "n1")
                assert raw.headers["x-kvgate-route-reason"]
                models = await client.models.list()
                assert [m.id for m in models.data] == [kit.MODEL]
            finally:
                await client.close()
            seen = [s for stub in c.stubs for s in stub.seen]
            assert any(s.headers.get("X-Request-ID") == "my-id-1" for s in seen)
            assert c.gw.controller.stats.outcomes["completed"] == 5

    kit.run(body())


def test_usage_chunk_stripped_unless_asked_and_cached_tokens_measured(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"cached": 40}) as c:
            req = {"model": kit.MODEL, "prompt": "p" * 2000, "stream": True}
            status, _, raw = await c.post("/v1/completions", req)
            assert status == 200
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert not any('"usage"' in e for e in events)  # stripped again
            sent = c.stubs[0].seen[-1].body
            assert sent["stream_options"] == {"include_usage": True}

            req["stream_options"] = {"include_usage": True}
            _, _, raw = await c.post("/v1/completions", req)
            usage = [json.loads(e[6:]) for e in raw.decode().split("\n\n")
                     if e.startswith("data: {") and '"usage"' in e]
            assert usage and usage[0]["choices"] == []

            hits = c.gw.controller.stats.hits
            measured = sum(h.measured_hit_tokens for h in hits.values())
            assert measured == 80  # 40 cached tokens reported by each of the two streams
            assert sum(h.measured_prompt_tokens for h in hits.values()) > 0

    kit.run(body())


def test_an_answer_without_cached_tokens_is_a_miss_once_the_node_states_them(kit: Any) -> None:
    """vLLM (--enable-prompt-tokens-details) and SGLang (--enable-cache-report) leave
    prompt_tokens_details out of the usage when nothing was cached: streamed or not,
    such an answer counts as a measured miss, not as unmeasured."""
    async def body() -> None:
        async with kit.cluster(1, stub={"cached": 40}) as c:
            req = {"model": kit.MODEL, "prompt": "p" * 2000, "stream": True}
            assert (await c.post("/v1/completions", req))[0] == 200
            hits = c.gw.controller.stats.hits

            def measured() -> tuple[int, int]:
                return (sum(h.measured_prompt_tokens for h in hits.values()),
                        sum(h.measured_hit_tokens for h in hits.values()))

            one, cached = measured()
            assert one > 0 and cached == 40
            c.stubs[0].cached = None  # a miss, as vLLM answers it
            assert (await c.post("/v1/completions", req))[0] == 200
            assert (await c.post("/v1/completions", {**req, "stream": False}))[0] == 200
            assert measured() == (3 * one, 40)

    kit.run(body())


def test_route_headers_can_be_turned_off_and_priority_forwarded(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, server={"route_headers": False}) as c:
            status, headers, _ = await c.post("/v1/completions",
                                              {"model": kit.MODEL, "prompt": "x"})
            assert status == 200
            assert "X-Kvgate-Node" not in headers and "X-Request-ID" in headers
            assert c.stubs[0].seen[-1].body["priority"] == 1

    kit.run(body())


def test_priority_is_sent_in_the_nodes_own_order(kit: Any) -> None:
    """SGLang's --enable-priority-scheduling runs higher values first (unless
    --schedule-low-priority-values-first): upstream.priority_order: high_first sends P0
    as 2 and P2 as 0, so its scheduler still runs P0 first."""
    async def body() -> None:
        async with kit.cluster(1, upstream={"priority_order": "high_first"}) as c:
            sent = []
            for cls in ("0", "1", "2"):
                status, _, _ = await c.post("/v1/completions", {"model": kit.MODEL, "prompt": "x"},
                                            {"X-Kvgate-Priority": cls})
                assert status == 200
                sent.append(c.stubs[0].seen[-1].body["priority"])
            assert sent == [2, 1, 0]

    kit.run(body())
    with pytest.raises(ConfigError, match="priority_order"):
        from kvgate.gateway.config import UpstreamConfig
        UpstreamConfig(priority_order="first")  # type: ignore[arg-type]


def test_a_node_whose_health_check_takes_over_a_second_is_served(kit: Any) -> None:
    """SGLang's /health runs a 1-token generation and answers after at least 1 s; with a
    1 s timeout every SGLang node stayed down and every request was a 503."""
    async def body() -> None:
        from kvgate.gateway.config import NodesConfig

        default = NodesConfig().health_timeout_s  # the tests' fast config sets 0.5
        async with kit.cluster(1, stub={"health_delay_s": 1.2},
                               nodes={"health_timeout_s": default}) as c:
            status, headers, _ = await c.post("/v1/completions",
                                              {"model": kit.MODEL, "prompt": "x"})
            assert status == 200 and headers["X-Kvgate-Node"] == "n0"

    kit.run(body())


def test_models_union_and_unknown_model_404(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1) as c:
            other = await kit.StubEngine(name="x", models=("other",), max_model_len=999).start()
            try:
                from kvgate.gateway import NodeConfig

                await c.gw.gateway.watcher.add(NodeConfig(id="x", url=other.url))
                status, _, raw = await c.get("/v1/models")
                data = json.loads(raw)["data"]
                assert status == 200
                assert {m["id"]: m["max_model_len"] for m in data} == {
                    kit.MODEL: 4096, "other": 999}
                # one model by id (the openai SDK's models.retrieve), as the list has it
                status, _, raw = await c.get("/v1/models/other")
                assert status == 200 and json.loads(raw) == next(
                    m for m in data if m["id"] == "other")
                status, _, raw = await c.get("/v1/models/org/nope")  # ids may hold '/'
                err = json.loads(raw)["error"]
                assert status == 404 and err["code"] == "model_not_found", err
                status, _, raw = await c.post("/v1/completions", {"model": "other",
                                                                  "prompt": "x"})
                assert status == 200 and other.attempts == 1
                status, _, raw = await c.post("/v1/completions", {"model": "nope",
                                                                  "prompt": "x"})
                err = json.loads(raw)["error"]
                assert status == 404 and err["code"] == "model_not_found"
                assert err["param"] == "model"
                assert await c.gw.gateway.watcher.remove(c.gw.gateway.watcher.get("x").node_id)
            finally:
                await other.stop()

    kit.run(body())
