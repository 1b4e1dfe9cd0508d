"""The controller's view of the inference nodes: static spec plus a live load view.

Theory of operation
-------------------
A node's *reported* load (waiting, running, KV utilisation) is a stale snapshot,
scraped or pushed every ~1 s. Between reports the gateway knows exactly what it
sent itself, so the routing queue signal is::

    queue = reported waiting + requests this gateway sent since that report
            that are still in flight

(vLLM's waiting count stays near 0 until its KV cache fills, so the gateway's own
count carries most of the signal). A report older than ``stale_after_s`` is
*unknown*, not healthy: the node is then scored as if fully utilised, with its
queue taken from the gateway's own in-flight count.

Only :class:`NodeTable` mutates :class:`NodeState`; policies get read-only use.
Routing runs for every request, so the table also keeps what lets it skip
repeated work (both are exact, never approximations):

* ``version`` counts membership, spec, health and drain changes; the eligible
  nodes (healthy, not draining), per model, are cached until it moves
  (:meth:`NodeTable.eligible`).
* ``load_seq`` counts load changes (report, send, completion) and a bounded
  journal names the nodes changed (:meth:`NodeTable.load_changes_since`), so a
  policy that caches per-node load scores recomputes only those nodes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

from xxhash import xxh3_64_intdigest

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId

# Journal of load changes: past this many entries the older half is dropped (amortised
# O(1)); a reader that fell further behind than what is kept rescans every node.
_LOAD_LOG_MAX = 4096
# Distinct model names whose eligible lists are cached (names come from requests, so
# the cache is bounded; past it the cache starts over).
_ELIGIBLE_MODELS_MAX = 64
# the most any of a node's sizes may be (a context of 2**31 tokens is no model's)
NODE_INT_LIMIT: Final = 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """What is configured or discovered about a node; changes rarely."""

    node_id: NodeId
    models: frozenset[str] = frozenset()  # empty = serves any model
    max_model_len: int = 131_072
    capacity: int = 64  # concurrent requests the node serves well; feeds the budget C
    cache_blocks: int = 4_000  # index capacity for this node, in index blocks

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ConfigError("node_id must be non-empty")
        if self.capacity < 1 or self.max_model_len < 1 or self.cache_blocks < 0:
            raise ConfigError(f"node {self.node_id}: capacity, max_model_len must be >= 1")
        if max(self.capacity, self.max_model_len, self.cache_blocks) > NODE_INT_LIMIT:
            # no node's; and float arithmetic on them (admission's length check) overflows
            raise ConfigError(f"node {self.node_id}: capacity, max_model_len and "
                              f"cache_blocks must be <= {NODE_INT_LIMIT}")


@dataclass(slots=True, eq=False)
class NodeState:
    """Live state of one node. Mutated only by :class:`NodeTable`.

    Compared and hashed by identity (one object per node and table), so policies can
    keep sets of states. Set health, drain and load through the table, which counts
    the changes its caches depend on.
    """

    spec: NodeSpec
    slot: int  # stable small integer, the node's bit in index bitmasks
    healthy: bool = True
    draining: bool = False
    # last report
    reported_waiting: int = 0
    reported_running: int = 0
    kv_util: float = 0.0
    report_time: float | None = None
    # the gateway's own counts
    inflight: int = 0  # all requests this gateway has in flight on the node
    sent_since_report: int = 0  # of those, sent after the last report
    # prompt tokens this gateway sent that the node has not prefilled yet (uncached part
    # of requests not past their first byte): the work a new request queues behind
    pending_prefill_tokens: int = 0
    # and their attention work, sum of q * (h + q / 2) over those requests (q uncached,
    # h cached tokens): prefill time grows with the square of a long prompt
    pending_prefill_pairs: float = 0.0
    # those prefills one by one in send order (key -> tokens, pairs); the node works
    # on the first (the head) since prefill_since: the send that found none queued,
    # or the moment the previous head got its first token (or was abandoned)
    prefills: dict[Hashable, tuple[int, float]] = field(default_factory=dict)
    prefill_since: float = 0.0
    # prompt tokens of this gateway's requests in flight on the node: the contexts its
    # decode steps attend over, which slow every sequence in the batch
    inflight_context_tokens: int = 0
    # this gateway's requests in flight on the node by tenant (tenants with none absent):
    # where a tenant at its quota already is
    tenant_inflight: dict[str, int] = field(default_factory=dict)
    cache_weight: float = 1.0  # < 1 while the node has announced a coming eviction
    # the node's answers have stated their cached tokens (usage.prompt_tokens_details):
    # from then on a usage without them means none was cached
    reports_cached_tokens: bool = False
    # before that: the prompt tokens, by prefix bucket, of its answers whose usage had
    # none (misses, once it states them)
    unstated_prompt_tokens: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0

    @property
    def node_id(self) -> NodeId:
        return self.spec.node_id

    @property
    def head_prefill(self) -> tuple[int, float]:
        """(tokens, pairs) of the prefill the node works on now: the oldest queued."""
        return next(iter(self.prefills.values()), (0, 0.0))

    def serves(self, model: str) -> bool:
        return not self.spec.models or model in self.spec.models


@dataclass(frozen=True, slots=True)
class LoadView:
    """The load signals a policy scores with, after the staleness rule."""

    queue: int  # reported waiting + own sends since the report (or own in-flight if stale)
    running: int
    utilisation: float  # KV utilisation in [0, 1]; 1.0 when the report is stale or missing
    inflight: int  # this gateway's in-flight requests on the node
    stale: bool


def rendezvous_rank(key: object, node_id: str) -> int:
    """``node_id``'s rank for ``key`` in rendezvous hashing (the highest rank wins):
    xxh3 of both, the same at every gateway and in every process, so gateways that
    never talk agree on where ``key`` goes."""
    return xxh3_64_intdigest(f"{key}\0{node_id}".encode())


def fleet_order(gateway_id: str, specs: Iterable[NodeSpec]) -> list[NodeSpec]:
    """``specs`` in the order a gateway of a fleet gives them slots: by a stable 64-bit
    hash (BLAKE2b) of the gateway id and the node id, the same in every process and run.

    The lowest slot is every policy's last tie-break, so gateways that share one order
    also break ties alike: at a fleet's start (or whenever several nodes look idle)
    each sent its first request to the same node, then each its second to the next,
    G cold prefills colliding node after node. Orders of their own scatter them."""

    def key(spec: NodeSpec) -> tuple[bytes, str]:
        digest = hashlib.blake2b(f"{gateway_id}/{spec.node_id}".encode(), digest_size=8)
        return digest.digest(), spec.node_id

    return sorted(specs, key=key)


class NodeTable:
    """All nodes known to one controller, by id and by slot."""

    def __init__(self, *, stale_after_s: float = 5.0) -> None:
        self._by_id: dict[NodeId, NodeState] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.stale_after_s = stale_after_s
        self.version = 0  # bumped on every membership, spec, health or drain change
        self.load_seq = 0  # bumped on every load change of any node
        self._load_log: list[NodeState] = []  # the last load changes, oldest first
        # model ("" = any) -> (eligible nodes in table order, their smallest max_model_len)
        self._eligible: dict[str, tuple[tuple[NodeState, ...], int]] = {}
        # model -> the largest max_model_len among all nodes serving it (None: no node)
        self._longest: dict[str, int | None] = {}

    def _changed(self) -> None:
        self.version += 1
        self._eligible.clear()
        self._longest.clear()

    # --- membership -----------------------------------------------------------------
    def add(self, spec: NodeSpec) -> NodeState:
        if spec.node_id in self._by_id:
            state = self._by_id[spec.node_id]
            state.spec = spec
            self._changed()
            return state
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        state = NodeState(spec=spec, slot=slot)
        self._by_id[spec.node_id] = state
        self._changed()
        return state

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def remove(self, node_id: NodeId) -> NodeState | None:
        state = self._by_id.pop(node_id, None)
        if state is not None:
            self._free_slots.append(state.slot)
            self._changed()
        return state

    def set_healthy(self, state: NodeState, healthy: bool) -> bool:
        """Set the node's health; returns whether it changed."""
        if state.healthy == healthy:
            return False
        state.healthy = healthy
        self._changed()
        return True

    def set_draining(self, state: NodeState, draining: bool) -> bool:
        """Set the node's draining flag; returns whether it changed."""
        if state.draining == draining:
            return False
        state.draining = draining
        self._changed()
        return True

    def eligible(self, model: str = "") -> tuple[tuple[NodeState, ...], int]:
        """Healthy, non-draining nodes serving ``model`` ("" = any model), in table order,
        and the smallest ``max_model_len`` among them (0 when there are none).

        Cached until the next membership, spec, health or drain change, so the routing
        hot path filters only what varies per request.
        """
        hit = self._eligible.get(model)
        if hit is None:
            pool = tuple(
                s
                for s in self._by_id.values()
                if s.healthy and not s.draining and (not model or s.serves(model))
            )
            hit = (pool, min((s.spec.max_model_len for s in pool), default=0))
            if len(self._eligible) >= _ELIGIBLE_MODELS_MAX:
                self._eligible.clear()
            self._eligible[model] = hit
        return hit

    def max_model_len(self, model: str) -> int | None:
        """The largest ``max_model_len`` among all nodes serving ``model``, healthy or not
        (None: no node serves it): the longest request any of them could ever take.
        Cached like :meth:`eligible`."""
        cache = self._longest
        if model in cache:
            return cache[model]
        value = max(
            (s.spec.max_model_len for s in self._by_id.values() if s.serves(model)), default=None
        )
        if len(cache) >= _ELIGIBLE_MODELS_MAX:  # model names come from requests
            cache.clear()
        cache[model] = value
        return value

    def get(self, node_id: NodeId) -> NodeState | None:
        return self._by_id.get(node_id)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._by_id

    # --- load -----------------------------------------------------------------------
    def report(
        self, node_id: NodeId, *, waiting: int, running: int, kv_util: float | None, now: float
    ) -> None:
        state = self._by_id.get(node_id)
        if state is None:
            return
        state.reported_waiting = max(0, waiting)
        state.reported_running = max(0, running)
        if kv_util is not None:
            state.kv_util = min(1.0, max(0.0, kv_util))
        state.report_time = now
        state.sent_since_report = 0
        self._load_changed(state)

    def on_sent(
        self,
        state: NodeState,
        *,
        now: float,
        key: Hashable = None,
        prefill_tokens: int = 0,
        prefill_pairs: float = 0.0,
        context_tokens: int = 0,
        tenant: str | None = None,
    ) -> None:
        """The gateway sent the node a request of ``context_tokens`` prompt tokens (for
        ``tenant``, when given); ``key`` names its prefill (``prefill_tokens`` uncached
        tokens, ``prefill_pairs`` attention work) until its first token."""
        state.inflight += 1
        if tenant is not None:
            state.tenant_inflight[tenant] = state.tenant_inflight.get(tenant, 0) + 1
        state.sent_since_report += 1
        state.inflight_context_tokens += context_tokens
        if (prefill_tokens or prefill_pairs) and key is not None:
            queue = state.prefills
            if not queue:  # the node starts on this prefill at once
                state.prefill_since = now
            queue[key] = (prefill_tokens, prefill_pairs)
            state.pending_prefill_tokens += prefill_tokens
            state.pending_prefill_pairs += prefill_pairs
        self._load_changed(state)

    def on_prefilled(self, state: NodeState, key: Hashable, *, now: float) -> None:
        """The node produced the first token of ``key``'s request: that prefill is done."""
        if self._drop_prefill(state, key, now):
            self._load_changed(state)

    def on_done(
        self,
        state: NodeState,
        *,
        sent_at: float,
        now: float,
        key: Hashable = None,
        context_tokens: int = 0,
        tenant: str | None = None,
    ) -> None:
        """A request sent at ``sent_at`` (of ``context_tokens`` prompt tokens, for ``tenant``
        as sent) left the node (finished, failed or cancelled); a prefill still queued
        under ``key`` is abandoned."""
        state.inflight = max(0, state.inflight - 1)
        if tenant is not None:
            left = state.tenant_inflight.get(tenant, 0) - 1
            if left > 0:
                state.tenant_inflight[tenant] = left
            else:
                state.tenant_inflight.pop(tenant, None)
        state.inflight_context_tokens = max(0, state.inflight_context_tokens - context_tokens)
        if state.report_time is None or sent_at >= state.report_time:
            state.sent_since_report = max(0, state.sent_since_report - 1)
        self._drop_prefill(state, key, now)
        self._load_changed(state)

    @staticmethod
    def _drop_prefill(state: NodeState, key: Hashable, now: float) -> bool:
        queue = state.prefills
        if key is None or key not in queue:
            return False
        was_head = next(iter(queue)) == key
        tokens, pairs = queue.pop(key)
        if queue:
            state.pending_prefill_tokens = max(0, state.pending_prefill_tokens - tokens)
            state.pending_prefill_pairs = max(0.0, state.pending_prefill_pairs - pairs)
        else:  # exact zero, whatever rounding the sums gathered
            state.pending_prefill_tokens, state.pending_prefill_pairs = 0, 0.0
        if was_head:  # the node moves on to the next prefill now
            state.prefill_since = now
        return True

    def _load_changed(self, state: NodeState) -> None:
        self.load_seq += 1
        log = self._load_log
        if len(log) >= _LOAD_LOG_MAX:
            del log[: len(log) // 2]
        log.append(state)

    def load_changes_since(self, seq: int) -> list[NodeState] | None:
        """The nodes whose load changed since ``load_seq`` was ``seq`` (repeats possible,
        removed nodes included), or None when the journal no longer reaches that far."""
        n = self.load_seq - seq
        if n <= 0:
            return [] if n == 0 else None
        log = self._load_log
        return log[-n:] if n <= len(log) else None

    def load(self, state: NodeState, now: float) -> LoadView:
        rt = state.report_time
        if rt is None or now - rt > self.stale_after_s:
            return LoadView(
                queue=state.inflight,
                running=state.reported_running,
                utilisation=1.0,
                inflight=state.inflight,
                stale=True,
            )
        return LoadView(
            queue=state.reported_waiting + state.sent_since_report,
            running=state.reported_running,
            utilisation=state.kv_util,
            inflight=state.inflight,
            stale=False,
        )

    # Allocation-free accessors for the routing hot path (same rule as load()).
    def queue(self, state: NodeState, now: float) -> int:
        rt = state.report_time
        if rt is None or now - rt > self.stale_after_s:
            return state.inflight
        return state.reported_waiting + state.sent_since_report

    def utilisation(self, state: NodeState, now: float) -> float:
        rt = state.report_time
        if rt is None or now - rt > self.stale_after_s:
            return 1.0
        return state.kv_util

    def is_stale(self, state: NodeState, now: float) -> bool:
        rt = state.report_time
        return rt is None or now - rt > self.stale_after_s

    def with_room(self, states: Iterable[NodeState], now: float, max_queue: int) -> list[NodeState]:
        """The ``states`` with a fresh report that say they have room, in order (safe
        mode's filter; the rule of is_stale() inlined): the node's reported queue is below
        ``max_queue``, and what it reported running and waiting plus what we sent since
        leaves fewer than ``max_queue`` waiting beyond its ``capacity``.

        Our sends since the report are mostly running by now, not queued: counted as
        queue, an idle node of capacity 64 took 8 requests per scrape interval and the
        rest of a burst was refused on an idle cluster (admission audit)."""
        stale_after = self.stale_after_s
        return [
            s
            for s in states
            if (rt := s.report_time) is not None
            and not now - rt > stale_after
            and s.reported_waiting < max_queue
            and s.reported_running + s.reported_waiting + s.sent_since_report
            < s.spec.capacity + max_queue
        ]
