"""The gateway's configuration: one frozen :class:`GatewayConfig`, validated once.

Sources, lowest precedence first (``config_load.load_config`` merges them):

1. the defaults below;
2. one YAML file (``--config FILE``), a mapping of sections::

       server: {host: 0.0.0.0, port: 8000, admin_token: s3cret}
       nodes:
         static:
           - http://10.0.0.1:8000                  # id = host:port
           - {id: b, url: http://10.0.0.2:8000, capacity: 32}
       routing: {policy: kvgate}
       admission: {budget: 128, tenant_quotas: {acme: 32}}
       auth:
         keys:
           sk-acme: {tenant: acme, max_priority: 1}
           sk-ops: {tenant: ops, max_priority: 0, bypass: true}

3. environment variables ``KVGATE_<SECTION>_<KEY>`` (upper case), e.g.
   ``KVGATE_SERVER_PORT=9000``, ``KVGATE_ADMISSION_BUDGET=64``,
   ``KVGATE_NODES_STATIC='[http://a:8000, http://b:8000]'``. The value is read as
   a YAML scalar or flow collection (``true``, ``1.5``, ``[a, b]``, ``{k: v}``),
   except for string keys, which take the text as is. Only the sections below are
   read; an unknown key inside one of them is an error, Kubernetes' service links
   (``KVGATE_SERVER_PORT=tcp://...`` for a Service ``kvgate-server``) are ignored;
4. command-line flags (``--host``, ``--port``, ``--node`` ...), see ``serve.py``.

Bad values raise :class:`~kvgate.core.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from kvgate.core.admission import (
    AdmissionConfig,
    ClassConfig,
    LeaseConfig,
    RetryBudget,
    SloConfig,
)
from kvgate.core.config import INDEX_MODES, ControllerConfig
from kvgate.core.errors import ConfigError
from kvgate.core.finite import first_nonfinite
from kvgate.core.nodes import NODE_INT_LIMIT
from kvgate.gateway.redact import redact_url

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SECTIONS = ("server", "upstream", "nodes", "routing", "admission", "auth")


def _frozen_map(value: Mapping[str, object]) -> Mapping[str, object]:
    return MappingProxyType(dict(value))


def _positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{section}.{key} must be > 0, got {value}", param=key)


def _finite(section: str, obj: object) -> None:
    """Every float knob of a section (and of its mappings, e.g. ``routing.params``) must be
    finite: ``.inf`` / ``.nan`` pass a ``> 0`` check but break timers and timeouts at run
    time, and cannot be shown as strict JSON."""
    if (bad := first_nonfinite(obj)) is not None:
        key, value = bad
        raise ConfigError(f"{section}.{key} must be a finite number, got {value}",
                          param=key.split(".", 1)[0])


DEFAULT_GATEWAY_ID = "gw0"  # with a redis coordinator, replaced by host-pid-random (app.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = an ephemeral port (tests)
    route_headers: bool = True  # X-Kvgate-Node / X-Kvgate-Route-Reason on responses
    admin_token: str | None = None  # bearer token of the admin API
    log_level: str = "info"
    access_log: bool = False
    # /dashboard and /dashboard/state, served without auth (off: both 404)
    dashboard: bool = True
    client_max_size: int = 16 * 1024 * 1024  # request bodies above it get 413
    body_timeout_s: float = 30.0  # a request body not read in this time gets 408
    # a connection must deliver a complete request head within this time of opening
    # or of its previous response (so also the idle keep-alive timeout), else it is
    # closed, after a 408 if part of a head came (slowloris)
    header_timeout_s: float = 30.0
    shutdown_timeout_s: float = 10.0  # graceful drain of in-flight requests on stop
    # on stop, first this long still listening with /ready at 503 and new requests
    # refused 503 shutting_down, so a load balancer (whose view lags) stops sending
    # here before the port closes; the stop then takes up to this + shutdown_timeout_s
    drain_delay_s: float = 0.0
    gateway_id: str = DEFAULT_GATEWAY_ID
    seed: int | None = None  # routing randomness (exploration); None = from the OS

    def __post_init__(self) -> None:
        _finite("server", self)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        if not self.host.strip():
            # aiohttp reads an empty host as every interface, while the start-up line
            # said 127.0.0.1: say 0.0.0.0 to mean that
            raise ConfigError("server.host must not be empty (0.0.0.0 listens on every "
                              "interface)", param="host")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"server.log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ConfigError("server.admin_token must be at least 8 characters")
        if self.admin_token is not None and self.admin_token != self.admin_token.strip():
            # clients' Authorization headers are trimmed: such a token could never match
            raise ConfigError("server.admin_token must not start or end with whitespace "
                              "(no client could send it: HTTP trims header values)",
                              param="admin_token")
        if not self.gateway_id:
            raise ConfigError("server.gateway_id must be non-empty")
        _positive("server", client_max_size=self.client_max_size,
                  shutdown_timeout_s=self.shutdown_timeout_s, body_timeout_s=self.body_timeout_s,
                  header_timeout_s=self.header_timeout_s)
        if self.drain_delay_s < 0:
            raise ConfigError(f"server.drain_delay_s must be >= 0, got {self.drain_delay_s}",
                              param="drain_delay_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0  # TCP connect to a node (CONNECT_ERROR past it)
    # streams: no byte from the node for this long (incl. headers), or none taken by
    # the client (it stopped reading): the stream ends
    stream_idle_timeout_s: float = 120.0
    # streams: the first data event (time to first token, prefill included) must come
    # within this; SSE comments (": keep-alive") before it do not extend it
    first_event_timeout_s: float = 300.0
    request_timeout_s: float = 600.0  # non-streamed requests: the whole answer
    pool_limit: int = 1024  # pooled upstream connections, all nodes together
    max_response_bytes: int = 64 * 1024 * 1024  # a non-streamed answer larger is a 502
    forward_priority: bool = True  # write the class into the body's `priority` (vLLM
    # needs --scheduling-policy priority for non-zero values)
    # which priority values the nodes run first: "low_first" (vLLM; P0 is sent as 0,
    # P2 as 2) or "high_first" (SGLang's --enable-priority-scheduling without
    # --schedule-low-priority-values-first; P0 is sent as 2, P2 as 0)
    priority_order: Literal["low_first", "high_first"] = "low_first"
    # The HTTP client of the hop to the nodes: "lean" (kvgate.gateway.lean_http, a
    # keep-alive pool on aiohttp's protocol and parser) or "aiohttp" (ClientSession).
    client: Literal["lean", "aiohttp"] = "lean"
    keepalive_s: float = 4.0  # an idle pooled connection older than this is not reused
    # (keep it below the nodes' own keep-alive timeout: uvicorn/vLLM's is 5 s)

    def __post_init__(self) -> None:
        _finite("upstream", self)
        if self.client not in ("lean", "aiohttp"):
            raise ConfigError(f"upstream.client must be 'lean' or 'aiohttp', got {self.client!r}",
                              param="client")
        if self.priority_order not in ("low_first", "high_first"):
            raise ConfigError("upstream.priority_order must be 'low_first' or 'high_first', "
                              f"got {self.priority_order!r}", param="priority_order")
        _positive("upstream", connect_timeout_s=self.connect_timeout_s,
                  keepalive_s=self.keepalive_s,
                  stream_idle_timeout_s=self.stream_idle_timeout_s,
                  first_event_timeout_s=self.first_event_timeout_s,
                  request_timeout_s=self.request_timeout_s, pool_limit=self.pool_limit,
                  max_response_bytes=self.max_response_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """One inference node. ``models`` empty = discover from its ``/v1/models``."""

    id: str
    url: str  # base URL, e.g. http://10.0.0.1:8000 (no /v1)
    capacity: int = 64  # concurrent requests it serves well (feeds the budget)
    # index capacity, in index blocks; None: the node's KV cache size as its metrics
    # give it (vLLM's cache_config_info, SGLang's max_total_num_tokens), else 4000
    cache_blocks: int | None = None
    max_model_len: int | None = None  # None = from /v1/models, else 131072
    models: tuple[str, ...] = ()
    api_key: str | None = None  # sent as Authorization to the node (vLLM --api-key)
    # its KV cache events' ZMQ publisher, e.g. tcp://10.0.0.1:5557 (vLLM's
    # --kv-events-config endpoint, connected to), or one per data-parallel rank, comma
    # separated (vLLM's rank r publishes on the port plus r); read in precise mode only
    kv_events: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ConfigError(f"node {redact_url(self.url)}: id must be non-empty")
        if self.kv_events is not None and not all(
            _zmq_endpoint(e) for e in self.kv_events_endpoints
        ):
            raise ConfigError(
                f"node {self.id}: kv_events must look like tcp://host:port or ipc://path "
                f"(comma separated, one per data-parallel rank; the engine's own address, "
                f"not the wildcard it binds), got {self.kv_events!r}",
                param="kv_events",
            )
        if self.api_key is not None and "@" in self.url.partition("://")[2].partition("/")[0]:
            # both would be an Authorization header: aiohttp refuses the pair on every
            # probe, and the node never became healthy, with nothing in the log
            raise ConfigError(
                f"node {self.id}: give either credentials in the url or an api_key, not both",
                param="api_key",
            )
        if self.api_key is not None and (
            not self.api_key or any(not ("!" <= c <= "~") for c in self.api_key)
        ):
            # it becomes "Authorization: Bearer <key>": a key read from a file or a secret
            # kept its newline, and every probe then failed with a bare ValueError
            raise ConfigError(
                f"node {self.id}: api_key must be non-empty printable ASCII with no spaces "
                "or line breaks (a key read from a file keeps its trailing newline)",
                param="api_key",
            )
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"node {self.id}: url must start with http:// or https://")
        if self.capacity < 1:
            raise ConfigError(f"node {self.id}: capacity must be >= 1, got {self.capacity}",
                              param="capacity")
        if self.cache_blocks is not None and self.cache_blocks < 0:
            raise ConfigError(f"node {self.id}: cache_blocks must be >= 0, got "
                              f"{self.cache_blocks}", param="cache_blocks")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"node {self.id}: max_model_len must be >= 1")
        for key in ("capacity", "cache_blocks", "max_model_len"):
            value = getattr(self, key)
            if value is not None and value > NODE_INT_LIMIT:
                raise ConfigError(f"node {self.id}: {key} must be <= {NODE_INT_LIMIT}",
                                  param=key)

    @property
    def kv_events_endpoints(self) -> tuple[str, ...]:
        """Its KV event publishers (one per data-parallel rank); () without any."""
        if self.kv_events is None:
            return ()
        return tuple(e.strip() for e in self.kv_events.split(","))


@dataclass(frozen=True, slots=True, kw_only=True)
class NodesConfig:
    static: tuple[NodeConfig, ...] = ()
    health_interval_s: float = 1.0
    # SGLang's /health answers after a 1-token generation and at least 1 s
    health_timeout_s: float = 3.0
    unhealthy_after: int = 3  # consecutive failed checks before the node is taken out
    healthy_after: int = 2  # consecutive passed checks before it is taken back
    metrics_interval_s: float = 1.0  # scrape each node's /metrics this often
    metrics_timeout_s: float = 1.0
    evictions_interval_s: float = 0.5  # poll /kvgate/evictions (stops on 404)
    startup_probe_timeout_s: float = 3.0  # first discovery round before serving

    def __post_init__(self) -> None:
        _finite("nodes", self)
        _positive("nodes", health_interval_s=self.health_interval_s,
                  health_timeout_s=self.health_timeout_s,
                  metrics_interval_s=self.metrics_interval_s,
                  metrics_timeout_s=self.metrics_timeout_s,
                  evictions_interval_s=self.evictions_interval_s,
                  startup_probe_timeout_s=self.startup_probe_timeout_s,
                  unhealthy_after=self.unhealthy_after, healthy_after=self.healthy_after)
        seen: set[str] = set()
        urls: dict[tuple[str, str, int, str], str] = {}
        for node in self.static:
            if node.id in seen:
                raise ConfigError(f"nodes.static: duplicate node id {node.id!r}")
            seen.add(node.id)
            # one engine under two ids: its capacity counted twice, its cache split
            # (however its url is spelt: LOCALHOST, :08000, :80 or none)
            if (other := urls.setdefault(url_key(node.url), node.id)) != node.id:
                raise ConfigError(f"nodes.static: nodes {other!r} and {node.id!r} have the "
                                  "same url")


def url_key(url: str) -> tuple[str, str, int, str]:
    """What tells two node URLs apart: scheme, host (lower case, an IP address in its
    canonical form), port (80 / 443 when left out) and path (no trailing slash).
    Credentials are no part of it: the same engine with two keys is one engine."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    with contextlib.suppress(ValueError):
        host = ipaddress.ip_address(host).compressed
    try:
        port = parts.port
    except ValueError:  # not from normalise_url: compared as written
        return scheme, url, -1, ""
    if port is None:
        port = 443 if scheme == "https" else 80
    return scheme, host, port, parts.path.rstrip("/")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    policy: str = "kvgate"
    params: Mapping[str, object] = field(default_factory=dict)  # the policy's knobs
    hasher: str = "text"
    hasher_params: Mapping[str, object] = field(default_factory=dict)
    # approximate: the index learns from this gateway's own routing; precise: from the
    # nodes' KV cache events (each node's kv_events), which needs a token hasher
    # ("tokens", or "sim" in front of kvgate engine) tokenizing as the engines do
    index_mode: str = "approximate"
    default_max_tokens: int = 256  # output estimate when the body has no max_tokens
    stale_after_s: float = 5.0  # a load report older than this is unknown
    eject_after_failures: int = 5
    eject_s: float = 30.0

    def __post_init__(self) -> None:
        _finite("routing", self)
        object.__setattr__(self, "params", _frozen_map(self.params))
        object.__setattr__(self, "hasher_params", _frozen_map(self.hasher_params))
        _positive("routing", default_max_tokens=self.default_max_tokens,
                  stale_after_s=self.stale_after_s, eject_s=self.eject_s,
                  eject_after_failures=self.eject_after_failures)
        if self.index_mode not in INDEX_MODES:
            raise ConfigError(
                f"routing.index_mode must be 'approximate' or 'precise', got {self.index_mode!r}",
                param="index_mode",
            )
        if self.index_mode == "precise" and self.hasher not in ("tokens", "sim"):
            raise ConfigError(
                "routing.index_mode 'precise' rebuilds keys from the token ids of the "
                f"engines' KV events: it needs hasher 'tokens' or 'sim', not {self.hasher!r}",
                param="hasher",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSection:
    budget: int = 256  # cluster concurrency C (one credit = one in-flight request)
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)
    default_tenant_quota: int | None = None  # None = unlimited for unlisted tenants
    bypass_fraction: float = 0.03
    queue_timeout_s: float | None = None  # None = the per-class defaults (30/30/60 s)
    queue_limit: int | None = None  # per class; None = 1024
    retry_budget_ratio: float = 0.2
    retry_budget_min: int = 3
    # a tenant refused for asking more than its quota keeps to the nodes it already
    # uses for this long (0: off), so its flood slows few nodes, not all
    tenant_confine_s: float = 10.0
    # Leases (core LeaseConfig). Several gateways: set expected_gateways to the fleet
    # size, since a gateway that never reached its coordinator admits P0 up to
    # budget / expected_gateways on its own (N gateways with the default 1: N x budget).
    expected_gateways: int = 1
    lease_ttl_s: float = 2.0  # the coordinator keeps a gateway's lease this long
    lease_refresh_s: float = 0.5  # periodic refresh (several per ttl)
    reclaim_grace_s: float = 0.0  # the coordinator holds a lost gateway's in-use this long
    # early refreshes (credits low, requests waiting) at most this often; a large Redis
    # fleet under load may raise it, since every refresh serialises on one key
    early_refresh_min_interval_s: float = 0.05
    tick_interval_s: float = 0.05  # controller.tick and the lease refresh check
    # P2 (idle capacity only): end P2 requests while P0 / P1 wait for the credits it
    # borrowed (503 preempted, or an error event mid-stream); false: let them run out
    reclaim_p2: bool = True
    reclaim_retry_after_s: float = 5.0  # Retry-After on a P2 request so ended
    # P2's share of the idle capacity at start-up and after a P0 SLO breach, doubled
    # every healthy 10 s window (1.0: all of it at once)
    p2_start: float = 0.1
    # inprocess: one gateway (the default); redis: a fleet sharing one budget through
    # the lease state under redis_key (each gateway holds a record of its own there)
    coordinator: Literal["inprocess", "redis"] = "inprocess"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_key: str = "kvgate:coordinator"

    def __post_init__(self) -> None:
        _finite("admission", self)
        object.__setattr__(self, "tenant_quotas", _frozen_map(self.tenant_quotas))
        _check_lease(self)
        _positive("admission", tick_interval_s=self.tick_interval_s)
        if self.tick_interval_s >= self.lease_refresh_s:
            # the lease refresh is only checked on a tick: ticks as far apart as the
            # refresh period let the lease lapse between two refreshes
            raise ConfigError(f"admission.tick_interval_s ({self.tick_interval_s}) must be "
                              f"below admission.lease_refresh_s ({self.lease_refresh_s}): "
                              f"the lease refresh is checked once per tick",
                              param="tick_interval_s")
        if not (math.isfinite(self.tenant_confine_s) and self.tenant_confine_s >= 0):
            raise ConfigError(f"admission.tenant_confine_s must be a finite number >= 0, got "
                              f"{self.tenant_confine_s}", param="tenant_confine_s")
        if self.coordinator not in ("inprocess", "redis"):
            raise ConfigError(
                f"admission.coordinator must be 'inprocess' or 'redis', got {self.coordinator!r}"
            )
        if self.coordinator == "redis":
            _check_redis_url(self.redis_url)
        if not self.redis_key:
            raise ConfigError("admission.redis_key must be non-empty")
        try:
            self.admission_config()  # the core's own checks of what this section sets
        except ConfigError as exc:
            # they name the core's fields ("P0 queue_timeout_s", "slo: p2_start"): say
            # which config section they came from
            if exc.message.startswith("admission."):
                raise
            raise ConfigError(f"admission: {exc.message}", param=exc.param) from exc

    def _class(self, c: ClassConfig) -> ClassConfig:
        return ClassConfig(
            share=c.share,
            lendable=c.lendable,
            queue_limit=c.queue_limit if self.queue_limit is None else self.queue_limit,
            queue_timeout_s=c.queue_timeout_s
            if self.queue_timeout_s is None
            else self.queue_timeout_s,
        )

    def admission_config(self) -> AdmissionConfig:
        c0, c1, c2 = (self._class(c) for c in AdmissionConfig().classes)
        return AdmissionConfig(
            budget=self.budget,
            classes=(c0, c1, c2),
            bypass_fraction=self.bypass_fraction,
            tenant_quotas=dict(self.tenant_quotas),
            default_tenant_quota=self.default_tenant_quota,
            retry=RetryBudget(ratio=self.retry_budget_ratio, minimum=self.retry_budget_min),
            reclaim_p2=self.reclaim_p2,
            reclaim_retry_after_s=self.reclaim_retry_after_s,
            slo=SloConfig(p2_start=self.p2_start),
            lease=LeaseConfig(
                ttl_s=self.lease_ttl_s,
                refresh_s=self.lease_refresh_s,
                expected_gateways=self.expected_gateways,
                reclaim_grace_s=self.reclaim_grace_s,
                early_refresh_min_interval_s=self.early_refresh_min_interval_s,
            ),
        )


