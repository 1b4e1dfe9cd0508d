"""The SLO loop: AIMD on the P1 ceiling with hysteresis, and P0 TTFT measurement."""

from __future__ import annotations

import itertools

import pytest
from admission_testlib import req, sync_refresh

from kvgate.core.admission import (
    AdmissionConfig,
    GatewayAdmission,
    InProcessCoordinator,
    Priority,
    SloConfig,
    SloController,
    TtftWindow,
)

SLO = SloConfig()  # p99 SLO 2.0 s, healthy <= 1.8 s, x0.8 after 2, +0.05 after 3
B, H, N = 3.0, 1.0, 1.9  # breached, healthy, in the hysteresis band


def _run(values: list[float | None]) -> list[float]:
    ctl = SloController(SLO)
    return [ctl.observe_window(v) for v in values]


@pytest.mark.parametrize(
    ("windows", "ceilings"),
    [
        ([B, B], [1.0, 0.8]),  # shrinks on the 2nd consecutive breached window
        ([B, B, B, B], [1.0, 0.8, 0.8, 0.64]),
        ([B, H, B, H], [1.0, 1.0, 1.0, 1.0]),  # isolated breaches: no change
        ([B, N, B], [1.0, 1.0, 1.0]),  # the band resets the breach streak
        ([B, B, H, H, H], [1.0, 0.8, 0.8, 0.8, 0.85]),  # +0.05 after 3 healthy windows
        ([B, B, H, N, H, H], [1.0, 0.8, 0.8, 0.8, 0.8, 0.8]),  # the band resets it too
        ([None, None, None], [1.0, 1.0, 1.0]),  # no P0 traffic counts as healthy, cap 1.0
    ],
)
def test_aimd_steps(windows: list[float | None], ceilings: list[float]) -> None:
    assert _run(windows) == pytest.approx(ceilings)


def test_floor_and_cap() -> None:
    assert _run([B] * 40)[-1] == pytest.approx(0.1)
    ctl = SloController(SLO)
    ctl.p1_ceiling = 0.98
    for _ in range(3):
        ctl.observe_window(H)
    assert ctl.p1_ceiling == 1.0


def test_p2_slow_start_and_off_from_the_first_breach_until_three_healthy_windows() -> None:
    ctl = SloController(SLO)
    assert ctl.ceilings == (1.0, 1.0, 0.1)  # start-up: a tenth of the idle capacity
    seen = []
    for _ in range(5):
        ctl.observe_window(H)
        seen.append(ctl.ceilings[2])
    assert seen == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])  # doubling per healthy window
    ctl.observe_window(B)
    assert ctl.ceilings[2] == 0.0 and ctl.ceilings[1] == 1.0
    ctl.observe_window(H)
    ctl.observe_window(N)  # the band restarts the count
    ctl.observe_window(H)
    ctl.observe_window(H)
    assert ctl.ceilings[2] == 0.0
    ctl.observe_window(H)
    assert ctl.ceilings[2] == pytest.approx(0.1)  # back at the slow start's first step
    ctl.observe_window(H)
    assert ctl.ceilings[2] == pytest.approx(0.2)
    ctl.observe_window(N)  # the band neither grows nor stops it
    assert ctl.ceilings[2] == pytest.approx(0.2)


def test_p2_all_at_once_when_the_slow_start_is_off() -> None:
    ctl = SloController(SloConfig(p2_start=1.0))
    assert ctl.ceilings == (1.0, 1.0, 1.0)
    ctl.observe_window(B)
    assert ctl.ceilings[2] == 0.0
    for _ in range(3):
        ctl.observe_window(H)
    assert ctl.ceilings[2] == 1.0


def test_recovers_without_oscillation_with_a_lagging_plant() -> None:
    """P0 p99 grows with the P1 ceiling and is measured one window late (sensor lag)."""
    ctl = SloController(SLO)

    def plant(ceiling: float) -> float:
        return 0.6 + 2.4 * ceiling  # SLO met for ceiling <= 0.58, healthy for <= 0.5

    history = [ctl.p1_ceiling]
    lagged = plant(1.0)
    for _ in range(200):
        measured, lagged = lagged, plant(ctl.p1_ceiling)
        history.append(ctl.observe_window(measured))
    changes = [b - a for a, b in itertools.pairwise(history) if b != a]
    reversals = sum(1 for a, b in itertools.pairwise(changes) if (a > 0) != (b > 0))
    assert reversals <= 1  # down, then at most one turn up: no limit cycle
    settled = history[-60:]
    assert max(settled) - min(settled) < 1e-9  # it comes to rest
    assert plant(settled[-1]) <= SLO.p0_ttft_p99_s  # inside the SLO
    assert settled[-1] >= 0.3  # without throwing P1 away


