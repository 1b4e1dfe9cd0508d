"""The cluster's cache location table: block hash -> the nodes holding it.

Theory of operation
-------------------
Every node gets a small integer *slot* (freed slots are reused, lowest first)
and so a bit ``1 << slot``. The table keeps:

* ``_masks``: one dict, block hash -> int bitmask of the slots holding the block.
  :meth:`ClusterIndex.match` reads only this: it fetches the masks of the chain's
  blocks in C up to the first block nobody holds, so its cost grows with the
  matched length, never with the table size or the node count. A node's match
  is where its bit drops out of the running AND of the masks; the AND can only
  change where a new group of equal masks starts, so the Python-level work is
  per group (usually 1-3), not per block.
* per node, ``lru``: an ``OrderedDict`` block -> last-touch time, least recently
  touched first. It mirrors the engine's prefix cache: capacity in blocks, LRU
  eviction from the front, and blocks of a chain touched LAST TO FIRST so a
  prefix's root is the most recently used and evicted last. One float object is
  shared by all blocks of one insert; no Python object per entry besides the
  block's int (about 100-110 bytes per (block, node) entry, everything included).
* per node, ``spec``: an ``OrderedDict`` of the *speculative* entries (precise
  mode: the gateway's routing guess before the engine's ``BlockStored`` event),
  block -> deadline. Speculative entries live in ``lru`` and ``_masks`` like any
  other entry (they count towards capacity and are matched); ``spec`` only marks
  them. A non-speculative insert of the block confirms it (drops the mark); at
  its deadline an unconfirmed entry is removed.

Time comes in as ``now`` (seconds). Touch times are the index clock, the largest
``now`` seen, so each node's ``lru`` is ordered by touch time and its TTL-expired
entries are a prefix of it (likewise deadlines in ``spec``). An entry touched at
``t`` is expired once ``t + ttl_s <= now``; a speculative one also once its
deadline ``<= now``. Expiry is exact and amortised: a heap holds, per non-empty
node, one item due no later than the node's earliest expiry. ``expire`` and
``insert`` pop the due items and drop each such node's expired prefix, so
afterwards nothing stored is expired. ``match`` stays cheap: it drops the expired
entries of only the nodes holding the chain's first block (the only ones that can
match), and only when the heap's head is due (one float comparison otherwise).
Expired entries of other nodes may stay stored until the next ``insert`` or
``expire``; ``num_entries``, ``holders`` and ``remove_blocks`` see stored state.

Events may race membership changes, so operations on an unknown node are
no-ops that return 0; ``set_capacity`` on an unknown node raises ``KeyError``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import compress, groupby, islice, repeat, takewhile
from operator import not_
from typing import cast

from kvgate.core.errors import ConfigError
from kvgate.core.ids import BlockHash, NodeId

_INF = float("inf")
_NO_NODE = NodeId("")


class _Node:
    """One node's entries. Mutated only by :class:`ClusterIndex`."""

    __slots__ = (
        "alive",
        "bit",
        "capacity",
        "lru",
        "node_id",
        "sched_due",
        "sched_seq",
        "slot",
        "spec",
    )

    def __init__(self, node_id: NodeId, slot: int, capacity: int) -> None:
        self.node_id = node_id
        self.slot = slot
        self.bit = 1 << slot
        self.capacity = capacity
        self.lru: OrderedDict[BlockHash, float] = OrderedDict()  # block -> last touch
        self.spec: OrderedDict[BlockHash, float] = OrderedDict()  # block -> deadline
        self.alive = True
        self.sched_seq = -1  # seq of this node's live item in the expiry heap (-1: none)
        self.sched_due = _INF  # due time of that item


