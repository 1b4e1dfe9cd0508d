"""One gateway's record at the coordinator: what it reported, what it was lent, and
how much of it stays held (``held*``) while the record lapses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.core.admission.types import TenantUsage, Triple


@dataclass(slots=True)
class GatewayRecord:
    gateway_id: str
    expires_at: float
    inuse: Triple = (0, 0, 0)
    wants: Triple = (0, 0, 0)
    has: Triple = (0, 0, 0)
    has_total: int = 0
    lease: Triple = (0, 0, 0)
    lease_total: int = 0
    bypass_inuse: int = 0
    bypass_has: int = 0
    bypass_lease: int = 0
    tenants: Mapping[str, TenantUsage] = field(default_factory=dict)
    tenant_lease: dict[str, int] = field(default_factory=dict)
    learning_until: float = 0.0
    # lapsed (no refresh for a TTL), its whole claim still held until expires_at: its
    # gateway may be cut off alone and still admitting on its last lease (for its
    # reuse_timeout_s), and that lease must not be lent to anyone else meanwhile
    reusing: bool = False
    ghost: bool = False  # expired; only its last in-use is held until expires_at
    # the state's refresh count in its last grant (None: written by an older version)
    serial: int | None = None

    def held(self, c: int) -> int:
        """Class ``c``'s part of what this gateway holds, counted where the credits sit:
        its grant for the class (or what it says it has). A gateway admits P0 (and P1)
        on any free credit, so a class may use more than its grant: on the lease's
        headroom, or on another class's unused grant, which already count them. Only
        a use beyond all of those (a lease that shrank) adds to its class. Counting
        each class's in-use on top of the grants counted a gateway whose P0 ran on its
        P1 grant as 8 held for 6 credits; in-use counted instead of its P0 grant, the
        early gateways' P0 filled the class budget: under mixed P0/P1 overload the
        fleet's leases settled at 20 of 26 credits, split unevenly, for good."""
        inuse = self.inuse
        if self.ghost:
            return inuse[c]
        claim = [max(self.lease[k], self.has[k]) for k in range(3)]
        excess = [max(0, inuse[k] - claim[k]) for k in range(3)]
        spill = excess[0] + excess[1] + excess[2]
        if spill == 0:
            return claim[c]  # the common case: every class within its grant
        headroom = max(0, max(self.lease_total, self.has_total) - sum(claim))
        unused = sum(max(0, claim[k] - inuse[k]) for k in range(3))
        unplaced = max(0, spill - headroom - unused)
        for k in range(c):  # what is left unplaced goes to the highest classes first
            unplaced -= min(excess[k], unplaced)
        return claim[c] + min(excess[c], unplaced)

    def held_total(self) -> int:
        used = self.inuse[0] + self.inuse[1] + self.inuse[2]
        if self.ghost:
            return used
        return max(self.lease_total, self.has_total, used)

    def held_bypass(self) -> int:
        if self.ghost:
            return self.bypass_inuse
        return max(self.bypass_lease, self.bypass_has, self.bypass_inuse)

    def held_tenant(self, tenant: str) -> int:
        usage = self.tenants.get(tenant)
        inuse = usage.inuse if usage is not None else 0
        if self.ghost:
            return inuse
        has = usage.has if usage is not None else 0
        return max(self.tenant_lease.get(tenant, 0), has, inuse)
