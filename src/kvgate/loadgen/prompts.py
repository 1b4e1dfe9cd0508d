"""Real prompt text for simulator workloads, shared exactly where block ids match.

A workload request is a chain of block ids (Mooncake ``hash_ids``; the synthetic
generators use the same model). Each id maps deterministically to a *chunk* of exactly
``block_tokens * chars_per_token`` characters: short English words drawn by a
``random.Random`` seeded from ``blake2b(seed, block id)`` (stable across processes and
Python versions, unlike ``hash()``), joined by spaces, cut to length, ending in a
space. A prompt is the concatenation of its blocks' chunks cut to
``prompt_tokens * chars_per_token`` characters. Ids chain (id *i* fixes the whole
prefix up to block *i*), so two requests with equal leading ids get byte-identical
leading text and a different id gives different text from that block on.

The words are short and common (3.7 letters on average; one word plus its space is
usually one BPE token), so with the default 4 characters per token a prompt likely
has somewhat fewer real tokens than ``prompt_tokens`` (not measured here: no tokenizer
files); the report uses the server's ``usage.prompt_tokens`` when it is given.
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
from kvgate.sim.workload import SimRequest, Workload, load_mooncake_trace

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


def _chunk_seed(seed: int, block_id: int) -> int:
    digest = hashlib.blake2b(f"kvgate-loadgen:{seed}:{block_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


@lru_cache(maxsize=16384)
def block_text(block_id: int, chars: int, seed: int = 0) -> str:
    """The chunk of exactly ``chars`` characters for ``block_id`` (ends in a space)."""
    if chars < 1:
        raise ValueError("chars must be >= 1")
    rng = random.Random(_chunk_seed(seed, block_id))
    parts: list[str] = []
    size = 0
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
    if block_tokens < 1 or chars_per_token < 1:
        raise ValueError("block_tokens and chars_per_token must be >= 1")
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
        # sent for 1 536 counted)
        text += block_text(hash_free_id(req.request_id), short, seed)
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
    if kind == "chat":  # 5.5 turns per session on average
        sessions = size if size is not None else max(1, -(-num_requests // 5))
        return multi_turn_chat(rng=rng, num_sessions=sessions, block_tokens=block_tokens,
                               closed_loop=closed_loop, **kw)
    if kind == "agent":  # 12.5 steps per task on average
        tasks = size if size is not None else max(1, -(-num_requests // 12))
        return agent_loops(rng=rng, num_tasks=tasks, block_tokens=block_tokens,
                           closed_loop=closed_loop, **kw)
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
) -> Workload:
    """A Mooncake JSONL trace at its own timestamps (``speedup`` is applied by the
    runner). Lines whose id count disagrees with ``input_length`` are accepted."""
    return load_mooncake_trace(path, limit=limit, block_tokens=block_tokens, strict=False)
