"""Continuous-batching scheduler with chunked prefill and preemption.

Theory of operation
-------------------
`schedule()` plans one iteration under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

1. every running sequence that is decoding gets its one token;
2. running sequences in the middle of a chunked prefill get the next chunk,
   in the order they started;
3. if nothing was preempted in 1-2, waiting sequences are admitted in queue
   order (FCFS, or (priority, arrival) under "priority") until the budget,
   the cap or the KV pool runs out. A newly admitted sequence first looks up
   its longest cached prefix (block-granular, at most num_tokens - 1 tokens
   so that at least one token is computed, as vLLM does); those blocks are
   referenced and their tokens skipped. Head-of-line: a waiting sequence that
   does not fit stops the pass (vLLM v1).

KV allocation returns None when it does not fit. A running sequence that
cannot grow preempts the newest running sequence (fcfs; vLLM v1 LIFO) or the
lowest-priority, newest one ("priority"), possibly itself; the victim's
blocks are freed (cached ones stay findable, so its recompute may hit) and it
returns to the waiting queue. Under "priority" a waiting sequence that does
not fit may also preempt running ones of strictly worse priority (worst,
newest first), but only when preempting all of them would make it fit: a
victim is never preempted for nothing. A victim already planned in this step
is taken out of the plan again.

Blocks are registered in the prefix cache (and `BlockStored` emitted) only by
`commit()`, after the plan is final: a victim's blocks were never computed,
so they must never be announced, and a lookup never hits a block that the
same forward pass is still computing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.api import SchedulingPolicy
from kvgate.engine.block_pool import BlockPool, KVBlock
from kvgate.engine.profiles import EngineProfile
from kvgate.engine.sequence import ReqStatus, SeqState, WaitingQueue

__all__ = ["Plan", "ScheduledChunk", "Scheduler"]


@dataclass(slots=True)
class ScheduledChunk:
    """Prompt (or recompute) tokens of one sequence computed in this step."""

    seq: SeqState
    num_new: int
    num_computed: int  # tokens already in KV before this chunk (h of the cost model)


@dataclass(slots=True)
class Plan:
    """One step's decision, in scheduling order: the decoding sequences (one token
    each; their context is ``num_computed_tokens`` until the step is applied), then
    the prefill chunks; and the victims. Decodes are a plain list because a step
    schedules every running decode: the simulator's hottest data."""

    decodes: list[SeqState] = field(default_factory=list)
    chunks: dict[SeqState, ScheduledChunk] = field(default_factory=dict)
    preempted: list[SeqState] = field(default_factory=list)
    num_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.seq] = chunk
        self.num_tokens += chunk.num_new

    def drop(self, seq: SeqState) -> None:
        chunk = self.chunks.pop(seq, None)
        if chunk is not None:
            self.num_tokens -= chunk.num_new
        elif seq in self.decodes:  # rare: a victim of preemption
            self.decodes.remove(seq)
            self.num_tokens -= 1


