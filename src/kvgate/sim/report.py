"""Turn a finished simulation into the numbers users compare policies by.

Definitions follow `vllm bench serve` (research/workloads.md section 4):
TTFT = arrival to first token; TPOT = (E2E - TTFT) / (output - 1); goodput =
requests per second that met every SLO, counted against *all* offered requests
(a rejected or failed request is an SLO miss), over the run's span (first arrival
to last end, as ``vllm bench serve`` divides by the benchmark's duration);
``slo_misses`` says what the others missed. ``ttft_parts`` splits TTFT into each
request's own prefill (alone on an idle node, after the cache it found) and the wait
on top of it, over all completed requests and over the slowest 1 %: whether a policy's
tail is long prompts or requests kept waiting. Hit ratios are block-weighted
like the trace bounds: cached blocks / prompt blocks (the trace's partial last
block counts in the denominator, as in the pooled-LRU bound).

Stable JSON keys (documented in the README): ``requests``, ``wall_s``,
``bounds.ideal_hit_ratio``, ``bounds.pooled_lru_hit_ratio`` (and, from the runner,
``bounds.balanced_hit_ratio``) and, per policy,
``ttft_p50_s``, ``ttft_p99_s``, ``ttft_mean_s``, ``hit_ratio``,
``load_max_over_mean``, ``goodput_rps``, ``completed``, ``rejected``, ``failed``
plus the other fields built below.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import ceil

from kvgate.core.config import PREFIX_BUCKETS, bucket_of
from kvgate.engine import EngineProfile, get_profile, prefill_alone_s
from kvgate.sim.cluster import RequestOutcome, SimCluster
from kvgate.sim.funnel import FUNNEL_KINDS


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    ttft_s: float = 5.0
    tpot_s: float = 0.1


STRICT_SLO = Slo(ttft_s=2.0, tpot_s=0.05)


def pct(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values (a run
    that completed nothing has no latency, not a perfect one)."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


SAMPLE_POINTS = 500


def thinned(xs: Sequence[float], n: int) -> list[float]:
    """At most ``n`` of ``xs`` (n >= 2), evenly spaced by index, the first and last
    included: a sorted sample keeps its extremes."""
    if len(xs) <= n:
        return list(xs)
    last = len(xs) - 1
    return [xs[round(i * last / (n - 1))] for i in range(n)]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def ttft(o: RequestOutcome) -> float | None:
    if o.status != "completed" or o.first_token_s is None:
        return None
    return o.first_token_s - o.arrived_s


def e2e(o: RequestOutcome) -> float | None:
    if o.status != "completed" or o.finished_s is None:
        return None
    return o.finished_s - o.arrived_s


def queued(o: RequestOutcome) -> float | None:
    """Arrival to the node first scheduling the prompt (vLLM's queue time, with the
    network and any failed attempt before it); None unless it completed with a known
    start."""
    if o.status != "completed" or o.prefill_started_s is None:
        return None
    return o.prefill_started_s - o.arrived_s


def tpot(o: RequestOutcome) -> float | None:
    if o.status != "completed" or o.first_token_s is None or o.finished_s is None:
        return None
    if o.output_tokens <= 1:
        return None
    return (o.finished_s - o.first_token_s) / (o.output_tokens - 1)


def meets(o: RequestOutcome, slo: Slo) -> bool:
    return slo_miss(o, slo) is None


# why a request missed the SLO: the keys of a report's ``slo_misses``
SLO_MISS_KINDS = ("ttft", "tpot", "both", "not_completed")


def slo_miss(o: RequestOutcome, slo: Slo) -> str | None:
    """None when ``o`` met ``slo``; else which part it missed (one of SLO_MISS_KINDS):
    a rejected or failed request is ``not_completed``."""
    t = ttft(o)
    if t is None:
        return "not_completed"
    p = tpot(o)
    late = t > slo.ttft_s
    slow = p is not None and p > slo.tpot_s
    if late and slow:
        return "both"
    if late:
        return "ttft"
    return "tpot" if slow else None


def latency_summary(outcomes: Iterable[RequestOutcome]) -> dict[str, float | None]:
    """Latency of a group of requests (a priority class, a tenant); None where none
    completed."""
    outs = list(outcomes)
    ttfts = [t for o in outs if (t := ttft(o)) is not None]
    tpots = [p for o in outs if (p := tpot(o)) is not None]
    e2es = [e for o in outs if (e := e2e(o)) is not None]
    return {
        "requests": len(outs),
        "completed": len(ttfts),
        "ttft_p50_s": _r(pct(ttfts, 0.5)),
        "ttft_p99_s": _r(pct(ttfts, 0.99)),
        "ttft_mean_s": _r(_mean(ttfts)),
        "tpot_p99_s": _r(pct(tpots, 0.99), 5),
        "e2e_p99_s": _r(pct(e2es, 0.99)),
    }


# the share of completed requests TTFT p99 reads: ttft_parts' "slowest_1pct"
TAIL_SHARE = 0.01
# a wait this long is counted apart (the default TTFT SLO)
LONG_WAIT_S = 5.0


def ttft_parts(
    done: Sequence[RequestOutcome], profile: EngineProfile
) -> dict[str, dict[str, float | int | None]]:
    """Where the completed requests' time to first token went, over all of them (what
    TTFT mean reads) and over the slowest ``TAIL_SHARE`` (at least one; what TTFT p99
    reads): ``prefill_mean_s``, each request's own prefill alone on an idle node after
    the cache it found (:func:`prefill_alone_s`), and ``wait_mean_s``, the rest, in two:
    ``queued_mean_s`` until the node first scheduled its prompt (the network there,
    failed attempts, the node's queue and the step it found running) and
    ``slowed_mean_s`` after (other requests' work in the steps its prefill shared:
    decodes, chunks of prompts ahead of it or admitted beside its last chunk; a
    preemption's recompute; the first byte's way back); ``waited_over_5s`` counts the
    requests whose wait passed ``LONG_WAIT_S``; ``cached_share`` is the share of their
    prompt tokens found cached."""
    rows = [
        (
            t,
            # the engine finds at most all but the prompt's last token cached
            prefill_alone_s(profile, o.req.prompt_tokens, o.cached_tokens),
            o,
        )
        for o in done
        if (t := ttft(o)) is not None
    ]
    rows.sort(key=lambda row: row[0])  # by TTFT alone: ties keep the run's order
    tail = rows[len(rows) - ceil(len(rows) * TAIL_SHARE) :]

    def parts(
        group: Sequence[tuple[float, float, RequestOutcome]],
    ) -> dict[str, float | int | None]:
        n = len(group)
        prompt = sum(o.req.prompt_tokens for _, _, o in group)
        # (wait, queued) of the requests whose prefill start is known (in a simulation
        # every completed one; not in an outcome made up without it)
        split = [(t - p, q) for t, p, o in group if (q := queued(o)) is not None]
        return {
            "requests": n,
            "ttft_mean_s": _r(_mean([t for t, _, _ in group])),
            "prefill_mean_s": _r(_mean([p for _, p, _ in group])),
            "wait_mean_s": _r(_mean([t - p for t, p, _ in group])),
            "queued_mean_s": _r(_mean([q for _, q in split])),
            "slowed_mean_s": _r(_mean([w - q for w, q in split])),
            "waited_over_5s": sum(1 for t, p, _ in group if t - p > LONG_WAIT_S),
            "cached_share": _r(sum(o.cached_tokens for _, _, o in group) / prompt)
            if prompt
            else None,
        }

    return {"all": parts(rows), "slowest_1pct": parts(tail)}


def policy_report(cluster: SimCluster, *, slo: Slo, wall_s: float) -> dict[str, object]:
    outs = list(cluster.outcomes.values())
    done = [o for o in outs if o.status == "completed"]
    ttfts = [t for o in done if (t := ttft(o)) is not None]
    tpots = [p for o in done if (p := tpot(o)) is not None]
    e2es = [e for o in done if (e := e2e(o)) is not None]
    first = min((o.arrived_s for o in outs), default=0.0)
    last = max((o.ended_s or 0.0 for o in outs), default=0.0)
    span = max(last - first, 1e-9)
    block = cluster.block_tokens

    # hit ratio, block-weighted, overall and by prompt-length bucket
    hit_blocks: Counter[str] = Counter()
    all_blocks: Counter[str] = Counter()
    for o in done:
        b = bucket_of(o.req.prompt_tokens)
        hit_blocks[b] += o.cached_tokens // block
        all_blocks[b] += len(o.req.block_ids)
    total_blocks = sum(all_blocks.values())
    by_bucket = {
        name: _r(hit_blocks[name] / all_blocks[name]) if all_blocks[name] else None
        for name, _ in PREFIX_BUCKETS
    }

    # each node's share of the processed prefill and decode tokens
    work = [n.prefill_tokens + n.decode_tokens for n in cluster.nodes]
    mean_work = sum(work) / len(work) if work else 0.0
    # no token processed anywhere: no balance to speak of (None, not a perfect 0)
    load_max_over_mean = max(work) / mean_work if mean_work else None

    rejects = Counter(o.reason for o in outs if o.status == "rejected")
    failures = Counter(o.reason for o in outs if o.status == "failed")
    retries: Counter[str] = Counter()
    routed: Counter[str] = Counter()
    # the gateways' index against the engines: of the hit tokens it predicted, the share
    # the engines found cached when the requests ran
    checked = confirmed = 0
    for ctl in cluster.gateways:
        retries.update(ctl.stats.retries)
        routed.update(ctl.stats.routed)
        for hc in ctl.stats.hits.values():
            checked += hc.checked_predicted_tokens
            confirmed += hc.confirmed_hit_tokens
    attempts = sum(o.attempts for o in outs)
    dispatched = sum(1 for o in outs if o.attempts)

    by_priority: dict[str, dict[str, float | None]] = {}
    groups: defaultdict[int, list[RequestOutcome]] = defaultdict(list)
    for o in outs:
        groups[o.req.priority].append(o)
    # every class P0-P2, an empty one with no latencies, so a reader's key is always there
    for p in sorted({0, 1, 2} | set(groups)):
        by_priority[f"P{p}"] = latency_summary(groups.get(p, []))
    tenants: defaultdict[str, list[RequestOutcome]] = defaultdict(list)
    for o in outs:
        tenants[o.req.tenant].append(o)
    by_tenant = {t: latency_summary(tenants[t]) for t in sorted(tenants)}

    out_tokens = sum(o.output_tokens for o in done)
    misses = Counter(kind for o in outs if (kind := slo_miss(o, slo)) is not None)
    return {
        "completed": len(done),
        "rejected": sum(1 for o in outs if o.status == "rejected"),
        "failed": sum(1 for o in outs if o.status == "failed"),
        "ttft_p50_s": _r(pct(ttfts, 0.5)),
        "ttft_p90_s": _r(pct(ttfts, 0.9)),
        "ttft_p99_s": _r(pct(ttfts, 0.99)),
        "ttft_mean_s": _r(_mean(ttfts)),
        "tpot_p50_s": _r(pct(tpots, 0.5), 5),
        "tpot_p99_s": _r(pct(tpots, 0.99), 5),
        "e2e_p50_s": _r(pct(e2es, 0.5)),
        "e2e_p99_s": _r(pct(e2es, 0.99)),
        "ttft_parts": ttft_parts(done, get_profile(cluster.config.profile)),
        "throughput_rps": _r(len(done) / span),
        "output_tokens_per_s": _r(out_tokens / span),
        "goodput_rps": _r((len(outs) - misses.total()) / span),
        "goodput_strict_rps": _r(sum(1 for o in outs if meets(o, STRICT_SLO)) / span),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        # the offered requests that missed the SLO, by what they missed: goodput is
        # (requests - these) / span_s
        "slo_misses": {kind: misses[kind] for kind in SLO_MISS_KINDS},
        # null with no completed prompt, as every ratio of nothing measured: never a 0
        # that a check could read as a result
        "hit_ratio": _r(sum(hit_blocks.values()) / total_blocks) if total_blocks else None,
        "hit_ratio_by_bucket": by_bucket,
        "index_precision": _r(confirmed / checked) if checked else None,
        "cache_loss_funnel": {k: cluster.funnel[k] for k in sorted(FUNNEL_KINDS)},
        "load_max_over_mean": _r(load_max_over_mean),
        "node_work_tokens": work,
        "rejects_by_reason": dict(sorted(rejects.items())),
        "failures_by_reason": dict(sorted(failures.items())),
        "retries_by_reason": dict(sorted(retries.items())),
        "routing_reasons": dict(sorted(routed.items())),
        "attempts_per_request": _r(attempts / dispatched) if dispatched else 0.0,
        "max_inflight": cluster.max_inflight_total,
        "by_priority": by_priority,
        "by_tenant": by_tenant,
        "span_s": _r(span, 2),
        "wall_s": _r(wall_s, 2),
        "sim_requests_per_wall_s": _r(len(outs) / wall_s, 1) if wall_s else 0.0,
        # a thinned sample (at most 500 points, the fastest and slowest among them) of
        # the TTFT distribution, for plots
        "ttft_samples_s": [_r(t) for t in thinned(sorted(ttfts), SAMPLE_POINTS)],
    }
