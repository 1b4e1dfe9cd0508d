"""The quality-bar check over a comparison report (kvgate.sim.ordering)."""

from __future__ import annotations

from typing import Any

from kvgate.sim.ordering import format_ordering, format_tally, ordering, tally


def _row(p99: float, mean: float, goodput: float, hit: float, load: float = 1.1) -> dict[str, Any]:
    return {
        "ttft_p99_s": p99,
        "ttft_mean_s": mean,
        "goodput_rps": goodput,
        "hit_ratio": hit,
        "load_max_over_mean": load,
    }


def _report(**rows: dict[str, Any]) -> dict[str, Any]:
    return {"policies": rows, "bounds": {"pooled_lru_hit_ratio": 0.2}}


def test_holds_when_every_check_passes() -> None:
    rep = _report(
        kvgate=_row(1.0, 0.5, 3.0, 0.18),
        sglang_cache_aware=_row(2.0, 0.6, 2.5, 0.18),  # a tie on hits is enough
        round_robin=_row(1.5, 0.7, 2.9, 0.05),
    )
    result = ordering(rep)
    assert result is not None and result["holds"]
    assert result["checks"]["ttft_p99_s"]["against"] == "round_robin"
    assert result["checks"]["goodput_rps"]["against"] == "round_robin"
    assert result["checks"]["hit_ratio"]["against"] == "sglang_cache_aware"
    assert result["checks"]["hit_ratio_vs_pooled_lru"]["floor"] == 0.16
    assert format_ordering(result).splitlines()[0].endswith("holds")


def test_each_failure_names_where_a_baseline_wins() -> None:
    rep = _report(
        kvgate=_row(1.0, 0.5, 3.0, 0.15, load=1.6),
        dynamo_cost=_row(0.9, 0.5, 3.1, 0.10),  # better tail and goodput, tied mean
        preble_e2=_row(3.0, 0.9, 2.0, 0.17),  # the best cache-aware hit ratio
        least_loaded=_row(2.0, 0.8, 2.0, 0.40),  # not cache-aware: its hits do not count
    )
    result = ordering(rep)
    assert result is not None and not result["holds"]
    failed = {k: c.get("against") for k, c in result["checks"].items() if not c["ok"]}
    assert failed == {
        "ttft_p99_s": "dynamo_cost",
        "ttft_mean_s": "dynamo_cost",  # equal is not beating
        "goodput_rps": "dynamo_cost",
        "load_max_over_mean": None,
        "hit_ratio": "preble_e2",
        "hit_ratio_vs_pooled_lru": None,
    }
    text = format_ordering(result)
    assert "FAIL goodput_rps" in text and "does not beat 3.100" in text
    assert "< 0.1700 (the best cache-aware baseline, preble_e2)" in text


def test_nothing_to_compare() -> None:
    assert ordering(_report(kvgate=_row(1, 1, 1, 0.1))) is None
    assert ordering(_report(round_robin=_row(1, 1, 1, 0.1), random=_row(1, 1, 1, 0.1))) is None


def test_tally_counts_the_runs_each_check_held() -> None:
    good = _report(kvgate=_row(1.0, 0.5, 3.0, 0.18), preble_e2=_row(2.0, 0.6, 2.5, 0.17))
    bad_hit = _report(kvgate=_row(1.0, 0.5, 3.0, 0.16), preble_e2=_row(2.0, 0.6, 2.5, 0.17))
    results = [ordering(good), ordering(bad_hit), ordering(good)]
    summary = tally([r for r in results if r is not None])
    assert summary["runs"] == 3 and summary["all"] == 2
    assert summary["held"]["hit_ratio"] == 2 and summary["held"]["ttft_p99_s"] == 3
    assert "hit_ratio 2/3" in format_tally(summary)
