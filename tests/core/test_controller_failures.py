"""How the controller judges failed attempts: whose fault, what status, what to abort."""

from __future__ import annotations

import random

import pytest

from kvgate.core.admission import BreakerState, FailureKind, InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Decision, Dispatch, Fail, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec


def cluster(n: int = 2, **config: object) -> Controller:
    ctl = Controller(
        ControllerConfig(hasher="trace", policy_params={"epsilon": 0}, **config),  # type: ignore[arg-type]
        rng=random.Random(1),
    )
    for i in range(n):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}")), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def arrive(ctl: Controller, rid: str, now: float = 0.1, **extra: object) -> Decision:
    return ctl.on_arrival(
        RequestArrived(request_id=RequestId(rid), block_ids=(1, 2), prompt_tokens=100,
                       **extra),  # type: ignore[arg-type]
        now,
    )


def dispatch(ctl: Controller, rid: str, now: float = 0.1, **extra: object) -> Dispatch:
    d = arrive(ctl, rid, now, **extra)
    assert isinstance(d, Dispatch)
    return d


def test_client_errors_neither_open_the_breaker_nor_eject_the_node() -> None:
    ctl = cluster()
    for i in range(40):  # well past the breaker's 20 outcomes at a 50 % error rate
        d = dispatch(ctl, f"bad{i}", 1.0)
        out = ctl.on_failed(RequestId(f"bad{i}"), FailureKind.CLIENT_ERROR, 1.0,
                            before_first_byte=True)
        assert isinstance(out[0], Fail) and out[0].node_id == d.node_id  # no retry
    assert ctl.admission.breaker_state is BreakerState.CLOSED
    assert all(s.healthy and s.consecutive_failures == 0 for s in ctl.nodes)
    assert ctl.stats.failures["client_error"] == 40
    assert isinstance(arrive(ctl, "good", 1.1), Dispatch)


NODE_FAULTS = [
    FailureKind.CONNECT_ERROR, FailureKind.NODE_DOWN, FailureKind.UPSTREAM_ERROR,
    FailureKind.TIMEOUT,
]
LOAD_REFUSALS = [
    FailureKind.RETRY_ELSEWHERE, FailureKind.POOL_OVERLOADED, FailureKind.RATE_LIMITED,
    FailureKind.HTTP_503,
]


@pytest.mark.parametrize("kind", NODE_FAULTS + LOAD_REFUSALS)
def test_node_faults_open_the_breaker_and_refusals_for_load_do_not(kind: FailureKind) -> None:
    """A busy node's refusals are backpressure: a lower class flooding the nodes must
    not open the breaker, which would refuse every class, P0 included."""
    ctl = cluster(eject_after_failures=1000)  # the error rate opens it, not "no node"
    for i in range(20):  # the breaker's 20 outcomes, every one a failure
        dispatch(ctl, f"r{i}", 1.0, priority=1)
        # after the first byte: never retried, so each one is a final failure
        out = ctl.on_failed(RequestId(f"r{i}"), kind, 1.0, before_first_byte=False)
        assert isinstance(out[0], Fail)
    opens = kind in NODE_FAULTS
    assert (ctl.admission.breaker_state is BreakerState.OPEN) is opens
    assert all(s.healthy for s in ctl.nodes)
    assert isinstance(arrive(ctl, "p0", 1.1, priority=0), Reject if opens else Dispatch)


def test_only_a_known_excluded_node_turns_off_the_gateway_retry() -> None:
    ctl = cluster(3)
    d = dispatch(ctl, "a", excluded_nodes=frozenset({NodeId("no-such-node")}))
    out = ctl.on_failed(RequestId("a"), FailureKind.RETRY_ELSEWHERE, 0.2, before_first_byte=True)
    assert isinstance(out[0], Dispatch) and out[0].node_id != d.node_id  # retried
    # a real client retry names a node we know: the client retries, so we do not
    d = dispatch(ctl, "b", excluded_nodes=frozenset({NodeId("n0"), NodeId("nope")}))
    assert d.node_id != "n0"
    out = ctl.on_failed(RequestId("b"), FailureKind.RETRY_ELSEWHERE, 0.3, before_first_byte=True)
    assert isinstance(out[0], Fail)


