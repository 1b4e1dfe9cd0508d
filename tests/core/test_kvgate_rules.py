"""The kvgate policy's placement rules and exploration helpers, called directly on
hand-set loads (the policy's own tests reach them through ``select``)."""

from __future__ import annotations

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec, NodeState, NodeTable
from kvgate.core.routing.kvgate_explore import least_loaded, most_idle, no_later_at, shared_hit
from kvgate.core.routing.kvgate_loads import Load, LoadScores, Params
from kvgate.core.routing.kvgate_rules import spread_session, within_slack

# the ttft form, 1 000 prefill tokens/s, no attention term, nothing else weighed
PARAMS: Params = (1.0, 32, 0.3, 5.0, True, 1000.0, 0.0, 0.0, 0.0, 0.0)
SLACK = {"slack_s": 20.0, "min_gain_s": 0.03, "short_gain_s": 0.25, "short_slack_s": 4.0}


def loads(**penalties: float) -> dict[str, Load]:
    """One Load per name, in slot order, with the given penalty (and wait)."""
    t = NodeTable(stale_after_s=5.0)
    out = {}
    for name, penalty in penalties.items():
        state = t.add(NodeSpec(node_id=NodeId(name)))
        load = Load(state, 0, 0.0, PARAMS, 0.0)
        load.penalty = load.wait = penalty
        out[name] = load
    return out


def uncached_s(prompt: int, cached: int) -> float:
    return (prompt - min(cached, prompt)) / 1000.0


def test_the_slack_keeps_the_holder_that_saves_most_within_its_window() -> None:
    ld = loads(win=0.0, a=10.0, b=15.0, far=30.0)
    holders = [(ld["a"], 2.0), (ld["b"], 3.0), (ld["far"], 9.0)]
    # b saves the most within 20 s of the winner's predicted TTFT (far is 21 s later)
    kept = within_slack(ld["win"], 0.0, holders, {}, 99.0, **SLACK)
    assert kept == (ld["b"], 3.0)
    # the bounded wait: nothing past `latest` (penalty less bonus) is held to
    kept = within_slack(ld["win"], 0.0, holders, {}, 11.0, **SLACK)
    assert kept == (ld["a"], 2.0)
    # a blocking cost on b counts in its predicted TTFT
    kept = within_slack(ld["win"], 0.0, holders, {NodeId("b"): 9.0}, 99.0, **SLACK)
    assert kept == (ld["a"], 2.0)


def test_a_short_gain_waits_only_the_short_window_and_a_sliver_not_at_all() -> None:
    ld = loads(win=0.0, near=3.0, late=6.0)
    # 0.2 s more than the winner saves: a short gain, held only within 4 s
    assert within_slack(ld["win"], 0.0, [(ld["late"], 0.2)], {}, 99.0, **SLACK) is None
    assert within_slack(ld["win"], 0.0, [(ld["near"], 0.2)], {}, 99.0, **SLACK) == (
        ld["near"],
        0.2,
    )
    # at most the minimum gain beyond the winner's bonus: not worth any wait
    assert within_slack(ld["win"], 0.5, [(ld["near"], 0.53)], {}, 99.0, **SLACK) is None


def test_a_holder_under_kv_pressure_is_not_held_to() -> None:
    ld = loads(win=0.0, hot=1.0)
    ld["hot"].util = 0.9
    assert within_slack(ld["win"], 0.0, [(ld["hot"], 5.0)], {}, 99.0, **SLACK) is None


def test_a_new_session_goes_where_recent_work_is_least_within_the_window() -> None:
    ld = loads(win=0.0, near=0.4, busy=0.1, far=0.9)
    scores = LoadScores()
    scores.order = sorted(ld[n].rank for n in ld)
    cands = frozenset(load.state for load in ld.values())
    work = {"win": 3.0, "near": 0.5, "busy": 2.0, "far": 0.0}
    top = spread_session(
        scores, cands, {}, [], (ld["win"], 0.0), 0, 4096, 64, 0.0,
        window_s=0.5,
        shared_window_s=1.0,
        min_shared_s=0.25,
        saved_s=lambda p, c: uncached_s(p, 0) - uncached_s(p, c),
        recent_work=lambda nid, now: work[nid],
    )  # fmt: skip
    assert top == (ld["near"], 0.0)  # "far" has less work but is 0.9 s later


def test_a_shared_prefix_held_by_one_node_alone_is_no_new_session() -> None:
    ld = loads(win=0.0, other=0.1)
    cands = frozenset(load.state for load in ld.values())
    common = {
        "window_s": 0.5,
        "shared_window_s": 1.0,
        "min_shared_s": 0.25,
        "saved_s": lambda p, c: uncached_s(p, 0) - uncached_s(p, c),
        "recent_work": lambda nid, now: 0.0,
    }
    m = {NodeId("win"): 8}  # 512 tokens: 0.512 s of prefill, a shared prefix's size
    one = [(ld["win"], 0.512)]
    assert spread_session(LoadScores(), cands, m, one, one[0], 8, 4096, 64, 0.0, **common) is None
    m2 = {NodeId("win"): 8, NodeId("other"): 8}
    two = [(ld["win"], 0.512), (ld["other"], 0.512)]
    top = spread_session(LoadScores(), cands, m2, two, two[0], 8, 4096, 64, 0.0, **common)
    assert top == two[0]  # both within the window, equal work: the sooner first token


def test_shared_hit_tells_a_shared_prefix_from_a_context_of_its_own() -> None:
    kw = {"ttft": True, "min_gain_s": 0.03, "uncached_s": uncached_s}
    # the winner holds 1 block (64 tokens, 0.064 s) beyond the other's 10: its own
    assert not shared_hit(1000, 64, 11, 10, **kw)
    assert shared_hit(1000, 64, 10, 10, **kw)
    # a first copy: the ttft form holds it to the no-later clause, the brief copies it
    assert not shared_hit(1000, 64, 10, 0, **kw)
    assert shared_hit(1000, 64, 10, 0, **{**kw, "ttft": False})


def test_no_later_counts_the_lost_hit_and_the_blocking_cost() -> None:
    ld = loads(idle=0.0, best=2.0)
    assert no_later_at(ld["idle"], ld["best"], 1.5, 1000, 0.0, lambda p, c, n, now: 0.5)
    assert not no_later_at(ld["idle"], ld["best"], 1.5, 1000, 0.0, lambda p, c, n, now: 0.6)


def test_idle_and_least_loaded_skip_holders() -> None:
    ld = loads(h=0.0, a=2.0, b=1.0)
    states: list[NodeState] = [ld[n].state for n in ("h", "a", "b")]
    by_id = {load.node_id: load for load in ld.values()}
    m = {NodeId("h"): 4}
    least = least_loaded(states, m, by_id)
    assert least is not None and least.spec.node_id == "b"
    ld["a"].util, ld["b"].util = 0.1, 0.3  # b is over the idle utilisation
    idle = most_idle(states, m, by_id, 0, 0.2)
    assert idle is not None and idle.spec.node_id == "a"
    ld["a"].queue = 1
    assert most_idle(states, m, by_id, 0, 0.2) is None
