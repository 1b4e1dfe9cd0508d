"""Watches the inference nodes: models, health, load and eviction announcements.

Per node, three small loops on the gateway's event loop, each bounded by a timeout:

* **health** every ``nodes.health_interval_s``: ``GET /health``. ``unhealthy_after``
  failures in a row take the node out (``controller.set_healthy(False)``), which also
  shrinks the admission budget and aborts the attempts still waiting for its first
  byte (``after_down``: they are retried on another node or failed); ``healthy_after``
  passes in a row bring it back and re-read its models. The watcher only announces its
  own transitions, so a node the controller ejected for failing requests stays out
  until the ejection expires; a node the watcher sees failing is held out even if an
  ejection expires meanwhile.
* **load** every ``nodes.metrics_interval_s``: ``GET /metrics`` -> ``on_load_report``.
* **evictions** every ``nodes.evictions_interval_s``: ``GET /kvgate/evictions?since=N``
  -> ``on_eviction_warning`` / ``on_eviction_done``; a 404 stops polling that node.

Models come from ``GET /v1/models`` (ids and vLLM's ``max_model_len``) at start-up,
whenever a node comes back or is seen to have restarted (a new process may serve
another model), and every ``MODELS_EVERY_CHECKS`` passed health checks (30 s at the
default interval: a model swapped faster than any signal shows). Probe bodies above
``MAX_PROBE_BYTES`` are refused, counted as that probe's error. All controller calls
happen on the loop thread, between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvgate.core.controller import Controller
from kvgate.core.hashing import TokenBlockHasher
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec
from kvgate.gateway.config import NodeConfig, NodesConfig
from kvgate.gateway.kv_watch import NodeKvWatch, base_model, kv_event_rows
from kvgate.gateway.node_probe import ModelInfo, parse_evictions, parse_load, parse_models
from kvgate.gateway.upstream import Upstream

log = logging.getLogger("kvgate.gateway.nodes")

DEFAULT_MAX_MODEL_LEN = 131_072
DEFAULT_CACHE_BLOCKS = 4_000  # index capacity of a node that says nothing of its cache
MODELS_EVERY_CHECKS = 30  # re-read /v1/models after this many passed health checks
# a probe's answer above this is no node's (vLLM's /metrics is a few hundred KB): read
# whole, a broken or hostile node could take the gateway's memory
MAX_PROBE_BYTES = 8 * 1024 * 1024
SCRAPE_WARN_AFTER = 3  # failed scrapes in a row, the node healthy, before a warning
SCRAPE_WARN_EVERY_S = 60.0  # at most one such warning per node this often


@dataclass(slots=True)
class NodeRuntime:
    """The watcher's view of one node (the controller keeps the routing view)."""

    config: NodeConfig
    headers: dict[str, str]
    watch_healthy: bool = True
    fails: int = 0
    passes: int = 0
    models: ModelInfo | None = None
    evictions_supported: bool = True
    eviction_cursor: int = 0
    last_seq: int = -1
    cache_tokens: int | None = None  # the KV cache size its metrics give, in tokens
    started_at: float | None = None  # its process's start, as its metrics give it
    restarted_at: float | None = None  # when a restart of it was last acted on
    errors: Counter[str] = field(default_factory=Counter)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    kv: NodeKvWatch | None = None  # precise mode, with the node's kv_events
    last_health: str = ""  # what its last failed health check got, for the log line
    last_scrape: str = ""  # what its last failed scrape got, for the log line
    scrape_fails: int = 0  # failed scrapes in a row
    scrape_warned: bool = False  # those were logged (once, until a scrape works)
    scrape_warned_at: float | None = None
    models_due: bool = False  # /v1/models to be read again (a restart, or periodically)
    checks_since_models: int = 0  # passed health checks since /v1/models was read

    @property
    def node_id(self) -> NodeId:
        return NodeId(self.config.id)

    @property
    def url(self) -> str:
        return self.config.url


def _forget_notices(rt: NodeRuntime) -> None:
    """Read the node's eviction notices from the start of its log again (a restarted
    engine numbers them from 0: the old cursor would skip them all)."""
    rt.eviction_cursor = 0
    rt.last_seq = -1
    rt.evictions_supported = True  # the new process may serve them