def test_a_request_no_node_ran_fails_with_503_other_failures_with_502() -> None:
    expected = {
        FailureKind.HTTP_503: 503,
        FailureKind.RETRY_ELSEWHERE: 503,
        FailureKind.POOL_OVERLOADED: 503,
        FailureKind.RATE_LIMITED: 503,
        FailureKind.CONNECT_ERROR: 502,
        FailureKind.UPSTREAM_ERROR: 502,
        FailureKind.TIMEOUT: 502,
    }
    # one node: a retry finds no other node, and the request fails with its own
    # failure all the same (it used to be rejected as overloaded, do not retry)
    for kind, status in expected.items():
        for nodes in (1, 2):
            ctl = cluster(nodes)
            dispatch(ctl, "r")
            out = ctl.on_failed(RequestId("r"), kind, 0.2, before_first_byte=True)
            if isinstance(out[0], Dispatch):  # retried once; the other node fails it too
                out = ctl.on_failed(RequestId("r"), kind, 0.3, before_first_byte=True)
            assert isinstance(out[0], Fail), (kind, nodes)
            assert (out[0].reason, out[0].http_status) == (kind.value, status), (kind, nodes)
            assert ctl.num_requests() == 0 and ctl.stats.rejects["overloaded"] == 0


def test_a_node_marked_down_aborts_the_attempts_it_has_not_answered() -> None:
    ctl = cluster(2)
    on: dict[str, list[str]] = {"n0": [], "n1": []}
    for i in range(6):
        rid = f"r{i}"
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=(100 + i,),
                                          prompt_tokens=100), 0.1)
        assert isinstance(d, Dispatch)
        on[d.node_id].append(rid)
    down, up = ("n0", "n1") if len(on["n0"]) >= 2 else ("n1", "n0")
    streaming, *waiting = on[down]
    ctl.on_first_byte(RequestId(streaming), 0.2)  # already answering: left alone
    assert ctl.take_aborts() == []
    ctl.set_healthy(NodeId(down), False, 0.3)
    assert sorted(ctl.take_aborts()) == sorted(waiting)
    assert ctl.take_aborts() == []  # each abort is handed out once
    ctl.set_healthy(NodeId(down), False, 0.3)  # no transition: nothing new
    assert ctl.take_aborts() == []
    for rid in waiting:  # the driver reports each abort: retried on the other node
        out = ctl.on_failed(RequestId(rid), FailureKind.NODE_DOWN, 0.4, before_first_byte=True)
        assert isinstance(out[0], Dispatch) and out[0].node_id == up
    assert ctl.stats.retries["node_down"] == len(waiting)
    assert ctl.nodes.get(NodeId(down)).consecutive_failures == 0  # type: ignore[union-attr]


def test_an_ejection_aborts_the_other_attempts_on_the_node() -> None:
    ctl = cluster(1)
    ids = [f"r{i}" for i in range(ctl.config.eject_after_failures + 2)]
    for rid in ids:
        dispatch(ctl, rid)
    failing, waiting = ids[: ctl.config.eject_after_failures], ids[-2:]
    for rid in failing:
        ctl.on_failed(RequestId(rid), FailureKind.UPSTREAM_ERROR, 0.2, before_first_byte=True)
    assert not ctl.nodes.get(NodeId("n0")).healthy  # type: ignore[union-attr]
    assert sorted(ctl.take_aborts()) == sorted(waiting)
    out = ctl.on_failed(RequestId(waiting[0]), FailureKind.NODE_DOWN, 0.3,
                        before_first_byte=True)
    # the retry found no node: the request fails with its own failure, a 503 the
    # client may retry (a Reject would say overloaded, do not retry)
    assert [type(d).__name__ for d in out] == ["Fail"]
    assert isinstance(out[0], Fail)
    assert (out[0].reason, out[0].http_status) == ("node_down", 503)
    assert ctl.stats.rejects["overloaded"] == 0  # the ejecting failures, then this one
    assert ctl.stats.outcomes["failed"] == len(failing) + 1
    ctl.on_cancelled(RequestId(waiting[1]), 0.3)
    assert ctl.num_requests() == 0 and ctl.take_aborts() == []


