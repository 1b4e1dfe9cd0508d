"""The simulator drives the real core: outcomes, determinism, bounds, speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.sim.cluster import STALL_S, ClusterConfig, SimCluster
from kvgate.sim.funnel import FUNNEL_KINDS, count_blocks
from kvgate.sim.loop import EventLoop
from kvgate.sim.report import SLO_MISS_KINDS, Slo
from kvgate.sim.runner import SeededRng, compare, resolve_policies, run_policy
from kvgate.sim.synthetic import multi_turn_chat, shared_prefix_groups
from kvgate.sim.workload import SimRequest, Workload


def small_config(**kw: object) -> ClusterConfig:
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=128))
    base = ClusterConfig(nodes=4, cache_blocks=400, node_capacity=32, controller=ctl)
    return replace(base, **kw)  # type: ignore[arg-type]


def gsp(n: int = 160, rate: float = 8.0, seed: int = 1):
    return shared_prefix_groups(
        rng=SeededRng(seed), arrivals=rate, num_groups=10, prompts_per_group=n // 10
    )


def test_event_loop_orders_by_time_then_schedule_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, lambda: seen.append("b"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(2.0, lambda: seen.append("c"))
    t = loop.at(1.5, lambda: seen.append("x"))
    t.cancel()
    loop.run()
    assert seen == ["a", "b", "c"] and loop.now == 2.0


def test_every_request_ends_exactly_once_and_policies_share_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every policy of a comparison runs on the same cluster and admission settings:
    only the routing policy (and its parameters) differ."""
    built: list[ClusterConfig] = []
    init = SimCluster.__init__

    def spy(self: SimCluster, config: ClusterConfig, *args: Any, **kw: Any) -> None:
        built.append(config)
        init(self, config, *args, **kw)

    monkeypatch.setattr(SimCluster, "__init__", spy)
    w = gsp()
    rep = compare(w, small_config(), ["kvgate", "round_robin"], seed=3)
    for name, r in rep["policies"].items():  # type: ignore[union-attr]
        assert r["completed"] + r["rejected"] + r["failed"] == len(w.requests), name
    assert rep["requests"] == len(w.requests)
    assert [c.controller.policy for c in built] == ["kvgate", "round_robin"]
    first, second = (replace(c, controller=replace(c.controller, policy="")) for c in built)
    assert first == second and first.controller.admission == small_config().controller.admission


def test_cache_hit_cuts_ttft_and_kvgate_beats_round_robin_on_hits() -> None:
    w = gsp()
    rep = compare(w, small_config(), ["kvgate", "round_robin"], seed=3)
    pol = rep["policies"]
    assert pol["kvgate"]["hit_ratio"] > pol["round_robin"]["hit_ratio"] + 0.1  # type: ignore[index]
    assert pol["kvgate"]["ttft_mean_s"] < pol["round_robin"]["ttft_mean_s"]  # type: ignore[index]
    b = rep["bounds"]
    assert pol["kvgate"]["hit_ratio"] <= b["ideal_hit_ratio"] + 1e-9  # type: ignore[index]


def test_report_has_the_documented_keys() -> None:
    rep = compare(gsp(60), small_config(), ["kvgate"], seed=1)
    assert {"requests", "wall_s", "bounds", "policies"} <= rep.keys()
    assert {"ideal_hit_ratio", "pooled_lru_hit_ratio", "balanced_hit_ratio"} <= rep["bounds"].keys()  # type: ignore[union-attr]
    keys = {
        "ttft_p50_s",
        "ttft_p99_s",
        "ttft_mean_s",
        "hit_ratio",
        "load_max_over_mean",
        "goodput_rps",
        "completed",
        "rejected",
        "failed",
        "tpot_p50_s",
        "tpot_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "goodput_strict_rps",
        "hit_ratio_by_bucket",
        "index_precision",
        "cache_loss_funnel",
        "rejects_by_reason",
        "retries_by_reason",
        "by_priority",
        "by_tenant",
        "throughput_rps",
        "output_tokens_per_s",
        "ttft_p90_s",
        "slo_misses",
    }
    assert keys <= rep["policies"]["kvgate"].keys()  # type: ignore[index]


