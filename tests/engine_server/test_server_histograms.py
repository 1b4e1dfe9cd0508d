"""vLLM's request histograms in ``kvgate engine`` (kvgate.engine.server_histograms)."""

from __future__ import annotations

from kvgate.engine.server_histograms import Histogram, RequestTimer, buckets_1_2_5


def test_buckets_are_vllms_1_2_5_series() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(4096)[-3:] == (500, 1000, 2000)


def test_a_value_on_a_bound_counts_in_that_bucket_and_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.samples() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert h.n == 4 and round(h.total, 9) == 4.6


def test_timer_observes_finished_requests_in_wall_seconds_and_forgets_the_rest() -> None:
    timer = RequestTimer(4096, lambda dt: dt / 10)  # an engine at speed-up 10
    timer.arrived("a", 0.0, max_tokens=16)
    timer.tokens("a", 2.0)  # first token: 0.2 s of wall time
    timer.tokens("a", 3.0)
    timer.tokens("a", 5.0)
    timer.finished("a", 5.0, prompt_tokens=120, output_tokens=3, scheduled_at=0.5)
    timer.arrived("b", 1.0, max_tokens=64)
    timer.tokens("b", 4.0)
    timer.forget("b")  # aborted: vLLM observes finished requests only
    timer.finished("b", 6.0, prompt_tokens=1, output_tokens=1)  # too late: ignored
    assert (timer.ttft.n, round(timer.ttft.total, 9)) == (2, 0.5)
    assert [round(x, 9) for x in (timer.itl.total, timer.e2e.total, timer.decode.total)] == [
        0.3, 0.5, 0.3]
    assert (timer.itl.n, timer.e2e.n, timer.prompt_tokens.total) == (2, 1, 120)
    # scheduled at 0.5: 0.05 s queued, then 0.15 s of prefill, 0.45 s running
    assert [round(h.total, 9) for h in (timer.queue, timer.prefill, timer.inference)] == [
        0.05, 0.15, 0.45]
    # the request's parameters, as finished: max_tokens 16, n 1, 3 tokens generated
    assert [(h.n, h.total) for h in (timer.params_max_tokens, timer.params_n,
                                     timer.max_generation_tokens)] == [(1, 16), (1, 1), (1, 3)]
    timer.step(8192 + 3)  # a step's prefill chunk and three decodes
    timer.step(0)  # only timers fired: no step for vLLM
    assert timer.iteration_tokens.samples()[-3:] == [("8192.0", 0), ("16384.0", 1), ("+Inf", 1)]
    assert len(timer) == 0
    lines: list[str] = []
    timer.render('model_name="m"', lines.append)
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.25"} 1.0' in lines
    assert 'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0' in lines
    assert 'vllm:request_params_max_tokens_sum{model_name="m"} 16.0' in lines
    assert 'vllm:iteration_tokens_total_bucket{model_name="m",le="16384.0"} 1.0' in lines


def test_bounds_are_written_as_prometheus_client_writes_them() -> None:
    """Past six integer digits prometheus_client (vLLM's exporter) writes 1e+06: a
    max_model_len of a million gave le="1000000.0", a series vLLM's never matches."""
    h = Histogram((0.005, 1, 2560, 999_999, 1_000_000, 1_500_000, 25_000_000))
    les = [le for le, _ in h.samples()]
    assert les == ["0.005", "1.0", "2560.0", "999999.0", "1e+06", "1.5e+06", "2.5e+07",
                   "+Inf"]
