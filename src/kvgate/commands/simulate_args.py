"""`kvgate simulate`'s command line: its parser (``add_simulate_parser``), the argparse
value types of the workload options (the tenant and priority-class shares,
``--tenants`` and ``--priorities``, and ``--burstiness``), and the checks across
options that refuse a combination which would be ignored or overwritten without a
word (each raises ValueError, one line)."""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path
from typing import Any

from kvgate.commands.argtypes import distinct_fractions, positive_float, positive_int
from kvgate.core.config import INDEX_MODES
from kvgate.core.routing import POLICIES
from kvgate.engine.profiles import DEFAULT_PROFILE, PROFILES
from kvgate.sim.scenarios import SCENARIOS, describe
from kvgate.sim.workload import PRIORITIES


def _shares(text: str, option: str) -> list[tuple[str, float]]:
    """``KEY=SHARE,...`` as (key, share) pairs: keys non-empty and distinct, shares
    finite and >= 0, not all zero. Raises argparse.ArgumentTypeError (one line)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected {option}, got {text!r}")
    out: list[tuple[str, float]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{item!r}: expected {option}")
        try:
            share = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: the share {raw.strip()!r} is not a number"
            ) from None
        if not (math.isfinite(share) and share >= 0):
            raise argparse.ArgumentTypeError(f"{item!r}: a share must be a finite number >= 0")
        if key in (k for k, _ in out):
            raise argparse.ArgumentTypeError(f"{key!r} is given twice")
        out.append((key, share))
    total = sum(share for _, share in out)
    if not total > 0:
        raise argparse.ArgumentTypeError(f"the shares are all 0 in {text!r}")
    if not math.isfinite(total):  # each is finite, but the draw needs their sum
        raise argparse.ArgumentTypeError(f"the shares add up past a float in {text!r}")
    return out


def tenant_shares(text: str) -> dict[str, float]:
    """``--tenants NAME=SHARE,...``: tenant name -> share (relative weights)."""
    return dict(_shares(text, "NAME=SHARE,..."))


def priority_shares(text: str) -> dict[int, float]:
    """``--priorities P0=SHARE,P1=SHARE,P2=SHARE`` (or ``0=``, ``1=``, ``2=``): class ->
    share (relative weights)."""
    out: dict[int, float] = {}
    for key, share in _shares(text, "P0=SHARE,P1=SHARE,P2=SHARE"):
        name = key[1:] if key[:1] in ("P", "p") else key
        if name not in {str(p) for p in PRIORITIES}:
            raise argparse.ArgumentTypeError(
                f"{key!r} is not a priority class: use P0, P1, P2 (or 0, 1, 2)"
            )
        if int(name) in out:
            raise argparse.ArgumentTypeError(f"P{name} is given twice")
        out[int(name)] = share
    return out


def burstiness(text: str) -> float:
    """``--burstiness``: a finite peak-to-mean ratio > 1."""
    value = positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(
            f"must be a peak-to-mean ratio > 1, got {text} (1 is Poisson: --arrivals poisson)"
        )
    return value


# the scenarios that set a class themselves, which the option would be overwritten by
SCENARIO_SETS = {
    "--priorities": ("p2_flood", "coordinator_down"),
    "--tenants": ("tenant_flood",),
}


def check_params_run(params: dict[str, dict[str, object]], policies: list[str]) -> None:
    """A ``--policy-param`` for a policy the run leaves out would be recorded in the
    report's settings and silently unused: a typo'd comparison. Raises ValueError."""
    unused = sorted(set(params) - set(policies))
    if unused:
        raise ValueError(
            f"--policy-param sets {', '.join(unused)}, which --policies does not run "
            f"(it runs {', '.join(policies)})"
        )


def check_saturation_args(args: argparse.Namespace) -> None:
    """``--saturation`` is a known point that ``--at-saturation`` runs fractions of;
    alone, or beside ``--find-saturation``, it would be ignored. So would ``--rate`` with
    a trace, ``--bucket`` without one, and ``--speedup`` beside the saturation flags.
    Raises ValueError."""
    if args.trace is None and args.bucket is not None:
        raise ValueError("--bucket replays a trace's shared timestamps; a synthetic "
                         "workload has none")
    check_class_args(args)
    if args.trace is not None and args.rate is not None:
        raise ValueError(
            "--rate sets a synthetic workload's arrivals; a trace has its own timestamps "
            "(--speedup scales them)"
        )
    if args.speedup != 1.0 and (args.at_saturation or args.find_saturation):
        raise ValueError(
            "--speedup gives one run's speed-up; with --find-saturation or --at-saturation "
            "the runs are at fractions of round robin's saturation point instead"
        )
    if args.saturation is None:
        return
    if args.find_saturation:
        raise ValueError(
            "--saturation gives the point, --find-saturation searches for it: use one"
        )
    if not args.at_saturation:
        raise ValueError(
            "--saturation needs --at-saturation (the fractions of it to run at); "
            "for one run at a speed-up, use --speedup"
        )


def check_class_args(args: argparse.Namespace) -> None:
    """``--arrivals`` and ``--burstiness`` draw a synthetic workload's arrivals (a trace
    has its timestamps), ``--burstiness`` only with ``--arrivals bursty``, which needs
    it; ``--tenants`` and ``--priorities`` cannot set what a scenario sets itself.
    Raises ValueError."""
    if args.trace is not None and (args.arrivals is not None or args.burstiness is not None):
        option = "--arrivals" if args.arrivals is not None else "--burstiness"
        raise ValueError(
            f"{option} draws a synthetic workload's arrival times; a trace has its own "
            "timestamps (--speedup scales them, --bucket places a shared one's requests)"
        )
    if args.burstiness is not None and args.arrivals != "bursty":
        raise ValueError(
            "--burstiness sets the bursty arrivals' peak-to-mean ratio: add --arrivals bursty"
        )
    if args.arrivals == "bursty" and args.burstiness is None:
        raise ValueError(
            "--arrivals bursty needs --burstiness B, the peak-to-mean rate ratio (> 1)"
        )
    for option, scenarios in SCENARIO_SETS.items():
        if getattr(args, option[2:]) is not None and args.scenario in scenarios:
            what = option[2:]
            raise ValueError(
                f"{option}: the {args.scenario} scenario assigns the {what} itself, "
                f"and would overwrite these; leave out {option} or the scenario"
            )


def check_run_options(args: argparse.Namespace) -> None:
    """``--plot`` draws runs and ``--replays`` repeats them: ``--find-saturation`` alone
    makes none. Raises ValueError."""
    if not args.find_saturation or args.at_saturation:
        return
    needs_runs = {"--plot draws": args.plot is not None, "--replays repeats": args.replays > 1}
    for option, given in needs_runs.items():
        if given:
            raise ValueError(
                f"{option} runs, and --find-saturation alone only searches: "
                "add --at-saturation (e.g. 0.8)"
            )


SYNTHETIC = ("gsp", "chat", "agent", "zipf")


def _scenarios_epilog() -> str:
    lines = ["scenarios (--scenario), each with its pass criteria:"]
    for name in SCENARIOS:
        lines.append(
            textwrap.fill(describe(name), initial_indent=f"  {name}: ", subsequent_indent="    ")
        )
    return "\n".join(lines)


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare routing policies on a trace or synthetic workload (virtual time)",
        description=textwrap.fill(
            "Replay a workload through N simulated nodes and G gateways running "
            "kvgate's real scheduling core, once per policy, and print a comparison table; "
            "when kvgate runs beside other policies, lines under the table check it against "
            "them (TTFT p99 and mean, goodput, load max/mean, hit ratio) and say where a "
            "baseline wins. Under a scenario, lines check each policy against the "
            "scenario's pass criteria."
        ),
        epilog=_scenarios_epilog(),
        # the epilog lists one scenario per paragraph, so keep its line breaks
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace", type=Path, help="Mooncake-format JSONL trace to replay (default: --workload)"
    )
    w.add_argument(
        "--workload",
        choices=SYNTHETIC,
        default="chat",
        help="synthetic workload when no --trace is given (default chat)",
    )
    w.add_argument(
        "--limit",
        type=positive_int,
        help="use only the first N requests of the workload (default: all)",
    )
    w.add_argument(
        "--speedup", type=positive_float, default=1.0, help="arrival speed-up factor (default 1.0)"
    )
    w.add_argument(
        "--bucket",
        choices=("spread", "burst", "jitter"),
        default=None,
        help="replay the requests sharing a bucketed trace timestamp at once (burst), evenly "
        "spread to the next timestamp (spread), or at random offsets drawn from --seed "
        "(jitter: a different replay of the same trace per seed) (default spread)",
    )
    w.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="synthetic arrivals per second: requests (gsp, zipf), sessions (chat) or "
        "tasks (agent) (default gsp 16, chat 0.5, agent 0.2, zipf 4)",
    )
    w.add_argument(
        "--arrivals",
        choices=("poisson", "bursty"),
        default=None,
        help="synthetic arrival process of the requests (gsp, zipf), sessions (chat) or "
        "tasks (agent): Poisson at --rate, or bursty, on/off periods (5 s on on average) "
        "at --burstiness times --rate with the same mean rate (default poisson; a trace "
        "has its own timestamps)",
    )
    w.add_argument(
        "--burstiness",
        type=burstiness,
        default=None,
        metavar="B",
        help="--arrivals bursty: the peak-to-mean rate ratio, > 1 (required with bursty; "
        "default: none)",
    )
    w.add_argument(
        "--tenants",
        type=tenant_shares,
        default=None,
        metavar="NAME=SHARE,...",
        help="assign each request a tenant drawn by these relative shares, e.g. "
        "alpha=3,beta=1 (a synthetic session keeps one tenant; trace requests draw one "
        "each); drawn from --seed by a generator of its own (default: one tenant, "
        "'default')",
    )
    w.add_argument(
        "--priorities",
        type=priority_shares,
        default=None,
        metavar="P0=SHARE,P1=SHARE,P2=SHARE",
        help="assign each request a priority class drawn by these relative shares, e.g. "
        "P0=0.2,P1=0.5,P2=0.3 (or 0=0.2,...; a class left out gets none; a session keeps "
        "one class, trace requests draw one each) (default: every request P1)",
    )
    w.add_argument(
        "--closed-loop",
        action="store_true",
        help="chat and agent: send a session's next request only once the previous one "
        "has ended (answered, failed or refused), plus its think time (an agent's tool "
        "gap) divided by --speedup (default: open loop, at the planned times; "
        "--find-saturation then searches on the open-loop arrivals)",
    )
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--nodes", type=positive_int, default=8, help="simulated inference nodes (default 8)"
    )
    c.add_argument(
        "--gateways",
        type=positive_int,
        default=1,
        help="gateways, each with its own core and a delayed view, sharing one "
        "coordinator, configured as a fleet of that size (expected_gateways) (default 1)",
    )
    c.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help=f"engine timing profile (default {DEFAULT_PROFILE})",
    )
    c.add_argument(
        "--cache-blocks",
        type=positive_int,
        default=1000,
        help="KV cache per node in blocks of the workload's block size (default 1000)",
    )
    c.add_argument(
        "--node-capacity", type=positive_int, default=64, help="requests per node in C (default 64)"
    )
    c.add_argument(
        "--budget", type=positive_int, help="admission budget C (default: nodes x capacity)"
    )
    c.add_argument(
        "--index-mode",
        choices=INDEX_MODES,
        default="approximate",
        help="cache index learned from the gateway's own routing (approximate) or from "
        "the nodes' KV events (precise) (default approximate)",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--policies",
        default="all",
        help=f"comma-separated policy names, or 'all' (default): {', '.join(sorted(POLICIES))}",
    )
    r.add_argument(
        "--scenario",
        choices=("none", *SCENARIOS),
        default="none",
        help="run a gray scenario and check its pass criteria (see below; default none)",
    )
    r.add_argument(
        "--seed", type=int, default=0, help="seed of the workload and the policies (default 0)"
    )
    r.add_argument(
        "--slo-ttft", type=positive_float, default=5.0, help="goodput SLO TTFT, s (default 5)"
    )
    r.add_argument(
        "--slo-tpot", type=positive_float, default=0.1, help="goodput SLO TPOT, s (default 0.1)"
    )
    r.add_argument(
        "--find-saturation",
        action="store_true",
        help="find round robin's saturation speed-up first (default: no search)",
    )
    r.add_argument(
        "--saturation",
        type=positive_float,
        default=None,
        help="round robin's saturation speed-up if already known, for --at-saturation "
        "(in place of --find-saturation's search; default: none)",
    )
    r.add_argument(
        "--at-saturation",
        type=distinct_fractions,
        default=None,
        help="comma-separated fractions of round robin's saturation speed-up to run at "
        "(default: none, one run at --speedup)",
    )
    r.add_argument(
        "--replays",
        type=positive_int,
        default=1,
        help="run each comparison N times, with seeds --seed to --seed + N - 1 (a trace's "
        "later replays with --bucket jitter), and print each policy's means, in how "
        "many replays each check held, and kvgate's paired difference with the policy "
        "each check names, with a 95%% interval (default 1)",
    )
    r.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="POLICY.NAME=VALUE",
        help="a routing policy's parameter, e.g. kvgate.affinity_slack_s=0 "
        "(repeatable; the other policies keep their defaults)",
    )
    r.add_argument(
        "--json", type=Path, help="write the whole report as JSON to this file (default: none)"
    )
    r.add_argument(
        "--requests",
        type=Path,
        metavar="FILE.jsonl",
        help="write one JSON line per request of every run (its policy, speed-up and "
        "seed; the node, the route's reason and matched blocks, cached tokens, TTFT "
        "and its parts): which requests make a tail (default: none)",
    )
    r.add_argument(
        "--plot",
        type=Path,
        help="draw TTFT distributions and hit ratios to this file: .png, .svg or .pdf "
        "(default: none)",
    )
    r.add_argument(
        "--no-progress",
        action="store_true",
        help="print one 'simulating ...' line per run on stderr instead of a progress "
        "bar of each run's requests (default: the bar on a terminal, the lines "
        "elsewhere)",
    )
