"""Admission configuration: one frozen value, validated at construction (ConfigError).

Defaults follow admission-anchors section 8 and the design brief; each knob says
what it does and where its number comes from. ``AdmissionConfig()`` is a sane
single-gateway setup with a budget of 256 concurrent requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvgate.core.admission.retry import RetryBudget
from kvgate.core.admission.types import NUM_CLASSES
from kvgate.core.errors import ConfigError
from kvgate.core.finite import first_nonfinite


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassConfig:
    """One priority class (APF arithmetic: NominalCL = ceil(C x share))."""

    share: float  # nominal share of the class capacity
    lendable: float  # fraction of NominalCL other classes may borrow (APF lendablePercent)
    queue_limit: int = 1024  # queued requests of this class at one gateway
    queue_timeout_s: float = 30.0  # longest wait in the queue before QUEUE_TIMEOUT


def _default_classes() -> tuple[ClassConfig, ClassConfig, ClassConfig]:
    return (
        ClassConfig(share=0.7, lendable=0.5, queue_timeout_s=30.0),
        ClassConfig(share=0.3, lendable=1.0, queue_timeout_s=30.0),
        ClassConfig(share=0.0, lendable=1.0, queue_timeout_s=60.0),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerConfig:
    """The cluster breaker: opens on error rate, or while no node is healthy."""

    error_rate: float = 0.5  # open when failures / outcomes >= this ...
    window_s: float = 10.0  # ... over this sliding window ...
    min_outcomes: int = 20  # ... with at least this many outcomes in it
    buckets: int = 10  # window resolution (window_s / buckets per bucket)
    open_s: float = 5.0  # stay open this long, then half-open
    half_open_probes: int = 3  # admits allowed half-open; that many successes close it


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseConfig:
    """The quota book's lease timing (Doorman leases, RLQS states)."""

    refresh_s: float = 0.5  # periodic refresh (x(1 +- jitter) when an rng is given)
    jitter: float = 0.1
    ttl_s: float = 2.0  # the coordinator keeps a gateway's record this long (3-4 refreshes)
    margin_s: float = 0.2  # local_deadline = t_sent + ttl - margin (monotonic clock)
    reuse_timeout_s: float = 5.0  # EXPIRED_REUSING: keep the last lease this long, then SAFE
    low_watermark_fraction: float = 0.1  # early refresh when free < max(min, fraction x lease)
    low_watermark_min: int = 2
    early_refresh_min_interval_s: float = 0.05  # coalescing: at most one early refresh per 50 ms
    expected_gateways: int = 1  # NO_ASSIGNMENT capacity = C / expected_gateways (P0 only)
    # credits a quota tenant may use at a gateway of a fleet before the lease has an
    # entry for it; beyond them its requests wait for the grant (0: the fleet never
    # exceeds the quota). A fleet of one (expected_gateways 1) takes the whole quota.
    tenant_first_sight_allowance: int = 0
    reclaim_grace_s: float = 0.0  # coordinator keeps an expired gateway's inuse held this long


@dataclass(frozen=True, slots=True, kw_only=True)
class SafeModeConfig:
    """SAFE: limit = min(last lease, C / gateways last seen); P2 off; dispatch gated."""

    p2_enabled: bool = False  # the brief: P2 off in safe mode (rejected DEGRADED)
    retry_after_s: float = 5.0  # Retry-After on DEGRADED rejections


