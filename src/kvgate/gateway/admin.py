"""The admin API under ``/admin``: inspect and change a running gateway.

Every route needs ``Authorization: Bearer <server.admin_token>``; a missing or wrong
token is a 401 with an OpenAI-shaped body, and a gateway with no admin token
configured answers 403 on every admin route (the API is off, not open)::

    GET    /admin/nodes               every node: health, drain, load, index, spec
    POST   /admin/nodes               {"url", "id"?, "capacity"?, ...} add (probed first)
    GET    /admin/nodes/{id}          one node
    DELETE /admin/nodes/{id}          remove
    POST   /admin/nodes/{id}/drain    {"draining": true|false} (default true)
    GET    /admin/config              the configuration as loaded at start-up, secrets
                                      redacted (membership now: GET /admin/nodes)
    GET    /admin/admission           the admission snapshot (lease, classes, tenants)
    GET    /admin/decisions?limit=N   recent routing decisions with their reasons

The view builders (:func:`node_view`, :func:`admission_view`, :func:`decision_view`)
are shared with the dashboard, which shows the same facts without secrets. Every
controller call happens on the event loop's thread, between awaits.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvgate.core.admission import AdmissionStats, Priority
from kvgate.core.errors import AuthError, ClientRequestError, ConfigError, KvgateError
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState
from kvgate.core.stats import DecisionRecord
from kvgate.edge import expect_handler, get_route_adder, json_response
from kvgate.gateway.body import read_body
from kvgate.gateway.config import GatewayConfig, url_key
from kvgate.gateway.config_load import parse_node
from kvgate.gateway.errors import refusing
from kvgate.gateway.redact import REDACTED, redact_url

if TYPE_CHECKING:
    from kvgate.gateway.app import Gateway

DECISIONS_DEFAULT = 50


class AdminDisabled(KvgateError):
    """No admin token is configured: the admin API is off."""

    http_status = 403
    error_type = "permission_error"


class NotFound(ClientRequestError):
    http_status = 404


class Conflict(ClientRequestError):
    http_status = 409


# ----------------------------------------------------------------------------- views


def _class(p: int) -> str:
    return f"P{p}"


def node_view(
    gw: Gateway, state: NodeState, now: float, *, with_url: bool = True
) -> dict[str, Any]:
    """One node as the admin API and the dashboard show it (no secrets; the dashboard,
    served without auth, without its URL)."""
    table = gw.controller.nodes
    node_id = state.spec.node_id
    rt = gw.watcher.get(node_id)
    spec = state.spec
    age = None if state.report_time is None else round(max(0.0, now - state.report_time), 3)
    view: dict[str, Any] = {"id": node_id}
    if with_url:
        view["url"] = redact_url(rt.url) if rt is not None else None
    return view | {
        "healthy": state.healthy,
        "draining": state.draining,
        "eligible": state.healthy and not state.draining,
        "load": {
            "waiting": state.reported_waiting,
            "running": state.reported_running,
            "kv_usage": round(state.kv_util, 4),
            "report_age_s": age,
            "stale": table.is_stale(state, now),
            "inflight": state.inflight,
            "sent_since_report": state.sent_since_report,
            "queue": table.queue(state, now),
            "cache_weight": state.cache_weight,
            "consecutive_failures": state.consecutive_failures,
        },
        "index": {
            "entries": gw.controller.index.node_entries(node_id),
            "speculative": gw.controller.index.speculative_entries(node_id),
            # precise mode: its events bring orphans, so routing teaches the index too
            "routing_learns": node_id in gw.controller.routing_learns,
        },
        "spec": {
            "models": sorted(spec.models),
            "max_model_len": spec.max_model_len,
            "capacity": spec.capacity,
            "cache_blocks": spec.cache_blocks,
        },
        "probe_errors": dict(rt.errors) if rt is not None else {},
    }


def nodes_view(gw: Gateway, now: float, *, with_url: bool = True) -> list[dict[str, Any]]:
    states = sorted(gw.controller.nodes, key=lambda s: s.spec.node_id)
    return [node_view(gw, s, now, with_url=with_url) for s in states]


def admission_view(a: AdmissionStats) -> dict[str, Any]:
    """``controller.admission.stats()`` as JSON (classes keyed P0/P1/P2)."""
    rejected: dict[str, dict[str, int]] = {}
    for (reason, p), n in sorted(a.rejected.items()):
        rejected.setdefault(reason.value, {})[_class(p)] = n
    classes = {
        _class(p): {
            "inuse": a.inuse[p],
            "queued": a.queued[p],
            "cap": a.class_caps[p],
            "ceiling": a.ceilings[p],
            "admitted": a.admitted[p],
            "rejected": sum(n for (_, q), n in a.rejected.items() if q == p),
        }
        for p in Priority
    }
    tenants = sorted(set(a.tenant_inflight) | set(a.tenant_queued) | set(a.tenant_limits))
    return {
        "gateway_id": a.gateway_id,
        "lease_state": a.lease_state.value,
        "degraded": a.degraded,
        "epoch": a.epoch,
        "c_eff": a.c_eff,
        "lease_total": a.lease_total,
        "inuse_total": a.inuse_total,
        "p0_reserve": a.p0_reserve,
        "breaker": {"state": a.breaker_state.value, "reason": a.breaker_reason},
        "bypass": {"inuse": a.bypass_inuse, "limit": a.bypass_limit,
                   "admitted": a.bypass_admitted},
        "classes": classes,
        "tenants": {
            t: {
                "inflight": a.tenant_inflight.get(t, 0),
                "queued": a.tenant_queued.get(t, 0),
                "limit": a.tenant_limits.get(t),
            }
            for t in tenants
        },
        "counters": {
            "admitted": sum(a.admitted),
            "bypass_admitted": a.bypass_admitted,
            "rejected": sum(a.rejected.values()),
            "refreshes": a.refreshes,
            "refresh_failures": a.refresh_failures,
        },
        "rejected": rejected,
    }


def decision_view(d: DecisionRecord, now: float) -> dict[str, Any]:
    return {
        "request_id": d.request_id,
        "node": d.node_id,
        "reason": d.reason,
        "matched_blocks": d.matched_blocks,
        "best_matched_blocks": d.best_matched_blocks,
        "score": round(d.score, 4),
        "attempt": d.attempt,
        "age_s": round(max(0.0, now - d.at), 3),
    }


def decisions_view(gw: Gateway, now: float, limit: int) -> list[dict[str, Any]]:
    """The most recent routing decisions, newest first."""
    recent = list(gw.controller.stats.recent)[-limit:] if limit > 0 else []
    return [decision_view(d, now) for d in reversed(recent)]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # strict JSON has no Infinity / NaN (validation keeps them out)
    return value


def redacted_config(config: GatewayConfig) -> dict[str, Any]:
    """The configuration as JSON with every secret replaced by ``***``: the admin token,
    the API keys (kept as entries so their tenants and caps stay visible), the
    nodes' API keys and the passwords in the nodes' URLs and in ``admission.redis_url``."""
    out: dict[str, Any] = _plain(config)
    server = out["server"]
    if server.get("admin_token") is not None:
        server["admin_token"] = REDACTED
    for node in out["nodes"]["static"]:
        if node.get("api_key") is not None:
            node["api_key"] = REDACTED
        node["url"] = redact_url(node["url"])
    out["admission"]["redis_url"] = redact_url(out["admission"]["redis_url"])
    keys = out["auth"]["keys"]
    out["auth"]["keys"] = [{"key": REDACTED, **spec} for _, spec in sorted(keys.items(),
                           key=lambda kv: (kv[1]["tenant"], kv[0]))]
    return out


# ----------------------------------------------------------------------------- handlers


class AdminApi:
    """The handlers; one per gateway, registered by :func:`register_admin`."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        token = gw.config.server.admin_token
        self._token = token.encode("utf-8") if token else None

    def check(self, request: web.Request) -> None:
        if self._token is None:
            raise AdminDisabled("admin API disabled: set server.admin_token",
                                code="admin_disabled")
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.strip().partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "surrogatepass"), self._token
        )
        if not ok:
            raise AuthError(
                "The admin API needs Authorization: Bearer <server.admin_token>."
                if not auth else "Incorrect admin token provided.",
                code="invalid_admin_token",
            )

    def _node(self, request: web.Request) -> NodeState:
        node_id = request.match_info["id"]
        state = self.gw.controller.nodes.get(NodeId(node_id))
        if state is None:
            raise NotFound(f"no node {node_id!r}", param="id", code="node_not_found")
        return state

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await read_body(request, self.gw.config.server.body_timeout_s)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ClientRequestError(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ClientRequestError("the body must be a JSON object")
        return body

    async def list_nodes(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        gw = self.gw
        now = gw.clock()
        return json_response(200, {
            "object": "list",
            "data": nodes_view(gw, now),
            "healthy": gw.watcher.healthy_count(),
        })

    async def get_node(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        return json_response(200, node_view(self.gw, self._node(request), self.gw.clock()))

    async def add_node(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        body = await self._body(request)
        try:
            config = parse_node(body, "node")
        except ConfigError as exc:
            raise ClientRequestError(exc.message, param=exc.param) from exc
        gw = self.gw
        if NodeId(config.id) in gw.controller.nodes or gw.watcher.get(config.id) is not None:
            raise Conflict(f"node {config.id!r} already exists; DELETE it first",
                           param="id", code="node_exists")
        # one engine under two ids: its capacity counted twice, its cache split (the
        # static config refuses it too)
        key = url_key(config.url)  # however it is spelt (LOCALHOST, :08000)
        if same := next((rt for rt in gw.watcher.nodes.values() if url_key(rt.url) == key),
                        None):
            raise Conflict(f"node {same.node_id!r} already has url {redact_url(same.url)}; "
                           "DELETE it first", param="url", code="node_exists")
        # the watcher completes the add even if this handler is cancelled (client gone)
        rt = await gw.watcher.add(config)
        state = gw.controller.nodes.get(NodeId(config.id))
        if state is None or gw.watcher.get(config.id) is not rt:
            # removed (maybe even added again by another call) while it was being probed
            raise Conflict(f"node {config.id!r} was removed while being added", param="id")
        return json_response(201, node_view(gw, state, gw.clock()))

    async def remove_node(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        node_id = request.match_info["id"]
        if not await self.gw.watcher.remove(NodeId(node_id)):
            if NodeId(node_id) not in self.gw.controller.nodes:
                raise NotFound(f"no node {node_id!r}", param="id", code="node_not_found")
            self.gw.controller.remove_node(NodeId(node_id), self.gw.clock())
        # its per-node series go (Prometheus marks them stale), or node-id churn would
        # grow the metrics page without bound
        self.gw.metrics.attempts.pop(node_id, None)
        return json_response(200, {"id": node_id, "deleted": True})

    async def drain_node(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        self._node(request)  # a 404 before the body is read
        body = await self._body(request)
        unknown = sorted(set(body) - {"draining"})
        if unknown:  # {"drainig": false} must not drain the node
            raise ClientRequestError(
                f"unknown key {unknown[0]!r}; the body is {{\"draining\": true|false}}",
                param=unknown[0],
            )
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise ClientRequestError("'draining' must be true or false", param="draining")
        # looked up again after reading the body: deleted (or replaced) meanwhile
        state = self._node(request)
        gw = self.gw
        gw.controller.set_draining(state.spec.node_id, draining, gw.clock())
        return json_response(200, node_view(gw, state, gw.clock()))

    async def config(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        return json_response(200, redacted_config(self.gw.config))

    async def admission(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        return json_response(200, admission_view(self.gw.controller.admission.stats()))

    async def decisions(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        text = request.query.get("limit", str(DECISIONS_DEFAULT))
        try:
            limit = int(text)
        except ValueError:
            limit = -1
        if limit < 0:
            raise ClientRequestError("'limit' must be an integer >= 0", param="limit")
        gw = self.gw
        return json_response(200, {"object": "list",
                                   "data": decisions_view(gw, gw.clock(), limit)})


def register_admin(app: web.Application, gw: Gateway) -> None:
    """Add the ``/admin`` routes (always registered; they answer 403 without a token)."""
    api = AdminApi(gw)
    r = app.router
    get = get_route_adder(r, gw.config.server.client_max_size)
    get("/admin/nodes", api.list_nodes)
    # 417 / 413 / 401 / 403 as JSON, and only then the 100: a caller without the token
    # is not invited to send its body
    expect = expect_handler(
        gw.config.server.client_max_size, refusing(api.check, AuthError, AdminDisabled)
    )
    r.add_post("/admin/nodes", api.add_node, expect_handler=expect)
    get("/admin/nodes/{id}", api.get_node)
    # every admin route checks the token before a 100 Continue (DELETE sent it to anyone)
    r.add_delete("/admin/nodes/{id}", api.remove_node, expect_handler=expect)
    r.add_post("/admin/nodes/{id}/drain", api.drain_node, expect_handler=expect)
    get("/admin/config", api.config)
    get("/admin/admission", api.admission)
    get("/admin/decisions", api.decisions)