def _check_lease(a: AdmissionSection) -> None:
    """The lease knobs, named as in the file (the core's own errors name its fields)."""
    if a.expected_gateways < 1:
        raise ConfigError(f"admission.expected_gateways must be >= 1 (the number of gateways "
                          f"sharing the coordinator), got {a.expected_gateways}",
                          param="expected_gateways")
    _positive("admission", lease_ttl_s=a.lease_ttl_s, lease_refresh_s=a.lease_refresh_s)
    margin = LeaseConfig().margin_s
    if not margin < a.lease_ttl_s < math.inf:
        raise ConfigError(f"admission.lease_ttl_s must be finite and > {margin:g} (the margin "
                          f"a gateway stops trusting its lease before it expires), got "
                          f"{a.lease_ttl_s}", param="lease_ttl_s")
    if a.lease_refresh_s >= a.lease_ttl_s:
        raise ConfigError(f"admission.lease_refresh_s ({a.lease_refresh_s}) must be below "
                          f"admission.lease_ttl_s ({a.lease_ttl_s}): a lease is refreshed "
                          f"several times before it expires", param="lease_refresh_s")
    if not 0 <= a.reclaim_grace_s < math.inf:
        raise ConfigError(f"admission.reclaim_grace_s must be finite and >= 0, got "
                          f"{a.reclaim_grace_s}", param="reclaim_grace_s")
    if not 0 <= a.early_refresh_min_interval_s <= a.lease_refresh_s:
        raise ConfigError(f"admission.early_refresh_min_interval_s must be in [0, "
                          f"lease_refresh_s = {a.lease_refresh_s}], got "
                          f"{a.early_refresh_min_interval_s}",
                          param="early_refresh_min_interval_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiKey:
    tenant: str
    max_priority: int = 1  # the best class the key may ask for (0 = P0 allowed)
    bypass: bool = False  # probes / operators: the bypass lane

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ConfigError("auth.keys: tenant must be non-empty")
        if self.max_priority not in (0, 1, 2):
            raise ConfigError(f"auth.keys: max_priority must be 0, 1 or 2 ({self.tenant})")


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    keys: Mapping[str, ApiKey] = field(default_factory=dict)  # empty = auth off
    default_priority: int = 1  # class of a request that names none
    anonymous_max_priority: int = 0  # cap when auth is off

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))
        for name in ("default_priority", "anonymous_max_priority"):
            if getattr(self, name) not in (0, 1, 2):
                raise ConfigError(f"auth.{name} must be 0, 1 or 2")
        for i, (key, spec) in enumerate(self.keys.items()):
            _check_client_key(key, f"auth.keys: the key of tenant {spec.tenant!r} (#{i + 1})")