def test_breach_then_recovery_is_monotone_up() -> None:
    history = _run([B] * 6 + [H] * 60)
    down, up = history[:6], history[6:]
    assert down == sorted(down, reverse=True) and down[-1] < 1.0
    assert up == sorted(up) and up[-1] == 1.0


def test_ttft_window_p99() -> None:
    w = TtftWindow(window_s=10.0, min_samples=5)
    for i in range(100):
        w.add(0.1 + i * 0.01, 0.5)  # 0.10 .. 1.09 s in window 0
    index, p99 = w.last(10.0)
    assert index == 0
    assert p99 == pytest.approx(1.08, rel=0.02)  # the 99th of 100 samples, +-2 %
    assert w.last(10.5) == (0, p99)
    assert w.last(30.0) == (2, None)  # window 1 and 2 had no samples
    for _ in range(4):
        w.add(5.0, 31.0)
    assert w.last(40.0) == (3, None)  # too few samples to say


def test_a_sparse_window_is_healthy_only_if_its_samples_are() -> None:
    """Fewer than min_samples: no p99, but a few P0 requests 5x over the SLO are not
    'no data'. All within the healthy fraction: None (healthy); any slower: the slowest,
    capped at the SLO (the band, never a breach on its own)."""
    w = TtftWindow.for_slo(SloConfig())  # 2 s SLO, healthy up to 1.8 s, 5 samples
    for _ in range(4):
        w.add(0.5, 1.0)
    assert w.last(10.0) == (0, None)
    w.add(0.5, 11.0)
    w.add(1.9, 12.0)
    assert w.last(20.0) == (1, pytest.approx(1.9, rel=0.02))
    for _ in range(3):
        w.add(11.0, 21.0)
    assert w.last(30.0) == (2, 2.0)
    ctl = SloController(SloConfig())
    assert [ctl.classify(p) for p in (None, 1.9, 2.0)] == ["healthy", "band", "band"]


def test_sparse_slow_p0_windows_do_not_let_p2_back() -> None:
    """Four P0 streams at ~11 s to first token give 3-4 samples a window: P2 stayed at its
    slow start's 0.1 (the audit saw it double to 0.8 as these windows read healthy)."""
    cfg = AdmissionConfig(budget=256)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")
    t = 0.0
    sync_refresh(gw, coord, t)
    for _ in range(6):  # six 10 s windows
        for k in range(3):
            gw.record_ttft(Priority.P0, 11.0, t + 1.0 + k)
        t += 10.0
        sync_refresh(gw, coord, t + 0.5)
        sync_refresh(gw, coord, t + 5.0)
    assert coord.slo.p2_ceiling == pytest.approx(SloConfig().p2_start)


def test_gateway_reports_feed_the_coordinator_ceiling() -> None:
    """Slow P0 at the gateway: the P1 ceiling falls within 3 windows (one of lag),
    the P1 grant follows, P2 stops; healthy windows bring it back."""
    cfg = AdmissionConfig(budget=256)
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, "g")
    for _ in range(300):
        gw.admit(req(1), 0.0)  # a P1 backlog
    t = 0.0
    ceilings = []
    while t < 80.0:
        t = round(t + 0.5, 6)
        for _ in range(3):
            gw.record_ttft(Priority.P0, 3.5 if t < 30.0 else 0.5, t)
            gw.record_ttft(Priority.P1, 9.0, t)  # P1 TTFT is not the SLO's business
        gw.apply_grant(coord.refresh(gw.make_refresh(t), t), t)
        ceilings.append((t, coord.ceilings[1], gw.stats().class_caps[1]))
    first_cut = next(t for t, c, _ in ceilings if c < 1.0)
    assert first_cut <= 30.5  # breach starts in window [0, 10): cut by the end of window 3
    at_30 = next(c for t, c, _ in ceilings if t == 30.0)
    assert at_30 == pytest.approx(0.8)
    cap_at_30 = next(cap for t, _, cap in ceilings if t == 30.0)
    assert cap_at_30 == 128  # floor(0.8 x (249 - 88)): the gateway's P1 cap follows
    assert ceilings[-1][1] > at_30  # recovering once P0 is fast again
