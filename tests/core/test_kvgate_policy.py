"""Golden decisions of kvgate's own policy on a 4-node table."""

from __future__ import annotations

import random

import pytest
from xxhash import xxh3_64_intdigest

from kvgate.core.errors import ConfigError
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec, NodeState, NodeTable
from kvgate.core.routing.base import RouteContext, RouteReason
from kvgate.core.routing.kvgate import KvgatePolicy
from kvgate.core.routing.kvgate_memory import DecayedSeconds, TailLevel

NOW = 10.0


class FixedRng:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def table(loads: dict[str, tuple[int, float]]) -> tuple[NodeTable, list[NodeState]]:
    t = NodeTable(stale_after_s=5.0)
    states = []
    for name, (waiting, util) in loads.items():
        s = t.add(NodeSpec(node_id=NodeId(name)))
        t.report(NodeId(name), waiting=waiting, running=4, kv_util=util, now=NOW)
        states.append(s)
    return t, states


def ctx(blocks: int = 100, tpb: int = 64, **kw: object) -> RouteContext:
    return RouteContext(
        chain=tuple(range(blocks)),
        prompt_tokens=blocks * tpb,
        tokens_per_block=tpb,
        **kw,  # type: ignore[arg-type]
    )


def test_score_follows_the_brief() -> None:
    t, c = table({"a": (8, 0.5), "b": (0, 0.0)})
    d = KvgatePolicy(form="brief", epsilon=0).select(
        ctx(), c, {NodeId("a"): 64}, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "a" and d.reason is RouteReason.CACHE_HIT
    # 64 blocks * 64 tokens = 4096 of 8192 -> bonus 0.5; penalty 8/32 + 0.3*0.5 = 0.4
    assert d.parts["bonus"] == pytest.approx(0.5)
    assert d.parts["penalty"] == pytest.approx(0.4)
    assert d.score == pytest.approx(3 * 0.5 - 0.4)


def test_bonus_grows_with_saved_prefill_not_with_fraction() -> None:
    # a full match of a short prompt saves less than a half match of a long one
    t, c = table({"short": (0, 0.0), "long": (0, 0.0)})
    p = KvgatePolicy(form="brief", epsilon=0)
    short = p.select(ctx(blocks=4), c[:1], {NodeId("short"): 4}, t, FixedRng(0.9), NOW)
    long_ = p.select(ctx(blocks=100), c[1:], {NodeId("long"): 50}, t, FixedRng(0.9), NOW)
    assert short is not None and long_ is not None
    assert long_.parts["bonus"] > short.parts["bonus"]


def test_small_match_loses_to_much_lower_load() -> None:
    t, c = table({"holder": (30, 0.9), "idle": (0, 0.0)})
    d = KvgatePolicy(form="brief", epsilon=0, breaker_open_queue=31).select(
        ctx(), c, {NodeId("holder"): 4}, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "idle" and d.reason is RouteReason.LOAD


def test_breaker_drops_bonus_with_hysteresis() -> None:
    p = KvgatePolicy(form="brief", epsilon=0, breaker_open_queue=24, breaker_close_queue=12)
    m = {NodeId("a"): 100}
    t, c = table({"a": (24, 0.2), "b": (10, 0.2)})
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b" and d.reason is RouteReason.BREAKER
    # queue falls to 16: still tripped (above the close threshold)
    t.report(NodeId("a"), waiting=16, running=4, kv_util=0.2, now=NOW)
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b"
    # queue falls to 12: closed again, the holder wins
    t.report(NodeId("a"), waiting=12, running=4, kv_util=0.2, now=NOW)
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "a" and d.reason is RouteReason.CACHE_HIT


def test_spread_among_holders_by_load() -> None:
    t, c = table({"a": (10, 0.5), "b": (2, 0.5), "c": (0, 0.0)})
    m = {NodeId("a"): 100, NodeId("b"): 100}
    d = KvgatePolicy(form="brief", epsilon=0).select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b" and d.reason is RouteReason.SPREAD


def test_exploration_sends_a_hit_to_an_idle_miss() -> None:
    t, c = table({"a": (3, 0.5), "idle": (0, 0.1), "busy": (5, 0.0)})
    m = {NodeId("a"): 100}
    p = KvgatePolicy(form="brief", epsilon=0.05)
    d = p.select(ctx(), c, m, t, FixedRng(0.01), NOW)
    assert d is not None and d.node_id == "idle" and d.reason is RouteReason.EXPLORATION
    d = p.select(ctx(), c, m, t, FixedRng(0.06), NOW)
    assert d is not None and d.node_id == "a"


def test_exploration_rate_is_about_epsilon() -> None:
    t, c = table({"a": (3, 0.5), "idle": (0, 0.1)})
    p = KvgatePolicy(form="brief", epsilon=0.05)
    rng = random.Random(5)
    n = sum(
        p.select(ctx(), c, {NodeId("a"): 100}, t, rng, NOW).reason is RouteReason.EXPLORATION  # type: ignore[union-attr]
        for _ in range(4000)
    )
    assert 150 < n < 250


def test_hot_prefix_gets_a_replica_up_to_the_cap() -> None:
    t, c = table({"a": (2, 0.2), "b": (0, 0.0), "c": (1, 0.0)})
    p = KvgatePolicy(form="brief", epsilon=0, replica_rps=5.0, max_replicas=2)
    hot = ctx(hot_key=7, hot_blocks=4, hot_rate=6.0)
    d = p.select(hot, c, {NodeId("a"): 100}, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b" and d.reason is RouteReason.REPLICATION
    # two holders now serve 10 rps: 6 rps needs no third one
    d = p.select(hot, c, {NodeId("a"): 100, NodeId("b"): 100}, t, FixedRng(0.9), NOW)
    assert d is not None and d.reason is not RouteReason.REPLICATION
    # at the cap no more replicas even when hotter
    hotter = ctx(hot_key=7, hot_blocks=4, hot_rate=50.0)
    d = p.select(hotter, c, {NodeId("a"): 100, NodeId("b"): 100}, t, FixedRng(0.9), NOW)
    assert d is not None and d.reason is not RouteReason.REPLICATION


def test_eviction_warning_weight_cuts_the_bonus() -> None:
    t, c = table({"a": (8, 0.3), "b": (0, 0.0)})
    d = KvgatePolicy(form="brief", epsilon=0).select(
        ctx(), c, {NodeId("a"): 100}, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "a"
    c[0].cache_weight = 0.1
    d = KvgatePolicy(form="brief", epsilon=0).select(
        ctx(), c, {NodeId("a"): 100}, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "b"


def test_stale_report_counts_as_loaded() -> None:
    t, c = table({"a": (0, 0.0), "b": (0, 0.0)})
    t.report(NodeId("a"), waiting=0, running=0, kv_util=0.0, now=NOW - 60)
    d = KvgatePolicy(form="brief", epsilon=0).select(ctx(), c, {}, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b"


def test_never_picks_a_non_candidate() -> None:
    t, c = table({"a": (0, 0.0), "b": (9, 0.9)})
    d = KvgatePolicy(form="brief", epsilon=1.0).select(
        ctx(), c[1:], {NodeId("a"): 100}, t, FixedRng(0.0), NOW
    )
    assert d is not None and d.node_id == "b"
    assert KvgatePolicy(form="brief").select(ctx(), [], {}, t, FixedRng(0.0), NOW) is None


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        KvgatePolicy(breaker_open_queue=4, breaker_close_queue=8)
    with pytest.raises(ConfigError):
        KvgatePolicy(form="brief", epsilon=2.0)
    for bad in (
        {"blocking_cost": -1.0},
        {"affinity_slack_s": -1.0},
        {"cache_value_tau_s": 0.0},
        {"explore_max_loss_s": -0.5},
        {"affinity_min_gain_s": -0.1},
        {"affinity_short_gain_s": -0.1},
        {"affinity_short_slack_s": float("nan")},
        {"affinity_slack_s": float("nan")},
        {"decode_s_per_context_token": float("inf")},
        {"blocking_cost": float("nan")},
        {"decode_s_per_context_token": -1e-5},
        {"max_cache_wait_s": -1.0},
        {"max_cache_wait_s": float("nan")},
        {"tail_quantile": 1.0},
        {"tail_quantile": -0.1},
        {"tail_quantile": float("nan")},
        {"tail_window": 0},
        {"session_spread_s": -0.1},
        {"session_spread_shared_s": -0.5},
        {"session_work_s": float("nan")},
        {"session_min_shared_s": -1.0},
        {"recent_work_tau_s": 0.0},
        {"ttft_target_s": -1.0},
        {"ttft_target_s": float("nan")},
        {"fleet_home_s": -0.1},
        {"explore_busy": "no"},  # a word, not a switch: "no" would read as on
    ):
        with pytest.raises(ConfigError):
            KvgatePolicy(**bad)  # type: ignore[arg-type]


# --- the predicted-TTFT form (the default) ----------------------------------------------


def test_ttft_form_weighs_saved_prefill_against_queued_prefill() -> None:
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0,
        prefill_tokens_per_s=1000.0,
        cache_gain=2.0,
        decode_s=0.0,
        attention_s_per_pair=0.0,
        affinity_slack_s=0.0,  # the score alone
    )
    m = {NodeId("holder"): 10}  # 10 blocks x 64 tokens = 640 tokens = 0.64 s saved
    # 1.0 s of queued prefill on the holder: 2 x 0.64 - 1.0 > 0 -> still the holder
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=1000)
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "holder"
    assert d.parts["bonus"] == pytest.approx(0.64) and d.parts["penalty"] == pytest.approx(1.0)
    # 1.5 s queued: 1.28 - 1.5 < 0 -> the idle node, which saves nothing but waits for nothing
    t.on_sent(c[0], now=NOW, key=2, prefill_tokens=500)
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "idle" and d.reason is RouteReason.LOAD
    # the first tokens came back: the queued prefill is gone, the holder wins again
    t.on_prefilled(c[0], 1, now=NOW)
    t.on_prefilled(c[0], 2, now=NOW)
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "holder"


def test_ttft_form_counts_the_queued_prefill_already_done() -> None:
    """The node works through its queued prefill in send order: after 0.5 s, 1.5 s
    queued is 1.0 s left, and the holder wins again (2 x 0.64 - 1.0 > 0)."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=1000.0, cache_gain=2.0, decode_s=0.0,
        attention_s_per_pair=0.0, kv_pressure_s=0.0,  # (reports go stale by NOW + 10)
        affinity_slack_s=0.0,  # the score alone
    )
    m = {NodeId("holder"): 10}
    t.on_sent(c[0], now=NOW, key="a", prefill_tokens=1500)
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "idle"
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW + 0.5)
    assert d is not None and d.node_id == "holder"
    assert d.parts["penalty"] == pytest.approx(1.0, abs=0.011)  # the 10 ms drain clock
    # a later send queues behind the head in progress: 1.0 + 0.4 s left
    t.on_sent(c[0], now=NOW + 0.5, key="b", prefill_tokens=400)
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW + 0.5)
    assert d is not None and d.node_id == "idle"
    # the head's first token: the node starts on "b" now, from its full size
    t.on_prefilled(c[0], "a", now=NOW + 1.0)
    d = p.select(ctx(blocks=20), c[:1], m, t, FixedRng(0.9), NOW + 1.0)
    assert d is not None and d.parts["penalty"] == pytest.approx(0.4)
    d = p.select(ctx(blocks=20), c[:1], m, t, FixedRng(0.9), NOW + 1.3)
    assert d is not None and d.parts["penalty"] == pytest.approx(0.1, abs=0.011)


def test_ttft_form_a_stalled_head_grows_less_attractive() -> None:
    """A head past its predicted prefill time without a first token is larger than
    predicted (an evicted hit): its overrun is taken as what is left of it."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=1000.0, decode_s=0.0, attention_s_per_pair=0.0,
        kv_pressure_s=0.0,
    )
    t.on_sent(c[0], now=NOW, key="head", prefill_tokens=400)  # predicted 0.4 s
    t.on_sent(c[0], now=NOW, key="next", prefill_tokens=600)  # 0.6 s behind it
    penalty = {}
    for dt in (0.0, 0.2, 0.4, 2.0, 5.0):
        d = p.select(ctx(blocks=20), c[:1], {}, t, FixedRng(0.9), NOW + dt)
        assert d is not None
        penalty[dt] = d.parts["penalty"]
    assert penalty[0.0] == pytest.approx(1.0)
    assert penalty[0.2] == pytest.approx(0.8, abs=0.011)
    assert penalty[0.4] == pytest.approx(0.6, abs=0.011)  # the head should be done
    assert penalty[2.0] == pytest.approx(0.6 + 1.6, abs=0.011)  # 1.6 s overdue
    assert penalty[5.0] == pytest.approx(0.6 + 4.6, abs=0.011)
    # a later request's first token does not restart the head
    t.on_prefilled(c[0], "next", now=NOW + 5.0)
    d = p.select(ctx(blocks=20), c[:1], {}, t, FixedRng(0.9), NOW + 5.0)
    assert d is not None and d.parts["penalty"] == pytest.approx(4.6, abs=0.011)
    # its end (an abandoned prefill) empties the queue
    t.on_done(c[0], sent_at=NOW, now=NOW + 6.0, key="head")
    d = p.select(ctx(blocks=20), c, {}, t, FixedRng(0.9), NOW + 6.0)
    assert d is not None and d.parts["penalty"] == 0.0


def test_ttft_form_bonus_is_not_capped() -> None:
    t, c = table({"a": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=10_000.0, decode_s=0.0, attention_s_per_pair=0.0
    )
    short = p.select(ctx(blocks=200), c, {NodeId("a"): 150}, t, FixedRng(0.9), NOW)
    long_ = p.select(ctx(blocks=400), c, {NodeId("a"): 300}, t, FixedRng(0.9), NOW)
    assert short is not None and long_ is not None
    assert long_.parts["bonus"] == pytest.approx(2 * short.parts["bonus"])


def test_ttft_form_decode_load_from_kv_utilisation() -> None:
    t, c = table({"busy": (0, 0.9), "calm": (0, 0.1)})
    p = KvgatePolicy(epsilon=0, decode_s=3.0, kv_pressure_s=5.0)
    d = p.select(ctx(), c, {}, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "calm"
    # 3 x 0.9 + 5 x (0.9 - 0.8) x 5 = 2.7 + 2.5
    busy = p.select(ctx(), c[:1], {}, t, FixedRng(0.9), NOW)
    assert busy is not None and busy.parts["penalty"] == pytest.approx(5.2)


def test_ttft_form_affinity_slack_keeps_the_deeper_holder() -> None:
    """The score alone sends the request to the idle node (2 x 0.64 s saved < 1.5 s
    queued on the holder); the holder's predicted TTFT is 1.5 + 0.64 = 2.14 s against
    the idle node's 1.28 s, so a slack of at least 0.86 s keeps it on the holder."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0), "short": (0, 0.0)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 2.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
        "decode_s_per_context_token": 0.0,
    }
    m = {NodeId("holder"): 10}  # 0.64 s saved of a 1.28 s prompt
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=1500)  # 1.5 s queued on the holder
    for slack, want in ((0.0, "idle"), (0.85, "idle"), (0.87, "holder"), (10.0, "holder")):
        p = KvgatePolicy(affinity_slack_s=slack, **kw)
        d = p.select(ctx(blocks=20), c[:2], m, t, FixedRng(0.9), NOW)
        assert d is not None and d.node_id == want, slack
    kept = KvgatePolicy(affinity_slack_s=10.0, **kw).select(
        ctx(blocks=20), c[:2], m, t, FixedRng(0.9), NOW
    )
    assert kept is not None and kept.reason is RouteReason.CACHE_HIT and kept.matched_blocks == 10
    assert kept.parts["bonus"] == pytest.approx(0.64) and kept.parts["penalty"] == 1.5
    assert kept.score == pytest.approx(2 * 0.64 - 1.5)
    # the winner is a shallower holder ("short", 6 blocks, idle: 0.9 s predicted): the
    # deeper one is kept only within the slack of *its* predicted TTFT
    m2 = {NodeId("holder"): 10, NodeId("short"): 6}
    for slack, want in ((1.2, "short"), (1.3, "holder")):
        p = KvgatePolicy(affinity_slack_s=slack, **kw)
        d = p.select(ctx(blocks=20), c, m2, t, FixedRng(0.9), NOW)
        assert d is not None and d.node_id == want, slack
    # a holder that saves only as much as the winner is not a reason to wait
    m3 = {NodeId("holder"): 10, NodeId("short"): 10}
    d = KvgatePolicy(affinity_slack_s=1e9, **kw).select(
        ctx(blocks=20), c, m3, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "short"


def test_ttft_form_affinity_slack_takes_the_deepest_holder_within_it() -> None:
    """Of two deeper holders within the slack the one that saves the most wins, even
    if it would answer later; a holder above 80 % KV utilisation is not held to."""
    t, c = table({"mid": (0, 0.0), "deep": (0, 0.0), "idle": (0, 0.0), "full": (0, 0.9)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 1.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
        "decode_s_per_context_token": 0.0, "affinity_slack_s": 5.0,
    }
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=1000)  # mid: 1 s queued
    t.on_sent(c[1], now=NOW, key=2, prefill_tokens=3000)  # deep: 3 s queued
    m = {NodeId("mid"): 8, NodeId("deep"): 12}
    d = KvgatePolicy(**kw).select(ctx(blocks=20), c[:3], m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "deep" and d.matched_blocks == 12
    # with a slack of 1 s only "mid" (1 + 0.768 s against the idle node's 1.28 s) fits
    d = KvgatePolicy(**{**kw, "affinity_slack_s": 1.0}).select(
        ctx(blocks=20), c[:3], m, t, FixedRng(0.9), NOW
    )
    assert d is not None and d.node_id == "mid"
    # the deepest holder of all (2 s queued, 2 s predicted) is nearly full: passed
    # over, "deep" keeps it
    t.on_sent(c[3], now=NOW, key=3, prefill_tokens=2000)
    m_full = {**m, NodeId("full"): 20}
    d = KvgatePolicy(**kw).select(ctx(blocks=20), c, m_full, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "deep"


def test_ttft_form_affinity_slack_needs_a_real_gain() -> None:
    """A holder that saves less than affinity_min_gain_s more than the winner (a block of
    a shared prefix) is not worth waiting for: one block (0.064 s) of a 20-block prompt
    behind 9 s of queue loses to the idle node; three blocks (0.192 s) keep it."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 2.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
        "decode_s_per_context_token": 0.0, "affinity_slack_s": 10.0,
        "affinity_min_gain_s": 0.1, "affinity_short_gain_s": 0.0,
    }
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=9000)  # 9 s queued on the holder
    for blocks, want in ((1, "idle"), (3, "holder")):
        d = KvgatePolicy(**kw).select(
            ctx(blocks=20), c, {NodeId("holder"): blocks}, t, FixedRng(0.9), NOW
        )
        assert d is not None and d.node_id == want, blocks


@pytest.mark.parametrize(
    ("queued", "blocks", "want"),
    [
        (9000, 3, "idle"),  # 0.192 s more saved, a short gain: 8.81 s is past 4 s
        (4300, 3, "idle"),  # 4.11 s: just past it
        (4100, 3, "holder"),  # 3.91 s: within it
        (9000, 5, "holder"),  # 0.32 s more saved: the whole slack (10 s) holds 8.68 s
    ],
)
def test_ttft_form_a_short_gain_gets_a_short_slack(queued: int, blocks: int, want: str) -> None:
    """A holder that saves less than affinity_short_gain_s more than the winner (a
    short session's own turns) keeps the request only within affinity_short_slack_s
    of the winner's predicted TTFT, not the whole affinity slack: waiting 9 s behind
    somebody's long prefill for 0.2 s of prefill is not worth it; the idle node
    answers at 0, the holder at its queue less what its cache saves."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=1000.0, cache_gain=2.0, decode_s=0.0,
        attention_s_per_pair=0.0, blocking_cost=0.0, kv_pressure_s=0.0,
        decode_s_per_context_token=0.0, affinity_slack_s=10.0,
        affinity_short_gain_s=0.25, affinity_short_slack_s=4.0,
    )  # fmt: skip
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=queued)
    d = p.select(ctx(blocks=20), c, {NodeId("holder"): blocks}, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == want


def test_ttft_form_bounded_wait_for_the_cache() -> None:
    """The score keeps a hit on its holder (5 x 0.64 s saved against 3 s queued: 0.2
    against the idle node's 0), but its predicted first token there comes 3 - 0.64 =
    2.36 s after the idle node's: past max_cache_wait_s the idle node takes it."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 5.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
        "decode_s_per_context_token": 0.0,
    }
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=3000)  # 3 s queued on the holder
    m = {NodeId("holder"): 10}  # 0.64 s of a 1.28 s prompt
    for wait, want in ((2.3, "idle"), (2.4, "holder"), (10.0, "holder")):
        d = KvgatePolicy(max_cache_wait_s=wait, **kw).select(
            ctx(blocks=20), c, m, t, FixedRng(0.9), NOW
        )
        assert d is not None and d.node_id == want, wait
    moved = KvgatePolicy(max_cache_wait_s=2.3, **kw).select(
        ctx(blocks=20), c, m, t, FixedRng(0.9), NOW
    )
    assert moved is not None and moved.reason is RouteReason.LOAD
    assert moved.matched_blocks == 0 and moved.best_matched_blocks == 10
    assert moved.score == 0.0 and moved.parts["bonus"] == 0.0


def test_ttft_form_affinity_slack_stays_within_the_bounded_wait() -> None:
    """The slack keeps a deeper holder only while its predicted first token is within
    max_cache_wait_s of the soonest: "deep" (15 blocks, 6 s queued) answers at 6 - 0.96
    = 5.04 s, the idle node at 0; "mid" (10 blocks, 1 s queued) wins the score."""
    t, c = table({"deep": (0, 0.0), "mid": (0, 0.0), "idle": (0, 0.0)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 5.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
        "decode_s_per_context_token": 0.0, "affinity_slack_s": 10.0,
    }
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=6000)
    t.on_sent(c[1], now=NOW, key=2, prefill_tokens=1000)
    m = {NodeId("deep"): 15, NodeId("mid"): 10}
    for wait, want in ((5.0, "mid"), (5.1, "deep")):
        d = KvgatePolicy(max_cache_wait_s=wait, **kw).select(
            ctx(blocks=20), c, m, t, FixedRng(0.9), NOW
        )
        assert d is not None and d.node_id == want, wait


def test_ttft_form_affinity_slack_counts_the_blocking_cost() -> None:
    """A long uncached prefill rescored by the blocking rule: the slack compares
    predicted TTFTs with each node's blocking cost in them, so it does not undo the
    rule by sending the prompt back to the busy cache for one block of it."""
    t, c = table({"busy_cache": (0, 0.0), "quiet": (0, 0.0)})
    kw: dict[str, float] = {
        "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 1.0, "decode_s": 0.0,
        "attention_s_per_pair": 0.0, "kv_pressure_s": 0.0, "decode_s_per_context_token": 0.0,
        "blocking_cost": 3.0, "blocking_min_s": 1.0, "cache_value_tau_s": 30.0,
        "affinity_min_gain_s": 0.0,
    }
    m = {NodeId("busy_cache"): 1}  # 64 of 2560 tokens: 0.064 s saved
    # blocking on busy_cache comes to 1.19 s, more than the 1 s slack
    for slack in (0.0, 1.0):
        p = KvgatePolicy(affinity_slack_s=slack, **kw)
        for i in range(30):  # hits on busy_cache: its cache value rate grows
            p.select(ctx(blocks=4), c[:1], {NodeId("busy_cache"): 4}, t, FixedRng(0.9), NOW + i)
        for node in ("busy_cache", "quiet"):  # fresh reports (a stale node counts as full)
            t.report(NodeId(node), waiting=0, running=4, kv_util=0.0, now=NOW + 30)
        # blocking on busy_cache: 3 x 2.496 s x its rate; quiet has none
        d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.9), NOW + 30)
        assert d is not None and d.node_id == "quiet", slack


