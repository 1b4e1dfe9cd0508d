"""Announced evictions and crashes end cleanly: the gateways' view of a node recovers,
an idle node runs its eviction on time, and a step a crash cut short reports nothing."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec
from kvgate.engine.eviction import EvictionConfig
from kvgate.sim.cluster import ClusterConfig, SimCluster
from kvgate.sim.runner import SeededRng
from kvgate.sim.synthetic import shared_prefix_groups
from kvgate.sim.workload import SimRequest, Workload

N0 = NodeId("n0")


def controller() -> Controller:
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    ctl.add_nodes([NodeSpec(node_id=N0), NodeSpec(node_id=NodeId("n1"))], 0.0)
    return ctl


def weight(ctl: Controller, node_id: NodeId = N0) -> float:
    state = ctl.nodes.get(node_id)
    assert state is not None
    return state.cache_weight


# --- the controller's per-node discount ------------------------------------------------


def test_overlapping_announcements_discount_the_node_until_the_last_is_done() -> None:
    ctl = controller()
    discounted = ctl.config.evicting_cache_weight
    ctl.on_eviction_warning(N0, 1.0)
    ctl.on_eviction_warning(N0, 1.5)
    ctl.on_eviction_done(N0, 2.0)
    assert weight(ctl) == discounted  # the second eviction is still coming
    ctl.on_eviction_done(N0, 3.0)
    assert weight(ctl) == 1.0 and weight(ctl, NodeId("n1")) == 1.0
    ctl.on_eviction_done(N0, 4.0)  # a done whose warning was missed: no debt
    ctl.on_eviction_warning(N0, 5.0)
    assert weight(ctl) == discounted
    ctl.on_eviction_done(N0, 6.0)
    assert weight(ctl) == 1.0


def test_a_cleared_cache_ends_the_pending_evictions() -> None:
    ctl = controller()
    ctl.on_eviction_warning(N0, 1.0)
    ctl.on_eviction_warning(N0, 1.5)
    ctl.on_cache_cleared(N0, 2.0)  # crash or reset: nothing is left to evict
    assert weight(ctl) == 1.0
    ctl.on_eviction_warning(N0, 3.0)
    ctl.on_eviction_done(N0, 4.0)  # one done ends the one eviction announced since
    assert weight(ctl) == 1.0


def test_a_node_removed_mid_eviction_comes_back_undiscounted() -> None:
    ctl = controller()
    ctl.on_eviction_warning(N0, 1.0)
    ctl.remove_node(N0, 2.0)
    ctl.on_eviction_done(N0, 2.5)  # a late notice for a node we no longer know
    ctl.add_node(NodeSpec(node_id=N0), 3.0)
    assert weight(ctl) == 1.0
    ctl.on_eviction_warning(N0, 4.0)
    ctl.on_eviction_done(N0, 5.0)
    assert weight(ctl) == 1.0


def test_an_announced_eviction_done_forgets_as_many_index_blocks_in_approximate_mode() -> None:
    """The notice says how many tokens went, not which: the index drops that many of the
    node's least recently touched blocks (it kept claiming them before, and every request
    for them went back to the node to miss). Precise mode waits for BlockRemoved."""
    for mode, left in (("approximate", 2), ("precise", 6)):
        ctl = Controller(ControllerConfig(hasher="trace", index_mode=mode), rng=random.Random(1))
        ctl.add_nodes([NodeSpec(node_id=N0), NodeSpec(node_id=NodeId("n1"))], 0.0)
        ctl.index.insert(N0, (1, 2, 3), 0.0)
        ctl.index.insert(N0, (7, 8, 9), 1.0)
        ctl.on_eviction_warning(N0, 2.0)
        ctl.on_eviction_done(N0, 3.0, tokens_evicted=4 * 512 + 100)  # 4 blocks and a bit
        assert ctl.index.node_entries(N0) == left, mode
        if mode == "approximate":
            assert ctl.index.match((7, 8, 9), 3.0) == {N0: 2}  # 3, 2, 1 and 9 went
            assert ctl.stats.eviction_blocks_forgotten == 4


# --- the simulator ---------------------------------------------------------------------


def _config(**kw: object) -> ClusterConfig:
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=64), **kw)  # type: ignore[arg-type]
    # every discretionary eviction counts as bulk (8 blocks of 400 would not)
    eviction = EvictionConfig(bulk_fraction=0.0)
    return ClusterConfig(
        nodes=2, cache_blocks=400, node_capacity=32, controller=ctl, eviction=eviction
    )


def _two_requests(gap_s: float) -> Workload:
    """One request that leaves 8 blocks cached, and one ``gap_s`` later."""

    def req(rid: str, t: float, first: int) -> SimRequest:
        return SimRequest(
            request_id=rid,
            arrival_s=t,
            prompt_tokens=512 * 8,
            output_tokens=2,
            block_ids=tuple(range(first, first + 8)),
        )

    return Workload(name="w", block_tokens=512, requests=(req("a", 0.0, 0), req("b", gap_s, 100)))


def _busiest(c: SimCluster) -> int:
    return max(c.nodes, key=lambda n: (n.engine.pool.num_cached_blocks, -n.index)).index


@pytest.mark.parametrize("index_mode", ["approximate", "precise"])
def test_a_crash_during_an_announced_eviction_leaves_no_discount_behind(index_mode: str) -> None:
    """The crash drops the eviction's plan: its done still reaches the gateways, so the
    node's cache counts in full again once it is back."""
    seen: dict[str, float] = {}
    cluster = SimCluster(_config(index_mode=index_mode), _two_requests(60.0), rng=SeededRng(1))

    def evict(c: SimCluster) -> None:
        i = _busiest(c)
        assert c.bulk_evict(i, 1.0, "purge") == 8
        c.loop.after(0.5, lambda: c.crash_node(i))  # before the first batch (lead 2 s)
        c.loop.after(5.0, lambda: c.recover_node(i))
        c.loop.after(10.0, lambda: seen.update(after=weight(c.gateways[0], c.nodes[i].node_id)))
        c.loop.after(0.3, lambda: seen.update(during=weight(c.gateways[0], c.nodes[i].node_id)))

    cluster.hooks.append((10.0, evict))
    cluster.run()
    cluster.check_outcomes()
    assert seen == {"during": ControllerConfig().evicting_cache_weight, "after": 1.0}


