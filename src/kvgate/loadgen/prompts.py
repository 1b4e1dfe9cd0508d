"""Real prompt text for simulator workloads, shared exactly where block ids match.

A workload request is a chain of block ids (Mooncake ``hash_ids``; the synthetic
generators use the same model). Each id maps deterministically to a *chunk* of exactly
``block_tokens * chars_per_token`` characters: a 14-letter *tag*, then short English
words drawn by a ``random.Random`` seeded from ``blake2b(seed, block id)`` (stable
across processes and Python versions, unlike ``hash()``), joined by spaces, cut to
length, ending in a space. A prompt is the concatenation of its blocks' chunks cut to
``prompt_tokens * chars_per_token`` characters. Ids chain (id *i* fixes the whole
prefix up to block *i*), so two requests with equal leading ids get byte-identical
leading text and a different id gives different text from that block on.

The tag is the id (modulo 2**64) through a seed-keyed bijection, written in base 26:
distinct ids get distinct chunks *by construction*, not by chance. Words alone could
not promise it: short chunks are one or two words, and ids 0 to 99 999 gave only
27 055 distinct chunks at 8 characters, 88 894 at 12 and 99 817 at 16 (so distinct
blocks shared text and the server saw sharing the workload does not have). A chunk must hold the tag
and its space, so blocks shorter than :data:`MIN_BLOCK_CHARS` characters are refused
(ValueError; ``kvgate bench`` exits 2).

The words are short and common (3.7 letters on average; one word plus its space is
usually one BPE token), so with the default 4 characters per token a prompt likely
has somewhat fewer real tokens than ``prompt_tokens``; the tag, a made-up word, is
likely several tokens, which matters only for small blocks (not measured here: no
tokenizer files); the report uses the server's ``usage.prompt_tokens`` when it is
given.
``seed`` is mixed into every chunk: the same seed replays the same text (a second run
starts with a warm prefix cache); change it to start cold.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypedDict

from kvgate.sim.synthetic import (
    agent_loops,
    multi_turn_chat,
    shared_prefix_groups,
    zipf_prefixes,
)
from kvgate.sim.workload import BucketMode, SimRequest, Workload, load_mooncake_trace

SYNTHETIC_WORKLOADS = ("gsp", "chat", "agent", "zipf")

# Short, common words (3.7 letters on average): with the separating space, about one
# BPE token per 4-5 characters.
_WORD_TEXT = """
the of and to in is it you that he was for on are as with his they at be this
from have or by one had not but what all were when we there can an your which their
said if do will each about how up out them then she many some so these would other
into has more her two like him see time could no make than first been its who now
my made over did down only way find use may long very after just where most know
get back much go good new our me man too any day same look also came come work
must does part even well such here take why help put away again off went old
tell men say small every still name home big give air line set own read last
never us left end along next sound saw both few those show large often house
world want keep food feet land side boy once life took four head kind live page
got need far hand high year light let night eyes soon story since white days ever
hard near best sure knew try red run cat dog sun sea tree book city road car fish
bird door open close fast slow blue green cold warm rain snow wind star moon
"""
_WORDS = tuple(_WORD_TEXT.split())


_TAG_LETTERS = 14
"""Letters of a chunk's tag: 26**14 > 2**64, so every 64-bit value has its own tag."""

MIN_BLOCK_CHARS = _TAG_LETTERS + 1
"""Fewest characters per block (``block_tokens * chars_per_token``): the tag and the
space that ends every chunk."""

_MASK64 = (1 << 64) - 1


