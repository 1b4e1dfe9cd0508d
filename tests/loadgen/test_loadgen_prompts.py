"""Prompt text from block ids: shared exactly where the ids match, stable, sized."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.loadgen.prompts import (
    MIN_BLOCK_CHARS,
    SYNTHETIC_WORKLOADS,
    block_tag,
    block_text,
    make_spec,
    prompt_text,
    synthetic_workload,
    trace_workload,
)
from kvgate.sim.workload import SimRequest

BT = 16  # tokens per block in these tests -> 64-character chunks


def _req(rid: str, ids: tuple[int, ...], tokens: int, out: int = 8) -> SimRequest:
    return SimRequest(request_id=rid, arrival_s=0.0, prompt_tokens=tokens,
                      output_tokens=out, block_ids=ids)


def test_chunk_is_exact_size_and_deterministic() -> None:
    a = block_text(7, 2048, 0)
    assert len(a) == 2048 and a.endswith(" ")
    assert block_text(7, 2048, 0) == a
    assert block_text(8, 2048, 0) != a
    assert block_text(7, 2048, 1) != a  # the seed changes the text


@pytest.mark.parametrize("chars", [MIN_BLOCK_CHARS, 16, 64])
def test_distinct_ids_give_distinct_chunks(chars: int) -> None:
    """Every id has its own chunk by construction (a tag one-to-one with the id), where
    words alone repeated: 183 of 100 000 ids at 16 characters, most at 8 or fewer."""
    ids = [*range(40_000), 2**63 - 1, 2**64 - 1, -1 + 2**62, 123456789012345678]
    chunks = {block_text(i, chars, 3) for i in ids}
    assert len(chunks) == len(ids)
    assert all(len(c) == chars and c.endswith(" ") for c in chunks)
    # the tag is a bijection of the 64-bit value: checked exhaustively on a window, and
    # the seed changes it
    assert len({block_tag(i) for i in range(2**64 - 5_000, 2**64)}) == 5_000
    assert block_tag(7, 0) != block_tag(7, 1)


@pytest.mark.parametrize("block_tokens", [1, 2, 3])
def test_blocks_too_short_for_distinct_text_are_refused(block_tokens: int) -> None:
    """4 to 12 characters per block (4 per token) cannot hold the tag: refused, not
    silently shared between ids (ids 0..99 999 gave 27 055 distinct 8-character chunks)."""
    with pytest.raises(ValueError, match="its own text"):
        prompt_text([1, 2], 2 * block_tokens, block_tokens=block_tokens)
    with pytest.raises(ValueError, match="at least"):
        block_text(1, block_tokens * 4)
    with pytest.raises(ValueError):
        make_spec(_req("r", (1, 2), 2 * block_tokens), block_tokens=block_tokens)
    # more characters per token make the same block size long enough
    assert len(prompt_text([1], block_tokens, block_tokens=block_tokens,
                           chars_per_token=MIN_BLOCK_CHARS)) == block_tokens * MIN_BLOCK_CHARS


def test_equal_leading_ids_give_byte_identical_leading_text() -> None:
    a = prompt_text([1, 2, 3, 4], 4 * BT, block_tokens=BT)
    b = prompt_text([1, 2, 9, 10], 4 * BT, block_tokens=BT)
    chunk = BT * 4
    assert len(a) == len(b) == 4 * chunk
    assert a[: 2 * chunk] == b[: 2 * chunk]
    assert a[2 * chunk: 3 * chunk] != b[2 * chunk: 3 * chunk]
    # different first ids: nothing shared beyond chance
    c = prompt_text([5, 2, 3, 4], 4 * BT, block_tokens=BT)
    assert a[:chunk] != c[:chunk]
    assert a[chunk:] == c[chunk:]  # same id -> same chunk (ids chain in real workloads)


def test_prompt_is_cut_to_prompt_tokens_times_chars() -> None:
    text = prompt_text([1, 2, 3], 2 * BT + 5, block_tokens=BT)
    assert len(text) == (2 * BT + 5) * 4
    assert text == prompt_text([1, 2, 3], 3 * BT, block_tokens=BT)[: len(text)]
    assert len(prompt_text([1, 2, 3], 3 * BT, block_tokens=BT, chars_per_token=3)) == 9 * BT
    # ids that cover fewer tokens than asked: the text stops with the ids
    assert len(prompt_text([1], 5 * BT, block_tokens=BT)) == BT * 4


def test_text_is_independent_of_hash_seed() -> None:
    code = ("from kvgate.loadgen.prompts import block_text;"
            "print(block_text(123456789, 300, 5))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # this process has another seed
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.rstrip("\n") == block_text(123456789, 300, 5)


def test_make_spec_caps_prompt_and_output() -> None:
    req = _req("r0", (1, 2, 3, 4), 4 * BT, out=500)
    spec = make_spec(req, block_tokens=BT, max_prompt_tokens=BT + 3, output_tokens_cap=32)
    assert spec.prompt_tokens == BT + 3 and len(spec.prompt) == (BT + 3) * 4
    assert spec.max_tokens == 32
    full = make_spec(req, block_tokens=BT)
    assert full.prompt.startswith(spec.prompt) and full.max_tokens == 500
    zero = make_spec(_req("z", (), 0, out=0), block_tokens=BT)
    assert zero.prompt and zero.max_tokens == 1


def test_ids_short_of_the_prompt_are_made_up_with_private_filler() -> None:
    """Two blocks of ids for a 100-token prompt (a trace read with another block size):
    the text is 100 tokens long, the ids' text first, then filler of the request's own
    (it was cut to the ids' 32 tokens while 100 were reported)."""
    a = make_spec(_req("a", (1, 2), 100), block_tokens=BT)
    b = make_spec(_req("b", (1, 2), 100), block_tokens=BT)
    ids_text = prompt_text((1, 2), 2 * BT, block_tokens=BT)
    assert len(a.prompt) == len(b.prompt) == 100 * 4 and a.prompt_tokens == 100
    assert a.prompt.startswith(ids_text) and b.prompt.startswith(ids_text)
    assert a.prompt[len(ids_text):] != b.prompt[len(ids_text):]


def test_trace_prompts_share_text_where_hash_ids_match(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 35, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 20, "input_length": 20, "output_length": 5, "hash_ids": [4, 5]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = trace_workload(path, block_tokens=BT)
    a, b, c = (make_spec(r, block_tokens=BT) for r in wl.requests)
    assert len(a.prompt) == 160 and len(b.prompt) == 140
    shared = 2 * BT * 4
    assert a.prompt[:shared] == b.prompt[:shared]
    assert a.prompt[shared:140] != b.prompt[shared:140]
    assert a.prompt[:64] != c.prompt[:64]
    assert len(trace_workload(path, limit=2, block_tokens=BT).requests) == 2


@pytest.mark.parametrize("kind", SYNTHETIC_WORKLOADS)
def test_synthetic_workloads_build_and_share(kind: str) -> None:
    wl = synthetic_workload(kind, seed=3, num_requests=40, block_tokens=64)
    assert len(wl.requests) >= 20
    specs = [make_spec(r, block_tokens=64, max_prompt_tokens=600) for r in wl.requests[:40]]
    firsts = {s.prompt[:256] for s in specs}
    assert len(firsts) < len(specs)  # some leading block is shared
    with pytest.raises(ValueError):
        synthetic_workload("nope")


@pytest.mark.parametrize(("kind", "seed", "n"), [("agent", 6, 200), ("chat", 39, 200),
                                                 ("chat", 0, 30)])
def test_a_synthetic_workload_holds_at_least_the_requests_asked(
    kind: str, seed: int, n: int
) -> None:
    """Sessions shorter than the average left fewer requests than --num-requests (agent
    seed 6: 189 of 200), and bench sent fewer than the README promises, unsaid."""
    assert len(synthetic_workload(kind, seed=seed, num_requests=n).requests) >= n
