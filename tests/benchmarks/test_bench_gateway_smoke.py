"""Smoke test of the gateway benchmark's parts: the stub upstream and wrk's parsing.

The full benchmark (minutes of load) is not run here.
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchlib import BENCH_DIR, load_bench

bench = load_bench("bench_gateway")


@pytest.fixture(scope="module")
def stub_port() -> Iterator[int]:
    cmd = [sys.executable, str(BENCH_DIR / "stub_upstream.py"), "--port", "0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 10.0)
            assert ready, "the stub did not start within 10 s"
            line = proc.stdout.readline().decode()
            assert line.startswith("stub upstream listening on http://127.0.0.1:"), line
            yield int(line.rsplit(":", 1)[1])
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _post(conn: http.client.HTTPConnection, body: dict[str, object]
          ) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn.getresponse()


def test_stub_models_health_metrics_keep_alive(stub_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", stub_port, timeout=5)
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        models = json.loads(resp.read())
        assert resp.status == 200
        assert models["data"][0]["id"] == "stub-model"
        assert models["data"][0]["max_model_len"] > 0
        sock = conn.sock
        for path, status in (("/health", 200), ("/metrics", 200), ("/kvgate/evictions", 404)):
            conn.request("GET", path)
            resp = conn.getresponse()
            text = resp.read().decode()
            assert resp.status == status
            if path == "/metrics":
                assert "vllm:num_requests_running" in text
                assert "vllm:kv_cache_usage_perc" in text
        assert conn.sock is sock  # the same connection throughout: keep-alive
    finally:
        conn.close()


def test_stub_completion_unary(stub_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", stub_port, timeout=5)
    try:
        resp = _post(conn, {"model": "stub-model", "prompt": "hello " * 300, "max_tokens": 4})
        obj = json.loads(resp.read())
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "application/json"
        assert obj["object"] == "text_completion"
        assert obj["choices"][0]["text"]
        assert obj["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    finally:
        conn.close()


def _events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


def test_stub_completion_stream(stub_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", stub_port, timeout=5)
    try:
        base = {"model": "stub-model", "prompt": "hi", "stream": True}
        resp = _post(conn, base)
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        events = _events(resp.read())  # http.client undoes the chunked encoding
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) >= 2
        assert all(c["choices"] for c in chunks)  # no usage chunk unless asked for
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        resp = _post(conn, {**base, "stream_options": {"include_usage": True}})
        events = _events(resp.read())
        usage = json.loads(events[-2])
        assert usage["choices"] == []
        assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    finally:
        conn.close()


def _raw(port: int, request: bytes) -> bytes:
    """Everything the stub sends back on one connection for ``request``."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


@pytest.mark.parametrize("body", [
    b"zz\r\nab\r\n0\r\n\r\n",  # not hex
    b"-2\r\nab\r\n0\r\n\r\n",  # int(..., 16) takes a sign
    b"2\r\nabcd\r\n0\r\n\r\n",  # more data than the size said
])
def test_stub_answers_a_malformed_chunked_body_400(stub_port: int, body: bytes) -> None:
    """A malformed chunk size raised ValueError in data_received: a traceback in the
    stub's log and a connection dropped without an answer, instead of its 400."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: stub\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    got = _raw(stub_port, head + body)
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n"), got
    assert b"Connection: close" in got
    # a well-formed chunked body still gets its answer
    good = _raw(stub_port, head.replace(b"HTTP/1.1", b"HTTP/1.0")
                + b"2\r\n{}\r\n0\r\n\r\n")
    assert good.startswith(b"HTTP/1.1 200 OK\r\n"), good


WRK_TEXT = """Running 2s test @ http://127.0.0.1:8100/v1/completions
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   712.15us    1.28ms  18.90ms   90.80%
    Req/Sec    24.51k     9.89k   45.67k    80.00%
  Latency Distribution
     50%  192.00us
     75%    0.86ms
     90%    1.96ms
     99%    5.14s
  48731 requests in 2.00s, 17.52MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 5
