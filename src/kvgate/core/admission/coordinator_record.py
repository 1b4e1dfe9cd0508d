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

    def held(self, c: int) -> int:
        if self.ghost:
            return self.inuse[c]
        return max(self.lease[c], self.has[c], self.inuse[c])

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
