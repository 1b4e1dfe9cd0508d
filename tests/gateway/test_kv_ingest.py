"""Precise mode's pure half: one node's KV event batches -> index operations."""

from __future__ import annotations

import pytest

from kvgate.core.hashing import make_hasher
from kvgate.core.hashing.tokens import TokenBlockHasher
from kvgate.gateway.kv_ingest import IndexCleared, IndexRemoved, IndexStored, NodeKvIngest
from kvgate.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 16
MODEL = "kvgate-sim"


def _hasher() -> TokenBlockHasher:
    h = make_hasher("sim", block_size=BS)
    assert isinstance(h, TokenBlockHasher)
    return h


def _tokens(n_blocks: int, salt: int = 0) -> list[int]:
    return [(salt * 7919 + i) % 32_000 for i in range(n_blocks * BS)]


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens),
        block_size=kw.pop("block_size", BS), medium=kw.pop("medium", "GPU"),  # type: ignore[arg-type]
        lora_id=kw.pop("lora_id", None), extra=kw,  # type: ignore[arg-type]
    )


def _batch(*events: object, rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=tuple(events), data_parallel_rank=rank)  # type: ignore[arg-type]


def test_stored_blocks_get_the_keys_a_request_chain_gives() -> None:
    h = _hasher()
    ids = _tokens(5)
    ing = NodeKvIngest(h)
    # the engine stores the first three blocks, then (a later step) two more after them
    ops = ing.feed(0, _batch(_stored([101, 102, 103], None, ids[: 3 * BS])), MODEL)
    ops += ing.feed(1, _batch(_stored([104, 105], 103, ids[3 * BS :])), MODEL)
    want = list(h.chain_for_tokens(ids, model=MODEL))
    assert ops == [IndexStored(tuple(want[:3])), IndexStored(tuple(want[3:]))]
    # and the same as the gateway's own chain for that prompt, tokenized its way
    text = "You are a helpful assistant. " * 40
    tokens = list(h.tokens_for_prompt(text))
    n = len(tokens) // BS
    ing2 = NodeKvIngest(h)
    [op] = ing2.feed(0, _batch(_stored(list(range(n)), None, tokens[: n * BS])), MODEL)
    assert op == IndexStored(tuple(h.chain_for_prompt(text, MODEL)))
    assert ing.counts["stored_blocks"] == 5


def test_removed_blocks_name_their_keys_and_unknown_ones_are_counted() -> None:
    h = _hasher()
    ids = _tokens(3)
    ing = NodeKvIngest(h)
    [stored] = ing.feed(0, _batch(_stored([1, 2, 3], None, ids)), MODEL)
    assert isinstance(stored, IndexStored)
    ops = ing.feed(1, _batch(BlockRemoved(block_hashes=(3, 2), medium="GPU"),
                             BlockRemoved(block_hashes=(99,), medium="GPU")), MODEL)
    assert ops == [IndexRemoved((stored.keys[2], stored.keys[1]))]
    assert ing.counts["unknown_removed"] == 1
    assert ing.remembered == 1


def test_a_key_held_by_two_data_parallel_ranks_leaves_with_the_last() -> None:
    h = _hasher()
    ids = _tokens(2)
    ing = NodeKvIngest(h)
    [a] = ing.feed(0, _batch(_stored([1, 2], None, ids), rank=0), MODEL)
    [b] = ing.feed(1, _batch(_stored([7, 8], None, ids), rank=1), MODEL)
    assert a == b  # same tokens: same keys, whatever the engine hashes
    assert ing.feed(2, _batch(BlockRemoved(block_hashes=(2,)), rank=0), MODEL) == []
    assert ing.feed(3, _batch(BlockRemoved(block_hashes=(8,)), rank=1), MODEL) == [
        IndexRemoved((a.keys[1],))  # type: ignore[union-attr]
    ]
    # AllBlocksCleared of one rank drops what that rank alone held
    assert ing.feed(4, _batch(AllBlocksCleared(), rank=1), MODEL) == []
    assert ing.feed(5, _batch(AllBlocksCleared(), rank=0), MODEL) == [
        IndexRemoved((a.keys[0],))  # type: ignore[union-attr]
    ]
    assert ing.remembered == 0


def test_an_orphan_cannot_be_keyed_nor_can_its_children() -> None:
    ing = NodeKvIngest(_hasher())
    assert ing.feed(0, _batch(_stored([5, 6], 4, _tokens(2))), MODEL) == []
    assert ing.feed(1, _batch(_stored([7], 6, _tokens(1, salt=3))), MODEL) == []
    assert ing.counts["orphan_blocks"] == 3


def test_sequence_gaps_are_counted_and_a_restart_clears_the_node() -> None:
    h = _hasher()
    ing = NodeKvIngest(h)
    ing.feed(0, _batch(_stored([1], None, _tokens(1))), MODEL)
    ing.feed(4, _batch(), MODEL)
    assert ing.counts["missed_batches"] == 3
    # a new engine process numbers its batches from 0 again, with an empty cache
    ops = ing.feed(0, _batch(_stored([1], None, _tokens(1, salt=9))), MODEL)
    assert ops[0] == IndexCleared()
    assert ops[1] == IndexStored(tuple(h.chain_for_tokens(_tokens(1, salt=9), model=MODEL)))
    assert ing.counts["restarts"] == 1
    assert ing.remembered == 1


