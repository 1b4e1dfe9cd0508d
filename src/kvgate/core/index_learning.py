"""What the gateway's own routing teaches the cache location table, and when.

Theory of operation
-------------------
In approximate mode the node a request is sent to is assumed to hold its chain from
then on: each dispatch inserts the chain into the :class:`ClusterIndex` and keeps the
blocks that were new, so that if the node never runs the attempt (it refused it, the
connection failed, it was marked down first) they can be taken back. In precise mode
the engines' KV events are the truth and a dispatch's insert is only a speculative
guess that expires unless an event confirms it; a node whose events cannot key what
it caches is switched to learning from routing as in approximate mode
(``routing_learns``).

A driver may defer the inserts (``defer``): a gateway sends the request first and
inserts soon after, off the request's path. Any read of the index applies the
deferred inserts first, oldest first, with the arguments they were made with, so the
index and every later decision are exactly as if each insert had happened inside its
decision.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgate.core.ids import BlockChain, BlockHash, NodeId
from kvgate.core.index import ClusterIndex

__all__ = ["PRECISE_INDEX_HEADROOM", "IndexLearning", "Learned"]

PRECISE_INDEX_HEADROOM = 2  # precise mode: index capacity over the engine's cache

# the blocks one dispatch taught the index (filled when its insert is applied), or None
# when it taught nothing to take back (no chain, or a speculative guess)
Learned = list[BlockHash] | None

# Deferred inserts beyond this many are applied at once: memory stays bounded if a
# driver defers and never flushes.
_MAX_DEFERRED = 1024


class IndexLearning:
    """The cache location table and the inserts routing makes into it."""

    __slots__ = ("_index", "_pending", "defer", "precise", "routing_learns")

    def __init__(self, index: ClusterIndex, *, precise: bool) -> None:
        self._index = index
        self.precise = precise
        self.defer = False  # see the module docstring; a gateway turns it on
        # precise mode: the nodes whose dispatches teach the index as in approximate mode
        self.routing_learns: set[NodeId] = set()
        self._pending: list[tuple[NodeId, BlockChain, float, bool, Learned]] = []

    @property
    def index(self) -> ClusterIndex:
        """The table, with every deferred insert applied."""
        if self._pending:
            self.flush()
        return self._index

    @property
    def pending(self) -> int:
        """Deferred inserts not applied yet."""
        return len(self._pending)

    def flush(self) -> None:
        """Apply the deferred inserts, oldest first."""
        pending = self._pending
        if pending:
            self._pending = []
            insert = self._index.insert
            for node_id, chain, at, speculative, learned in pending:
                insert(node_id, chain, at, speculative=speculative, new_out=learned)

    def add_node(self, node_id: NodeId, cache_blocks: int) -> None:
        """Make room for a node (or resize it) at its engine's cache size. In precise mode
        the engine's BlockRemoved events evict; the index's own LRU, in dispatch order and
        counting routing's speculative guesses, only bounds memory. At the engine's size
        it evicted blocks the engine still held (a running request's), which no event
        brings back: a hit sends no BlockStored."""
        capacity = cache_blocks * PRECISE_INDEX_HEADROOM if self.precise else cache_blocks
        index = self.index
        if index.has_node(node_id):
            index.set_capacity(node_id, capacity)
        else:
            index.add_node(node_id, capacity)

    def remove_node(self, node_id: NodeId) -> None:
        self.index.remove_node(node_id)

    def set_routing_learns(self, node_id: NodeId, on: bool) -> None:
        if on:
            self.routing_learns.add(node_id)
        else:
            self.routing_learns.discard(node_id)

    def learn(self, node_id: NodeId, chain: BlockChain, now: float) -> Learned:
        """A request with ``chain`` was sent to the node: teach the index (now, or later
        if deferred). Returns the list its new blocks go into, to take back with
        :meth:`unlearn` if the node never runs it, or None (nothing to take back: no
        chain, or a speculative guess of precise mode, which expires by itself)."""
        speculative = self.precise and node_id not in self.routing_learns
        learned: Learned = [] if chain and not speculative else None
        if chain:
            if self.defer and len(self._pending) < _MAX_DEFERRED:
                self._pending.append((node_id, chain, now, speculative, learned))
            else:
                self.index.insert(node_id, chain, now, speculative=speculative, new_out=learned)
        return learned

    def unlearn(
        self,
        node_id: NodeId,
        learned: Learned,
        others: Iterable[tuple[BlockChain, list[BlockHash]]],
    ) -> None:
        """Take back the blocks one dispatch to the node taught the index (``learned``,
        from :meth:`learn`), but for those another request in flight there also carries
        (``others``: each one's chain and learned list): that one will compute them, and
        they become its to take back if it fails in turn."""
        self.flush()  # a deferred insert fills ``learned``
        if not learned:
            return
        mine = set(learned)
        for chain, other_learned in others:
            backed = mine.intersection(chain)
            if backed:
                other_learned.extend(b for b in learned if b in backed)
                mine -= backed
                if not mine:
                    return
        self._index.remove_blocks(node_id, [b for b in learned if b in mine])
