"""Fault injection: crash and recover, slow steps, reject-all, mass eviction."""

from __future__ import annotations

import math

import pytest

from kvgate.engine import AllBlocksCleared, EvictionAnnounced, EvictionDone, RejectKind


def test_crash_fails_everything_in_flight_and_clears_the_cache(kit) -> None:
    engine = kit.tiny_engine(profile=kit.tiny_profile(max_num_seqs=1))
    engine.submit(kit.req("run", 8, base=100, max_tokens=5), 0.0)
    engine.submit(kit.req("wait", 8, base=200), 0.0)
    out = engine.step(0.0)
    assert out is not None
    engine.take_events()
    assert engine.crash(out.end) == ("run", "wait")
    assert engine.take_events() == [AllBlocksCleared()]
    assert (engine.pool.num_free_blocks, engine.pool.cached_hashes()) == (10, {})
    assert not engine.has_unfinished_requests()
    refused = engine.submit(kit.req("new", 4, base=300), 1.0)
    assert (refused.reject_kind, refused.reason) == (RejectKind.RETRY_ELSEWHERE, "engine crashed")
    assert engine.step(1.0) is None
    assert not engine.abort("run", 1.0)  # already failed: exactly one outcome
    m = engine.metrics()
    assert (m.num_requests_failed, m.num_requests_rejected, m.num_requests_running) == (2, 1, 0)

    engine.recover(2.0)
    assert engine.submit(kit.req("run", 8, base=100), 2.0).accepted  # the id may be reused
    outs, _ = kit.drive(engine, 2.0)
    assert [f.cached_tokens for o in outs for f in o.finished] == [0]  # cold after the crash


def test_crash_ends_a_pending_announcement_with_its_done(kit) -> None:
    engine = kit.tiny_engine(num_blocks=20)
    engine.submit(kit.req("a", 16, base=100), 0.0)
    kit.drive(engine, 0.0)
    engine.bulk_evict(0.2, 1.0, "fault")
    engine.crash(1.5)
    events = engine.take_events()
    # the eviction is over (everything is gone): its done comes, before the clear
    assert isinstance(events[-3], EvictionAnnounced)
    assert events[-2:] == [EvictionDone(num_blocks_evicted=0), AllBlocksCleared()]
    assert engine.next_timer_at() is None


def test_slow_multiplies_every_step_time(kit) -> None:
    engine = kit.tiny_engine()
    engine.slow(2.5)
    assert engine.faults.active
    engine.submit(kit.req("a", 8, base=100, max_tokens=2), 0.0)
    out = engine.step(0.0)
    assert out is not None and out.duration_s == pytest.approx(2.5 * (0.010 + 0.008))
    engine.slow(1.0)
    out = engine.step(out.end)
    assert out is not None and out.duration_s == pytest.approx(0.011)
    with pytest.raises(ValueError):
        engine.slow(0.0)


def test_reject_all_refuses_with_retry_elsewhere_until_switched_off(kit) -> None:
    engine = kit.tiny_engine()
    engine.reject_all(True)
    decision = engine.submit(kit.req("a", 4, base=1), 0.0)
    assert decision.rejected and decision.reject_kind is RejectKind.RETRY_ELSEWHERE
    engine.reject_all(False)
    assert engine.submit(kit.req("a", 4, base=1), 0.0).accepted


def test_recover_heals_every_fault(kit) -> None:
    engine = kit.tiny_engine()
    engine.slow(3.0)
    engine.reject_all(True)
    engine.recover(0.0)
    assert not engine.faults.active
    assert engine.submit(kit.req("a", 4, base=1), 0.0).accepted


def test_reset_prefix_cache_only_when_idle(kit) -> None:
    engine = kit.tiny_engine()
    engine.submit(kit.req("a", 8, base=100, max_tokens=3), 0.0)
    out = engine.step(0.0)
    assert out is not None
    assert not engine.reset_prefix_cache()
    kit.drive(engine, out.end)
    engine.take_events()
    assert engine.reset_prefix_cache()
    assert engine.take_events() == [AllBlocksCleared()]


@pytest.mark.parametrize("factor", [math.inf, math.nan])
def test_a_non_finite_slow_factor_is_refused(kit, factor: float) -> None:
    engine = kit.tiny_engine()
    with pytest.raises(ValueError, match="slow factor must be a finite number"):
        engine.slow(factor)  # an infinite step would never end
    assert engine.faults.slow_factor == 1.0