@pytest.mark.parametrize(
    ("kw", "counter"),
    [
        ({"block_size": 32}, "bad_block_size"),  # another block size than the hasher's
        ({"medium": "CPU"}, "other_medium"),  # an offload tier is no prefix-cache hit
        ({"group_idx": 1}, "other_medium"),  # a hybrid model's second KV cache group
        ({"lora_id": 3}, "unnamed_lora_blocks"),  # an adapter without its name
    ],
)
def test_blocks_that_cannot_be_keyed_as_ours_are_skipped(
    kw: dict[str, object], counter: str
) -> None:
    ing = NodeKvIngest(_hasher())
    size = int(kw.get("block_size", BS))  # type: ignore[call-overload]
    event = _stored([1, 2], None, [1] * (2 * size), **kw)
    assert ing.feed(0, _batch(event), MODEL) == []
    assert ing.counts[counter] >= 1
    assert ing.remembered == 0


def test_token_ids_that_do_not_fill_the_blocks_are_skipped() -> None:
    ing = NodeKvIngest(_hasher())
    assert ing.feed(0, _batch(_stored([1, 2], None, _tokens(1))), MODEL) == []
    assert ing.counts["bad_block_size"] == 2


def test_a_lora_adapter_starts_from_its_own_root() -> None:
    h = _hasher()
    ids = _tokens(2)
    ing = NodeKvIngest(h)
    [op] = ing.feed(0, _batch(_stored([1, 2], None, ids, lora_id=1, lora_name="sql-lora")), MODEL)
    assert op == IndexStored(tuple(h.chain_for_tokens(ids, model="sql-lora")))
    assert op != IndexStored(tuple(h.chain_for_tokens(ids, model=MODEL)))


def test_memory_is_bounded_oldest_hashes_forgotten_first() -> None:
    h = _hasher()
    ing = NodeKvIngest(h, max_blocks=3)
    ids = _tokens(5)
    [stored] = ing.feed(0, _batch(_stored([1, 2, 3, 4, 5], None, ids)), MODEL)
    assert ing.remembered == 3
    assert ing.counts["forgotten_blocks"] == 2
    # the forgotten ones cannot be removed by name any more; the kept ones can
    ops = ing.feed(1, _batch(BlockRemoved(block_hashes=(1, 5))), MODEL)
    assert ops == [IndexRemoved((stored.keys[4],))]  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        NodeKvIngest(h, max_blocks=0)
    # a lower bound (the node came back with a smaller cache) forgets the oldest now
    ing.max_blocks = 1  # 3 and 4 left: 3 goes
    assert ing.remembered == 1 and ing.counts["forgotten_blocks"] == 3
    ops = ing.feed(2, _batch(BlockRemoved(block_hashes=(3, 4))), MODEL)
    assert ops == [IndexRemoved((stored.keys[3],))]  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        ing.max_blocks = 0



def test_the_bound_forgets_the_nodes_oldest_whichever_rank_stored_them() -> None:
    """Two data-parallel ranks of 10 blocks each: the bound forgot the oldest of the rank
    storing (a rank's blocks stored just now went first while the other rank's old ones
    stayed), so its continuations became orphans and its removals unknown."""
    h = _hasher()
    ing = NodeKvIngest(h, max_blocks=100)
    for rank in (0, 1):
        ids = _tokens(10, salt=rank)
        hashes = list(range(100 * rank, 100 * rank + 10))
        ing.feed(0, _batch(_stored(hashes, None, ids), rank=rank), MODEL)
    assert ing.remembered == 20
    ing.max_blocks = 5  # a lower bound: the node's 15 oldest go now
    assert ing.remembered == 5 and ing.counts["forgotten_blocks"] == 15
    assert list(ing._entries) == [(1, h) for h in range(105, 110)]
    # at the bound, a rank storing pushes out the node's oldest, the other rank's
    ing.feed(1, _batch(_stored([20], 9, _tokens(1, salt=4)), rank=0), MODEL)
    assert ing.counts["orphan_blocks"] == 1  # rank 0's parent was forgotten above
    ing.feed(2, _batch(_stored([10, 11], None, _tokens(2, salt=5)), rank=0), MODEL)
    ing.feed(3, _batch(_stored([12], 11, _tokens(1, salt=6)), rank=0), MODEL)
    assert ing.counts["orphan_blocks"] == 1  # its newest parent was kept
    assert [k for k in ing._entries] == [(1, 108), (1, 109), (0, 10), (0, 11), (0, 12)]


