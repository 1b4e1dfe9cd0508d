"""End to end against the stub server: schedules, bounds, metrics, errors, endpoints."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import math
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvgate.loadgen import client as client_mod
from kvgate.loadgen import runner as runner_mod
from kvgate.loadgen.prompts import PromptSpec
from kvgate.loadgen.report import LoadReport
from kvgate.loadgen.runner import LoadConfig, run_load, send_offsets
from kvgate.sim.workload import SimRequest, Workload

Serve = Callable[..., Any]


def _workload(n: int, *, shared_blocks: int = 2, gap_s: float = 0.0, out: int = 4) -> Workload:
    """n requests: ``shared_blocks`` common 16-token blocks, then a private one."""
    reqs = tuple(
        SimRequest(request_id=f"q{i}", arrival_s=i * gap_s,
                   prompt_tokens=16 * (shared_blocks + 1), output_tokens=out,
                   block_ids=(*range(shared_blocks), 1000 + i))
        for i in range(n))
    return Workload(name="unit", block_tokens=16, requests=reqs)


def _run(serve: Serve, stub_kw: dict[str, Any], **kw: Any) -> tuple[LoadReport, Any]:
    async def go() -> tuple[LoadReport, Any]:
        async with serve(**stub_kw) as stub:
            return await run_load(LoadConfig(base_url=stub.base_url, **kw)), stub
    return asyncio.run(go())


def test_poisson_rate_streams_and_measures(stub_server: Serve) -> None:
    rep, stub = _run(stub_server, dict(tokens=4, delay_s=0.01),
                     workload=_workload(30), rate=200.0, num_requests=12,
                     output_tokens_cap=3)
    assert (rep.sent, rep.completed, rep.failed) == (12, 12, 0)
    body = stub.received[0]
    assert body["model"] == "stub-model"  # discovered from GET /v1/models
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3 and len(body["prompt"]) == 48 * 4
    assert rep.total_output_tokens == 36 and rep.total_input_tokens == 12 * 48
    ttft, itl = rep.metrics["ttft"], rep.metrics["itl"]
    assert ttft.count == 12 and ttft.mean is not None and ttft.mean >= 9.0
    assert itl.count == 24 and itl.median is not None and 5.0 <= itl.median <= 200.0
    assert rep.metrics["tpot"].count == 12 and rep.metrics["e2el"].count == 12
    # two shared 16-token blocks = 128 characters = 32 cached tokens, after the first
    assert rep.total_cached_tokens >= 32 * 10 and rep.cache_hit_ratio is not None
    assert 0.5 < rep.cache_hit_ratio < 2 / 3 + 1e-9
    assert rep.settings["rate"] == 200.0 and rep.settings["model"] == "stub-model"
    starts = sorted(r.start_s for r in rep.results)
    assert starts[-1] > 0.0  # Poisson gaps, not a burst


def test_nothing_is_sent_past_the_time_bound_when_the_loop_runs_late(
    stub_server: Serve,
) -> None:
    """The stub serves in the same event loop: its first request blocks the loop for
    0.6 s, past the 0.3 s bound. When the loop runs again, the requests that came due
    meanwhile must not go out before the bound's timer cancels the run (they did)."""
    block = lambda i: time.sleep(0.6) if i == 0 else None  # noqa: E731
    rep, stub = _run(stub_server, dict(tokens=50, delay_s=0.05, fail=block),
                     workload=_workload(10, gap_s=0.1, out=50), schedule="trace",
                     num_requests=10, max_seconds=0.3)
    assert rep.sent == 1 and len(stub.received) == 1 and rep.incomplete == 1


def test_concurrency_caps_in_flight(stub_server: Serve) -> None:
    rep, stub = _run(stub_server, dict(tokens=3, delay_s=0.02),
                     workload=_workload(20), concurrency=3, num_requests=9)
    assert rep.completed == 9
    assert stub.max_in_flight == 3
    assert rep.peak_concurrency <= 3


def test_max_seconds_cancels_and_reports_incomplete(stub_server: Serve) -> None:
    rep, _ = _run(stub_server, dict(tokens=50, delay_s=0.05),
                  workload=_workload(10, gap_s=0.1, out=50), schedule="trace", num_requests=10,
                  max_seconds=0.4)
    assert rep.completed == 0 and rep.failed == 0
    assert 2 <= rep.incomplete <= 6 and rep.sent == rep.incomplete
    assert 0.35 <= rep.duration_s < 1.5
    # the requests the bound kept from being sent are in the table too
    assert f"{'Not sent (time bound):':<40}{10 - rep.sent}" in rep.format_table().splitlines()


