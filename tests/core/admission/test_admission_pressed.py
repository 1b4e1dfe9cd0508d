"""The memory of tenants that pressed their quota: when, who since when, bounded."""

from __future__ import annotations

from kvgate.core.admission.pressed import PressedTenants


def test_when_and_since() -> None:
    p = PressedTenants()
    assert p.at("a") is None and p.since(0.0) == []
    p.note("a", 1.0)
    p.note("b", 5.0)
    p.note("a", 3.0)  # the latest press counts
    assert (p.at("a"), p.at("b")) == (3.0, 5.0)
    assert p.since(4.0) == ["b"] and sorted(p.since(2.0)) == ["a", "b"]
    assert p.since(6.0) == []


def test_the_memory_is_bounded_and_keeps_the_latest() -> None:
    p = PressedTenants(limit=8)
    for i in range(100):
        p.note(f"t{i}", float(i))
    assert len(p.since(0.0)) <= 8
    assert p.at("t99") == 99.0 and p.at("t0") is None