def test_goodput_is_the_requests_that_missed_nothing_over_the_span() -> None:
    # a TTFT target no first token meets and a TPOT target every decode misses
    w = gsp(60)
    for slo, kind in (
        (Slo(ttft_s=1e-9, tpot_s=10.0), "ttft"),
        (Slo(ttft_s=60.0, tpot_s=1e-9), "tpot"),
    ):
        _, rep = run_policy(w, small_config(), "kvgate", seed=1, slo=slo)
        misses = rep["slo_misses"]
        assert isinstance(misses, dict) and set(misses) == set(SLO_MISS_KINDS)
        assert misses[kind] == 60 and sum(misses.values()) == 60
        assert rep["goodput_rps"] == 0.0
    _, rep = run_policy(w, small_config(), "kvgate", seed=1, slo=Slo(ttft_s=60.0, tpot_s=10.0))
    assert rep["slo_misses"] == dict.fromkeys(SLO_MISS_KINDS, 0)
    # every request completed and met it: goodput is the throughput
    assert rep["completed"] == 60 and rep["goodput_rps"] == rep["throughput_rps"]


def test_funnel_accounts_for_every_prompt_block() -> None:
    w = multi_turn_chat(rng=SeededRng(2), arrivals=2.0, num_sessions=30)
    cluster, rep = run_policy(w, small_config(), "kvgate", seed=1)
    funnel = rep["cache_loss_funnel"]
    done = [o for o in cluster.outcomes.values() if o.status == "completed"]
    assert sum(funnel.values()) == sum(len(o.req.block_ids) for o in done)  # type: ignore[union-attr]
    assert funnel["hit"] > 0 and funnel["never_seen"] > 0  # type: ignore[index]
    # every kind is reported, none seen or not: a stable key set
    assert set(funnel) == set(FUNNEL_KINDS) and set(cluster.funnel) <= set(FUNNEL_KINDS)  # type: ignore[arg-type]


def test_all_policies_resolve() -> None:
    names = resolve_policies(["all"])
    assert names[0] == "kvgate" and len(names) == 9
    with pytest.raises(ValueError):
        resolve_policies(["nope"])


DETERMINISM_SCRIPT = """
import json, sys
from kvgate.sim.runner import SeededRng, compare
from kvgate.sim.synthetic import multi_turn_chat
from kvgate.sim.cluster import STALL_S, ClusterConfig, SimCluster
from kvgate.sim.funnel import FUNNEL_KINDS
from kvgate.core.config import ControllerConfig
from kvgate.core.admission import AdmissionConfig, LeaseConfig
w = multi_turn_chat(rng=SeededRng(5), arrivals=1.5, num_sessions=25)
# a fleet of two with a tenant quota: leases, parked requests, a pressing tenant's home
adm = AdmissionConfig(budget=96, default_tenant_quota=4, lease=LeaseConfig(expected_gateways=2))
cfg = ClusterConfig(nodes=3, cache_blocks=300, gateways=2,
    controller=ControllerConfig(hasher="trace", admission=adm))
rep = compare(w, cfg, ["kvgate", "power_of_two", "dynamo_cost"], seed=11)
sys.stdout.write(json.dumps(rep, sort_keys=True))
"""