def test_ttft_form_exploration_gives_up_only_small_hits() -> None:
    """Exploration sends a hit to an idle node only if it saves at most
    explore_max_loss_s of prefill: a shared prefix, not a session's long context."""
    t, c = table({"holder": (0, 0.5), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=1.0, prefill_tokens_per_s=1000.0, attention_s_per_pair=0.0,
        explore_max_loss_s=1.0,
    )
    small = p.select(ctx(blocks=40), c, {NodeId("holder"): 15}, t, FixedRng(0.0), NOW)
    assert small is not None and small.node_id == "idle"  # 0.96 s saved
    assert small.reason is RouteReason.EXPLORATION
    big = p.select(ctx(blocks=40), c, {NodeId("holder"): 16}, t, FixedRng(0.0), NOW)
    assert big is not None and big.node_id == "holder"  # 1.024 s saved
    assert big.reason is RouteReason.CACHE_HIT


def test_ttft_form_default_explores_whenever_a_node_is_idle() -> None:
    """A new agent task whose tool prefix (12 of 16 blocks) only one busy node holds:
    the score prefers the idle node (5 x 0.768 s saved < 4 s queued) but the affinity
    slack keeps the holder (3.23 s to a first token is within 10 s of 0 s); with the
    default epsilon (1.0) the idle node takes it whatever the draw, at 0.2 only when
    the draw is below 0.2."""
    t, c = table({"busy": (0, 0.0), "idle": (0, 0.0)})
    kw: dict[str, float] = {
        "prefill_tokens_per_s": 1000.0, "attention_s_per_pair": 0.0, "decode_s": 0.0,
        "kv_pressure_s": 0.0, "decode_s_per_context_token": 0.0, "blocking_cost": 0.0,
    }
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=4000)  # 4 s queued on the holder
    t.report(NodeId("idle"), waiting=0, running=0, kv_util=0.0, now=NOW)
    m = {NodeId("busy"): 12}
    assert KvgatePolicy().epsilon == 1.0
    for draw in (0.0, 0.5, 0.999):
        d = KvgatePolicy(**kw).select(ctx(blocks=16), c, m, t, FixedRng(draw), NOW)
        assert d is not None and d.node_id == "idle" and d.reason is RouteReason.EXPLORATION
    kept = KvgatePolicy(epsilon=0.0, **kw).select(ctx(blocks=16), c, m, t, FixedRng(0.5), NOW)
    assert kept is not None and kept.node_id == "busy" and kept.reason is RouteReason.CACHE_HIT
    for draw, want in ((0.1, "idle"), (0.5, "busy")):
        d = KvgatePolicy(epsilon=0.2, **kw).select(ctx(blocks=16), c, m, t, FixedRng(draw), NOW)
        assert d is not None and d.node_id == want, draw


