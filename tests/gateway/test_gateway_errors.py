"""Bad input gets the right 4xx with an OpenAI body; auth, priority caps, backpressure."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from kvgate.testing import raw_exchange

M = "stub-model"
C, CH = "/v1/completions", "/v1/chat/completions"

# (name, method, path, body, headers, status, param or None)
MALFORMED: list[tuple[str, str, str, Any, dict[str, str], int, str | None]] = [
    ("not json", "POST", C, b"{not json", {}, 400, None),
    ("json array", "POST", C, b"[1, 2]", {}, 400, None),
    ("bad utf-8", "POST", C, b"\xff\xfe{}", {}, 400, None),
    ("NaN", "POST", C, b'{"model":"stub-model","prompt":"x","temperature":NaN}', {}, 400, None),
    ("missing model", "POST", C, {"prompt": "x"}, {}, 400, "model"),
    ("model not a string", "POST", C, {"model": 3, "prompt": "x"}, {}, 400, "model"),
    ("empty model", "POST", C, {"model": "", "prompt": "x"}, {}, 400, "model"),
    ("missing prompt", "POST", C, {"model": M}, {}, 400, "prompt"),
    ("prompt an int", "POST", C, {"model": M, "prompt": 5}, {}, 400, "prompt"),
    ("empty prompt list", "POST", C, {"model": M, "prompt": []}, {}, 400, "prompt"),
    ("batched prompts", "POST", C, {"model": M, "prompt": ["a", "b"]}, {}, 400, "prompt"),
    ("negative token id", "POST", C, {"model": M, "prompt": [1, -2]}, {}, 400, "prompt[1]"),
    ("max_tokens a string", "POST", C, {"model": M, "prompt": "x", "max_tokens": "9"}, {}, 400,
     "max_tokens"),
    ("max_tokens zero", "POST", C, {"model": M, "prompt": "x", "max_tokens": 0}, {}, 400,
     "max_tokens"),
    ("stream not bool", "POST", C, {"model": M, "prompt": "x", "stream": "yes"}, {}, 400,
     "stream"),
    ("stream_options alone", "POST", C,
     {"model": M, "prompt": "x", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options"),
    ("n=2", "POST", C, {"model": M, "prompt": "x", "n": 2}, {}, 400, "n"),
    ("temperature 5", "POST", C, {"model": M, "prompt": "x", "temperature": 5}, {}, 400,
     "temperature"),
    ("top_p 0", "POST", C, {"model": M, "prompt": "x", "top_p": 0}, {}, 400, "top_p"),
    ("stop an int", "POST", C, {"model": M, "prompt": "x", "stop": 5}, {}, 400, "stop"),
    ("messages missing", "POST", CH, {"model": M}, {}, 400, "messages"),
    ("messages empty", "POST", CH, {"model": M, "messages": []}, {}, 400, "messages"),
    ("message not an object", "POST", CH, {"model": M, "messages": ["hi"]}, {}, 400,
     "messages[0]"),
    ("bad role", "POST", CH, {"model": M, "messages": [{"role": 7, "content": "x"}]}, {},
     400, "messages[0].role"),
    ("unknown part", "POST", CH, {"model": M, "messages": [{"role": "user", "content": [
        {"type": "hologram", "hologram": {}}]}]}, {}, 400, "messages[0].content[0].type"),
    ("missing content", "POST", CH, {"model": M, "messages": [{"role": "user"}]}, {}, 400,
     "messages[0].content"),
    ("priority header 9", "POST", C, {"model": M, "prompt": "x"}, {"X-Kvgate-Priority": "9"},
     400, "X-Kvgate-Priority"),
    ("body priority 7", "POST", C, {"model": M, "prompt": "x", "priority": 7}, {}, 400,
     "priority"),
    ("body priority a string", "POST", C, {"model": M, "prompt": "x", "priority": "high"}, {},
     400, "priority"),
    ("prompt over max_model_len", "POST", C, {"model": M, "prompt": "w" * 24000}, {}, 400,
     None),
    ("unknown model", "POST", C, {"model": "gpt-99", "prompt": "x"}, {}, 404, "model"),
    ("unknown route", "POST", "/v1/nope", {"model": M}, {}, 404, None),
    ("wrong method", "GET", C, None, {}, 405, None),
    ("body too large", "POST", C, {"model": M, "prompt": "x" * 70_000}, {}, 413, None),
    # what a web page can make a browser post cross-site without a preflight
    ("a text/plain body", "POST", C, {"model": M, "prompt": "x"},
     {"Content-Type": "text/plain; charset=utf-8"}, 415, None),
    ("a form", "POST", CH, b'{"model":"stub-model","messages":[],"x":"="}',
     {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("a multipart form", "POST", C, b"--b\r\n\r\n",
     {"Content-Type": "multipart/form-data; boundary=b"}, 415, None),
]


def test_malformed_requests_get_the_right_4xx_and_the_gateway_stays_healthy(kit: Any) -> None:
    assert len(MALFORMED) >= 20

    async def body() -> None:
        async with kit.cluster(1, server={"client_max_size": 64 * 1024}) as c:
            for name, method, path, payload, headers, status, param in MALFORMED:
                data = payload if isinstance(payload, bytes | None) else (
                    json.dumps(payload).encode())  # (a str would go as text/plain)
                async with c.session.request(method, c.url + path, data=data,
                                             headers=headers) as r:
                    raw = await r.read()
                    assert r.status == status, (name, r.status, raw[:300])
                    assert r.content_type == "application/json", name
                err = json.loads(raw)["error"]
                assert set(err) == {"message", "type", "param", "code"}, name
                assert err["message"] and err["type"], name
                if param is not None:
                    assert err["param"] == param, (name, err)
            assert c.stubs[0].attempts == 0  # nothing malformed reached a node
            status, _, _ = await c.get("/health")
            assert status == 200
            status, _, _ = await c.post(C, {"model": M, "prompt": "fine"})
            assert status == 200
            ctl = c.gw.controller
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0
            assert ctl.stats.rejects["invalid_request"] == 1  # the over-long prompt
            responses = c.gw.gateway.metrics.responses
            assert not any(code >= 500 for (_, code) in responses)

    kit.run(body())


def test_a_media_part_reaches_the_node_as_sent(kit: Any) -> None:
    """An image is a vision model's to read: the gateway routes on the text around it
    and passes the body on (it refused every image with a 400)."""

    async def body() -> None:
        async with kit.cluster(1) as c:
            req = {"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
            status, _, raw = await c.post(CH, req)
            assert status == 200, raw[:300]
            assert c.stubs[0].attempts == 1
            assert c.stubs[0].seen[0].body["messages"] == req["messages"]

    kit.run(body())


AUTH = {"keys": {
    "sk-gold": {"tenant": "gold", "max_priority": 0},
    "sk-std": {"tenant": "std", "max_priority": 1},
    "sk-ops": {"tenant": "ops", "max_priority": 0, "bypass": True},
}}


def test_auth_required_when_keys_are_configured(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, auth=AUTH) as c:
            req = {"model": M, "prompt": "x"}
            for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "sk-gold"},
                            {"Authorization": "Basic sk-gold"}):
                status, h, raw = await c.post(C, req, headers)
                assert status == 401, headers
                assert json.loads(raw)["error"]["type"] == "invalid_request_error"
                assert h["WWW-Authenticate"] == "Bearer"
            status, _, _ = await c.get("/v1/models")
            assert status == 401
            status, _, _ = await c.post(C, req, {"Authorization": "Bearer sk-std"})
            assert status == 200
            status, _, _ = await c.get("/health")  # probes need no key
            assert status == 200
            assert c.stubs[0].attempts == 1
            assert "Authorization" not in c.stubs[0].seen[0].headers  # the key stays here

    kit.run(body())


def test_a_bad_key_is_refused_before_its_body_is_read(kit: Any) -> None:
    """No key, no body buffered: a 401 at once, not a wait of up to body_timeout_s while
    up to client_max_size bytes are taken in for a caller who may send nothing."""

    async def body() -> None:
        async with kit.cluster(1, auth=AUTH, server={"body_timeout_s": 10.0}) as c:
            host, port = c.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer sk-nope\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
                assert head.startswith(b"HTTP/1.1 401"), head[:40]
            finally:
                writer.close()
                await writer.wait_closed()

    kit.run(body())


def test_priority_capped_by_the_key_and_bypass_lane(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, auth=AUTH) as c:
            cases = [  # (key, header, body priority, expected class)
                ("sk-std", "0", None, 1), ("sk-std", None, 0, 1), ("sk-std", "2", None, 2),
                ("sk-std", None, None, 1), ("sk-gold", "0", None, 0), ("sk-gold", None, 2, 2),
                ("sk-gold", "1", 0, 1),  # the header wins over the body
            ]
            for key, header, prio, expected in cases:
                headers = {"Authorization": f"Bearer {key}"}
                if header is not None:
                    headers["X-Kvgate-Priority"] = header
                req: dict[str, Any] = {"model": M, "prompt": "x"}
                if prio is not None:
                    req["priority"] = prio
                status, _, _ = await c.post(C, req, headers)
                assert status == 200
                assert c.stubs[0].seen[-1].body["priority"] == expected, (key, header, prio)
            adm = c.gw.controller.admission.stats()
            assert adm.bypass_admitted == 0
            await c.post(C, {"model": M, "prompt": "x"}, {"Authorization": "Bearer sk-ops"})
            assert c.gw.controller.admission.stats().bypass_admitted == 1

    kit.run(body())


def test_tenant_quota_429_with_retry_after_and_no_retry(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": "slow"}, auth=AUTH,
                               admission={"tenant_quotas": {"std": 1}}) as c:
            headers = {"Authorization": "Bearer sk-std"}
            async with aiohttp.ClientSession() as s:
                first = await s.post(c.url + C, json={"model": M, "prompt": "x",
                                                      "stream": True}, headers=headers)
                await first.content.readany()
                status, h, raw = await c.post(C, {"model": M, "prompt": "y"}, headers)
                first.close()
            assert status == 429
            assert h["Retry-After"] == "1" and h["x-should-retry"] == "false"
            err = json.loads(raw)["error"]
            assert err["code"] == "tenant_quota"
            assert c.stubs[0].attempts == 1

    kit.run(body())


def test_no_healthy_node_503_with_retry_after_and_not_ready(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(2) as c:
            status, _, _ = await c.get("/ready")
            assert status == 200
            for s in c.stubs:
                s.healthy = False
            await kit.eventually(lambda: c.gw.gateway.watcher.healthy_count() == 0)
            status, h, raw = await c.post(C, {"model": M, "prompt": "x"})
            assert status == 503
            assert int(h["Retry-After"]) >= 1
            assert "x-should-retry" not in h  # transient: the client may come back
            assert json.loads(raw)["error"]["type"] == "server_error"
            status, h, raw = await c.get("/ready")
            assert status == 503 and json.loads(raw)["healthy_nodes"] == 0
            status, _, _ = await c.get("/health")
            assert status == 200
            for s in c.stubs:
                s.healthy = True
            await kit.eventually(lambda: c.gw.gateway.watcher.healthy_count() == 2)
            await asyncio.sleep(0)
            status, _, _ = await c.get("/ready")
            assert status == 200

    kit.run(body())


def test_slow_request_body_gets_408_and_nothing_hangs(kit: Any) -> None:
    async def body() -> None:
        async with kit.cluster(1, server={"body_timeout_s": 0.2}) as c:
            data, _ = await raw_exchange(
                c.url,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
                timeout=3,
            )
            assert data.startswith(b"HTTP/1.1 408"), data[:60]
            status, _, _ = await c.get("/health")
            assert status == 200

    kit.run(body())


@pytest.mark.parametrize("mode", ["html", "400-html-json"])
def test_a_nodes_answer_is_never_served_as_a_page(kit: Any, mode: str) -> None:
    """The node's own Content-Type was passed on: a hostile node's text/html answer (or
    a JSON error labelled text/html) became a page of the gateway's origin."""
    async def body() -> None:
        async with kit.cluster(1, stub={"mode": mode}) as c:
            status, headers, _ = await c.post(C, {"model": M, "prompt": "x"})
            assert status == (200 if mode == "html" else 400)
            assert headers["Content-Type"].startswith("application/json")
            assert headers["X-Content-Type-Options"] == "nosniff"

    kit.run(body())