def test_same_seed_same_report_bytes_across_processes() -> None:
    outs = []
    for hashseed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        res = subprocess.run(
            [sys.executable, "-c", DETERMINISM_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    kvgate = json.loads(outs[0])["policies"]["kvgate"]
    assert kvgate["completed"] > 0 and kvgate["rejects_by_reason"].get("tenant_quota", 0) > 0


def test_closed_loop_request_arrives_its_think_time_after_the_answer() -> None:
    from kvgate.sim.report import ttft
    from kvgate.sim.workload import SimRequest, Workload

    def req(rid: str, t: float, blocks: int, **kw: object) -> SimRequest:
        return SimRequest(
            request_id=rid,
            arrival_s=t,
            prompt_tokens=512 * blocks,
            output_tokens=20,
            block_ids=tuple(range(blocks)),
            **kw,  # type: ignore[arg-type]
        )

    w = Workload(
        name="w",
        block_tokens=512,
        requests=(
            req("a", 0.0, 8),
            req("b", 0.1, 9, after="a", think_s=0.5),  # planned 0.1 s, sent on a's answer
            req("huge", 0.0, 1000),  # longer than a node's context: rejected at once
            req("c", 0.2, 2, after="huge", think_s=0.25),
        ),
    )
    cluster, rep = run_policy(w, small_config(nodes=1), "kvgate")
    out = cluster.outcomes
    a, b, c = out["a"], out["b"], out["c"]
    assert a.status == b.status == c.status == "completed" and out["huge"].status == "rejected"
    assert a.ended_s is not None and a.ended_s > 0.2  # well after b's plan
    assert b.arrived_s == pytest.approx(a.ended_s + 0.5)  # not at its planned 0.1 s
    assert c.arrived_s == pytest.approx(0.25)  # released by the rejection, too
    assert ttft(b) == pytest.approx(b.first_token_s - b.arrived_s)
    assert rep["completed"] == 3 and rep["rejected"] == 1
    # without its predecessor in the workload, a request keeps its planned time
    alone = Workload(name="w", block_tokens=512, requests=(req("b", 0.1, 9, after="a"),))
    cluster, _ = run_policy(alone, small_config(nodes=1), "kvgate")
    assert cluster.outcomes["b"].arrived_s == pytest.approx(0.1)


def test_a_crash_at_any_moment_loses_no_request() -> None:
    """A node crashing while a step is running: the requests that step finishes or
    refuses have already left the engine, so the crash does not fail them, and their
    answers never leave the node. They must fail (and be retried or answered), not
    vanish; a vanished request stalls the run, which stops and says so."""
    # one output token: every step that prefills a request also finishes it
    w = shared_prefix_groups(
        rng=SeededRng(1), arrivals=40.0, num_groups=4, prompts_per_group=10, output_tokens=1
    )
    for k in range(20):
        at = w.requests[5 + k].arrival_s + 0.03  # while the node is busy

        def crash(c: SimCluster, at: float = at) -> None:
            c.crash_node(0)
            c.loop.at(at + 1.0, lambda: c.recover_node(0))

        cluster = SimCluster(small_config(nodes=2), w, rng=SeededRng(3))
        cluster.hooks.append((at, crash))
        cluster.run()
        cluster.check_outcomes()  # raises if one never ended


def test_a_lost_request_stops_the_run_and_is_named() -> None:
    w = gsp(n=10, rate=8.0)
    cluster = SimCluster(small_config(nodes=2), w, rng=SeededRng(3))
    lost = w.requests[3].request_id

    def drop(c: SimCluster) -> None:  # a simulator bug, made on purpose
        for eid, att in c._attempts.items():
            if eid.startswith(lost + "#"):
                att.done = True  # its answer will be ignored

    cluster.hooks.append((w.requests[3].arrival_s + 0.001, drop))
    cluster.run()  # returns: the housekeeping stops once nothing moves for STALL_S
    with pytest.raises(AssertionError, match="1 requests never ended"):
        cluster.check_outcomes()


def test_an_idle_gap_longer_than_the_stall_bound_is_not_a_stall() -> None:
    """With nothing open the cluster is idle, not stalled: a request arriving more
    than STALL_S after the previous one ended still finds leases and load reports."""
    w = gsp(n=10, rate=8.0)
    late = replace(w.requests[-1], arrival_s=w.requests[-1].arrival_s + STALL_S + 400.0)
    w2 = replace(w, requests=(*w.requests[:-1], late))
    cluster = SimCluster(small_config(nodes=2), w2, rng=SeededRng(3))
    cluster.run()
    cluster.check_outcomes()
    assert cluster.outcomes[late.request_id].status == "completed"


def test_idle_housekeeping_jumps_to_the_next_arrival_or_hook() -> None:
    """A trace with one far-off timestamp (epoch milliseconds beside relative ones) ran
    for hours: every idle tick, report and health check was an event. Idle, they jump
    by whole periods to a minute before the next arrival or hook, which then finds
    leases, reports and health fresh, exactly as after a short gap."""
    w = gsp(n=10, rate=8.0)
    gap = 1.7e9  # seconds: about 54 years
    late = replace(w.requests[-1], arrival_s=w.requests[-1].arrival_s + gap)
    w2 = replace(w, requests=(*w.requests[:-1], late))
    cluster = SimCluster(small_config(nodes=2), w2, rng=SeededRng(3))
    hooked: list[float] = []
    cluster.hooks.append((gap / 2, lambda c: hooked.append(c.loop.now)))
    cluster.run()
    cluster.check_outcomes()
    assert cluster.outcomes[late.request_id].status == "completed"
    assert hooked == [gap / 2]
    assert cluster.loop.events_run < 20_000  # a minute of housekeeping around each
    # the late request is served as one 700 s after the others is
    near = replace(w.requests[-1], arrival_s=w.requests[-1].arrival_s + 700.0)
    w3 = replace(w, requests=(*w.requests[:-1], near))
    c2 = SimCluster(small_config(nodes=2), w3, rng=SeededRng(3))
    c2.run()
    a, b = cluster.outcomes[late.request_id], c2.outcomes[near.request_id]
    assert a.first_token_s is not None and b.first_token_s is not None
    # (floats near 1.7e9 s are 2.4e-7 s apart)
    assert a.first_token_s - a.arrived_s == pytest.approx(b.first_token_s - b.arrived_s, abs=1e-5)


def test_funnel_evicted_counts_only_blocks_a_node_had_cached() -> None:
    """A block seen before only in a request that was refused never reached a cache:
    missing it is not an eviction. One that a node cached and lost is."""
    from kvgate.engine.eviction import EvictionConfig
    from kvgate.sim.workload import SimRequest, Workload

    def req(rid: str, t: float, first: int, blocks: int) -> SimRequest:
        ids = tuple(range(first, first + blocks))
        return SimRequest(
            request_id=rid, arrival_s=t, prompt_tokens=512 * blocks, output_tokens=20, block_ids=ids
        )

    w = Workload(
        name="w",
        block_tokens=512,
        requests=(
            req("a", 0.0, 0, 8),  # computed and cached, then evicted by the hook
            req("huge", 0.0, 100, 1000),  # longer than a node's context: refused at once
            req("after_refused", 5.0, 100, 8),  # its blocks were only ever in "huge"
            req("after_evicted", 5.0, 0, 8),
        ),
    )

    def evict_all(c: SimCluster) -> None:
        c.bulk_evict(0, 1.0)

    cfg = small_config(nodes=1, eviction=EvictionConfig(announce_lead_s=None))
    cluster = SimCluster(cfg, w, rng=SeededRng(1))
    cluster.hooks.append((3.0, evict_all))
    cluster.run()
    cluster.check_outcomes()
    assert cluster.outcomes["huge"].status == "rejected"
    # after_evicted's 8th block is the last of a prompt of whole blocks: no cache could
    # give it, so it is never_cached, not evicted
    assert dict(cluster.funnel) == {"hit": 0, "never_seen": 8, "never_cached": 9, "evicted": 7}


def test_funnel_adds_up_when_a_request_hits_blocks_a_later_arrival_computed() -> None:
    """Blocks a request hits are not 'never seen', even when the request that computed
    them arrived after it (it jumped the queue on priority): the funnel still adds up
    to the prompt blocks."""
    from kvgate.sim.workload import SimRequest, Workload

    def req(rid: str, t: float, first: int, prio: int, out: int = 20) -> SimRequest:
        ids = tuple(range(first, first + 16))  # 8 192 tokens: one whole step's budget
        return SimRequest(
            request_id=rid,
            arrival_s=t,
            prompt_tokens=512 * 16,
            output_tokens=out,
            block_ids=ids,
            priority=prio,
        )

    w = Workload(
        name="w",
        block_tokens=512,
        requests=(
            req("busy", 0.0, 0, 1, out=1),  # keeps the node busy while the next two queue
            req("early", 0.001, 100, 1),
            req("late", 0.002, 100, 0),  # P0: prefilled first, early then hits its blocks
        ),
    )
    cluster, _ = run_policy(w, small_config(nodes=1), "kvgate", seed=1)
    early = cluster.outcomes["early"]
    assert early.status == "completed" and early.cached_tokens == 15 * 512
    assert sum(cluster.funnel.values()) == 3 * 16
    assert cluster.funnel["hit"] == 15


def test_funnel_files_a_prefix_the_target_lost_while_the_request_queued_as_evicted() -> None:
    """The node a request was sent to held its prefix at submit and evicted it while the
    request waited there: an eviction, not a prefix routed away by load (one node: there
    was nowhere else to route it)."""
    from kvgate.engine.eviction import EvictionConfig
    from kvgate.engine.sequence import ReqStatus
    from kvgate.sim.workload import SimRequest, Workload

    def req(rid: str, t: float, ids: tuple[int, ...]) -> SimRequest:
        return SimRequest(
            request_id=rid, arrival_s=t, prompt_tokens=512 * len(ids), output_tokens=1,
            block_ids=ids,
        )

    w = Workload(
        name="w",
        block_tokens=512,
        requests=(
            req("a", 0.0, tuple(range(8))),  # computed and cached by t = 2
            req("busy", 2.0, tuple(range(100, 116))),  # a whole step's budget of prefill
            req("b", 2.0005, (*range(8), 50)),  # a's prefix: waits at the node behind busy
        ),
    )
    seen: dict[str, object] = {}

    def evict_all(c: SimCluster) -> None:  # while b waits at the node, before it runs
        engine = c.nodes[0].engine
        seen["b"] = engine.request_status("b#1")
        seen["cached"] = len(engine.pool.find_prefix(tuple(range(8)), 8))
        c.bulk_evict(0, 1.0)

    cfg = small_config(nodes=1, eviction=EvictionConfig(announce_lead_s=None))
    cluster = SimCluster(cfg, w, rng=SeededRng(1))
    cluster.hooks.append((2.01, evict_all))
    cluster.run()
    cluster.check_outcomes()
    assert seen == {"b": ReqStatus.WAITING, "cached": 8}
    assert cluster.outcomes["b"].cached_tokens == 0
    f = {k: v for k, v in cluster.funnel.items() if v}
    assert f == {"never_seen": 8 + 16 + 1, "evicted": 8}


@pytest.mark.parametrize(
    ("own", "other", "got", "reason", "expected"),
    [
        # the target held 3 blocks at submit and lost 2 while the request queued there;
        # another node held 6: 3 were routed away, 2 evicted (+ 2 no node held)
        (3, 6, 1, "load", {"hit": 1, "evicted": 2 + 2, "routed_away_by_load": 3}),
        # only the target held any, and lost them all: evicted, whatever the route said
        (5, 0, 0, "exploration", {"evicted": 3 + 5}),
        # the target held the longest prefix and got it: nothing was routed away
        (6, 4, 6, "load", {"hit": 6, "evicted": 2}),
        # only another node held some, and the route explored
        (0, 4, 0, "exploration", {"evicted": 4, "exploration": 4}),
    ],
)
def test_funnel_keeps_the_targets_own_prefix_apart(
    own: int, other: int, got: int, reason: str, expected: dict[str, int]
) -> None:
    """Of a request's 10 blocks, 8 were seen and cached before (2 never seen)."""
    funnel: Counter[str] = Counter()
    count_blocks(
        funnel,
        total=10,
        seen=8,
        own=own,
        best_other=other,
        stored=8,
        got=got,
        route_reason=reason,
        usable=9,
    )
    assert {k: v for k, v in funnel.items() if v} == {"never_seen": 2, **expected}
    assert set(funnel) <= set(FUNNEL_KINDS)


def test_the_last_block_of_a_prompt_of_whole_blocks_is_never_cached_not_evicted() -> None:
    """The engine computes at least a prompt's last token, so the second of two
    identical 2-block prompts hits one block: the other was filed as evicted from a
    1 000-block pool that evicted nothing."""
    w = Workload(name="aligned", block_tokens=512, requests=tuple(
        SimRequest(request_id=rid, arrival_s=t, prompt_tokens=1024, output_tokens=4,
                   block_ids=(1, 2))
        for rid, t in (("a", 0.0), ("b", 10.0))))
    cluster = SimCluster(small_config(nodes=1), w, rng=SeededRng(0))
    cluster.run()
    cluster.check_outcomes()
    assert cluster.outcomes["b"].cached_tokens == 512
    f = {k: v for k, v in cluster.funnel.items() if v}
    assert f == {"never_seen": 2, "hit": 1, "never_cached": 1}


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("gateways", 0, "gateways must be >= 1"),
        ("nodes", 0, "nodes must be >= 1"),
        ("report_interval_s", 0.0, "report_interval_s must be a finite number > 0"),
        ("tick_interval_s", 0.0, "tick_interval_s must be a finite number > 0"),
        ("health_interval_s", float("inf"), "health_interval_s must be a finite number > 0"),
        ("network_delay_s", float("nan"), "network_delay_s must be a finite number >= 0"),
        ("event_delay_s", -0.1, "event_delay_s must be a finite number >= 0"),
        ("scheduling_policy", "prio", "scheduling_policy must be one of fcfs, priority"),
    ],
)
def test_a_cluster_config_that_cannot_run_is_refused(field: str, value: object, says: str) -> None:
    """A zero period looped forever at one virtual instant (624 MB in 15 s), no gateway
    divided by zero, a misspelt policy ran FCFS: refused when built, naming the field."""
    with pytest.raises(ValueError, match=says):
        small_config(**{field: value})