class NodeWatcher:
    def __init__(
        self,
        controller: Controller,
        config: NodesConfig,
        upstream: Upstream,
        clock: Callable[[], float],
        *,
        after_down: Callable[[], None] | None = None,
    ) -> None:
        self.controller = controller
        self.config = config
        self.upstream = upstream
        self.clock = clock
        # called after a node is marked down: the driver aborts what was waiting on it
        self.after_down = after_down
        self.nodes: dict[NodeId, NodeRuntime] = {}
        self._stopped = False

    # ------------------------------------------------------------------ membership
    async def start(self) -> None:
        """Register the configured nodes, probe them once (bounded), start the loops."""
        runtimes = [self._register(cfg) for cfg in self.config.static]
        # at once, so a gateway of a fleet gives them slots in its own order
        self.controller.add_nodes([self._spec(rt) for rt in runtimes], self.clock())
        if runtimes:
            probes = [asyncio.ensure_future(self._first_probe(rt)) for rt in runtimes]
            _, pending = await asyncio.wait(probes, timeout=self.config.startup_probe_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
            for rt in runtimes:
                if not rt.passes:  # failed or did not answer in time: out until it passes
                    self._mark(rt, healthy=False)
        for rt in runtimes:
            self._spawn(rt)
        await self._kv_connected(runtimes)

    async def add(self, config: NodeConfig) -> NodeRuntime:
        """Add a node at run time (admin API): probe it once, then watch it."""
        if NodeId(config.id) in self.nodes:
            await self.remove(NodeId(config.id))
        rt = self._register(config)
        self.controller.add_node(self._spec(rt), self.clock())
        # out of rotation and of the budget until its first probe passes (a node that
        # never answers counted in C_eff for the probe's whole timeout)
        self.controller.set_healthy(rt.node_id, False, self.clock())
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.startup_probe_timeout_s):
                    await self._first_probe(rt)
        except Exception:  # a probe bug: the node is added, held out until it passes
            rt.passes = 0
            log.exception("first probe of node %s failed", rt.node_id)
        finally:
            # Even when the caller is cancelled mid-probe (an admin client gave up), the
            # node ends fully added: held out until it passes, with its loops running.
            # Removed (or replaced) meanwhile: nothing more to do for this runtime.
            if self._current(rt) and not self._stopped:
                if not rt.passes:
                    self._mark(rt, healthy=False)
                else:
                    self.controller.set_healthy(rt.node_id, True, self.clock())
                self._spawn(rt)
        if self._current(rt):
            await self._kv_connected([rt])
        return rt

    async def _kv_connected(self, runtimes: list[NodeRuntime]) -> None:
        """Precise mode: wait (bounded) until each KV event subscription is connected. A
        publisher drops what it sends before (ZMQ's slow joiner): a request served
        at once had its first blocks' events lost, and every later block of that
        prompt was an orphan the index could not key."""
        watches = [rt.kv for rt in runtimes if rt.kv is not None]
        if not watches:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.startup_probe_timeout_s):
                await asyncio.gather(*(w.wait_connected() for w in watches))
        late = [str(w.node_id) for w in watches if not w.is_connected()]
        if late:
            log.warning("KV events of %s not connected yet; serving without them", late)

    async def remove(self, node_id: NodeId) -> bool:
        rt = self.nodes.pop(node_id, None)
        if rt is None:
            return False
        await _cancel(rt.tasks)
        self.controller.remove_node(node_id, self.clock())
        return True

    async def stop(self) -> None:
        self._stopped = True
        await _cancel([t for rt in self.nodes.values() for t in rt.tasks])

    def get(self, node_id: str) -> NodeRuntime | None:
        return self.nodes.get(NodeId(node_id))

    def _current(self, rt: NodeRuntime) -> bool:
        """``rt`` is still the watched runtime of its id (not removed, nor replaced by a
        later node with the same id): only then may its probes act on the controller."""
        return self.nodes.get(rt.node_id) is rt

    def _register(self, config: NodeConfig) -> NodeRuntime:
        """Watch ``config``'s node; the caller adds it to the controller."""
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        rt = NodeRuntime(config=config, headers=headers)
        self.nodes[rt.node_id] = rt
        return rt

    def _spec(self, rt: NodeRuntime) -> NodeSpec:
        cfg, info = rt.config, rt.models
        models = cfg.models or (info.ids if info is not None else ())
        mml = cfg.max_model_len or (info.max_model_len if info is not None else None)
        return NodeSpec(
            node_id=rt.node_id,
            models=frozenset(models),
            max_model_len=mml or DEFAULT_MAX_MODEL_LEN,
            capacity=cfg.capacity,
            cache_blocks=self._cache_blocks(rt),
        )

    def _cache_blocks(self, rt: NodeRuntime) -> int:
        """The index capacity for the node: configured, else its KV cache in index blocks
        (a guess that the index then holds as many prompt blocks as the cache holds)."""
        if rt.config.cache_blocks is not None:
            return rt.config.cache_blocks
        if rt.cache_tokens is None:
            return DEFAULT_CACHE_BLOCKS
        return max(1, rt.cache_tokens // self.controller.hasher.tokens_per_block)

    def _spawn(self, rt: NodeRuntime) -> None:
        c = self.config
        rt.tasks = [
            asyncio.ensure_future(self._every(c.health_interval_s, rt, self.check_health)),
            asyncio.ensure_future(self._every(c.metrics_interval_s, rt, self.scrape)),
            asyncio.ensure_future(self._every(c.evictions_interval_s, rt, self.poll_evictions)),
        ]
        hasher = self.controller.hasher
        if self.controller.config.index_mode != "precise" or not isinstance(
            hasher, TokenBlockHasher
        ):
            return
        if not rt.config.kv_events_endpoints:
            # routing's guesses expire in seconds unconfirmed: no cache is seen there
            log.warning("node %s has no kv_events endpoint: precise mode sees no cache "
                        "on it", rt.node_id)
            return
        rt.kv = NodeKvWatch(
            rt.node_id, hasher, rt.config.kv_events_endpoints, cache_blocks=self._cache_blocks(rt)
        )
        rt.tasks += rt.kv.start(
            self.controller,
            model=lambda: base_model(rt.config, rt.models),
            current=lambda: not self._stopped and self._current(rt),
            clock=self.clock,
            errors=rt.errors,
            retry_s=self.config.health_interval_s,
        )

    async def _every(
        self, interval: float, rt: NodeRuntime, probe: Callable[[NodeRuntime], Awaitable[None]]
    ) -> None:
        while True:
            await asyncio.sleep(interval)
            if self._stopped or not self._current(rt):  # stopped, or the node removed
                return
            try:
                await probe(rt)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe bug must not kill the loop
                log.exception("probe of node %s failed", rt.node_id)

    async def _first_probe(self, rt: NodeRuntime) -> None:
        await asyncio.gather(self.check_health(rt, first=True), self.discover(rt), self.scrape(rt))

    # ------------------------------------------------------------------ probes
    async def _get(self, rt: NodeRuntime, path: str, timeout: float) -> tuple[int, bytes] | None:
        try:
            async with self.upstream.probe_session.get(
                rt.url + path, headers=rt.headers,
                timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False,
            ) as resp:
                body = await _read_capped(resp, MAX_PROBE_BYTES)
                if body is None:
                    _note_failure(rt, path, f"an answer over {MAX_PROBE_BYTES >> 20} MB")
                    return None
                return resp.status, body
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            _note_failure(rt, path, _probe_error(exc, timeout))
            return None

    async def check_health(self, rt: NodeRuntime, *, first: bool = False) -> None:
        got = await self._get(rt, "/health", self.config.health_timeout_s)
        if got is not None and got[0] == 200:
            rt.fails = 0
            rt.passes += 1
            rt.checks_since_models += 1
            if rt.checks_since_models >= MODELS_EVERY_CHECKS:
                rt.models_due = True  # a model swapped without any restart signal
            if not rt.watch_healthy and rt.passes >= self.config.healthy_after:
                await self.discover(rt)
                self._mark(rt, healthy=True)
            elif (rt.models is None or rt.models_due) and not first:
                await self.discover(rt)  # retried each check until it succeeds
            return
        rt.errors["health"] += 1
        if got is not None:
            rt.last_health = f"HTTP {got[0]}"
        rt.passes = 0
        rt.fails += 1
        if rt.watch_healthy and rt.fails >= self.config.unhealthy_after:
            self._mark(rt, healthy=False)
        elif not rt.watch_healthy:
            self._mark(rt, healthy=False)  # re-assert over an expired ejection

    def _mark(self, rt: NodeRuntime, *, healthy: bool) -> None:
        if rt.watch_healthy != healthy:
            if healthy:
                log.warning("node %s is back", rt.node_id)
                _forget_notices(rt)  # most likely a new process: its log starts afresh
            else:
                log.warning("node %s is unhealthy (health check: %s)", rt.node_id,
                            rt.last_health or "no answer")
        rt.watch_healthy = healthy
        if self._current(rt):
            self.controller.set_healthy(rt.node_id, healthy, self.clock())
            if not healthy and self.after_down is not None:
                self.after_down()

    async def discover(self, rt: NodeRuntime) -> None:
        got = await self._get(rt, "/v1/models", self.config.health_timeout_s)
        info = parse_models(_json(got[1])) if got is not None and got[0] == 200 else None
        if info is None:
            rt.errors["models"] += 1
            return
        rt.models_due = False
        rt.checks_since_models = 0
        if rt.models is not None and set(rt.models.ids) != set(info.ids):
            log.warning("node %s now serves %s (was %s)", rt.node_id,
                        ", ".join(info.ids) or "no model", ", ".join(rt.models.ids) or "none")
        missing = sorted(set(rt.config.models) - set(info.ids)) if info.ids else []
        if missing and (rt.models is None or set(rt.models.ids) != set(info.ids)):
            # its configured models route there anyway, and every such request gets the
            # node's 404: say so once (each time its list changes)
            log.warning("node %s is configured for model(s) %s but serves %s",
                        rt.node_id, ", ".join(missing), ", ".join(info.ids))
        rt.models = info
        if self._current(rt):
            spec = self._spec(rt)
            state = self.controller.nodes.get(rt.node_id)
            if state is None or state.spec != spec:
                self.controller.add_node(spec, self.clock())

    async def scrape(self, rt: NodeRuntime) -> None:
        got = await self._get(rt, "/metrics", self.config.metrics_timeout_s)
        sample = None
        if got is not None and got[0] == 200:
            sample = parse_load(got[1].decode("utf-8", "replace"))
        if sample is None:
            rt.errors["metrics"] += 1
            if got is not None:
                rt.last_scrape = f"HTTP {got[0]}" if got[0] != 200 else "no load gauges in it"
            self._scrape_failed(rt)
            return
        if rt.scrape_warned:
            log.warning("scrapes of node %s work again", rt.node_id)
        rt.scrape_fails, rt.scrape_warned = 0, False
        if not self._current(rt):
            return
        if rt.kv is not None:  # precise mode: routing stops teaching once orphans stop
            rt.kv.note_orphans(self.controller, self.clock())
        started = sample.started_at
        if started is not None:
            # only a start later than any seen is a new process: behind a load balancer
            # the URL reaches several, and an older one answering is no restart
            if rt.started_at is not None and started > rt.started_at + 0.5:
                self._restarted(rt, "its process start time moved on")
            rt.started_at = max(started, rt.started_at or started)
        cache_tokens = sample.cache_tokens
        if cache_tokens is not None and cache_tokens != rt.cache_tokens:
            rt.cache_tokens = cache_tokens  # the index follows the node's real cache
            if rt.kv is not None:  # and the KV-event mapper's memory bound
                rt.kv.set_cache_blocks(self._cache_blocks(rt))
            state = self.controller.nodes.get(rt.node_id)
            if state is not None and rt.config.cache_blocks is None:
                spec = self._spec(rt)
                if state.spec != spec:
                    self.controller.add_node(spec, self.clock())
        self.controller.on_load_report(
            rt.node_id, waiting=sample.waiting, running=sample.running, kv_util=sample.kv_util,
            now=self.clock(),
        )

    def _scrape_failed(self, rt: NodeRuntime) -> None:
        """A warning when a healthy node's scrapes keep failing (its load stays unknown,
        seen before only in kvgate_node_scrape_errors_total): once until a scrape works,
        at most once per node every SCRAPE_WARN_EVERY_S. A node going down is the
        health check's to report."""
        rt.scrape_fails += 1
        if (rt.scrape_warned or rt.scrape_fails < SCRAPE_WARN_AFTER or rt.fails
                or not rt.watch_healthy or not self._current(rt)):
            return
        now = self.clock()
        if rt.scrape_warned_at is not None and now - rt.scrape_warned_at < SCRAPE_WARN_EVERY_S:
            return
        rt.scrape_warned, rt.scrape_warned_at = True, now
        log.warning("node %s: %d scrapes of /metrics in a row failed (last: %s); its load "
                    "is unknown until one works", rt.node_id, rt.scrape_fails,
                    rt.last_scrape or "no answer")

    async def poll_evictions(self, rt: NodeRuntime) -> None:
        if not rt.evictions_supported:
            return
        got = await self._get(rt, f"/kvgate/evictions?since={rt.eviction_cursor}",
                              self.config.metrics_timeout_s)
        if got is None or got[0] != 200:
            if got is not None and got[0] in (404, 405):
                rt.evictions_supported = False
            else:
                rt.errors["evictions"] += 1
            return
        if not self._current(rt):
            return
        events, cursor = parse_evictions(_json(got[1]))
        now = self.clock()
        if cursor is not None and cursor < rt.eviction_cursor:
            # the node's notice log went back: a new engine process, with an empty
            # cache and none of the old one's evictions pending; read its log afresh
            _forget_notices(rt)
            self._restarted(rt, "its eviction log went back")
            return
        for ev in events:
            if ev.seq <= rt.last_seq:
                continue
            rt.last_seq = ev.seq
            if ev.kind == "announced":
                self.controller.on_eviction_warning(rt.node_id, now)
            else:
                self.controller.on_eviction_done(rt.node_id, now, ev.tokens_evicted)
        rt.eviction_cursor = cursor if cursor is not None else max(rt.eviction_cursor,
                                                                   rt.last_seq)

    def _restarted(self, rt: NodeRuntime, why: str) -> None:
        """A new engine process behind the node's URL, seen by one of its signals (its
        KV events' sequence, its notice log, its metrics' start time; no health check
        need have failed): its cache is empty and none of the old process's evictions
        are pending. One restart is acted on once: a second signal of it, later, would
        drop what the new process has cached since."""
        now = self.clock()
        window = self._restart_window_s
        rt.models_due = True  # the new process may serve another model: the next check reads
        if rt.kv is not None and rt.kv.restarted_within(now, window):
            rt.restarted_at = now  # its events said so first; the index follows it
            return
        if rt.restarted_at is not None and now - rt.restarted_at < window:
            return
        rt.restarted_at = now
        log.warning("node %s restarted (%s)", rt.node_id, why)
        _forget_notices(rt)
        if rt.kv is not None:
            rt.kv.ingest.reset()  # the old process's block hashes name nothing now
        self.controller.on_cache_cleared(rt.node_id, now)

    @property
    def _restart_window_s(self) -> float:
        """Signals of one restart come within a few probe intervals of each other."""
        c = self.config
        return 3 * max(c.metrics_interval_s, c.evictions_interval_s)

    # ------------------------------------------------------------------ views
    def model_entries(self) -> list[dict[str, Any]]:
        """The union of the models of healthy nodes (of all nodes if none is healthy)."""
        healthy = [rt for rt in self.nodes.values() if self._healthy(rt)]
        merged: dict[str, dict[str, Any]] = {}
        for rt in healthy or list(self.nodes.values()):
            entries = rt.models.entries if rt.models is not None else ()
            if not entries:
                entries = tuple({"id": m} for m in rt.config.models)
            for e in entries:
                cur = merged.setdefault(e["id"], dict(e))
                mml, other = cur.get("max_model_len"), e.get("max_model_len")
                if isinstance(mml, int) and isinstance(other, int):
                    cur["max_model_len"] = max(mml, other)
        return [merged[k] for k in sorted(merged)]

    def serves(self, model: str) -> bool:
        """False only when every node's model list is known and none has ``model``."""
        return any(s.serves(model) for s in self.controller.nodes) or not len(
            self.controller.nodes
        )

    def _healthy(self, rt: NodeRuntime) -> bool:
        state = self.controller.nodes.get(rt.node_id)
        return state is not None and state.healthy and not state.draining

    def healthy_count(self) -> int:
        return sum(1 for rt in self.nodes.values() if self._healthy(rt))

    def error_counts(self) -> Iterator[tuple[str, str, int]]:
        for node_id in sorted(self.nodes):
            for kind, n in sorted(self.nodes[node_id].errors.items()):
                yield node_id, kind, n

    def kv_event_counts(self) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
        """Precise mode's counters per node: (batches by kind, blocks by kind)."""
        return kv_event_rows(
            (node_id, rt.kv) for node_id, rt in sorted(self.nodes.items()) if rt.kv is not None
        )


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None when it is longer than ``limit`` (read no further)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _note_failure(rt: NodeRuntime, path: str, why: str) -> None:
    """Keep why a health check or scrape failed, for its log line."""
    if path == "/health":
        rt.last_health = why
    elif path == "/metrics":
        rt.last_scrape = why


def _probe_error(exc: BaseException, timeout: float) -> str:
    """A probe's failure in a few words (no URL: it may hold a password)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
