"""The quality bar as a check: does one policy beat the others in a comparison?

A comparison report (:func:`kvgate.sim.runner.compare`) holds one row per policy.
:func:`ordering` reads it the way the simulator's quality bar is written: the policy
under test (``kvgate`` by default) must have a strictly lower TTFT p99 and TTFT mean
and a strictly higher goodput than every other policy in the run, a load max/mean of
at most 1.5, a hit ratio at least the best cache-aware baseline's (a policy that
consults the cache index, ``uses_cache``), and at least 80 % of the pooled-LRU bound.
The hit-ratio check also says when the baseline's hit ratio is above the balanced
bound (:mod:`kvgate.sim.balanced_bound`): then no policy within the load limit can
match it, and the two checks conflict.
Each check names the policy it is measured against, so a failure says where a
baseline wins; a goodput check also carries both sides' SLO misses by kind and their
spans, so a lost goodput says whether the other policy met the SLO more often or only
finished its last request sooner; a TTFT check carries both sides' ``ttft_parts`` (the
slowest 1 % for p99, all requests for the mean), so a lost one says whether the
other's requests had less prefill of their own to do or waited less, in the node's
queue or in steps shared with other requests' work.
Pure: report in, JSON-able dict out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvgate.core.routing import POLICIES

__all__ = [
    "HIGHER_IS_BETTER",
    "LOAD_MAX_OVER_MEAN_LIMIT",
    "POOLED_LRU_SHARE",
    "decimals",
    "format_ordering",
    "format_tally",
    "ordering",
    "tally",
]

LOAD_MAX_OVER_MEAN_LIMIT = 1.5
POOLED_LRU_SHARE = 0.8

# the checks where a higher value is the better one (the others: latencies, load)
HIGHER_IS_BETTER = frozenset({"goodput_rps", "hit_ratio"})
# the checks ranked against every other policy, each with whether higher is better
_RANKED = tuple(
    (key, key in HIGHER_IS_BETTER) for key in ("ttft_p99_s", "ttft_mean_s", "goodput_rps")
)


def _uses_cache(name: str) -> bool:
    cls = POLICIES.get(name)
    return bool(cls is not None and cls.uses_cache)


def ordering(report: Mapping[str, Any], policy: str = "kvgate") -> dict[str, Any] | None:
    """The checks for ``policy`` against the other policies of ``report``, or None when
    the report lacks it or has nothing to compare it with."""
    rows: Mapping[str, Mapping[str, Any]] = report.get("policies", {})
    if policy not in rows or len(rows) < 2:
        return None
    ours = rows[policy]
    others = {name: row for name, row in rows.items() if name != policy}
    checks: dict[str, Any] = {}
    for key, higher in _RANKED:
        value = ours[key]
        ranked = sorted(others, key=lambda n: _rank_value(others[n][key], higher), reverse=higher)
        rival = ranked[0]  # the best of the others on this metric
        rival_value = others[rival][key]
        ok = value is not None and (
            _rank_value(value, higher) > _rank_value(rival_value, higher)
            if higher
            else _rank_value(value, higher) < _rank_value(rival_value, higher)
        )
        checks[key] = {"value": value, "against": rival, "other": rival_value, "ok": ok}
        if key == "goodput_rps":
            checks[key].update(_goodput_parts(ours, others[rival]))
        elif (group := _TTFT_GROUP.get(key)) is not None:
            checks[key].update(_ttft_parts(ours, others[rival], group))
    load = ours["load_max_over_mean"]
    checks["load_max_over_mean"] = {
        "value": load,
        "limit": LOAD_MAX_OVER_MEAN_LIMIT,
        "ok": load is not None and load <= LOAD_MAX_OVER_MEAN_LIMIT,
    }
    hit = ours["hit_ratio"]
    aware = [n for n in others if _uses_cache(n)]
    if aware:
        rival = max(aware, key=lambda n: _rank_value(others[n]["hit_ratio"], True))
        rival_hit = others[rival]["hit_ratio"]
        checks["hit_ratio"] = {
            "value": hit,
            "against": rival,
            "other": rival_hit,
            "ok": hit is not None and (rival_hit is None or hit >= rival_hit),
        }
        balanced = report["bounds"].get("balanced_hit_ratio")
        # above it, the baseline's hits cost load no balanced policy may spend (both
        # keys are always there, null without a bound, as the README lists them)
        checks["hit_ratio"]["balanced_bound"] = balanced
        checks["hit_ratio"]["other_beyond_balance"] = (
            rival_hit > balanced if balanced is not None and rival_hit is not None else None
        )
    pooled = report["bounds"]["pooled_lru_hit_ratio"]
    checks["hit_ratio_vs_pooled_lru"] = {
        "value": hit,
        "floor": round(POOLED_LRU_SHARE * pooled, 4),
        "ok": hit is not None and hit >= POOLED_LRU_SHARE * pooled,
    }
    return {
        "policy": policy,
        "checks": checks,
        "holds": all(c["ok"] for c in checks.values()),
    }


def _rank_value(value: float | None, higher: bool) -> float:
    """A metric for ranking: None (nothing measured, e.g. a latency with no completed
    request) ranks last, never as a perfect 0."""
    if value is None:
        return -math.inf if higher else math.inf
    return value


def _goodput_parts(ours: Mapping[str, Any], rival: Mapping[str, Any]) -> dict[str, Any]:
    """What a goodput comparison is made of, when the rows say: each side's SLO misses
    (``slo_misses``) and span (goodput is requests less misses over the span)."""
    parts: dict[str, Any] = {}
    if "slo_misses" in ours and "slo_misses" in rival:
        parts["misses"] = dict(ours["slo_misses"])
        parts["other_misses"] = dict(rival["slo_misses"])
    if "span_s" in ours and "span_s" in rival:
        parts["span_s"], parts["other_span_s"] = ours["span_s"], rival["span_s"]
    return parts


# the ttft_parts group each TTFT check reads
_TTFT_GROUP = {"ttft_p99_s": "slowest_1pct", "ttft_mean_s": "all"}


def _ttft_parts(ours: Mapping[str, Any], rival: Mapping[str, Any], group: str) -> dict[str, Any]:
    """Both sides' split of TTFT (``ttft_parts``, one group) when the rows have it."""
    if "ttft_parts" in ours and "ttft_parts" in rival:
        return {
            "parts": dict(ours["ttft_parts"][group]),
            "other_parts": dict(rival["ttft_parts"][group]),
        }
    return {}


