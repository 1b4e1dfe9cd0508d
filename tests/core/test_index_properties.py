"""ClusterIndex against a brute-force model under random operation sequences.

The model keeps, per node, an ordered dict block -> (last touch, speculative
deadline or None), least recently touched first, and applies the index's rules
literally: touch last block first, evict from the front past capacity, an entry
touched at t is expired once ``t + ttl <= now``, a speculative one once its
deadline ``<= now``. insert and expire drop every expired entry first; match
drops those of the nodes storing the chain's first block (the only nodes that
can match), so the stored state is compared exactly, laziness included.

Two drivers share one harness: a stateful machine (good shrinking, chains drawn
from recent history) and a denser list of operations (long sequences).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvgate.core.ids import NodeId
from kvgate.core.index import ClusterIndex

NODE_NAMES = [NodeId(f"n{i}") for i in range(3)]
CHURN_OPS = ["add", "capacity", "remove", "clear"]


def chain_of(path: list[int]) -> tuple[int, ...]:
    """Chained "hashes": the key of block i is a function of path[: i + 1]."""
    out, key = [], 0x5EED
    for step in path:
        key = (key * 1_000_003 + step + 1) % (1 << 64)
        out.append(key)
    return tuple(out)


# Chains are paths in a small 3-ary tree, so random chains often share prefixes.
paths = st.lists(st.integers(0, 2), min_size=1, max_size=7)
nodes = st.sampled_from(NODE_NAMES)
capacities = st.integers(0, 8)
steps = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 3.0])  # expiry boundaries are hit
short_tails = st.lists(st.integers(0, 2), max_size=2)
ttls = st.sampled_from([None, 3.0, 10.0])
spec_ttls = st.sampled_from([1.0, 2.0])


@dataclass
class Entry:
    touch: float
    deadline: float | None  # None: confirmed


class Model:
    def __init__(self, ttl: float | None, spec_ttl: float) -> None:
        self.ttl, self.spec_ttl = ttl, spec_ttl
        self.cap: dict[NodeId, int] = {}
        self.lru: dict[NodeId, OrderedDict[int, Entry]] = {}
        self.clock = float("-inf")

    def expired(self, e: Entry, now: float) -> bool:
        if self.ttl is not None and e.touch + self.ttl <= now:
            return True
        return e.deadline is not None and e.deadline <= now

    def expire(self, now: float) -> int:
        dropped = 0
        for od in self.lru.values():
            for h in [h for h, e in od.items() if self.expired(e, now)]:
                del od[h]
                dropped += 1
        return dropped

    def set_capacity(self, n: NodeId, cap: int) -> None:
        self.cap[n] = cap
        od = self.lru.setdefault(n, OrderedDict())
        while len(od) > cap:
            od.popitem(last=False)

    def insert(self, n: NodeId, chain: tuple[int, ...], now: float, spec: bool) -> int:
        if n not in self.lru:
            return 0
        self.expire(now)
        self.clock = max(self.clock, now)
        t = self.clock
        od, added = self.lru[n], 0
        for h in reversed(chain):
            old = od.pop(h, None)
            if old is None:
                added += 1
            refresh = old is None or old.deadline is not None  # a guess stays a guess
            od[h] = Entry(t, t + self.spec_ttl if spec and refresh else None)
        self.set_capacity(n, self.cap[n])
        return added

    def match(self, chain: tuple[int, ...], now: float) -> dict[NodeId, int]:
        # match expires (all expired entries of) only the nodes storing chain[0]
        for od in self.lru.values():
            if chain and chain[0] in od:
                for h in [h for h, e in od.items() if self.expired(e, now)]:
                    del od[h]
        out = {}
        for n, od in self.lru.items():
            k = 0
            while k < len(chain) and chain[k] in od:
                k += 1
            if k:
                out[n] = k
        return out


class Harness:
    """Applies each operation to the index and the model and compares the results."""

    def __init__(self, ttl: float | None, spec_ttl: float, caps: list[int]) -> None:
        self.idx = ClusterIndex(ttl_s=ttl, speculative_ttl_s=spec_ttl)
        self.model = Model(ttl, spec_ttl)
        self.now = 0.0
        self.history: list[list[int]] = []  # paths inserted so far
        for n, cap in zip(NODE_NAMES, caps, strict=False):
            self.churn(n, cap, "add")

    def advance(self, dt: float) -> None:
        self.now += dt

    def churn(self, n: NodeId, cap: int, op: str) -> None:
        if op == "add":
            self.idx.add_node(n, cap)
            self.model.set_capacity(n, cap)
        elif op == "capacity" and n in self.model.lru:
            self.idx.set_capacity(n, cap)
            self.model.set_capacity(n, cap)
        elif op == "remove":
            self.idx.remove_node(n)
            self.model.lru.pop(n, None)
            self.model.cap.pop(n, None)
        elif op == "clear":
            od = self.model.lru.get(n)
            expected = 0 if od is None else len(od)
            if od is not None:
                od.clear()
            assert self.idx.clear_node(n) == expected

    def seen(self, k: int, cut: int, tail: list[int]) -> list[int]:
        """A recently inserted path cut after ``cut + 1`` blocks, then ``tail`` appended."""
        if not self.history:
            return tail
        old = self.history[-1 - k % min(6, len(self.history))]
        return old[: 1 + cut % len(old)] + tail

    def insert_seen(self, n: NodeId, k: int, cut: int, spec: bool) -> None:
        self.insert(n, self.seen(k, cut, []), spec)

    def match_seen(self, k: int, cut: int, tail: list[int]) -> None:
        self.match(self.seen(k, cut, tail))

    def insert(self, n: NodeId, path: list[int], spec: bool) -> None:
        if path:
            self.history.append(path)
        chain = chain_of(path)
        expected = self.model.insert(n, chain, self.now, spec)
        assert self.idx.insert(n, chain, self.now, speculative=spec) == expected

    def remove_blocks(self, n: NodeId, path: list[int], picks: list[int]) -> None:
        chain = chain_of(path)
        victims = [chain[i % len(chain)] for i in picks] if chain else []
        od = self.model.lru.get(n)
        expected = 0 if od is None else sum(od.pop(h, None) is not None for h in victims)
        assert self.idx.remove_blocks(n, victims) == expected

    def expire(self) -> None:
        assert self.idx.expire(self.now) == self.model.expire(self.now)

    def match(self, path: list[int]) -> None:
        chain = chain_of(path)
        assert self.idx.match(chain, self.now) == self.model.match(chain, self.now)

    def check(self) -> None:
        idx, model = self.idx, self.model
        assert idx.num_entries() == sum(len(od) for od in model.lru.values())
        assert sorted(idx.nodes()) == sorted(model.lru)
        blocks: dict[int, set[NodeId]] = {}
        for n, od in model.lru.items():
            assert idx.node_entries(n) == len(od) <= model.cap[n]
            assert idx.speculative_entries(n) == sum(e.deadline is not None for e in od.values())
            for h in od:
                blocks.setdefault(h, set()).add(n)
        assert idx.num_blocks() == len(blocks)
        for h, holders in blocks.items():
            assert idx.holders(h) == holders


class IndexVsModel(RuleBasedStateMachine):
    """Invariants, checked after every step:

    - match agrees with the model for every chain tried, including chains sharing prefixes.
    - No node ever holds more blocks than its capacity.
    - num_entries equals the model's number of stored (block, node) pairs.
    - holders(b) is exactly the set of nodes the model stores b on, so the index never
      reports a block a node does not hold.
    - insert, remove_blocks, clear_node and expire return the model's counts.
    """

    @initialize(
        ttl=ttls,
        spec_ttl=spec_ttls,
        caps=st.lists(st.integers(1, 8), min_size=len(NODE_NAMES), max_size=len(NODE_NAMES)),
    )
    def setup(self, ttl: float | None, spec_ttl: float, caps: list[int]) -> None:
        self.h = Harness(ttl, spec_ttl, caps)

    def _draw_path(self, data: st.DataObject) -> list[int]:
        """Mostly a path sharing a prefix with a recently inserted one, else a random one."""
        path = data.draw(paths)
        if data.draw(st.integers(0, 3)):
            k, cut = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 6))
            return self.h.seen(k, cut, path[: data.draw(st.integers(0, 2))]) or path
        return path

    @rule(dt=steps)
    def advance(self, dt: float) -> None:
        self.h.advance(dt)

    @rule(n=nodes, cap=capacities, op=st.sampled_from(CHURN_OPS))
    def churn(self, n: NodeId, cap: int, op: str) -> None:
        """Membership and engine resets: one rule, so they are rarer than inserts."""
        self.h.churn(n, cap, op)

    @rule(n=nodes, data=st.data(), spec=st.booleans())
    def insert(self, n: NodeId, data: st.DataObject, spec: bool) -> None:
        self.h.insert(n, self._draw_path(data), spec)

    @rule(n=nodes, k=st.integers(0, 5), cut=st.integers(0, 6), spec=st.booleans())
    def insert_seen(self, n: NodeId, k: int, cut: int, spec: bool) -> None:
        """Route a chain seen before (or its prefix) to a node: the common case."""
        self.h.insert_seen(n, k, cut, spec)

    @rule(n=nodes, data=st.data(), picks=st.lists(st.integers(0, 6), max_size=3))
    def remove_blocks(self, n: NodeId, data: st.DataObject, picks: list[int]) -> None:
        self.h.remove_blocks(n, self._draw_path(data), picks)

    @rule()
    def expire(self) -> None:
        self.h.expire()

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        self.h.match(self._draw_path(data))

    @invariant()
    def same_stored_state(self) -> None:
        if hasattr(self, "h"):
            self.h.check()


IndexVsModel.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_index_matches_model_stateful = IndexVsModel.TestCase


operations = st.one_of(
    st.tuples(st.just("advance"), steps),
    st.tuples(st.just("churn"), nodes, capacities, st.sampled_from(CHURN_OPS)),
    st.tuples(st.just("insert"), nodes, paths, st.booleans()),
    st.tuples(st.just("insert_seen"), nodes, st.integers(0, 5), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("remove_blocks"), nodes, paths, st.lists(st.integers(0, 6), max_size=3)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("match"), paths),
    st.tuples(st.just("match_seen"), st.integers(0, 5), st.integers(0, 6), short_tails),
    st.tuples(st.just("match_seen"), st.integers(0, 5), st.integers(0, 6), short_tails),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ttl=ttls,
    spec_ttl=spec_ttls,
    caps=st.lists(st.integers(1, 8), min_size=len(NODE_NAMES), max_size=len(NODE_NAMES)),
    ops=st.lists(operations, min_size=10, max_size=80),
)
def test_index_matches_model_long_sequences(
    ttl: float | None, spec_ttl: float, caps: list[int], ops: list[tuple[object, ...]]
) -> None:
    """Same invariants as IndexVsModel, checked after every operation of a long sequence:

    - match agrees with the model for every chain tried, including chains sharing prefixes.
    - No node ever holds more blocks than its capacity.
    - num_entries equals the model's number of stored (block, node) pairs.
    - holders(b) is exactly the set of nodes the model stores b on.
    - insert, remove_blocks, clear_node and expire return the model's counts.
    """
    h = Harness(ttl, spec_ttl, caps)
    for name, *args in ops:
        getattr(h, str(name))(*args)
        h.check()