@dataclass(frozen=True, slots=True, kw_only=True)
class SloConfig:
    """The P0 TTFT SLO loop: AIMD on the P1 ceiling, with a hysteresis band."""

    p0_ttft_p99_s: float = 2.0  # the SLO
    window_s: float = 10.0
    min_samples: int = 5  # fewer P0 samples: healthy if all are, else the band (slo.py)
    healthy_fraction: float = 0.9  # healthy only when p99 <= 0.9 x SLO (the band in between
    # counts as neither breach nor healthy: this is the hysteresis)
    breach_windows: int = 2  # consecutive breached windows before a decrease
    decrease: float = 0.8  # multiplicative decrease of the P1 ceiling
    floor: float = 0.1
    healthy_windows: int = 3  # consecutive healthy windows before an increase
    increase: float = 0.05  # additive increase
    cap: float = 1.0
    # P2's ceiling when it (re)starts: at start-up and after a breach held it off; it
    # doubles every healthy window up to 1 (slow start: 0.1, 0.2, 0.4, 0.8, 1 over 40 s).
    # P2 holds a credit for its request's whole life, so what it takes in one window
    # P0 gets back only as those requests end. 1.0: all idle capacity at once.
    p2_start: float = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    budget: int = 256  # configured cluster concurrency C (C_eff = min(C, healthy capacity))
    classes: tuple[ClassConfig, ClassConfig, ClassConfig] = field(default_factory=_default_classes)
    bypass_fraction: float = 0.03  # bypass pool carved out of C (>= 1 credit per gateway)
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)  # tenant -> max concurrency
    default_tenant_quota: int | None = None  # unknown tenants; None = unlimited
    tenant_retry_after_s: float = 1.0  # Retry-After on TENANT_QUOTA
    # P2 borrows idle credits and holds each for its request's whole life; while P0 or
    # P1 requests wait here for credits P2 holds beyond its share, end as many P2
    # requests (those that have sent the client nothing first, then the youngest):
    # PREEMPTED, 503 with Retry-After (Kueue's reclaimWithinCohort at request scale)
    reclaim_p2: bool = True
    reclaim_retry_after_s: float = 5.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    safe_mode: SafeModeConfig = field(default_factory=SafeModeConfig)
    retry: RetryBudget = field(default_factory=RetryBudget)
    slo: SloConfig = field(default_factory=SloConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_quotas", MappingProxyType(dict(self.tenant_quotas)))
        _validate(self)

    def quota_for(self, tenant: str) -> int | None:
        return self.tenant_quotas.get(tenant, self.default_tenant_quota)

    def bypass_credits(self, capacity: int) -> int:
        """The bypass pool carved out of ``capacity`` for this fleet (:func:`bypass_pool`)."""
        return bypass_pool(capacity, self.bypass_fraction, self.lease.expected_gateways)


# ----------------------------------------------------------------------------- arithmetic


def bypass_pool(capacity: int, fraction: float, gateways: int = 1) -> int:
    """Credits of C reserved for the bypass lane: max(gateways, floor(fraction x C)),
    at most C - 1.

    At least one per gateway of the fleet: the coordinator splits the pool over the
    live gateways, and a gateway granted none refuses every probe and emergency
    request while another gateway's credit sits idle (3 % of a C of 40 is one credit
    for two gateways). 0 when the fraction is 0 or C < 2 (one credit cannot be split
    between lanes).
    """
    if fraction <= 0.0 or capacity < 2:
        return 0
    return min(capacity - 1, max(1, gateways, math.floor(capacity * fraction + 1e-9)))


def ceil_fraction(value: int, fraction: float) -> int:
    """ceil(value x fraction), immune to float noise such as 100 x 0.7 = 70.00000000000001."""
    return math.ceil(round(value * fraction, 9))


def floor_fraction(value: int, fraction: float) -> int:
    return math.floor(round(value * fraction, 9))


def _validate(cfg: AdmissionConfig) -> None:
    if (bad := first_nonfinite(cfg)) is not None:  # before any range check: NaN passes them
        raise ConfigError(f"admission {bad[0]} must be a finite number", param=bad[0])
    if cfg.budget < 1:
        raise ConfigError(f"admission budget must be >= 1, got {cfg.budget}", param="budget")
    if len(cfg.classes) != NUM_CLASSES:
        raise ConfigError("admission needs exactly three classes (P0, P1, P2)", param="classes")
    shares = [c.share for c in cfg.classes]
    if any(s < 0.0 for s in shares) or shares[0] <= 0.0 or sum(shares) > 1.0 + 1e-9:
        raise ConfigError(f"class shares must be >= 0, P0 > 0, sum <= 1: {shares}")
    for i, c in enumerate(cfg.classes):
        if not 0.0 <= c.lendable <= 1.0:
            raise ConfigError(f"P{i} lendable must be in [0, 1], got {c.lendable}")
        if c.queue_limit < 0:
            raise ConfigError(f"P{i} queue_limit must be >= 0, got {c.queue_limit}")
        if not c.queue_timeout_s > 0.0:
            raise ConfigError(f"P{i} queue_timeout_s must be > 0, got {c.queue_timeout_s}")
    if cfg.reclaim_retry_after_s < 0.0 or cfg.tenant_retry_after_s < 0.0:
        raise ConfigError(
            "reclaim_retry_after_s and tenant_retry_after_s must be >= 0",
            param="reclaim_retry_after_s",
        )
    if cfg.safe_mode.retry_after_s < 0.0:
        raise ConfigError("safe_mode.retry_after_s must be >= 0", param="safe_mode")
    if not 0.0 <= cfg.bypass_fraction <= 0.5:
        raise ConfigError(f"bypass_fraction must be in [0, 0.5], got {cfg.bypass_fraction}")
    quotas = dict(cfg.tenant_quotas)
    if cfg.default_tenant_quota is not None:
        quotas["(default_tenant_quota)"] = cfg.default_tenant_quota
    if negative := sorted(t for t, q in quotas.items() if q < 0):
        raise ConfigError(
            f"tenant quotas must be >= 0: {', '.join(f'{t} = {quotas[t]}' for t in negative)}",
            param="tenant_quotas",
        )
    b = cfg.breaker
    if not 0.0 < b.error_rate <= 1.0 or b.window_s <= 0 or b.buckets < 1 or b.open_s <= 0:
        raise ConfigError("breaker: error_rate in (0, 1], window_s, buckets, open_s > 0")
    if b.min_outcomes < 1 or b.half_open_probes < 1:
        raise ConfigError("breaker: min_outcomes and half_open_probes must be >= 1")
    lc = cfg.lease
    if lc.refresh_s <= 0 or lc.ttl_s <= lc.refresh_s:
        raise ConfigError("lease: need 0 < refresh_s < ttl_s", param="lease")
    if not 0.0 <= lc.margin_s < lc.ttl_s or lc.reuse_timeout_s < 0 or not 0 <= lc.jitter < 1:
        raise ConfigError("lease: need 0 <= margin_s < ttl_s, reuse_timeout_s >= 0, jitter < 1")
    if lc.expected_gateways < 1 or lc.tenant_first_sight_allowance < 0:
        raise ConfigError("lease: expected_gateways >= 1, tenant_first_sight_allowance >= 0")
    if lc.low_watermark_min < 0 or lc.early_refresh_min_interval_s < 0 or lc.reclaim_grace_s < 0:
        raise ConfigError("lease: watermark, early interval and reclaim grace must be >= 0")
    s = cfg.slo
    if s.p0_ttft_p99_s <= 0 or s.window_s <= 0 or not 0 < s.healthy_fraction <= 1:
        raise ConfigError("slo: p0_ttft_p99_s, window_s > 0 and healthy_fraction in (0, 1]")
    if not 0 < s.decrease < 1 or not 0 < s.floor <= s.cap <= 1 or s.increase <= 0:
        raise ConfigError("slo: 0 < decrease < 1, 0 < floor <= cap <= 1, increase > 0")
    if not 0 < s.p2_start <= 1:
        raise ConfigError(f"slo: p2_start must be in (0, 1], got {s.p2_start}")
    if s.breach_windows < 1 or s.healthy_windows < 1 or s.min_samples < 1:
        raise ConfigError("slo: breach_windows, healthy_windows, min_samples >= 1")
