"""vLLM's per-request histograms for ``kvgate engine``'s ``/metrics``.

vLLM's Grafana dashboard draws its TTFT, inter-token latency, end-to-end latency,
queue / prefill / decode time, prompt / generation length, max_tokens and tokens per
step panels from these series; without them those panels stay empty in front of
simulated engines. Names, help texts and bucket bounds follow vLLM v1's
``PrometheusStatLogger`` (tokens per step: its buckets without CUDA graphs).

Times are wall-clock seconds, as clients and the gateway see them: the engine's time
divided by its speed-up (an engine at ``--speedup 10`` reports a tenth of the
simulated GPU's time). :class:`RequestTimer` is fed by the engine loop; it holds one
small record per request in flight, dropped when the request ends.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class Histogram:
    """Cumulative-on-render bucket counts, a sum and a count."""

    bounds: Sequence[float]
    counts: list[int] = field(init=False)  # per bucket, the last one +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value
        self.n += 1

    def samples(self) -> list[tuple[str, float]]:
        """(le, cumulative count) per bucket, ``+Inf`` last."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, None), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound is None else _le(bound), running))
        return out


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client (vLLM's exporter) writes it: 1.0, 0.005,
    2560.0, and past six integer digits an exponent, 1e+06, 1.5e+06 (Prometheus 2 keeps
    ``le`` as written: vLLM's series and ours must spell it alike)."""
    text = repr(float(bound))
    dot = text.find(".")
    if bound > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


@dataclass(slots=True)
class _Timing:
    arrival: float
    max_tokens: int
    first: float | None = None
    last: float | None = None


# name, help, which histogram attribute of RequestTimer
FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     "itl"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     "e2e"),
    ("vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", "queue"),
    ("vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", "prefill"),
    ("vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", "inference"),
    ("vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", "decode"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.",
     "generation_tokens"),
    ("vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "max_generation_tokens"),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "params_n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "params_max_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     "iteration_tokens"),
)


class RequestTimer:
    """Per-request timings and parameters from the engine loop, observed into vLLM's
    histograms when a request finishes, and each step's tokens. ``to_wall`` turns an
    engine-time interval into wall seconds."""

    def __init__(self, max_model_len: int, to_wall: Callable[[float], float]) -> None:
        self._to_wall = to_wall
        self._open: dict[str, _Timing] = {}
        tokens = buckets_1_2_5(max(1, max_model_len))
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(tokens)
        self.generation_tokens = Histogram(tokens)
        self.params_max_tokens = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)

    def __len__(self) -> int:
        return len(self._open)

    def arrived(self, rid: str, now: float, max_tokens: int) -> None:
        self._open[rid] = _Timing(arrival=now, max_tokens=max_tokens)

    def step(self, tokens: int) -> None:
        """An engine step computed ``tokens`` (prefill chunks plus one per decode)."""
        if tokens > 0:
            self.iteration_tokens.observe(tokens)

    def tokens(self, rid: str, end: float) -> None:
        """The step ending at ``end`` gave ``rid`` output tokens."""
        t = self._open.get(rid)
        if t is None:
            return
        if t.first is None:
            t.first = end
            self.ttft.observe(self._to_wall(end - t.arrival))
        elif t.last is not None:
            self.itl.observe(self._to_wall(end - t.last))
        t.last = end

    def finished(self, rid: str, end: float, prompt_tokens: int, output_tokens: int,
                 scheduled_at: float = -1.0) -> None:
        """``scheduled_at``: the engine time the request was first scheduled (vLLM's
        scheduled_ts), splitting its time into queue, prefill and decode; -1 unknown."""
        t = self._open.pop(rid, None)
        if t is None:
            return
        wall = self._to_wall
        self.e2e.observe(wall(end - t.arrival))
        last = t.last if t.last is not None else end
        if scheduled_at >= 0:
            # our arrival is stamped just after the engine's submit: never below 0
            self.queue.observe(wall(max(0.0, scheduled_at - t.arrival)))
            self.inference.observe(wall(last - scheduled_at))
            if t.first is not None:
                self.prefill.observe(wall(t.first - scheduled_at))
        if t.first is not None:
            self.decode.observe(wall(last - t.first))
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(output_tokens)
        self.params_max_tokens.observe(t.max_tokens)

    # n is always 1 here (n > 1 is refused): a request's largest generation is its own,
    # and every finished request observed n = 1; both read off what is already counted
    @property
    def max_generation_tokens(self) -> Histogram:
        return self.generation_tokens

    @property
    def params_n(self) -> Histogram:
        ones = Histogram(PARAMS_N_BUCKETS)
        ones.counts[0] = ones.n = self.generation_tokens.n
        ones.total = float(ones.n)
        return ones

    def forget(self, rid: str) -> None:
        """The request ended otherwise (aborted, refused, failed): vLLM observes only
        finished requests' latencies."""
        self._open.pop(rid, None)

    def render(self, base: str, write: Callable[[str], None]) -> None:
        """Each family as Prometheus text; ``base`` is the escaped ``k="v",...`` label
        list every sample carries."""
        for name, help_, attr in FAMILIES:
            h: Histogram = getattr(self, attr)
            write(f"# HELP {name} {help_}")
            write(f"# TYPE {name} histogram")
            for le, count in h.samples():
                write(f'{name}_bucket{{{base},le="{le}"}} {float(count)!r}')
            write(f"{name}_sum{{{base}}} {float(h.total)!r}")
            write(f"{name}_count{{{base}}} {float(h.n)!r}")
