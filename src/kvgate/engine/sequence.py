"""Per-request mutable state of the simulated engine, and its waiting queue.

Theory of operation
-------------------
Token accounting follows vLLM v1: a request has `num_tokens = prompt +
generated` known tokens, of which `num_computed_tokens` are in KV. Each step
schedules `num_tokens - num_computed_tokens` tokens (or a budget-limited chunk
of them); when a step brings `num_computed_tokens` up to `num_tokens`, it
samples one new token. So prefill and decode are the same operation, and a
preempted request (blocks freed, `num_computed_tokens` reset to 0) recomputes
prompt + generated tokens as a prefill and then resumes sampling. The last
sampled token never enters KV, so a finished request held
ceil((prompt + max_tokens - 1) / block_size) blocks.

Block hashes: the caller supplies the hashes of the prompt's full blocks.
Blocks that fill with generated tokens (including the prompt's partial tail)
get `generated_block_hash(parent, request_id, index, key)`: stable across runs
and PYTHONHASHSEED (xxh3, never `hash()`), and distinct per request because
sampling makes two requests' outputs differ. The first such block also covers
`prompt_key(request)` (prompt length and token ids): it may hold the prompt's
tail, which the parent chain does not, and a request id can be reused.
Generated token ids (reported in events when the request carried prompt token
ids) come from `generated_token_id`, so a server can render the same tokens.
"""

from __future__ import annotations

import bisect
import enum
import sys
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from kvgate.core.hashing.sim_tokens import (
    SIM_VOCAB_SIZE,  # generated ids: the tokenizer's vocabulary
)
from kvgate.engine.api import EngineRequest, SchedulingPolicy
from kvgate.engine.block_pool import KVBlock

__all__ = [
    "SIM_VOCAB_SIZE",
    "ReqStatus",
    "SeqState",
    "WaitingQueue",
    "generated_block_hash",
    "generated_token_id",
    "prompt_key",
]



def generated_token_id(request_id: str, index: int) -> int:
    """Token id of output token `index` (0-based) of `request_id`; deterministic."""
    return xxhash.xxh3_64_intdigest(f"{request_id}\x00{index}".encode()) % SIM_VOCAB_SIZE


def generated_block_hash(
    parent: int | None, request_id: str, block_index: int, key: int = 0
) -> int:
    """Chained hash of a block that holds generated tokens (`key`: see `prompt_key`)."""
    root_flag = b"\x01" if parent is None else b"\x00"
    data = (
        (parent or 0).to_bytes(8, "little")
        + root_flag
        + block_index.to_bytes(8, "little")
        + key.to_bytes(8, "little")
        + request_id.encode()
    )
    return xxhash.xxh3_64_intdigest(data)


def prompt_key(request: EngineRequest) -> int:
    """Digest of the prompt's length and token ids, for its first generated block."""
    ids = array("Q", request.token_ids)
    if sys.byteorder == "big":
        ids.byteswap()  # the same digest on every host
    return xxhash.xxh3_64_intdigest(request.prompt_tokens.to_bytes(8, "little") + ids.tobytes())


class ReqStatus(enum.Enum):
    QUEUED = "queued"  # in the node's admission queue, not yet seen by the scheduler
    WAITING = "waiting"  # in the scheduler's waiting queue (new or preempted)
    RUNNING = "running"  # holds blocks, scheduled every step


@dataclass(slots=True, eq=False)
class SeqState:
    """Mutable state of one in-flight request; owned by the engine."""

    request: EngineRequest
    seq_no: int  # submission order: the final tie-break, keeps runs deterministic
    status: ReqStatus = ReqStatus.WAITING
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0  # prompt + generated; kept as a field: read on every step
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    cached_tokens: int = -1  # prefix hit at first scheduling; -1 = not scheduled yet
    num_preemptions: int = 0
    scheduled_at: float = -1.0  # the start of its first scheduled step; -1 = not yet

    def __post_init__(self) -> None:
        self.block_hashes = list(self.request.block_hashes)
        self.num_tokens = self.request.prompt_tokens + self.num_output_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_decoding(self) -> bool:
        """It has sampled a token and only that token is not in KV yet: its next step
        is a decode (one token), not a prefill chunk."""
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Order under the "priority" policy: (priority, arrival, submission)."""
        return (self.request.priority, self.request.arrival, self.seq_no)

    def block_hash(self, index: int) -> int:
        """Hash of block `index`; generated blocks get theirs on first use."""
        while len(self.block_hashes) <= index:
            i = len(self.block_hashes)
            parent = self.block_hashes[i - 1] if i else None
            # Only the first generated block can hold prompt tokens; later ones chain from it.
            key = prompt_key(self.request) if i == len(self.request.block_hashes) else 0
            self.block_hashes.append(generated_block_hash(parent, self.request_id, i, key))
        return self.block_hashes[index]

    def block_token_ids(self, index: int, block_size: int) -> tuple[int, ...]:
        """Token ids of a full block, or () when the request carried none."""
        prompt_ids = self.request.token_ids
        if not prompt_ids:
            return ()
        start, stop = index * block_size, (index + 1) * block_size
        prompt_len = len(prompt_ids)
        ids = list(prompt_ids[start:stop])
        for pos in range(max(start, prompt_len), stop):
            ids.append(generated_token_id(self.request_id, pos - prompt_len))
        return tuple(ids)


class WaitingQueue:
    """The scheduler's waiting queue: FIFO under "fcfs", sorted under "priority".

    A preempted request goes back to the head under "fcfs" (vLLM
    `prepend_request`) and to its (priority, arrival) place under "priority".
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._fifo: deque[SeqState] = deque()
        self._sorted: list[SeqState] = []

    def __len__(self) -> int:
        return len(self._fifo) + len(self._sorted)

    def __iter__(self) -> Iterator[SeqState]:
        return iter(self._fifo) if self._policy == "fcfs" else iter(self._sorted)

    def push(self, seq: SeqState) -> None:
        if self._policy == "fcfs":
            self._fifo.append(seq)
        else:
            bisect.insort(self._sorted, seq, key=lambda s: s.sort_key)

    def prepend(self, seq: SeqState) -> None:
        if self._policy == "fcfs":
            self._fifo.appendleft(seq)
        else:
            self.push(seq)

    def peek(self) -> SeqState | None:
        queue = self._fifo if self._policy == "fcfs" else self._sorted
        return queue[0] if queue else None

    def pop(self) -> SeqState:
        return self._fifo.popleft() if self._policy == "fcfs" else self._sorted.pop(0)

    def remove(self, seq: SeqState) -> None:
        if self._policy == "fcfs":
            self._fifo.remove(seq)
        else:
            self._sorted.remove(seq)

    def clear(self) -> list[SeqState]:
        items = list(self)
        self._fifo.clear()
        self._sorted.clear()
        return items

    def num_ahead_of(self, priority: int) -> int:
        """Waiting requests served before a newcomer of `priority`."""
        if self._policy == "fcfs":
            return len(self._fifo)
        return sum(1 for s in self._sorted if s.request.priority <= priority)
