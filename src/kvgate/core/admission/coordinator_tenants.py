"""Tenant quotas at the coordinator: each quota tenant's lease per gateway, and the
tenants whose quota the fleet's requests already fill. Pure functions over the
gateway records (:mod:`kvgate.core.admission.coordinator`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvgate.core.admission.allocation import share_with_slack
from kvgate.core.admission.config import AdmissionConfig
from kvgate.core.admission.coordinator_record import GatewayRecord


def tenants_full(
    config: AdmissionConfig, records: Iterable[GatewayRecord], rec: GatewayRecord
) -> frozenset[str]:
    """The tenants ``rec`` reports whose quota the requests every gateway reports
    (in flight or queued there) already fill."""
    recs = list(records)
    return frozenset(
        t
        for t in rec.tenants
        if (quota := config.quota_for(t)) is not None
        and quota <= sum(r.tenants[t].inuse for r in recs if t in r.tenants)
    )


def tenant_grants(
    config: AdmissionConfig,
    rec: GatewayRecord,
    others: list[GatewayRecord],
    live: list[GatewayRecord],
    unseen: list[str],
) -> dict[str, int]:
    """Each quota tenant in use anywhere (or reported by ``rec``): a max-min share of
    its quota by wants, what nobody wants spread over the fleet (``live``, and the
    ``unseen`` placeholders of expected gateways), so a gateway that sees the tenant
    next already holds a lease for it (it would otherwise wait for the others' next
    refreshes to give some back); at most what the ``others`` do not hold."""
    out: dict[str, int] = {}
    in_use = {t for r in live for t, u in r.tenants.items() if u.wants > 0 or u.inuse > 0}
    placeholders = dict.fromkeys(unseen, 0)  # the same for every tenant
    for tenant in sorted(rec.tenants.keys() | in_use):
        quota = config.quota_for(tenant)
        if quota is None:
            continue
        wants = {
            r.gateway_id: r.tenants[tenant].wants if tenant in r.tenants else 0 for r in live
        } | placeholders
        fair = share_with_slack(quota, wants).get(rec.gateway_id, 0)
        free = quota - sum(o.held_tenant(tenant) for o in others)
        out[tenant] = max(0, min(fair, free))
    return out
