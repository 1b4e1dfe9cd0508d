"""A fleet's gateways give their nodes slots in orders of their own.

The lowest slot is every policy's last tie-break. With one shared order, every gateway
of a fleet sent its first request to the same idle node, its second to the next, and
so on: G cold prefills colliding node after node at a fleet's start.
"""

from __future__ import annotations

import random

from xxhash import xxh3_64_intdigest

from kvgate.core.admission import AdmissionConfig, InProcessCoordinator, LeaseConfig
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec, fleet_order

SPECS = [NodeSpec(node_id=NodeId(f"node-{i}")) for i in range(8)]


def _slots(ctl: Controller) -> list[str]:
    return [s.node_id for s in sorted(ctl.nodes, key=lambda s: s.slot)]


def test_fleet_order_is_a_stable_permutation_of_its_own_per_gateway() -> None:
    orders = {g: [s.node_id for s in fleet_order(f"gw{g}", SPECS)] for g in range(4)}
    for order in orders.values():
        assert sorted(order) == sorted(s.node_id for s in SPECS)
    # the same in every call (a stable hash, not Python's salted one), whatever the input order
    assert [s.node_id for s in fleet_order("gw1", reversed(SPECS))] == orders[1]
    assert len({order[0] for order in orders.values()}) >= 3
    assert len({tuple(order) for order in orders.values()}) == 4


def _controller(gateway: int, gateways: int) -> Controller:
    adm = AdmissionConfig(budget=64, lease=LeaseConfig(expected_gateways=gateways))
    # no fleet home: a cold prefix's place is left to the score and its tie-break
    params = {"epsilon": 0, "fleet_home_s": 0.0}
    return Controller(
        ControllerConfig(hasher="trace", admission=adm, policy_params=params),
        rng=random.Random(gateway),
        gateway_id=f"gw{gateway}",
    )


def test_a_lone_gateway_keeps_the_order_it_is_given() -> None:
    ctl = _controller(0, 1)
    ctl.add_nodes(SPECS, 0.0)
    assert _slots(ctl) == [s.node_id for s in SPECS]


def test_each_gateway_of_a_fleet_sends_its_first_cold_request_to_its_own_first_node() -> None:
    """Four gateways, eight idle nodes, one uncached request each: with a shared order
    all four went to node-0; now each goes to the first node of its own order. (Each
    gateway has a coordinator of its own here: admission is not what is tested.)"""
    firsts = []
    for g in range(4):
        ctl = _controller(g, 4)
        ctl.add_nodes(SPECS, 0.0)
        assert _slots(ctl) == [s.node_id for s in fleet_order(f"gw{g}", SPECS)]
        for s in SPECS:
            ctl.on_load_report(s.node_id, waiting=0, running=0, kv_util=0.0, now=0.0)
        ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
        req = RequestArrived(request_id=RequestId(f"r{g}"), block_ids=(g,), prompt_tokens=4000)
        d = ctl.on_arrival(req, 0.1)
        assert isinstance(d, Dispatch)
        assert d.route.node_id == _slots(ctl)[0]
        firsts.append(d.route.node_id)
    assert len(set(firsts)) >= 3


def test_a_fleet_gateway_routes_a_new_prefix_to_its_home_whichever_gateway_it_is() -> None:
    """Through the controller: a gateway of a fleet tells the policy so, and kvgate's
    fleet home sends a prefix nobody holds to the same node at every gateway (the
    highest xxh3 of its first block and the node), whatever each gateway sent before."""
    homes = []
    for g in range(3):
        adm = AdmissionConfig(budget=64, lease=LeaseConfig(expected_gateways=3))
        ctl = Controller(
            ControllerConfig(hasher="trace", admission=adm, policy_params={"epsilon": 0}),
            rng=random.Random(g),
            gateway_id=f"gw{g}",
        )
        ctl.add_nodes(SPECS, 0.0)
        for s in SPECS:
            ctl.on_load_report(s.node_id, waiting=0, running=0, kv_util=0.0, now=0.0)
        ctl.refresh_with(InProcessCoordinator(adm), 0.0)
        for i in range(g):  # a different history at each gateway
            warm = RequestArrived(request_id=RequestId(f"w{i}"), block_ids=(100 + i,))
            assert isinstance(ctl.on_arrival(warm, 0.05), Dispatch)
        req = RequestArrived(request_id=RequestId("r"), block_ids=(7, 8, 9), prompt_tokens=1500)
        d = ctl.on_arrival(req, 0.1)
        assert isinstance(d, Dispatch)
        homes.append(d.route.node_id)
    # the trace hasher takes block ids as the chain: block 7 is the first past no match
    want = max(SPECS, key=lambda s: xxh3_64_intdigest(f"7\0{s.node_id}".encode())).node_id
    assert homes == [want] * 3
