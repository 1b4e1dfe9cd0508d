"""`kvgate bench` argument parsing and a full run against the stub server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgate.loadgen.cli import add_bench_parser, config_from_args, main, run_bench


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    sub = parser.add_subparsers(dest="command")
    add_bench_parser(sub)
    return parser.parse_args(["bench", *argv])


def test_defaults() -> None:
    args = _parse()
    assert args.command == "bench"
    assert (args.workload, args.trace, args.rate, args.schedule, args.concurrency) == (
        None, None, None, "rate", None)
    assert (args.num_requests, args.max_seconds, args.base_url, args.endpoint) == (
        None, 120.0, "http://127.0.0.1:8000", "completions")
    assert args.stream and args.progress and not args.save_detailed and args.goodput == []
    cfg = config_from_args(args)
    assert math.isinf(cfg.rate) and cfg.workload.name == "gsp"
    assert cfg.num_requests == 200  # a synthetic workload's default size
    assert len(cfg.workload.requests) >= 200


def test_flags_reach_the_config() -> None:
    args = _parse("--workload", "zipf", "--rate", "2.5", "--concurrency", "8",
                  "--num-requests", "30", "--max-seconds", "10", "--no-stream",
                  "--endpoint", "chat", "--model", "m", "--api-key", "k",
                  "--goodput", "ttft:500", "tpot:50", "--max-prompt-tokens", "1000",
                  "--output-tokens-cap", "64", "--seed", "9", "--no-progress",
                  "--block-tokens", "256", "--chars-per-token", "3", "--ignore-eos")
    cfg = config_from_args(args)
    assert (cfg.rate, cfg.concurrency, cfg.num_requests, cfg.max_seconds) == (2.5, 8, 30, 10)
    assert (cfg.stream, cfg.endpoint, cfg.model, cfg.api_key, cfg.progress) == (
        False, "chat", "m", "k", False)
    assert dict(cfg.goodput_slos_ms) == {"ttft": 500.0, "tpot": 50.0}
    assert (cfg.max_prompt_tokens, cfg.output_tokens_cap, cfg.seed) == (1000, 64, 9)
    assert cfg.workload.block_tokens == 256 and cfg.chars_per_token == 3 and cfg.ignore_eos
    assert len(cfg.workload.requests) == 30
    assert math.isinf(config_from_args(_parse("--rate", "inf")).rate)
    assert cfg.burstiness == 1.0  # Poisson unless asked
    cfg = config_from_args(_parse("--rate", "4", "--burstiness", "0.5"))
    assert cfg.burstiness == 0.5 and cfg.settings("m")["burstiness"] == 0.5


def test_closed_loop_flag_links_sessions() -> None:
    open_cfg = config_from_args(_parse("--workload", "agent", "--num-requests", "40"))
    closed = config_from_args(_parse("--workload", "agent", "--num-requests", "40",
                                     "--closed-loop"))
    assert not any(r.after for r in open_cfg.workload.requests)
    assert not open_cfg.settings("m")["closed_loop"] and closed.settings("m")["closed_loop"]
    # the same prompts; every later step of a task waits for the step before it
    pairs = zip(open_cfg.workload.requests, closed.workload.requests, strict=True)
    assert all(o.block_ids == c.block_ids for o, c in pairs)
    by_id = {r.request_id: r for r in closed.workload.requests}
    followers = [r for r in closed.workload.requests if r.after is not None]
    assert followers and all(by_id[r.after].session == r.session for r in followers)


def _trace(path: Path, n: int) -> str:
    path.write_text("".join(
        json.dumps({"timestamp": i * 100, "input_length": 700, "output_length": 3,
                    "hash_ids": [0, 1, 100 + i]}) + "\n" for i in range(n)))
    return str(path)


def test_trace_sends_the_whole_limited_trace_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A README example (--trace ... --limit 500) once sent 200: --num-requests defaulted
    to 200 whatever the workload."""
    trace = _trace(tmp_path / "t.jsonl", 260)
    cfg = config_from_args(_parse("--trace", trace, "--schedule", "trace"))
    assert cfg.num_requests == 260 and cfg.settings("m")["num_requests"] == 260
    cfg = config_from_args(_parse("--trace", trace, "--limit", "230"))
    assert cfg.num_requests == 230 == cfg.settings("m")["workload_requests"]
    assert capsys.readouterr().err == ""
    # an explicit cut is the user's choice, said in one line
    cfg = config_from_args(_parse("--trace", trace, "--num-requests", "50"))
    assert cfg.num_requests == 50 == cfg.settings("m")["num_requests"]
    err = capsys.readouterr().err
    assert err == "kvgate bench: --num-requests 50 sends only the first 50 of the trace's " \
        "260 requests\n"
    config_from_args(_parse("--trace", trace, "--num-requests", "900"))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [
    ["--rate", "0"], ["--rate", "x"], ["--concurrency", "0"], ["--workload", "nope"],
    ["--workload", "gsp", "--trace", "f.jsonl"], ["--endpoint", "embeddings"],
    ["--temperature", "nan"], ["--temperature", "-1"], ["--temperature", "2.5"],
    ["--rate", "4", "--burstiness", "0"], ["--rate", "4", "--burstiness", "inf"],
    ["--rate", "4", "--burstiness", "nan"],
])
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(*argv)


