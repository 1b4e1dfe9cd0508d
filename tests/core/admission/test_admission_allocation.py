"""Golden tests of the coordinator's arithmetic (Doorman algorithm_test style)."""

from __future__ import annotations

import pytest

from kvgate.core.admission import (
    bypass_pool,
    class_budgets,
    max_min_share,
    share_with_slack,
    spread,
)

SHARES = (0.7, 0.3, 0.0)
LENDABLE = (0.5, 1.0, 1.0)


@pytest.mark.parametrize(
    ("capacity", "wants", "expected"),
    [
        # Doorman FAIR_SHARE golden: C = 120, wants 1000 / 50 / 10
        (120, {"a": 1000, "b": 50, "c": 10}, {"a": 60, "b": 50, "c": 10}),
        (100, {"a": 10, "b": 20}, {"a": 10, "b": 20}),  # not scarce: everyone gets wants
        (10, {"a": 5, "b": 5, "c": 5}, {"a": 4, "b": 3, "c": 3}),  # remainder in key order
        (7, {"a": 0, "b": 100, "c": 3}, {"a": 0, "b": 4, "c": 3}),
        (0, {"a": 5, "b": 1}, {"a": 0, "b": 0}),
        (9, {}, {}),
        (100, {"x": 40, "y": 40, "z": 40}, {"x": 34, "y": 33, "z": 33}),
        (12, {"a": 2, "b": 9, "c": 9}, {"a": 2, "b": 5, "c": 5}),
    ],
)
def test_max_min_share_golden(
    capacity: int, wants: dict[str, int], expected: dict[str, int]
) -> None:
    got = max_min_share(capacity, wants)
    assert got == expected
    assert sum(got.values()) == min(capacity, sum(wants.values()))


def test_spread_and_share_with_slack() -> None:
    assert spread(10, ["b", "a", "c"]) == {"a": 4, "b": 3, "c": 3}
    assert spread(0, ["a"]) == {"a": 0}
    assert spread(5, []) == {}
    # tenant quota 10 at two gateways wanting 1 each: all of it, split
    assert share_with_slack(10, {"a": 1, "b": 1}) == {"a": 5, "b": 5}
    assert share_with_slack(10, {"a": 8, "b": 1}) == {"a": 9, "b": 1}
    assert share_with_slack(10, {"a": 30, "b": 30}) == {"a": 5, "b": 5}


@pytest.mark.parametrize(
    ("capacity", "fraction", "pool"),
    [(256, 0.03, 7), (1000, 0.03, 30), (10, 0.03, 1), (2, 0.03, 1), (1, 0.03, 0), (100, 0.0, 0)],
)
def test_bypass_pool(capacity: int, fraction: float, pool: int) -> None:
    assert bypass_pool(capacity, fraction) == pool


@pytest.mark.parametrize(
    ("capacity", "gateways", "pool"),
    [(40, 2, 2), (128, 4, 4), (256, 8, 8), (256, 4, 7), (1000, 2, 30), (4, 8, 3), (1, 2, 0)],
)
def test_bypass_pool_holds_a_credit_per_gateway(capacity: int, gateways: int, pool: int) -> None:
    """The pool is split over the fleet's gateways: 3 % of 40 is one credit, which one of
    two gateways would not get (every probe there refused while the credit sat idle)."""
    assert bypass_pool(capacity, 0.03, gateways) == pool


# K = 249 (C = 256 minus a bypass pool of 7): NominalCL = (175, 75, 0), P0 reserve 88.
@pytest.mark.parametrize(
    ("demand", "ceilings", "budgets", "idle"),
    [
        # idle cluster: nothing budgeted, all idle (lent out as headroom)
        ((0, 0, 0), (1.0, 1.0, 1.0), (0, 0, 0), 249),
        # P1 flood, P0 only its reserve: P1 takes all but P0's unlendable 88
        ((88, 300, 0), (1.0, 1.0, 1.0), (88, 161, 0), 0),
        # everyone floods: nominal shares (P1 loses the ceil rounding credit); P2 nothing
        ((300, 300, 300), (1.0, 1.0, 1.0), (175, 74, 0), 0),
        # P0 floods: P0 may take everything (any free credit)
        ((400, 0, 0), (1.0, 1.0, 1.0), (249, 0, 0), 0),
        # P2 gets only idle capacity, and never P0's reserve
        ((10, 10, 300), (1.0, 1.0, 1.0), (10, 10, 161), 68),
        ((200, 40, 300), (1.0, 1.0, 1.0), (200, 40, 9), 0),
        # SLO loop: P1 ceiling 0.5 caps P1 at 0.5 x (K - reserve); P2 off
        ((0, 300, 300), (1.0, 0.5, 0.0), (0, 80, 0), 169),
        ((100, 300, 0), (1.0, 0.1, 1.0), (100, 16, 0), 133),
    ],
)
def test_class_budgets_water_fill(
    demand: tuple[int, int, int],
    ceilings: tuple[float, float, float],
    budgets: tuple[int, int, int],
    idle: int,
) -> None:
    cb = class_budgets(
        capacity=249, shares=SHARES, lendable=LENDABLE, demand=demand, ceilings=ceilings
    )
    assert cb.nominal == (175, 75, 0)
    assert cb.reserve == (88, 0, 0)
    assert cb.budgets == budgets
    assert cb.idle == idle
    assert sum(cb.budgets) + cb.idle == 249


def test_class_budgets_float_noise_does_not_add_a_credit() -> None:
    cb = class_budgets(capacity=100, shares=SHARES, lendable=LENDABLE, demand=(0, 0, 0))
    assert cb.nominal == (70, 30, 0)  # 100 x 0.7 = 70.00000000000001 in floats
    assert cb.reserve == (35, 0, 0)


def test_p2_on_at_a_small_ceiling_still_gets_one_credit() -> None:
    """A slow start's first tenth of a small budget rounds down to no credit: P2 on
    means at least one (P2 off, ceiling 0, still none)."""
    kw = {"capacity": 7, "shares": (0.7, 0.3, 0.0), "lendable": (0.5, 1.0, 1.0)}
    on = class_budgets(demand=(0, 0, 5), ceilings=(1.0, 1.0, 0.1), **kw)  # type: ignore[arg-type]
    assert on.caps[2] == 1 and on.budgets[2] == 1
    off = class_budgets(demand=(0, 0, 5), ceilings=(1.0, 1.0, 0.0), **kw)  # type: ignore[arg-type]
    assert off.caps[2] == 0 and off.budgets[2] == 0
    full = class_budgets(demand=(0, 0, 5), ceilings=(1.0, 1.0, 1.0), **kw)  # type: ignore[arg-type]
    assert full.caps[2] == 4  # 7 less P0's reserve of 3 (P1 lends all of its share)


@pytest.mark.parametrize(
    ("capacity", "reserve0", "cap1"), [(1, 0, 1), (2, 1, 1), (3, 2, 1), (4, 2, 2)]
)
def test_p0_reserve_never_takes_the_whole_class_capacity(
    capacity: int, reserve0: int, cap1: int
) -> None:
    """On a one-credit class capacity (a budget of 1 or 2: the bypass lane takes one
    of 2) P0's unlendable reserve was that credit, and P1, the default priority, was
    never admitted even on an idle cluster; it is capped at K - 1."""
    cb = class_budgets(capacity=capacity, shares=SHARES, lendable=LENDABLE, demand=(0, 1, 0))
    assert cb.reserve[0] == reserve0 and cb.caps[1] == cap1
    assert cb.budgets[1] == 1  # the P1 request gets its credit
