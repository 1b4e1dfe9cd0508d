"""Decode runs: many decode-only steps computed at once, and cut short when needed.

Theory of operation
-------------------
Between two things that change a node (a request submitted, a finish, a block that
fills, an eviction batch, a fault) its steps are all alike: every running sequence
decodes one token, and the step time grows by ``k * n`` a step (each of the ``n``
contexts gains a token). A simulator that steps such a node once per event spends
most of its time there. :func:`plan_run` computes those steps at once: how many
there can be before anything but time changes the next one (a sequence would finish,
fill the block it writes, whose registration emits ``BlockStored``, or need a new
block) and when each starts, chaining the very floats ``step()`` would (each step
starts at the previous one's ``start + duration``).

The driver does not know yet whether something will reach the node meanwhile, so a
run is optimistic: :meth:`DecodeRun.cut` keeps only the steps that had started
before ``now`` (the first one always has) when a submit, an abort or a fault comes
in the middle. Pure: the engine applies and takes back the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.profiles import EngineProfile, step_time_of_sums
from kvgate.engine.sequence import SeqState

__all__ = ["DecodeRun", "plan_run"]


@dataclass(slots=True)
class DecodeRun:
    """``steps`` decode steps of the sequences ``seqs``: step ``i`` starts at
    ``starts[i]`` and lasts ``durations[i]``."""

    seqs: list[SeqState]
    starts: list[float]
    durations: list[float]

    @property
    def steps(self) -> int:
        return len(self.starts)

    def cut(self, now: float) -> int:
        """Keep the steps that have started by ``now`` (the first always has: it
        started when the run was planned); returns how many steps were taken back.

        A step starting exactly at ``now`` is kept: one step of it takes longer than
        the network delay, so whatever comes at ``now`` was sent after the step
        before it began, and one by one that step's start would have run first."""
        keep = 1
        starts = self.starts
        while keep < len(starts) and starts[keep] <= now:
            keep += 1
        dropped = len(starts) - keep
        if dropped:
            del self.starts[keep:]
            del self.durations[keep:]
        return dropped


def plan_run(
    running: Sequence[SeqState],
    *,
    now: float,
    profile: EngineProfile,
    block_size: int,
    slow_factor: float,
) -> DecodeRun | None:
    """The decode steps ``step()`` would run back to back from ``now`` if nothing came
    in: None unless every running sequence decodes and at least two steps fit."""
    n = len(running)
    if not n or n > profile.max_num_batched_tokens:
        return None
    steps = -1  # no bound yet
    ctx_total = 0
    for seq in running:
        if not seq.is_decoding:
            return None  # a prefill chunk is due
        computed = seq.num_computed_tokens
        ctx_total += computed + 1  # the context of its next token, itself included
        # steps that sample without finishing, without filling the block being written
        # and within the blocks held
        room = min(
            seq.request.max_tokens - seq.num_output_tokens - 1,
            (seq.num_cached_blocks + 1) * block_size - computed - 1,
            len(seq.blocks) * block_size - computed,
        )
        if steps < 0 or room < steps:
            steps = room
            if steps < 2:
                return None
    starts: list[float] = []
    durations: list[float] = []
    start = now
    for i in range(steps):
        if i:
            start = start + durations[-1]
        starts.append(start)
        durations.append(step_time_of_sums(profile, n, 0.0, ctx_total + n * i) * slow_factor)
    return DecodeRun(list(running), starts, durations)
