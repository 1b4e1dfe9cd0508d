"""The deterministic tokenizer, fault flags and the `engine` sub-command."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from kvgate.core.hashing import TokenBlockHasher
from kvgate.engine.server import add_engine_parser, run_engine
from kvgate.engine.server_cli import config_from_args
from kvgate.engine.server_config import FaultSpec, WireFaults, parse_fault_flag
from kvgate.engine.server_tokens import (
    PromptTokenizer,
    SimTokenizer,
    generated_text,
    sim_token_hasher,
)
from kvgate.protocol import parse_chat_request, parse_completion_request


def test_one_token_per_four_characters_deterministic() -> None:
    tok = SimTokenizer()
    ids = tok.encode("abcdabcdxy")
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]
    assert all(0 <= i < 32_000 for i in ids)
    assert tok.encode("abcdabcdxy") == ids
    assert tok.encode("") == []
    assert len(tok.encode("\udcff surrogate é")) == 4  # any str is accepted


def test_prefix_blocks_are_shared_and_match_the_gateway_hasher() -> None:
    tokens = PromptTokenizer(16)
    base = "shared system prompt. " * 20  # 440 chars = 110 tokens = 6 full blocks
    a = tokens.for_prompt(base + "question one")
    b = tokens.for_prompt(base + "another question entirely")
    assert len(a.block_hashes) == a.num_tokens // 16
    assert a.block_hashes[:6] == b.block_hashes[:6]
    hasher = sim_token_hasher(16)
    assert isinstance(hasher, TokenBlockHasher)
    assert hasher.chain_for_prompt(base) == tokens.for_prompt(base).block_hashes
    msgs = [("system", "be brief"), ("user", "x" * 100)]
    assert hasher.chain_for_messages(msgs) == tokens.for_messages(msgs).block_hashes
    longer = tokens.for_messages([*msgs, ("assistant", "ok"), ("user", "more")])
    assert longer.token_ids[: len(tokens.for_messages(msgs).token_ids) - 1] == \
        tokens.for_messages(msgs).token_ids[:-1]


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": ""}',
        b'{"model": "m", "prompt": "abc"}',
        b'{"model": "m", "prompt": "abcd"}',
        b'{"model": "m", "prompt": "abcde"}',
        rb'{"model": "m", "prompt": "\u00e9\u00e9\u00e9\u00e9\u00e9 \ud83d\ude00\ud800"}',
        b'{"model": "m", "prompt": [1, 2, 3, 4, 5]}',
        b'{"model": "m", "messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "x y z"}]}',
    ],
)
def test_the_cheap_token_count_is_the_tokenized_count(body: bytes) -> None:
    """``count`` (what a too-long prompt is refused on, before tokenizing) is exact."""
    tokens = PromptTokenizer(16)
    parsed = (parse_chat_request(body) if b'"messages"' in body
              else parse_completion_request(body))
    source = tokens.source(parsed)
    assert tokens.count(source) == tokens.for_source(source).num_tokens
    if not isinstance(source, str):
        assert tokens.for_source(source) == tokens.for_completion(parse_completion_request(body))
    elif b'"messages"' in body:
        assert tokens.for_source(source) == tokens.for_messages(parse_chat_request(body).messages)


def test_generated_text_is_deterministic_words() -> None:
    words = generated_text("cmpl-x", 0, 5)
    assert words == generated_text("cmpl-x", 0, 5)
    assert generated_text("cmpl-x", 2, 3) == words[2:]
    assert all(w.startswith(" ") and w.strip() for w in words)


def test_fault_flags() -> None:
    assert parse_fault_flag("crash") == FaultSpec(action="crash", count=0)
    assert parse_fault_flag("slow:4").factor == 4.0
    assert parse_fault_flag("reject:off").on is False
    assert parse_fault_flag("mass_evict:0.25").fraction == 0.25
    assert parse_fault_flag("midstream_error:5").after == 5
    assert parse_fault_flag("slow_first_byte:0.5").seconds == 0.5
    for bad in ("explode", "crash:1", "slow:x", "slow:0", "midstream_error:1.5", "reject:maybe"):
        with pytest.raises(ValueError):
            parse_fault_flag(bad)


def test_wire_fault_counts() -> None:
    wire = WireFaults()
    wire.arm(FaultSpec(action="reset_connection", count=2))
    assert [wire.reset_connection.take() is not None for _ in range(3)] == [True, True, False]
    wire.arm(parse_fault_flag("slow_first_byte:0.5"))  # a flag lasts until recover
    assert all(wire.slow_first_byte.take() == 0.5 for _ in range(5))
    wire.heal()
    assert wire.slow_first_byte.take() is None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate")
    add_engine_parser(parser.add_subparsers(dest="command"))
    return parser


def test_parser_defaults_and_options() -> None:
    cfg = config_from_args(_parser().parse_args(["engine"]))
    assert (cfg.host, cfg.port, cfg.model, cfg.profile) == ("127.0.0.1", 8100, "kvgate-sim",
                                                            "a100-8b")
    assert (cfg.block_size, cfg.speedup, cfg.scheduling_policy) == (16, 1.0, "priority")
    assert cfg.kv_events_endpoint is None and cfg.kv_events_layout == "map"
    args = _parser().parse_args([
        "engine", "--port", "0", "--model", "m", "--profile", "h100-8b", "--num-blocks", "64",
        "--block-size", "32", "--max-model-len", "1024", "--speedup", "50", "--node-id", "n1",
        "--kv-events-endpoint", "tcp://*:5557", "--kv-events-layout", "array",
        "--fault", "slow:2", "--fault", "reject", "--scheduling-policy", "fcfs"])
    cfg = config_from_args(args)
    assert cfg.num_blocks == 64 and cfg.block_size == 32 and cfg.max_model_len == 1024
    assert cfg.speedup == 50.0 and cfg.node_id == "n1" and cfg.kv_events_layout == "array"
    assert [f.action for f in cfg.faults] == ["slow", "reject"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["engine", "--speedup", "0"])


def test_run_engine_rejects_an_inconsistent_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["engine", "--num-blocks", "4", "--max-model-len", "100"])
    assert run_engine(args) == 2
    assert "max_model_len" in capsys.readouterr().err
    # ZMQ took port 99999 modulo 65536 and published where nobody subscribes; an empty
    # host listened on every interface and printed http://:PORT
    for argv, message in ((["--kv-events-endpoint", "tcp://*:99999"], "the port must be in"),
                          (["--host", ""], "host must not be empty")):
        assert run_engine(_parser().parse_args(["engine", *argv])) == 2
        assert message in capsys.readouterr().err


def test_run_engine_serves_until_sigterm() -> None:
    code = (
        "import argparse, sys\n"
        "from kvgate.engine.server import add_engine_parser, run_engine\n"
        "p = argparse.ArgumentParser(); add_engine_parser(p.add_subparsers(dest='c'))\n"
        "sys.exit(run_engine(p.parse_args(['engine', '--port', '0', '--speedup', '100'])))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "error"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        url = line.split("serving on ")[1].split()[0].rstrip(",")
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
