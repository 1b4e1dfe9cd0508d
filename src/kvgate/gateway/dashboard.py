"""The live dashboard: ``GET /dashboard`` (one HTML page) and ``GET /dashboard/state`` (JSON).

The page has no external assets: vanilla JS in ``static/dashboard.html`` renders the
state embedded in the page at once, then polls ``/dashboard/state`` every second.
It is read-only and served without the admin token (``server.dashboard: false`` turns
both routes off), so the state carries no secrets and less than the admin API: no API
keys, no admin token, no tenant keys, no node URLs (node ids only); of the tenants only
those with requests in flight or queued here, at most ``TENANTS_SHOWN`` of them, the
busiest first, and how many there are.

Key numbers have stable element ids for scripts and tests::

    requests-total, requests-completed, requests-failed, requests-cancelled,
    requests-rejected, requests-inflight, requests-queued, retries-total,
    lease-state, c-eff, lease-total, degraded, breaker-state,
    hit-ratio-<bucket>-predicted, hit-ratio-<bucket>-measured   (bucket: lt1k, 1k_4k, ...)
    class-P0-inuse, class-P0-queued, class-P0-cap, class-P0-rejected (P1, P2 alike)
"""

from __future__ import annotations

import json
import logging
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvgate.core.config import PREFIX_BUCKETS
from kvgate.edge import get_route_adder, json_response
from kvgate.gateway.admin import admission_view, decisions_view, nodes_view
from kvgate.protocol import server_error_body

if TYPE_CHECKING:
    from kvgate.gateway.app import Gateway

log = logging.getLogger("kvgate.gateway.dashboard")

STATE_PLACEHOLDER = "/*__KVGATE_STATE__*/null"
DECISIONS_SHOWN = 20
TENANTS_SHOWN = 50  # the state is polled every second: bounded whatever the tenants
_BUCKET_LABELS = {"lt1k": "< 1k", "1k_4k": "1k - 4k", "4k_16k": "4k - 16k", "ge16k": ">= 16k"}


def _page_template() -> str | None:
    """The page, or None when the package was installed without its static file."""
    try:
        path = resources.files("kvgate.gateway") / "static" / "dashboard.html"
        return path.read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        log.error("dashboard page missing (kvgate/gateway/static/dashboard.html was not "
                  "installed); /dashboard answers 503, /dashboard/state still works")
        return None


def dashboard_state(gw: Gateway) -> dict[str, Any]:
    """Everything the page shows, as JSON (no secrets)."""
    now = gw.clock()
    ctl = gw.controller
    st = ctl.stats
    rejected = sum(st.rejects.values())
    finished = sum(st.outcomes.values())
    adm = admission_view(ctl.admission.stats())
    adm["tenants"], adm["tenants_active"] = busiest_tenants(adm["tenants"], TENANTS_SHOWN)
    hit_ratio: list[dict[str, Any]] = []
    for name, _ in PREFIX_BUCKETS:
        hc = st.hits[name]
        hit_ratio.append({
            "bucket": name,
            "label": _BUCKET_LABELS.get(name, name),
            "predicted": round(hc.predicted_ratio, 4),
            "measured": round(hc.measured_ratio, 4),
            "prompt_tokens": hc.prompt_tokens,
            "predicted_hit_tokens": hc.predicted_hit_tokens,
            "measured_prompt_tokens": hc.measured_prompt_tokens,
            "measured_hit_tokens": hc.measured_hit_tokens,
        })
    total_prompt = sum(h["prompt_tokens"] for h in hit_ratio)
    total_measured = sum(h["measured_prompt_tokens"] for h in hit_ratio)
    return {
        "gateway_id": gw.gateway_id,
        "policy": gw.config.routing.policy,
        "time": time.time(),
        "requests": {
            "total": finished + rejected,
            "completed": st.outcomes.get("completed", 0),
            "failed": st.outcomes.get("failed", 0),
            "cancelled": st.outcomes.get("cancelled", 0),
            "rejected": rejected,
            "inflight": ctl.in_flight(),
            "queued": ctl.admission.queued_total,
            "retries": sum(st.retries.values()),
            "client_disconnects": gw.metrics.client_disconnects,
            "eviction_warnings": st.eviction_warnings,
            "confined_dispatches": st.confined_dispatches,
        },
        "routed": dict(sorted(st.routed.items())),
        "rejects": dict(sorted(st.rejects.items())),
        "failures": dict(sorted(st.failures.items())),
        "hit_ratio": hit_ratio,
        "hit_ratio_total": {
            "predicted": round(sum(h["predicted_hit_tokens"] for h in hit_ratio) / total_prompt,
                               4) if total_prompt else 0.0,
            "measured": round(sum(h["measured_hit_tokens"] for h in hit_ratio) / total_measured,
                              4) if total_measured else 0.0,
        },
        # node URLs are the admin API's (an internal address, a user name)
        "nodes": nodes_view(gw, now, with_url=False),
        "admission": adm,
        "decisions": decisions_view(gw, now, DECISIONS_SHOWN),
    }


def busiest_tenants(
    tenants: dict[str, dict[str, Any]], limit: int
) -> tuple[dict[str, dict[str, Any]], int]:
    """The tenants with requests in flight or queued (an idle one's lease stays a
    minute), the busiest first (then by name), at most ``limit``; and how many such
    tenants there are. A gateway of 500 tenants wrote 48 kB a second, growing."""
    active = [(t, v) for t, v in tenants.items() if v["inflight"] or v["queued"]]
    active.sort(key=lambda tv: (-(tv[1]["inflight"] + tv[1]["queued"]), tv[0]))
    return dict(active[:limit]), len(active)


def _embed(state: dict[str, Any]) -> str:
    """JSON safe inside a <script> element (no ``</script>``, no ``<!--``)."""
    text = json.dumps(state, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class Dashboard:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._template = _page_template()

    async def page(self, request: web.Request) -> web.StreamResponse:
        if self._template is None:
            return json_response(503, server_error_body(
                "The dashboard page is not installed; GET /dashboard/state has its data.",
                code="dashboard_missing"))
        html = self._template.replace(STATE_PLACEHOLDER, _embed(dashboard_state(self.gw)), 1)
        return web.Response(
            body=html.encode("utf-8"),
            headers={
                "Content-Type": "text/html; charset=utf-8",
                "Cache-Control": "no-store",
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
                "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )

    async def state(self, request: web.Request) -> web.StreamResponse:
        resp = json_response(200, dashboard_state(self.gw))
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp


def register_dashboard(app: web.Application, gw: Gateway) -> None:
    """Add ``GET /dashboard`` and ``GET /dashboard/state`` (no auth: read-only, no secrets)."""
    dash = Dashboard(gw)
    get = get_route_adder(app.router, gw.config.server.client_max_size)
    get("/dashboard", dash.page)
    get("/dashboard/", dash.page)
    get("/dashboard/state", dash.state)