class Scheduler:
    """Owns the running list and the waiting queue; plans steps on a `BlockPool`."""

    def __init__(self, pool: BlockPool, profile: EngineProfile, policy: SchedulingPolicy) -> None:
        self.pool = pool
        self.profile = profile
        self.policy = policy
        self.running: list[SeqState] = []
        self.waiting = WaitingQueue(policy)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up (vLLM prefix_cache_queries)
        self.prefix_cache_hits = 0  # tokens found (vLLM prefix_cache_hits)

    # ------------------------------------------------------------- planning
    def schedule(self) -> Plan:
        plan = Plan()
        limit = self.profile.max_num_batched_tokens
        block_size = self.pool.block_size
        running_status = ReqStatus.RUNNING
        decoding: list[SeqState] = []
        prefilling: list[SeqState] = []
        for seq in self.running:
            (decoding if seq.is_decoding else prefilling).append(seq)
        # The loops below run once per running sequence per step: the simulator's
        # hottest code.
        decodes = plan.decodes
        for seq in decoding:
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            if plan.num_tokens >= limit:
                break
            if seq.num_tokens <= len(seq.blocks) * block_size or self._grow(seq, 1, plan):
                decodes.append(seq)
                plan.num_tokens += 1
        for seq in prefilling:
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            budget = limit - plan.num_tokens
            if budget <= 0:
                break
            num_computed = seq.num_computed_tokens
            num_new = min(seq.num_tokens - num_computed, budget)
            fits = num_computed + num_new <= len(seq.blocks) * block_size
            if fits or self._grow(seq, num_new, plan):
                plan.add(ScheduledChunk(seq, num_new, num_computed))
        if not plan.preempted:
            self._admit_waiting(plan, limit)
        return plan

    def _admit_waiting(self, plan: Plan, limit: int) -> None:
        block_size = self.pool.block_size
        while len(self.running) < self.profile.max_num_seqs and plan.num_tokens < limit:
            seq = self.waiting.peek()
            if seq is None or seq in plan.preempted:
                break  # a victim of this step waits for the next one (as in vLLM)
            max_hit_blocks = (seq.num_tokens - 1) // block_size
            hits = self.pool.find_prefix(seq.block_hashes, max_hit_blocks)
            num_computed = len(hits) * block_size
            num_new = min(seq.num_tokens - num_computed, limit - plan.num_tokens)
            need = _blocks_for(num_computed + num_new, block_size) - len(hits)
            if not self.pool.can_allocate(need, hits) and not self._make_room(
                seq, need, hits, plan
            ):
                break
            self.pool.touch(hits)
            new_blocks = self.pool.allocate(need)
            assert new_blocks is not None  # can_allocate said it fits
            self.waiting.pop()
            seq.blocks = hits + new_blocks
            seq.num_computed_tokens = num_computed
            seq.num_cached_blocks = len(hits)
            if seq.cached_tokens < 0:
                seq.cached_tokens = num_computed
            seq.status = ReqStatus.RUNNING
            self.running.append(seq)
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_computed
            plan.add(ScheduledChunk(seq, num_new, num_computed))

    def _make_room(self, seq: SeqState, need: int, hits: list[KVBlock], plan: Plan) -> bool:
        """Under "priority", preempt running sequences of strictly worse priority than
        the waiting `seq` (worst, newest first) until `need` new blocks fit beside its
        prefix `hits`; False, and nobody preempted, when even all of them would not do."""
        priority = seq.request.priority
        victim = self._victim() if self.policy == "priority" else None
        if victim is None or victim.request.priority <= priority:
            return False  # the common case, checked first: nobody to preempt
        # can_allocate counts the free blocks; add what every possible victim would free
        if not self.pool.can_allocate(need - self._reclaimable(priority, hits), hits):
            return False
        while not self.pool.can_allocate(need, hits):
            victim = self._victim()
            assert victim is not None and victim.request.priority > priority  # counted above
            self._preempt(victim, plan)
        return True

    def _reclaimable(self, priority: int, hits: list[KVBlock]) -> int:
        """Blocks that preempting every running sequence of strictly worse `priority`
        would free: those no other sequence references (a shared prefix block stays in
        use), less the waiting sequence's prefix `hits`, which it takes back."""
        refs: dict[KVBlock, int] = {}
        for s in self.running:
            if s.request.priority > priority:
                for block in s.blocks:
                    refs[block] = refs.get(block, 0) + 1
        kept = set(hits)
        return sum(1 for b, n in refs.items() if b.ref_cnt == n and b not in kept)

    def _grow(self, seq: SeqState, num_new: int, plan: Plan) -> bool:
        """Give a running sequence room for `num_new` more tokens, preempting if needed."""
        need = _blocks_for(seq.num_computed_tokens + num_new, self.pool.block_size)
        need -= len(seq.blocks)
        while need > 0:
            new_blocks = self.pool.allocate(need)
            if new_blocks is not None:
                seq.blocks.extend(new_blocks)
                return True
            victim = self._victim()
            assert victim is not None  # seq itself is running
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _victim(self) -> SeqState | None:
        if not self.running:
            return None
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda s: s.sort_key)

    def _preempt(self, seq: SeqState, plan: Plan) -> None:
        plan.drop(seq)
        plan.preempted.append(seq)
        self.running.remove(seq)
        self._release(seq)
        seq.status = ReqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(seq)

    # --------------------------------------------------------------- commit
    def commit(self, plan: Plan) -> None:
        """Cache the blocks the final plan fills, emitting `BlockStored`."""
        block_size = self.pool.block_size
        # decodes first (one token on top of what is in KV; rarely a block's last),
        # then prefill chunks
        for seq in plan.decodes:
            if (seq.num_computed_tokens + 1) // block_size > seq.num_cached_blocks:
                self._cache_full_blocks(seq, seq.num_computed_tokens + 1)
        for c in plan.chunks.values():
            self._cache_full_blocks(c.seq, c.num_computed + c.num_new)

    def _cache_full_blocks(self, seq: SeqState, num_in_kv: int) -> None:
        """Register the blocks of ``seq`` that ``num_in_kv`` tokens fill and that are not
        registered yet."""
        block_size = self.pool.block_size
        num_full = num_in_kv // block_size
        first = seq.num_cached_blocks
        if num_full <= first:
            return
        indices = range(first, num_full)
        salt = seq.request.cache_salt
        self.pool.cache_full_blocks(
            seq.blocks[first:num_full],
            [seq.block_hash(i) for i in indices],
            seq.block_hash(first - 1) if first else None,
            [seq.block_token_ids(i, block_size) for i in indices],
            root_extra=(salt,) if salt else None,  # the pool knows which block is the root
        )
        seq.num_cached_blocks = num_full

    # ----------------------------------------------------------- lifecycle
    def finish(self, seq: SeqState) -> None:
        """Remove a running or waiting sequence and free its blocks (reverse order)."""
        if seq.status is ReqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is ReqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)

    def clear(self) -> None:
        self.running.clear()
        self.waiting.clear()

    def _release(self, seq: SeqState) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
