"""Each gray scenario's pass criteria (see :mod:`kvgate.sim.scenarios`) as checks.

:func:`measure` reads, after one policy's run, the numbers a criterion needs that the
policy report lacks (``scenario_measures``: admit shares around the coordinator outage,
in-flight maxima, the other tenants' pooled TTFT p99). :func:`criteria` reads a scenario
report (``{scenario, variants}``, each variant a comparison report) and returns, per
policy, one check per criterion: measured ``value``, ``rel`` and ``threshold``, ``ok``.
:func:`format_criteria` prints them like the ordering check lines. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.sim.cluster import SimCluster
from kvgate.sim.report import pct, ttft
from kvgate.sim.scenarios import Plan, arrived_in, p0_admit_shares

__all__ = [
    "MAX_ATTEMPTS_PER_REQUEST",
    "OTHERS_TTFT_MAX_CHANGE",
    "P0_ADMIT_KEEP",
    "criteria",
    "format_criteria",
    "measure",
]

MAX_ATTEMPTS_PER_REQUEST = 1.2  # nodes_fail
P0_ADMIT_KEEP = 0.9  # coordinator_down: P0's admit share during / before the outage
OTHERS_TTFT_MAX_CHANGE = 0.2  # tenant_flood: |flood - no flood| / no flood, the others' p99
FLOOD_TENANT = "flood"  # the tenant tenant_flood adds


def measure(name: str, plan: Plan, cluster: SimCluster) -> dict[str, object]:
    """``{"scenario_measures": {...}}`` for one finished run of ``plan`` (scenario
    ``name``), or ``{}`` when its criteria read the report alone. Ends the probe's run."""
    out: dict[str, object] = {}
    run = plan.probe.end_run() if plan.probe is not None else None
    if name == "coordinator_down" and plan.probe is not None and plan.window is not None:
        assert run is not None
        before, during = p0_admit_shares(cluster, *plan.window)
        out = {
            "p0_admit_share_before": round(before, 4),
            "p0_admit_share_during": round(during, 4),
            "max_inflight_in_window": run.inflight_in_window,
            "budget": plan.probe.budget,
            # every admission during the outage, against the limit in force at its
            # gateway (the last lease while reused, then the safe limit)
            "admitted_in_window": run.admitted_in_window,
            "admitted_beyond_limit": max(0, run.admitted_over_limit),
            "admitted_in_safe_mode": run.admitted_in_safe_mode,
            "safe_mode_max_inuse": run.safe_mode_inuse,
            "safe_limit": plan.probe.budget // len(cluster.gateways),
            "p0_offered_during": len(arrived_in(cluster, *plan.window, priority=0)),
        }
    elif name == "tenant_flood" and plan.probe is not None:
        others = [
            t
            for o in cluster.outcomes.values()
            if o.req.tenant != FLOOD_TENANT and (t := ttft(o)) is not None
        ]
        out = {
            "others_ttft_p99_s": _round(pct(others, 0.99)),
            "flood_max_inflight": run.tenant_inflight.get(FLOOD_TENANT, 0) if run else 0,
            "quota": plan.probe.budget,
            "flood_requests": sum(
                1 for o in cluster.outcomes.values() if o.req.tenant == FLOOD_TENANT
            ),
        }
    elif name == "mass_eviction":
        warned = sum(ctl.stats.eviction_warnings for ctl in cluster.gateways)
        out = {
            **plan.fault,
            "announced": warned > 0,
            # index entries the gateways dropped when the eviction was done (approximate)
            "index_blocks_forgotten": sum(
                ctl.stats.eviction_blocks_forgotten for ctl in cluster.gateways
            ),
        }
    elif name == "traffic_double":
        # the doubled traffic is turned away at the budget, not let in beyond it
        out = {
            "max_inflight": cluster.max_inflight_total,
            "budget": plan.config.controller.admission.budget,
            **plan.fault,
        }
    elif name == "nodes_fail" and plan.window is not None:
        out = {**plan.fault, "requests_while_down": len(arrived_in(cluster, *plan.window))}
    return {"scenario_measures": out} if out else {}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _check(value: float | None, rel: str, threshold: float, note: str = "") -> dict[str, Any]:
    """A criterion; a value of None (nothing measured, e.g. no request completed)
    fails it."""
    ok = value is not None and {
        "<=": value <= threshold,
        "<": value < threshold,
        ">=": value >= threshold,
        ">": value > threshold,
        "==": value == threshold,
    }[rel]
    check: dict[str, Any] = {"value": value, "rel": rel, "threshold": threshold, "ok": ok}
    if note:
        check["note"] = note
    return check


