"""`kvgate engine` under hostile or unlucky clients: reused request ids, huge prompts,
unusable headers, stalled steps, unknown routes (each from an audit; each failed before)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvgate.engine import EngineProfile
from kvgate.engine.api import EngineRequest
from kvgate.engine.sequence import ReqStatus
from kvgate.engine.server_config import parse_fault_flag
from kvgate.engine.server_tokens import SimTokenizer

pytestmark = pytest.mark.asyncio

MODEL = "kvgate-sim"
GENERATED_ID = re.compile(r"(chat)?cmpl-[0-9a-f]{32}")


def _body(prompt: str = "hello", max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def _fault(http: aiohttp.ClientSession, server: Any, **action: Any) -> None:
    async with http.post(f"{server.url}/admin/fault", json=action) as resp:
        assert resp.status == 200, await resp.text()


async def _poll(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for state no engine notification announces (a step planned, a handler gone)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                rid: str | None = None) -> tuple[int, dict[str, Any], str]:
    headers = {"X-Request-Id": rid} if rid is not None else None
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers.get("X-Request-Id", "")


# ----------------------------------------------------------- reused request ids
async def test_a_reused_request_id_is_not_aborted_by_its_previous_holder(
    start_server: Any, http: aiohttp.ClientSession
) -> None:
    """The engine finished A, whose handler still writes (a slow client): B may take the
    id, and A's handler ending must neither drop B's queue nor abort B in the engine."""
    server = await start_server()
    url = f"{server.url}/v1/completions"
    real_unary = server._unary
    held, release = asyncio.Event(), asyncio.Event()

    async def unary_held_once(*args: Any) -> Any:
        resp = await real_unary(*args)
        if not held.is_set():  # A: done in the engine, its answer not written yet
            held.set()
            await release.wait()
        return resp

    server._unary = unary_held_once
    first = asyncio.create_task(_post(http, url, _body(max_tokens=2), "reused"))
    await asyncio.wait_for(held.wait(), 5)
    second = asyncio.create_task(_post(http, url, _body("another", max_tokens=30), "reused"))
    await server.wait_until(lambda: server.engine.request_status("cmpl-reused") is not None)
    release.set()  # A's handler ends: its `finally` runs while B holds the id
    assert (await first)[0] == 200
    status, data, rid = await asyncio.wait_for(second, 5)
    assert (status, rid) == (200, "cmpl-reused")
    assert data["usage"]["completion_tokens"] == 30
    assert server.engine.metrics().num_requests_aborted == 0


async def test_a_step_result_goes_to_the_request_it_was_computed_for(
    start_server: Any, http: aiohttp.ClientSession, one_seq_profile: EngineProfile
) -> None:
    """A step finished A; while it runs (sleeps) A's client leaves and B takes the id:
    the step's result is A's, not B's answer."""
    server = await start_server(profile=one_seq_profile, speedup=1.0)
    url = f"{server.url}/v1/completions"
    rid = "cmpl-reused"
    await _fault(http, server, action="slow", factor=1000)  # one step: 10+ s
    first = asyncio.create_task(_post(http, url, _body(max_tokens=1), "reused"))
    # A's only step is planned (A is finished in the engine) and now sleeps
    await _poll(lambda: rid in server._pending and server.engine.request_status(rid) is None)
    first.cancel()
    await _poll(lambda: rid not in server._pending)  # A's handler is gone
    second = asyncio.create_task(_post(http, url, _body("another", max_tokens=3), "reused"))
    await _poll(lambda: server.engine.request_status(rid) is not None)  # B holds the id
    await _fault(http, server, action="recover")  # the slowed step ends at once
    status, data, got = await asyncio.wait_for(second, 5)
    assert (status, got) == (200, rid)
    assert data["usage"]["completion_tokens"] == 3  # B's own answer, not A's (1 token)


async def test_a_duplicate_id_racing_slow_first_byte_gets_a_fresh_id(
    start_server: Any, http: aiohttp.ClientSession, one_seq_profile: EngineProfile
) -> None:
    server = await start_server(profile=one_seq_profile, speedup=1.0)
    await _fault(http, server, action="slow_first_byte", seconds=0.2, count=2)
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]}
    results = await asyncio.gather(_post(http, url, body, "same"), _post(http, url, body, "same"))
    assert [status for status, _, _ in results] == [200, 200]
    ids = sorted(rid for _, _, rid in results)
    assert "chatcmpl-same" in ids and len(set(ids)) == 2
    assert all(data["id"] == rid for _, data, rid in results)


