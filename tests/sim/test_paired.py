"""Paired differences over replays (kvgate.sim.paired): hand-computed intervals and
what they say about an ordering."""

from __future__ import annotations

import math

import pytest

from kvgate.sim.paired import paired_difference, t95, verdict


def test_the_interval_is_the_mean_difference_plus_or_minus_t_times_its_standard_error() -> None:
    # differences 1, 2, 3: mean 2, sample sd 1, stderr 1/sqrt(3), t(2 df) = 4.303
    d = paired_difference([1.5, 2.0, 4.0], [0.5, 0.0, 1.0])
    assert d is not None
    half = 4.303 / math.sqrt(3)
    assert d["n"] == 3
    assert d["mean"] == pytest.approx(2.0)
    assert d["stderr"] == pytest.approx(1 / math.sqrt(3), abs=1e-6)
    assert d["ci95"] == pytest.approx([2.0 - half, 2.0 + half], abs=1e-6)


def test_the_sign_is_ours_less_theirs() -> None:
    d = paired_difference([1.0, 1.1], [2.0, 2.3])
    assert d is not None and d["mean"] == pytest.approx(-1.1)


def test_identical_runs_are_a_tie_within_noise() -> None:
    d = paired_difference([0.3, 0.4, 0.5], [0.3, 0.4, 0.5])
    assert d is not None and d["ci95"] == [0.0, 0.0]
    assert verdict(d, higher_is_better=True) == "within noise"
    assert verdict(d, higher_is_better=False) == "within noise"


def test_a_verdict_needs_the_whole_interval_on_one_side() -> None:
    lower = {"ci95": [-0.3, -0.1]}
    higher = {"ci95": [0.1, 0.3]}
    across = {"ci95": [-0.1, 0.3]}
    assert verdict(lower, higher_is_better=False) == "better"  # a latency went down
    assert verdict(lower, higher_is_better=True) == "worse"  # a goodput went down
    assert verdict(higher, higher_is_better=False) == "worse"
    assert verdict(higher, higher_is_better=True) == "better"
    assert verdict(across, higher_is_better=True) == "within noise"


def test_a_consistent_small_margin_is_more_than_noise_and_a_noisy_large_one_is_not() -> None:
    steady = paired_difference([1.01, 1.02, 1.01, 1.02], [1.0, 1.0, 1.0, 1.0])
    noisy = paired_difference([1.9, 0.6, 2.3, 0.6], [1.0, 1.0, 1.0, 1.0])
    assert steady is not None and noisy is not None
    assert noisy["mean"] > steady["mean"]
    assert verdict(steady, higher_is_better=True) == "better"
    assert verdict(noisy, higher_is_better=True) == "within noise"


def test_nothing_to_pair() -> None:
    assert paired_difference([1.0], [2.0]) is None  # one replay has no spread
    assert paired_difference([1.0, None], [2.0, 2.0]) is None  # a run measured nothing
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0])


def test_t_quantiles() -> None:
    assert t95(1) == 12.706 and t95(7) == 2.365 and t95(30) == 2.042
    # past the table: close to the exact values (60 df: 2.000, 120 df: 1.980)
    assert t95(60) == pytest.approx(2.000, abs=0.002)
    assert t95(120) == pytest.approx(1.980, abs=0.002)
    with pytest.raises(ValueError):
        t95(0)
