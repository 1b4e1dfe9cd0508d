"""What a request missed of the SLO (kvgate.sim.report.slo_miss), by hand; the index's
precision on a hand-made run."""

from __future__ import annotations

import pytest

from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.engine import get_profile, prefill_alone_s, step_time
from kvgate.engine.eviction import EvictionConfig
from kvgate.sim.cluster import ClusterConfig, RequestOutcome, SimCluster
from kvgate.sim.report import (
    Slo,
    latency_summary,
    meets,
    pct,
    slo_miss,
    thinned,
    ttft_parts,
)
from kvgate.sim.runner import run_policy
from kvgate.sim.workload_types import SimRequest, Workload

SLO = Slo(ttft_s=5.0, tpot_s=0.1)


def _outcome(status: str, first: float | None, finished: float | None, out: int) -> RequestOutcome:
    req = SimRequest(
        request_id="r", arrival_s=0.0, prompt_tokens=10, output_tokens=out, block_ids=()
    )
    return RequestOutcome(
        req=req,
        gateway=0,
        status=status,
        first_token_s=first,
        finished_s=finished,
        output_tokens=out,
    )


@pytest.mark.parametrize(
    ("status", "first", "finished", "out", "kind"),
    [
        ("completed", 1.0, 1.0 + 0.1 * 10, 11, None),  # TPOT exactly on the target
        ("completed", 5.0, 5.0, 1, None),  # one token: no TPOT to miss
        ("completed", 6.0, 6.5, 11, "ttft"),
        ("completed", 1.0, 1.0 + 0.2 * 10, 11, "tpot"),
        ("completed", 6.0, 6.0 + 0.2 * 10, 11, "both"),
        ("rejected", None, None, 0, "not_completed"),
        ("failed", 2.0, None, 3, "not_completed"),  # failed after its first token
    ],
)
def test_slo_miss_says_which_part_was_missed(
    status: str, first: float | None, finished: float | None, out: int, kind: str | None
) -> None:
    o = _outcome(status, first, finished, out)
    assert slo_miss(o, SLO) == kind
    assert meets(o, SLO) is (kind is None)


def test_no_completed_request_has_no_latency_not_a_perfect_one() -> None:
    shed = [_outcome("rejected", None, None, 0), _outcome("failed", 2.0, None, 3)]
    summary = latency_summary(shed)
    assert summary["completed"] == 0
    for key in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "tpot_p99_s", "e2e_p99_s"):
        assert summary[key] is None, key
    assert pct([], 0.99) is None


def test_a_group_summary_has_tpot_and_e2e_too() -> None:
    done = _outcome("completed", 1.0, 2.0, 11)  # arrived at 0: TTFT 1 s, TPOT 0.1 s, E2E 2 s
    summary = latency_summary([done])
    assert (summary["ttft_p99_s"], summary["tpot_p99_s"], summary["e2e_p99_s"]) == (1.0, 0.1, 2.0)


def test_thinned_keeps_the_extremes_and_at_most_n_points() -> None:
    xs = [float(i) for i in range(1_999)]
    sample = thinned(xs, 500)
    assert len(sample) == 500 and sample[0] == 0.0 and sample[-1] == 1_998.0
    assert sample == sorted(sample)
    assert thinned(xs[:7], 500) == xs[:7]


def _flush_node_0(cluster: SimCluster) -> None:
    cluster.flush_node(0, 1.0)


