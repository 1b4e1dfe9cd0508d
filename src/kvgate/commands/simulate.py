"""`kvgate simulate`: compare routing policies on a workload or trace, in virtual time.

This is a shell around the pure simulator: it reads files, seeds the generator,
reads the wall clock for the speed figures and prints; the simulation itself is
deterministic (same seed, same report, except the wall-clock fields ``wall_s`` and
``sim_requests_per_wall_s``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from kvgate.commands.argtypes import (
    check_closed_loop,
    check_distinct_files,
    check_output_file,
)
from kvgate.commands.pipes import EXIT_BROKEN_PIPE, silence_stdout
from kvgate.commands.sim_progress import SimProgress
from kvgate.commands.sim_replays import check_replay_args, orderings, run_point
from kvgate.commands.sim_table import print_report
from kvgate.commands.simulate_args import (
    check_params_run,
    check_run_options,
    check_saturation_args,
)
from kvgate.core.admission import AdmissionConfig, LeaseConfig
from kvgate.core.config import ControllerConfig
from kvgate.core.errors import ConfigError
from kvgate.core.routing import make_policy
from kvgate.sim.cluster import ClusterConfig, SimCluster
from kvgate.sim.ordering import ordering, tally
from kvgate.sim.report import Slo
from kvgate.sim.request_log import RequestLog
from kvgate.sim.runner import SeededRng, compare, resolve_policies, run_policy
from kvgate.sim.scenario_checks import criteria, measure
from kvgate.sim.scenarios import SCENARIOS
from kvgate.sim.synthetic import (
    Arrivals,
    agent_loops,
    bursty,
    multi_turn_chat,
    poisson,
    shared_prefix_groups,
    zipf_prefixes,
)
from kvgate.sim.workload import (
    Workload,
    assign_classes,
    load_mooncake_trace,
    scale_rate,
)

# arrivals per second when --rate is not given: requests (gsp, zipf), sessions (chat),
# tasks (agent)
DEFAULT_RATES = {"gsp": 16.0, "chat": 0.5, "agent": 0.2, "zipf": 4.0}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # formats matplotlib writes that we document
# the seed of the tenant and class draw (--tenants, --priorities) is --seed plus this: a
# generator of its own, so the workload's draws, and every run without those options,
# stay as they were
CLASS_SEED_OFFSET = 1_000_003


def _load_workload(
    args: argparse.Namespace, speedup: float, *, open_loop: bool = False
) -> Workload:
    """The workload of ``args`` at ``speedup``; ``open_loop`` ignores --closed-loop."""
    rng = SeededRng(args.seed)
    closed = args.closed_loop and not open_loop
    if args.trace is not None:
        jitter = args.bucket == "jitter"
        trace = load_mooncake_trace(
            args.trace,
            speedup=speedup,
            bucket_mode="burst" if args.bucket == "burst" else "spread",  # jitter: spread
            limit=args.limit,
            rng=rng if jitter else None,
        )
        if not trace.requests:
            raise ValueError(f"{args.trace}: the trace holds no requests")
        return _with_classes(args, trace)
    kind = args.workload
    arrivals = _arrivals(args)
    if kind == "gsp":
        w = shared_prefix_groups(rng=rng, arrivals=arrivals)
    elif kind == "chat":
        w = multi_turn_chat(rng=rng, arrivals=arrivals, closed_loop=closed)
    elif kind == "agent":
        w = agent_loops(rng=rng, arrivals=arrivals, closed_loop=closed)
    else:
        w = zipf_prefixes(rng=rng, arrivals=arrivals)
    if args.limit:
        w = replace(w, requests=w.requests[: args.limit])
    return _with_classes(args, scale_rate(w, speedup) if speedup != 1.0 else w)


def _arrivals(args: argparse.Namespace) -> Arrivals:
    """The synthetic arrival process: Poisson at the rate, or bursty (--arrivals)."""
    if args.arrivals == "bursty":
        return bursty(_rate(args), args.burstiness)
    return poisson(_rate(args))


def _with_classes(args: argparse.Namespace, w: Workload) -> Workload:
    """``w`` with tenants and priority classes drawn by --tenants and --priorities
    shares (unchanged without them), from a generator of their own."""
    if args.tenants is None and args.priorities is None:
        return w
    return assign_classes(
        w,
        tenants=args.tenants or {},
        priorities=args.priorities or {},
        rng=SeededRng(args.seed + CLASS_SEED_OFFSET),
    )


def parse_policy_params(items: list[str]) -> dict[str, dict[str, object]]:
    """``POLICY.NAME=VALUE`` items as {policy: {name: value}}, checked by building each
    policy. Raises ValueError on a bad item."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        policy, dot, name = key.partition(".")
        if not sep or not dot or not policy or not name:
            raise ValueError(f"--policy-param {item!r}: expected POLICY.NAME=VALUE")
        value = _param_value(raw)
        if isinstance(value, float) and not math.isfinite(value):
            # a report records its parameters, and JSON has no Infinity or NaN
            raise ValueError(f"--policy-param {item!r}: the value must be a finite number")
        out.setdefault(policy.strip(), {})[name.strip()] = value
    for policy, params in out.items():
        try:
            make_policy(policy, params)
        except ConfigError as exc:
            raise ValueError(f"--policy-param: {exc}") from exc
    return out


