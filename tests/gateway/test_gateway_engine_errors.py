"""An engine's error answer without a JSON body (none, or an HTML page) reaches the
client OpenAI-shaped: a 4xx with its status, invalid_request_error and
x-should-retry: false (not a retryable 502); a 5xx as the failed attempt it is."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.gateway import start_gateway

C = "/v1/completions"
Answer = Callable[[], web.Response]


@asynccontextmanager
async def _gateway_over(kit: Any, answer: list[Answer]) -> AsyncIterator[tuple[str, Any]]:
    """One fake node answering completions with ``answer[0]()``; the gateway's URL."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": kit.MODEL, "object": "model", "max_model_len": 4096}]})

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return answer[0]()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post(C, complete)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw = None
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = await start_gateway(kit.config([{"id": "e", "url": url}]))
        yield gw.url, gw
    finally:
        if gw is not None:
            await gw.stop()
        await runner.cleanup()


def test_engine_errors_without_a_json_body_are_openai_shaped(kit: Any) -> None:
    answer: list[Answer] = [lambda: web.Response(status=400)]

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            async def post(stream: bool) -> tuple[int, Any, Any]:
                async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": stream}) as r:
                    raw = await r.read()
                    assert r.content_type == "application/json", raw[:200]
                    return r.status, r.headers, json.loads(raw)

            client_errors: list[tuple[int, Answer]] = [
                (400, lambda: web.Response(status=400)),
                (404, lambda: web.Response(status=404)),
                (400, lambda: web.Response(status=400, text="<html>bad</html>",
                                           content_type="text/html")),
                (422, lambda: web.Response(status=422, body=b"not json {",
                                           content_type="application/json")),
            ]
            for status, make in client_errors:
                answer[0] = make
                for stream in (False, True):
                    got, headers, out = await post(stream)
                    assert got == status, (status, stream, out)
                    err = out["error"]
                    assert set(err) == {"message", "type", "param", "code"}
                    assert err["type"] == "invalid_request_error" and err["message"]
                    assert headers["x-should-retry"] == "false"
                    assert "Retry-After" not in headers
                    assert headers["X-Kvgate-Node"] == "e"

            # an engine's JSON error body is passed through as it was
            engine_body = {"error": {"message": "bad", "type": "x", "param": None,
                                     "code": 422}}
            answer[0] = lambda: web.json_response(engine_body, status=422)
            got, headers, out = await post(False)
            assert (got, out) == (422, engine_body)
            assert headers["x-should-retry"] == "false"  # the client's own error, as any 4xx

            # a 5xx HTML page: the failed attempt's 502, OpenAI-shaped, Retry-After
            answer[0] = lambda: web.Response(status=500, text="<html>oops</html>",
                                             content_type="text/html")
            for stream in (False, True):
                got, headers, out = await post(stream)
                assert got == 502, out
                assert out["error"]["type"] == "server_error"
                assert headers["Retry-After"] == "1"
            assert gw.controller.num_requests() == 0

    kit.run(body())


def test_a_bare_503_from_the_only_node_is_a_503_the_client_may_retry(kit: Any) -> None:
    """The gateway's retry finds no other node: the client gets the node's failure, a
    503 with Retry-After it may retry (the request never ran), not the cluster-wide
    "overloaded" that tells it not to."""
    answer: list[Answer] = [lambda: web.Response(status=503)]

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x"}) as r:
                out = await r.json()
                assert r.status == 503, out
                assert out["error"]["code"] == "http_503" and out["error"]["type"]
                assert r.headers["Retry-After"] == "1"
                assert "x-should-retry" not in r.headers
                assert r.headers["X-Kvgate-Node"] == "e"
            assert gw.controller.num_requests() == 0
            assert gw.controller.stats.rejects["overloaded"] == 0

    kit.run(body())


def test_an_engines_429_passed_through_keeps_its_retry_after(kit: Any) -> None:
    """A node's 429 with its own JSON body, no retry left, reaches the client as it was:
    with the node's Retry-After now (it was dropped, leaving the openai SDK's retries no
    hint), 1 s when the node gave none or a date."""
    engine_body = {"error": {"message": "slow down", "type": "x", "param": None,
                             "code": 429}}
    answer: list[Answer] = []

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            for given, want in (("7", "7"), (None, "1"), ("Wed, 21 Oct 2015 07:28:00 GMT", "1")):
                extra = {} if given is None else {"Retry-After": given}
                answer[:] = [lambda extra=extra: web.json_response(  # type: ignore[misc]
                    engine_body, status=429, headers=extra)]
                async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x"}) as r:
                    assert (r.status, await r.json()) == (429, engine_body)
                    assert r.headers["Retry-After"] == want, given
            assert gw.controller.num_requests() == 0

    kit.run(body())


