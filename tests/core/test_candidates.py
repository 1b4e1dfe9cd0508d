"""Controller.candidates reuses the node table's cached eligible lists; whatever the
sequence of membership, spec, health, drain and load changes, it must return what
filtering every node afresh returns."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.core.admission import InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec, NodeState
from kvgate.core.routing import RouteContext

NAMES = [NodeId(f"n{i}") for i in range(6)]
MODELS = ["", "llama", "qwen"]


def reference(
    ctl: Controller, ctx: RouteContext, excluded: set[NodeId], now: float
) -> list[NodeState]:
    need = ctx.prompt_tokens + ctx.max_tokens
    out = [
        s
        for s in ctl.nodes
        if s.healthy
        and not s.draining
        and s.node_id not in excluded
        and s.spec.max_model_len >= need
        and (not ctx.model or s.serves(ctx.model))
    ]
    if ctl.admission.degraded:
        limit = ctl.config.safe_mode_max_queue
        out = [
            s
            for s in out
            if not ctl.nodes.is_stale(s, now)
            and s.reported_waiting < limit
            and s.reported_running + ctl.nodes.queue(s, now) < s.spec.capacity + limit
        ]
    return out


spec_st = st.builds(
    NodeSpec,
    node_id=st.sampled_from(NAMES),
    models=st.sets(st.sampled_from(MODELS[1:])).map(frozenset),
    max_model_len=st.sampled_from([1000, 4000, 131_072]),
)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("add"), spec_st),
        st.tuples(st.just("remove"), st.sampled_from(NAMES)),
        st.tuples(st.just("healthy"), st.sampled_from(NAMES), st.booleans()),
        st.tuples(st.just("draining"), st.sampled_from(NAMES), st.booleans()),
        st.tuples(
            st.just("report"), st.sampled_from(NAMES), st.integers(0, 12), st.integers(0, 80)
        ),
        st.tuples(st.just("lease"), st.booleans()),
        st.tuples(
            st.just("check"),
            st.sampled_from(MODELS),
            st.sampled_from([100, 900, 3000, 20_000]),
            st.sets(st.sampled_from(NAMES), max_size=2),
        ),
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st)
def test_candidates_match_a_fresh_filter(ops: list[tuple[object, ...]]) -> None:
    ctl = Controller(ControllerConfig(policy="kvgate"), rng=random.Random(0))
    coord = InProcessCoordinator(ctl.config.admission)
    now = 1.0
    for op in ops:
        now += 0.1
        kind = op[0]
        if kind == "add":
            ctl.add_node(op[1], now)  # type: ignore[arg-type]
        elif kind == "remove":
            ctl.remove_node(op[1], now)  # type: ignore[arg-type]
        elif kind == "healthy":
            ctl.set_healthy(op[1], op[2], now)  # type: ignore[arg-type]
        elif kind == "draining":
            ctl.set_draining(op[1], op[2], now)  # type: ignore[arg-type]
        elif kind == "report":
            ctl.on_load_report(op[1], waiting=op[2], running=op[3], kv_util=0.1, now=now)  # type: ignore[arg-type]
        elif kind == "lease":
            if op[1]:
                ctl.refresh_with(coord, now)
            else:
                ctl.on_refresh_failed(now)
        else:
            _, model, tokens, excluded = op
            ctx = RouteContext(
                chain=(1, 2),
                prompt_tokens=tokens,  # type: ignore[arg-type]
                tokens_per_block=64,
                max_tokens=100,
                model=model,  # type: ignore[arg-type]
            )
            got = ctl.candidates(ctx, excluded, now)  # type: ignore[arg-type]
            assert got == reference(ctl, ctx, excluded, now)  # type: ignore[arg-type]
            got.clear()  # the caller owns the list: the cache must not care
            assert ctl.candidates(ctx, excluded, now) == reference(ctl, ctx, excluded, now)  # type: ignore[arg-type]


def test_eligible_follows_every_kind_of_change() -> None:
    ctl = Controller(ControllerConfig(policy="kvgate"), rng=random.Random(0))
    a, b = NodeId("a"), NodeId("b")
    ctl.add_node(NodeSpec(node_id=a, models=frozenset({"llama"})), 0.0)
    ctl.add_node(NodeSpec(node_id=b), 0.0)

    def ids(model: str = "") -> list[str]:
        return [s.node_id for s in ctl.nodes.eligible(model)[0]]

    assert ids() == ["a", "b"] and ids("qwen") == ["b"]
    v = ctl.nodes.version
    ctl.set_healthy(a, False, 0.0)
    assert ids() == ["b"] and ctl.nodes.version > v
    ctl.set_healthy(a, True, 0.0)
    ctl.set_draining(b, True, 0.0)
    assert ids() == ["a"]
    ctl.set_draining(b, False, 0.0)
    ctl.add_node(NodeSpec(node_id=a, models=frozenset({"qwen"}), max_model_len=500), 0.0)
    assert ids("qwen") == ["a", "b"] and ids("llama") == ["b"]
    assert ctl.nodes.eligible()[1] == 500  # the smallest max_model_len among them
    ctl.remove_node(b, 0.0)
    assert ids() == ["a"]
    v = ctl.nodes.version
    ctl.set_healthy(a, True, 0.0)  # no change: no invalidation
    ctl.on_load_report(a, waiting=3, running=0, kv_util=0.0, now=0.0)
    assert ctl.nodes.version == v


def _safe_mode_controller() -> tuple[Controller, NodeId]:
    """One node of capacity 64 with a fresh report of an empty node, and a gateway
    whose coordinator never answered (degraded: safe mode)."""
    ctl = Controller(ControllerConfig(policy="kvgate"), rng=random.Random(0))
    node = NodeId("n0")
    ctl.add_node(NodeSpec(node_id=node, capacity=64), 0.0)
    ctl.on_load_report(node, waiting=0, running=0, kv_util=0.0, now=0.0)
    assert ctl.admission.degraded
    return ctl, node


def test_safe_mode_counts_unreported_sends_against_the_nodes_capacity() -> None:
    """Our sends since the node's report are mostly running by now: an idle node of
    capacity 64 takes a burst of 24 in safe mode (counted as queue, it took 8 per scrape
    interval and the other 16 were refused on an idle cluster), and stops taking more
    once 64 + 8 (the safe-mode queue) are there; a node that reports a queue of 8 has no
    room."""
    ctl, node = _safe_mode_controller()
    state = ctl.nodes.get(node)
    assert state is not None
    ctx = RouteContext(chain=(1,), prompt_tokens=10, tokens_per_block=64, max_tokens=10)
    for i in range(24):
        ctl.nodes.on_sent(state, now=0.1, key=f"r{i}", prefill_tokens=10, prefill_pairs=0.0,
                          context_tokens=10, tenant="t")
    assert ctl.candidates(ctx, set(), 0.1) == [state]
    for i in range(24, 72):
        ctl.nodes.on_sent(state, now=0.1, key=f"r{i}", prefill_tokens=10, prefill_pairs=0.0,
                          context_tokens=10, tenant="t")
    assert ctl.candidates(ctx, set(), 0.1) == []
    ctl.on_load_report(node, waiting=8, running=10, kv_util=0.2, now=0.2)
    assert ctl.candidates(ctx, set(), 0.2) == []