def _why_ttft(policy: str, key: str, c: Mapping[str, Any]) -> list[str]:
    """Lines saying where a TTFT difference comes from: the requests' own prefill (long
    prompts, little cache) or the wait on top of it; none without the parts."""
    if "parts" not in c:
        return []
    group = (
        f"the slowest 1 % ({c['parts']['requests']} requests)"
        if key == "ttft_p99_s"
        else "all requests"
    )
    lines = [f"{group}, own prefill alone + wait on top of it:"]
    for name, p in ((policy, c["parts"]), (c["against"], c["other_parts"])):
        if not p["requests"]:
            lines.append(f"  {name:<20} none completed")
            continue
        # the wait's split, when the parts have it (a report of an earlier build does not)
        queued, slowed = p.get("queued_mean_s"), p.get("slowed_mean_s")
        split = (
            f"{queued:.3f} s queued, {slowed:.3f} s slowed; "
            if queued is not None and slowed is not None
            else ""
        )
        lines.append(
            f"  {name:<20} {p['prefill_mean_s']:.3f} s + {p['wait_mean_s']:.3f} s"
            f" ({split}{p['waited_over_5s']} waited over 5 s; {p['cached_share']:.1%} of"
            " prompt tokens cached)"
        )
    return lines


def _why_goodput(policy: str, c: Mapping[str, Any]) -> str | None:
    """A line saying where a goodput difference comes from: SLO misses (and which part
    of the SLO they missed) or, when both sides missed as many, the span alone."""
    if "misses" not in c:
        return None
    ours, theirs = c["misses"], c["other_misses"]

    def said(name: str, misses: Mapping[str, int]) -> str:
        total = sum(misses.values())
        kinds = ", ".join(f"{k} {n}" for k, n in misses.items() if n)
        return f"{name} {total}" + (f" ({kinds})" if kinds else "")

    line = f"SLO misses: {said(policy, ours)}; {said(c['against'], theirs)}"
    if "span_s" in c:
        line += f"; span {c['span_s']} s against {c['other_span_s']} s"
        if sum(ours.values()) == sum(theirs.values()):
            same_span = c["span_s"] == c["other_span_s"]
            line += " (a tie)" if same_span else " (as many misses: the span alone differs)"
    return line