def test_an_abort_whose_attempt_moved_on_is_dropped() -> None:
    ctl = cluster(2)
    d = dispatch(ctl, "a")
    ctl.set_healthy(d.node_id, False, 0.2)
    ctl.on_first_byte(RequestId("a"), 0.25)  # the answer started meanwhile
    assert ctl.take_aborts() == []
    d = dispatch(ctl, "b", 0.3)
    ctl.set_healthy(d.node_id, False, 0.35)
    ctl.on_finished(RequestId("b"), 0.4)
    assert ctl.take_aborts() == []


def test_no_node_for_the_request_is_counted_with_the_admission_rejections() -> None:
    ctl = cluster(2)
    every = frozenset({NodeId("n0"), NodeId("n1")})
    d = arrive(ctl, "a", excluded_nodes=every, priority=0)
    assert type(d).__name__ == "Reject"
    assert ctl.stats.rejects["overloaded"] == 1  # what the dashboard counts ...
    rejected = ctl.admission.stats().rejected
    assert sum(rejected.values()) == 1  # ... and the admission counters (metrics) too
    ((reason, priority),) = rejected
    assert (reason.value, int(priority)) == ("overloaded", 0)


def test_a_too_long_request_says_which_part_to_cut() -> None:
    # prompt_tokens=100 plus max_tokens against a node accepting 1000 tokens
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    ctl.add_node(NodeSpec(node_id=NodeId("n0"), max_model_len=1000), 0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    d = arrive(ctl, "long", max_tokens=950)
    assert isinstance(d, Reject) and d.rejected.http_status == 400
    assert "1050 tokens (100 of prompt + 950 of max_tokens)" in d.rejected.message
    assert "1000" in d.rejected.message


@pytest.mark.parametrize("defer", [False, True])
def test_a_node_that_never_ran_the_request_is_not_learned_as_holding_its_prefix(
    defer: bool,
) -> None:
    ctl = cluster(2)
    ctl.defer_index_inserts = defer
    d = ctl.on_arrival(RequestArrived(request_id=RequestId("warm"), block_ids=(1,),
                                      prompt_tokens=100), 0.1)
    assert isinstance(d, Dispatch)
    first = d.node_id
    ctl.on_finished(RequestId("warm"), 0.2)  # `first` holds block 1 from now on
    d = ctl.on_arrival(RequestArrived(request_id=RequestId("r"), block_ids=(1, 2, 3),
                                      prompt_tokens=300), 0.3)
    assert isinstance(d, Dispatch) and d.node_id == first
    # the node refuses it before the first byte: it computes nothing of (1, 2, 3)
    out = ctl.on_failed(RequestId("r"), FailureKind.RETRY_ELSEWHERE, 0.4, before_first_byte=True)
    assert isinstance(out[0], Dispatch) and out[0].node_id != first
    other = out[0].node_id
    assert ctl.index.match((1, 2, 3), 0.5) == {first: 1, other: 3}
    # an answer that had started means the node ran it: what it learned stays
    d = ctl.on_arrival(RequestArrived(request_id=RequestId("s"), block_ids=(1, 5),
                                      prompt_tokens=200), 0.6)
    assert isinstance(d, Dispatch) and d.node_id == first
    ctl.on_failed(RequestId("s"), FailureKind.UPSTREAM_ERROR, 0.7, before_first_byte=False)
    assert ctl.index.match((1, 5), 0.8)[first] == 2


@pytest.mark.parametrize("second_fails", [False, True])
def test_a_failed_request_unlearns_only_blocks_nobody_else_carries(second_fails: bool) -> None:
    """Approximate mode takes back what a dispatch taught the index when the node ran
    nothing of it. A and B share a prompt on n0; A taught the index, B found it known.
    A refused by the node used to take the blocks away while B ran there; now B keeps
    them, and they are taken back if B fails in turn."""
    ctl = Controller(ControllerConfig(policy="round_robin"), rng=random.Random(0))
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.0)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.1, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    prompt = "shared system prompt " * 200
    for rid, t in (("A", 0.1), ("B", 0.2)):
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), prompt=prompt), t)
        assert isinstance(d, Dispatch) and d.node_id == "n0"
    chain, _ = ctl.chain_for(RequestArrived(request_id=RequestId("x"), prompt=prompt))
    known = {NodeId("n0"): len(chain)}
    assert ctl.index.match(chain, 0.3) == known
    ctl.on_failed(RequestId("A"), FailureKind.HTTP_503, 0.4, before_first_byte=True)
    assert ctl.index.match(chain, 0.5) == known  # B will compute them
    if second_fails:
        ctl.on_failed(RequestId("B"), FailureKind.HTTP_503, 0.6, before_first_byte=True)
        assert ctl.index.match(chain, 0.7) == {}  # nobody computed them