@pytest.mark.parametrize(
    ("index_mode", "flush", "precision"),
    [
        ("approximate", False, 1.0),  # the second request found all it was promised
        ("approximate", True, 0.0),  # unannounced: the index still promised the blocks
        ("precise", True, None),  # the engine's events took them out: nothing promised
    ],
)
def test_index_precision_is_the_share_of_promised_hits_the_engine_found(
    index_mode: str, flush: bool, precision: float | None
) -> None:
    """The same prompt (four blocks and a partial one) twice on one node, its cache
    flushed in between without notice (announcements off) or not."""
    reqs = tuple(
        SimRequest(request_id=rid, arrival_s=t, prompt_tokens=4 * 512 + 100, output_tokens=4,
                   block_ids=(1, 2, 3, 4, 5))
        for rid, t in (("a", 0.0), ("b", 10.0))
    )
    ctl = ControllerConfig(hasher="trace", index_mode=index_mode,  # type: ignore[arg-type]
                           admission=AdmissionConfig(budget=8))
    cfg = ClusterConfig(nodes=1, cache_blocks=100, node_capacity=8, controller=ctl,
                        eviction=EvictionConfig(announce_lead_s=None))
    hooks = [(5.0, _flush_node_0)] if flush else []
    _, rep = run_policy(Workload(name="twice", block_tokens=512, requests=reqs), cfg,
                        "kvgate", hooks=hooks)
    assert rep["index_precision"] == precision
    assert rep["hit_ratio"] == (0.0 if flush else 0.4)  # "b" hit 4 of 5, unless flushed


def test_ttft_parts_split_each_first_token_into_own_prefill_and_wait() -> None:
    """Three requests on one node: "a" and "b" (15 blocks each) arrive together, so the
    first one's step also carries the other's first chunk and the other finishes its
    prefill a step later; "c", later and alone, is "a"'s prompt and one block more, and
    finds "a"'s 15 blocks cached: its TTFT is its own prefill alone."""
    a100 = get_profile("a100-8b")
    reqs = (
        SimRequest(request_id="a", arrival_s=0.0, prompt_tokens=7680, output_tokens=2,
                   block_ids=tuple(range(1, 16))),
        SimRequest(request_id="b", arrival_s=0.0, prompt_tokens=7680, output_tokens=2,
                   block_ids=tuple(range(101, 116))),
        SimRequest(request_id="c", arrival_s=10.0, prompt_tokens=8192, output_tokens=2,
                   block_ids=tuple(range(1, 17))),
    )  # fmt: skip
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=8))
    cfg = ClusterConfig(nodes=1, cache_blocks=100, node_capacity=8, controller=ctl)
    cluster, rep = run_policy(Workload(name="three", block_tokens=512, requests=reqs), cfg,
                              "round_robin")  # fmt: skip
    net = 2 * cfg.network_delay_s  # the request to the node, its first byte back
    ttfts = {rid: o.first_token_s - o.arrived_s for rid, o in cluster.outcomes.items()
             if o.first_token_s is not None}  # fmt: skip
    alone = prefill_alone_s(a100, 7680, 0)
    # the budget (8 192 tokens) takes the first's 7 680 and the other's first 512
    first, second = sorted(("a", "b"), key=lambda r: ttfts[r])
    step_1 = step_time(a100, [(7680, 0), (512, 0)], [])
    assert ttfts[first] == pytest.approx(net + step_1, abs=1e-9)
    # then the other's last 7 168 beside the first's decode (a context of 7 681)
    step_2 = step_time(a100, [(7168, 512)], [7681])
    assert ttfts[second] == pytest.approx(net + step_1 + step_2, abs=1e-9)
    # "c" hit 15 blocks: its own prefill is the last 512 tokens over them
    assert cluster.outcomes["c"].cached_tokens == 7680
    assert ttfts["c"] == pytest.approx(net + prefill_alone_s(a100, 8192, 7680), abs=1e-9)

    parts = rep["ttft_parts"]
    everything = parts["all"]
    assert everything["requests"] == 3
    own = [alone, alone, prefill_alone_s(a100, 8192, 7680)]
    assert everything["prefill_mean_s"] == pytest.approx(sum(own) / 3, abs=1e-4)
    waits = [ttfts["a"] - alone, ttfts["b"] - alone, ttfts["c"] - own[2]]
    assert everything["wait_mean_s"] == pytest.approx(sum(waits) / 3, abs=1e-4)
    assert everything["waited_over_5s"] == 0
    assert everything["cached_share"] == round(7680 / (7680 + 7680 + 8192), 4)
    # the slowest 1 % of three is one request: the one that waited a step
    slowest = parts["slowest_1pct"]
    assert slowest["requests"] == 1
    assert slowest["ttft_mean_s"] == pytest.approx(ttfts[second], abs=1e-4)
    assert slowest["wait_mean_s"] == pytest.approx(ttfts[second] - alone, abs=1e-4)
    assert slowest["cached_share"] == 0.0
    # each was first scheduled as it reached the node (the network's way there): all its
    # wait is in steps its prefill shared ("second" got only 512 tokens of the first)
    assert everything["queued_mean_s"] == pytest.approx(cfg.network_delay_s, abs=1e-4)
    assert everything["slowed_mean_s"] == pytest.approx(
        sum(waits) / 3 - cfg.network_delay_s, abs=1e-4
    )
    assert slowest["queued_mean_s"] == pytest.approx(cfg.network_delay_s, abs=1e-4)
    assert slowest["slowed_mean_s"] == pytest.approx(
        ttfts[second] - alone - cfg.network_delay_s, abs=1e-4
    )