def test_trace_schedule_and_speedup() -> None:
    wl = _workload(4, gap_s=1.0)
    cfg = LoadConfig(workload=wl, schedule="trace", speedup=10.0)
    assert send_offsets(cfg, wl.requests) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert send_offsets(LoadConfig(workload=wl), wl.requests) == [0.0] * 4
    gaps = send_offsets(LoadConfig(workload=wl, rate=5.0, seed=1), wl.requests)
    assert gaps == send_offsets(LoadConfig(workload=wl, rate=5.0, seed=1), wl.requests)
    assert gaps[0] == 0.0 and gaps == sorted(gaps) and gaps[-1] > 0


def test_trace_schedule_sends_on_time(stub_server: Serve) -> None:
    rep, _ = _run(stub_server, dict(tokens=2, delay_s=0.001),
                  workload=_workload(4, gap_s=1.0), schedule="trace", speedup=10.0)
    starts = [r.start_s for r in rep.results]
    assert starts == pytest.approx([0.0, 0.1, 0.2, 0.3], abs=0.06)


def _session(gaps_s: tuple[float, ...], *, think_s: float, out: int = 5) -> Workload:
    """One session: request i planned at gaps_s[i]; each later one waits for the one
    before it (closed loop) plus ``think_s``."""
    reqs = tuple(
        SimRequest(request_id=f"s{i}", arrival_s=at, prompt_tokens=32, output_tokens=out,
                   block_ids=(7, 100 + i), session="chat-0",
                   after=f"s{i - 1}" if i else None, think_s=think_s if i else 0.0)
        for i, at in enumerate(gaps_s))
    return Workload(name="unit", block_tokens=16, requests=reqs)


def test_closed_loop_waits_for_the_answer(stub_server: Serve) -> None:
    # planned 10 ms apart (open loop: all three in flight at once), but each answer takes
    # >= 5 x 40 ms; closed loop sends the next one 0.1 s (think 0.2 / speedup 2) after it
    rep, stub = _run(stub_server, dict(tokens=5, delay_s=0.04),
                     workload=_session((0.0, 0.01, 0.02), think_s=0.2),
                     schedule="trace", speedup=2.0)
    assert rep.completed == 3 and stub.max_in_flight == 1
    by_id = {r.request_id: r for r in rep.results}
    for prev, nxt in (("s0", "s1"), ("s1", "s2")):
        gap = by_id[nxt].start_s - by_id[prev].end_s
        assert 0.09 <= gap <= 0.25, gap
    assert rep.settings["closed_loop"] is True
    assert "closed loop" in rep.format_table()


def test_closed_loop_follows_failures_and_stops_at_the_bound(stub_server: Serve) -> None:
    # a refused predecessor still releases its follower
    rep, _ = _run(stub_server, dict(tokens=2, delay_s=0.01, fail=lambda i: 503 if i == 0 else None),
                  workload=_session((0.0, 0.01), think_s=0.0), schedule="trace")
    assert (rep.completed, rep.failed) == (1, 1)
    # long answers: at the bound the first is cancelled and its follower never sent
    rep, _ = _run(stub_server, dict(tokens=50, delay_s=0.02),
                  workload=_session((0.0, 0.01, 0.02), think_s=0.0, out=50),
                  schedule="trace", max_seconds=0.3)
    assert rep.sent == 1 and rep.incomplete == 1 and rep.duration_s < 1.5


def test_errors_are_counted_by_status(stub_server: Serve) -> None:
    def fail(i: int) -> int | None:
        return {1: 503, 3: 503, 4: 400}.get(i)

    rep, _ = _run(stub_server, dict(fail=fail, stream_error_at=5),
                  workload=_workload(8), concurrency=1, num_requests=8,
                  model="given", goodput_slos_ms={"ttft": 10_000})
    assert rep.completed == 4 and rep.failed == 4
    assert rep.failed_by_status == {"200": 1, "400": 1, "503": 2}
    assert rep.errors_by_type == {"http": 3, "stream_error": 1}
    assert rep.good_requests == 4 and rep.goodput_ratio == pytest.approx(0.5)
    bad = next(r for r in rep.results if r.status == 503)
    assert "HTTP 503" in bad.error_detail


