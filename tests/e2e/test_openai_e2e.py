"""The official openai SDK against the gateway in front of three engine servers."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

LONG_SYSTEM = (
    "You are the support assistant of a company that runs a large inference cluster. "
    "Answer briefly, cite the runbook section, never invent facts. "
) * 40  # ~6 000 characters: ~1 500 tokens of shared prefix


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=15.0)


def test_openai_sdk_unary_and_streaming_with_cached_tokens(e2e: Any) -> None:
    async def body() -> None:
        async with e2e.stack(3) as s, _client(s.url) as client:
            messages: list[Any] = [{"role": "system", "content": LONG_SYSTEM},
                                   {"role": "user", "content": "How do I drain a node?"}]
            raw = await client.chat.completions.with_raw_response.create(
                model=e2e.MODEL, messages=messages, max_tokens=8)
            first = raw.parse()
            node = raw.headers["x-kvgate-node"]
            assert first.choices[0].message.content
            assert first.usage is not None and first.usage.prompt_tokens > 1000
            assert first.usage.completion_tokens == 8

            # the same long prompt again: same node, served from its KV cache
            raw = await client.chat.completions.with_raw_response.create(
                model=e2e.MODEL, messages=messages, max_tokens=8)
            again = raw.parse()
            assert raw.headers["x-kvgate-node"] == node
            assert raw.headers["x-kvgate-route-reason"] == "cache_hit"
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            cached = again.usage.prompt_tokens_details.cached_tokens or 0
            assert cached > 1000

            # streamed, with the usage chunk the client asked for
            stream = await client.chat.completions.create(
                model=e2e.MODEL, messages=messages, max_tokens=12, stream=True,
                stream_options={"include_usage": True})
            text, usage = [], None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            assert len(text) >= 1
            assert usage is not None and usage.completion_tokens == 12
            assert usage.prompt_tokens_details is not None
            assert (usage.prompt_tokens_details.cached_tokens or 0) > 1000

            # the legacy completions endpoint, streamed without usage
            comp = await client.completions.create(
                model=e2e.MODEL, prompt=LONG_SYSTEM + "Q: status?", max_tokens=5, stream=True)
            pieces = [c.choices[0].text async for c in comp if c.choices]
            assert len("".join(pieces)) > 0

            models = await client.models.list()
            assert [m.id for m in models.data] == [e2e.MODEL]

            # measured and predicted hits reach the gateway's counters
            hits = s.gw.controller.stats.hits["1k_4k"]
            assert hits.measured_hit_tokens > 2000
            assert hits.predicted_hit_tokens > 2000

    e2e.run(body())


def test_shared_prefix_sticks_to_one_node_while_load_allows(e2e: Any) -> None:
    async def body() -> None:
        async with e2e.stack(3) as s, _client(s.url) as client:
            nodes: dict[str, list[str]] = {}
            for group in ("alpha", "beta"):
                system = f"[{group}] " + LONG_SYSTEM
                for i in range(5):
                    raw = await client.chat.completions.with_raw_response.create(
                        model=e2e.MODEL, max_tokens=4,
                        messages=[{"role": "system", "content": system},
                                  {"role": "user", "content": f"question {i} of {group}"}])
                    raw.parse()
                    nodes.setdefault(group, []).append(raw.headers["x-kvgate-node"])
            for group, seen in nodes.items():
                assert len(set(seen)) == 1, (group, seen)
            # the engine that served a group reports the cached prefix
            for seen in nodes.values():
                assert await s.engine_metric(seen[0], "vllm:prefix_cache_hits_total") > 0

    e2e.run(body())