def test_a_request_the_engines_would_refuse_is_refused_before_the_run() -> None:
    """A trace read with strict=False may carry fewer block ids than the prompt's full
    blocks; the engine refused it mid-run with a traceback. Now the cluster refuses the
    workload up front and names the request."""
    good = SimRequest(
        request_id="a", arrival_s=0.0, prompt_tokens=1024, output_tokens=4, block_ids=(1, 2)
    )
    short = replace(good, request_id="b", prompt_tokens=1536)
    empty = replace(good, request_id="c", prompt_tokens=0, block_ids=())
    ok = Workload(name="w", block_tokens=512, requests=(good,))
    SimCluster(small_config(), ok, rng=SeededRng(1))  # one id per full block: accepted
    for bad, why in ((short, "1536 prompt tokens and 2 block ids"), (empty, "0 prompt tokens")):
        w = Workload(name="w", block_tokens=512, requests=(good, bad))
        with pytest.raises(ValueError, match=f"request '{bad.request_id}' has {why}"):
            SimCluster(small_config(), w, rng=SeededRng(1))


def test_a_policy_that_completed_nothing_has_no_hit_ratio() -> None:
    """Every prompt longer than a node's whole cache: every request is refused, and the
    report's hit ratio is null (nothing measured), like its latencies, never 0.0."""
    ids = tuple(range(10))
    big = SimRequest(
        request_id="a", arrival_s=0.0, prompt_tokens=5000, output_tokens=4, block_ids=ids
    )
    w = Workload(name="w", block_tokens=512, requests=(big,))
    _cluster, rep = run_policy(w, small_config(cache_blocks=2), "round_robin")
    assert rep["completed"] == 0 and rep["rejected"] == 1
    assert rep["hit_ratio"] is None and rep["ttft_p99_s"] is None
