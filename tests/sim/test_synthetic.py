"""Synthetic workloads: prefix-sharing structure, determinism, arrival rates, classes."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise

import pytest

from kvgate.sim.synthetic import (
    agent_loops,
    bursty,
    constant,
    multi_turn_chat,
    poisson,
    shared_prefix_groups,
    zipf_prefixes,
)
from kvgate.sim.synthetic_blocks import Segment, chained_block_hashes, segment_key
from kvgate.sim.synthetic_random import Categorical, zipf
from kvgate.sim.workload import SimRequest, Workload, assign_classes, ideal_hit_ratio

Gen = Callable[..., Workload]
GENERATORS: list[Gen] = [shared_prefix_groups, multi_turn_chat, agent_loops, zipf_prefixes]


def _shared(a: SimRequest, b: SimRequest) -> int:
    n = 0
    for x, y in zip(a.block_ids, b.block_ids, strict=False):
        if x != y:
            break
        n += 1
    return n


def _check_shape(w: Workload) -> None:
    bt = w.block_tokens
    for r in w.requests:
        assert len(r.block_ids) == -(-r.prompt_tokens // bt)
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and times[0] == 0.0
    seen = -1
    for r in w.requests:  # ids remapped to 0, 1, 2, ... in order of first appearance
        for b in r.block_ids:
            assert b <= seen + 1
            seen = max(seen, b)


# --- block content model ---------------------------------------------------------------


def test_chained_hashes_follow_token_content() -> None:
    a, b, c = segment_key("a"), segment_key("b"), segment_key("c")
    base = chained_block_hashes([Segment(a, 1000)], 512)
    longer = chained_block_hashes([Segment(a, 1000), Segment(b, 100)], 512)
    other = chained_block_hashes([Segment(a, 1000), Segment(c, 100)], 512)
    assert len(base) == 2 and len(longer) == 3
    assert longer[0] == base[0] and longer[1] != base[1]  # partial block 1 was filled
    assert longer[0] == other[0] and longer[1] != other[1]  # block 1 holds a and b / c
    full = chained_block_hashes([Segment(a, 1024), Segment(b, 10)], 512)
    assert full[:2] == chained_block_hashes([Segment(a, 1024), Segment(c, 10)], 512)[:2]
    split = chained_block_hashes([Segment(a, 512), Segment(b, 512)], 512)
    assert split[0] == base[0] and split[1] != longer[1]
    assert chained_block_hashes([], 512) == []


def test_block_ids_do_not_depend_on_pythonhashseed() -> None:
    code = (
        "import random; from kvgate.sim.synthetic import multi_turn_chat as m; "
        "w = m(rng=random.Random(3), num_sessions=20); "
        "print(hash(tuple(b for r in w.requests for b in r.block_ids)), "
        "[r.request_id for r in w.requests][-1])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


# --- generators ------------------------------------------------------------------------


def test_shared_prefix_groups_structure() -> None:
    w = shared_prefix_groups(rng=random.Random(1))
    _check_shape(w)
    assert len(w.requests) == 64 * 16
    assert {r.prompt_tokens for r in w.requests} == {2048 + 128}
    assert {r.output_tokens for r in w.requests} == {256}
    groups: dict[int, list[SimRequest]] = {}
    for r in w.requests:
        groups.setdefault(r.block_ids[0], []).append(r)
    assert len(groups) == 64 and all(len(g) == 16 for g in groups.values())
    for g in groups.values():
        assert all(_shared(g[0], r) == 4 for r in g[1:])  # exactly the 4 system blocks
    firsts = [g[0] for g in groups.values()]
    assert all(_shared(firsts[0], r) == 0 for r in firsts[1:])
    assert ideal_hit_ratio(w) == pytest.approx(64 * 15 * 4 / (1024 * 5))
    # interleaved by default, group after group when ordered
    runs = sum(a.block_ids[0] != b.block_ids[0] for a, b in pairwise(w.requests))
    assert runs > 500
    ordered = shared_prefix_groups(rng=random.Random(1), ordered=True)
    assert sum(a.block_ids[0] != b.block_ids[0] for a, b in pairwise(ordered.requests)) == 63


def test_shared_prefix_groups_range_ratio() -> None:
    w = shared_prefix_groups(rng=random.Random(2), num_groups=4, range_ratio=0.5)
    assert all(64 <= r.output_tokens <= 256 for r in w.requests)
    assert len({r.output_tokens for r in w.requests}) > 10


def test_multi_turn_chat_turns_extend_previous_turn() -> None:
    w = multi_turn_chat(rng=random.Random(4), num_sessions=40)
    _check_shape(w)
    sessions: dict[str, list[SimRequest]] = {}
    for r in w.requests:
        assert r.session is not None
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 40
    assert all(3 <= len(s) <= 8 for s in sessions.values())
    firsts = [s[0] for s in sessions.values()]
    assert all(r.block_ids[:2] == firsts[0].block_ids[:2] for r in firsts)  # 1024-token system
    for turns in sessions.values():
        for prev, cur in pairwise(turns):
            full = prev.prompt_tokens // 512
            assert cur.block_ids[:full] == prev.block_ids[:full]
            assert _shared(prev, cur) == full  # the partial last block is not shared
            user = cur.prompt_tokens - prev.prompt_tokens - prev.output_tokens
            assert 100 <= user <= 300
            assert cur.arrival_s > prev.arrival_s
    gaps = [b.arrival_s - a.arrival_s for s in sessions.values() for a, b in pairwise(s)]
    assert 6 < statistics.fmean(gaps) < 14


def test_agent_loops_structure() -> None:
    w = agent_loops(rng=random.Random(5), num_tasks=30)
    _check_shape(w)
    tasks: dict[str, list[SimRequest]] = {}
    for r in w.requests:
        assert r.session is not None and 50 <= r.output_tokens <= 200
        tasks.setdefault(r.session, []).append(r)
    assert all(5 <= len(t) <= 20 for t in tasks.values())
    assert len({t[0].block_ids[:11] for t in tasks.values()}) <= 4  # 6000 tokens = 11 blocks
    for steps in tasks.values():
        for prev, cur in pairwise(steps):
            assert 1.0 <= cur.arrival_s - prev.arrival_s <= 3.0
            added = cur.prompt_tokens - prev.prompt_tokens
            assert prev.output_tokens + 500 <= added <= prev.output_tokens + 2000
            assert _shared(prev, cur) == prev.prompt_tokens // 512


@pytest.mark.parametrize("gen", [multi_turn_chat, agent_loops])
def test_closed_loop_sessions_wait_for_the_previous_answer(gen: Gen) -> None:
    """Closed loop changes when a session's next request is sent, nothing else: the same
    prompts and plan, each later request waiting for its predecessor plus the gap."""
    kw = {"num_sessions": 30} if gen is multi_turn_chat else {"num_tasks": 30}
    opened = gen(rng=random.Random(8), **kw)
    closed = gen(rng=random.Random(8), closed_loop=True, **kw)
    assert all(r.after is None and r.think_s == 0.0 for r in opened.requests)
    assert tuple(replace(r, after=None, think_s=0.0) for r in closed.requests) == opened.requests
    by_id = {r.request_id: r for r in closed.requests}
    sessions: dict[str | None, list[SimRequest]] = {}
    for r in closed.requests:
        sessions.setdefault(r.session, []).append(r)
    for steps in sessions.values():
        assert steps[0].after is None
        for prev, cur in pairwise(steps):
            assert cur.after == prev.request_id and by_id[cur.after] is prev
            assert cur.think_s == pytest.approx(cur.arrival_s - prev.arrival_s)


def test_zipf_prefixes_popularity() -> None:
    w = zipf_prefixes(rng=random.Random(6), num_requests=2000, num_documents=50)
    _check_shape(w)
    docs = Counter(r.block_ids[0] for r in w.requests)
    assert len(docs) <= 50
    top, second = (c for _, c in docs.most_common(2))
    assert 1.6 < top / second < 2.8  # Zipf 1.1: 2 ** 1.1 = 2.14
    assert all(2000 + 20 <= r.prompt_tokens <= 16000 + 200 for r in w.requests)


def test_zipf_sampler_matches_weights() -> None:
    rng = random.Random(0)
    z = zipf(5, 1.0)
    counts = Counter(z.sample(rng) for _ in range(50_000))
    h = sum(1 / k for k in range(1, 6))
    for k in range(5):
        assert abs(counts[k] / 50_000 - 1 / (k + 1) / h) < 0.01
    assert {Categorical([0, 1, 0]).sample(rng) for _ in range(100)} == {1}


@pytest.mark.parametrize("gen", GENERATORS, ids=lambda g: g.__name__)
def test_determinism(gen: Gen) -> None:
    a = gen(rng=random.Random(11))
    assert a == gen(rng=random.Random(11))
    assert a != gen(rng=random.Random(12))


# --- arrivals ----------------------------------------------------------------------------


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def test_poisson_rate_and_dispersion() -> None:
    ts = poisson(20.0).times(5000, random.Random(1))
    assert ts[0] == 0.0 and ts == sorted(ts)
    assert abs(_rate(ts) - 20.0) / 20.0 < 0.1
    gaps = [b - a for a, b in pairwise(ts)]
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert 0.85 < cv2 < 1.15


def test_constant_rate() -> None:
    assert constant(4.0).times(5, random.Random(1)) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_bursty_keeps_mean_rate_and_is_burstier() -> None:
    ts = bursty(10.0, 4.0).times(50_000, random.Random(2))
    assert ts == sorted(ts) and ts[0] == 0.0
    assert abs(_rate(ts) - 10.0) / 10.0 < 0.1
    gaps = [b - a for a, b in pairwise(ts)]
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 > 20  # theory: 1 + 2 * 10 * 5 * 9 / 4 = 226
    assert bursty(10.0, 1.0).times(3, random.Random(2)) == poisson(10.0).times(3, random.Random(2))
    with pytest.raises(ValueError, match="peak-to-mean"):
        bursty(10.0, 0.5)


def test_generator_rate_follows_arrivals() -> None:
    w = zipf_prefixes(rng=random.Random(3), arrivals=50.0, num_requests=3000)
    assert abs(float(w.describe()["rate_rps"]) - 50.0) / 50.0 < 0.1
    c = shared_prefix_groups(rng=random.Random(3), arrivals=constant(8.0), num_groups=2)
    assert c.duration_s == pytest.approx(31 / 8)


def test_class_shares_on_sessions() -> None:
    w = multi_turn_chat(rng=random.Random(8), num_sessions=600)
    a = assign_classes(
        w,
        tenants={"t1": 0.5, "t2": 0.3, "t3": 0.2},
        priorities={0: 0.1, 1: 0.6, 2: 0.3},
        rng=random.Random(9),
    )
    per_session: dict[str | None, tuple[str, int]] = {}
    for r in a.requests:
        assert per_session.setdefault(r.session, (r.tenant, r.priority)) == (r.tenant, r.priority)
    tenants = Counter(t for t, _ in per_session.values())
    prios = Counter(p for _, p in per_session.values())
    assert abs(tenants["t1"] / 600 - 0.5) < 0.06 and abs(tenants["t3"] / 600 - 0.2) < 0.06
    assert abs(prios[1] / 600 - 0.6) < 0.06 and abs(prios[0] / 600 - 0.1) < 0.06
