"""Node ids come and go (a new pod name per restart): no policy keeps state per gone node."""

from __future__ import annotations

import pickle
import random

import pytest

from kvgate.core.admission import InProcessCoordinator
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
