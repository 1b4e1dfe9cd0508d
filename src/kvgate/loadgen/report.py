"""Per-request results and the aggregate report of a load run (no I/O, no clock).

Definitions (``vllm bench serve``, research/workloads.md section 4):

* TTFT: send to the first chunk with choices (as vLLM's bench: its text may be empty,
  a special token's). ITL: the gaps between such chunks of one request (pooled over
  all requests for the statistics). TPOT:
  ``(E2E - TTFT) / (output_tokens - 1)`` per request with more than one output token.
  E2EL: send to the last data chunk received, as vLLM's bench (the last chunk with
  choices, so E2EL - TTFT is the sum of the ITL gaps; not the usage chunk, ``[DONE]``
  or the end of the body); without streaming, to the whole body read.
* Throughputs count successful requests only and divide by the benchmark duration.
* Goodput: successful requests that meet every SLO, per second of duration. Failed
  and incomplete requests never count as good, so ``goodput_ratio`` is good / sent.
  A TPOT SLO is met by a request with one output token (TPOT taken as 0, as vLLM does);
  a TTFT SLO is never met without a measured TTFT (``--no-stream``).
* Cache hit ratio: ``usage.prompt_tokens_details.cached_tokens`` summed over the
  successful requests that report it, divided by the prompt tokens of the requests it
  covers. vLLM and SGLang leave the details out when nothing was cached: once any
  answer of the run states cached tokens, an answer with a usage but without them is
  covered too, as 0 cached (a miss). So the ratio covers more requests than
  ``cached_tokens_reported`` counts (those whose usage stated cached tokens).

JSON keys (:meth:`LoadReport.to_dict`, ``kvgate bench --json``); times in seconds unless
the key ends in ``_ms``; absent values are ``null``:

* ``settings``: the run's settings (``base_url``, ``endpoint``, ``model``, ``stream``,
  ``workload``, ``workload_requests``, ``closed_loop``, ``block_tokens``, ``schedule``, ``rate`` (a
  number or ``"inf"``), ``burstiness`` (the gamma shape of the gaps, 1 = Poisson),
  ``concurrency``, ``speedup``, ``num_requests``,
  ``max_seconds``, ``seed``, ``chars_per_token``, ``max_prompt_tokens``,
  ``output_tokens_cap``, ``ignore_eos``, ``temperature``; from ``kvgate bench``, also
  ``trace``, ``limit`` and ``bucket`` (``"spread"`` or ``"burst"``, how requests sharing
  a timestamp were placed; null under ``schedule`` ``"rate"``) for a trace,
  ``workload_size`` and ``arrival_rate`` for a synthetic workload).
* Counts: ``sent``, ``completed``, ``failed``, ``incomplete`` (cancelled at the time
  bound), ``failed_by_status`` (HTTP status as a string -> count; ``"0"`` = no
  complete response: a connection failure, a timeout or a stream cut short before
  ``[DONE]``, even after the headers),
  ``errors_by_type`` (``RequestResult.error`` -> count, failed only). Both sum to
  ``failed``.
* ``duration``; tokens of successful requests: ``total_input_tokens``,
  ``total_output_tokens``, ``total_cached_tokens``, ``cached_tokens_reported``
  (successful requests whose usage stated ``prompt_tokens_details.cached_tokens``),
  ``cache_hit_ratio`` (0..1, null until an answer states cached tokens; see above for
  the requests it covers).
* Throughput: ``request_throughput`` (req/s), ``output_throughput`` and
  ``total_token_throughput`` (tok/s), ``peak_concurrency``.
* Goodput: ``goodput_slos_ms`` (name -> ms), ``good_requests``, ``request_goodput``
  (req/s), ``goodput_ratio`` (good / sent); the last three are null without SLOs.
* Latency: ``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms``.
* With ``detailed``, per-request arrays in send order: ``request_ids``,
  ``start_times``, ``successes``, ``statuses``, ``errors`` (detail text, "" if ok),
  ``input_lens``, ``output_lens``, ``cached_tokens``, ``ttfts``, ``tpots``, ``e2els``,
  ``itls`` (a list per request).
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvgate.sim.workload import percentile

METRICS = ("ttft", "tpot", "itl", "e2el")
"""Latency metrics, in report order."""

SLO_METRICS = ("ttft", "tpot", "e2el")
"""Metrics an SLO may name (``--goodput ttft:MS tpot:MS e2el:MS``)."""

STAT_NAMES = ("mean", "median", "std", "p90", "p99")

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(slots=True, kw_only=True)
class RequestResult:
    """What one request did. Times are seconds; ``start_s``/``end_s`` are relative to
    the start of the benchmark.

    ``status`` is the HTTP status, 0 when no complete response arrived (a connection
    failure, a timeout or a truncated stream, even after the headers came). ``error``
    is ``""`` on success, else one of ``http``, ``connection``, ``timeout``,
    ``truncated`` (the stream's body ended before ``data: [DONE]``), ``stream_error``,
    ``bad_response``, ``empty_output``, ``internal`` (a loadgen bug) or ``cancelled``
    (still running at the time bound; such requests are *incomplete*, not failed).
    """

    request_id: str
    success: bool
    status: int
    error: str = ""
    error_detail: str = ""
    start_s: float = 0.0
    end_s: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_reported: bool = False
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """``(E2E - TTFT) / (output - 1)``; None without both times or with < 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of one latency metric in milliseconds (all None without samples)."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of(samples_s: Sequence[float]) -> Stats:
        if not samples_s:
            return Stats(0, None, None, None, None, None)
        ms = sorted(x * 1000.0 for x in samples_s)
        n = len(ms)
        mean = math.fsum(ms) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in ms) / n)
        return Stats(n, mean, percentile(ms, 50), std, percentile(ms, 90), percentile(ms, 99))


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"bad SLO {item!r}: the bound must be a positive number of ms")
        out[name] = ms
    return out