async def _raw_post(port: int, header: bytes, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """POST with a raw header line (bytes aiohttp's client would refuse to send)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\n" + header
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(
    "value",
    [b"\xff\xfe", b"caf\xc3\xa9", b"a b\tc", b"x" * 129],
    ids=["not-utf8", "non-ascii", "control-char", "too-long"],
)
async def test_an_unusable_x_request_id_gets_a_generated_id(
    start_server: Any, value: bytes, stream: bool
) -> None:
    server = await start_server()
    head, rest = await _raw_post(server.port, b"X-Request-Id: " + value,
                                 _body(max_tokens=2, stream=stream))
    assert head.startswith(b"HTTP/1.1 200 "), head
    rid = next(line.split(b": ", 1)[1] for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-request-id:"))
    assert GENERATED_ID.fullmatch(rid.decode()), rid
    assert rid in rest  # the body's ids are the same
    head, _ = await _raw_post(server.port, b"X-Request-Id: ok-1.A_b", _body(max_tokens=1))
    assert b"\r\nX-Request-Id: cmpl-ok-1.A_b\r\n" in head  # a usable one is kept


# ----------------------------------------------------------------- slow faults
async def test_the_slow_factor_is_bounded(start_server: Any,
                                          http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.post(f"{server.url}/admin/fault",
                         json={"action": "slow", "factor": 1e6}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == "factor" and "<= 1000" in error["message"]
    await _fault(http, server, action="slow", factor=1000)
    with pytest.raises(ValueError, match="out of range"):
        parse_fault_flag("slow:1001")


@pytest.mark.parametrize("actions", [("recover",), ("crash", "recover"), ("slow",)],
                         ids=["recover", "crash-recover", "slow-again"])
async def test_a_fault_action_replans_a_slowed_step(
    start_server: Any, http: aiohttp.ClientSession, one_seq_profile: EngineProfile,
    actions: tuple[str, ...],
) -> None:
    """A step slowed 1000 times (10+ s) ends as soon as the fault is healed or changed
    (its time left rescaled), or at once on a crash; the engine serves again."""
    server = await start_server(profile=one_seq_profile, speedup=1.0)
    url = f"{server.url}/v1/completions"
    await _fault(http, server, action="slow", factor=1000)
    first = asyncio.create_task(_post(http, url, _body(max_tokens=2), "slowed"))
    await _poll(lambda: server.engine.request_status("cmpl-slowed") is ReqStatus.RUNNING)
    for action in actions:  # "slow" = the default factor 2
        await _fault(http, server, action=action)
    status, _, _ = await asyncio.wait_for(first, 3)
    assert status == (503 if "crash" in actions else 200)
    status, data, _ = await asyncio.wait_for(_post(http, url, _body(max_tokens=2)), 3)
    assert status == 200 and data["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ huge prompts
@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 257},
         "prompt (65) + max_tokens (1) exceeds max_model_len (64)"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 160, "max_tokens": 30},
         "prompt (40) + max_tokens (30) exceeds max_model_len (64)"),
        ("/v1/chat/completions",  # "<|user|>\n" + 300 + "\n": 310 characters
         {"model": MODEL, "messages": [{"role": "user", "content": "y" * 300}]},
         "prompt (78) + max_tokens (1) exceeds max_model_len (64)"),
        ("/v1/completions", {"model": MODEL, "prompt": list(range(70))},
         "prompt (70) + max_tokens (1) exceeds max_model_len (64)"),
    ],
    ids=["text", "text-max-tokens", "chat", "token-ids"],
)
async def test_a_prompt_too_long_is_refused_before_it_is_tokenized(
    start_server: Any, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
    path: str, body: dict[str, Any], message: str,
) -> None:
    server = await start_server(max_model_len=64)
    encoded: list[int] = []
    real_encode = SimTokenizer.encode

    def encode(self: SimTokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
        encoded.append(len(text))
        return real_encode(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(SimTokenizer, "encode", encode)
    hashed: list[int] = []
    real_for_token_ids = server._tokens.for_token_ids
    monkeypatch.setattr(type(server._tokens), "for_token_ids",
                        lambda self, ids, param="prompt", salt=None: hashed.append(len(ids))
                        or real_for_token_ids(ids, param, salt=salt))
    async with http.post(f"{server.url}{path}", json=body) as resp:
        assert resp.status == 400
        data = await resp.json()
    assert data == {"error": {"message": message, "type": "invalid_request_error",
                              "param": None, "code": "context_length_exceeded"}}
    assert encoded == [] and hashed == []  # refused from its length alone
    # the engine's own words for the same refusal
    n, m = (int(x) for x in re.findall(r"\((\d+)\)", message)[:2])
    decision = server.engine.submit(
        EngineRequest(request_id="r", prompt_tokens=n, block_hashes=(0,) * (n // 16),
                      max_tokens=m, arrival=0.0), 0.0)
    assert decision.reason == message
    # a prompt that fits is tokenized and served as before
    async with http.post(f"{server.url}/v1/completions",
                         json={"model": MODEL, "prompt": "z" * 200, "max_tokens": 14}) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["prompt_tokens"] == 50


# ------------------------------------------------------------- /tokenize, routes
async def test_tokenize_with_a_deeply_nested_extra_field(
    start_server: Any, http: aiohttp.ClientSession
) -> None:
    """The client's body is validated as sent, not written back (that recursed: a 500)."""
    server = await start_server()
    nested = b"[" * 1000 + b"]" * 1000
    async with http.post(f"{server.url}/tokenize", data=b'{"prompt": "hi", "x": ' + nested + b"}",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["count"] == 1
    # "model": null is replaced, which takes writing the body back: too deep is a 400
    async with http.post(f"{server.url}/tokenize",
                         data=b'{"prompt": "hi", "model": null, "x": ' + nested + b"}",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "json_too_deep"


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("GET", "/nope", 404, "unknown_url", None),
        ("POST", "/v1/nope", 404, "unknown_url", None),
        ("PUT", "/health", 405, "method_not_allowed", "GET,HEAD"),
        ("GET", "/v1/completions", 405, "method_not_allowed", "POST"),
    ],
)
async def test_unknown_routes_and_methods_answer_openai_json(
    start_server: Any, http: aiohttp.ClientSession, method: str, path: str, status: int,
    code: str, allow: str | None,
) -> None:
    server = await start_server()
    async with http.request(method, f"{server.url}{path}") as resp:
        assert resp.status == status
        assert resp.content_type == "application/json"
        assert resp.headers.get("Allow") == allow
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)


async def test_the_engine_own_error_answers_are_not_rewrapped(
    start_server: Any, http: aiohttp.ClientSession
) -> None:
    server = await start_server()
    async with http.post(f"{server.url}/v1/completions",
                         json={"model": "other", "prompt": "x"}) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