def test_ttft_form_exploration_copies_a_shared_prefix_not_a_session_context() -> None:
    """A cheap hit is explored if it is shared: what the winner holds beyond the
    longest other match saves at most affinity_min_gain_s. A session's own context on
    top of a shared prefix, and a first copy (no other candidate holds any of it, so it
    may be a session's own context too), leave their holder only for a first token no
    later at the idle node. (The holder is busy: KV above idle_util.)"""
    t, c = table({"holder": (0, 0.25), "other": (0, 0.2), "idle": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=1.0, prefill_tokens_per_s=1000.0, attention_s_per_pair=0.0,
        explore_max_loss_s=1.0, affinity_min_gain_s=0.1,
    )

    def pick(other: int) -> tuple[str, RouteReason]:
        m = {NodeId("holder"): 15, NodeId("other"): other}
        d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.0), NOW)
        assert d is not None
        return d.node_id, d.reason

    # nobody else holds any of it, and the idle node would answer later (loss 0.96 s >
    # the holder's penalty, decode_s x 0.25)
    assert pick(0) == ("holder", RouteReason.CACHE_HIT)
    assert pick(15) == ("idle", RouteReason.EXPLORATION)  # another holder of all of it
    assert pick(14) == ("idle", RouteReason.EXPLORATION)  # one block beyond: 0.064 s
    # two blocks beyond (0.128 s), 5 blocks (0.32 s): a context of its own, and the idle
    # node would answer later (loss 0.96 s > the holder's penalty, decode_s x 0.25)
    assert pick(13) == ("holder", RouteReason.CACHE_HIT)
    assert pick(10) == ("holder", RouteReason.CACHE_HIT)
    # the holder's penalty 1.5 s (KV 0.5) >= the loss plus the idle node's (0 or 0.3 s)
    t.report(NodeId("holder"), waiting=0, running=4, kv_util=0.5, now=NOW)
    assert pick(10) == ("idle", RouteReason.EXPLORATION)
    assert pick(0) == ("idle", RouteReason.EXPLORATION)
    t.report(NodeId("idle"), waiting=0, running=4, kv_util=0.1, now=NOW)
    assert pick(10) == ("idle", RouteReason.EXPLORATION)
    t.report(NodeId("idle"), waiting=0, running=4, kv_util=0.2, now=NOW)  # 0.96 + 0.6 > 1.5
    assert pick(10) == ("holder", RouteReason.CACHE_HIT)