def _check_client_key(key: str, which: str) -> None:
    """A key a client can send: clients' Authorization headers are trimmed and carry no
    control characters, so such a key was accepted and then never matched. The message
    names the key's tenant, never the key."""
    if not key:
        raise ConfigError("auth.keys: an API key must be non-empty", param="keys")
    if key != key.strip():
        raise ConfigError(f"{which} starts or ends with whitespace (no client could send "
                          "it: HTTP trims header values; a key read from a file keeps its "
                          "trailing newline)", param="keys")
    if not key.isprintable():
        raise ConfigError(f"{which} holds a control character (no client could send it in "
                          "a header)", param="keys")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    auth: AuthConfig = field(default_factory=AuthConfig)

    def __post_init__(self) -> None:
        # Build the core's config once so a bad policy, hasher or admission knob fails
        # here, at startup, with the core's own message.
        from kvgate.core.hashing import make_hasher
        from kvgate.core.routing import make_policy

        if self.nodes.metrics_interval_s >= self.routing.stale_after_s:
            # every report would be stale before the next: safe mode (which dispatches
            # only to nodes whose fresh report shows room) would refuse everything
            raise ConfigError(
                f"nodes.metrics_interval_s ({self.nodes.metrics_interval_s:g}) must be "
                f"below routing.stale_after_s ({self.routing.stale_after_s:g}): a load "
                "report goes stale before the next one",
                param="metrics_interval_s",
            )
        cc = self.controller_config()
        make_policy(cc.policy, cc.policy_params)
        make_hasher(cc.hasher, **dict(cc.hasher_params))

    def controller_config(self) -> ControllerConfig:
        r = self.routing
        return ControllerConfig(
            hasher=r.hasher,
            hasher_params=dict(r.hasher_params),
            index_mode="precise" if r.index_mode == "precise" else "approximate",
            policy=r.policy,
            policy_params=dict(r.params),
            stale_after_s=r.stale_after_s,
            eject_after_failures=r.eject_after_failures,
            eject_s=r.eject_s,
            tenant_confine_s=self.admission.tenant_confine_s,
            admission=self.admission.admission_config(),
        )