def test_without_max_tokens_only_the_prompt_must_fit() -> None:
    """A client that asks for no max_tokens gets what fits (vLLM's rule): the gateway's
    output estimate must not refuse a prompt the node serves."""
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    ctl.add_node(NodeSpec(node_id=NodeId("n0"), max_model_len=1000), 0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    def arrive_with(rid: str, prompt: int, given: bool) -> Decision:
        return ctl.on_arrival(
            RequestArrived(request_id=RequestId(rid), block_ids=(1, 2), prompt_tokens=prompt,
                           max_tokens=256, max_tokens_given=given),
            0.1,
        )

    assert isinstance(arrive_with("asked", 999, True), Reject)  # 999 + 256 asked for
    assert isinstance(arrive_with("open", 999, False), Dispatch)  # a node may take it
    d = arrive_with("full", 1000, False)
    assert isinstance(d, Reject)  # no room for a single token
    assert "1001 tokens (1000 of prompt + 1 of max_tokens)" in d.rejected.message


def test_an_estimated_prompt_is_refused_only_well_over_the_limit() -> None:
    """The text hasher counts characters / 4; prose of long words has more characters a
    token, so a prompt that fits may read too long: refused only past 1.25 x the limit,
    and the message says the count is an estimate."""
    ctl = Controller(ControllerConfig(hasher="text"), rng=random.Random(1))
    ctl.add_node(NodeSpec(node_id=NodeId("n0"), max_model_len=1000), 0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    near = RequestArrived(request_id=RequestId("near"), prompt="x" * 4400, max_tokens=10)
    assert isinstance(ctl.on_arrival(near, 0.1), Dispatch)  # about 1100 + 10 tokens
    far = RequestArrived(request_id=RequestId("far"), prompt="x" * 5200, max_tokens=10)
    d = ctl.on_arrival(far, 0.1)
    assert isinstance(d, Reject) and d.rejected.http_status == 400
    assert "about 1310 tokens (about 1300 of prompt + 10 of max_tokens)" in d.rejected.message
    # a count the client gave is exact: the plain limit
    exact = RequestArrived(
        request_id=RequestId("exact"), prompt="x" * 40, prompt_tokens=1001, max_tokens=10
    )
    assert isinstance(ctl.on_arrival(exact, 0.1), Reject)


def test_safe_mode_without_room_anywhere_is_a_retryable_degraded_503() -> None:
    """The coordinator never answered (safe mode: only nodes reporting room) and the only
    node reports itself full: a retryable 503 degraded (room comes back with the next
    load report), not overloaded with 'do not retry'."""
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    ctl.add_node(NodeSpec(node_id=NodeId("n0"), capacity=4), 0.0)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=20, kv_util=0.5, now=0.0)
    assert ctl.admission.degraded
    d = arrive(ctl, "r", priority=0)
    assert isinstance(d, Reject)
    assert d.rejected.reason.value == "degraded" and d.rejected.http_status == 503
    assert d.rejected.retryable_by_client and d.rejected.retry_after_s > 0
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=0.2)
    assert isinstance(arrive(ctl, "r2", 0.2, priority=0), Dispatch)


