"""The OpenAI/vLLM surface of `kvgate engine`: real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from kvgate.engine.server_tokens import PromptTokenizer

pytestmark = pytest.mark.asyncio

MODEL = "kvgate-sim"


async def test_completion_unary_shape_and_usage(start_server: Any,
                                                http: aiohttp.ClientSession) -> None:
    server = await start_server()
    body = {"model": MODEL, "prompt": "Say hello to the simulated engine.", "max_tokens": 5}
    async with http.post(f"{server.url}/v1/completions", json=body,
                         headers={"X-Request-Id": "abc"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "cmpl-abc"
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["id"] == "cmpl-abc"
    assert data["model"] == MODEL
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    prompt_tokens = len(body["prompt"]) // 4 + 1  # 34 chars: ceil(34 / 4)
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5, "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_default_max_tokens_is_16(start_server: Any,
                                                   http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.post(f"{server.url}/v1/completions",
                         json={"model": MODEL, "prompt": "x"}) as resp:
        data = await resp.json()
    assert data["usage"]["completion_tokens"] == 16


async def test_completion_stream_with_usage(start_server: Any, http: aiohttp.ClientSession,
                                            read_sse: Any) -> None:
    server = await start_server()
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    tokens = events[:-2]
    assert len(tokens) == 4
    assert all(t["object"] == "text_completion" for t in tokens)
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None, "length"]
    assert all(t["choices"][0]["text"].startswith(" ") for t in tokens)


async def test_stream_without_include_usage_has_no_usage_chunk(
    start_server: Any, http: aiohttp.ClientSession, read_sse: Any
) -> None:
    server = await start_server()
    body = {"model": MODEL, "prompt": "p", "max_tokens": 2, "stream": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        events = await read_sse(resp)
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_chat_unary_and_stream(start_server: Any, http: aiohttp.ClientSession,
                                     read_sse: Any) -> None:
    server = await start_server()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with http.post(f"{server.url}/v1/chat/completions",
                         json={"model": MODEL, "messages": messages, "max_tokens": 3}) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    message = data["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"].split()) == 3
    expected = PromptTokenizer(16).for_messages([("system", "be brief"), ("user", "hi")])
    assert data["usage"]["prompt_tokens"] == expected.num_tokens

    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:4]]
    assert len(contents) == 3 and all(c.strip() for c in contents)
    assert events[3]["choices"][0]["finish_reason"] == "length"
    assert events[4]["usage"]["completion_tokens"] == 3 and events[4]["choices"] == []
    assert events[5] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:5])


async def test_chat_default_max_tokens_is_256_clamped_to_model_len(
    start_server: Any, http: aiohttp.ClientSession
) -> None:
    server = await start_server(max_model_len=64)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}]}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
    usage = data["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64


async def test_repeated_long_prompt_hits_the_cache_and_cuts_ttft(
    start_server: Any, http: aiohttp.ClientSession, read_sse: Any
) -> None:
    server = await start_server(speedup=10.0)
    prompt = "".join(f"line {i} of a long shared system prompt. " for i in range(800))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft: list[float] = []
    cached: list[int] = []
    for _ in range(2):
        t0 = time.perf_counter()
        async with http.post(f"{server.url}/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            ttft.append(time.perf_counter() - t0)
            events = await read_sse(resp)
        cached.append(events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt_tokens = events[-2]["usage"]["prompt_tokens"]
    assert cached[0] == 0
    assert cached[1] == prompt_tokens // 16 * 16 or cached[1] >= prompt_tokens - 16
    assert ttft[1] < ttft[0] / 2, ttft


async def test_models(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server(num_blocks=100, block_size=16)
    async with http.get(f"{server.url}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    (model,) = data["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["owned_by"] == "kvgate" and model["max_model_len"] == 1600


async def test_metrics_use_vllm_names(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    prompt = "a" * 400
    for _ in range(2):
        async with http.post(f"{server.url}/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as resp:
            assert resp.status == 200
    async with http.get(f"{server.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels.split("{")[0]] = (name_labels, float(value))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total"):
        assert name in samples, name
        assert f'model_name="{MODEL}"' in samples[name][0]
    # vLLM's cache_config_info labels: the cache config and the engine, no model_name
    info = samples["vllm:cache_config_info"][0]
    assert "model_name" not in info and 'engine="0"' in info and 'block_size="' in info
    success = {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("vllm:request_success_total")}
    assert success == {"length": 2, "stop": 0, "abort": 0}  # vLLM's three, from 0
    assert samples["vllm:generation_tokens_total"][1] == 4
    assert samples["vllm:prefix_cache_hits_total"][1] > 0
    assert samples["vllm:num_requests_running"][1] == 0
    # a counter's family carries its _total, as prometheus_client writes it (under the
    # bare name its parser saw an empty counter and an untyped sample)
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert "# HELP vllm:prefix_cache_hits_total " in text
    # the process start, as vLLM's process collector writes it: a gateway tells a
    # restarted engine by it
    start = samples["process_start_time_seconds"]
    assert start[0] == "process_start_time_seconds" and 0 < time.time() - start[1] < 60


async def test_tokenize_refuses_a_model_that_is_not_a_string(
        start_server: Any, http: aiohttp.ClientSession) -> None:
    """400 invalid_type, as the completion routes answer; it was a 404 'The model `5`
    does not exist'."""
    server = await start_server()
    async with http.post(f"{server.url}/tokenize", json={"model": 5, "prompt": "hi"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_type", "model")


async def test_a_long_tokenize_runs_off_the_event_loop(
        start_server: Any, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM tokenizes any length at /tokenize; a prompt of many MB took the simulated
    tokenizer seconds on the event loop, stalling every stream and /health."""
    import threading

    from kvgate.engine import server as server_module

    threads: list[str] = []
    real = server_module.tokenize_body

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(server_module, "tokenize_body", recording)
    server = await start_server()
    for prompt in ("short", "w" * 200_000):
        async with http.post(f"{server.url}/tokenize",
                             json={"model": MODEL, "prompt": prompt}) as resp:
            assert resp.status == 200
            assert (await resp.json())["count"] == -(-len(prompt) // 4)
    main = threading.main_thread().name
    assert threads[0] == main and threads[1] != main


async def test_tokenize_matches_usage(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.post(f"{server.url}/tokenize",
                         json={"model": MODEL, "prompt": "abcdefghij"}) as resp:
        data = await resp.json()
    assert data["count"] == 3 and len(data["tokens"]) == 3
    assert data["max_model_len"] == server.max_model_len
    assert data["tokens"] == list(PromptTokenizer(16).for_prompt("abcdefghij").token_ids)
    messages = [{"role": "user", "content": "what is a KV cache?"}]
    async with http.post(f"{server.url}/tokenize", json={"messages": messages}) as resp:
        chat_tokens = await resp.json()
    async with http.post(f"{server.url}/v1/chat/completions",
                         json={"model": MODEL, "messages": messages, "max_tokens": 1}) as resp:
        usage = (await resp.json())["usage"]
    assert chat_tokens["count"] == usage["prompt_tokens"]
    async with http.post(f"{server.url}/tokenize", json={"prompt": 3}) as resp:
        assert resp.status == 400
    async with http.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"}) as resp:
        assert resp.status == 404


async def test_token_id_prompt(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 1}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["prompt_tokens"] == 40
    body["prompt"] = [2**40]
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status == 400


@pytest.mark.parametrize(
    ("path", "payload", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"model": "kvgate-sim"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "max_tokens": 0}', 400,
         "max_tokens"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": ""}', 400, "prompt"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "messages": []}', 400, "messages"),
        ("/v1/chat/completions",
         b'{"model": "kvgate-sim", "messages": [{"role": "", "content": "x"}]}', 400,
         "messages[0].role"),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "max_tokens": 99999}', 400,
         None),
        # what the simulator cannot answer in the asked shape, or vLLM refuses as well
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "logprobs": 2}', 400,
         "logprobs"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "echo": true}', 400,
         "echo"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "suffix": "y"}', 400,
         "suffix"),
        ("/v1/completions",
         b'{"model": "kvgate-sim", "prompt": "x", "max_tokens": 2, "min_tokens": 5}', 400,
         "min_tokens"),
        # min_tokens against the max_tokens the request runs with (16 by default), and
        # its type and sign, as vLLM checks them
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "min_tokens": 100}', 400,
         "min_tokens"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "min_tokens": -3}', 400,
         "min_tokens"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", "min_tokens": "abc"}',
         400, "min_tokens"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "min_tokens": 300, '
         b'"messages": [{"role": "user", "content": "x"}]}', 400, "min_tokens"),
        # an id past the vocabulary has no embedding: vLLM's 400
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": [5, 32000]}', 400, "prompt"),
        # a media part is a real engine's to read; the simulator names it
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "messages": [{"role": "user", '
         b'"content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}', 400,
         "messages[0].content[0].image_url"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "logprobs": true, '
         b'"messages": [{"role": "user", "content": "x"}]}', 400, "logprobs"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "top_logprobs": 2, '
         b'"messages": [{"role": "user", "content": "x"}]}', 400, "top_logprobs"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", "tool_choice": "required", '
         b'"messages": [{"role": "user", "content": "x"}]}', 400, "tool_choice"),
        ("/v1/chat/completions", b'{"model": "kvgate-sim", '
         b'"response_format": {"type": "json_object"}, '
         b'"messages": [{"role": "user", "content": "x"}]}', 400, "response_format"),
        ("/v1/completions", b'{"model": "kvgate-sim", "prompt": "x", '
         b'"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}', 400,
         "response_format"),
    ],
)
async def test_errors_are_openai_shaped(start_server: Any, http: aiohttp.ClientSession,
                                        path: str, payload: bytes, status: int,
                                        param: str | None) -> None:
    server = await start_server()
    async with http.post(f"{server.url}{path}", data=payload,
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        body = await resp.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


async def test_body_size_limit(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server(max_body_bytes=4096)
    body = {"model": MODEL, "prompt": "x" * 5000}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


async def test_health(start_server: Any, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 200


async def test_badly_encoded_body_is_a_400(start_server: Any, http: aiohttp.ClientSession) -> None:
    # a body that says gzip but is not: the client's fault, not a 500
    server = await start_server()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    payload = b'{"model": "x", "prompt": "hi"}'
    async with http.post(f"{server.url}/v1/completions", data=payload, headers=headers) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_body"


async def _raw_exchange(port: int, raw: bytes) -> tuple[bytes, bytes]:
    """Send ``raw`` bytes on a fresh connection: the answer's head and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return head, await asyncio.wait_for(reader.readexactly(length), 5.0)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", b"400", "malformed_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", b"431",
         "headers_too_large"),
    ],
    ids=["junk-request-line", "oversized-header"],
)
async def test_what_the_http_parser_rejects_gets_an_openai_error(
    start_server: Any, http: aiohttp.ClientSession, raw: bytes, status: bytes, code: str
) -> None:
    """Like the gateway: JSON in OpenAI's shape, not aiohttp's text/plain echo of the bytes."""
    server = await start_server()
    assert server.port is not None
    head, body = await _raw_exchange(server.port, raw)
    assert head.split(b" ")[1] == status
    assert b"application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert b"aaaa" not in body  # the client's bytes are not quoted back
    async with http.get(f"{server.url}/health") as resp:  # and the server carries on
        assert resp.status == 200