Requests/sec:  24351.53
Transfer/sec:      8.76MB
"""


def test_parse_wrk_text() -> None:
    got = bench.parse_wrk(WRK_TEXT)
    assert got["p50_ms"] == pytest.approx(0.192)
    assert got["p75_ms"] == pytest.approx(0.86)
    assert got["p99_ms"] == pytest.approx(5140.0)
    assert got["requests"] == 48731
    assert got["rps"] == pytest.approx(24351.53)
    assert got["non2xx"] == 5
    assert got["socket_errors"] == 3


def test_goals_are_the_issues() -> None:
    assert bench.GOALS["added_p50_ms"] == ("<=", 1.0)
    assert bench.GOALS["cpu_ms_per_request"] == ("<=", 0.3)
    assert bench.GOALS["max_rps"] == (">=", 2000.0)


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_wrk_against_stub(stub_port: int, tmp_path: Path) -> None:
    for stream in (False, True):
        script = tmp_path / f"s{int(stream)}.lua"
        script.write_text(bench.lua_script(bench.make_body(stream=stream)))
        got = bench.run_wrk(stub_port, script, connections=2, duration=1, pin=[])
        assert got["requests"] > 0
        assert got["non2xx"] == 0 and got["socket_errors"] == 0
        assert 0 < got["p50_ms"] <= got["p99_ms"]


def _wrk_run(p50: float, *, rps: float = 500.0, requests: int = 5000,
             non2xx: int = 0, socket_errors: int = 0) -> dict[str, object]:
    return {"p50_ms": p50, "p75_ms": p50, "p90_ms": p50, "p99_ms": p50, "rps": rps,
            "requests": requests, "duration_s": 10.0, "non2xx": non2xx,
            "socket_errors": socket_errors, "wrk_cpu_s": 1.0}


def _summary(max_rps_run: dict[str, object], **via: dict[str, object]) -> dict[str, object]:
    runs = {"direct_unary": _wrk_run(1.0), "via_unary": _wrk_run(1.5),
            "direct_stream": _wrk_run(2.0), "via_stream": _wrk_run(2.5),
            "via_max_rps": {**max_rps_run, "proxy_cpu_s": 1.0, "stub_cpu_s": 0.5},
            "direct_max_rps": _wrk_run(1.0, rps=6000.0, requests=60000), **via}
    args = argparse.Namespace(latency_connections=1, rps_connections=64, prompt_chars=1500,
                              repeat=1)
    out: dict[str, object] = bench.summarize(
        args, runs, {}, duration=10, pin=bench.Pinning(), gw_cmd=["gw"], gw_rss=1.0,
        body_bytes=1)
    return out


def test_goals_met_on_a_clean_run() -> None:
    r = _summary(_wrk_run(3.0, rps=5000.0, requests=50000))
    assert r["max_rps"] == 5000.0 and r["max_rps_errors"] == 0
    assert r["cpu_ms_per_request"] == 0.02 and r["all_goals_ok"] is True


def test_errors_fail_the_goals(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A throughput run where every answer through the gateway was a 503 reported
    max_rps 5000, 0.02 ms CPU per request and all goals met (--strict exit 0)."""
    r = _summary(_wrk_run(3.0, rps=5000.0, requests=50000, non2xx=50000))
    assert r["max_rps"] == 0.0 and r["max_rps_errors"] == 50000
    assert r["cpu_ms_per_request"] == 1000.0  # 1 s of CPU, no request served
    goals: Any = r["goals"]
    assert not goals["max_rps"]["ok"] and goals["max_rps"]["errors"] == 50000
    assert not goals["cpu_ms_per_request"]["ok"]
    assert goals["added_p50_ms"]["ok"] and r["all_goals_ok"] is False
    # some answers failed: only the good ones count, and the goal is missed anyway
    r = _summary(_wrk_run(3.0, rps=5000.0, requests=50000, non2xx=10),
                 via_stream=_wrk_run(2.5, socket_errors=2))
    goals = r["goals"]
    assert r["max_rps"] == 4999.0 and not goals["max_rps"]["ok"]
    assert not goals["stream_added_p50_ms"]["ok"] and goals["stream_added_p50_ms"]["errors"] == 2
    assert goals["added_p99_ms"]["ok"] and not r["all_goals_ok"]
    bench.print_table(r)
    text = capsys.readouterr().out
    assert "NO (10 errors)" in text and "NO (2 errors)" in text
    assert "a goal measured on a run with errors is missed" in text
    assert text.rstrip().endswith("some goals missed")
    monkeypatch.setattr(bench, "run_benchmark", lambda args: r)
    assert bench.main(["--strict"]) == 1
    assert bench.main([]) == 0