def test_a_request_excluding_every_node_is_told_so() -> None:
    ctl = cluster(2)
    d = arrive(ctl, "r", excluded_nodes=frozenset({NodeId("n0"), NodeId("n1")}))
    assert isinstance(d, Reject) and d.rejected.http_status == 503
    assert "X-Kvgate-Exclude-Node" in d.rejected.message
    d = arrive(ctl, "r2", excluded_nodes=frozenset({NodeId("n0")}))
    assert isinstance(d, Dispatch) and d.route.node_id == "n1"


@pytest.mark.parametrize(
    "kind", [FailureKind.RETRY_ELSEWHERE, FailureKind.HTTP_503, FailureKind.RATE_LIMITED]
)
def test_a_node_that_keeps_refusing_is_left_out_a_while(kind: FailureKind) -> None:
    """A node refusing everything with a healthy /health looked idle (nothing of ours in
    flight) and kept drawing requests that failed; after two refusals in a row it is
    left out, for longer at each further one, until it takes a request again."""
    ctl = cluster(3)
    bad = NodeId("n0")
    sent: dict[NodeId, int] = {}
    now = 1.0
    for i in range(300):  # one request every 10 ms for 3 s; n0 refuses, the others answer
        now = 1.0 + i * 0.01
        first = ctl.on_arrival(
            RequestArrived(request_id=RequestId(f"r{i}"), block_ids=(2 * i + 10, 2 * i + 11),
                           prompt_tokens=100),
            now,
        )
        assert isinstance(first, Dispatch)
        d = first  # a prompt of its own: no cache draws it anywhere
        while d.node_id == bad:
            sent[bad] = sent.get(bad, 0) + 1
            out = ctl.on_failed(RequestId(f"r{i}"), kind, now, before_first_byte=True)
            if not out or not isinstance(out[0], Dispatch):
                break  # failed for good
            d = out[0]
        else:
            sent[d.node_id] = sent.get(d.node_id, 0) + 1
            ctl.on_first_byte(RequestId(f"r{i}"), now)
            ctl.on_finished(RequestId(f"r{i}"), now)
    # without the back-off n0, idle-looking, drew about a third or more of 300
    assert sent[bad] <= 8, sent
    assert ctl.refusals.backoffs >= 2
    assert all(s.healthy for s in ctl.nodes)  # left out, not marked down
    # once it takes a request again, it is a candidate like any other (idle, first slot)
    ctl.refusals.took(bad)
    again = ctl.on_arrival(
        RequestArrived(request_id=RequestId("again"), block_ids=(7, 8), prompt_tokens=100), now
    )
    assert isinstance(again, Dispatch) and again.node_id == bad


def test_a_whole_answer_ends_a_nodes_refusals_as_a_first_byte_does() -> None:
    """A node that refused once, then served non-streamed requests (their whole answer
    at once: no first byte is reported), was left out at its next single refusal: only
    a streamed first byte cleared its count of refusals in a row."""
    ctl = cluster(1)
    dispatch(ctl, "r0", 1.0)
    ctl.on_failed(RequestId("r0"), FailureKind.RETRY_ELSEWHERE, 1.0, before_first_byte=True)
    for i in range(1, 4):  # served, not streamed
        dispatch(ctl, f"r{i}", 1.1)
        ctl.on_finished(RequestId(f"r{i}"), 1.2)
    dispatch(ctl, "r4", 1.3)
    ctl.on_failed(RequestId("r4"), FailureKind.RETRY_ELSEWHERE, 1.3, before_first_byte=True)
    assert ctl.refusals.left_out(1.3) == frozenset()  # one refusal in a row, not two
    assert ctl.refusals.backoffs == 0