def _param_value(raw: str) -> object:
    """true/false, none, an integer, a float, or else the word (e.g. kvgate.form=brief)."""
    text = raw.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def settings(args: argparse.Namespace, params: dict[str, dict[str, object]]) -> dict[str, Any]:
    """What a report was run with, so a saved ``--json`` file says how to reproduce it."""
    trace = args.trace is not None
    out: dict[str, Any] = {
        "trace": str(args.trace) if trace else None,
        "workload": None if trace else args.workload,
        "rate": None if trace else _rate(args),
        "bucket": (args.bucket or "spread") if trace else None,
        "arrivals": None if trace else (args.arrivals or "poisson"),
        "burstiness": args.burstiness,
        "tenants": args.tenants,
        "priorities": None
        if args.priorities is None
        else {f"P{p}": share for p, share in args.priorities.items()},
        "closed_loop": bool(args.closed_loop),
        "limit": args.limit,
        "nodes": args.nodes,
        "gateways": args.gateways,
        "profile": args.profile,
        "cache_blocks": args.cache_blocks,
        "node_capacity": args.node_capacity,
        "budget": _budget(args),
        "index_mode": args.index_mode,
        "policies": resolve_policies(_policy_names(args)),
        "policy_params": params,
        "scenario": args.scenario,
        "seed": args.seed,
        "replays": args.replays,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
    }
    if args.find_saturation or args.at_saturation:
        out["at_saturation"] = list(args.at_saturation or [])
    else:
        out["speedup"] = args.speedup
    return out


def _rate(args: argparse.Namespace) -> float:
    """The synthetic workload's arrival rate: --rate, else the workload's default."""
    return float(args.rate or DEFAULT_RATES[args.workload])


def _budget(args: argparse.Namespace) -> int:
    """The admission budget C: --budget, else nodes x capacity."""
    return int(args.budget or args.nodes * args.node_capacity)


def _config(args: argparse.Namespace) -> ClusterConfig:
    budget = _budget(args)
    ctl = ControllerConfig(
        hasher="trace",
        index_mode=args.index_mode,
        # a fleet says how many gateways share the budget, as README asks of a real one:
        # before their first grant each admits budget / gateways, not the whole budget
        admission=AdmissionConfig(
            budget=budget, lease=LeaseConfig(expected_gateways=args.gateways)
        ),
    )
    return ClusterConfig(
        nodes=args.nodes,
        gateways=args.gateways,
        profile=args.profile,
        cache_blocks=args.cache_blocks,
        node_capacity=args.node_capacity,
        controller=ctl,
    )


def keeps_up(rep: dict[str, Any], workload: Workload, base_e2e_s: float) -> bool:
    """Round robin keeps up when it sheds < 1 % and its backlog drains at once.

    Draining at once: the run ends within 10 % of the arrival span plus an unloaded
    run's drain allowance (``base_e2e_s``: its p99 request latency, or its own time from
    last arrival to end when that is longer) after the last arrival. A slack taken from
    the loaded run itself would grow with the very queue it must detect, and a fixed one
    would hide a growing queue in a short synthetic run.
    """
    arrival_span = max(workload.duration_s, 1e-9)
    # + 0.01: the report rounds span_s to 10 ms
    drained = rep["span_s"] <= 1.1 * arrival_span + base_e2e_s + 0.01
    return bool(not sheds(rep, workload) and drained)