def test_ttft_parts_split_the_wait_at_the_first_scheduled_step() -> None:
    """"long" (16 384 tokens) fills the budget of two steps; "late", sent while the
    first runs, is first scheduled in the third, beside long's first decode: queued
    until then, then slowed by that decode."""
    a100 = get_profile("a100-8b")
    reqs = (
        SimRequest(request_id="long", arrival_s=0.0, prompt_tokens=16384, output_tokens=2,
                   block_ids=tuple(range(1, 33))),
        SimRequest(request_id="late", arrival_s=0.0005, prompt_tokens=512, output_tokens=2,
                   block_ids=(101,)),
    )  # fmt: skip
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=8))
    cfg = ClusterConfig(nodes=1, cache_blocks=100, node_capacity=8, controller=ctl)
    cluster, rep = run_policy(Workload(name="two", block_tokens=512, requests=reqs), cfg,
                              "round_robin")  # fmt: skip
    net = cfg.network_delay_s
    step_1 = step_time(a100, [(8192, 0)], [])
    step_2 = step_time(a100, [(8192, 8192)], [])
    step_3 = step_time(a100, [(512, 0)], [16385])  # long's first decode beside it
    late = cluster.outcomes["late"]
    assert late.prefill_started_s == pytest.approx(net + step_1 + step_2, abs=1e-9)
    queued = net + step_1 + step_2 - 0.0005
    alone = prefill_alone_s(a100, 512, 0)
    assert late.first_token_s is not None
    assert late.first_token_s - late.arrived_s == pytest.approx(queued + step_3 + net, abs=1e-9)
    slowest = rep["ttft_parts"]["slowest_1pct"]  # one of two: late, the slower
    assert slowest["ttft_mean_s"] == pytest.approx(queued + step_3 + net, abs=1e-4)
    assert slowest["queued_mean_s"] == pytest.approx(queued, abs=1e-4)
    assert slowest["slowed_mean_s"] == pytest.approx(step_3 - alone + net, abs=1e-4)
    assert slowest["queued_mean_s"] + slowest["slowed_mean_s"] == pytest.approx(
        slowest["wait_mean_s"], abs=2e-4
    )


def test_ttft_parts_without_a_known_prefill_start_split_nothing() -> None:
    done = _outcome("completed", 1.0, 2.0, 11)  # made up: no prefill_started_s
    parts = ttft_parts([done], get_profile("a100-8b"))["all"]
    assert parts["wait_mean_s"] is not None
    assert parts["queued_mean_s"] is None and parts["slowed_mean_s"] is None


def test_ttft_parts_of_a_run_with_nothing_completed() -> None:
    parts = ttft_parts([], get_profile("a100-8b"))
    assert parts["all"]["requests"] == 0 and parts["slowest_1pct"]["requests"] == 0
    assert parts["all"]["wait_mean_s"] is None and parts["all"]["cached_share"] is None
