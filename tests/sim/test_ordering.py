"""The quality-bar check over a comparison report (kvgate.sim.ordering)."""

from __future__ import annotations

from typing import Any

from kvgate.sim.ordering import format_ordering, format_tally, ordering, tally


def _row(
    p99: float, mean: float, goodput: float, hit: float, load: float | None = 1.1
) -> dict[str, Any]:
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


def test_a_run_with_no_load_fails_the_load_check() -> None:
    """A run where no node processed a token (everything refused) has no balance: its
    load is None, and the check fails instead of passing at a perfect 0."""
    rep = _report(kvgate=_row(1.0, 0.5, 3.0, 0.18, load=None), preble_e2=_row(2, 0.6, 2.5, 0.17))
    result = ordering(rep)
    assert result is not None and not result["holds"]
    assert not result["checks"]["load_max_over_mean"]["ok"]
    assert "no token processed" in format_ordering(result)


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


def _misses(ttft: int = 0, tpot: int = 0) -> dict[str, int]:
    return {"ttft": ttft, "tpot": tpot, "both": 0, "not_completed": 0}


def test_a_lost_goodput_says_whether_misses_or_the_span_made_it() -> None:
    ours = _row(1.0, 0.5, 8.68, 0.18) | {"slo_misses": _misses(tpot=124), "span_s": 137.17}
    theirs = _row(2.0, 0.6, 9.45, 0.17) | {"slo_misses": _misses(ttft=2, tpot=17), "span_s": 137.17}
    result = ordering(_report(kvgate=ours, dynamo_cost=theirs))
    assert result is not None
    check = result["checks"]["goodput_rps"]
    assert not check["ok"] and check["misses"]["tpot"] == 124
    assert check["other_misses"] == _misses(ttft=2, tpot=17)
    text = format_ordering(result)
    assert "SLO misses: kvgate 124 (tpot 124); dynamo_cost 19 (ttft 2, tpot 17)" in text
    assert "the span alone" not in text

    # nobody missed anything: the last request's end decided it
    ours = _row(1.0, 0.5, 35.0, 0.18) | {"slo_misses": _misses(), "span_s": 29.24}
    theirs = _row(2.0, 0.6, 35.6, 0.17) | {"slo_misses": _misses(), "span_s": 28.74}
    result = ordering(_report(kvgate=ours, dynamo_cost=theirs))
    assert result is not None
    text = format_ordering(result)
    assert "SLO misses: kvgate 0; dynamo_cost 0; span 29.24 s against 28.74 s" in text
    assert "(as many misses: the span alone differs)" in text

    # as many misses over the same span: a tie, which is not beating
    tied = ordering(_report(kvgate=ours, dynamo_cost=ours | {"ttft_p99_s": 2.0}))
    assert tied is not None and not tied["checks"]["goodput_rps"]["ok"]
    assert "span 29.24 s against 29.24 s (a tie)" in format_ordering(tied)

    # a won goodput, or rows without the parts (an older report), add no line
    won = ordering(_report(kvgate=ours | {"goodput_rps": 36.0}, dynamo_cost=theirs))
    assert won is not None and "SLO misses" not in format_ordering(won)
    bare = ordering(_report(kvgate=_row(1.0, 0.5, 3.0, 0.18), dynamo_cost=_row(2, 0.6, 3.1, 0.1)))
    assert bare is not None and "misses" not in bare["checks"]["goodput_rps"]
    assert "SLO misses" not in format_ordering(bare)


def test_a_latency_with_nothing_behind_it_ranks_last() -> None:
    """A policy that completed nothing has no TTFT (None): it neither beats the others
    nor is beaten by... being perfect."""
    shed = _row(0.0, 0.0, 0.0, 0.0) | {"ttft_p99_s": None, "ttft_mean_s": None}
    ours = _row(2.0, 1.0, 3.0, 0.5)
    result = ordering(_report(kvgate=ours, round_robin=shed))
    assert result is not None
    p99 = result["checks"]["ttft_p99_s"]
    assert p99["ok"] and p99["other"] is None
    # and the policy under test with nothing measured fails, against a real number
    result = ordering(_report(kvgate=shed, round_robin=ours))
    assert result is not None and not result["checks"]["ttft_p99_s"]["ok"]
    text = format_ordering(result)
    assert "FAIL ttft_p99_s                none  does not beat 2.000" in text