def test_an_all_blocks_cleared_from_the_only_publisher_clears_the_nodes_index() -> None:
    """The keys remembered here are not all the index holds for the node (what routing
    taught it, its guesses): a clear that dropped only those left stale matches."""
    ing = NodeKvIngest(_hasher())
    ing.feed(0, _batch(_stored([1], None, _tokens(1))), MODEL)
    assert ing.feed(1, _batch(AllBlocksCleared()), MODEL) == [IndexCleared()]
    assert ing.remembered == 0 and ing.counts["restarts"] == 0
    assert ing.feed(2, _batch(), MODEL) == [] and ing.counts["missed_batches"] == 0


def test_a_lora_adapters_name_in_extra_keys_does_not_make_its_blocks_salted() -> None:
    """vLLM 0.33 lists the adapter's name first in every block's extra_keys: every LoRA
    block was taken for a salted one and never keyed."""
    h = _hasher()
    ids = _tokens(2)
    ing = NodeKvIngest(h)
    lora = {"lora_id": 1, "lora_name": "sql-lora"}
    event = _stored([1, 2], None, ids, extra_keys=(("sql-lora",), ("sql-lora",)), **lora)
    [op] = ing.feed(0, _batch(event), MODEL)
    assert op == IndexStored(tuple(h.chain_for_tokens(ids, model="sql-lora")))
    salted = _stored([3], None, _tokens(1, salt=2), extra_keys=(("sql-lora", "s3cret"),), **lora)
    assert ing.feed(1, _batch(salted), MODEL) == []  # and a salt beside it still counts
    assert ing.counts["extra_keys_blocks"] == 1


def test_a_block_cached_twice_leaves_with_its_last_copy() -> None:
    """vLLM does not de-duplicate: two requests computing the same block in one step
    cache a copy each (a BlockStored each) and evicting one copy sends one
    BlockRemoved. The first removal dropped the key the engine still held, and every
    later block continuing it was an orphan."""
    h = _hasher()
    ids = _tokens(3)
    ing = NodeKvIngest(h)
    [a, b] = ing.feed(0, _batch(_stored([1, 2], None, ids[: 2 * BS]),
                                _stored([1, 2], None, ids[: 2 * BS])), MODEL)
    assert a == b
    assert ing.feed(1, _batch(BlockRemoved(block_hashes=(2, 1))), MODEL) == []
    # the other copy still names the parent of the next block
    [c] = ing.feed(2, _batch(_stored([3], 2, ids[2 * BS :])), MODEL)
    assert c == IndexStored((h.chain_for_tokens(ids, model=MODEL)[2],))
    assert ing.counts["orphan_blocks"] == 0
    ops = ing.feed(3, _batch(BlockRemoved(block_hashes=(3, 2, 1))), MODEL)
    assert ops == [IndexRemoved(tuple(reversed(h.chain_for_tokens(ids, model=MODEL))))]


def test_blocks_with_extra_keys_are_not_keyed_by_their_tokens() -> None:
    """A cache_salt (or multimodal input) is in the first block's extra_keys: keyed by
    its tokens alone, a salted prompt's blocks were a false hit for the plain one."""
    ing = NodeKvIngest(_hasher())
    salted = _stored([1, 2], None, _tokens(2), extra_keys=(("s3cret",), None))
    assert ing.feed(0, _batch(salted), MODEL) == []
    # its continuation (decode, a later chunk) is no more keyable, and no orphan either:
    # orphans make routing teach the index (kv_watch.py), which salted traffic kept on
    assert ing.feed(1, _batch(_stored([3], 2, _tokens(1, salt=5))), MODEL) == []
    assert ing.counts["extra_keys_blocks"] == 3 and ing.counts["orphan_blocks"] == 0
    plain = _stored([4], None, _tokens(1), extra_keys=(None,))  # vLLM's for plain text
    assert len(ing.feed(2, _batch(plain), MODEL)) == 1
    # their evictions name nothing in the index, and they are forgotten
    assert ing.feed(3, _batch(BlockRemoved(block_hashes=(3, 2, 1))), MODEL) == []
    assert ing.remembered == 1 and ing.counts["unknown_removed"] == 0


def test_each_rank_numbers_its_own_batches_and_restarts_alone() -> None:
    """Data-parallel ranks publish on their own endpoints, each with its own sequence:
    interleaved they are no restart, and one rank restarting drops only its blocks."""
    h = _hasher()
    ing = NodeKvIngest(h)
    shared, own = _tokens(1), _tokens(1, salt=8)
    ing.feed(0, _batch(_stored([1], None, shared), rank=0), MODEL)
    ing.feed(0, _batch(_stored([1], None, shared), rank=1), MODEL)
    ing.feed(1, _batch(_stored([9], None, own), rank=1), MODEL)
    ing.feed(1, _batch(rank=0), MODEL)
    assert ing.counts["restarts"] == 0 and ing.counts["missed_batches"] == 0
    ops = ing.feed(0, _batch(rank=1), MODEL)  # rank 1's engine started again
    assert ops == [IndexRemoved((h.chain_for_tokens(own, model=MODEL)[0],))]
    assert ing.counts["restarts"] == 1 and ing.remembered == 1