async def test_a_stalled_request_head_is_dropped(start_server: Any) -> None:
    server = await start_server(header_timeout_s=0.2)
    assert server.port is not None
    head, body = await _raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    assert head.split(b" ")[1] == b"408"
    assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("sent", [b"", b'{"mod'], ids=["no-body", "half-a-body"])
async def test_a_stalled_request_body_gets_408_and_the_connection_closes(
        start_server: Any, sent: bytes) -> None:
    """A head with Content-Length and then too little body: a 408 after body_timeout_s,
    then the connection closes (the rest of the body must not be read as a request).
    The engine waited for the body forever."""
    server = await start_server(body_timeout_s=0.3)
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + sent)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.split(b" ")[1] == b"408"
        rest = await asyncio.wait_for(reader.read(), 5.0)  # to EOF: the server closed
        assert json.loads(rest)["error"]["code"] == "request_timeout"
    finally:
        writer.close()


async def test_an_unknown_expectation_is_a_json_417_without_an_echo(start_server: Any) -> None:
    server = await start_server()
    assert server.port is not None
    head, body = await _raw_exchange(server.port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\nExpect: the-moon\r\n\r\n"))
    assert head.split(b" ")[1] == b"417"
    error = json.loads(body)["error"]
    assert error["code"] == "expectation_failed" and "the-moon" not in error["message"]
    for path in (b"/health", b"/v1/models", b"/metrics"):  # GET routes too, not text/plain
        head, body = await _raw_exchange(
            server.port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nExpect: the-moon\r\n\r\n")
        assert head.split(b" ")[1] == b"417", path
        assert json.loads(body)["error"]["code"] == "expectation_failed"


async def test_settings_the_simulator_need_not_honour_are_accepted(
        start_server: Any, http: aiohttp.ClientSession) -> None:
    """Sampling settings, stop strings, tools the model may skip, plain-text output and
    logprobs turned off: accepted (the answer is random words either way)."""
    server = await start_server()
    body = {"model": "kvgate-sim", "max_tokens": 4, "messages": [{"role": "user",
                                                                  "content": "x"}],
            "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n", "END"],
            "logprobs": False, "tool_choice": "auto", "response_format": {"type": "text"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    assert out["choices"][0]["message"]["content"]


async def test_cache_salt_keeps_caches_apart(start_server: Any,
                                             http: aiohttp.ClientSession) -> None:
    """vLLM's cache_salt: a request hits only blocks cached under its own salt (or, with
    none, unsalted ones). The engine ignored it, so salted tenants shared caches."""
    server = await start_server()
    prompt = "a shared prompt of some length, " * 40

    async def cached(salt: str | None) -> int:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        async with http.post(f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("A") == 0
    assert await cached("A") > 0  # its own salt: a hit
    assert await cached("B") == 0  # another salt: none of A's blocks
    assert await cached(None) == 0  # no salt: none either
    assert await cached(None) > 0 and await cached("B") > 0


async def test_metrics_carry_vllms_request_histograms(
        start_server: Any, http: aiohttp.ClientSession) -> None:
    """vLLM's Grafana dashboard draws TTFT, inter-token latency, e2e latency, decode
    time and request lengths from these histograms; without them its panels stayed
    empty in front of simulated engines. Times are wall seconds (engine time / speed-up)."""
    server = await start_server()
    for prompt in ("a" * 400, "b" * 800):
        async with http.post(f"{server.url}/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                   "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
    async with http.get(f"{server.url}/metrics") as resp:
        text = await resp.text()
    series: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            series.setdefault(name_labels.split("{")[0], []).append((name_labels, float(value)))
    for family in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:request_prefill_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_decode_time_seconds",
                   "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                   "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
                   "vllm:request_params_max_tokens", "vllm:iteration_tokens_total"):
        assert f"# TYPE {family} histogram" in text
        buckets = [v for _, v in series[f"{family}_bucket"]]
        assert buckets == sorted(buckets), family  # cumulative
        assert series[f"{family}_bucket"][-1][0].endswith('le="+Inf"}')
        count = series[f"{family}_count"][0][1]
        assert buckets[-1] == count, family
        assert f'model_name="{MODEL}"' in series[f"{family}_count"][0][0]
    count = {f: series[f"{f}_count"][0][1] for f in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_generation_tokens")}
    # two requests of 3 tokens each: two first tokens, four gaps between tokens
    assert count == {"vllm:time_to_first_token_seconds": 2,
                     "vllm:inter_token_latency_seconds": 4,
                     "vllm:e2e_request_latency_seconds": 2,
                     "vllm:request_generation_tokens": 2}
    assert series["vllm:request_generation_tokens_sum"][0][1] == 6
    assert series["vllm:request_prompt_tokens_sum"][0][1] == 300  # 100 + 200 tokens
    e2e = series["vllm:e2e_request_latency_seconds_sum"][0][1]
    ttft = series["vllm:time_to_first_token_seconds_sum"][0][1]
    assert 0 < ttft < e2e < 5.0
    # the phases add up: queue + prefill is the time to first token, queue + inference e2e
    queue = series["vllm:request_queue_time_seconds_sum"][0][1]
    prefill = series["vllm:request_prefill_time_seconds_sum"][0][1]
    inference = series["vllm:request_inference_time_seconds_sum"][0][1]
    assert series["vllm:request_queue_time_seconds_count"][0][1] == 2
    assert abs(queue + prefill - ttft) < 1e-6 and abs(queue + inference - e2e) < 1e-6
    assert len(server.timer) == 0  # nothing held once the requests ended
    # the parameters as asked (max_tokens 3, n 1), and every step's tokens: each prompt
    # in one prefill step that also gives its first token, then two decode steps
    assert series["vllm:request_params_max_tokens_sum"][0][1] == 6
    assert series["vllm:request_params_n_sum"][0][1] == 2
    assert series["vllm:request_max_num_generation_tokens_sum"][0][1] == 6
    assert series["vllm:iteration_tokens_total_count"][0][1] == 6
    assert series["vllm:iteration_tokens_total_sum"][0][1] == 100 + 2 + 200 + 2