def test_an_ejected_node_and_its_return_are_news_for_the_log() -> None:
    ctl = cluster(2, eject_after_failures=3, eject_s=30.0)
    for i in range(3):
        d = dispatch(ctl, f"r{i}", 1.0, excluded_nodes=frozenset({NodeId("n1")}))
        assert d.node_id == "n0"
        ctl.on_failed(RequestId(f"r{i}"), FailureKind.UPSTREAM_ERROR, 1.0,
                      before_first_byte=False)
    assert ctl.take_ejections() == [(NodeId("n0"), True)]
    assert ctl.take_ejections() == []  # each told once
    ctl.tick(30.5)
    assert ctl.take_ejections() == []
    ctl.tick(31.0)
    assert ctl.take_ejections() == [(NodeId("n0"), False)]


def test_refusals_leave_no_node_out_when_none_else_is_left() -> None:
    ctl = cluster(1)
    for i in range(5):
        dispatch(ctl, f"r{i}", 1.0)
        ctl.on_failed(RequestId(f"r{i}"), FailureKind.RETRY_ELSEWHERE, 1.0,
                      before_first_byte=True)
    assert ctl.refusals.left_out(1.0) == {NodeId("n0")}
    assert isinstance(arrive(ctl, "last", 1.0), Dispatch)  # its refusal is the answer


def test_a_busy_node_refusing_is_left_to_the_load_score() -> None:
    """A node whose reports say requests wait there refuses for load: backpressure,
    which the load score reads. Left out too, round robin (blind to load) kept up longer
    and its saturation point on the conversation trace moved from x1.044 to x1.079."""
    ctl = cluster(1)
    ctl.on_load_report(NodeId("n0"), waiting=6, running=40, kv_util=0.7, now=1.0)
    for i in range(6):
        assert dispatch(ctl, f"r{i}", 1.0).node_id == NodeId("n0")
        ctl.on_failed(RequestId(f"r{i}"), FailureKind.RETRY_ELSEWHERE, 1.0,
                      before_first_byte=True)
    assert ctl.refusals.backoffs == 0 and not ctl.refusals.left_out(1.0)
    # the same refusals from a node that reports nothing waiting: left out
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=1.0)
    for i in range(6, 8):
        dispatch(ctl, f"r{i}", 1.0)
        ctl.on_failed(RequestId(f"r{i}"), FailureKind.RETRY_ELSEWHERE, 1.0,
                      before_first_byte=True)
    assert ctl.refusals.left_out(1.0) == {NodeId("n0")}


def test_a_node_refusing_for_good_neither_overflows_nor_over_counts() -> None:
    from kvgate.core.refusals import RefusalBackoff

    backoff = RefusalBackoff()
    node = NodeId("n0")
    for i in range(3000):  # 2.0 ** 1024 overflowed at the 1 026th refusal in a row
        backoff.refused(node, 1.0 + i * 1e-3)
    assert backoff.left_out(2.0) == {node}
    assert not backoff.left_out(1.0 + 2999e-3 + 5.0)  # at most max_s
    # refusals while it is left out are not new back-offs: 3 s at 1 ms each, the
    # waits 0.25, 0.5, 1, 2, 4 s: left out at the second refusal and never let back
    assert backoff.backoffs == 1


