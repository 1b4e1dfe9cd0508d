"""The step-time model against hand-computed numbers (research/workloads.md 3.2)."""

from __future__ import annotations

import math

import pytest

from kvgate.engine import (
    DEFAULT_PROFILE,
    PROFILES,
    EngineProfile,
    get_profile,
    prefill_alone_s,
    step_time,
)


def test_registry_holds_the_research_constants_in_seconds() -> None:
    a100, h100 = PROFILES["a100-8b"], PROFILES["h100-8b"]
    assert (a100.t0_s, a100.a_s_per_token) == pytest.approx((0.011, 0.066e-3))
    assert (a100.c_s_per_pair, a100.k_s_per_ctx_token) == pytest.approx((3.4e-9, 8.7e-8))
    assert (h100.t0_s, h100.a_s_per_token) == pytest.approx((0.006, 0.022e-3))
    assert (h100.c_s_per_pair, h100.k_s_per_ctx_token) == pytest.approx((1.3e-9, 5.0e-8))
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (8192, 256)
    assert DEFAULT_PROFILE == "a100-8b"


def test_8k_prefill_a100_is_666_ms() -> None:
    # 11 ms + 8192 * 0.066 ms + 3.4e-6 ms * 8192 * 4096 pairs = 11 + 540.672 + 114.084 ms
    t = step_time(get_profile("a100-8b"), [(8192, 0)], [])
    assert t == pytest.approx(0.011 + 0.540672 + 0.11408506880, rel=1e-12)
    assert round(t, 3) == 0.666


def test_8k_prefill_h100_is_230_ms() -> None:
    t = step_time(get_profile("h100-8b"), [(8192, 0)], [])
    assert t == pytest.approx(0.006 + 0.180224 + 0.0436207616, rel=1e-12)
    assert round(t, 2) == 0.23


def test_64_by_2k_decode_step() -> None:
    ctx = [2048] * 64
    a100 = step_time(get_profile("a100-8b"), [], ctx)
    h100 = step_time(get_profile("h100-8b"), [], ctx)
    # A100: 11 + 64 * 0.066 + 8.7e-5 * 131072 = 11 + 4.224 + 11.403264 ms
    assert a100 == pytest.approx(0.026627264, rel=1e-12)
    assert round(a100, 3) == 0.027
    # H100: 6 + 64 * 0.022 + 5e-5 * 131072 = 6 + 1.408 + 6.5536 ms
    assert h100 == pytest.approx(0.0139616, rel=1e-12)


def test_mixed_step_counts_chunk_history_and_decodes() -> None:
    p = EngineProfile(
        name="unit", t0_s=1.0, a_s_per_token=0.1, c_s_per_pair=0.01, k_s_per_ctx_token=0.001
    )
    # chunk (q=4, h=6): 4 * (6 + 2) = 32 pairs; decodes ctx 10 and 20; N = 4 + 2
    assert step_time(p, [(4, 6)], [10, 20]) == pytest.approx(1.0 + 0.6 + 0.32 + 0.03)
    assert step_time(p, [], []) == 1.0


def test_cached_prefix_only_costs_attention_over_it() -> None:
    a100 = get_profile("a100-8b")
    cold = step_time(a100, [(8192, 0)], [])
    warm = step_time(a100, [(512, 7680)], [])  # 15 of 16 blocks of 512 hit
    assert warm < cold / 10


def test_unknown_profile_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown engine profile 'b200'.*a100-8b, h100-8b"):
        get_profile("b200")


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        EngineProfile(name="x", t0_s=-1, a_s_per_token=0, c_s_per_pair=0, k_s_per_ctx_token=0)
    with pytest.raises(ValueError):
        step_time(get_profile("a100-8b"), [(-1, 0)], [])


def test_prefill_alone_runs_in_budget_sized_chunks_after_the_cache() -> None:
    a100 = get_profile("a100-8b")
    # one step: the 666 ms 8K prefill
    assert prefill_alone_s(a100, 8192, 0) == pytest.approx(step_time(a100, [(8192, 0)], []))
    # 10 000 tokens, 1 000 cached: 8 192 over 1 000, then the last 808 over 9 192
    expected = step_time(a100, [(8192, 1000)], []) + step_time(a100, [(808, 9192)], [])
    assert prefill_alone_s(a100, 10_000, 1000) == pytest.approx(expected, rel=1e-12)
    # all but the last token cached: one one-token step over the rest
    assert prefill_alone_s(a100, 4096, 4095) == pytest.approx(step_time(a100, [(1, 4095)], []))


@pytest.mark.parametrize(("prompt", "cached"), [(0, 0), (100, 100), (100, -1)])
def test_prefill_alone_needs_a_token_left_to_compute(prompt: int, cached: int) -> None:
    with pytest.raises(ValueError, match="cached < prompt"):
        prefill_alone_s(get_profile("a100-8b"), prompt, cached)


@pytest.mark.parametrize("field", ["t0_s", "a_s_per_token", "c_s_per_pair", "k_s_per_ctx_token"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_cost_is_refused_by_name(field: str, value: float) -> None:
    costs = dict.fromkeys(["t0_s", "a_s_per_token", "c_s_per_pair", "k_s_per_ctx_token"], 0.0)
    costs[field] = value
    with pytest.raises(ValueError, match=rf"EngineProfile\.{field} must be a finite number"):
        EngineProfile(name="x", **costs)
