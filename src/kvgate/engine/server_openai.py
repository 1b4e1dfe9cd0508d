"""Response bodies of the simulated engine's HTTP shell, in vLLM's shapes (pure).

Completions stream ``object: "text_completion"`` chunks with ``choices[0].text``;
chat streams ``object: "chat.completion.chunk"`` chunks, the first one with
``delta.role``, then ``delta.content``. The chunk of the last token carries
``finish_reason: "length"`` (the simulated engine always generates exactly
``max_tokens`` tokens). ``usage`` follows vLLM with
``--enable-prompt-tokens-details``: ``prompt_tokens_details.cached_tokens`` is
the engine's prefix-cache hit (in tokens) at the request's first scheduling.

:func:`render_metrics` writes the Prometheus text exposition with vLLM's metric
names and labels (``model_name``, ``engine``), research/engine-integration.md
4.1, plus a few ``kvgate:`` counters vLLM has no name for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvgate.core.hashing.sim_tokens import SIM_VOCAB_SIZE
from kvgate.engine.api import EngineMetrics, FinishedRequest
from kvgate.engine.server_histograms import RequestTimer
from kvgate.engine.server_tokens import PromptTokenizer, SimTokens
from kvgate.protocol import (
    ChatRequest,
    CompletionRequest,
    InvalidTypeError,
    InvalidValueError,
    ProtocolError,
    UnsupportedParameterError,
    not_found_body,
    parse_chat_request,
    parse_completion_request,
)
from kvgate.protocol.errors import type_name

__all__ = [
    "GenerateInput",
    "ModelNotFoundError",
    "ResponseShape",
    "models_body",
    "parse_generate",
    "render_metrics",
    "usage_body",
]

Kind = Literal["completion", "chat"]
FINISH_REASON: Final = "length"


class ModelNotFoundError(ProtocolError):
    http_status = 404

    def body(self) -> dict[str, Any]:
        return not_found_body(self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateInput:
    """A validated generation request, tokenized, with its output length settled."""

    request: CompletionRequest | ChatRequest
    tokens: SimTokens
    max_tokens: int


def parse_generate(kind: Kind, body: bytes, *, tokens: PromptTokenizer, model: str,
                   max_model_len: int, default_max_tokens: int,
                   max_body_bytes: int) -> GenerateInput:
    """Parse and tokenize a ``/v1/completions`` or ``/v1/chat/completions`` body.

    ``max_tokens`` absent: ``default_max_tokens`` (vLLM's 16 for completions;
    kvgate's 256 for chat, where vLLM would use the rest of the context),
    clamped to what ``max_model_len`` leaves after the prompt. Raises a
    ProtocolError (400; 404 :class:`ModelNotFoundError` for another model).

    A prompt that cannot fit (prompt + max_tokens > max_model_len) is refused
    before it is tokenized, from its token count (exact, from its length:
    :meth:`PromptTokenizer.count`), with the engine's own 400
    ``context_length_exceeded`` answer: tokenizing and hashing a body of many
    MiB would hold the event loop (and every stream on it) for most of a second.
    """
    parsed: CompletionRequest | ChatRequest
    if kind == "chat":
        parsed = parse_chat_request(body, max_body_bytes=max_body_bytes)
    else:
        parsed = parse_completion_request(body, max_body_bytes=max_body_bytes)
    if parsed.model != model:
        raise ModelNotFoundError(parsed.model, param="model")
    _refuse_unsimulated(parsed, kind)
    source = tokens.source(parsed)
    num_tokens = tokens.count(source)
    if num_tokens == 0:
        raise InvalidValueError("The prompt is empty.", param="prompt")
    max_tokens = parsed.max_tokens or max(1, min(default_max_tokens,
                                                 max_model_len - num_tokens))
    if num_tokens + max_tokens > max_model_len:
        # the words and code of SimEngine.submit's BAD_REQUEST (the server's 400)
        raise ProtocolError(
            f"prompt ({num_tokens}) + max_tokens ({max_tokens}) exceeds max_model_len "
            f"({max_model_len})", code="context_length_exceeded")
    _check_min_tokens(parsed.raw.get("min_tokens"), max_tokens)
    if not isinstance(source, str) and max(source) >= SIM_VOCAB_SIZE:
        # vLLM's words: an id the model has no embedding for
        raise InvalidValueError(f"Token id {max(source)} is out of vocabulary", param="prompt")
    sim = tokens.for_source(source, salt=parsed.cache_salt)
    return GenerateInput(request=parsed, tokens=sim, max_tokens=max_tokens)


def _check_min_tokens(low: object, max_tokens: int) -> None:
    """vLLM's checks of ``min_tokens``: an integer, >= 0, at most the ``max_tokens`` the
    request runs with (the default when it gives none)."""
    if low is None:
        return
    if not isinstance(low, int) or isinstance(low, bool):
        raise InvalidTypeError(
            f"Invalid type for 'min_tokens': expected an integer, but got {type_name(low)} "
            "instead.", param="min_tokens")
    if low < 0:
        raise InvalidValueError(f"min_tokens must be greater than or equal to 0, got {low}.",
                                param="min_tokens")
    if low > max_tokens:
        raise InvalidValueError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {low}.",
            param="min_tokens")


def _refuse_unsimulated(parsed: CompletionRequest | ChatRequest, kind: Kind) -> None:
    """A 400 naming a parameter whose answer the simulator cannot give in the shape it
    asks for (logprobs, an echoed prompt, a required tool call, JSON output), or that
    vLLM refuses too (``suffix``): a client reading
    ``choices[0].logprobs`` or ``message.tool_calls[0]`` would otherwise get None and
    text. Sampling settings and ``stop`` are accepted and do not change the random
    words it generates."""

    def refuse(param: str, what: str) -> None:
        raise UnsupportedParameterError(
            f"kvgate's simulated engine does not {what} ('{param}')", param=param)

    raw = parsed.raw
    if kind == "chat":
        if raw.get("logprobs") or raw.get("top_logprobs") is not None:
            refuse("logprobs" if raw.get("logprobs") else "top_logprobs", "return logprobs")
        if isinstance(parsed, ChatRequest) and parsed.media:
            refuse(parsed.media[0], "read images, audio, video or files")
        choice = raw.get("tool_choice")
        if choice is not None and choice not in ("auto", "none"):
            refuse("tool_choice", "call tools")
    else:
        if raw.get("logprobs") is not None:
            refuse("logprobs", "return logprobs")
        if raw.get("echo"):
            refuse("echo", "echo the prompt")
        if raw.get("suffix"):
            refuse("suffix", "support a suffix")
    # both APIs: vLLM's completions take a response_format (structured output) as well
    fmt = raw.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        refuse("response_format", "produce structured output")


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finished_usage(done: FinishedRequest) -> dict[str, Any]:
    return usage_body(done.prompt_tokens, done.output_tokens, done.cached_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseShape:
    """The fixed parts of one response: builds its chunks and its final body."""

    kind: Kind
    request_id: str
    model: str
    created: int

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat's role chunk, sent before the first token; None for completions."""
        if self.kind != "chat":
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def token_chunk(self, text: str, last: bool) -> dict[str, Any]:
        finish = FINISH_REASON if last else None
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text},
                                      "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: FinishedRequest) -> dict[str, Any]:
        """The usage-only chunk ``stream_options.include_usage`` adds before ``[DONE]``."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": finished_usage(done)}

    def full_body(self, text: str, done: FinishedRequest) -> dict[str, Any]:
        """A non-streamed response."""
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": FINISH_REASON, "stop_reason": None,
            }
            return {**self._head("chat.completion"), "choices": [choice],
                    "usage": finished_usage(done)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH_REASON,
                  "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice],
                "usage": finished_usage(done)}


def models_body(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{
            "id": model, "object": "model", "created": created, "owned_by": "kvgate",
            "root": model, "parent": None, "max_model_len": max_model_len, "permission": [],
        }],
    }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _fmt(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def render_metrics(
    m: EngineMetrics, *, model: str, extra_counters: Mapping[str, tuple[str, int]] = {},
    started_at: float | None = None, timer: RequestTimer | None = None,
) -> str:
    """Prometheus text for one engine (DP rank 0).

    ``extra_counters`` maps a ``kvgate:`` counter name (without ``_total``) to
    ``(help, value)``, for counts the shell keeps itself. ``started_at`` (Unix time)
    is written as ``process_start_time_seconds``, as prometheus_client's process
    collector does for vLLM: a gateway tells a restarted engine by it. ``timer`` adds
    vLLM's per-request histograms (TTFT, inter-token latency, ...).
    """
    base = {"model_name": model, "engine": "0"}
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float,
               labels: Mapping[str, str] = base,
               more: tuple[tuple[Mapping[str, str], float], ...] = ()) -> None:
        # a counter's family is named with its _total, as prometheus_client (vLLM's
        # exporter) writes it: under a bare name its parser sees an empty counter and
        # an untyped _total sample; ``more`` are further samples of the family
        family = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {family} {help_}")
        lines.append(f"# TYPE {family} {kind}")
        for labelled, v in ((labels, value), *more):
            lines.append(f"{family}{_labels(labelled)} {_fmt(v)}")

    metric("vllm:num_requests_running", "gauge",
           "Number of requests in model execution batches.", m.num_requests_running)
    metric("vllm:num_requests_waiting", "gauge",
           "Number of requests waiting to be processed.", m.num_requests_waiting)
    metric("vllm:kv_cache_usage_perc", "gauge",
           "KV-cache usage. 1 means 100 percent usage.", m.kv_cache_usage_perc)
    metric("vllm:prefix_cache_queries", "counter",
           "Prefix cache queries, in terms of number of queried tokens.",
           m.prefix_cache_queries)
    metric("vllm:prefix_cache_hits", "counter",
           "Prefix cache hits, in terms of number of cached tokens.", m.prefix_cache_hits)
    metric("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
           m.num_preemptions)
    metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
           m.prompt_tokens)
    metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
           m.generation_tokens)
    # every finish reason vLLM writes, from 0, so a dashboard's per-reason panel has
    # them all (the simulated engine never stops on a stop string: all end by length)
    metric("vllm:request_success", "counter", "Count of successfully processed requests.",
           m.num_requests_finished, {**base, "finished_reason": FINISH_REASON},
           more=(({**base, "finished_reason": "stop"}, 0),
                 ({**base, "finished_reason": "abort"}, m.num_requests_aborted)))
    # vLLM's labels: CacheConfig.metrics_info() and the engine, no model_name; its hash
    # algorithm names the family (the simulated engine's block hashes are xxh3, not vLLM's)
    metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
           1, {"engine": base["engine"], "block_size": str(m.block_size),
               "num_gpu_blocks": str(m.num_gpu_blocks), "enable_prefix_caching": "True",
               "prefix_caching_hash_algo": "xxhash"})
    metric("kvgate:num_requests_queued", "gauge",
           "Requests in the node's admission queue (part of vllm:num_requests_waiting).",
           m.num_requests_queued)
    metric("kvgate:num_cached_blocks", "gauge", "KV blocks holding a cached hash.",
           m.num_cached_blocks)
    metric("kvgate:requests_aborted", "counter", "Requests aborted (client disconnect).",
           m.num_requests_aborted)
    metric("kvgate:requests_rejected", "counter",
           "Requests refused by second-stage admission (at submit or by queue TTL).",
           m.num_requests_rejected)
    metric("kvgate:requests_failed", "counter", "Requests failed by an engine crash.",
           m.num_requests_failed)
    metric("kvgate:lazy_evictions", "counter", "Cached blocks evicted on reuse.",
           m.num_evicted_blocks)
    for name, (help_, value) in extra_counters.items():
        metric(name, "counter", help_, value)
    if timer is not None:
        timer.render(_labels(base)[1:-1], lines.append)
    if started_at is not None:
        metric("process_start_time_seconds", "gauge",
               "Start time of the process since unix epoch in seconds.", started_at, {})
    return "\n".join(lines) + "\n"
