"""The routed tree: what SGLang's HTTP-mode router knows, its own routing and nothing
of the engine's evictions, and the controller matching a "routed" policy against it."""

from __future__ import annotations

import random

import pytest

from kvgate.core.admission import InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec
from kvgate.core.routed_tree import RoutedTree
from kvgate.core.routing import make_policy
from kvgate.core.routing.base import cache_view

A, B = NodeId("a"), NodeId("b")


def test_match_is_the_run_of_leading_blocks_routed_to_each_node() -> None:
    tree = RoutedTree()
    tree.insert(A, (1, 2, 3), 16)
    tree.insert(B, (1, 5), 16)
    assert tree.match((1, 2, 3, 4)) == {A: 3, B: 1}
    assert tree.match((1, 5, 3)) == {A: 1, B: 2}
    assert tree.match((9, 2, 3)) == {}
    assert tree.match(()) == {}
    tree.forget(A)
    assert tree.match((1, 2, 3)) == {B: 1} and tree.size(A) == 0


def test_past_its_bound_the_least_recently_routed_leaves_go_first() -> None:
    tree = RoutedTree(max_tokens=5 * 16)  # five blocks of 16 tokens
    tree.insert(A, (1, 2, 3), 16)
    tree.insert(A, (7, 8), 16)
    assert tree.size(A) == 5
    tree.insert(A, (1, 2, 3), 16)  # touched again: now (7, 8) are the oldest
    tree.insert(A, (9,), 16)
    assert tree.size(A) == 5
    assert tree.match((7, 8)) == {A: 1}  # the leaf 8 went first; its root 7 stays
    assert tree.match((1, 2, 3)) == {A: 3} and tree.match((9,)) == {A: 1}
    with pytest.raises(ValueError):
        RoutedTree(max_tokens=0)


def test_sglang_reads_the_routed_tree_unless_told_to_read_the_index() -> None:
    assert cache_view(make_policy("sglang_cache_aware")) == "routed"
    assert cache_view(make_policy("sglang_cache_aware", {"tree": "index"})) == "index"
    assert cache_view(make_policy("dynamo_cost")) == "index"
    assert cache_view(make_policy("kvgate")) == "index"


def _cluster(**params: object) -> Controller:
    ctl = Controller(
        ControllerConfig(hasher="trace", policy="sglang_cache_aware", policy_params=params),
        rng=random.Random(0),
    )
    for node in (A, B):
        # four blocks of cache: the index forgets a node's oldest prompt at once
        ctl.add_node(NodeSpec(node_id=node, cache_blocks=4), 0.0)
        ctl.on_load_report(node, waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def _send(ctl: Controller, rid: str, ids: tuple[int, ...], now: float) -> Dispatch:
    d = ctl.on_arrival(
        RequestArrived(request_id=RequestId(rid), block_ids=ids, prompt_tokens=2048), now
    )
    assert isinstance(d, Dispatch)
    ctl.on_first_byte(RequestId(rid), now + 0.1)
    ctl.on_finished(RequestId(rid), now + 0.2, cached_tokens=0)
    return d


@pytest.mark.parametrize("tree", ["routed", "index"])
def test_a_prompt_the_index_has_forgotten_goes_back_where_sglang_sent_it(tree: str) -> None:
    ctl = _cluster(tree=tree)
    first = _send(ctl, "p", (1, 2, 3, 4), 1.0)
    # misses go to the least loaded (ties: the lowest slot)
    for k, ids in enumerate([(11, 12, 13, 14), (21, 22, 23, 24), (31, 32, 33, 34)]):
        _send(ctl, f"q{k}", ids, 2.0 + k)
    assert ctl.index.match((1, 2, 3, 4), 6.0) == {}  # both nodes' four blocks moved on
    again = _send(ctl, "p2", (1, 2, 3, 4), 6.0)
    if tree == "routed":  # SGLang's tree still names the node it was sent to
        assert again.node_id == first.node_id and again.route.matched_blocks == 4
    else:  # a tree told of the evictions finds nothing
        assert again.route.matched_blocks == 0


def test_sglang_reads_its_routed_tree_in_precise_mode_too() -> None:
    """The HTTP router reads no KV events; fed them, its threshold policy was a hybrid
    no SGLang runs (the gRPC mode that reads them selects by overlap, no threshold)."""
    ctl = Controller(
        ControllerConfig(hasher="trace", policy="sglang_cache_aware", index_mode="precise"),
        rng=random.Random(0),
    )
    assert ctl.routed is not None
    assert _cluster().routed is not None
    assert _cluster(tree="index").routed is None
