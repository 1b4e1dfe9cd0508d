"""`kvgate simulate`'s options checked: the argparse value types of the workload
options (the tenant and priority-class shares, ``--tenants`` and ``--priorities``, and
``--burstiness``), and the checks across options that refuse a combination which
would be ignored or overwritten without a word (each raises ValueError, one line)."""

from __future__ import annotations

import argparse
import math

from kvgate.commands.argtypes import positive_float
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