@pytest.mark.parametrize("how", ["cancelled", "no node"])
def test_a_half_open_probe_that_never_ran_is_handed_back(how: str) -> None:
    """A probe whose client went away, or that no node could take, says nothing of the
    cluster: its probe goes back at once (it used to be lost until the breaker's own
    re-arm, and before that for good)."""
    ctl = cluster(eject_after_failures=1000)
    coordinator = InProcessCoordinator(ctl.config.admission)
    for i in range(20):  # 20 timeouts after the first byte: the breaker opens
        dispatch(ctl, f"f{i}", 1.0)
        ctl.on_failed(RequestId(f"f{i}"), FailureKind.TIMEOUT, 1.0, before_first_byte=False)
    assert ctl.admission.breaker_state is BreakerState.OPEN
    ctl.refresh_with(coordinator, 7.0)  # a live lease and fresh load reports at 7 s
    for n in ("n0", "n1"):
        ctl.on_load_report(NodeId(n), waiting=0, running=0, kv_util=0.0, now=7.0)
    everyone = frozenset({NodeId("n0"), NodeId("n1")})
    for i in range(3):  # open_s (5 s) later: the three half-open probes
        if how == "cancelled":
            dispatch(ctl, f"p{i}", 7.0)
            ctl.on_cancelled(RequestId(f"p{i}"), 7.1)
        else:
            d = arrive(ctl, f"p{i}", 7.0, excluded_nodes=everyone)
            assert isinstance(d, Reject) and d.rejected.reason.value == "overloaded"
    assert ctl.admission.breaker_state is BreakerState.HALF_OPEN
    assert isinstance(arrive(ctl, "next", 7.2), Dispatch)  # a probe was left for it


def test_excluding_the_only_healthy_node_says_healthy() -> None:
    """n1 is down (ejected for a while): a request excluding n0 excludes every healthy
    node, not every node serving the model, as the message said."""
    ctl = cluster(2)
    ctl.set_healthy(NodeId("n1"), False, 0.5)
    d = arrive(ctl, "r", 1.0, excluded_nodes=frozenset({NodeId("n0")}))
    assert isinstance(d, Reject)
    assert d.rejected.message.startswith("every healthy node serving this model is excluded")


def test_a_long_queue_no_node_can_take_is_rejected_without_recursion() -> None:
    """Each queued request no node could take gave its credit back, which admitted the
    next one, three stack frames deeper: ~330 of them overflowed Python's stack, and the
    rejections already made were lost with the exception."""
    from kvgate.core.admission import AdmissionConfig

    ctl = cluster(admission=AdmissionConfig(budget=16, bypass_fraction=0.0))
    running = []
    while isinstance(d := arrive(ctl, f"run{len(running)}"), Dispatch):
        running.append(d.request_id)
    ctl.on_cancelled(RequestId(f"run{len(running)}"), 0.1)  # the budget is full: queued
    for i in range(600):  # they name every node as one to avoid
        arrive(ctl, f"q{i}", excluded_nodes=("n0", "n1"))
    assert ctl.admission.queued_total == 600
    out = ctl.on_finished(running[0], 1.0)
    rejected = [d for d in out if isinstance(d, Reject)]
    assert len(rejected) == 600 and ctl.admission.queued_total == 0
    assert {d.request_id for d in rejected} == {RequestId(f"q{i}") for i in range(600)}
    assert ctl.num_requests() == len(running) - 1


def test_queued_requests_do_not_widen_the_retry_budget() -> None:
    """The budget (20 % of active requests) counted the requests queued at the gateway:
    with 500 queued, every attempt in flight could be retried, 2x load under overload."""
    from kvgate.core.admission import AdmissionConfig

    def retried(queued: int) -> int:
        ctl = cluster(3, admission=AdmissionConfig(budget=40, bypass_fraction=0.0))
        running = []
        while isinstance(d := arrive(ctl, f"r{len(running)}", priority=0), Dispatch):
            running.append(d)
        for j in range(queued):
            arrive(ctl, f"q{j}", priority=0)
        assert ctl.admission.queued_total == queued + 1
        out = 0
        for d in running:  # every node refuses every attempt: "retry elsewhere"
            got = ctl.on_failed(d.request_id, FailureKind.RETRY_ELSEWHERE, 0.2,
                                before_first_byte=True)
            out += any(isinstance(x, Dispatch) and x.request_id == d.request_id for x in got)
        return out

    assert retried(0) == retried(500) == 8  # max(3, 0.2 x ~40 in flight)