def test_an_idle_winner_keeps_a_hit_no_other_node_holds_in_full() -> None:
    """Nobody waits for an idle holder's hit: a first copy or a match longer than any
    other node's stays (on a quiet cluster, a chat session's next turn), in either
    form; a prefix another node holds in full still warms an idle node; once the
    holder is busy, the first copy is explored again (in the ttft form, once its first
    token there would come no sooner than at the idle node)."""
    for form in ("ttft", "brief"):
        t, c = table({"holder": (0, 0.1), "other": (0, 0.1), "idle": (0, 0.0)})
        p = KvgatePolicy(
            form=form, epsilon=1.0, prefill_tokens_per_s=1000.0, attention_s_per_pair=0.0,
            explore_max_loss_s=1.0, affinity_min_gain_s=0.1,
        )

        def pick(other: int) -> tuple[str, RouteReason]:
            m = {NodeId("holder"): 15, NodeId("other"): other}
            d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.0), NOW)  # noqa: B023
            assert d is not None
            return d.node_id, d.reason

        assert pick(0) == ("holder", RouteReason.CACHE_HIT), form  # a first copy
        assert pick(14) == ("holder", RouteReason.CACHE_HIT), form  # one block longer
        assert pick(15) == ("idle", RouteReason.EXPLORATION), form  # held in full elsewhere
        t.on_sent(c[0], now=NOW, key=1, prefill_tokens=0, context_tokens=500)  # now busy
        if form == "brief":
            assert pick(0) == ("idle", RouteReason.EXPLORATION), form
            continue
        # a request in flight is not enough: the copy's prefill (0.96 s) would come after
        # the holder's first token (penalty 0.01 s); 1 s of prefill queued there is
        assert pick(0) == ("holder", RouteReason.CACHE_HIT), form
        t.on_sent(c[0], now=NOW, key=2, prefill_tokens=1000)
        assert pick(0) == ("idle", RouteReason.EXPLORATION), form