def test_bulk_evict_on_an_idle_node_announces_and_evicts_on_time() -> None:
    """No request reaches the node for a minute: the announcement goes out at once and
    the batches run at their times, not at the next submit."""
    seen: dict[str, object] = {}
    cluster = SimCluster(_config(), _two_requests(60.0), rng=SeededRng(1))

    def evict(c: SimCluster) -> None:
        i = _busiest(c)
        node_id = c.nodes[i].node_id
        assert c.bulk_evict(i, 1.0, "purge") == 8
        # event_delay_s (0.1) later the gateway knows; 2 s lead + 7 batches of 0.5 s
        c.loop.after(0.2, lambda: seen.update(warned=weight(c.gateways[0], node_id)))
        c.loop.after(6.0, lambda: seen.update(
            done=weight(c.gateways[0], node_id), cached=c.nodes[i].engine.pool.num_cached_blocks
        ))

    cluster.hooks.append((10.0, evict))
    cluster.run()
    cluster.check_outcomes()
    assert seen == {"warned": ControllerConfig().evicting_cache_weight, "done": 1.0, "cached": 0}


@pytest.mark.parametrize("decode_runs", [True, False])
def test_a_step_a_crash_interrupted_reports_nothing_after_a_quick_recovery(
    decode_runs: bool,
) -> None:
    """Node 0 crashes in the middle of a long prefill step (0.001 s to 0.48 s) and is
    back 20 ms later, before the step's end: the step's work is lost, so the request it
    would have finished fails, and the node serves again from the step's end."""
    w = shared_prefix_groups(
        rng=SeededRng(1),
        arrivals=40.0,
        num_groups=4,
        prompts_per_group=10,
        output_tokens=1,
        system_prompt_tokens=6000,
    )
    crash_at = w.requests[5].arrival_s + 0.03
    cluster = SimCluster(replace(_config(), decode_runs=decode_runs), w, rng=SeededRng(3))
    cluster.hooks.append((crash_at, lambda c: c.crash_node(0)))
    cluster.hooks.append((crash_at + 0.02, lambda c: c.recover_node(0)))
    cluster.run()
    cluster.check_outcomes()
    first = cluster.outcomes["gsp-0"]  # sent to node 0 at once, finished by that step
    assert (first.status, first.reason, first.attempts) == ("failed", "upstream_error", 1)
    served = [o.finished_s or 0.0 for o in cluster.outcomes.values()
              if o.node == "node-0" and o.status == "completed"]
    assert served and min(served) > 0.48  # back at work, from the lost step's end
