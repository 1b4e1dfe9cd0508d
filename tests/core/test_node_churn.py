"""Node ids come and go (a new pod name per restart): no policy keeps state per gone node."""

from __future__ import annotations

import pickle
import random

import pytest

from kvgate.core.admission import FailureKind, InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec
from kvgate.core.routing import POLICIES


def churn(ctl: Controller, coord: InProcessCoordinator, rounds: int, start: int) -> None:
    # two nodes at a time; each round one leaves and a new one joins after serving
    for i in range(start, start + rounds):
        new = NodeId(f"pod-{i}")
        ctl.add_node(NodeSpec(node_id=new), float(i))
        ctl.on_load_report(new, waiting=0, running=0, kv_util=0.1, now=float(i))
        ctl.refresh_with(coord, float(i))
        for k in range(4):
            rid = RequestId(f"r{i}-{k}")
            d = ctl.on_arrival(RequestArrived(request_id=rid, block_ids=(i, k),
                                              prompt_tokens=600), i + 0.1)
            assert isinstance(d, Dispatch)
            ctl.on_first_byte(rid, i + 0.2)
            if k % 2:  # half finish; the others are cut off by the removal
                ctl.on_finished(rid, i + 0.3, cached_tokens=0)
        for node in list(ctl.nodes):
            if node.spec.node_id != new:
                ctl.remove_node(node.spec.node_id, i + 0.5)
        for k in (0, 2):  # the cut-off streams end (their clients hang up)
            ctl.on_cancelled(RequestId(f"r{i}-{k}"), i + 0.55)
        ctl.tick(i + 0.6)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_forget_removed_nodes(policy: str) -> None:
    ctl = Controller(ControllerConfig(hasher="trace", policy=policy), rng=random.Random(3))
    coord = InProcessCoordinator(ctl.config.admission)
    churn(ctl, coord, 300, 0)  # past every time window (preble_e2's is 180 s)
    before = len(pickle.dumps(ctl.policy))
    churn(ctl, coord, 600, 300)
    after = len(pickle.dumps(ctl.policy))
    assert after <= before * 1.2 + 512, (policy, before, after)


def _one_node(policy: str) -> Controller:
    ctl = Controller(ControllerConfig(hasher="trace", policy=policy), rng=random.Random(3))
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.0)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def _send(ctl: Controller, rid: str, now: float) -> None:
    d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=(len(rid), 1),
                                      prompt_tokens=100), now)
    assert isinstance(d, Dispatch) and d.node_id == "n0"


def test_a_request_outliving_its_node_leaves_the_new_node_of_that_id_alone() -> None:
    """A node removed and added back under the same id (a restarted pod on the same
    address) is a new node: what the old one's requests do later is not about it."""
    ctl = _one_node("dynamo_cost")
    _send(ctl, "old", 0.1)
    ctl.remove_node(NodeId("n0"), 0.2)
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.3)
    _send(ctl, "new", 0.4)
    active = ctl.policy.active_blocks(NodeId("n0"))  # type: ignore[attr-defined]
    assert active > 0
    ctl.on_finished(RequestId("old"), 0.5)
    assert ctl.policy.active_blocks(NodeId("n0")) == active  # type: ignore[attr-defined]


def test_a_request_outliving_its_node_leaves_the_kvgate_score_of_its_successor_moving() -> None:
    """The old node's request ending took the new node (same id) out of the set whose
    scores follow their prefill draining: its predicted wait froze at its first value."""
    from kvgate.core.routing.kvgate_loads import LoadScores

    ctl = _one_node("kvgate")
    d = ctl.on_arrival(RequestArrived(request_id=RequestId("old"), block_ids=(1, 2, 3),
                                      prompt_tokens=20_000), 0.0)
    assert isinstance(d, Dispatch)
    ctl.remove_node(NodeId("n0"), 0.1)
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.1)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.1, now=0.1)
    d = ctl.on_arrival(RequestArrived(request_id=RequestId("new"), block_ids=(4, 5, 6),
                                      prompt_tokens=20_000), 0.2)
    assert isinstance(d, Dispatch)
    ctx = ctl._requests[RequestId("new")].ctx
    ctl.route(ctx, 0.25)  # syncs the policy's scores: the new node's prefill drains
    ctl.on_finished(RequestId("old"), 0.3)
    ctl.route(ctx, 0.3)
    ctl.route(ctx, 1.2)
    loads = ctl.policy._loads  # type: ignore[attr-defined]
    fresh = LoadScores()
    fresh.rebuild(ctl.nodes, list(ctl.nodes), 1.2, loads.params)
    assert loads.by_id[NodeId("n0")].wait == pytest.approx(fresh.by_id[NodeId("n0")].wait)