def test_a_hit_ratio_with_nothing_behind_it_holds_no_check() -> None:
    """A policy that completed no request has no hit ratio (null): it used to read 0.0
    and pass ">= 0.0000 (80 % of the pooled-LRU bound)" on a trace whose bound is 0."""
    shed = _row(1.0, 0.5, 3.0, 0.0) | {"hit_ratio": None}
    ours = _row(1.0, 0.5, 3.0, 0.18)
    rep = {"policies": {"kvgate": shed, "sglang_cache_aware": ours}}
    result = ordering(rep | {"bounds": {"pooled_lru_hit_ratio": 0.0}})
    assert result is not None
    assert not result["checks"]["hit_ratio"]["ok"]
    assert not result["checks"]["hit_ratio_vs_pooled_lru"]["ok"]
    text = format_ordering(result)
    assert "FAIL hit_ratio                 none  < 0.1800 (the best cache-aware baseline" in text
    # a rival with nothing measured ranks last: any measured hit ratio beats it
    won = ordering(_report(kvgate=ours, sglang_cache_aware=shed, preble_e2=shed))
    assert won is not None and won["checks"]["hit_ratio"]["ok"]
    assert "(the best cache-aware baseline, sglang_cache_aware)" in format_ordering(won)
    assert ">= none" in format_ordering(won)


def _parts(prefill: float, wait: float, over: int = 0, cached: float = 0.0, n: int = 121,
           queued: float | None = None):  # fmt: skip
    """One group of ``ttft_parts``; with ``queued``, the wait's split (slowed: the rest)."""
    parts = {"requests": n, "ttft_mean_s": prefill + wait, "prefill_mean_s": prefill,
             "wait_mean_s": wait, "waited_over_5s": over, "cached_share": cached}  # fmt: skip
    if queued is not None:
        parts |= {"queued_mean_s": queued, "slowed_mean_s": round(wait - queued, 4)}
    return parts


def test_a_lost_ttft_says_whether_own_prefill_or_waiting_made_it() -> None:
    """The canonical run's lost TTFT p99: the slowest 1 % had as much prefill of their
    own either way, and kvgate's waited longer."""
    ours = _row(17.055, 1.5, 3.0, 0.18) | {
        "ttft_parts": {"slowest_1pct": _parts(24.965, 0.829, 3, 0.018, queued=0.524),
                       "all": _parts(1.264, 0.188, 94, 0.177, n=12031, queued=0.131)}
    }  # fmt: skip
    theirs = _row(16.903, 1.473, 2.5, 0.10) | {
        "ttft_parts": {"slowest_1pct": _parts(25.014, 0.119, 0, 0.007, queued=0.061),
                       "all": _parts(1.351, 0.123, 8, 0.105, n=12031, queued=0.069)}
    }  # fmt: skip
    result = ordering(_report(kvgate=ours, dynamo_cost=theirs))
    assert result is not None
    p99, mean = result["checks"]["ttft_p99_s"], result["checks"]["ttft_mean_s"]
    assert not p99["ok"] and p99["parts"]["wait_mean_s"] == 0.829
    assert p99["other_parts"]["prefill_mean_s"] == 25.014
    assert not mean["ok"] and mean["parts"]["requests"] == 12031  # the mean reads "all"
    text = format_ordering(result)
    assert "the slowest 1 % (121 requests), own prefill alone + wait on top of it:" in text
    assert ("kvgate               24.965 s + 0.829 s (0.524 s queued, 0.305 s slowed; 3 waited"
            " over 5 s; 1.8% of prompt") in text  # fmt: skip
    assert ("dynamo_cost          25.014 s + 0.119 s (0.061 s queued, 0.058 s slowed; 0 waited"
            " over 5 s; 0.7% of prompt") in text  # fmt: skip
    assert "all requests, own prefill alone + wait on top of it:" in text
    assert ("1.264 s + 0.188 s (0.131 s queued, 0.057 s slowed; 94 waited over 5 s; 17.7% of"
            " prompt tokens cached)") in text  # fmt: skip
    # parts of an earlier build, without the split: the line says what it has
    old = ours | {"ttft_parts": {"slowest_1pct": _parts(24.965, 0.829, 3, 0.018),
                                 "all": _parts(1.264, 0.188, 94, 0.177, n=12031)}}  # fmt: skip
    old_result = ordering(_report(kvgate=old, dynamo_cost=theirs))
    assert old_result is not None
    old_text = format_ordering(old_result)
    assert "kvgate               24.965 s + 0.829 s (3 waited over 5 s; 1.8% of prompt" in old_text

    # a won check, or rows without the parts (an older report), add no lines
    won = ordering(_report(kvgate=ours | {"ttft_p99_s": 16.0, "ttft_mean_s": 1.0},
                           dynamo_cost=theirs))  # fmt: skip
    assert won is not None and "own prefill" not in format_ordering(won)
    bare = ordering(_report(kvgate=_row(17.1, 1.5, 3.0, 0.18), dynamo_cost=_row(16.9, 1.4, 2, 0.1)))
    assert bare is not None and "parts" not in bare["checks"]["ttft_p99_s"]
    assert "own prefill" not in format_ordering(bare)