def test_ttft_form_explores_a_busy_but_less_loaded_node_with_a_shared_prefix() -> None:
    """No node is idle, but "light" (requests in flight, a light decode batch) misses
    the system prompt every other node holds (one tenant's flood, confined there,
    started before the prompt spread): the slack would keep every request on the
    holders, and "light" would never get the prompt nor anybody's sessions.
    A hit on a prefix other nodes hold goes to the least loaded non-holder when its
    first token comes no later (penalty + the lost prefill <= the winner's penalty);
    not a session's own context, not a new session the spread placed, not with
    explore_busy off."""
    t, c = table({"h1": (0, 0.5), "h2": (0, 0.5), "light": (0, 0.1)})
    t.on_sent(c[2], now=NOW, key=1, prefill_tokens=0, context_tokens=500)  # in flight
    kw: dict[str, float] = {
        "epsilon": 1.0, "prefill_tokens_per_s": 1000.0, "attention_s_per_pair": 0.0,
        "affinity_min_gain_s": 0.03, "session_min_shared_s": 1.0,
    }
    # a 256-token system prompt on both holders: 5 x 0.256 s saved beats the penalties
    # difference (1.5 s against light's 0.3 s + 500 x 1.74e-5), so a holder wins the score
    prompt = {NodeId("h1"): 4, NodeId("h2"): 4}

    def pick(p: KvgatePolicy, m: dict[NodeId, int]) -> tuple[str, RouteReason]:
        d = p.select(ctx(blocks=8), c, m, t, FixedRng(0.0), NOW)
        assert d is not None
        return d.node_id, d.reason

    # light answers no later: 0.31 s + the 0.256 s lost <= 1.5 s
    assert pick(KvgatePolicy(**kw), prompt) == ("light", RouteReason.EXPLORATION)
    assert pick(KvgatePolicy(explore_busy=False, **kw), prompt) == ("h1", RouteReason.SPREAD)
    # a context of its own (3 blocks beyond the prompt, 0.19 s) stays with its holder
    own = {NodeId("h1"): 7, NodeId("h2"): 4}
    assert pick(KvgatePolicy(**kw), own) == ("h1", RouteReason.CACHE_HIT)
    # a loaded non-holder (1.2 s of prefill queued) would answer later: no move
    t.on_sent(c[2], now=NOW, key=2, prefill_tokens=1200)
    assert pick(KvgatePolicy(**kw), prompt)[0] == "h1"
    # a shared prefix long enough to start a session is the spread's to place
    t.on_prefilled(c[2], 2, now=NOW)
    shared_kw = kw | {"session_min_shared_s": 0.05}
    assert pick(KvgatePolicy(**shared_kw), prompt) == ("h1", RouteReason.SPREAD)


def test_ttft_form_exploration_of_a_context_counts_the_idle_nodes_own_cache() -> None:
    """The no-later clause charges the blocking cost of the whole prefill at the idle
    node: an idle node whose cache has been serving hits (its sessions come back to it)
    does not take a session's context, one whose cache serves nothing does."""
    t, c = table({"holder": (0, 0.2), "other": (0, 0.2), "idle": (0, 0.0)})
    t.report(NodeId("holder"), waiting=0, running=4, kv_util=0.5, now=NOW)  # penalty 1.5 s
    p = KvgatePolicy(
        epsilon=1.0, prefill_tokens_per_s=1000.0, attention_s_per_pair=0.0,
        explore_max_loss_s=1.0, affinity_min_gain_s=0.1,
        blocking_cost=3.0, blocking_min_s=100.0, cache_value_tau_s=30.0,
    )
    m = {NodeId("holder"): 15, NodeId("other"): 10}  # 5 blocks of its own: a context
    d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.0), NOW)
    assert d is not None and (d.node_id, d.reason) == ("idle", RouteReason.EXPLORATION)
    for i in range(5):  # the idle node's cache serves hits (no exploration: draw 0.9)
        hit = p.select(ctx(blocks=40), c, {NodeId("idle"): 40}, t, FixedRng(0.9), NOW + i)
        assert hit is not None and hit.node_id == "idle"
    assert p._cache_value.rate(NodeId("idle"), NOW + 5) > 0
    d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.0), NOW + 5)
    assert d is not None and (d.node_id, d.reason) == ("holder", RouteReason.CACHE_HIT)
    # without the blocking cost the clause lets it go
    p.blocking_cost = 0.0
    d = p.select(ctx(blocks=40), c, m, t, FixedRng(0.0), NOW + 5)
    assert d is not None and (d.node_id, d.reason) == ("idle", RouteReason.EXPLORATION)


