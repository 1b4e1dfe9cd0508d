"""What the node watcher reads from a node, parsed defensively (pure functions).

* ``/metrics`` (Prometheus text): the load signals of vLLM (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, older
  ``vllm:gpu_cache_usage_perc``) or SGLang (``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``). Counts are summed over label
  sets (data-parallel engines, several models); the KV usage, a fraction, is their
  mean, so two half-full ranks read 0.5, not 1.0.
  The KV cache's size, in tokens: vLLM's ``vllm:cache_config_info`` labels
  (``num_gpu_blocks`` x ``block_size``; the largest line: with data-parallel ranks
  behind one server vLLM writes one line per rank, each already holding the ranks'
  sum, as its front end adds their block counts up in one cache config) or SGLang's
  ``sglang:max_total_num_tokens``. A sum that overflows to infinity (absurd gauges on
  several lines) is ignored like a non-finite gauge. ``process_start_time_seconds``
  (prometheus_client's process collector, which vLLM's server has; kvgate engine
  writes it too): when it changes, the node is a new process, with an empty cache.
* ``/v1/models``: model ids and vLLM's per-model ``max_model_len``.
* ``/kvgate/evictions?since=N``: the simulated engine's eviction announcements, a
  JSON list of ``{"seq", "type": "announced"|"done", ...}`` or an object with such a
  list under ``events`` (and optionally the next cursor under ``next``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvgate.core.nodes import NODE_INT_LIMIT

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage", "vllm:gpu_cache_usage_perc")
SGLANG_CACHE_TOKENS = "sglang:max_total_num_tokens"
VLLM_CACHE_INFO = "vllm:cache_config_info{"  # the size is in its labels
PROCESS_START = "process_start_time_seconds"
_WANTED = frozenset((*RUNNING, *WAITING, *KV_USAGE, SGLANG_CACHE_TOKENS, PROCESS_START))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSample:
    running: int
    waiting: int
    kv_util: float | None  # None when the node exports no usage gauge
    cache_tokens: int | None = None  # the KV cache's size, when the page gives it
    started_at: float | None = None  # the server process's start (Unix time), if given


def _sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, value); None for anything else."""
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace]
        close = line.rfind("}")
        if close < brace:
            return None
        rest = line[close + 1:].split()
    else:
        parts = line.split()
        if len(parts) < 2:
            return None
        name, rest = parts[0], parts[1:]
    if name not in _WANTED or not rest:
        return None
    try:
        value = float(rest[0])
    except ValueError:
        return None
    return (name, value) if math.isfinite(value) else None


def parse_load(text: str) -> LoadSample | None:
    """The load signals of a Prometheus page, or None if it has neither vLLM's nor
    SGLang's request gauges."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    cache_tokens = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if not line.startswith(("vllm:", "sglang:", PROCESS_START)):
            continue
        if line.startswith(VLLM_CACHE_INFO):
            cache_tokens = max(cache_tokens, _vllm_cache_tokens(line))
            continue
        if "_rank=" in line and line.startswith("sglang:") and _other_rank(line):
            continue
        got = _sample(line)
        if got is None:
            continue
        name, value = got
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    for name in [n for n, v in sums.items() if not math.isfinite(v)]:
        del sums[name]  # finite lines adding up to infinity: no reading

    def first(names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in sums), None)

    run, wait = first(RUNNING), first(WAITING)
    if run is None and wait is None:
        return None
    kv = first(KV_USAGE)
    return LoadSample(
        running=max(0, round(sums[run])) if run else 0,
        waiting=max(0, round(sums[wait])) if wait else 0,
        kv_util=min(1.0, max(0.0, sums[kv] / counts[kv])) if kv else None,
        cache_tokens=cache_tokens + max(0, int(sums.get(SGLANG_CACHE_TOKENS, 0))) or None,
        # one process serves the page: a sum of several lines would be no start time
        started_at=sums[PROCESS_START] if counts.get(PROCESS_START) == 1 else None,
    )


def _other_rank(line: str) -> bool:
    """An SGLang line of a tensor- or pipeline-parallel rank other than 0: with
    ``--enable-metrics-for-all-schedulers`` every such rank logs the same batch as rank
    0 (its data-parallel rank's), so adding its lines counted the load that many times."""
    labels = _labels(line)
    return labels.get("tp_rank", "0") != "0" or labels.get("pp_rank", "0") != "0"


def _vllm_cache_tokens(line: str) -> int:
    """``num_gpu_blocks`` x ``block_size`` of a ``vllm:cache_config_info`` line, 0 if
    it lacks them."""
    labels = _labels(line)
    try:
        blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return 0
    return blocks * size if blocks > 0 and size > 0 else 0


def _labels(line: str) -> dict[str, str]:
    """The labels of ``name{a="x",b="y"} value`` (values without escapes suffice here)."""
    inner = line[line.find("{") + 1:line.rfind("}")]
    out: dict[str, str] = {}
    for part in inner.split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    ids: tuple[str, ...]
    max_model_len: int | None  # the largest any model reports
    entries: tuple[dict[str, Any], ...]  # the raw model objects (for /v1/models)


def parse_models(obj: Any) -> ModelInfo | None:
    """An OpenAI ``/v1/models`` answer, or None if it does not look like one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        return None
    ids: list[str] = []
    entries: list[dict[str, Any]] = []
    best: int | None = None
    for item in obj["data"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        ids.append(item["id"])
        entries.append(item)
        mml = item.get("max_model_len")
        # an absurd length (past NODE_INT_LIMIT) is no model's: taken as not said
        if isinstance(mml, int) and not isinstance(mml, bool) and 0 < mml <= NODE_INT_LIMIT:
            best = mml if best is None else max(best, mml)
    return ModelInfo(ids=tuple(ids), max_model_len=best, entries=tuple(entries))


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionEvent:
    seq: int
    kind: str  # "announced" | "done"
    tokens_evicted: int = 0  # a done's num_tokens_evicted (0: not given)


def parse_evictions(obj: Any) -> tuple[list[EvictionEvent], int | None]:
    """(events in seq order, the server's next cursor if it gave one)."""
    items: Any = obj
    cursor: int | None = None
    if isinstance(obj, dict):
        items = obj.get("events", [])
        nxt = obj.get("next", obj.get("cursor"))
        if isinstance(nxt, int) and not isinstance(nxt, bool):
            cursor = nxt
    if not isinstance(items, list):
        return [], cursor
    out: list[EvictionEvent] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        seq = item.get("seq")
        kind = item.get("type")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(kind, str):
            continue
        kind = kind.lower()
        if "announce" in kind:
            out.append(EvictionEvent(seq=seq, kind="announced"))
        elif "done" in kind or "complete" in kind:
            tokens = item.get("num_tokens_evicted")
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
                tokens = 0
            out.append(EvictionEvent(seq=seq, kind="done", tokens_evicted=tokens))
    out.sort(key=lambda e: e.seq)
    return out, cursor
