"""argparse value types of `kvgate simulate`'s workload options: the tenant and
priority-class shares (``--tenants``, ``--priorities``) and ``--burstiness``."""

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
