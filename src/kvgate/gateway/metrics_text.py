"""Prometheus text exposition of the gateway (``GET /metrics``).

Every metric name is declared once, in :data:`FAMILIES`, with the ``kvgate_``
prefix; :func:`render` builds the page from the controller's counters
(``controller.stats``), the admission snapshot (``controller.admission.stats()``),
the node table, the node watcher and the gateway's own timers
(:class:`GatewayMetrics`). Labels come from small closed sets (reasons, buckets,
classes, node ids, configured tenants), never from request data.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvgate.core.admission import BreakerState, LeaseState, Priority
from kvgate.core.controller import Controller
from kvgate.core.ids import NodeId
from kvgate.gateway.node_watcher import NodeWatcher


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("kvgate_requests_total", "counter",
               "Requests the core handled, by terminal outcome: completed, failed, cancelled, "
               "or rejected (by admission, or before it, e.g. a prompt too long for every "
               "node); requests refused at parsing (bad JSON, unknown model) are not here."),
        Family("kvgate_rejections_total", "counter", "Requests rejected, by reason."),
        Family("kvgate_routing_decisions_total", "counter", "Routing decisions, by reason."),
        Family("kvgate_retries_total", "counter",
               "Gateway retries on another node, by the failure that caused them."),
        Family("kvgate_upstream_failures_total", "counter", "Failed attempts at nodes, by kind."),
        Family("kvgate_upstream_attempts_total", "counter", "Attempts sent to each node."),
        Family("kvgate_eviction_warnings_total", "counter",
               "Bulk-eviction announcements received from nodes."),
        Family("kvgate_eviction_blocks_forgotten_total", "counter",
               "Index blocks dropped when an announced eviction was done (approximate mode)."),
        Family("kvgate_tenant_confined_dispatches_total", "counter",
               "Requests of a tenant pressing its quota sent only to the nodes it held."),
        Family("kvgate_upstream_resends_total", "counter",
               "Requests sent once more, on a new connection, after a pooled keep-alive "
               "connection to the node turned out closed before any answer."),
        Family("kvgate_node_refusal_backoffs_total", "counter",
               "Times a node that kept refusing requests was left out of routing a while."),
        Family("kvgate_prompt_tokens_total", "counter",
               "Prompt tokens by prefix-length bucket; source=predicted counts every routed "
               "request, source=measured those whose engine reported cached_tokens (a "
               "usage without them counts as 0 once the node has stated them)."),
        Family("kvgate_cached_tokens_total", "counter",
               "Prompt tokens found cached: predicted by the index, or measured by the "
               "engines (usage.prompt_tokens_details.cached_tokens); source=checked is "
               "the predicted of requests whose engine stated them, source=confirmed "
               "how many of those it found (confirmed / checked: the index's precision)."),
        Family("kvgate_prefix_hit_ratio", "gauge",
               "cached / prompt tokens by prefix-length bucket and source."),
        Family("kvgate_decision_latency_seconds", "histogram",
               "Time spent in the core's on_arrival (admission + routing)."),
        Family("kvgate_queue_wait_seconds", "histogram",
               "Time held requests waited in the local admission queue."),
        Family("kvgate_queue_depth", "gauge", "Requests waiting in the admission queue, by class."),
        Family("kvgate_admission_admitted_total", "counter", "Admissions by class."),
        Family("kvgate_admission_bypass_admitted_total", "counter", "Bypass-lane admissions."),
        Family("kvgate_admission_rejected_total", "counter",
               "Rejections by reason and class: stage 1, and routing finding no node "
               "(overloaded)."),
        Family("kvgate_admission_inflight", "gauge", "Credits in use, by class."),
        Family("kvgate_admission_class_cap", "gauge", "Per-class ceiling inside the lease."),
        Family("kvgate_tenant_inflight", "gauge", "In-flight requests by tenant."),
        Family("kvgate_tenant_queued", "gauge", "Queued requests by tenant."),
        Family("kvgate_tenant_limit", "gauge", "Tenant concurrency granted to this gateway."),
        Family("kvgate_lease_state", "gauge", "Quota-book state (1 for the current state)."),
        Family("kvgate_lease_credits", "gauge", "Credits this gateway may have in flight."),
        Family("kvgate_capacity_effective", "gauge",
               "C_eff = min(budget, healthy nodes' capacity)."),
        Family("kvgate_degraded", "gauge", "1 while admission runs in a degraded mode."),
        Family("kvgate_breaker_state", "gauge", "Cluster breaker state (1 for the current)."),
        Family("kvgate_bypass_inflight", "gauge", "Bypass-lane credits in use."),
        Family("kvgate_bypass_limit", "gauge", "Bypass-lane credits available."),
        Family("kvgate_coordinator_refreshes_total", "counter", "Lease refreshes attempted."),
        Family("kvgate_coordinator_refresh_errors_total", "counter", "Lease refreshes failed."),
        Family("kvgate_coordinator_refresh_seconds", "histogram", "Lease refresh latency."),
        Family("kvgate_coordinator_refresh_conflicts_total", "counter",
               "Lease refreshes re-run because another gateway's refresh committed first "
               "(Redis coordinator)."),
        Family("kvgate_lease_loop_errors_total", "counter",
               "Unexpected errors in the gateway's lease loop (bugs; see the log)."),
        Family("kvgate_node_healthy", "gauge", "1 when the node takes traffic."),
        Family("kvgate_node_report_age_seconds", "gauge",
               "Age of the node's last load report (-1 = never reported)."),
        Family("kvgate_node_queue", "gauge",
               "Routing queue signal: reported waiting + own sends since the report."),
        Family("kvgate_node_running", "gauge", "Running requests the node last reported."),
        Family("kvgate_node_kv_usage", "gauge", "KV cache usage (0-1) the node last reported."),
        Family("kvgate_node_inflight", "gauge", "This gateway's requests in flight on the node."),
        Family("kvgate_node_cache_weight", "gauge", "Cache-bonus weight (<1 while evicting)."),
        Family("kvgate_node_scrape_errors_total", "counter", "Failed node probes, by kind."),
        Family("kvgate_kv_event_batches_total", "counter",
               "KV event batches from a node (precise mode), by kind: received, missed "
               "(sequence gaps), restarts, malformed, no_model, cleared."),
        Family("kvgate_kv_event_routing_learns", "gauge",
               "1 while a node's KV events bring orphans and routing teaches the index "
               "about it too (precise mode)."),
        Family("kvgate_kv_event_blocks_total", "counter",
               "Blocks named by a node's KV events (precise mode), by kind: stored, removed, "
               "orphan, forgotten, extra_keys, unknown_removed, other_medium, "
               "bad_block_size, unnamed_lora."),
        Family("kvgate_http_responses_total", "counter", "Responses by endpoint and status."),
        Family("kvgate_client_disconnects_total", "counter",
               "Clients that went away before their answer was complete."),
    )
}

LATENCY_BUCKETS = (
    2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REFRESH_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class GatewayMetrics:
    """The gateway's own timers and counters (the core keeps the rest)."""

    def __init__(self) -> None:
        self.decision_latency = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(WAIT_BUCKETS)
        self.refresh_latency = Histogram(REFRESH_BUCKETS)
        self.responses: Counter[tuple[str, int]] = Counter()
        self.attempts: Counter[str] = Counter()
        self.client_disconnects = 0
        # the lease loop's own failures (a bug, not the coordinator's: that is a failed
        # refresh), and a shared coordinator's optimistic retries (set by the gateway)
        self.lease_loop_errors = 0
        self.coordinator_conflicts: Callable[[], int] = lambda: 0
        # requests the lean client sent again after a pooled connection turned out dead
        self.upstream_resends: Callable[[], int] = lambda: 0


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    parts = []
    for k, v in labels.items():
        v = v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{k}="{v}"')
    return "{" + ",".join(parts) + "}"


