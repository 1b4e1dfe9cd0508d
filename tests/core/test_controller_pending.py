"""The controller keeps each node's queued prefill work for the predicted-TTFT score."""

from __future__ import annotations

import random

from kvgate.core.admission import FailureKind, InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec


def cluster() -> Controller:
    ctl = Controller(
        # the score alone: no exploration, no affinity slack
        ControllerConfig(hasher="trace", policy_params={"epsilon": 0, "affinity_slack_s": 0}),
        rng=random.Random(1),
    )
    for i in range(2):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}")), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def arrive(ctl: Controller, rid: str, ids: tuple[int, ...], tokens: int) -> Dispatch:
    d = ctl.on_arrival(
        RequestArrived(request_id=RequestId(rid), block_ids=ids, prompt_tokens=tokens), 0.1
    )
    assert isinstance(d, Dispatch)
    return d


def pending(ctl: Controller) -> dict[str, int]:
    return {s.node_id: s.pending_prefill_tokens for s in ctl.nodes}


def test_pending_prefill_follows_dispatch_first_byte_and_end() -> None:
    ctl = cluster()
    a = arrive(ctl, "a", (1, 2, 3, 4), 20_000)
    assert pending(ctl)[a.node_id] == 20_000
    # a second request sharing 3 blocks (1536 tokens: 5 x 0.128 s of credit) goes
    # elsewhere: the holder has 20 000 tokens (1.67 s) of prefill queued ...
    b = arrive(ctl, "b", (1, 2, 3, 9), 2048)
    assert b.node_id != a.node_id and pending(ctl)[b.node_id] == 2048
    # ... once the first token is out, its prefill is no longer queued
    ctl.on_first_byte(RequestId("a"), 0.5)
    assert pending(ctl)[a.node_id] == 0
    ctl.on_finished(RequestId("a"), 0.6, cached_tokens=0)
    # a failure before the first byte takes the queued work away too
    out = ctl.on_failed(RequestId("b"), FailureKind.POOL_OVERLOADED, 0.7, before_first_byte=True)
    assert out and all(v == 0 for v in pending(ctl).values())
    # with nothing queued the holder of 3 blocks wins again
    c = arrive(ctl, "c", (1, 2, 3, 7), 2048)
    assert c.node_id == a.node_id and c.route.matched_blocks == 3


def test_inflight_context_follows_dispatch_and_end() -> None:
    """Each node counts the prompt tokens of our requests in flight on it, past the first
    byte too (the decode batch attends over them), until the request ends or fails."""
    ctl = cluster()

    def context() -> dict[str, int]:
        return {s.node_id: s.inflight_context_tokens for s in ctl.nodes}

    a = arrive(ctl, "a", (1, 2, 3, 4), 20_000)
    b = arrive(ctl, "b", (5, 6), 900)
    want = {"n0": 0, "n1": 0}
    want[a.node_id] += 20_000
    want[b.node_id] += 900
    assert context() == want
    ctl.on_first_byte(RequestId("a"), 0.5)
    assert context() == want  # still decoding
    ctl.on_finished(RequestId("a"), 0.6, cached_tokens=0)
    ctl.on_failed(RequestId("b"), FailureKind.POOL_OVERLOADED, 0.7, before_first_byte=True)
    retried = [s for s in ctl.nodes if s.inflight]  # b may have been retried elsewhere
    assert sum(context().values()) == 900 * len(retried)


def test_credit_freed_by_a_failed_retry_reaches_a_queued_request() -> None:
    """A retry that finds no node fails the request (with its own failure) and releases
    its credit; the request queued behind it is dispatched with it, not forgotten until
    its queue deadline."""
    from kvgate.core.admission import AdmissionConfig
    from kvgate.core.decisions import Fail, Hold

    cfg = ControllerConfig(
        hasher="trace", policy_params={"epsilon": 0}, admission=AdmissionConfig(budget=4)
    )
    ctl = Controller(cfg, rng=random.Random(1))
    # n1 counts for capacity but can never take these prompts (too short a context)
    ctl.add_node(NodeSpec(node_id=NodeId("n0"), capacity=2), 0.0)
    ctl.add_node(NodeSpec(node_id=NodeId("n1"), capacity=2, max_model_len=100), 0.0)
    for n in ("n0", "n1"):
        ctl.on_load_report(NodeId(n), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(cfg.admission), 0.0)
    held: list[Hold] = []
    sent: list[Dispatch] = []
    for i in range(8):
        d = ctl.on_arrival(
            RequestArrived(
                request_id=RequestId(f"r{i}"), priority=0, block_ids=(i,), prompt_tokens=512
            ),
            0.1,
        )
        if isinstance(d, Hold):
            held.append(d)
        elif isinstance(d, Dispatch):
            sent.append(d)
    assert held and sent, "the small budget must queue someone"
    # n0 refuses the first request before its first byte; its retry has nowhere to go
    out = ctl.on_failed(sent[0].request_id, FailureKind.CONNECT_ERROR, 0.2, before_first_byte=True)
    failed = [(d.request_id, d.reason, d.http_status) for d in out if isinstance(d, Fail)]
    assert failed == [(sent[0].request_id, "connect_error", 502)]
    dispatched = [d.request_id for d in out if isinstance(d, Dispatch)]
    assert dispatched == [held[0].request_id]


def test_prefix_rates_are_tracked_only_for_a_policy_that_reads_them() -> None:
    """Hot-prefix rates cost every arrival; only replication (replica_rps) reads them."""
    rate: dict[str, float] = {}
    for name, params in (("off", {"epsilon": 0}), ("on", {"epsilon": 0, "replica_rps": 100.0})):
        ctl = Controller(
            ControllerConfig(hasher="trace", policy_params=params), rng=random.Random(1)
        )
        ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.0)
        ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=0.0)
        ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
        for i in range(3):
            d = ctl.on_arrival(
                RequestArrived(
                    request_id=RequestId(f"r{i}"), block_ids=(1, 2, 3, 4, 5), prompt_tokens=2560
                ),
                0.1 * i,
            )
            assert isinstance(d, Dispatch)
        probe = RequestArrived(request_id=RequestId("x"), block_ids=(1, 2, 3, 4))
        hot_key = ctl.chain_for(probe)[0][-1]  # the chain's 4th block (hot_prefix_blocks)
        rate[name] = ctl.contexts.hot.rate(hot_key, 0.3)
    assert rate["off"] == 0.0
    assert rate["on"] > 0.0
