"""The gateway's hot-path shortcuts in the core keep its decisions exactly.

* deferred index inserts (``Controller.defer_index_inserts``, on under the gateway's
  driver): decisions and the index equal those of a controller that inserts at once;
* ``NodeTable.max_model_len`` (stage 1's longest admissible request) is cached per
  model and follows node changes.
"""

from __future__ import annotations

import asyncio
import random

from kvgate.core.admission import FailureKind, InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec
from kvgate.gateway.driver import Driver, InProcessLeaseClient
from kvgate.gateway.metrics_text import GatewayMetrics


def cluster(defer: bool, mode: str = "approximate") -> Controller:
    ctl = Controller(  # no exploration: decisions follow the index alone
        ControllerConfig(hasher="trace", index_mode=mode, policy_params={"epsilon": 0.0}),
        rng=random.Random(7),
    )
    ctl.defer_index_inserts = defer
    for i in range(3):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}"), cache_blocks=40), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def test_deferred_inserts_give_the_same_decisions_and_index() -> None:
    for mode in ("approximate", "precise"):
        rng = random.Random(3)
        a, b = cluster(False, mode), cluster(True, mode)
        live: list[str] = []
        chains: list[tuple[int, ...]] = []
        for i in range(400):
            now = 0.01 * i
            op = rng.random()
            if op < 0.6 or not live:
                root = rng.randrange(6)  # siblings share a root and often more
                ids = (root, *(rng.randrange(4) + 10 * root for _ in range(rng.randrange(1, 6))))
                chains.append(ids)
                rid = f"r{i}"
                out = []
                for ctl in (a, b):
                    d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=ids,
                                                      prompt_tokens=16 * len(ids)), now)
                    out.append((type(d).__name__, getattr(d, "node_id", None),
                                getattr(getattr(d, "route", None), "matched_blocks", None)))
                assert out[0] == out[1], (i, out)
                if out[0][0] == "Dispatch":
                    live.append(rid)
                if rng.random() < 0.3:
                    b.flush_index()  # sometimes the driver's callback ran in between
            elif op < 0.85:
                rid = live.pop(rng.randrange(len(live)))
                for ctl in (a, b):
                    ctl.on_finished(RequestId(rid), now, cached_tokens=0)
            else:
                rid = live.pop(rng.randrange(len(live)))
                res = [ctl.on_failed(RequestId(rid), FailureKind.CONNECT_ERROR, now,
                                     before_first_byte=True) for ctl in (a, b)]
                seen = [[(type(d).__name__, getattr(d, "node_id", None)) for d in r]
                        for r in res]
                assert seen[0] == seen[1], (i, seen)
                if any(isinstance(d, Dispatch) for d in res[0]):
                    live.append(rid)
        for ids in chains:
            assert a.index.match(ids, 5.0) == b.index.match(ids, 5.0)
        assert a.index.num_entries() == b.index.num_entries()
        assert not b.learning.pending


def test_driver_flushes_after_the_decision_and_the_next_one_sees_the_chain() -> None:
    async def body() -> None:
        ctl = cluster(False)
        driver = Driver(ctl, InProcessLeaseClient(InProcessCoordinator(ctl.config.admission)),
                        GatewayMetrics(), clock=lambda: 0.1)
        assert ctl.defer_index_inserts
        first = await driver.admit(RequestArrived(request_id=RequestId("a"),
                                                  block_ids=(1, 2, 3), prompt_tokens=48))
        assert isinstance(first, Dispatch)
        assert ctl.learning.pending  # not yet: the request goes out first
        second = await driver.admit(RequestArrived(request_id=RequestId("b"),
                                                   block_ids=(1, 2, 3, 4), prompt_tokens=64))
        assert isinstance(second, Dispatch) and second.route.matched_blocks == 3
        await asyncio.sleep(0)
        assert not ctl.learning.pending  # the loop callback flushed
        assert ctl.index.match((1, 2, 3, 4), 1.0)[first.node_id] >= 3

    asyncio.run(body())


def test_max_seq_len_is_cached_and_follows_node_changes() -> None:
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    longest = ctl.nodes.max_model_len
    assert longest("m") is None
    ctl.add_node(NodeSpec(node_id=NodeId("a"), max_model_len=1000), 0.0)
    assert longest("m") == 1000
    ctl.add_node(NodeSpec(node_id=NodeId("b"), max_model_len=4000,
                          models=frozenset({"m"})), 0.0)
    assert longest("m") == 4000 and longest("other") == 1000
    ctl.add_node(NodeSpec(node_id=NodeId("b"), max_model_len=500,
                          models=frozenset({"m"})), 0.0)  # spec change
    assert longest("m") == 1000
    ctl.remove_node(NodeId("a"), 0.0)
    assert longest("m") == 500 and longest("other") is None
    for i in range(100):  # many model names: bounded, still right
        assert longest(f"x{i}") is None
    assert len(ctl.nodes._longest) <= 64 and longest("m") == 500