class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def declare(self, name: str) -> None:
        if name not in self._seen:
            fam = FAMILIES[name]  # KeyError = an undeclared metric name: our bug
            self._seen.add(name)
            self.lines.append(f"# HELP {name} {fam.help}")
            self.lines.append(f"# TYPE {name} {fam.kind}")

    def add(self, name: str, value: float, **labels: str) -> None:
        self.declare(name)
        self.lines.append(f"{name}{_labels(labels)} {_fmt(value)}")

    def counter_map(self, name: str, label: str, values: Mapping[str, int]) -> None:
        self.declare(name)
        for key in sorted(values):
            self.add(name, values[key], **{label: key})

    def histogram(self, name: str, h: Histogram) -> None:
        self.declare(name)
        running = 0
        for bound, n in zip(h.bounds, h.counts, strict=False):
            running += n
            self.lines.append(f'{name}_bucket{{le="{bound!r}"}} {running}')
        self.lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
        self.lines.append(f"{name}_sum {_fmt(h.sum)}")
        self.lines.append(f"{name}_count {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _class(p: int) -> str:
    return f"P{p}"


def render(controller: Controller, watcher: NodeWatcher, own: GatewayMetrics, now: float) -> str:
    page = _Page()
    st = controller.stats
    outcomes = dict(st.outcomes)
    outcomes["rejected"] = sum(st.rejects.values())
    page.counter_map("kvgate_requests_total", "outcome", outcomes)
    page.counter_map("kvgate_rejections_total", "reason", st.rejects)
    page.counter_map("kvgate_routing_decisions_total", "reason", st.routed)
    page.counter_map("kvgate_retries_total", "kind", st.retries)
    page.counter_map("kvgate_upstream_failures_total", "kind", st.failures)
    page.counter_map("kvgate_upstream_attempts_total", "node", own.attempts)
    page.add("kvgate_eviction_warnings_total", st.eviction_warnings)
    page.add("kvgate_eviction_blocks_forgotten_total", st.eviction_blocks_forgotten)
    page.add("kvgate_tenant_confined_dispatches_total", st.confined_dispatches)
    page.add("kvgate_node_refusal_backoffs_total", controller.refusals.backoffs)
    page.add("kvgate_upstream_resends_total", own.upstream_resends())
    for bucket, hc in st.hits.items():
        page.add("kvgate_prompt_tokens_total", hc.prompt_tokens, bucket=bucket, source="predicted")
        page.add("kvgate_prompt_tokens_total", hc.measured_prompt_tokens, bucket=bucket,
                 source="measured")
    for bucket, hc in st.hits.items():
        page.add("kvgate_cached_tokens_total", hc.predicted_hit_tokens, bucket=bucket,
                 source="predicted")
        page.add("kvgate_cached_tokens_total", hc.measured_hit_tokens, bucket=bucket,
                 source="measured")
        page.add("kvgate_cached_tokens_total", hc.checked_predicted_tokens, bucket=bucket,
                 source="checked")
        page.add("kvgate_cached_tokens_total", hc.confirmed_hit_tokens, bucket=bucket,
                 source="confirmed")
    for bucket, hc in st.hits.items():
        page.add("kvgate_prefix_hit_ratio", hc.predicted_ratio, bucket=bucket, source="predicted")
        page.add("kvgate_prefix_hit_ratio", hc.measured_ratio, bucket=bucket, source="measured")
    page.histogram("kvgate_decision_latency_seconds", own.decision_latency)
    page.histogram("kvgate_queue_wait_seconds", own.queue_wait)
    _admission(page, controller)
    page.add("kvgate_coordinator_refreshes_total", controller.admission.stats().refreshes)
    page.add("kvgate_coordinator_refresh_errors_total",
             controller.admission.stats().refresh_failures)
    page.histogram("kvgate_coordinator_refresh_seconds", own.refresh_latency)
    page.add("kvgate_coordinator_refresh_conflicts_total", own.coordinator_conflicts())
    page.add("kvgate_lease_loop_errors_total", own.lease_loop_errors)
    _nodes(page, controller, watcher, now)
    page.declare("kvgate_http_responses_total")
    for (endpoint, code), n in sorted(own.responses.items()):
        page.add("kvgate_http_responses_total", n, endpoint=endpoint, code=str(code))
    page.add("kvgate_client_disconnects_total", own.client_disconnects)
    return page.text()


def _admission(page: _Page, controller: Controller) -> None:
    a = controller.admission.stats()
    for p in Priority:
        page.add("kvgate_queue_depth", a.queued[p], **{"class": _class(p)})
    for p in Priority:
        page.add("kvgate_admission_admitted_total", a.admitted[p], **{"class": _class(p)})
    page.add("kvgate_admission_bypass_admitted_total", a.bypass_admitted)
    page.declare("kvgate_admission_rejected_total")
    for (reason, p), n in sorted(a.rejected.items()):
        page.add("kvgate_admission_rejected_total", n, reason=reason.value,
                 **{"class": _class(p)})
    for p in Priority:
        page.add("kvgate_admission_inflight", a.inuse[p], **{"class": _class(p)})
    for p in Priority:
        page.add("kvgate_admission_class_cap", a.class_caps[p], **{"class": _class(p)})
    page.counter_map("kvgate_tenant_inflight", "tenant", a.tenant_inflight)
    page.counter_map("kvgate_tenant_queued", "tenant", a.tenant_queued)
    page.counter_map("kvgate_tenant_limit", "tenant", a.tenant_limits)
    for state in LeaseState:
        page.add("kvgate_lease_state", int(a.lease_state is state), state=state.value)
    page.add("kvgate_lease_credits", a.lease_total)
    page.add("kvgate_capacity_effective", a.c_eff)
    page.add("kvgate_degraded", int(a.degraded))
    for bstate in BreakerState:
        page.add("kvgate_breaker_state", int(a.breaker_state is bstate), state=bstate.value)
    page.add("kvgate_bypass_inflight", a.bypass_inuse)
    page.add("kvgate_bypass_limit", a.bypass_limit)


def _nodes(page: _Page, controller: Controller, watcher: NodeWatcher, now: float) -> None:
    table = controller.nodes
    states = sorted(table, key=lambda s: s.spec.node_id)
    for s in states:
        page.add("kvgate_node_healthy", int(s.healthy and not s.draining), node=s.spec.node_id)
    for s in states:
        age = -1.0 if s.report_time is None else max(0.0, now - s.report_time)
        page.add("kvgate_node_report_age_seconds", round(age, 3), node=s.spec.node_id)
    for s in states:
        page.add("kvgate_node_queue", table.queue(s, now), node=s.spec.node_id)
    for s in states:
        page.add("kvgate_node_running", s.reported_running, node=s.spec.node_id)
    for s in states:
        page.add("kvgate_node_kv_usage", s.kv_util, node=s.spec.node_id)
    for s in states:
        page.add("kvgate_node_inflight", s.inflight, node=s.spec.node_id)
    for s in states:
        page.add("kvgate_node_cache_weight", s.cache_weight, node=s.spec.node_id)
    page.declare("kvgate_node_scrape_errors_total")
    for node_id, kind, n in watcher.error_counts():
        page.add("kvgate_node_scrape_errors_total", n, node=node_id, kind=kind)
    batches, blocks = watcher.kv_event_counts()
    page.declare("kvgate_kv_event_batches_total")
    for node_id, kind, n in batches:
        page.add("kvgate_kv_event_batches_total", n, node=node_id, kind=kind)
    page.declare("kvgate_kv_event_blocks_total")
    for node_id, kind, n in blocks:
        page.add("kvgate_kv_event_blocks_total", n, node=node_id, kind=kind)
    page.declare("kvgate_kv_event_routing_learns")
    for node_id in sorted({row[0] for row in batches}):
        page.add("kvgate_kv_event_routing_learns",
                 int(NodeId(node_id) in controller.routing_learns), node=node_id)