@pytest.mark.parametrize("argv", [
    ["--schedule", "trace", "--rate", "3"], ["--save-detailed"], ["--goodput", "itl:5"],
    ["--trace", "/nonexistent/trace.jsonl"], ["--closed-loop"],
    ["--closed-loop", "--workload", "zipf"],
    # options of the other kind of source were ignored without a word
    ["--workload", "gsp", "--limit", "3"],
    # --burstiness shapes the gaps of a finite --rate only
    ["--burstiness", "2"], ["--rate", "inf", "--burstiness", "2"],
    ["--schedule", "trace", "--burstiness", "2"],
])
def test_usage_errors_return_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse(*argv)) == 2
    assert "kvgate bench:" in capsys.readouterr().err


@pytest.mark.parametrize(("block_tokens", "chars_per_token", "least"),
                         [("1", "4", 4), ("2", "4", 4), ("3", "4", 4), ("7", "2", 8)])
def test_blocks_too_short_for_distinct_text_exit_2(
        block_tokens: str, chars_per_token: str, least: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--block-tokens 1 or 2 gave distinct block ids the same text (a shared prefix the
    workload does not have); refused before any workload is built or request sent."""
    args = _parse("--block-tokens", block_tokens, "--chars-per-token", chars_per_token,
                  "--model", "m", "--base-url", "http://127.0.0.1:9")
    assert run_bench(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvgate bench: --block-tokens {block_tokens} x --chars-per-token "
                          f"{chars_per_token} = ") and err.count("\n") == 1
    assert f"use --block-tokens {least} or more" in err
    cfg = config_from_args(_parse("--block-tokens", str(least), "--chars-per-token",
                                  chars_per_token, "--num-requests", "5"))
    assert cfg.workload.block_tokens == least


def test_an_empty_trace_or_synthetic_options_on_a_trace_are_usage_errors(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty trace printed an all-zero table and exited 0; --workload-size on a trace
    was ignored."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run_bench(_parse("--trace", str(empty))) == 2
    assert "the trace holds no requests" in capsys.readouterr().err
    line = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
    one = tmp_path / "one.jsonl"
    one.write_text(line)
    assert run_bench(_parse("--trace", str(one), "--workload-size", "3")) == 2
    assert "--workload-size and --arrival-rate shape a synthetic" in capsys.readouterr().err
    # the report written over the trace it replayed
    assert run_bench(_parse("--trace", str(one), "--json", str(tmp_path / "." / "one.jsonl"))) == 2
    assert "is the same file as --trace" in capsys.readouterr().err
    assert one.read_text() == line


def test_full_run_writes_table_and_json(
    stub_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i * 100, "input_length": 700, "output_length": 3,
                    "hash_ids": [0, 1, 100 + i]}) + "\n" for i in range(6)))
    out = tmp_path / "r.json"

    async def go() -> int:
        async with stub_server(tokens=3) as stub:
            args = _parse("--trace", str(trace), "--schedule", "trace", "--speedup", "10",
                          "--base-url", stub.base_url + "/v1", "--json", str(out),
                          "--save-detailed", "--goodput", "ttft:5000")
            return await asyncio.to_thread(run_bench, args)

    assert asyncio.run(go()) == 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "6/6 done" in captured.err  # the progress bar
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["good_requests"] == 6
    assert data["settings"]["schedule"] == "trace" and len(data["ttfts"]) == 6
    assert data["cache_hit_ratio"] > 0.5  # 2 of 3 blocks shared
    # the report says where its workload came from, so the run can be repeated
    assert (data["settings"]["trace"], data["settings"]["limit"]) == (str(trace), None)


def test_main_all_failed_returns_1(stub_server: Callable[..., Any]) -> None:
    async def go() -> int:
        async with stub_server(fail=lambda i: 503) as stub:
            argv = ["--base-url", stub.base_url, "--num-requests", "3", "--no-progress",
                    "--model", "m"]
            return await asyncio.to_thread(main, argv)

    assert asyncio.run(go()) == 1


def _bench_against(stub_server: Callable[..., Any], stub_kw: dict[str, Any],
                   *argv: str) -> tuple[int, Any, float]:
    """run_bench against a stub: (exit code, the stub, seconds taken)."""
    async def go() -> tuple[int, Any, float]:
        async with stub_server(**stub_kw) as stub:
            args = _parse("--base-url", stub.base_url, "--num-requests", "2",
                          "--no-progress", *argv)
            t0 = asyncio.get_running_loop().time()
            code = await asyncio.to_thread(run_bench, args)
            return code, stub, asyncio.get_running_loop().time() - t0

    return asyncio.run(go())


def _one_setup_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgate bench: "), captured.err
    return lines[0]


def test_models_not_json_is_a_setup_error(
    stub_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A 200 text/html GET /v1/models (a login page) raised JSONDecodeError out of
    run_bench: a traceback instead of exit 2."""
    code, stub, _ = _bench_against(stub_server, {"models_mode": "html"})
    assert code == 2 and stub.models_calls == 1 and stub.received == []
    line = _one_setup_error(capsys)
    assert "did not return JSON" in line and "text/html" in line and "--model" in line


def test_model_discovery_is_bounded_by_max_seconds(
    stub_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A hanging GET /v1/models waited --request-timeout (20 s here), not --max-seconds."""
    code, stub, took = _bench_against(stub_server, {"models_mode": "hang"},
                                      "--max-seconds", "0.5", "--request-timeout", "20")
    assert code == 2 and stub.received == []
    assert took < 5.0
    assert "GET /v1/models did not answer within 0.5 s" in _one_setup_error(capsys)


@pytest.mark.parametrize("where", ["missing_folder", "a_folder", "read_only_folder"])
def test_bad_json_path_fails_before_any_request(
    stub_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    """--json into a missing folder was found only after the whole run (a traceback)."""
    target = {"missing_folder": tmp_path / "nope" / "r.json", "a_folder": tmp_path,
              "read_only_folder": tmp_path / "r.json"}[where]
    if where == "read_only_folder":  # os.access, as root sees everything writable
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: (
            False if Path(p) == tmp_path and mode & os.W_OK else real_access(p, mode)))
    code, stub, _ = _bench_against(stub_server, {}, "--json", str(target))
    assert code == 2
    assert stub.models_calls == 0 and stub.received == []  # nothing sent
    assert "--json" in _one_setup_error(capsys)
    assert not (tmp_path / "r.json").exists()


@asynccontextmanager
async def _raw_http(reply: bytes) -> AsyncIterator[str]:
    """A server on 127.0.0.1 that answers every request with ``reply``, as bytes (for
    answers aiohttp's server will not write); yields its base URL."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


def test_a_garbled_models_answer_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """aiohttp's parser error (a ClientResponseError) has a message of several lines (a
    caret under the bad byte), printed as its repr: ``\\n`` escapes in the line. A setup
    error is one plain line on stderr."""
    garbled = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
               b"Bad\x01Header: x\r\nContent-Length: 2\r\n\r\n{}")

    async def go() -> int:
        async with _raw_http(garbled) as base_url:
            args = _parse("--base-url", base_url, "--num-requests", "2", "--no-progress")
            return await asyncio.to_thread(run_bench, args)

    assert asyncio.run(go()) == 2
    line = _one_setup_error(capsys)
    assert line.startswith("kvgate bench: ClientResponseError: 400, message=")
    assert "Bad\\x01Header" in line and "\\n" not in line  # the message, not its repr


def _bucketed_trace(path: Path) -> str:
    """Two timestamps 1 s apart, four requests each (a bucketed trace)."""
    path.write_text("".join(
        json.dumps({"timestamp": 1000 * (i // 4), "input_length": 700, "output_length": 3,
                    "hash_ids": [0, 1, 100 + i]}) + "\n" for i in range(8)))
    return str(path)


def test_bucket_places_the_requests_sharing_a_timestamp(tmp_path: Path) -> None:
    """--schedule trace spread a bucket's requests over the gap to the next timestamp,
    unsaid and with no way to replay them at once, as kvgate simulate --bucket burst
    does; the mode is an option now, and the report records it."""
    trace = _bucketed_trace(tmp_path / "b.jsonl")
    spread = config_from_args(_parse("--trace", trace, "--schedule", "trace"))
    assert [r.arrival_s for r in spread.workload.requests] == pytest.approx(
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    assert spread.settings("m")["bucket"] == "spread"
    burst = config_from_args(_parse("--trace", trace, "--schedule", "trace",
                                    "--bucket", "burst"))
    assert [r.arrival_s for r in burst.workload.requests] == [0.0] * 4 + [1.0] * 4
    assert burst.settings("m")["bucket"] == "burst"
    # the timestamps are not replayed under --schedule rate: nothing placed, nothing said
    assert config_from_args(_parse("--trace", trace)).settings("m")["bucket"] is None


@pytest.mark.parametrize("argv", [
    ["--bucket", "burst"],  # a synthetic workload has no shared timestamps
    ["--bucket", "burst", "--workload", "chat", "--schedule", "trace"],
    ["--bucket", "spread", "--trace", "TRACE"],  # --schedule rate ignores the timestamps
])
def test_bucket_without_a_replayed_trace_is_a_usage_error(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _bucketed_trace(tmp_path / "b.jsonl")
    assert run_bench(_parse(*[trace if a == "TRACE" else a for a in argv])) == 2
    assert "--bucket places the requests that share a trace timestamp" in \
        _one_setup_error(capsys)


def test_nothing_sent_before_the_time_bound_returns_1(stub_server: Callable[..., Any]) -> None:
    """The bound came before the first send: no request succeeded, yet it exited 0."""
    async def go() -> tuple[int, Any]:
        async with stub_server() as stub:
            argv = ["--base-url", stub.base_url, "--num-requests", "3", "--no-progress",
                    "--model", "m", "--max-seconds", "1e-9"]
            return await asyncio.to_thread(main, argv), stub

    code, stub = asyncio.run(go())
    assert stub.received == [] and code == 1


@pytest.mark.parametrize(("url", "says"), [
    ("127.0.0.1:9", "must start with http:// or https://"),
    ("ftp://127.0.0.1:9", "must start with http:// or https://"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:0", "port 0"),
    ("http://:9", "has no host"),
    ("http://127.0.0.1:9/?x=1", "must not have a query or fragment"),
])
def test_a_malformed_base_url_exits_2_before_any_request(
        url: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """With --model they became one 'connection' failure per request (exit 1); without
    it, a setup error. One line and exit 2 either way, before anything is sent."""
    for model in (["--model", "m"], []):
        assert run_bench(_parse("--base-url", url, "--num-requests", "2", "--no-progress",
                                *model)) == 2
        line = _one_setup_error(capsys)
        assert line.startswith("kvgate bench: --base-url") and says in line, line