def test_chat_endpoint_and_no_stream(stub_server: Serve) -> None:
    rep, stub = _run(stub_server, dict(tokens=3), workload=_workload(3), endpoint="chat",
                     num_requests=3)
    assert rep.completed == 3 and rep.total_output_tokens == 9
    assert stub.received[0]["messages"][0]["role"] == "user"
    assert rep.metrics["ttft"].count == 3
    rep, stub = _run(stub_server, dict(tokens=3), workload=_workload(3), stream=False,
                     num_requests=3, api_key="k")
    assert rep.completed == 3 and "stream_options" not in stub.received[0]
    assert rep.metrics["ttft"].count == 0 and rep.metrics["e2el"].count == 3
    assert rep.total_output_tokens == 9


def test_a_special_token_with_empty_text_is_timed_as_vllms_bench_does(
        stub_server: Serve) -> None:
    """A chunk with choices is a token's arrival even when its text is empty (a special
    token): TTFT is measured, and the output tokens come from usage. It had no TTFT and
    so never met a TTFT SLO."""
    rep, _ = _run(stub_server, dict(tokens=1, empty_text=True), workload=_workload(3),
                  num_requests=3)
    assert rep.completed == 3 and rep.total_output_tokens == 3
    assert rep.metrics["ttft"].count == 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_e2el_ends_at_the_last_token_chunk_as_vllms_bench(
        stub_server: Serve, endpoint: str) -> None:
    """vLLM's bench ends E2EL at the last chunk with choices; a server that sends the
    usage chunk and [DONE] 0.3 s later made it 0.3 s longer (and TPOT with it)."""
    rep, _ = _run(stub_server, dict(tokens=3, delay_s=0.01, tail_delay_s=0.3),
                  workload=_workload(2, out=3), endpoint=endpoint, num_requests=2)
    assert rep.completed == 2 and rep.total_output_tokens == 6  # usage still read
    for r in rep.results:
        assert r.e2e_s is not None and r.ttft_s is not None
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s), abs=1e-9)
        assert r.e2e_s < 0.25 <= r.end_s - r.start_s  # the request itself ran on
    e2el = rep.metrics["e2el"]
    assert e2el.mean is not None and e2el.mean < 250.0


def test_e2el_without_streaming_is_the_whole_body(stub_server: Serve) -> None:
    """No stream: the body is the one data chunk; E2EL covers the server's 5 x 20 ms and
    ends with the request, before it."""
    rep, _ = _run(stub_server, dict(tokens=5, delay_s=0.02), workload=_workload(2, out=5),
                  stream=False, num_requests=2)
    assert rep.completed == 2
    for r in rep.results:
        assert r.e2e_s is not None and 0.09 <= r.e2e_s <= r.end_s - r.start_s


def test_a_timeout_counts_as_a_timeout_not_under_its_headers_status(
        stub_server: Serve) -> None:
    """Headers (200) came, the stream outlived --request-timeout: it was listed under
    status 200 like a server error; now status 0 (no complete answer), error timeout,
    and still in every total."""
    def fail(i: int) -> int | None:
        return 503 if i == 2 else None

    rep, _ = _run(stub_server, dict(tokens=40, delay_s=0.05, fail=fail),
                  workload=_workload(3, out=40), concurrency=1, num_requests=3,
                  model="m", request_timeout_s=0.4)
    assert (rep.sent, rep.completed, rep.failed, rep.incomplete) == (3, 0, 3, 0)
    assert rep.failed_by_status == {"0": 2, "503": 1}
    assert rep.errors_by_type == {"http": 1, "timeout": 2}
    assert sum(rep.failed_by_status.values()) == sum(rep.errors_by_type.values()) == 3
    timed_out = [r for r in rep.results if r.error == "timeout"]
    assert all(r.status == 0 for r in timed_out)
    assert timed_out[0].error_detail.startswith("timeout after HTTP 200 headers: ")
    assert all(0.35 <= r.end_s - r.start_s < 1.5 for r in timed_out)
    table = rep.format_table().splitlines()
    row = table.index(f"{'  status 0:':<40}2")
    assert table[row + 1].startswith("    first: timeout after HTTP 200 headers")
    assert not any(line.startswith("  status 200:") for line in table)


def test_without_usage_a_whole_answer_counts_its_estimated_tokens(stub_server: Serve) -> None:
    """No usage and no stream: the text's characters over chars_per_token (4), where it
    was 1 token whatever the length."""
    rep, _ = _run(stub_server, dict(tokens=12, usage=False), workload=_workload(2, out=12),
                  stream=False, num_requests=2)
    assert rep.completed == 2 and rep.total_output_tokens == 2 * 3


