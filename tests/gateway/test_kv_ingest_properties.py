"""The KV-event mapper against a brute-force model of the engines' caches.

Random event streams as vLLM's data-parallel ranks emit them (blocks stored on a
parent the rank holds, copies of a block, evictions copy by copy, a rank's cache
cleared): after every batch, the keys the mapper's operations leave in an index are
exactly the keys of the blocks some rank holds, each key our own chain over the
block's tokens from the sequence's root."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.hashing import make_hasher
from kvgate.core.hashing.tokens import TokenBlockHasher
from kvgate.gateway.kv_ingest import IndexCleared, IndexRemoved, IndexStored, NodeKvIngest
from kvgate.protocol import AllBlocksCleared, BlockRemoved, KVEventBatch, gpu_block_stored

BS = 4
MODEL = "m"
HASHER = make_hasher("sim", block_size=BS)
assert isinstance(HASHER, TokenBlockHasher)

# one step: (rank, op, a, b): op 0 store a child of the a-th held block (or a root),
# op 1 store a copy of the a-th held block, op 2 evict one copy of the a-th held
# block, op 3 clear the rank
steps = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 50), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_the_index_holds_exactly_what_some_rank_holds(
    plan: list[tuple[int, int, int, int]],
) -> None:
    ing = NodeKvIngest(HASHER)
    index: set[int] = set()
    # the model: per rank, engine hash -> copies; every hash's key and its block
    copies: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}
    key_of: dict[int, int] = {}
    block_of: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    seqs = {0: 0, 1: 0}
    next_hash = 1
    for rank, op, a, b in plan:
        held = sorted(h for h, n in copies[rank].items() if n > 0)
        events: list[object] = []
        if op == 0:
            parent = held[a % len(held)] if held and a % 3 else None
            # half the blocks share their tokens: the same key under other engine
            # hashes, on either rank (a shared prefix cached by both)
            salt = 0 if a % 2 == 0 else next_hash
            tokens = tuple((salt * 31 + b * 7 + i) % 1000 for i in range(BS))
            h = next_hash
            next_hash += 1
            parent_key = key_of[parent] if parent is not None else None
            key_of[h] = HASHER.chain_for_tokens(tokens, parent=parent_key, model=MODEL)[0]
            block_of[h] = (parent, tokens)
            copies[rank][h] += 1
            events.append(gpu_block_stored([h], parent, tokens, BS))
        elif op == 1 and held:
            h = held[a % len(held)]
            parent, tokens = block_of[h]
            if parent is not None and not copies[rank][parent]:
                continue  # a copy is computed on a cached parent
            copies[rank][h] += 1
            events.append(gpu_block_stored([h], parent, tokens, BS))
        elif op == 2 and held:
            h = held[a % len(held)]
            copies[rank][h] -= 1
            events.append(BlockRemoved(block_hashes=(h,), medium="GPU"))
        elif op == 3:
            copies[rank].clear()
            events.append(AllBlocksCleared())
        if not events:
            continue
        batch = KVEventBatch(ts=0.0, events=tuple(events), data_parallel_rank=rank)  # type: ignore[arg-type]
        for o in ing.feed(seqs[rank], batch, MODEL):
            if isinstance(o, IndexStored):
                index.update(o.keys)
            elif isinstance(o, IndexRemoved):
                index.difference_update(o.keys)
            else:
                assert isinstance(o, IndexCleared)
                index.clear()
        seqs[rank] += 1
        want = {key_of[h] for r in (0, 1) for h, n in copies[r].items() if n > 0}
        assert index == want
    assert ing.counts["orphan_blocks"] == 0 and ing.counts["unknown_removed"] == 0