def test_a_prompt_that_fits_without_max_tokens_reaches_the_node(kit: Any) -> None:
    """No max_tokens: the node generates what fits (vLLM's rule), so only the prompt
    must fit. The gateway added its 256-token output estimate and refused a prompt the
    node serves; a prompt well past the context is still refused up front."""
    done = {"id": "c", "object": "text_completion", "created": 1, "model": kit.MODEL,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4000, "completion_tokens": 96, "total_tokens": 4096}}
    answer: list[Answer] = [lambda: web.json_response(done)]

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            prompt = "word " * 3200  # about 4000 tokens by its characters, of 4096
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": prompt}) as r:
                assert r.status == 200, await r.text()
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": prompt,
                                             "max_tokens": 1500}) as r:
                out = await r.json()  # asked for: 4000 + 1500 is well past 4096
                assert r.status == 400 and "1500 of max_tokens" in out["error"]["message"]
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": prompt * 2}) as r:
                out = await r.json()  # about 8000 tokens: no node can take it
                assert r.status == 400 and "about 8001 tokens" in out["error"]["message"], out
            assert gw.controller.num_requests() == 0

    kit.run(body())


def test_a_nodes_retry_after_is_passed_on_only_as_whole_seconds() -> None:
    from kvgate.gateway.relay import _node_retry_after

    assert [_node_retry_after(v) for v in ("7", " 30 ", "86400")] == ["7", "30", "86400"]
    for odd in (None, "", "1.5", "-1", "86401", "²", "٣", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert _node_retry_after(odd) == "1", odd


def test_a_node_refusing_the_gateways_key_is_its_fault_not_the_clients(kit: Any) -> None:
    """vLLM's --api-key check answers 401 {"error": "Unauthorized"}. The client's own
    key is never forwarded, so the node refused the gateway's: it was passed on as the
    client's error (x-should-retry: false, ``error`` a string), never retried, and the
    node never ejected. Now it counts toward ejection and fails as the node's fault."""
    answer: list[Answer] = [lambda: web.json_response({"error": "Unauthorized"}, status=401)]

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            node = gw.controller.nodes.get("e")
            for status in (401, 403, 407):
                answer[0] = lambda status=status: web.json_response(  # type: ignore[misc]
                    {"error": "Unauthorized"}, status=status)
                async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x"}) as r:
                    out = await r.json()
                    assert r.status == 502, out
                    assert out["error"]["type"] == "server_error"
                    assert out["error"]["code"] == "node_auth"
                    assert "x-should-retry" not in r.headers
            assert node.consecutive_failures == 3
            assert gw.controller.stats.failures["node_auth"] == 3
            # an error body not in OpenAI's shape is never passed on as it is
            answer[0] = lambda: web.json_response({"error": "nope"}, status=400)
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x"}) as r:
                out = await r.json()
                assert r.status == 400 and set(out["error"]) == {"message", "type", "param",
                                                                 "code"}
            assert gw.controller.num_requests() == 0

    kit.run(body())


def test_an_engines_in_stream_400_is_the_clients_error_not_the_nodes(kit: Any) -> None:
    """vLLM streams an error it finds only while generating (an out-of-vocabulary token
    id) as an event of HTTP status 400 after a 200. Counted as an upstream error, a
    client's bad streams ejected the node and opened the breaker for every tenant."""
    event = {"error": {"object": "error", "message": "Token id 999999 is out of vocabulary",
                       "type": "BadRequestError", "param": None, "code": 400}}
    sse = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n"
    answer: list[Answer] = [
        lambda: web.Response(text=sse, content_type="text/event-stream")
    ]

    async def body() -> None:
        async with _gateway_over(kit, answer) as (url, gw), aiohttp.ClientSession() as s:
            node = gw.controller.nodes.get("e")
            for _ in range(8):  # past eject_after_failures (5)
                async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x",
                                                 "stream": True}) as r:
                    raw = await r.read()
                    assert r.status == 200 and b"out of vocabulary" in raw and b"[DONE]" in raw
            assert node.healthy and node.consecutive_failures == 0
            assert gw.controller.stats.failures["client_error"] == 8
            # a 5xx in the stream is still the node's
            event["error"]["code"] = 500
            bad = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n"
            answer[0] = lambda: web.Response(text=bad, content_type="text/event-stream")
            async with s.post(url + C, json={"model": kit.MODEL, "prompt": "x",
                                             "stream": True}) as r:
                await r.read()
            assert node.consecutive_failures == 1
            assert gw.controller.num_requests() == 0

    kit.run(body())
