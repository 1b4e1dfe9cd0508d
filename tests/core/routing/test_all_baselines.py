"""Properties every baseline policy shares: the contract of base.RoutingPolicy."""

import ast
import inspect
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.core.ids import NodeId
from kvgate.core.routing.consistent_hash import ConsistentHashPolicy
from kvgate.core.routing.dynamo_cost import DynamoCostPolicy
from kvgate.core.routing.least_loaded import LeastLoadedPolicy
from kvgate.core.routing.power_of_two import PowerOfTwoPolicy
from kvgate.core.routing.preble_e2 import PrebleE2Policy
from kvgate.core.routing.random_choice import RandomPolicy
from kvgate.core.routing.round_robin import RoundRobinPolicy
from kvgate.core.routing.sglang_cache_aware import SglangCacheAwarePolicy

FACTORIES = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "consistent_hash": ConsistentHashPolicy,
    "sglang_cache_aware": SglangCacheAwarePolicy,
    "dynamo_cost": DynamoCostPolicy,
    "dynamo_cost_t1": lambda: DynamoCostPolicy(temperature=1.0),
    "preble_e2": PrebleE2Policy,
}
CLASSES = [
    RoundRobinPolicy,
    RandomPolicy,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    ConsistentHashPolicy,
    SglangCacheAwarePolicy,
    DynamoCostPolicy,
    PrebleE2Policy,
]
USES_CACHE = {"sglang_cache_aware", "dynamo_cost", "preble_e2"}


@pytest.mark.parametrize("cls", CLASSES)
def test_name_flags_and_keyword_only_defaults(cls):
    assert cls.name in FACTORIES
    assert cls.uses_cache is (cls.name in USES_CACHE)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert all(p.default is not inspect.Parameter.empty for p in params)
    assert cls.__module__.startswith("kvgate.core.routing.")
    assert 60 <= len(inspect.getsource(inspect.getmodule(cls)).splitlines()) <= 250


@pytest.mark.parametrize("key", list(FACTORIES))
def test_excluded_node_is_never_chosen(key, make_cluster, make_ctx, matches):
    """n0 holds every prompt in full and is idle: the perfect pick, but it is excluded."""
    c = make_cluster(5)
    for i, load in enumerate((0, 3, 1, 4, 2)):
        c.load(f"n{i}", inflight=load, waiting=load)
    policy, rng = FACTORIES[key](), random.Random(1)
    cands = c.candidates("n1", "n2", "n3", "n4")
    seen = set()
    for k in range(300):
        chain = tuple(k * 100 + j for j in range(8))
        d = policy.select(make_ctx(chain), cands, matches(n0=8, n3=k % 3), c.table, rng, float(k))
        assert d is not None and d.node_id != "n0"
        assert d.best_matched_blocks == k % 3
        seen.add(d.node_id)
        if k % 2:
            policy.on_finished(d.node_id, float(k))
    assert seen <= {"n1", "n2", "n3", "n4"}


@pytest.mark.parametrize("key", list(FACTORIES))
def test_no_candidates_gives_none(key, make_cluster, make_ctx, matches):
    c = make_cluster(2)
    policy = FACTORIES[key]()
    assert policy.select(make_ctx(), [], matches(n0=4), c.table, random.Random(0), 1.0) is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.sampled_from(list(FACTORIES)),
    loads=st.lists(st.integers(0, 120), min_size=6, max_size=6),
    match_lens=st.lists(st.integers(0, 12), min_size=6, max_size=6),
    chosen=st.sets(st.integers(0, 5), min_size=1),
    prompt=st.integers(0, 900),
    seed=st.integers(0, 1000),
)
def test_decision_is_a_candidate_with_consistent_fields(
    make_cluster, make_ctx, key, loads, match_lens, chosen, prompt, seed
):
    c = make_cluster(6)
    for i, load in enumerate(loads):
        c.load(f"n{i}", inflight=load, waiting=load // 2, stale=(i == 5))
    ms = {NodeId(f"n{i}"): n for i, n in enumerate(match_lens)}
    cands = c.candidates(*(f"n{i}" for i in sorted(chosen)))
    ctx = make_ctx(tuple(range(prompt // 64)), prompt_tokens=prompt)
    policy, rng = FACTORIES[key](), random.Random(seed)
    for step in range(3):
        d = policy.select(ctx, cands, ms, c.table, rng, 10.0 + step)
        assert d is not None
        assert d.node_id in {s.node_id for s in cands}
        assert d.matched_blocks == ms[d.node_id]
        assert d.best_matched_blocks == max(ms[s.node_id] for s in cands)
        assert all(isinstance(v, float) for v in d.parts.values())


FORBIDDEN = {"asyncio", "aiohttp", "socket", "time", "random", "logging", "redis", "zmq"}


@pytest.mark.parametrize("cls", CLASSES)
def test_policy_modules_are_pure(cls):
    path = Path(inspect.getfile(cls))
    for p in (path, path.with_name("_common.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & FORBIDDEN, (p.name, names)