def test_failures_on_a_removed_node_do_not_eject_its_successor() -> None:
    ctl = _one_node("least_loaded")
    n = ctl.config.eject_after_failures
    for i in range(n):
        _send(ctl, f"r{i}", 0.1)
    ctl.remove_node(NodeId("n0"), 0.2)
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.3)
    for i in range(n):  # the old node's streams break after the removal
        ctl.on_failed(RequestId(f"r{i}"), FailureKind.UPSTREAM_ERROR, 0.4,
                      before_first_byte=False)
    state = ctl.nodes.get(NodeId("n0"))
    assert state is not None and state.healthy and state.consecutive_failures == 0
    ctl.set_healthy(NodeId("n0"), False, 1.0)  # the new node's own health probe fails
    ctl.tick(0.4 + ctl.config.eject_s + 1)  # and no ejection of the old one revives it
    assert not state.healthy


@pytest.mark.parametrize("mode", ["approximate", "precise"])
def test_a_node_back_from_unhealthy_has_an_empty_cache_in_approximate_mode(mode: str) -> None:
    """A node out after failed health checks most likely restarted, and a restarted
    engine's prefix cache is empty. Approximate mode has no event to say so (precise
    mode has the engine's AllBlocksCleared): it forgets the node's blocks when the node
    comes back, instead of sending requests there for hits it no longer holds."""
    cfg = ControllerConfig(hasher="trace", policy="kvgate", index_mode=mode)  # type: ignore[arg-type]
    ctl = Controller(cfg, rng=random.Random(3))
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.0)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    _send(ctl, "r1", 0.1)  # approximate: the index learns the prompt's blocks from it
    if mode == "precise":  # precise: the node's events, not our routing, fill the index
        ctl.on_blocks_stored(NodeId("n0"), [3, 1], 0.15)
    held = ctl.index.num_blocks()
    assert held >= 2
    ctl.set_healthy(NodeId("n0"), False, 0.3)
    assert ctl.index.num_blocks() == held  # out, not forgotten yet
    ctl.set_healthy(NodeId("n0"), True, 0.5)
    assert ctl.index.num_blocks() == (0 if mode == "approximate" else held)


def test_precise_mode_keeps_what_the_engine_holds_past_its_own_lru() -> None:
    """Precise mode: the index's LRU ran at the engine's cache size, in dispatch order
    and counting routing's speculative guesses, so it evicted a block the engine still
    held (a running request's); a later hit on it sends no BlockStored, and the index
    never had it again. The engine's BlockRemoved is what evicts: the index keeps
    twice the cache, only to bound memory."""
    cfg = ControllerConfig(hasher="trace", policy="kvgate", index_mode="precise")
    ctl = Controller(cfg, rng=random.Random(3))
    n0 = NodeId("n0")
    ctl.add_node(NodeSpec(node_id=n0, cache_blocks=8), 0.0)
    assert ctl.index.capacity(n0) == 16
    r1, r2, r3 = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]
    ctl.on_blocks_stored(n0, r1, 0.01)  # r1 runs on, its blocks in use
    ctl.on_blocks_stored(n0, r2, 0.11)  # r2 finishes: its blocks free, cached
    ctl.index.insert(n0, r3, 0.2, speculative=True)  # r3 dispatched (a guess)
    ctl.on_blocks_removed(n0, r2, 0.21)  # the engine evicts r2's blocks for r3's
    ctl.on_blocks_stored(n0, r3, 0.21)
    assert ctl.index.match(r1, 5.0).get(n0) == 4  # r1's follow-up still finds them


def test_precise_mode_lets_routing_teach_the_index_for_a_node_while_asked() -> None:
    """A gateway started after a long-running engine: the engine's events continue
    prefixes they never named (orphans), so precise mode alone would never see them;
    while the driver asks, dispatches to that node teach the index as in approximate
    mode (kept, not speculative guesses that expire in 2 s)."""
    cfg = ControllerConfig(hasher="trace", policy="kvgate", index_mode="precise")
    ctl = Controller(cfg, rng=random.Random(3))
    n0 = NodeId("n0")
    ctl.add_node(NodeSpec(node_id=n0), 0.0)
    ctl.on_load_report(n0, waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    _send(ctl, "r1", 0.1)
    assert ctl.index.speculative_entries(n0) == ctl.index.node_entries(n0) > 0  # guesses
    ctl.set_routing_learns(n0, True)
    _send(ctl, "r22", 0.2)
    assert ctl.index.node_entries(n0) > ctl.index.speculative_entries(n0)  # learnt, kept
    ctl.set_routing_learns(n0, False)
    ctl.remove_node(n0, 0.3)
    assert n0 not in ctl.routing_learns