def test_connection_refused_is_a_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = LoadConfig(workload=_workload(2), base_url=f"http://127.0.0.1:{port}",
                     model="m", num_requests=2)
    rep = asyncio.run(run_load(cfg))
    assert rep.failed == 2 and rep.failed_by_status == {"0": 2}
    assert rep.errors_by_type == {"connection": 2}


def test_config_validation() -> None:
    wl = _workload(1)
    for bad in ({"rate": 0.0}, {"concurrency": 0}, {"endpoint": "x"}, {"schedule": "x"},
                {"max_seconds": 0.0}, {"goodput_slos_ms": {"itl": 1.0}},
                {"output_tokens_cap": 0}, {"burstiness": 0.0}, {"burstiness": -1.0},
                {"burstiness": math.inf}, {"burstiness": math.nan}):
        with pytest.raises(ValueError):
            LoadConfig(workload=wl, **bad)


def _sse(*objs: object, sep: bytes = b"\n") -> bytes:
    """``data:`` lines of ``objs`` (bytes as they are), each ended by a blank line."""
    out = b""
    for obj in objs:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        out += b"data: " + data + sep + sep
    return out


def _text(t: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t}]}


def _usage(n: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n}}


@pytest.mark.parametrize("script", [
    (_sse(_usage(4), b"[DONE]"),),  # usage only
    (_sse({"choices": []}, {"choices": []}, _usage(3), b"[DONE]"),),  # no choice ever
])
def test_a_stream_without_a_chunk_with_choices_fails_as_in_vllms_bench(
        stub_server: Serve, script: tuple[bytes, ...]) -> None:
    """vLLM's bench fails it ("Never received a valid chunk to calculate TTFT"); it was
    a success with the usage's tokens and no TTFT."""
    rep, _ = _run(stub_server, dict(script=script), workload=_workload(2), num_requests=2,
                  model="m")
    assert (rep.completed, rep.failed) == (0, 2)
    assert rep.failed_by_status == {"200": 2} and rep.errors_by_type == {"empty_output": 2}
    assert "no chunk with choices" in rep.results[0].error_detail


def test_a_reset_after_the_headers_is_status_0(stub_server: Serve) -> None:
    """A connection reset mid-stream is no complete answer, as a timeout after the
    headers: status 0, not the headers' 200 (which read as the server's answer)."""
    rep, _ = _run(stub_server, dict(script=(_sse(_text("a"), _text("b")),), reset=True),
                  workload=_workload(2), num_requests=2, model="m")
    assert rep.failed == 2 and rep.failed_by_status == {"0": 2}
    assert rep.errors_by_type == {"connection": 2}
    assert all("after HTTP 200 headers: " in r.error_detail for r in rep.results)


def test_without_usage_a_stream_counts_its_text_not_only_its_chunks(stub_server: Serve) -> None:
    """A server that bundles tokens in a chunk: two chunks of 12 characters are 6 tokens
    at 4 characters each, not 2 (one per chunk); short tokens still count one a chunk."""
    bundled = (_sse(_text("x" * 12), _text("y" * 12), b"[DONE]"),)
    rep, _ = _run(stub_server, dict(script=bundled), workload=_workload(2), num_requests=2,
                  model="m")
    assert rep.completed == 2 and rep.total_output_tokens == 2 * 6
    rep, _ = _run(stub_server, dict(tokens=5, usage=False), workload=_workload(2, out=5),
                  num_requests=2, model="m")
    assert rep.completed == 2 and rep.total_output_tokens == 2 * 5  # 1-char tokens


def test_json_nested_too_deep_is_a_bad_response(stub_server: Serve) -> None:
    """json.loads raises RecursionError on deep nesting: a malformed answer, under its
    status, not an 'internal' loadgen bug."""
    deep = b"[" * 100_000 + b"]" * 100_000
    rep, _ = _run(stub_server, dict(script=(_sse(_text("a"), deep),)), workload=_workload(2),
                  num_requests=2, model="m")
    assert rep.failed_by_status == {"200": 2} and rep.errors_by_type == {"bad_response": 2}
    assert rep.results[0].error_detail.startswith("RecursionError: ")


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_sse_lines_may_end_in_cr_lf_or_both(stub_server: Serve, sep: bytes) -> None:
    """The SSE spec's three line ends; a lone CR ran every event into one line (a
    JSONDecodeError). The CRLF script is cut between its CR and LF."""
    body = _sse(_text("a"), _text("b"), _usage(2), b"[DONE]", sep=sep)
    cut = body.index(b"\n") if sep == b"\r\n" else len(body) // 2
    rep, _ = _run(stub_server, dict(script=(body[:cut], body[cut:])), workload=_workload(2),
                  num_requests=2, model="m")
    assert rep.completed == 2 and rep.total_output_tokens == 4
    assert rep.metrics["ttft"].count == 2 and rep.metrics["itl"].count == 2


