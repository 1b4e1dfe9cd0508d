"""Bulk eviction: announce -> paced BlockRemoved batches -> done; lazy churn says nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvgate.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EvictionAnnounced,
    EvictionConfig,
    EvictionDone,
    SimEngine,
)

A = (101, 102, 103, 104)
B = (201, 202, 203, 204)


def warm(kit, **eviction: float | None) -> SimEngine:  # type: ignore[no-untyped-def]
    """20 blocks of 4 (batch 1 block, bulk above 2 blocks / s) with chains A and B cached-free."""
    engine = kit.tiny_engine(num_blocks=20, eviction=EvictionConfig(**eviction))  # type: ignore[arg-type]
    for name, base in (("a", 100), ("b", 200)):
        assert engine.submit(kit.req(name, 16, base=base), 0.0).accepted
        kit.drive(engine, 0.0)
    assert engine.pool.free_block_ids()[-8:] == [3, 2, 1, 0, 7, 6, 5, 4]
    engine.take_events()
    return engine


def test_announced_bulk_eviction_is_paced_in_batches(kit) -> None:
    engine = warm(kit)
    assert engine.bulk_evict(0.3, 10.0, "flush") == 6
    # LRU order: A's tail first; prefixes = first chosen block of each affected segment
    assert engine.take_events() == [
        EvictionAnnounced(
            num_blocks=6, prefixes=(101, 203), starts_at=12.0, done_by=14.5, reason="flush"
        )
    ]
    assert engine.next_timer_at() == 12.0
    assert engine.step(11.9) is None
    assert engine.take_events() == []  # nothing lost before starts_at
    removed = []
    for t in (12.0, 12.5, 13.0, 13.5, 14.0, 14.5):
        assert engine.step(t) is None  # idle engine: only the timer ran
        removed.append(engine.take_events())
    assert removed == [
        [BlockRemoved(block_hashes=(104,))],
        [BlockRemoved(block_hashes=(103,))],
        [BlockRemoved(block_hashes=(102,))],
        [BlockRemoved(block_hashes=(101,))],
        [BlockRemoved(block_hashes=(204,))],
        [BlockRemoved(block_hashes=(203,)), EvictionDone(num_blocks_evicted=6)],
    ]
    assert sorted(engine.pool.cached_hashes()) == [201, 202]
    assert engine.next_timer_at() is None


def test_late_step_runs_every_overdue_batch_in_order(kit) -> None:
    engine = warm(kit)
    engine.bulk_evict(0.3, 10.0, "flush")
    engine.take_events()
    engine.step(13.1)
    assert engine.take_events() == [BlockRemoved(block_hashes=(h,)) for h in (104, 103, 102)]


def test_blocks_in_use_by_then_are_skipped(kit) -> None:
    engine = warm(kit)
    engine.bulk_evict(0.3, 10.0, "flush")
    engine.take_events()
    # a request reusing chain A arrives before the first batch and keeps running
    assert engine.submit(kit.req("a2", 16, base=100, max_tokens=20), 11.0).accepted
    out = engine.step(11.0)
    assert out is not None and out.num_prefill_tokens == 4  # 3 blocks hit
    assert engine.take_events() == []  # block 104 recomputed as a duplicate: no event
    events = []
    for t in (12.0, 12.5, 13.0, 13.5, 14.0, 14.5):
        engine.step(t)
        events.extend(e for e in engine.take_events() if not isinstance(e, BlockStored))
    assert events == [
        BlockRemoved(block_hashes=(104,)),  # still cached-free: a2 holds its own copy
        BlockRemoved(block_hashes=(204,)),
        BlockRemoved(block_hashes=(203,)),
        EvictionDone(num_blocks_evicted=3),
    ]
    assert {101, 102, 103} <= set(engine.pool.cached_hashes())


def test_a_cache_reset_mid_eviction_ends_it_with_its_done(kit) -> None:
    engine = warm(kit)
    engine.bulk_evict(0.3, 10.0, "flush")
    engine.take_events()
    engine.step(12.5)  # two of the six batches ran
    assert engine.take_events() == [BlockRemoved(block_hashes=(h,)) for h in (104, 103)]
    assert engine.reset_prefix_cache()
    # the done (what the batches evicted) comes before the clear that ends the plan
    assert engine.take_events() == [EvictionDone(num_blocks_evicted=2), AllBlocksCleared()]
    assert engine.next_timer_at() is None


def test_a_refused_cache_reset_keeps_the_eviction_going(kit) -> None:
    engine = warm(kit)
    engine.bulk_evict(0.3, 10.0, "flush")
    engine.take_events()
    assert engine.submit(kit.req("c", 8, base=300, max_tokens=5), 10.0).accepted
    assert engine.step(10.0) is not None  # c holds blocks: no reset
    assert not engine.reset_prefix_cache()
    assert not any(isinstance(e, EvictionDone | AllBlocksCleared) for e in engine.take_events())
    assert engine.next_timer_at() == 12.0


def test_the_fraction_is_of_the_pool_capped_by_the_cached_free_blocks(kit) -> None:
    engine = warm(kit, announce_lead_s=None)  # 8 of 20 blocks cached-free
    assert engine.bulk_evict(0.2, 10.0) == 4  # 20 % of the pool, not of the 8 cached
    assert engine.bulk_evict(0.9, 20.0) == 4  # at most every cached block not in use
    assert engine.pool.num_cached_blocks == 0


def test_without_announcement_the_same_blocks_go_at_once(kit) -> None:
    engine = warm(kit, announce_lead_s=None)
    assert engine.bulk_evict(0.3, 10.0, "flush") == 6
    assert engine.take_events() == [BlockRemoved(block_hashes=(104, 103, 102, 101, 204, 203))]
    assert engine.next_timer_at() is None
    # evicted blocks are blank now and are reused before the surviving cached ones
    assert engine.pool.free_block_ids()[:6] == [6, 7, 0, 1, 2, 3]


def test_small_trims_are_not_bulk_until_the_window_adds_up(kit) -> None:
    engine = warm(kit)
    assert engine.bulk_evict(0.05, 10.0, "trim") == 1  # 1 block <= 10 % of 20
    assert engine.bulk_evict(0.05, 10.5, "trim") == 1  # 2 blocks within 1 s: still <= 2
    assert engine.take_events() == [
        BlockRemoved(block_hashes=(104,)),
        BlockRemoved(block_hashes=(103,)),
    ]
    assert engine.bulk_evict(0.05, 10.9, "trim") == 1  # 3 blocks within 1 s: bulk
    (announced,) = engine.take_events()
    assert isinstance(announced, EvictionAnnounced)
    assert (announced.num_blocks, announced.prefixes, announced.starts_at) == (1, (102,), 12.9)
    assert engine.bulk_evict(0.05, 20.0, "trim") == 1  # the window has moved on
    assert engine.take_events() == [BlockRemoved(block_hashes=(101,))]


def test_lazy_lru_churn_announces_nothing(kit) -> None:
    engine = kit.tiny_engine(num_blocks=10)
    now = 0.0
    for i in range(30):  # each request evicts the previous ones' cached blocks
        assert engine.submit(kit.req(f"r{i}", 32, base=1000 * (i + 1)), now).accepted
        _, now = kit.drive(engine, now)
    events = engine.take_events()
    assert sum(isinstance(e, BlockRemoved) for e in events) > 100
    assert not any(isinstance(e, EvictionAnnounced | EvictionDone) for e in events)


def test_nothing_cached_means_nothing_to_evict(kit) -> None:
    engine = kit.tiny_engine()
    assert engine.bulk_evict(1.0, 0.0) == 0
    assert engine.take_events() == []
    with pytest.raises(ValueError):
        engine.bulk_evict(0.0, 0.0)


def test_a_forced_flush_takes_a_share_of_the_cache_and_is_announced_however_small(
    kit: Any,
) -> None:
    """``flush``: ceil(share x cached blocks), least recently used first, announced even
    below the bulk threshold (2 blocks of a 20-block pool is 10 %: a trim otherwise)."""
    engine = warm(kit)  # 8 of 20 blocks cached, none in use
    assert engine.bulk_evict(0.1, 10.0) == 2  # the same size as a trim: silent
    assert engine.take_events() == [BlockRemoved(block_hashes=(104, 103))]
    assert engine.pool.num_cached_blocks == 6
    assert engine.flush(0.3, 20.0, "forced") == 2  # ceil(0.3 x 6) = 2
    assert engine.take_events() == [
        EvictionAnnounced(
            num_blocks=2, prefixes=(101,), starts_at=22.0, done_by=22.5, reason="forced"
        )
    ]
    for t in (22.0, 22.5):
        assert engine.step(t) is None
    assert engine.take_events() == [
        BlockRemoved(block_hashes=(102,)),
        BlockRemoved(block_hashes=(101,)),
        EvictionDone(num_blocks_evicted=2),
    ]
    # the threshold is back for the next discretionary eviction (the window moved on)
    assert engine.bulk_evict(0.1, 40.0) == 2
    assert engine.take_events() == [BlockRemoved(block_hashes=(204, 203))]


def test_a_forced_flush_leaves_blocks_in_use_and_goes_at_once_unannounced(kit: Any) -> None:
    engine = warm(kit, announce_lead_s=None)
    assert engine.submit(kit.req("c", 17, base=100, max_tokens=50), 1.0).accepted
    assert engine.step(1.0) is not None  # c holds A's 4 blocks (hits) and a fifth
    engine.take_events()
    assert engine.pool.num_cached_blocks == 8
    assert engine.flush(1.0, 2.0) == 4  # all 8 asked, B's 4 free to go
    assert engine.take_events() == [BlockRemoved(block_hashes=(204, 203, 202, 201))]
    assert sorted(engine.pool.cached_hashes()) == [101, 102, 103, 104]
    with pytest.raises(ValueError):
        engine.flush(0.0, 3.0)
    assert kit.tiny_engine().flush(1.0, 0.0) == 0  # nothing cached


@pytest.mark.parametrize(
    "field", ["announce_lead_s", "batch_fraction", "batch_interval_s", "bulk_window_s"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_setting_is_refused_by_name(field: str, value: float) -> None:
    # a NaN lead passed the range check and left the announced eviction never starting
    with pytest.raises(ValueError, match=rf"EvictionConfig\.{field} must be a finite number"):
        EvictionConfig(**{field: value})  # type: ignore[arg-type]