# decimals shown per check (the table's precision)
_DECIMALS = {"ttft_p99_s": 3, "ttft_mean_s": 3, "goodput_rps": 3, "load_max_over_mean": 3}


def decimals(key: str) -> int:
    """The decimals a check's values are shown with (the table's precision)."""
    return _DECIMALS.get(key, 4)


def _shown(x: float | None, digits: int) -> str:
    return "none" if x is None else f"{x:.{digits}f}"


def format_ordering(result: Mapping[str, Any]) -> str:
    """A few console lines: one per check, with where a baseline wins."""
    policy = result["policy"]
    lines = [f"{policy} against the other policies: {'holds' if result['holds'] else 'FAILS'}"]
    for key, c in result["checks"].items():
        digits = decimals(key)
        mark = "ok  " if c["ok"] else "FAIL"
        value = _shown(c["value"], digits)
        if key == "hit_ratio":
            rel = ">=" if c["ok"] else "<"
            tail = f"{rel} {_shown(c['other'], 4)} (the best cache-aware baseline, {c['against']})"
            if c.get("other_beyond_balance"):
                tail += (
                    f"; above {c['balanced_bound']:.4f}, the most any policy with load"
                    f" max/mean <= {LOAD_MAX_OVER_MEAN_LIMIT} can hit"
                )
        elif "against" in c:
            rel = "beats" if c["ok"] else "does not beat"
            tail = f"{rel} {_shown(c['other'], digits)} (the best other policy, {c['against']})"
        elif "limit" in c:
            if c["value"] is None:
                tail = "no token processed: no load to balance"
            else:
                tail = f"<= {c['limit']}" if c["ok"] else f"> {c['limit']}"
        else:
            rel = ">=" if c["ok"] else "<"
            tail = f"{rel} {c['floor']:.4f} ({POOLED_LRU_SHARE:.0%} of the pooled-LRU bound)"
        lines.append(f"  {mark} {key.removesuffix('_vs_pooled_lru'):<20} {value:>9}  {tail}")
        why: list[str] = []
        if not c["ok"] and key == "goodput_rps" and (said := _why_goodput(policy, c)):
            why = [said]
        elif not c["ok"] and key in _TTFT_GROUP:
            why = _why_ttft(policy, key, c)
        lines.extend(f"       {'':<20} {'':>9}  {line}" for line in why)
    return "\n".join(lines)


def tally(results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Over several runs (speed-ups): per check, at how many of them it held."""
    held: dict[str, int] = {}
    for result in results:
        for key, c in result["checks"].items():
            held[key] = held.get(key, 0) + bool(c["ok"])
    return {"runs": len(results), "held": held, "all": sum(bool(r["holds"]) for r in results)}


def format_tally(summary: Mapping[str, Any], policy: str = "kvgate") -> str:
    runs = summary["runs"]
    parts = ", ".join(
        f"{key.replace('_vs_pooled_lru', ' vs pooled LRU')} {n}/{runs}"
        for key, n in summary["held"].items()
    )
    return f"{policy} against the other policies, checks held over {runs} runs: {parts}"