def _chunk_seed(seed: int, block_id: int) -> int:
    digest = hashlib.blake2b(f"kvgate-loadgen:{seed}:{block_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit values (each step is invertible)
    that scatters neighbours, so ids 0, 1, 2 do not get tags with a common start."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_tag(block_id: int, seed: int = 0) -> str:
    """14 lowercase letters, one-to-one with ``block_id % 2**64`` for a given seed:
    adding a seed-derived key and :func:`_mix64` are bijections and 26**14 > 2**64."""
    key = hashlib.blake2b(f"kvgate-loadgen-tag:{seed}".encode(), digest_size=8).digest()
    x = _mix64((block_id + int.from_bytes(key, "little")) & _MASK64)
    letters: list[str] = []
    for _ in range(_TAG_LETTERS):
        x, digit = divmod(x, 26)
        letters.append(chr(ord("a") + digit))
    return "".join(letters)


def check_block_chars(block_tokens: int, chars_per_token: int) -> None:
    """ValueError when a block's chunk is too short to hold its tag (see the module
    docstring): without it, distinct ids could share text."""
    if block_tokens < 1 or chars_per_token < 1:
        raise ValueError("block_tokens and chars_per_token must be >= 1")
    chars = block_tokens * chars_per_token
    if chars < MIN_BLOCK_CHARS:
        raise ValueError(
            f"blocks of {block_tokens} tokens x {chars_per_token} characters = {chars} "
            f"characters are too short to give every block id its own text (at least "
            f"{MIN_BLOCK_CHARS} are needed)"
        )


@lru_cache(maxsize=16384)
def block_text(block_id: int, chars: int, seed: int = 0) -> str:
    """The chunk of exactly ``chars`` characters for ``block_id`` (ends in a space): its
    tag, then words. ValueError below :data:`MIN_BLOCK_CHARS`, where the tag would be
    cut and distinct ids could give the same chunk."""
    if chars < MIN_BLOCK_CHARS:
        raise ValueError(f"a chunk needs at least {MIN_BLOCK_CHARS} characters, got {chars}")
    rng = random.Random(_chunk_seed(seed, block_id))
    parts: list[str] = [block_tag(block_id, seed) + " "]
    size = len(parts[0])
    while size < chars:
        words = rng.choices(_WORDS, k=chars // 4 + 8)
        text = " ".join(words) + " "
        parts.append(text)
        size += len(text)
    return "".join(parts)[: chars - 1] + " "


def prompt_text(
    block_ids: Sequence[int],
    prompt_tokens: int,
    *,
    block_tokens: int,
    chars_per_token: int = 4,
    seed: int = 0,
) -> str:
    """The concatenated chunks of ``block_ids`` cut to ``prompt_tokens * chars_per_token``
    characters (shorter when the ids do not cover that many characters)."""
    check_block_chars(block_tokens, chars_per_token)
    want = max(0, prompt_tokens) * chars_per_token
    chunk = block_tokens * chars_per_token
    n_blocks = min(len(block_ids), -(-want // chunk))
    text = "".join(block_text(b, chunk, seed) for b in block_ids[:n_blocks])
    return text[:want]


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptSpec:
    """A request ready to send: text, token budget and its offset in the workload."""

    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    session: str | None = None


def make_spec(
    req: SimRequest,
    *,
    block_tokens: int,
    chars_per_token: int = 4,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    output_tokens_cap: int | None = None,
) -> PromptSpec:
    """Text and limits for one workload request. ``max_prompt_tokens`` caps the prompt
    (cutting its tail, so shared prefixes stay shared); ``max_tokens`` is the request's
    output length, at least 1, capped by ``output_tokens_cap``."""
    tokens = max(1, req.prompt_tokens)
    if max_prompt_tokens is not None:
        tokens = min(tokens, max_prompt_tokens)
    out = max(1, req.output_tokens)
    if output_tokens_cap is not None:
        out = min(out, output_tokens_cap)
    text = prompt_text(req.block_ids, tokens, block_tokens=block_tokens,
                       chars_per_token=chars_per_token, seed=seed)
    short = tokens * chars_per_token - len(text)
    if short > 0:
        # Ids that do not cover the prompt (none at all, or a trace read with another
        # --block-tokens than its own): private filler makes up the rest, so what is
        # sent is as long as the prompt_tokens reported (it was cut short: 48 tokens
        # sent for 1 536 counted); a chunk is never shorter than its tag, so a short
        # remainder is the head of a minimum-size one
        filler = block_text(hash_free_id(req.request_id), max(short, MIN_BLOCK_CHARS), seed)
        text += filler[:short]
    return PromptSpec(request_id=req.request_id, prompt=text, prompt_tokens=tokens,
                      max_tokens=out, arrival_s=req.arrival_s, session=req.session)


def hash_free_id(name: str) -> int:
    """A stable 63-bit id for a name (used for requests that carry no block ids)."""
    d = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1


class _Arrivals(TypedDict, total=False):
    arrivals: float


def synthetic_workload(
    kind: str,
    *,
    seed: int = 0,
    num_requests: int = 200,
    block_tokens: int = 512,
    arrival_rate: float | None = None,
    size: int | None = None,
    closed_loop: bool = False,
) -> Workload:
    """One of the simulator's generators with kvgate's defaults.

    ``size`` is the generator's main knob: groups (``gsp``, 16 prompts each), sessions
    (``chat``), tasks (``agent``) or documents (``zipf``); by default it is chosen so
    the workload has at least about ``num_requests`` requests. ``arrival_rate`` (per
    second; sessions or tasks started for chat/agent) matters only when the workload's
    own schedule is replayed. ``closed_loop`` (chat and agent) makes each later request
    of a session wait for the previous one's answer (see :mod:`kvgate.loadgen.runner`).
    """
    if closed_loop and kind not in ("chat", "agent"):
        raise ValueError(
            f"closed loop applies to the session workloads (chat, agent), not {kind!r}"
        )
    rng = random.Random(seed)
    kw: _Arrivals = {} if arrival_rate is None else {"arrivals": arrival_rate}
    if kind == "gsp":
        groups = size if size is not None else max(1, -(-num_requests // 16))
        return shared_prefix_groups(rng=rng, num_groups=groups, prompts_per_group=16,
                                    block_tokens=block_tokens, **kw)
    if kind in ("chat", "agent"):  # 5.5 turns per session, 12.5 steps per task on average
        per = 5 if kind == "chat" else 12
        n = size if size is not None else max(1, -(-num_requests // per))
        while True:
            rng = random.Random(seed)
            if kind == "chat":
                w = multi_turn_chat(rng=rng, num_sessions=n, block_tokens=block_tokens,
                                    closed_loop=closed_loop, **kw)
            else:
                w = agent_loops(rng=rng, num_tasks=n, block_tokens=block_tokens,
                                closed_loop=closed_loop, **kw)
            # by default, at least num_requests: sessions shorter than the average
            # (agent seed 6: 189 of 200) sent fewer than asked, unsaid
            if size is not None or len(w.requests) >= num_requests:
                return w
            n += max(1, -(-(num_requests - len(w.requests)) // per))
    if kind == "zipf":
        docs = size if size is not None else 300
        return zipf_prefixes(rng=rng, num_requests=num_requests, num_documents=docs,
                             block_tokens=block_tokens, **kw)
    raise ValueError(f"unknown workload {kind!r}; expected one of {SYNTHETIC_WORKLOADS}")


def trace_workload(
    path: str | Path,
    *,
    limit: int | None = None,
    block_tokens: int = 512,
    bucket_mode: BucketMode = "spread",
) -> Workload:
    """A Mooncake JSONL trace at its own timestamps (``speedup`` is applied by the
    runner). Requests sharing a bucketed timestamp are placed by ``bucket_mode`` as
    ``kvgate simulate --bucket`` places them: ``"spread"`` evenly over the gap to the
    next timestamp, ``"burst"`` all at it (see :mod:`kvgate.sim.workload_mooncake`).
    Lines whose id count disagrees with ``input_length`` are accepted."""
    return load_mooncake_trace(path, limit=limit, block_tokens=block_tokens, strict=False,
                               bucket_mode=bucket_mode)