def test_poisson_gaps_are_rescaled_to_the_rate() -> None:
    """As vLLM's get_request: the sum of the random gaps drifted from the rate with the
    seed; now N requests span (N - 1) / rate for every seed (first at 0)."""
    wl = _workload(200)
    for seed in range(5):
        for burstiness in (0.3, 1.0, 3.0):
            cfg = LoadConfig(workload=wl, rate=20.0, seed=seed, burstiness=burstiness)
            offsets = send_offsets(cfg, wl.requests)
            assert offsets[0] == 0.0 and offsets == sorted(offsets)
            assert offsets[-1] == pytest.approx(199 / 20.0, rel=1e-12)


def test_burstiness_shapes_the_gaps_as_a_gamma() -> None:
    """Gamma gaps of shape B have a coefficient of variation 1/sqrt(B): 2 at 0.25,
    1 (Poisson) at 1, 0.5 at 4."""
    wl = _workload(4000)

    def cv(burstiness: float) -> float:
        offsets = send_offsets(LoadConfig(workload=wl, rate=10.0, burstiness=burstiness),
                               wl.requests)
        gaps = [b - a for a, b in itertools.pairwise(offsets)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)
    assert LoadConfig(workload=wl, burstiness=0.5).settings("m")["burstiness"] == 0.5


def _run_raw(raw_server: Serve, reply: bytes, then: str = "close",
             **kw: Any) -> tuple[LoadReport, Any]:
    """run_load against a :class:`Raw` server answering ``reply`` (model "m")."""
    async def go() -> tuple[LoadReport, Any]:
        async with raw_server(reply, then) as raw:
            return await run_load(LoadConfig(base_url=raw.base_url, model="m", **kw)), raw
    return asyncio.run(go())


_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


@pytest.mark.parametrize("end", ["chunked", "close"])
def test_a_stream_that_ends_before_done_is_truncated(
        stub_server: Serve, raw_server: Serve, end: str) -> None:
    """2 of 4 tokens, then the body ends cleanly (the chunked terminator, or the close
    of a body without length) without [DONE]: it was a success with 2 tokens; the
    gateway fails it, and so does the bench now, under status 0 (no complete answer)."""
    cut = _sse(_text("a"), _text("b"))
    if end == "chunked":
        rep, _ = _run(stub_server, dict(script=(cut,)), workload=_workload(2),
                      num_requests=2, model="m")
    else:
        rep, _ = _run_raw(raw_server, _SSE_HEAD + b"Connection: close\r\n\r\n" + cut,
                          workload=_workload(1), num_requests=1)
    assert rep.completed == 0 and rep.failed == rep.sent
    assert rep.failed_by_status == {"0": rep.sent}
    assert rep.errors_by_type == {"truncated": rep.sent}
    assert rep.results[0].error_detail == (
        "the body ended after HTTP 200 headers and 2 token chunks, before data: [DONE]")
    assert rep.total_output_tokens == 0  # failed: its tokens count nowhere


def test_a_done_without_its_newline_at_the_end_still_ends_the_stream(
        stub_server: Serve) -> None:
    rep, _ = _run(stub_server, dict(script=(_sse(_text("a"), _usage(1)) + b"data: [DONE]",)),
                  workload=_workload(2), num_requests=2, model="m")
    assert rep.completed == 2 and rep.failed == 0


