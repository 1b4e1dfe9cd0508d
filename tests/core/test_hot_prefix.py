"""HotPrefixTracker: sliding-window rates in bounded memory."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.errors import ConfigError
from kvgate.core.index import HotPrefixTracker


def test_steady_stream_reads_its_rate() -> None:
    t = HotPrefixTracker(window_s=10.0)
    for i in range(300):  # 10 requests/s for 30 s
        t.record(7, i * 0.1)
    for now in (29.9, 30.0, 30.05, 30.5):
        assert t.rate(7, now) == pytest.approx(10.0, rel=0.05)
    assert t.rate(8, 30.0) == 0.0


def test_window_slides_out_old_requests() -> None:
    t = HotPrefixTracker(window_s=10.0, buckets=10)
    for i in range(10):  # 10 requests in [0, 1)
        t.record(1, i * 0.1)
    assert t.rate(1, 1.0) == pytest.approx(1.0)
    assert t.rate(1, 10.0) == pytest.approx(1.0)
    assert t.rate(1, 10.5) == pytest.approx(0.5)  # half of the oldest sub-bucket left
    assert t.rate(1, 11.0) == 0.0
    assert t.rate(1, 1000.0) == 0.0


def test_rate_over_a_burst_then_silence() -> None:
    t = HotPrefixTracker(window_s=4.0, buckets=4)
    for _ in range(8):
        t.record(3, 2.0)
    assert t.rate(3, 2.0) == pytest.approx(2.0)
    assert t.rate(3, 5.0) == pytest.approx(2.0)
    assert t.rate(3, 6.0) == pytest.approx(2.0)  # the sub-bucket [2, 3) is fully inside
    assert t.rate(3, 6.25) == pytest.approx(1.5)
    assert t.rate(3, 7.0) == 0.0


def test_keys_are_bounded_and_least_recently_seen_go_first() -> None:
    t = HotPrefixTracker(window_s=10.0, max_keys=3)
    for k in (1, 2, 3):
        t.record(k, 0.0)
    t.record(1, 0.1)  # 1 is now the most recently seen
    t.record(4, 0.2)  # evicts 2
    assert len(t) == 3
    assert t.rate(2, 0.2) == 0.0
    assert t.rate(1, 0.2) == pytest.approx(0.2)
    assert {k for k, _ in t.top(10, 0.2)} == {1, 3, 4}


def test_keys_not_seen_within_the_window_are_forgotten() -> None:
    t = HotPrefixTracker(window_s=10.0)
    for k in range(100):
        t.record(k, 0.0)
    t.record(1000, 20.0)
    assert len(t) == 1


def test_top_orders_by_rate_then_key() -> None:
    t = HotPrefixTracker(window_s=10.0)
    for k, n in ((5, 3), (6, 7), (7, 3), (8, 1)):
        for _ in range(n):
            t.record(k, 1.0)
    assert t.top(3, 2.0) == [(6, 0.7), (5, 0.3), (7, 0.3)]
    assert t.top(0, 2.0) == []
    assert t.top(10, 100.0) == []


def test_earlier_now_counts_as_the_latest() -> None:
    t = HotPrefixTracker(window_s=10.0)
    t.record(1, 5.0)
    t.record(1, 4.0)  # clock going backwards: counted at 5.0
    assert t.rate(1, 5.0) == pytest.approx(0.2)
    assert t.rate(1, 0.0) == pytest.approx(0.2)


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        HotPrefixTracker(window_s=0.0)
    with pytest.raises(ConfigError):
        HotPrefixTracker(window_s=math.inf)
    with pytest.raises(ConfigError):
        HotPrefixTracker(max_keys=0)
    with pytest.raises(ConfigError):
        HotPrefixTracker(buckets=0)


records = st.lists(
    st.tuples(st.integers(0, 6), st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 2.5])), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(
    recs=records,
    probe=st.sampled_from([0.0, 0.3, 1.0, 4.0]),
    max_keys=st.sampled_from([1, 2, 3, 5, 100]),
)
def test_rates_match_a_brute_force_count(
    recs: list[tuple[int, float]], probe: float, max_keys: int
) -> None:
    """Invariants:

    - At most max_keys keys are ever tracked.
    - With room for every key, rate equals the weighted count of the raw request times.
    - A tracked key's rate never exceeds that count (eviction only forgets).
    """
    window, buckets = 5.0, 5
    width = window / buckets
    tracker = HotPrefixTracker(window_s=window, max_keys=max_keys, buckets=buckets)
    now, times = 0.0, []
    for key, dt in recs:
        now += dt
        tracker.record(key, now)
        times.append((key, now))
        assert len(tracker) <= max_keys
    end = now + probe
    b = math.floor(end / width)
    frac = end / width - b
    for key in range(7):
        expected = 0.0
        for k, ts in times:
            kb = math.floor(ts / width)
            if k == key and b - buckets < kb <= b:
                expected += 1.0
            elif k == key and kb == b - buckets:
                expected += 1.0 - frac
        rate = tracker.rate(key, end)
        if max_keys >= 7:
            assert rate == pytest.approx(expected / window)
        else:
            assert rate <= expected / window + 1e-9
