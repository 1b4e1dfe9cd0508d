"""The coordinator's arithmetic, as pure functions over integers.

- :func:`max_min_share`: Doorman FAIR_SHARE (max-min fairness) in whole credits.
  C = 120, wants 1000 / 50 / 10 gives 60 / 50 / 10.
- :func:`spread`: an even split of whole credits.
- :func:`class_budgets`: APF arithmetic plus a priority water-fill. Per class c:
  NominalCL[c] = ceil(K x share[c]); reserve[c] = ceil(NominalCL[c] x (1 - lendable[c]))
  is never given to a lower class. Step 1 gives each class min(demand,
  NominalCL x ceiling); step 2 hands the rest out in priority order P0 -> P1 -> P2
  up to demand. P2 (nominal 0) therefore receives only idle capacity.

Remainders (the credits a floor leaves over) go to keys in sorted order, so every
call is deterministic and sums are exact: no credit is lost or made up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvgate.core.admission.config import ceil_fraction, floor_fraction
from kvgate.core.admission.types import Triple


def max_min_share(capacity: int, wants: Mapping[str, int]) -> dict[str, int]:
    """Max-min fair share of ``capacity`` whole credits among ``wants``.

    Everyone wanting less than an equal share gets what it wants; the rest split the
    remainder equally (the "water level"), the leftover credits one each to the
    first keys in sorted order. The sum is min(capacity, sum(wants)).
    """
    out = {k: 0 for k in wants}
    remaining = max(0, capacity)
    items = sorted((max(0, w), k) for k, w in wants.items())
    n = len(items)
    hungry: list[str] = []
    for i, (w, k) in enumerate(items):
        if not hungry and w <= remaining // (n - i):
            out[k] = w
            remaining -= w
        else:
            hungry.append(k)
    if hungry:
        level, extra = divmod(remaining, len(hungry))
        for j, k in enumerate(sorted(hungry)):
            out[k] = level + (1 if j < extra else 0)
    return out


def spread(amount: int, keys: Iterable[str]) -> dict[str, int]:
    """Split ``amount`` credits evenly over ``keys`` (remainder to the first sorted keys)."""
    ordered = sorted(keys)
    if not ordered:
        return {}
    level, extra = divmod(max(0, amount), len(ordered))
    return {k: level + (1 if j < extra else 0) for j, k in enumerate(ordered)}


def share_with_slack(capacity: int, wants: Mapping[str, int]) -> dict[str, int]:
    """Max-min share by wants, then any capacity nobody wants spread over all keys.

    Used for tenant quotas: a tenant active at two gateways with quota 10 and wants
    1 and 1 gets 5 and 5, so a burst at either gateway finds room at once.
    """
    out = max_min_share(capacity, wants)
    slack = capacity - sum(out.values())
    if slack > 0:
        for k, extra in spread(slack, out).items():
            out[k] += extra
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassBudgets:
    capacity: int  # K: the class capacity (C_eff minus the bypass pool)
    nominal: Triple  # NominalCL per class
    reserve: Triple  # unlendable part of NominalCL per class
    caps: Triple  # the most a class may hold (ceilings and lower reserves applied)
    budgets: Triple  # B[c]
    idle: int  # K - sum(B): capacity nobody asked for (lent out as headroom)


def class_budgets(
    *,
    capacity: int,
    shares: tuple[float, float, float],
    lendable: tuple[float, float, float],
    demand: Triple,
    ceilings: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> ClassBudgets:
    """Class budgets B[c] for a class capacity K and per-class demand.

    P0 may take everything (its ceiling is ignored); P1 never P0's reserve and at most
    ceiling[1] x (K - reserve[0]); P2 never P0's or P1's reserve, and only what is
    left once P0 and P1 have their demand, at most ceiling[2] of that room (0: off; a
    slow start's fraction; at least one credit when on and there is room).
    The caller folds P0's standing reserve into ``demand[0]`` if it wants one.
    """
    k = max(0, capacity)
    nominal = (
        ceil_fraction(k, shares[0]),
        ceil_fraction(k, shares[1]),
        ceil_fraction(k, shares[2]),
    )
    reserve = (
        # never the whole class capacity: on a cluster of one or two credits P1 (the
        # default priority) would otherwise never run, even idle
        min(max(0, k - 1), ceil_fraction(nominal[0], 1.0 - lendable[0])),
        ceil_fraction(nominal[1], 1.0 - lendable[1]),
        ceil_fraction(nominal[2], 1.0 - lendable[2]),
    )
    cap1 = floor_fraction(max(0, k - reserve[0]), min(1.0, ceilings[1]))
    room2 = max(0, k - reserve[0] - reserve[1])
    cap2 = floor_fraction(room2, min(1.0, ceilings[2]))
    if ceilings[2] > 0.0 and room2:
        cap2 = max(1, cap2)  # P2 on (a slow start's first tenth of a small K): one at least
    caps = (k, cap1, cap2)
    want = [min(max(0, demand[c]), caps[c]) for c in range(3)]
    ceil_use = (1.0, ceilings[1], ceilings[2])
    got = [0, 0, 0]
    left = k
    for c in range(3):  # step 1: nominal shares (scaled by the ceilings)
        take = min(want[c], floor_fraction(nominal[c], min(1.0, ceil_use[c])), left)
        got[c] = take
        left -= take
    for c in range(3):  # step 2: the rest, in priority order, up to demand
        take = min(want[c] - got[c], left)
        got[c] += take
        left -= take
    return ClassBudgets(
        capacity=k,
        nominal=nominal,
        reserve=reserve,
        caps=caps,
        budgets=(got[0], got[1], got[2]),
        idle=left,
    )
