"""Precise mode's glue between the node watcher and the controller, per node.

:class:`NodeKvWatch` owns what the watcher keeps for one node's KV events: the
mapper every publisher of the node feeds (one per data-parallel rank,
``NodeConfig.kv_events_endpoints``), one "connected" flag per publisher, the
subscriber tasks (``kv_subscriber.py``, restarted after an error) and how many of
the mapper's restarts the watcher has accounted for. The index operations the
mapper yields are applied to the controller here, on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvgate.core.controller import Controller
from kvgate.core.hashing import TokenBlockHasher
from kvgate.core.ids import NodeId
from kvgate.gateway.config import NodeConfig
from kvgate.gateway.kv_ingest import IndexOp, IndexRemoved, IndexStored, NodeKvIngest
from kvgate.gateway.kv_subscriber import follow_kv_events
from kvgate.gateway.node_probe import ModelInfo

__all__ = ["NodeKvWatch", "base_model", "kv_event_rows", "remembered_blocks"]

log = logging.getLogger("kvgate.gateway.kv_events")

# metric kind -> NodeKvIngest / subscriber counter
BATCH_COUNTS = (("received", "batches"), ("missed", "missed_batches"), ("restarts", "restarts"),
                ("malformed", "malformed"), ("no_model", "no_model"), ("cleared", "cleared"))
BLOCK_COUNTS = (("stored", "stored_blocks"), ("removed", "removed_blocks"),
                ("orphan", "orphan_blocks"), ("forgotten", "forgotten_blocks"),
                ("extra_keys", "extra_keys_blocks"),
                ("unknown_removed", "unknown_removed"), ("other_medium", "other_medium"),
                ("bad_block_size", "bad_block_size"), ("unnamed_lora", "unnamed_lora_blocks"))

Rows = list[tuple[str, str, int]]
ORPHAN_QUIET_S = 60.0  # without orphan blocks this long, routing stops teaching the index
# Engine hashes the mapper remembers per node: the node's cache this many times over
# (stale entries of lost batches wait for the bound), for each of its data-parallel
# ranks (the metrics give one rank's cache, and each rank's copy of a block counts),
# never fewer than the floor, which covers a cache size that is a guess.
REMEMBER_CACHE_TIMES = 4
MIN_REMEMBERED_BLOCKS = 16_384


def remembered_blocks(cache_blocks: int | None, ranks: int = 1) -> int:
    """The mapper's bound for a node of ``ranks`` publishers whose caches hold
    ``cache_blocks`` blocks each (None: unknown)."""
    return max(MIN_REMEMBERED_BLOCKS, REMEMBER_CACHE_TIMES * (cache_blocks or 0) * ranks)


class NodeKvWatch:
    """One node's KV event subscriptions (precise mode)."""

    def __init__(
        self,
        node_id: NodeId,
        hasher: TokenBlockHasher,
        endpoints: Sequence[str],
        *,
        cache_blocks: int | None = None,
    ) -> None:
        self.node_id = node_id
        self.endpoints = tuple(endpoints)
        # one for all its ranks' publishers
        self.ingest = NodeKvIngest(
            hasher, max_blocks=remembered_blocks(cache_blocks, len(self.endpoints))
        )
        self.connected = [asyncio.Event() for _ in self.endpoints]
        self.restarts_seen = 0  # the ingest's restarts already noted
        self.restarted_at: float | None = None  # the last restart the events reported
        self.orphans_seen = 0
        self.orphan_at: float | None = None  # the last orphan block; None: routing does not learn

    def set_cache_blocks(self, cache_blocks: int) -> None:
        """The node's cache size changed: so does the mapper's bound."""
        self.ingest.max_blocks = remembered_blocks(cache_blocks, len(self.endpoints))

    def note_orphans(self, controller: Controller, now: float) -> None:
        """After each batch, and on the watcher's scrape: while the node's events bring
        orphans (blocks continuing a prefix the events never named), routing teaches
        the index too, as in approximate mode; ``ORPHAN_QUIET_S`` without any, it stops.
        A gateway started after a long-running engine sees the prefixes stored before
        only this way (until the engine stores them again, which for a hot system
        prompt may be never)."""
        orphans = self.ingest.counts["orphan_blocks"]
        if orphans > self.orphans_seen:
            self.orphans_seen = orphans
            if self.orphan_at is None:
                log.warning("node %s: KV events continue prefixes stored before the "
                            "gateway heard them; routing teaches the index too", self.node_id)
                controller.set_routing_learns(self.node_id, True)
            self.orphan_at = now
        elif self.orphan_at is not None and now - self.orphan_at > ORPHAN_QUIET_S:
            self.orphan_at = None
            controller.set_routing_learns(self.node_id, False)

    def start(
        self,
        controller: Controller,
        *,
        model: Callable[[], str | None],
        current: Callable[[], bool],
        clock: Callable[[], float],
        errors: Counter[str],
        retry_s: float,
    ) -> list[asyncio.Task[None]]:
        """One subscriber task per publisher, each restarted ``retry_s`` after a failure,
        until ``current()`` turns false (the node removed, the watcher stopped)."""

        def apply(ops: list[IndexOp]) -> None:
            now = clock()
            apply_ops(controller, self.node_id, ops, now)
            self.note_restarts(now)
            self.note_orphans(controller, now)

        async def follow(endpoint: str, connected: asyncio.Event) -> None:
            while current():
                try:
                    await follow_kv_events(endpoint, self.ingest, model=model, apply=apply,
                                           current=current, connected=connected)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a bug or a socket error must not end it
                    errors["kv_events"] += 1
                    if errors["kv_events"] == 1:  # the first with its traceback, then a line
                        log.exception("KV events of node %s failed; retrying", self.node_id)
                    else:
                        log.warning("KV events of node %s failed again (%s); retrying",
                                    self.node_id, exc)
                    await asyncio.sleep(retry_s)

        return [asyncio.ensure_future(follow(e, c))
                for e, c in zip(self.endpoints, self.connected, strict=True)]

    def note_restarts(self, now: float) -> None:
        """After each batch: when the events reported a restart (their sequence started
        again; the mapper already cleared the node), remember when."""
        restarts = self.ingest.counts["restarts"]
        if restarts > self.restarts_seen:
            self.restarts_seen = restarts
            self.restarted_at = now

    def restarted_within(self, now: float, window_s: float) -> bool:
        """The events reported a restart less than ``window_s`` ago."""
        return self.restarted_at is not None and now - self.restarted_at < window_s

    async def wait_connected(self) -> None:
        await asyncio.gather(*(c.wait() for c in self.connected))

    def is_connected(self) -> bool:
        return all(c.is_set() for c in self.connected)


