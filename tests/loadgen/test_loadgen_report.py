"""Metrics arithmetic on hand-built timings, goodput, the table and the JSON keys."""

from __future__ import annotations

import json

import pytest

from kvgate.loadgen.report import (
    RequestResult,
    Stats,
    build_report,
    meets_slos,
    parse_goodput,
    peak_concurrency,
)


def _ok(rid: str, start: float, ttft: float, e2e: float, out: int, prompt: int,
        cached: int | None) -> RequestResult:
    itl = [(e2e - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return RequestResult(request_id=rid, success=True, status=200, start_s=start,
                         end_s=start + e2e, prompt_tokens=prompt, prompt_tokens_reported=True,
                         output_tokens=out, cached_tokens=cached, ttft_s=ttft, e2e_s=e2e,
                         itl_s=itl)


def _fail(rid: str, status: int, error: str = "http") -> RequestResult:
    return RequestResult(request_id=rid, success=False, status=status, error=error,
                         start_s=0.0, end_s=0.1, prompt_tokens=100)


RESULTS = [
    _ok("a", 0.0, 0.1, 0.5, 5, 100, 50),    # tpot 0.1, 4 ITLs of 0.1
    _ok("b", 0.2, 0.3, 1.3, 11, 200, 0),    # tpot 0.1, 10 ITLs of 0.1
    _ok("c", 0.4, 0.2, 0.2, 1, 100, None),  # single token: no TPOT, no ITL
    _fail("d", 503),
    _fail("e", 400),
    _fail("f", 503),
    _fail("g", 0, "cancelled"),
]


def test_a_server_that_never_states_cached_tokens_has_no_hit_ratio() -> None:
    """Without --enable-prompt-tokens-details no usage has the details: no ratio, where
    counting those usages as misses would read 0."""
    rep = build_report([_ok("a", 0.0, 0.1, 0.5, 5, 100, None),
                        _ok("b", 0.2, 0.3, 1.3, 11, 200, None)], duration_s=2.0)
    assert rep.cache_hit_ratio is None and rep.cached_tokens_reported == 0
    # a usage without prompt tokens (no usage at all) is never counted
    none = _ok("c", 0.4, 0.2, 0.2, 1, 100, None)
    none.prompt_tokens_reported = False
    rep = build_report([_ok("a", 0.0, 0.1, 0.5, 5, 100, 40), none], duration_s=2.0)
    assert rep.cached_tokens_reported == 1 and rep.cache_hit_ratio == pytest.approx(0.4)


def test_request_tpot() -> None:
    assert RESULTS[0].tpot_s == pytest.approx(0.1)
    assert RESULTS[2].tpot_s is None


def test_stats_match_numpy_conventions() -> None:
    s = Stats.of([0.001, 0.002, 0.003, 0.004])
    assert s.count == 4
    assert s.mean == pytest.approx(2.5) and s.median == pytest.approx(2.5)
    assert s.std == pytest.approx(1.118033988749895)  # population std
    assert s.p90 == pytest.approx(3.7) and s.p99 == pytest.approx(3.97)
    assert Stats.of([]) == Stats(0, None, None, None, None, None)


def test_aggregates_on_hand_built_timings() -> None:
    rep = build_report(RESULTS, duration_s=2.0, goodput_slos_ms={"ttft": 250, "tpot": 150})
    assert (rep.sent, rep.completed, rep.failed, rep.incomplete) == (7, 3, 3, 1)
    assert rep.failed_by_status == {"400": 1, "503": 2}
    assert rep.errors_by_type == {"http": 3}
    assert rep.total_input_tokens == 400 and rep.total_output_tokens == 17
    assert rep.request_throughput == pytest.approx(1.5)
    assert rep.output_throughput == pytest.approx(8.5)
    assert rep.total_token_throughput == pytest.approx(208.5)
    # cached over the requests with a usage: "c" states no cached tokens, as vLLM and
    # SGLang answer a miss (no prompt_tokens_details), so 50 / (100 + 200 + 100); two
    # answers stated cached tokens
    assert rep.total_cached_tokens == 50 and rep.cached_tokens_reported == 2
    assert rep.cache_hit_ratio == pytest.approx(50 / 400)
    ttft = rep.metrics["ttft"]
    assert ttft.mean == pytest.approx(200.0) and ttft.median == pytest.approx(200.0)
    assert ttft.p90 == pytest.approx(280.0) and ttft.p99 == pytest.approx(298.0)
    assert rep.metrics["tpot"].count == 2 and rep.metrics["tpot"].mean == pytest.approx(100.0)
    assert rep.metrics["itl"].count == 14 and rep.metrics["itl"].p99 == pytest.approx(100.0)
    e2el = rep.metrics["e2el"]
    assert e2el.mean == pytest.approx(2000 / 3) and e2el.median == pytest.approx(500.0)
    # goodput: a (ttft 100) and c (ttft 200, one token) meet both SLOs; b's TTFT is 300
    assert rep.good_requests == 2
    assert rep.request_goodput == pytest.approx(1.0)
    assert rep.goodput_ratio == pytest.approx(2 / 7)
    assert rep.peak_concurrency == peak_concurrency(RESULTS)


def test_goodput_edge_cases() -> None:
    slow_tpot = _ok("x", 0.0, 0.1, 2.1, 3, 10, None)  # tpot 1 s
    assert not meets_slos(slow_tpot, {"tpot": 500})
    assert meets_slos(slow_tpot, {"ttft": 500, "e2el": 2200})
    assert not meets_slos(slow_tpot, {"e2el": 2000})
    no_ttft = RequestResult(request_id="n", success=True, status=200, output_tokens=3,
                            e2e_s=0.1)
    assert not meets_slos(no_ttft, {"ttft": 1000})
    assert not meets_slos(_fail("f", 503), {})
    rep = build_report(RESULTS, duration_s=2.0)
    assert rep.good_requests is None and rep.request_goodput is None


def test_peak_concurrency() -> None:
    rs = [RequestResult(request_id=str(i), success=True, status=200, start_s=s, end_s=e)
          for i, (s, e) in enumerate([(0, 1), (0.5, 2), (0.9, 1.0), (1.0, 3), (2, 4)])]
    assert peak_concurrency(rs) == 3


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


AGGREGATE_KEYS = {
    "settings", "sent", "completed", "failed", "incomplete", "failed_by_status",
    "errors_by_type", "duration", "total_input_tokens", "total_output_tokens",
    "total_cached_tokens", "cached_tokens_reported", "cache_hit_ratio",
    "request_throughput", "output_throughput", "total_token_throughput",
    "peak_concurrency", "goodput_slos_ms", "good_requests", "request_goodput",
    "goodput_ratio",
} | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
     for m in ("ttft", "tpot", "itl", "e2el")}
DETAIL_KEYS = {"request_ids", "start_times", "successes", "statuses", "errors", "input_lens",
               "output_lens", "cached_tokens", "ttfts", "tpots", "e2els", "itls"}


def test_json_keys_are_stable() -> None:
    rep = build_report(RESULTS, duration_s=2.0, goodput_slos_ms={"ttft": 250},
                       settings={"model": "m"})
    d = json.loads(json.dumps(rep.to_dict()))
    assert set(d) == AGGREGATE_KEYS
    assert d["settings"] == {"model": "m"} and d["failed_by_status"]["503"] == 2
    full = json.loads(json.dumps(rep.to_dict(detailed=True)))
    assert set(full) == AGGREGATE_KEYS | DETAIL_KEYS
    assert all(len(full[k]) == 7 for k in DETAIL_KEYS)
    assert full["itls"][0] == pytest.approx([0.1] * 4)
    empty = build_report([], duration_s=0.0).to_dict()
    assert set(empty) == AGGREGATE_KEYS and empty["mean_ttft_ms"] is None


def test_table_is_aligned() -> None:
    table = build_report(RESULTS, duration_s=2.0, goodput_slos_ms={"ttft": 250}).format_table()
    lines = table.splitlines()
    assert "Serving Benchmark Result" in lines[0]
    for label, value in [("Successful requests:", "3"), ("  status 503:", "2"),
                         ("Request goodput (req/s):", "1.00"),
                         ("Mean TTFT (ms):", "200.00"), ("Cache hit ratio (%):", "12.50")]:
        assert f"{label:<40}{value}" in lines
    assert any(line.startswith("P99 ITL (ms):") for line in lines)
    assert all(len(line) <= 50 for line in lines)
    # what the first failed request of a status was told, under its count
    status_row = lines.index(f"{'  status 503:':<40}2")
    assert lines[status_row + 1].startswith("    first: ")


def test_table_shows_the_first_failure_of_each_kind_under_a_status() -> None:
    """Status 0 holds connection failures and timeouts: the first of one kind hid the
    other (a timeout read as a connection failure)."""
    conn = RequestResult(request_id="c", success=False, status=0, error="connection",
                         error_detail="ClientConnectorError: refused")
    late = RequestResult(request_id="t", success=False, status=0, error="timeout",
                         error_detail="timeout after HTTP 200 headers: TimeoutError()")
    rep = build_report([conn, late, conn], duration_s=1.0)
    assert rep.failed_by_status == {"0": 3}
    assert rep.errors_by_type == {"connection": 2, "timeout": 1}
    lines = rep.format_table().splitlines()
    row = lines.index(f"{'  status 0:':<40}3")
    assert lines[row + 1: row + 3] == [
        "    first: ClientConnectorError: refused",
        "    first: timeout after HTTP 200 headers:",
    ]
    assert lines[row + 3] == "    TimeoutError()"


def test_cached_tokens_reported_counts_the_answers_that_stated_them() -> None:
    """It counted every answer in the hit ratio, the misses whose usage left the
    details out included, where its documentation says the answers that had them."""
    rep = build_report([_ok("a", 0.0, 0.1, 0.5, 5, 100, 40), _ok("b", 0.0, 0.1, 0.5, 5, 100, None),
                        _ok("c", 0.0, 0.1, 0.5, 5, 100, None)], duration_s=1.0)
    assert rep.cached_tokens_reported == 1
    assert rep.cache_hit_ratio == pytest.approx(40 / 300)  # b and c are misses