def sheds(rep: dict[str, Any], workload: Workload) -> bool:
    """Whether a run rejected or failed 1 % or more of the workload's requests."""
    return bool(rep["rejected"] + rep["failed"] >= 0.01 * max(1, len(workload.requests)))


# the speed-ups the saturation search brackets: below the first, a cluster is too small
# for the workload; above the last, the search gives up (give --saturation instead)
SEARCH_LOW, SEARCH_HIGH = 0.25, 16.0


def find_saturation(args: argparse.Namespace, progress: SimProgress) -> float:
    """Bisect (geometrically) the arrival speed-up at which round robin stops keeping
    up. Raises ValueError when it does not keep up even at the search's low end, or
    keeps up at every speed-up probed (the point is above the search's high end)."""
    cfg = _config(args)
    lo, hi = SEARCH_LOW, SEARCH_HIGH
    progress(f"round_robin unloaded reference x{lo:.2f}")
    # Closed-loop sessions slow down instead of queueing, so the point where arrivals
    # outrun round robin is searched on the open-loop plan (same prompts, same starts).
    slow = _load_workload(args, lo, open_loop=True)
    _, base = run_policy(slow, cfg, "round_robin", seed=args.seed, on_progress=progress.requests)
    e2e_p99 = base["e2e_p99_s"]
    # the reference is the low end's probe too (its own latency is its drain allowance,
    # so only what it sheds can fail it)
    if not isinstance(e2e_p99, int | float) or sheds(base, slow):
        raise ValueError(
            f"round robin does not keep up with this workload even at x{lo:g} of its "
            f"arrival rate ({base['rejected']} rejected, {base['failed']} failed of "
            f"{len(slow.requests)}): the cluster is too small for it; give more nodes, "
            "or --saturation if you know the point"
        )
    # The allowance: the unloaded p99 latency, or the unloaded run's own drain when that
    # is longer. With the p99 alone, a run whose last request is its slowest (a
    # 120k-token prompt, 45 s end to end on an idle cluster, the p99 30 s) failed at
    # x0.3 and the point came out at x0.267 where queueing starts near x1; five requests
    # of one timestamp (every speed-up the same run) failed every probe, and x0.25 came
    # out as found.
    span = base["span_s"]
    assert isinstance(span, int | float)
    base_e2e = max(float(e2e_p99), float(span) - slow.duration_s)
    for _ in range(7):
        mid = (lo * hi) ** 0.5
        progress(f"round_robin saturation probe x{mid:.2f}")
        w = _load_workload(args, mid, open_loop=True)
        _, rep = run_policy(w, cfg, "round_robin", seed=args.seed, on_progress=progress.requests)
        if keeps_up(rep, w, base_e2e):
            lo = mid
        else:
            hi = mid
    if hi == SEARCH_HIGH:
        raise ValueError(
            f"round robin keeps up at every speed-up probed, up to x{lo:.3f} (the search "
            f"stops below x{SEARCH_HIGH:g}): give --saturation if you know a higher point"
        )
    return round(lo, 3)


def _policy_names(args: argparse.Namespace) -> list[str]:
    return [p.strip() for p in args.policies.split(",") if p.strip()]


