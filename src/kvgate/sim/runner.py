"""Run one simulation per policy on the same workload and collect the report.

Every policy in one comparison runs with the same cluster and admission settings
(only ``ControllerConfig.policy`` differs), so no policy wins by shedding load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from kvgate.core.routing import POLICIES
from kvgate.sim.balanced_bound import balanced_hit_ratio, busy_nodes_needed
from kvgate.sim.cluster import ClusterConfig, SimCluster
from kvgate.sim.ordering import LOAD_MAX_OVER_MEAN_LIMIT
from kvgate.sim.report import Slo, policy_report
from kvgate.sim.workload import Workload, ideal_hit_ratio, pooled_lru_hit_ratio


class SeededRng:
    """A tiny deterministic generator (xorshift64*) satisfying the core's Rng.

    The simulator may not import ``random``; this keeps runs identical across
    Python versions and processes.
    """

    __slots__ = ("_s",)

    def __init__(self, seed: int) -> None:
        self._s = (seed * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF or 1

    def random(self) -> float:
        s = self._s
        s ^= s >> 12
        s ^= (s << 25) & 0xFFFFFFFFFFFFFFFF
        s ^= s >> 27
        self._s = s
        return ((s * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF) / 18446744073709551616.0


Hook = Callable[[SimCluster], None]


def run_policy(
    workload: Workload,
    config: ClusterConfig,
    policy: str,
    *,
    seed: int = 0,
    slo: Slo | None = None,
    hooks: Sequence[tuple[float, Hook]] = (),
    clock: Callable[[], float] | None = None,
    policy_params: Mapping[str, Mapping[str, object]] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[SimCluster, dict[str, object]]:
    """One simulation of ``workload`` under ``policy``; returns the cluster and its report.

    ``clock`` measures wall time for the report (the CLI passes a real clock; the
    simulation itself never reads one). ``policy_params``, when given, maps a policy
    name to its keyword parameters (no entry: its defaults) in place of the config's.
    ``on_progress`` is told (ended, total) requests as the run goes (a progress bar).
    """
    ctl = replace(config.controller, policy=policy)
    if policy_params is not None:
        ctl = replace(ctl, policy_params=dict(policy_params.get(policy, {})))
    cluster = SimCluster(replace(config, controller=ctl), workload, rng=SeededRng(seed))
    cluster.hooks.extend(hooks)
    cluster.on_progress = on_progress
    t0 = clock() if clock else 0.0
    cluster.run()
    wall = (clock() - t0) if clock else 0.0
    cluster.check_outcomes()
    return cluster, policy_report(cluster, slo=slo or Slo(), wall_s=wall)


def resolve_policies(names: Sequence[str]) -> list[str]:
    """The policies a comparison runs, in order; ``["all"]`` is every policy, kvgate
    first. Raises ValueError on none, an unknown one or one named twice (a report has
    one row per policy)."""
    if list(names) == ["all"]:
        return ["kvgate", *sorted(n for n in POLICIES if n != "kvgate")]
    if not names:
        raise ValueError(f"no policy given; known: {sorted(POLICIES)} or 'all'")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(POLICIES)} or 'all'")
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise ValueError(f"policies named more than once: {twice}")
    return list(names)


def compare(
    workload: Workload,
    config: ClusterConfig,
    policies: Sequence[str],
    *,
    seed: int = 0,
    slo: Slo | None = None,
    hooks: Sequence[tuple[float, Hook]] = (),
    clock: Callable[[], float] | None = None,
    progress: Callable[[str], None] | None = None,
    policy_params: Mapping[str, Mapping[str, object]] | None = None,
    extra: Callable[[SimCluster], Mapping[str, object]] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_run: Callable[[str, SimCluster], None] | None = None,
) -> dict[str, object]:
    """One run of ``workload`` per policy, with the workload's bounds; ``extra`` adds
    keys to each policy's report, read from its finished cluster. ``progress`` is told
    each policy's name as its run starts, ``on_progress`` its requests as they end,
    ``on_run`` the policy and its finished cluster (the request log)."""
    capacity = config.nodes * config.cache_blocks
    report: dict[str, object] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "nodes": config.nodes,
        "gateways": config.gateways,
        "profile": config.profile,
        "cache_blocks_per_node": config.cache_blocks,
        "block_tokens": workload.block_tokens,
        "seed": seed,
        "bounds": {
            "ideal_hit_ratio": round(ideal_hit_ratio(workload), 4),
            "pooled_lru_hit_ratio": round(pooled_lru_hit_ratio(workload, capacity), 4),
            "pooled_lru_capacity_blocks": capacity,
            # the most any policy keeping load max/mean <= the quality bar's limit can hit
            "balanced_hit_ratio": _round(
                balanced_hit_ratio(workload, config.nodes, LOAD_MAX_OVER_MEAN_LIMIT)
            ),
            "balanced_load_limit": LOAD_MAX_OVER_MEAN_LIMIT,
            "balanced_busy_nodes": busy_nodes_needed(config.nodes, LOAD_MAX_OVER_MEAN_LIMIT),
        },
    }
    results: dict[str, object] = {}
    wall = 0.0
    for name in policies:
        if progress:
            progress(name)
        cluster, rep = run_policy(
            workload,
            config,
            name,
            seed=seed,
            slo=slo,
            hooks=hooks,
            clock=clock,
            policy_params=policy_params,
            on_progress=on_progress,
        )
        if extra is not None:
            rep.update(extra(cluster))
        if on_run is not None:
            on_run(name, cluster)
        results[name] = rep
        wall += float(rep["wall_s"])  # type: ignore[arg-type]
    if policy_params:
        report["policy_params"] = {k: dict(v) for k, v in sorted(policy_params.items())}
    report["policies"] = results
    report["wall_s"] = round(wall, 2)
    return report


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