def meets_slos(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """True when a successful request meets every SLO (see the module docstring)."""
    if not r.success:
        return False
    for name, bound_ms in slos_ms.items():
        if name == "ttft":
            value = r.ttft_s
        elif name == "tpot":
            value = r.tpot_s if r.output_tokens >= 2 else 0.0
        else:
            value = r.e2e_s
        if value is None or value * 1000.0 > bound_ms:
            return False
    return True


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (interval ends before starts at equal times)."""
    events = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results])
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


@dataclass(slots=True, kw_only=True)
class LoadReport:
    """Aggregates of a run; :meth:`to_dict` gives the stable JSON keys of ``--json``."""

    settings: dict[str, object]
    sent: int
    completed: int
    failed: int
    incomplete: int
    failed_by_status: dict[str, int]
    errors_by_type: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    cached_tokens_reported: int
    cache_hit_ratio: float | None
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    goodput_slos_ms: dict[str, float]
    good_requests: int | None
    request_goodput: float | None
    goodput_ratio: float | None
    metrics: dict[str, Stats]
    results: list[RequestResult]

    def to_dict(self, *, detailed: bool = False) -> dict[str, object]:
        d: dict[str, object] = {
            "settings": dict(self.settings),
            "sent": self.sent,
            "completed": self.completed,
            "failed": self.failed,
            "incomplete": self.incomplete,
            "failed_by_status": dict(self.failed_by_status),
            "errors_by_type": dict(self.errors_by_type),
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "total_cached_tokens": self.total_cached_tokens,
            "cached_tokens_reported": self.cached_tokens_reported,
            "cache_hit_ratio": self.cache_hit_ratio,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "peak_concurrency": self.peak_concurrency,
            "goodput_slos_ms": dict(self.goodput_slos_ms),
            "good_requests": self.good_requests,
            "request_goodput": self.request_goodput,
            "goodput_ratio": self.goodput_ratio,
        }
        for m in METRICS:
            s = self.metrics[m]
            for stat in STAT_NAMES:
                d[f"{stat}_{m}_ms"] = getattr(s, stat)
        if detailed:
            rs = self.results
            d["request_ids"] = [r.request_id for r in rs]
            d["start_times"] = [r.start_s for r in rs]
            d["successes"] = [r.success for r in rs]
            d["statuses"] = [r.status for r in rs]
            d["errors"] = [r.error_detail or r.error for r in rs]
            d["input_lens"] = [r.prompt_tokens for r in rs]
            d["output_lens"] = [r.output_tokens for r in rs]
            d["cached_tokens"] = [r.cached_tokens for r in rs]
            d["ttfts"] = [r.ttft_s for r in rs]
            d["tpots"] = [r.tpot_s for r in rs]
            d["e2els"] = [r.e2e_s for r in rs]
            d["itls"] = [list(r.itl_s) for r in rs]
        return d

    def _first_failures(self, status: str) -> list[str]:
        """The error detail of the first failed request with ``status``, one per error
        type (status 0 holds connection failures and timeouts: the first of one kind
        hid the other)."""
        firsts: dict[str, str] = {}
        for r in self.results:
            if not r.success and r.error != "cancelled" and str(r.status) == status:
                detail = " ".join((r.error_detail or r.error or "").split())
                if detail:
                    firsts.setdefault(r.error, detail)
        return list(firsts.values())

    def format_table(self) -> str:
        """A console table shaped like ``vllm bench serve``'s."""
        w = 50
        lines = [" Serving Benchmark Result ".center(w, "=")]

        def row(label: str, value: object) -> None:
            if value is None:
                text = "n/a"
            elif isinstance(value, float):
                text = f"{value:.2f}"
            else:
                text = str(value)
            lines.append(f"{label:<40}{text}")

        row("Successful requests:", self.completed)
        row("Failed requests:", self.failed)
        for status, n in sorted(self.failed_by_status.items()):
            row(f"  status {status}:", n)
            # what the first of them was told: a count alone hid a 400 for every request
            for first in self._first_failures(status):
                text = textwrap.wrap(f"first: {first}", w - 4, max_lines=4, placeholder=" ...")
                lines.extend(f"    {part}" for part in text)
        if self.incomplete:
            row("Incomplete requests (time bound):", self.incomplete)
        planned = self.settings.get("num_requests")
        available = self.settings.get("workload_requests")
        if isinstance(planned, int) and isinstance(available, int):
            planned = min(planned, available)
        if isinstance(planned, int) and planned > self.sent:
            # the time bound came first: without this row they vanished from the table
            row("Not sent (time bound):", planned - self.sent)
        if self.settings.get("closed_loop"):
            row("Sessions:", "closed loop (each waits for its last answer)")
        row("Peak concurrent requests:", self.peak_concurrency)
        row("Benchmark duration (s):", self.duration_s)
        row("Total input tokens:", self.total_input_tokens)
        row("Total generated tokens:", self.total_output_tokens)
        row("Total cached tokens:", self.total_cached_tokens)
        ratio = None if self.cache_hit_ratio is None else 100.0 * self.cache_hit_ratio
        row("Cache hit ratio (%):", ratio)
        row("Request throughput (req/s):", self.request_throughput)
        if self.goodput_slos_ms:
            row("Request goodput (req/s):", self.request_goodput)
            gr = None if self.goodput_ratio is None else 100.0 * self.goodput_ratio
            row("Goodput ratio (% of sent):", gr)
        row("Output token throughput (tok/s):", self.output_throughput)
        row("Total token throughput (tok/s):", self.total_token_throughput)
        for m in METRICS:
            s = self.metrics[m]
            lines.append(_TITLES[m].center(w, "-"))
            up = m.upper()
            row(f"Mean {up} (ms):", s.mean)
            row(f"Median {up} (ms):", s.median)
            row(f"P90 {up} (ms):", s.p90)
            row(f"P99 {up} (ms):", s.p99)
        lines.append("=" * w)
        return "\n".join(lines)


def build_report(
    results: Sequence[RequestResult],
    *,
    duration_s: float,
    goodput_slos_ms: Mapping[str, float] | None = None,
    settings: Mapping[str, object] | None = None,
) -> LoadReport:
    """Aggregate per-request results; see the module docstring for the definitions."""
    slos = dict(goodput_slos_ms or {})
    ok = [r for r in results if r.success]
    incomplete = [r for r in results if not r.success and r.error == "cancelled"]
    failed = [r for r in results if not r.success and r.error != "cancelled"]
    by_status = Counter(str(r.status) for r in failed)
    by_type = Counter(r.error for r in failed)
    dur = max(duration_s, 0.0)

    def per_s(x: float) -> float:
        return x / dur if dur > 0 else 0.0

    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    # vLLM and SGLang leave prompt_tokens_details out when nothing was cached: once the
    # server states cached tokens at all, an answer whose usage lacks them is a miss
    states = any(r.cached_tokens is not None for r in ok)
    with_cache = [r for r in ok
                  if r.cached_tokens is not None or (states and r.prompt_tokens_reported)]
    n_cached = sum(r.cached_tokens or 0 for r in with_cache)
    cache_den = sum(r.prompt_tokens for r in with_cache)
    cache_ratio = n_cached / cache_den if with_cache and cache_den > 0 else None
    good = sum(1 for r in ok if meets_slos(r, slos)) if slos else None
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    metrics = {
        "ttft": Stats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": Stats.of(tpots),
        "itl": Stats.of([x for r in ok for x in r.itl_s]),
        "e2el": Stats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    return LoadReport(
        settings=dict(settings or {}),
        sent=len(results),
        completed=len(ok),
        failed=len(failed),
        incomplete=len(incomplete),
        failed_by_status=dict(sorted(by_status.items())),
        errors_by_type=dict(sorted(by_type.items())),
        duration_s=dur,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        total_cached_tokens=n_cached,
        # the answers that stated them, as documented (it counted the misses too)
        cached_tokens_reported=sum(1 for r in ok if r.cached_tokens is not None),
        cache_hit_ratio=cache_ratio,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        peak_concurrency=peak_concurrency(results),
        goodput_slos_ms=slos,
        good_requests=good,
        request_goodput=None if good is None else per_s(good),
        goodput_ratio=None if good is None else (good / len(results) if results else 0.0),
        metrics=metrics,
        results=list(results),
    )
