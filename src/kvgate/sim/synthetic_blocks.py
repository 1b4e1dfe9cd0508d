"""A stable content model for synthetic prompts, and block ids derived from it.

A prompt is a list of :class:`Segment` (segment key, length in tokens): e.g. a system
prompt, then user and assistant turns. Block *i* covers tokens
``[i*B, (i+1)*B)`` and is described by the *pieces* of segments it covers
(key, start, end within the segment). Its id chains over every earlier block::

    h_i = xxh3_64(pack(h_{i-1}) + pack(pieces of block i))

So two prompts get equal ids at block *i* exactly when their token content up to the
end of block *i* is the same; a partial last block differs from the full block that a
longer prompt has at the same position. Finally ids are remapped to consecutive
integers in order of first appearance (requests by arrival, blocks in order), like the
Mooncake traces. All of it is deterministic and independent of ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvgate.sim.workload_types import SimRequest, Workload

_ROOT = 0x6B76_6761_7465_5349  # "kvgateSI": seed of block 0's chain
_PIECE = struct.Struct("<QQQ")
_PREV = struct.Struct("<Q")


def segment_key(*parts: str | int) -> int:
    """A stable 64-bit key for a segment named by ``parts`` (e.g. ``("chat", 3, "u", 2)``)."""
    return xxhash.xxh3_64_intdigest("\x1f".join(str(p) for p in parts).encode())


@dataclass(frozen=True, slots=True)
class Segment:
    """``tokens`` tokens of the content named by ``key`` (always read from its start)."""

    key: int
    tokens: int


def chained_block_hashes(segments: Sequence[Segment], block_tokens: int) -> list[int]:
    """One chained 64-bit hash per block of the prompt (``ceil(total / block_tokens)``)."""
    out: list[int] = []
    prev = _ROOT
    h = xxhash.xxh3_64()
    used = 0  # tokens placed in the current block
    for seg in segments:
        pos = 0
        while pos < seg.tokens:
            if used == 0:
                h.reset()
                h.update(_PREV.pack(prev))
            take = min(seg.tokens - pos, block_tokens - used)
            h.update(_PIECE.pack(seg.key, pos, pos + take))
            pos += take
            used += take
            if used == block_tokens:
                prev = h.intdigest()
                out.append(prev)
                used = 0
    if used:
        out.append(h.intdigest())
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Draft:
    """A request before block ids and a request id are assigned."""

    arrival_s: float
    segments: tuple[Segment, ...]
    output_tokens: int
    session: str | None = None
    # closed loop: the index (in the drafts list) of the draft whose answer this one
    # waits for, and the time after that answer it is sent
    after: int | None = None
    think_s: float = 0.0


def build_workload(name: str, block_tokens: int, drafts: Sequence[Draft]) -> Workload:
    """Sort drafts by arrival (stable), hash their blocks and remap ids to 0, 1, 2, ...

    Request ids are ``<name>-<k>``, *k* the position in arrival order.
    """
    order = sorted(range(len(drafts)), key=lambda k: drafts[k].arrival_s)
    rid = {k: f"{name}-{pos}" for pos, k in enumerate(order)}
    remap: dict[int, int] = {}
    reqs: list[SimRequest] = []
    for k in order:
        d = drafts[k]
        ids = tuple(
            remap.setdefault(h, len(remap)) for h in chained_block_hashes(d.segments, block_tokens)
        )
        reqs.append(
            SimRequest(
                request_id=rid[k],
                arrival_s=d.arrival_s,
                prompt_tokens=sum(s.tokens for s in d.segments),
                output_tokens=d.output_tokens,
                block_ids=ids,
                session=d.session,
                after=None if d.after is None else rid[d.after],
                think_s=d.think_s,
            )
        )
    return Workload(name=name, block_tokens=block_tokens, requests=tuple(reqs))