def test_sent_requests_do_not_keep_their_prompts(
        stub_server: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sent request's PromptSpec (its whole prompt) stayed referenced until the
    run ended: memory grew with the requests sent, not with those in flight. With one
    in flight, at most one may be alive when a request is sent."""
    alive: list[int] = []
    real = runner_mod.send_request

    async def spy(session: Any, **kw: Any) -> Any:
        alive.append(sum(1 for o in gc.get_objects()
                         if isinstance(o, PromptSpec) and o.request_id.startswith("mem")))
        return await real(session, **kw)

    monkeypatch.setattr(runner_mod, "send_request", spy)
    reqs = tuple(SimRequest(request_id=f"mem{i}", arrival_s=0.0, prompt_tokens=64,
                            output_tokens=2, block_ids=(5000 + i,)) for i in range(6))
    rep, _ = _run(stub_server, dict(tokens=2), model="m", concurrency=1,
                  workload=Workload(name="unit", block_tokens=16, requests=reqs))
    assert rep.completed == 6 and len(alive) == 6
    assert max(alive) <= 1, alive


def test_the_connection_is_reused_after_done(
        stub_server: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub ends each body (the chunked terminator) 20 ms after [DONE]: reading
    stopped at [DONE], so aiohttp closed the connection and the next request opened a
    new one. The rest of the body is read now; one connection serves them all. (The
    drain's bound is raised so a loaded machine cannot make the test flaky.)"""
    monkeypatch.setattr(client_mod, "DRAIN_TIMEOUT_S", 10.0)
    script = (_sse(_text("a"), _text("b"), _usage(2), b"[DONE]"),)
    rep, stub = _run(stub_server, dict(script=script, delay_s=0.02), workload=_workload(4),
                     num_requests=4, concurrency=1, model="m")
    assert rep.completed == 4 and len(stub.received) == 4
    assert len(stub.peers) == 1, stub.peers


def test_a_body_that_goes_on_after_done_does_not_hold_the_request(
        raw_server: Serve) -> None:
    """After [DONE] the rest of the body is read only briefly: an answer whose chunked
    body never ends is complete at [DONE], not held until --request-timeout."""
    events = _sse(_text("a"), _usage(1), b"[DONE]")
    reply = (_SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
             + b"%x\r\n" % len(events) + events + b"\r\n")
    rep, _ = _run_raw(raw_server, reply, then="hang", workload=_workload(1),
                      num_requests=1, request_timeout_s=5.0)
    r = rep.results[0]
    assert r.success and r.end_s - r.start_s < 4.0


def test_a_line_without_an_end_fails_past_the_bound(raw_server: Serve) -> None:
    """A data line that never ends was buffered without limit (and searched again on
    every read) until --request-timeout; past MAX_LINE_BYTES it is a bad_response."""
    reply = (_SSE_HEAD + b"Connection: close\r\n\r\n" + _sse(_text("a"))
             + b"data: " + b"x" * (client_mod.MAX_LINE_BYTES + 65536))
    rep, _ = _run_raw(raw_server, reply, then="hang", workload=_workload(1),
                      num_requests=1, request_timeout_s=5.0)
    assert rep.errors_by_type == {"bad_response": 1} and rep.failed_by_status == {"200": 1}
    assert "an SSE line longer than" in rep.results[0].error_detail


def test_a_refusal_is_not_held_by_an_endless_body(raw_server: Serve) -> None:
    """A 503 whose body never ends: resp.text() waited for all of it, so the request
    ran to --request-timeout and its detail said only that the body was not read. The
    start of the body is its detail now."""
    reply = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
             b"Content-Length: 100000000\r\n\r\n" + b"overloaded " * 100)
    rep, _ = _run_raw(raw_server, reply, then="hang", workload=_workload(1),
                      num_requests=1, request_timeout_s=5.0)
    assert rep.failed_by_status == {"503": 1} and rep.errors_by_type == {"http": 1}
    detail = rep.results[0].error_detail
    assert detail.startswith("HTTP 503: overloaded overloaded ") and len(detail) <= 320


def test_a_whole_answer_without_choices_is_empty_output(raw_server: Serve) -> None:
    """Without streaming, a 200 with "choices": [] was a success (with its usage's 7
    tokens) where a stream without choices fails: both are empty_output now."""
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                "completion_tokens": 7}}).encode()
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n" % len(body) + body)
    rep, _ = _run_raw(raw_server, reply, then="keep", workload=_workload(2),
                      num_requests=2, stream=False)
    assert (rep.completed, rep.failed) == (0, 2)
    assert rep.failed_by_status == {"200": 2} and rep.errors_by_type == {"empty_output": 2}
    assert rep.results[0].error_detail == "the response carried no choices"


@pytest.mark.parametrize("url", ["127.0.0.1:9", "http://127.0.0.1:99999", "ftp://127.0.0.1:9",
                                 "http://:9", "http://127.0.0.1:0",
                                 "http://127.0.0.1:9/?x=1"])
def test_a_malformed_base_url_is_refused_before_the_run(url: str) -> None:
    with pytest.raises(ValueError, match=r"^base_url"):
        LoadConfig(workload=_workload(1), base_url=url)
