"""Decode runs (engine/decode_run.py) change how fast the simulator goes, never what
it finds: every report is the same with them as with one event per engine step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.engine.api import EngineRequest
from kvgate.engine.engine import SimEngine
from kvgate.sim.cluster import ClusterConfig
from kvgate.sim.runner import SeededRng, run_policy
from kvgate.sim.scenarios import SCENARIOS
from kvgate.sim.synthetic import agent_loops, multi_turn_chat, shared_prefix_groups
from kvgate.sim.workload import SimRequest, Workload

WALL_KEYS = {"wall_s", "sim_requests_per_wall_s"}


def _config(nodes: int = 3) -> ClusterConfig:
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=32 * nodes))
    return ClusterConfig(nodes=nodes, cache_blocks=300, node_capacity=32, controller=ctl)


def _without_wall(rep: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rep.items() if k not in WALL_KEYS}


def _both(workload: Workload, cfg: ClusterConfig, hooks: Any = (), policy: str = "kvgate") -> Any:
    reports = []
    for runs in (False, True):
        cluster, rep = run_policy(
            workload, replace(cfg, decode_runs=runs), policy, seed=1, hooks=hooks
        )
        steps = cluster.loop.events_run
        reports.append((_without_wall(rep), steps))
    (plain, plain_events), (batched, batched_events) = reports
    return plain, batched, plain_events, batched_events


WORKLOADS = {
    "gsp": lambda: shared_prefix_groups(
        rng=SeededRng(1), arrivals=12.0, num_groups=6, prompts_per_group=12
    ),
    "chat": lambda: multi_turn_chat(rng=SeededRng(2), arrivals=2.0, num_sessions=25),
    "agent": lambda: agent_loops(rng=SeededRng(3), arrivals=0.5, num_tasks=12),
    "agent_closed": lambda: agent_loops(
        rng=SeededRng(3), arrivals=0.5, num_tasks=12, closed_loop=True
    ),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("policy", ["kvgate", "round_robin"])
def test_the_same_report_with_and_without_decode_runs(name: str, policy: str) -> None:
    plain, batched, plain_events, batched_events = _both(
        WORKLOADS[name](), _config(), policy=policy
    )
    assert batched == plain
    assert batched_events < plain_events  # the runs did replace step events


def test_the_same_report_when_the_index_learns_from_kv_events() -> None:
    cfg = _config()
    cfg = replace(cfg, controller=replace(cfg.controller, index_mode="precise"))
    plain, batched, _, _ = _both(WORKLOADS["chat"](), cfg)
    assert batched == plain


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_same_scenario_report_with_and_without_decode_runs(scenario: str) -> None:
    w = multi_turn_chat(rng=SeededRng(2), arrivals=1.0, num_sessions=30)
    cfg = _config(nodes=4)
    kw: dict[str, Any] = {"flood": True, "quota": 4} if scenario == "tenant_flood" else {}
    plan = SCENARIOS[scenario](w, cfg, SeededRng(3), **kw)
    plain, batched, _, _ = _both(plan.workload, plan.config, plan.hooks)
    assert batched == plain


def _decoding_engine(max_tokens: int = 40) -> SimEngine:
    engine = SimEngine()
    bs = engine.pool.block_size
    for i in range(3):
        engine.submit(
            EngineRequest(
                request_id=f"r{i}",
                prompt_tokens=5 * bs + 3,
                block_hashes=tuple(100 * i + b for b in range(5)),
                max_tokens=max_tokens + i,
                arrival=0.0,
            ),
            0.0,
        )
    now = 0.0
    for _ in range(2):  # the prefills, then one decode step
        out = engine.step(now)
        assert out is not None
        now = out.end
    return engine


def test_a_run_ends_where_the_steps_one_by_one_end_and_a_cut_takes_steps_back() -> None:
    one_by_one, batched = _decoding_engine(), _decoding_engine()
    start = 10.0
    out = batched.run_decodes(start)
    assert out is not None
    run = batched.decode_run
    assert run is not None and run.steps >= 2 and run.starts[0] == start
    now, ends = start, []
    for _ in range(run.steps):
        step = one_by_one.step(now)
        assert step is not None and not step.finished and not step.first_token_ids
        now = step.end
        ends.append(now)
    assert out.end == ends[-1]  # the very float
    assert out.num_decode_seqs == 3 * run.steps and set(out.tokens.values()) == {run.steps}
    assert batched.metrics() == one_by_one.metrics()

    # something arrives just after the third step began: the rest is taken back
    settled = batched.settle(ends[1] + 1e-9)
    assert settled is not None and batched.decode_run is not None
    assert batched.decode_run.steps == 3 and settled.end == ends[2]
    assert batched.metrics().generation_tokens == one_by_one.metrics().generation_tokens - 3 * (
        len(ends) - 3
    )
    assert batched.settle(ends[1] + 1e-9) is None  # nothing more to take back


def test_no_run_when_a_step_would_change_more_than_time() -> None:
    engine = _decoding_engine(max_tokens=3)  # r0 finishes at its next step
    assert engine.run_decodes(1.0) is None
    fresh = SimEngine()
    assert fresh.run_decodes(0.0) is None  # nothing running


@pytest.mark.parametrize("crash_at", [3.0, 3.013, 4.5])
def test_a_crash_in_the_middle_of_a_run_counts_the_steps_that_ended(crash_at: float) -> None:
    w = multi_turn_chat(rng=SeededRng(2), arrivals=4.0, num_sessions=6)
    counted = []
    for runs in (False, True):
        cfg = replace(_config(nodes=1), decode_runs=runs)
        cluster, rep = run_policy(w, cfg, "kvgate", seed=1, hooks=[(crash_at, _crash_node_0)])
        counted.append((cluster.nodes[0].decode_tokens, _without_wall(rep)))
    assert counted[0][0] > 0 and counted[1] == counted[0]


def _crash_node_0(cluster: Any) -> None:
    cluster.crash_node(0)


def _request(
    rid: str, t: float, prompt: int = 600, output: int = 400, first_block: int = 1
) -> SimRequest:
    blocks = (first_block, *(1000 * (ord(rid[0]) - 96) + b for b in range(1, -(-prompt // 512))))
    return SimRequest(
        request_id=rid, arrival_s=t, prompt_tokens=prompt, output_tokens=output, block_ids=blocks
    )


def _slow_node_0(cluster: Any) -> None:
    cluster.slow_node(0, 10.0)


def _recover_node_0(cluster: Any) -> None:
    cluster.recover_node(0)


def _reject_all_node_0(cluster: Any) -> None:
    cluster.reject_all_node(0)


# faults injected while node 0 is in the middle of a decode run (its one request has
# decoded for a second): they apply from the next step on, with runs as without them
FAULT_CASES: dict[str, tuple[tuple[float, Any], ...]] = {
    "slow": ((1.0, _slow_node_0),),
    "slow_then_recover": ((1.0, _slow_node_0), (2.0, _recover_node_0)),
    # the refusal reaches the request arriving at 2 s, which fails (no other node)
    "reject_all": ((1.0, _reject_all_node_0), (3.0, _recover_node_0)),
}


@pytest.mark.parametrize("case", sorted(FAULT_CASES))
def test_a_fault_in_the_middle_of_a_decode_run_applies_from_the_next_step(case: str) -> None:
    """A slow fault injected at t = 1 into a node decoding one 600-token prompt's 400
    tokens used to wait for the end of the decode run: the request finished at 4.597 s
    with runs and 35.876 s without. The cluster's fault wrappers settle the run first."""
    reqs: tuple[SimRequest, ...] = (_request("a", 0.0),)
    if case == "reject_all":
        reqs += (_request("b", 2.0, prompt=1100, output=50),)
    w = Workload(name="one", block_tokens=512, requests=reqs)
    results = []
    for runs in (False, True):
        cfg = replace(_config(nodes=1), decode_runs=runs)
        cluster, rep = run_policy(w, cfg, "kvgate", seed=1, hooks=FAULT_CASES[case])
        ends = {rid: (o.status, o.finished_s) for rid, o in cluster.outcomes.items()}
        results.append((ends, _without_wall(rep), cluster.nodes[0].engine.faults.active))
    assert results[1] == results[0]  # bit for bit
    ends = results[0][0]
    plain = 4.4963163999999995  # request a alone, no fault (the same with runs or not)
    status, end = ends["a"]
    assert status == "completed" and end is not None
    if case == "slow":
        assert end > 30.0 and results[0][2]  # most of it at a tenth of the speed
    elif case == "slow_then_recover":
        assert plain + 0.5 < end < 10.0 and not results[0][2]
    else:
        assert end == plain and ends["b"] == ("failed", None)
        assert results[0][1]["failures_by_reason"] == {"retry_elsewhere": 1}