def _exercised(count: int | None, note: str) -> dict[str, Any]:
    """The fault met traffic: a criterion over a fault nobody saw would hold vacuously
    (a one-request trace "held" every scenario)."""
    return _check(count, ">=", 1, note)


def _lost(report: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    ended = row["completed"] + row["rejected"] + row["failed"]
    return _check(report["requests"] - ended, "==", 0, "requests without an outcome")


def _policy_checks(
    name: str, variants: Mapping[str, Mapping[str, Any]], policy: str
) -> dict[str, Any]:
    """The checks of ``policy`` (a row in every variant) for scenario ``name``."""
    checks: dict[str, Any] = {}
    if name in ("mass_eviction", "tenant_flood"):  # two variants, compared
        pair = {
            "mass_eviction": ("announced", "unannounced"),
            "tenant_flood": ("flood", "no_flood"),
        }
        first, second = pair[name]
        a, b = variants[first]["policies"][policy], variants[second]["policies"][policy]
    else:
        report = variants[name]
        row = report["policies"][policy]
    if name == "p2_flood":
        p0 = row["by_priority"].get("P0", {})
        checks["p2_requests"] = _exercised(
            row["by_priority"].get("P2", {}).get("requests"), "P2 requests of the flood"
        )
        slo = row["slo"]["ttft_s"]
        checks["p0_ttft_p99_s"] = _check(p0.get("ttft_p99_s"), "<=", slo, "the TTFT SLO")
        checks["p0_completed"] = _check(
            p0.get("completed", 0), "==", p0.get("requests", 0), "every P0 request"
        )
    elif name == "nodes_fail":
        m = row.get("scenario_measures", {})
        checks["requests_while_down"] = _exercised(
            m.get("requests_while_down"),
            f"requests that came while {m.get('nodes_failed')} of {m.get('nodes')} nodes "
            "were down",
        )
        checks["attempts_per_request"] = _check(
            row["attempts_per_request"], "<=", MAX_ATTEMPTS_PER_REQUEST
        )
        checks["lost_requests"] = _lost(report, row)
    elif name == "coordinator_down":
        m = row["scenario_measures"]
        before = m["p0_admit_share_before"]
        checks["p0_offered_during"] = _exercised(
            m.get("p0_offered_during"), "P0 requests that came during the outage"
        )
        checks["p0_admit_share_during"] = _check(
            m["p0_admit_share_during"],
            ">=",
            round(P0_ADMIT_KEEP * before, 4),
            f"{P0_ADMIT_KEEP:.0%} of the share before the outage, {before:.4f}",
        )
        checks["max_inflight_in_window"] = _check(
            m["max_inflight_in_window"], "<=", m["budget"], "the budget C"
        )
        checks["admitted_beyond_limit"] = _check(
            m["admitted_beyond_limit"],
            "==",
            0,
            f"credits beyond its gateway's limit after any of the "
            f"{m['admitted_in_window']} admissions during the outage",
        )
        checks["safe_mode_max_inuse"] = _check(
            m["safe_mode_max_inuse"],
            "<=",
            m["safe_limit"],
            f"C / gateways, after any of the {m['admitted_in_safe_mode']} admissions "
            "in safe mode",
        )
    elif name == "mass_eviction":
        # with the pre-announcement against without it: both runs shown, no threshold,
        # once the fault was a mass eviction announced in the one run and not the other
        ma, mb = a.get("scenario_measures", {}), b.get("scenario_measures", {})
        flushed = ma.get("evicted_blocks")
        if not ma.get("announced"):
            why = (
                f"nothing announced: none of {ma['node']}'s {ma['cached_blocks']} cached "
                "blocks was free to evict"
                if flushed == 0 and "cached_blocks" in ma
                else "nothing announced"
            )
            announced = _check(0, ">=", 1, f"{why}; the two runs compare nothing")
        elif mb.get("announced"):
            announced = _check(0, ">=", 1, "the run without the announcement announced too")
        else:
            announced = _check(
                flushed,
                ">=",
                1,
                f"flushed of {ma['node']}'s {ma['cached_blocks']} cached blocks (pool "
                f"{ma['pool_blocks']}), announced first in the announced run only",
            )
        checks["announced_blocks"] = announced
        measured = a["completed"] > 0 and b["completed"] > 0
        note = "announced vs unannounced: both shown, no threshold"
        for key in ("ttft_p99_s", "hit_ratio"):
            checks[key] = {
                "value": a[key],
                "rel": "vs",
                "threshold": b[key],
                "ok": measured and announced["ok"],
                "note": note,
            }
    elif name == "tenant_flood":
        ma, mb = a["scenario_measures"], b["scenario_measures"]
        # a flood that never offered more than the quota did not test it
        checks["flood_requests"] = _check(
            ma.get("flood_requests"),
            ">",
            ma["quota"],
            "the flooding tenant's requests, more than its quota",
        )
        checks["flood_max_inflight"] = _check(
            ma["flood_max_inflight"], "<=", ma["quota"], "the flooding tenant's quota"
        )
        flood_p99, calm_p99 = ma["others_ttft_p99_s"], mb["others_ttft_p99_s"]
        # no change can be measured without both p99s (and a calm one above 0)
        change = (
            round(abs(flood_p99 - calm_p99) / calm_p99, 4)
            if flood_p99 is not None and calm_p99
            else None
        )
        checks["others_ttft_p99_change"] = _check(
            change,
            "<",
            OTHERS_TTFT_MAX_CHANGE,
            f"the other tenants' TTFT p99, {_seconds(flood_p99)} with the flood "
            f"against {_seconds(calm_p99)} without",
        )
    elif name == "traffic_double":
        m = row["scenario_measures"]
        checks["extra_requests"] = _exercised(
            m.get("extra_requests"), "requests added to double the traffic"
        )
        checks["lost_requests"] = _lost(report, row)
        checks["max_inflight"] = _check(m["max_inflight"], "<=", m["budget"], "the budget C")
    return checks


def _seconds(x: float | None) -> str:
    return "none measured" if x is None else f"{x:.4f} s"


def criteria(report: Mapping[str, Any]) -> dict[str, Any]:
    """Per policy of a scenario report, ``{"checks": {name: check}, "holds": bool}``."""
    name: str = report["scenario"]
    variants: Mapping[str, Mapping[str, Any]] = report["variants"]
    first = next(iter(variants.values()))
    out: dict[str, Any] = {}
    for policy in first["policies"]:
        checks = _policy_checks(name, variants, policy)
        out[policy] = {"checks": checks, "holds": all(c["ok"] for c in checks.values())}
    return out


def _number(x: float | None) -> str:
    if x is None:
        return "none"
    return str(x) if isinstance(x, int) else f"{x:.4f}"


_NEGATED = {"<=": ">", "<": ">=", ">=": "<", ">": "<=", "==": "!="}


def format_criteria(scenario: str, result: Mapping[str, Any]) -> str:
    """Console lines: per policy, one line per criterion (the ordering lines' style)."""
    lines = []
    for policy, r in result.items():
        lines.append(f"{scenario} pass criteria, {policy}: {'holds' if r['holds'] else 'FAILS'}")
        for key, c in r["checks"].items():
            mark = "ok  " if c["ok"] else "FAIL"
            if c["value"] is None and c["rel"] != "vs":
                tail = f"nothing measured; needs {c['rel']} {_number(c['threshold'])}"
            else:
                rel = c["rel"] if c["ok"] or c["rel"] == "vs" else _NEGATED[c["rel"]]
                tail = f"{rel} {_number(c['threshold'])}"
            if "note" in c:
                tail += f" ({c['note']})"
            lines.append(f"  {mark} {key:<22} {_number(c['value']):>9}  {tail}")
    return "\n".join(lines)