def _zmq_endpoint(text: str) -> bool:
    """tcp://host:port or ipc://path (what a SUB socket connects to); not a wildcard
    host (vLLM's default tcp://*:5557 is where the engine binds, nothing to connect to)."""
    if text.startswith("ipc://"):
        return len(text) > len("ipc://")
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    return (
        text.startswith("tcp://")
        and bool(sep and host and port.isdigit())
        and host not in ("*", "0.0.0.0", "[::]", "::")
    )


def _check_redis_url(url: str) -> None:
    """A redis://, rediss:// or unix:// URL redis-py can use, its database (the path)
    a number: redis-py ignores a path like /l3 and uses database 0 without a word, and
    a bad port surfaced as a traceback at start-up."""
    from redis.connection import parse_url  # only a Redis fleet needs it

    shown = redact_url(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"admission.redis_url must be a redis://, rediss:// or unix:// URL, got {shown!r}",
            param="redis_url",
        )
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        # neither the URL nor redis-py's words: with a '#', '/' or '?' in the password
        # the redaction misses it and redis-py quotes it as the port
        scheme = url.partition("://")[0]
        raise ConfigError(
            f"admission.redis_url ({scheme}://...) cannot be parsed: a bad host or port, "
            "or a password with '#', '/' or '?' not percent-encoded",
            param="redis_url",
        ) from exc
    if not url.startswith("unix://"):
        path = urlsplit(url).path.strip("/")
        if path and not path.isdigit():
            raise ConfigError(
                f"admission.redis_url {shown!r}: the path names the database, a number "
                f"(redis://host:6379/0), not {path!r}",
                param="redis_url",
            )