def _run_once(
    args: argparse.Namespace,
    speedup: float,
    progress: SimProgress,
    params: dict[str, dict[str, object]],
    label: str = "",
    log: RequestLog | None = None,
) -> dict[str, Any]:
    """One comparison at ``speedup`` (``label`` goes into the progress lines); each
    run's requests go to ``log`` when there is one."""
    base = _load_workload(args, speedup)
    cfg = _config(args)
    slo = Slo(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    policies = resolve_policies(_policy_names(args))
    if args.scenario == "none":
        rep = compare(
            base,
            cfg,
            policies,
            seed=args.seed,
            slo=slo,
            clock=time.perf_counter,
            progress=partial(_announce, progress, speedup, label),
            on_progress=progress.requests,
            policy_params=params,
            on_run=_log_runs(log, speedup, args.seed),
        )
        rep["speedup"] = speedup
        if (checked := ordering(rep)) is not None:
            rep["ordering"] = checked
        return rep
    builder = SCENARIOS[args.scenario]
    out: dict[str, Any] = {"scenario": args.scenario, "speedup": speedup, "variants": {}}
    variants: dict[str, dict[str, Any]] = {"": {}}
    if args.scenario == "mass_eviction":
        variants = {"announced": {"announce": True}, "unannounced": {"announce": False}}
    elif args.scenario == "tenant_flood":
        variants = {"flood": {"flood": True}, "no_flood": {"flood": False}}
    for variant, kw in variants.items():
        context = f", {args.scenario}" + (f" ({variant})" if variant else "")
        plan = builder(base, cfg, SeededRng(args.seed + 1), **kw)
        rep = compare(
            plan.workload,
            plan.config,
            policies,
            seed=args.seed,
            slo=slo,
            hooks=plan.hooks,
            clock=time.perf_counter,
            progress=partial(_announce, progress, speedup, context),
            on_progress=progress.requests,
            policy_params=params,
            extra=partial(measure, args.scenario, plan),
            on_run=_log_runs(log, speedup, args.seed, variant or args.scenario),
        )
        if plan.probe is not None:
            rep["probe"] = {
                "max_inflight_in_window": plan.probe.max_inflight_in_window,
                "max_tenant_inflight": dict(sorted(plan.probe.max_tenant_inflight.items())),
                "budget": plan.probe.budget,
            }
        rep["speedup"] = speedup  # each variant's report has a single run's keys
        out["variants"][variant or args.scenario] = rep
    out["criteria"] = criteria(out)
    return out


def _log_runs(
    log: RequestLog | None, speedup: float, seed: int, variant: str | None = None
) -> Callable[[str, SimCluster], None] | None:
    """What writes each finished run's requests to ``log``, labelled with its run."""
    if log is None:
        return None
    labels = {"speedup": speedup, "seed": seed, "variant": variant}
    return lambda policy, cluster: log.write_run(cluster, {"policy": policy, **labels})


def _announce(progress: SimProgress, speedup: float, context: str, policy: str) -> None:
    """Name a run starting: the policy, the speed-up and any scenario context."""
    progress(f"{policy} at x{speedup:.4g}{context}")


def run_simulate(args: argparse.Namespace) -> int:
    progress = SimProgress(not args.no_progress)
    log: RequestLog | None = None
    try:
        params = parse_policy_params(args.policy_param)  # bad ones fail before any run
        check_params_run(params, resolve_policies(_policy_names(args)))  # so do unknown policies
        check_closed_loop(args)
        check_output_file(args.json, "--json")  # before the run, not after it
        check_output_file(args.plot, "--plot", PLOT_SUFFIXES)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(f"--plot {args.plot}: needs matplotlib (pip install matplotlib)")
        check_output_file(args.requests, "--requests")
        check_distinct_files(
            {"--trace": args.trace},
            {"--json": args.json, "--plot": args.plot, "--requests": args.requests},
        )
        report: dict[str, Any]
        check_saturation_args(args)
        check_run_options(args)
        check_replay_args(args)

        log = RequestLog(args.requests) if args.requests else None

        def run(speedup: float) -> dict[str, Any]:
            if args.replays == 1:
                return _run_once(args, speedup, progress, params, log=log)
            return run_point(
                args,
                speedup,
                lambda a, sp, label: _run_once(a, sp, progress, params, label, log),
            )

        if args.find_saturation or args.at_saturation:
            sat = args.saturation or find_saturation(args, progress)
            report = {
                "round_robin_saturation_speedup": sat,
                "saturation_found": args.saturation is None,
                "runs": {},
            }
            fractions: list[float] = args.at_saturation or []
            for f in fractions:
                report["runs"][f"{f:g}"] = run(f * sat)
            checked = [o for r in report["runs"].values() for o in orderings(r)]
            if len(checked) > 1:
                report["ordering_tally"] = tally(checked)
        else:
            report = run(args.speedup)
        report["settings"] = settings(args, params)
    except (OSError, ValueError, ConfigError) as exc:
        progress.done()
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    finally:
        if log is not None:  # every run's rows are in it by now (or up to the error)
            log.close()
    progress.done()
    broken = False
    try:
        print_report(report)
    except BrokenPipeError:  # `| head`: the files asked for are still written
        silence_stdout()
        broken = True
    try:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        if args.plot:
            from kvgate.commands.sim_plot import plot_report

            plot_report(report, args.plot)
    except (OSError, ValueError) as exc:  # e.g. the disk filled up during the run
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    return EXIT_BROKEN_PIPE if broken else 0


__all__ = ["run_simulate"]
