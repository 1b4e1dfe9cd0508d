"""The balanced bound: the most any policy keeping load max/mean <= a limit can hit."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.admission import AdmissionConfig
from kvgate.core.config import ControllerConfig
from kvgate.sim.balanced_bound import balanced_hit_ratio, busy_nodes_needed, forced_misses
from kvgate.sim.cluster import ClusterConfig
from kvgate.sim.ordering import format_ordering, ordering
from kvgate.sim.runner import SeededRng, compare
from kvgate.sim.synthetic import multi_turn_chat
from kvgate.sim.workload import SimRequest, Workload


def _brute(chains: list[list[int]], k: int) -> tuple[int, int]:
    """Every k-subset, every prefix counted: the definition, by exhaustion."""
    prefixes = {tuple(c[:i]) for c in chains for i in range(1, len(c) + 1)}
    best = -1
    for subset in itertools.combinations(chains, k):
        counts: dict[tuple[int, ...], int] = {}
        for c in subset:
            for i in range(1, len(c) + 1):
                counts[tuple(c[:i])] = counts.get(tuple(c[:i]), 0) + 1
        extra = sum(n - 1 for n in counts.values())
        best = extra if best < 0 else min(best, extra)
    return len(prefixes), best


def _workload(chains: list[list[int]]) -> Workload:
    reqs = [
        SimRequest(
            request_id=f"r{i}",
            arrival_s=float(i),
            prompt_tokens=len(c) * 4,
            output_tokens=4,
            block_ids=tuple(c),
        )
        for i, c in enumerate(chains)
    ]
    return Workload(name="hand", block_tokens=4, requests=tuple(reqs))


def test_busy_nodes_needed() -> None:
    assert busy_nodes_needed(8, 1.5) == 6  # 8 / 1.5 = 5.33
    assert busy_nodes_needed(8, 2.0) == 4
    assert busy_nodes_needed(8, 1.0) == 8
    assert busy_nodes_needed(8, 100.0) == 1
    assert busy_nodes_needed(1, 1.5) == 1
    with pytest.raises(ValueError):
        busy_nodes_needed(0, 1.5)
    with pytest.raises(ValueError):
        busy_nodes_needed(8, 0.0)


def test_a_shared_system_prompt_is_computed_once_per_busy_node() -> None:
    # six chats: the same two system-prompt blocks, then their own block
    chains = [[1, 2, 100 + i] for i in range(6)]
    assert forced_misses(chains, 6) == (2 + 6, 2 * 5)
    assert forced_misses(chains, 1) == (8, 0)
    # 18 blocks, 8 distinct: ideal 10 hits; on 6 cold nodes 10 more misses: 0 hits
    assert balanced_hit_ratio(_workload(chains), 8, 1.5) == 0.0
    assert balanced_hit_ratio(_workload(chains), 8, 8.0) == pytest.approx(10 / 18)


def test_agent_types_spread_over_nodes_only_by_recomputing_their_prefix() -> None:
    # four tool prefixes of 3 blocks, three tasks each; six busy nodes need two of the
    # prefixes a second time
    chains = [
        [10 * t, 10 * t + 1, 10 * t + 2, 1000 + 10 * t + i] for t in range(4) for i in range(3)
    ]
    assert forced_misses(chains, 4) == (12 + 12, 0)
    assert forced_misses(chains, 6) == (24, 2 * 3)
    # a task whose chain is another's prefix shares all of it
    assert forced_misses([[1, 2], [1, 2, 3]], 2) == (3, 2)
    assert forced_misses([[1, 2], [1, 2]], 2) == (2, 2)


def test_fewer_requests_than_busy_nodes_cannot_be_balanced() -> None:
    assert forced_misses([[1], [2]], 3) == (2, -1)
    assert balanced_hit_ratio(_workload([[1], [2]]), 8, 1.5) is None
    assert balanced_hit_ratio(_workload([]), 8, 1.5) == 0.0


def test_long_chains_do_not_recurse() -> None:
    long = list(range(5000))
    chains = [[*long, 10**6 + i] for i in range(3)] + [long[:2500]]
    # the first 2 500 blocks are in all four chains, the next 2 500 in three
    assert forced_misses(chains, 4) == (5003, 3 * 2500 + 2 * 2500)


@settings(max_examples=300, deadline=None)
@given(
    chains=st.lists(
        st.lists(st.integers(min_value=0, max_value=2), max_size=5), min_size=1, max_size=7
    ),
    k=st.integers(min_value=1, max_value=5),
)
def test_forced_misses_is_the_least_overlapping_subset(chains: list[list[int]], k: int) -> None:
    assert forced_misses(chains, k) == _brute(chains, k)


def _small_config() -> ClusterConfig:
    ctl = ControllerConfig(hasher="trace", admission=AdmissionConfig(budget=128))
    return ClusterConfig(nodes=4, cache_blocks=400, node_capacity=32, controller=ctl)


def test_no_balanced_run_beats_the_bound_and_a_concentrated_one_can() -> None:
    w = multi_turn_chat(rng=SeededRng(1), arrivals=2.0, num_sessions=40)
    policies = ["kvgate", "round_robin", "least_loaded", "dynamo_cost", "preble_e2"]
    rep = compare(w, _small_config(), policies, seed=1)
    bound = rep["bounds"]["balanced_hit_ratio"]  # type: ignore[index]
    assert bound < rep["bounds"]["ideal_hit_ratio"]  # type: ignore[index]
    balanced = 0
    for name, row in rep["policies"].items():  # type: ignore[union-attr]
        assert row["completed"] == len(w.requests), name
        if row["load_max_over_mean"] <= 1.5:
            balanced += 1
            assert row["hit_ratio"] <= bound, name  # the theorem, on the real engine
    assert balanced >= 3
    # preble_e2 keeps every chat on the node holding the system prompt
    preble = rep["policies"]["preble_e2"]  # type: ignore[index]
    assert preble["load_max_over_mean"] > 1.5 and preble["hit_ratio"] > bound
    # and the quality-bar line says the hit-ratio check cannot hold with the load limit
    result = ordering(rep)
    assert result is not None
    check = result["checks"]["hit_ratio"]
    assert check["against"] == "preble_e2" and check["other_beyond_balance"] is True
    assert check["balanced_bound"] == bound
    assert "the most any policy with load max/mean <= 1.5 can hit" in format_ordering(result)


def test_the_balanced_keys_are_null_without_a_bound() -> None:
    """Too few requests for a bound: ``balanced_bound`` and ``other_beyond_balance`` are
    still in the check, null (the README lists both as stable keys)."""
    w = Workload(name="two", block_tokens=16, requests=tuple(
        SimRequest(request_id=f"q{i}", arrival_s=float(i), prompt_tokens=32, output_tokens=2,
                   block_ids=(1, 2)) for i in range(2)))
    rep = compare(w, _small_config(), ["kvgate", "sglang_cache_aware"], seed=1)
    assert rep["bounds"]["balanced_hit_ratio"] is None  # type: ignore[index]
    result = ordering(rep)
    assert result is not None
    check = result["checks"]["hit_ratio"]
    assert check["balanced_bound"] is None and check["other_beyond_balance"] is None