class ClusterIndex:
    """Which nodes hold which blocks; longest leading match per node in one walk."""

    def __init__(self, *, ttl_s: float | None = 600.0, speculative_ttl_s: float = 2.0) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        if not speculative_ttl_s > 0:
            raise ConfigError(f"speculative_ttl_s must be > 0, got {speculative_ttl_s!r}")
        self._ttl = ttl_s
        self._spec_ttl = speculative_ttl_s
        self._masks: dict[BlockHash, int] = {}
        self._nodes: dict[NodeId, _Node] = {}
        self._slot_ids: list[NodeId] = []  # slot -> node id (_NO_NODE when free)
        self._free_slots: list[int] = []  # a heap: lowest free slot first
        self._heap: list[tuple[float, int, _Node]] = []  # (due, seq, node)
        self._seq = 0
        self._next_due = _INF  # the heap's head due time
        self._clock = -_INF  # the largest `now` seen; touch times are taken from it
        # counters for metrics (monotonic)
        self.evicted_capacity = 0
        self.expired_ttl = 0
        self.expired_speculative = 0

    # --- membership -------------------------------------------------------------------
    def add_node(self, node_id: NodeId, capacity_blocks: int) -> None:
        """Register a node; on a known node this is :meth:`set_capacity`."""
        if node_id in self._nodes:
            self.set_capacity(node_id, capacity_blocks)
            return
        _check_capacity(node_id, capacity_blocks)
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = len(self._slot_ids)
            self._slot_ids.append(node_id)
        node = _Node(node_id, slot, capacity_blocks)
        self._nodes[node_id] = node
        self._slot_ids[slot] = node_id

    def set_capacity(self, node_id: NodeId, capacity_blocks: int) -> None:
        """Change a node's capacity; shrinking evicts its least recently used blocks at once."""
        _check_capacity(node_id, capacity_blocks)
        node = self._nodes[node_id]
        node.capacity = capacity_blocks
        excess = len(node.lru) - capacity_blocks
        if excess > 0:
            self._evict(node, excess)

    def remove_node(self, node_id: NodeId) -> None:
        """Forget a node and everything it holds; its slot is reused later."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        self.clear_node(node_id)
        node.alive = False
        del self._nodes[node_id]
        self._slot_ids[node.slot] = _NO_NODE
        heapq.heappush(self._free_slots, node.slot)

    def clear_node(self, node_id: NodeId) -> int:
        """Engine reset (``AllBlocksCleared``): drop all the node holds; returns the count."""
        node = self._nodes.get(node_id)
        if node is None:
            return 0
        dropped = len(node.lru)
        self._drop(node, list(node.lru))
        return dropped

    def has_node(self, node_id: NodeId) -> bool:
        return node_id in self._nodes

    def nodes(self) -> list[NodeId]:
        return list(self._nodes)

    def capacity(self, node_id: NodeId) -> int:
        return self._nodes[node_id].capacity

    # --- updates ----------------------------------------------------------------------
    def insert(
        self,
        node_id: NodeId,
        chain: Sequence[BlockHash],
        now: float,
        *,
        speculative: bool = False,
        new_out: list[BlockHash] | None = None,
    ) -> int:
        """The node now holds every block of ``chain``; returns how many entries were new.

        Blocks are touched last to first (the root ends most recently used), then the
        node's least recently used blocks beyond its capacity are evicted; a block
        counted as new may be evicted by the same call when the chain exceeds the
        capacity. A speculative insert marks its new blocks speculative (they expire
        ``speculative_ttl_s`` after the last speculative touch unless a non-speculative
        insert confirms them); blocks already held and confirmed stay confirmed.
        ``new_out``, if given, is extended with the new blocks (to undo this insert).
        """
        node = self._nodes.get(node_id)
        if node is None or not chain:
            return 0
        if now >= self._next_due:
            self._expire_due(now)
        if now > self._clock:
            self._clock = now
        t = self._clock
        lru, spec, masks, bit = node.lru, node.spec, self._masks, node.bit
        was_empty = not lru
        # Batched in C: append the new blocks / refresh the held ones with time t, last
        # block first, so the new ones are the tail of lru; set their bits; then, unless
        # all were new, move every block to the end in that order (root most recent).
        if speculative:
            refreshed = list(filter(spec.__contains__, chain)) if spec else []
        elif spec:
            deque(map(spec.__delitem__, set(filter(spec.__contains__, chain))), 0)  # confirm
        before = len(lru)
        lru.update(zip(reversed(chain), repeat(t)))
        added = len(lru) - before
        new: list[BlockHash] = []
        if added:
            new = list(islice(reversed(lru), added))
            masks.update(zip(new, map(bit.__or__, map(masks.get, new, repeat(0))), strict=True))
            if new_out is not None:
                new_out.extend(new)
        if added != len(chain):
            deque(map(lru.move_to_end, reversed(chain)), 0)
        if speculative:
            deadline = t + self._spec_ttl
            spec_was_empty = not spec
            if refreshed:
                deque(map(spec.move_to_end, refreshed), 0)
                spec.update(zip(refreshed, repeat(deadline)))
            if new:
                spec.update(zip(new, repeat(deadline)))
            if spec_was_empty and spec:
                self._schedule(node, deadline)
        excess = len(lru) - node.capacity
        if excess > 0:
            self._evict(node, excess)
        if was_empty and lru and self._ttl is not None:
            self._schedule(node, t + self._ttl)
        return added

    def remove_blocks(self, node_id: NodeId, hashes: Iterable[BlockHash]) -> int:
        """Engine eviction (``BlockRemoved``): the node no longer holds these blocks.

        Returns how many stored entries were dropped (unknown blocks are ignored).
        """
        node = self._nodes.get(node_id)
        if node is None:
            return 0
        held = list(filter(node.lru.__contains__, dict.fromkeys(hashes)))
        self._drop(node, held)
        return len(held)

    def forget_oldest(self, node_id: NodeId, count: int) -> int:
        """The node evicted about ``count`` blocks in LRU order, and we were told only how
        many (an announced bulk eviction, approximate mode): drop its ``count`` least
        recently touched entries, our image of its LRU front. Returns how many."""
        node = self._nodes.get(node_id)
        if node is None or count <= 0:
            return 0
        victims = list(islice(node.lru, count))
        self._drop(node, victims)
        return len(victims)

    def expire(self, now: float) -> int:
        """Drop every entry past its TTL or speculative deadline at ``now``; returns the count."""
        return self._expire_due(now) if now >= self._next_due else 0

    # --- queries ----------------------------------------------------------------------
    def match(self, chain: Sequence[BlockHash], now: float) -> dict[NodeId, int]:
        """For every node holding ``chain[0]``, how many leading blocks of ``chain`` it holds.

        Nodes absent from the result match nothing. One walk over the chain that stops
        at the first block no node holds.
        """
        masks = self._masks
        if now >= self._next_due and chain:
            # Only nodes holding chain[0] can match: expire just those among the due
            # nodes; insert and expire do the rest of the work.
            first = masks.get(chain[0])
            if first:
                self._expire_holders(first, now)
        # masks of the chain's blocks up to the first block nobody holds (C-level loop)
        ml = cast("list[int]", list(takewhile(bool, map(masks.get, chain))))
        if not ml:
            return {}
        ids = self._slot_ids
        out: dict[NodeId, int] = {}
        # The running AND of the masks only changes where a value appears that the run
        # is not a subset of; that is at the start of a group of equal masks, and the
        # first such group of value v starts at ml.index(v, pos) (pos: last change).
        run = ml[0]
        pos = 0
        for v, _group in groupby(ml):
            kept = run & v
            if kept != run:
                pos = ml.index(v, pos)
                _decode_into(out, ids, run ^ kept, pos)
                run = kept
                if not run:
                    return out
        _decode_into(out, ids, run, len(ml))
        return out

    def holders(self, block_hash: BlockHash) -> frozenset[NodeId]:
        """The nodes storing ``block_hash`` (stored state: call :meth:`expire` first for TTL)."""
        m = self._masks.get(block_hash, 0)
        ids = self._slot_ids
        out = []
        while m:
            low = m & -m
            out.append(ids[low.bit_length() - 1])
            m ^= low
        return frozenset(out)

    def num_entries(self) -> int:
        """Stored (block, node) pairs, speculative ones included."""
        return sum(len(node.lru) for node in self._nodes.values())

    def num_blocks(self) -> int:
        """Distinct blocks held by at least one node."""
        return len(self._masks)

    def node_entries(self, node_id: NodeId) -> int:
        node = self._nodes.get(node_id)
        return 0 if node is None else len(node.lru)

    def speculative_entries(self, node_id: NodeId) -> int:
        node = self._nodes.get(node_id)
        return 0 if node is None else len(node.spec)

    def is_speculative(self, node_id: NodeId, block_hash: BlockHash) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and block_hash in node.spec

    # --- internals --------------------------------------------------------------------
    def _drop(self, node: _Node, victims: list[BlockHash]) -> None:
        """Remove distinct blocks the node holds, from lru, spec and masks (batched in C)."""
        lru, spec, masks = node.lru, node.spec, self._masks
        deque(map(lru.__delitem__, victims), 0)
        left = list(map(node.bit.__xor__, map(masks.__getitem__, victims)))
        masks.update(zip(victims, left, strict=True))
        deque(map(masks.__delitem__, compress(victims, map(not_, left))), 0)
        if spec:
            deque(map(spec.__delitem__, list(filter(spec.__contains__, victims))), 0)

    def _evict(self, node: _Node, count: int) -> None:
        """Drop the node's ``count`` least recently used entries."""
        self._drop(node, list(islice(node.lru, count)))
        self.evicted_capacity += count

    def _schedule(self, node: _Node, due: float) -> None:
        """Make sure the node has a heap item due no later than ``due``."""
        if due >= node.sched_due:
            return
        self._seq += 1
        node.sched_seq = self._seq
        node.sched_due = due
        heap = self._heap
        heapq.heappush(heap, (due, self._seq, node))
        if due < self._next_due:
            self._next_due = due
        if len(heap) > 2 * len(self._nodes) + 64:
            # superseded items pile up when dues move earlier; keep only live ones
            heap[:] = [it for it in heap if it[2].alive and it[1] == it[2].sched_seq]
            heapq.heapify(heap)
            self._next_due = heap[0][0] if heap else _INF

    def _expire_due(self, now: float) -> int:
        """Process every heap item due at ``now``: afterwards no stored entry is expired."""
        heap = self._heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _due, seq, node = heapq.heappop(heap)
            if node.alive and seq == node.sched_seq:  # else superseded
                dropped += self._expire_and_reschedule(node, now)
        self._next_due = heap[0][0] if heap else _INF
        return dropped

    def _expire_holders(self, mask: int, now: float) -> None:
        """Expire the due nodes whose bit is in ``mask`` (match's share of the work).

        Costs O(due nodes * log nodes): the other due items go back on the heap.
        """
        heap = self._heap
        others = []
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            node = item[2]
            if not node.alive or item[1] != node.sched_seq:
                continue  # superseded
            if node.bit & mask:
                self._expire_and_reschedule(node, now)  # pushes a due > now
            else:
                others.append(item)
        for item in others:
            heapq.heappush(heap, item)
        self._next_due = heap[0][0] if heap else _INF

    def _expire_and_reschedule(self, node: _Node, now: float) -> int:
        node.sched_seq = -1  # its pending item, if any, is now superseded
        node.sched_due = _INF
        dropped = self._expire_node(node, now)
        due = _INF
        if self._ttl is not None and node.lru:
            due = next(iter(node.lru.values())) + self._ttl
        if node.spec:
            due = min(due, next(iter(node.spec.values())))
        if due < _INF:
            self._schedule(node, due)
        return dropped

    def _expire_node(self, node: _Node, now: float) -> int:
        """Drop the node's expired entries: a prefix of lru (TTL) and of spec (deadline)."""
        ttl_victims: list[BlockHash] = []
        if self._ttl is not None:
            ttl = self._ttl
            for h, t in node.lru.items():
                if t + ttl > now:
                    break
                ttl_victims.append(h)
            self._drop(node, ttl_victims)
        spec_victims: list[BlockHash] = []
        for h, deadline in node.spec.items():
            if deadline > now:
                break
            spec_victims.append(h)
        self._drop(node, spec_victims)
        self.expired_ttl += len(ttl_victims)
        self.expired_speculative += len(spec_victims)
        return len(ttl_victims) + len(spec_victims)


def _decode_into(out: dict[NodeId, int], ids: list[NodeId], mask: int, value: int) -> None:
    """Set ``out[node] = value`` for every node whose slot bit is in ``mask``.

    One step per set bit: a change point of the running AND drops one or a few nodes,
    so this beats table-driven decoding (bytes of the mask) at these mask widths.
    """
    while mask:
        top = mask.bit_length() - 1
        out[ids[top]] = value
        mask ^= 1 << top


def _check_capacity(node_id: NodeId, capacity_blocks: int) -> None:
    if capacity_blocks < 0:
        raise ConfigError(f"node {node_id}: capacity_blocks must be >= 0, got {capacity_blocks}")