def test_ttft_form_puts_a_long_prefill_where_it_blocks_the_least_used_cache() -> None:
    """Two equal idle nodes, but "busy" has been serving hits and "quiet" has not: a
    prompt nobody holds whose prefill takes >= blocking_min_s goes to "quiet" (the lower
    slot, "busy", wins any tie); a short one still takes the tie-break."""
    t, c = table({"busy": (0, 0.0), "quiet": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=1000.0, decode_s=0.0, attention_s_per_pair=0.0,
        blocking_cost=3.0, blocking_min_s=1.0, cache_value_tau_s=30.0,
    )
    assert p.select(ctx(blocks=20), c, {}, t, FixedRng(0.9), NOW).node_id == "busy"  # type: ignore[union-attr]
    for i in range(5):  # hits on "busy" (nothing is sent: the load stays equal)
        d = p.select(ctx(blocks=20), c, {NodeId("busy"): 20}, t, FixedRng(0.9), NOW + i * 0.1)
        assert d is not None and d.node_id == "busy"
    assert p._cache_value.rate(NodeId("busy"), NOW + 0.4) > 0
    assert p._cache_value.rate(NodeId("quiet"), NOW + 0.4) == 0
    long = p.select(ctx(blocks=20), c, {}, t, FixedRng(0.9), NOW + 0.5)  # 1.28 s uncached
    assert long is not None and long.node_id == "quiet"
    short = p.select(ctx(blocks=10), c, {}, t, FixedRng(0.9), NOW + 0.5)  # 0.64 s: no rescoring
    assert short is not None and short.node_id == "busy"
    # without the blocking cost the long one takes the tie-break too
    p0 = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=1000.0, decode_s=0.0, attention_s_per_pair=0.0,
        blocking_cost=0.0,
    )
    assert p0.select(ctx(blocks=20), c, {}, t, FixedRng(0.9), NOW + 0.5).node_id == "busy"  # type: ignore[union-attr]


def test_ttft_form_can_weigh_the_decode_batch_contexts() -> None:
    """With decode_s_per_context_token, the prompt tokens of our requests in flight on a
    node count against it (each decode step attends over them); 0 turns it off."""
    t, c = table({"a": (0, 0.0), "b": (0, 0.0)})
    t.on_sent(c[0], now=NOW, context_tokens=100_000)  # in flight, past its prefill
    t.on_sent(c[1], now=NOW, context_tokens=0)  # the same queue on both
    assert c[0].inflight_context_tokens == 100_000
    off = KvgatePolicy(epsilon=0, decode_s=0.0, kv_pressure_s=0.0, decode_s_per_context_token=0)
    on = KvgatePolicy(epsilon=0, decode_s=0.0, kv_pressure_s=0.0, decode_s_per_context_token=1e-5)
    m = {NodeId("a"): 20, NodeId("b"): 20}  # both hold the prefix
    d = off.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "a"  # a tie: the lower slot
    d = on.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "b" and d.parts["penalty"] == 0.0
    d = on.select(ctx(blocks=20), c[:1], m, t, FixedRng(0.9), NOW)
    assert d is not None and d.parts["penalty"] == pytest.approx(1.0)  # 1e5 x 1e-5 s
    t.on_done(c[0], sent_at=NOW, now=NOW, context_tokens=100_000)
    t.on_sent(c[0], now=NOW, context_tokens=0)
    assert c[0].inflight_context_tokens == 0
    d = on.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "a"


def test_cache_value_decays_and_forgets() -> None:
    v = DecayedSeconds(tau_s=10.0)
    v.add(NodeId("a"), 5.0, now=0.0)
    assert v.rate(NodeId("a"), 0.0) == pytest.approx(0.5)
    assert v.rate(NodeId("a"), 10.0) == pytest.approx(0.5 / 2.718281828, rel=1e-6)
    assert v.rate(NodeId("a"), -1.0) == pytest.approx(0.5)  # time moving back: no growth
    v.add(NodeId("a"), 5.0, now=10.0)
    assert v.rate(NodeId("a"), 10.0) == pytest.approx(0.5 / 2.718281828 + 0.5, rel=1e-6)
    for i in range(DecayedSeconds._MAX_NODES + 1):  # bounded: decayed entries are dropped
        v.add(NodeId(f"n{i}"), 1.0, now=float(i))
    assert len(v._saved) <= DecayedSeconds._MAX_NODES + 1


def test_ttft_form_counts_attention_work_of_long_prompts() -> None:
    """Prefill time grows with the square of a long prompt (workloads.md 3.2's c term)."""
    t, c = table({"a": (0, 0.0)})
    p = KvgatePolicy(
        epsilon=0, prefill_tokens_per_s=10_000.0, decode_s=0.0, attention_s_per_pair=1e-8
    )
    d = p.select(ctx(blocks=200), c, {NodeId("a"): 100}, t, FixedRng(0.9), NOW)
    assert d is not None
    h = 100 * 64
    assert d.parts["bonus"] == pytest.approx(h / 10_000 + 1e-8 * h * h / 2)
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=1000, prefill_pairs=1000 * 500.0)
    d = p.select(ctx(blocks=200), c, {}, t, FixedRng(0.9), NOW)
    assert d is not None and d.parts["penalty"] == pytest.approx(0.1 + 1e-8 * 500_000)


# --- the tail guard ----------------------------------------------------------------------

# a 1000 tokens/s prefill and nothing else: predicted first token = wait + prefill left
GUARD_KW: dict[str, float] = {
    "epsilon": 0, "prefill_tokens_per_s": 1000.0, "cache_gain": 5.0, "decode_s": 0.0,
    "attention_s_per_pair": 0.0, "blocking_cost": 0.0, "kv_pressure_s": 0.0,
    "decode_s_per_context_token": 0.0, "affinity_slack_s": 10.0, "tail_quantile": 0.9,
    "tail_window": 4,
}


def test_tail_level_is_the_quantile_of_the_last_window() -> None:
    level = TailLevel(quantile=0.5, window=4)
    # fewer than a window seen: no tail yet
    assert [level.observe(s) for s in (4.0, 1.0, 3.0, 2.0)] == [float("inf")] * 4
    assert level.observe(0.5) == 3.0  # of 1, 2, 3, 4; then 4.0, the oldest, leaves
    assert level.observe(9.0) == 2.0  # of 0.5, 1, 2, 3


