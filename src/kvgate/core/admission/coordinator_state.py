"""The coordinator's whole state as plain JSON data, so a shared store can hold it.

A remote coordinator (Redis) keeps no logic of its own: each refresh loads this state,
runs the very same :meth:`InProcessCoordinator.refresh` on it at the store's clock, and
writes it back atomically (see ``gateway/redis_coordinator.py``). One implementation
of the lease rules therefore serves one gateway, the simulator and a fleet.

Pure: dicts, lists, numbers and strings in and out; no I/O. ``load_state(config,
dump_state(c))`` behaves exactly like ``c`` from then on (a test checks refresh by
refresh). The configuration is not stored: every gateway of a fleet is expected to
run the same admission settings; each refresh applies those of the gateway making it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvgate.core.admission.config import AdmissionConfig
from kvgate.core.admission.coordinator import InProcessCoordinator
from kvgate.core.admission.coordinator_record import GatewayRecord
from kvgate.core.admission.types import TenantUsage, Triple
from kvgate.core.errors import ConfigError

STATE_VERSION = 1

_SLO_FIELDS = (
    "p1_ceiling", "breach_streak", "healthy_streak", "windows", "decreases",
    "increases",
)


def dump_state(coord: InProcessCoordinator) -> dict[str, Any]:
    """Everything a later refresh reads, as JSON-ready data."""
    return {
        "v": STATE_VERSION,
        "epoch": coord.epoch,
        "learn_on_start": coord.learn_on_start,
        "capacity": coord.capacity,
        "learning_until": coord.learning_until,
        "epoch_started": coord.epoch_started,
        "refreshes": coord.refreshes,
        "clock_s": coord.clock_s,
        "clock_offset_s": coord.clock_offset_s,
        "slo": {
            **{name: getattr(coord.slo, name) for name in _SLO_FIELDS},
            # P2's ceiling is a fraction now (slow start); "p2_on" is kept for gateways
            # of the version before, which read only that (a rolling upgrade)
            "p2_on": coord.slo.p2_on,
            "p2_ceiling": coord.slo.p2_ceiling,
        },
        "slo_seen": dict(coord.slo_seen),
        "slo_pending": dict(coord.slo_pending),
        "slo_next": coord.slo_next,
        "records": {gid: _dump_record(rec) for gid, rec in coord.records.items()},
    }


def load_state(config: AdmissionConfig, data: Mapping[str, Any]) -> InProcessCoordinator:
    """A coordinator in the state ``data`` (from :func:`dump_state`) describes."""
    if data.get("v") != STATE_VERSION:
        raise ConfigError(
            f"coordinator state version {data.get('v')!r} is not {STATE_VERSION}: "
            "gateways of different kvgate versions share one store"
        )
    coord = InProcessCoordinator(
        config, epoch=str(data["epoch"]), learn_on_start=bool(data["learn_on_start"])
    )
    coord.capacity = int(data["capacity"])
    coord.learning_until = float(data["learning_until"])
    started = data.get("epoch_started")  # absent from state an older version wrote
    coord.epoch_started = None if started is None else float(started)
    coord.refreshes = int(data["refreshes"])
    # absent from state an older version wrote
    coord.clock_s = float(data.get("clock_s", -math.inf))
    coord.clock_offset_s = float(data.get("clock_offset_s", 0.0))
    slo = data["slo"]
    for name in _SLO_FIELDS:
        setattr(coord.slo, name, slo[name])
    # written by a gateway of the version before: on or off, no slow start
    if "p2_ceiling" in slo:
        coord.slo.p2_ceiling = float(slo["p2_ceiling"])
    else:
        coord.slo.p2_ceiling = 1.0 if slo["p2_on"] else 0.0
    coord.slo_seen.update({str(k): int(v) for k, v in data["slo_seen"].items()})
    coord.slo_pending.update(
        {str(k): (None if v is None else float(v)) for k, v in data["slo_pending"].items()}
    )
    nxt = data["slo_next"]
    coord.slo_next = None if nxt is None else float(nxt)
    coord.records.update(
        {str(gid): _load_record(str(gid), rec) for gid, rec in data["records"].items()}
    )
    return coord


def _dump_record(rec: GatewayRecord) -> dict[str, Any]:
    return {
        "expires_at": rec.expires_at,
        "inuse": list(rec.inuse),
        "wants": list(rec.wants),
        "has": list(rec.has),
        "has_total": rec.has_total,
        "lease": list(rec.lease),
        "lease_total": rec.lease_total,
        "bypass_inuse": rec.bypass_inuse,
        "bypass_has": rec.bypass_has,
        "bypass_lease": rec.bypass_lease,
        "tenants": {t: [u.inuse, u.wants, u.has] for t, u in rec.tenants.items()},
        "tenant_lease": dict(rec.tenant_lease),
        "learning_until": rec.learning_until,
        "reusing": rec.reusing,
        "ghost": rec.ghost,
        "serial": rec.serial,
    }


def _triple(value: Any) -> Triple:
    a, b, c = (int(x) for x in value)
    return (a, b, c)


def _load_record(gid: str, d: Mapping[str, Any]) -> GatewayRecord:
    return GatewayRecord(
        gateway_id=gid,
        expires_at=float(d["expires_at"]),
        inuse=_triple(d["inuse"]),
        wants=_triple(d["wants"]),
        has=_triple(d["has"]),
        has_total=int(d["has_total"]),
        lease=_triple(d["lease"]),
        lease_total=int(d["lease_total"]),
        bypass_inuse=int(d["bypass_inuse"]),
        bypass_has=int(d["bypass_has"]),
        bypass_lease=int(d["bypass_lease"]),
        tenants={
            str(t): TenantUsage(inuse=int(u[0]), wants=int(u[1]), has=int(u[2]))
            for t, u in d["tenants"].items()
        },
        tenant_lease={str(t): int(n) for t, n in d["tenant_lease"].items()},
        learning_until=float(d["learning_until"]),
        reusing=bool(d.get("reusing", False)),  # absent in state an older version wrote
        ghost=bool(d["ghost"]),
        serial=None if d.get("serial") is None else int(d["serial"]),  # absent: older
    )
