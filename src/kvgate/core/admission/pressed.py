"""Which tenants press their quota: refused while already holding their share of it.

Such a tenant asks for more than its quota (a flood), unlike one refused on a lease
smaller than its share (the others' leases still hold the rest). The controller confines it
to the nodes it holds (``tenant_confine_s``), and discounts those nodes' cache for the
other tenants, so its flood stalls few nodes, which the others avoid.
"""

from __future__ import annotations

import math

__all__ = ["PressedTenants"]


class PressedTenants:
    """When each tenant last pressed its quota; bounded."""

    __slots__ = ("_at", "_last", "limit")

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._at: dict[str, float] = {}
        self._last = -math.inf  # the latest press of any tenant

    def note(self, tenant: str, now: float) -> None:
        at = self._at
        at[tenant] = now
        self._last = max(self._last, now)
        if len(at) > self.limit:  # forget the longest quiet half
            cut = sorted(at.values())[len(at) // 2]
            self._at = {t: when for t, when in at.items() if when >= cut}

    def at(self, tenant: str) -> float | None:
        """When ``tenant`` last pressed its quota, or None."""
        return self._at.get(tenant)

    def since(self, since: float) -> list[str]:
        """The tenants that pressed their quota at ``since`` or later."""
        if self._last < since:
            return []
        return [t for t, when in self._at.items() if when >= since]