def test_tail_guard_moves_a_request_its_cache_wait_would_make_one_of_the_slowest() -> None:
    """The score keeps a half-cached 20-block prompt (1.28 s of prefill, 0.64 s of it
    cached) on its holder behind 3 s of queue: 5 x 0.64 - 3 = 0.2 against the idle
    node's 0, a first token at 3.64 s against 1.28 s. Once the policy has seen a window
    of requests (the level: 1.92 s, the full prefill of its 30-block ones), 3.64 s is
    past it and 1.28 s is not: the idle node takes it. Before the window is full, and
    with the guard off, the holder keeps it."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=3000)
    m = {NodeId("holder"): 10}
    for quantile, want in ((0.9, ["holder", "idle", "idle"]), (0.0, ["holder"] * 3)):
        p = KvgatePolicy(**{**GUARD_KW, "tail_quantile": quantile})
        for _ in range(3):  # three 30-block requests nobody holds
            p.select(ctx(blocks=30), c, {}, t, FixedRng(0.9), NOW)
        got = [p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW) for _ in range(3)]
        assert [d.node_id for d in got if d is not None] == want, quantile
    p = KvgatePolicy(**GUARD_KW)
    for _ in range(4):
        p.select(ctx(blocks=30), c, {}, t, FixedRng(0.9), NOW)
    moved = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert moved is not None and moved.node_id == "idle" and moved.reason is RouteReason.LOAD
    assert moved.matched_blocks == 0 and moved.best_matched_blocks == 10
    assert moved.score == 0.0 and moved.parts["bonus"] == 0.0


def test_tail_guard_prefers_a_holder_under_the_level_and_spares_long_prompts() -> None:
    """"deep" (15 blocks, 6 s queued) keeps a 20-block prompt by the affinity slack,
    its first token at 6.32 s; the level is 1.92 s. Under it: "mid" (10 blocks, 1 s
    queued: 1.64 s, score 2.2) and the idle node (1.28 s, score 0): "mid" takes it. A
    100-block prompt (6.4 s of prefill anywhere) is one of the slowest wherever it
    goes: the guard leaves its decision alone."""
    t, c = table({"deep": (0, 0.0), "mid": (0, 0.0), "idle": (0, 0.0)})
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=6000)
    t.on_sent(c[1], now=NOW, key=2, prefill_tokens=1000)
    m = {NodeId("deep"): 15, NodeId("mid"): 10}
    guarded = KvgatePolicy(**GUARD_KW)
    unguarded = KvgatePolicy(**{**GUARD_KW, "tail_quantile": 0.0})
    for p in (guarded, unguarded):
        for _ in range(4):
            p.select(ctx(blocks=30), c, {}, t, FixedRng(0.9), NOW)
    d = unguarded.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "deep"
    d = guarded.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "mid" and d.matched_blocks == 10
    assert d.score == pytest.approx(5 * 0.64 - 1.0)
    long_prompt = {NodeId("deep"): 60, NodeId("mid"): 10}
    want = unguarded.select(ctx(blocks=100), c, long_prompt, t, FixedRng(0.9), NOW)
    got = guarded.select(ctx(blocks=100), c, long_prompt, t, FixedRng(0.9), NOW)
    assert got == want and got is not None and got.node_id == "deep"


def test_ttft_target_moves_a_request_its_holder_would_keep_past_it() -> None:
    """The same half-cached 20-block prompt behind 3 s of queue at its holder (first
    token at 3.64 s; the idle node's at 1.28 s). With no tail window yet, a TTFT target
    of 2 s moves it at once; a target of 4 s, which the holder meets, does not, nor does
    no target. A 40-block prompt (2.56 s of prefill anywhere) misses a 2 s target
    wherever it goes: its decision is left alone."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=3000)
    m = {NodeId("holder"): 10}
    for target, want in ((2.0, "idle"), (4.0, "holder"), (0.0, "holder")):
        p = KvgatePolicy(**{**GUARD_KW, "tail_quantile": 0.0, "ttft_target_s": target})
        d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
        assert d is not None and d.node_id == want, target
    p = KvgatePolicy(**{**GUARD_KW, "ttft_target_s": 2.0})  # the tail guard on, no window
    d = p.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "idle" and d.matched_blocks == 0
    long_m = {NodeId("holder"): 20}
    d = p.select(ctx(blocks=40), c, long_m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "holder"


def test_a_requests_own_ttft_target_moves_it_like_the_policys() -> None:
    """The controller gives a P0 request what is left of the P0 TTFT SLO
    (``RouteContext.ttft_target_s``): the same half-cached prompt behind its holder's 3 s
    queue goes to the idle node under a 2 s target of its own, stays under 4 s or none;
    the lower of the policy's target and the request's counts."""
    t, c = table({"holder": (0, 0.0), "idle": (0, 0.0)})
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=3000)
    m = {NodeId("holder"): 10}
    p = KvgatePolicy(**{**GUARD_KW, "tail_quantile": 0.0})
    for target, want in ((2.0, "idle"), (4.0, "holder"), (0.0, "holder")):
        d = p.select(ctx(blocks=20, ttft_target_s=target), c, m, t, FixedRng(0.9), NOW)
        assert d is not None and d.node_id == want, target
    lax = KvgatePolicy(**{**GUARD_KW, "tail_quantile": 0.0, "ttft_target_s": 10.0})
    d = lax.select(ctx(blocks=20, ttft_target_s=2.0), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "idle"
    strict = KvgatePolicy(**{**GUARD_KW, "tail_quantile": 0.0, "ttft_target_s": 2.0})
    d = strict.select(ctx(blocks=20, ttft_target_s=10.0), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "idle"
    # with every other rule that looks past the score off, the target alone still weighs
    # the holders under it: "deep" wins the score (5 x 1.216 - 3 s) with its first token
    # at 3.06 s; under 1.7 s "mid" (1.64 s, score 2.2) beats the idle node (1.28 s, 0)
    t, c = table({"deep": (0, 0.0), "mid": (0, 0.0), "idle": (0, 0.0)})
    t.on_sent(c[0], now=NOW, key=1, prefill_tokens=3000)
    t.on_sent(c[1], now=NOW, key=2, prefill_tokens=1000)
    bare = KvgatePolicy(
        **{**GUARD_KW, "tail_quantile": 0.0, "affinity_slack_s": 0.0},
        session_spread_s=0.0, fleet_home_s=0.0,
    )
    m = {NodeId("deep"): 19, NodeId("mid"): 10}
    assert bare.select(ctx(blocks=20), c, m, t, FixedRng(0.9), NOW).node_id == "deep"  # type: ignore[union-attr]
    d = bare.select(ctx(blocks=20, ttft_target_s=1.7), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "mid" and d.matched_blocks == 10


# --- the new-session spread --------------------------------------------------------------

# a 1000 tokens/s prefill and nothing else: equally loaded nodes score alike
SPREAD_KW: dict[str, float] = {
    "epsilon": 0,
    "prefill_tokens_per_s": 1000.0,
    "decode_s": 0.0,
    "attention_s_per_pair": 0.0,
    "blocking_cost": 0.0,
    "kv_pressure_s": 0.0,
    "decode_s_per_context_token": 0.0,
    "tail_quantile": 0.0,
}


def _routed(p: KvgatePolicy, t: NodeTable, c: list[NodeState], m: dict, blocks: int) -> str:
    d = p.select(ctx(blocks=blocks), c, m, t, FixedRng(0.9), NOW)
    assert d is not None
    return str(d.node_id)


def _home(block: int, names: str) -> str:
    """The fleet home of ``block`` among ``names``: the highest xxh3 of (block, node)."""
    return max(names, key=lambda n: xxh3_64_intdigest(f"{block}\0{n}".encode()))


def test_in_a_fleet_a_new_session_goes_to_its_prefix_home_whatever_the_gateway() -> None:
    """Two gateways of a fleet, each with its own policy and its own history, agree
    where a new session goes without a word. A 14-block prompt whose first 5 blocks (a
    system prompt, 0.32 s of prefill) three equally loaded nodes hold goes to the home
    of block 5, its first block past the shared part ("b"); a prompt nobody holds, to
    the home of block 0 ("c"). Alone, the spread sends a gateway's first session to
    "a" (the lowest slot) and its next to where it has sent least. A home whose first
    token would come more than fleet_home_s after the winner's gives way to the next
    node in rank; a session's own context (one holder deeper) stays with its holder."""
    t, c = table({"a": (0, 0.0), "b": (0, 0.0), "c": (0, 0.0)})
    shared = {NodeId(n): 5 for n in "abc"}
    assert (_home(5, "abc"), _home(0, "abc"), _home(5, "ac")) == ("b", "c", "c")
    fleet = ctx(blocks=14, fleet=True)
    for p in (KvgatePolicy(**SPREAD_KW), KvgatePolicy(**SPREAD_KW)):  # two gateways
        got = [p.select(fleet, c, m, t, FixedRng(0.9), NOW) for m in (shared, {})]
        assert [d.node_id for d in got if d is not None] == ["b", "c"]
    alone = KvgatePolicy(**SPREAD_KW)
    assert [_routed(alone, t, c, m, 14) for m in (shared, {})] == ["a", "b"]
    # the home busy (1 s of prefill queued, past fleet_home_s): the next node in rank
    t.on_sent(c[1], now=NOW, key=1, prefill_tokens=1000)
    d = KvgatePolicy(**SPREAD_KW).select(fleet, c, shared, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "c"
    # a session's own context, one holder deeper: its holder, as alone
    own = {**shared, NodeId("a"): 14}
    d = KvgatePolicy(**SPREAD_KW).select(fleet, c, own, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "a"


def test_new_sessions_on_a_shared_prefix_go_where_sessions_worked_least() -> None:
    """Three equally loaded nodes hold a 10-block system prompt (640 tokens, 0.64 s of
    prefill). The score alone sends every new session to the lowest slot; the spread
    counts each new session's expected work (4 s) where it went, so the next ones go to
    the others. A continuation (a longer match only one node holds) is no new session,
    nor is a request sharing only 2 blocks (0.13 s, under session_min_shared_s)."""
    t, c = table({"a": (0, 0.0), "b": (0, 0.0), "c": (0, 0.0)})
    shared = {NodeId(n): 10 for n in "abc"}
    spread = KvgatePolicy(**SPREAD_KW)
    plain = KvgatePolicy(**{**SPREAD_KW, "session_spread_s": 0.0})
    assert [_routed(spread, t, c, shared, 14) for _ in range(3)] == ["a", "b", "c"]
    assert [_routed(plain, t, c, shared, 14) for _ in range(3)] == ["a", "a", "a"]
    # a continuation: "b" alone holds the session's 14 blocks
    continuation = {**shared, NodeId("b"): 14}
    assert _routed(spread, t, c, continuation, 20) == "b"
    short = {NodeId(n): 2 for n in "abc"}
    fresh = KvgatePolicy(**SPREAD_KW)
    assert [_routed(fresh, t, c, short, 14) for _ in range(2)] == ["a", "a"]


@pytest.mark.parametrize(
    ("queued", "shared_order"), [(2000, ["a", "c", "a"]), (750, ["a", "c", "b"])]
)
def test_the_spread_keeps_to_nodes_about_as_soon_and_spreads_cold_requests_too(
    queued: int, shared_order: list[str]
) -> None:
    """"b" has 2 s of prefill queued, past session_spread_shared_s (1 s) of the winner's
    first token, so new sessions on a shared prefix (an agent's tool preamble) alternate
    between "a" and "c"; with 0.75 s queued it is within that window, and they take "b"
    in turn once the idle nodes have sessions of their own. A request no node holds
    anything of spreads the same way over the non-holders within session_spread_s
    (0.5 s): "b" is past it either way."""
    t, c = table({"a": (0, 0.0), "b": (0, 0.0), "c": (0, 0.0)})
    t.on_sent(c[1], now=NOW, key=1, prefill_tokens=queued)
    shared = {NodeId(n): 10 for n in "abc"}
    p = KvgatePolicy(**SPREAD_KW)
    assert [_routed(p, t, c, shared, 14) for _ in range(3)] == shared_order
    cold = KvgatePolicy(**SPREAD_KW)
    assert [_routed(cold, t, c, {}, 14) for _ in range(3)] == ["a", "c", "a"]
    # one window for both: shared prefixes keep to "a" and "c" too
    narrow = KvgatePolicy(**{**SPREAD_KW, "session_spread_shared_s": 0.5})
    assert [_routed(narrow, t, c, shared, 14) for _ in range(3)] == ["a", "c", "a"]


@pytest.mark.parametrize("form", ["brief", "ttft"])
def test_a_holder_at_its_capacity_loses_its_bonus(form: str) -> None:
    """Running or waiting as many requests as it serves well, a holder's cache does not
    pull more: its queue says nothing of the decodes it runs."""
    # the queue breaker out of the way: only the capacity rule is left to trip
    p = KvgatePolicy(form=form, epsilon=0, breaker_open_queue=10_000)  # type: ignore[arg-type]
    t, c = table({"holder": (0, 0.2), "other": (0, 0.2)})
    m = {NodeId("holder"): 100}
    capacity = c[0].spec.capacity
    t.report(NodeId("holder"), waiting=0, running=capacity - 1, kv_util=0.2, now=NOW)
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "holder" and d.reason is RouteReason.CACHE_HIT
    t.report(NodeId("holder"), waiting=1, running=capacity - 1, kv_util=0.2, now=NOW)
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "other" and d.reason is RouteReason.BREAKER
    # our own requests in flight count too, whatever the node last reported
    t.report(NodeId("holder"), waiting=0, running=0, kv_util=0.2, now=NOW)
    for i in range(capacity):
        t.on_sent(c[0], now=NOW, key=f"r{i}", prefill_tokens=0, prefill_pairs=0.0)
    d = p.select(ctx(), c, m, t, FixedRng(0.9), NOW)
    assert d is not None and d.node_id == "other"