def apply_ops(controller: Controller, node_id: NodeId, ops: Iterable[IndexOp], now: float) -> None:
    for op in ops:
        if isinstance(op, IndexStored):
            controller.on_blocks_stored(node_id, op.keys, now)
        elif isinstance(op, IndexRemoved):
            controller.on_blocks_removed(node_id, op.keys, now)
        else:
            log.warning("node %s restarted (KV event sequence reset)", node_id)
            controller.on_cache_cleared(node_id, now)


def base_model(config: NodeConfig, models: ModelInfo | None) -> str | None:
    """The model a node's sequences start from in its KV events (LoRA adapters name
    their own): the configured first model, else the first one it lists that is no
    adapter (vLLM gives adapters a ``parent``); None while unknown."""
    if config.models:
        return config.models[0]
    if models is None:
        return None
    for entry in models.entries:
        if not entry.get("parent") and isinstance(entry.get("id"), str):
            return str(entry["id"])
    return models.ids[0] if models.ids else None


def kv_event_rows(watches: Iterable[tuple[str, NodeKvWatch]]) -> tuple[Rows, Rows]:
    """Precise mode's counters per node, for /metrics: (batches by kind, blocks by kind)."""
    batches: Rows = []
    blocks: Rows = []
    for node_id, watch in watches:
        counts = watch.ingest.counts
        batches += [(node_id, kind, counts[key]) for kind, key in BATCH_COUNTS]
        blocks += [(node_id, kind, counts[key]) for kind, key in BLOCK_COUNTS]
    return batches, blocks
