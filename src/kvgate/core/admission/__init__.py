"""Global admission control: stage 1 at each gateway, leases from a coordinator.

One credit = one in-flight request. Each gateway admits locally, in microseconds,
against a lease of credits (its quota book) and refreshes the lease off the request
path from a :class:`Coordinator`. The coordinator counts a gateway as holding
max(lease, reported lease, in-use), so the gateways together never exceed the
cluster budget C while they reach it. Priority classes (P0 / P1 / P2) share C by
APF arithmetic with Netflix-style work conservation; tenants have global
concurrency quotas; a cluster breaker, a bypass lane, an SLO loop on the P1 ceiling
and a retry budget complete it. When the coordinator is lost the gateway reuses its
lease briefly, then runs a safe local limit: it never fails open.

The design and its sources: shared/research/admission-anchors.md section 8.
"""

from kvgate.core.admission.allocation import (
    ClassBudgets,
    class_budgets,
    max_min_share,
    share_with_slack,
    spread,
)
from kvgate.core.admission.breaker import ClusterBreaker
from kvgate.core.admission.config import (
    AdmissionConfig,
    BreakerConfig,
    ClassConfig,
    LeaseConfig,
    SafeModeConfig,
    SloConfig,
    bypass_pool,
)
from kvgate.core.admission.coordinator import Coordinator, InProcessCoordinator
from kvgate.core.admission.coordinator_record import GatewayRecord
from kvgate.core.admission.gateway import GatewayAdmission
from kvgate.core.admission.queues import FairQueue, QueueEntry
from kvgate.core.admission.quota_book import LocalLimits, QuotaBook
from kvgate.core.admission.retry import (
    NOT_RUN_FAILURES,
    RETRYABLE_FAILURES,
    FailureKind,
    RetryBudget,
    RetryPolicy,
)
from kvgate.core.admission.slo import SloController, TtftWindow
from kvgate.core.admission.stage1 import Stage1Limiter
from kvgate.core.admission.types import (
    PRIORITIES,
    REJECT_HTTP_STATUS,
    REJECT_RETRYABLE,
    AdmissionRequest,
    AdmissionStats,
    Admitted,
    BreakerState,
    CoordinatorUnavailable,
    Decision,
    Lane,
    LeaseGrant,
    LeaseState,
    Priority,
    Queued,
    RefreshRequest,
    Rejected,
    RejectReason,
    TenantUsage,
    Ticket,
    make_rejection,
    overloaded_rejection,
    shutting_down_rejection,
)

__all__ = [
    "NOT_RUN_FAILURES",
    "PRIORITIES",
    "REJECT_HTTP_STATUS",
    "REJECT_RETRYABLE",
    "RETRYABLE_FAILURES",
    "AdmissionConfig",
    "AdmissionRequest",
    "AdmissionStats",
    "Admitted",
    "BreakerConfig",
    "BreakerState",
    "ClassBudgets",
    "ClassConfig",
    "ClusterBreaker",
    "Coordinator",
    "CoordinatorUnavailable",
    "Decision",
    "FailureKind",
    "FairQueue",
    "GatewayAdmission",
    "GatewayRecord",
    "InProcessCoordinator",
    "Lane",
    "LeaseConfig",
    "LeaseGrant",
    "LeaseState",
    "LocalLimits",
    "Priority",
    "QueueEntry",
    "Queued",
    "QuotaBook",
    "RefreshRequest",
    "RejectReason",
    "Rejected",
    "RetryBudget",
    "RetryPolicy",
    "SafeModeConfig",
    "SloConfig",
    "SloController",
    "Stage1Limiter",
    "TenantUsage",
    "Ticket",
    "TtftWindow",
    "bypass_pool",
    "class_budgets",
    "make_rejection",
    "max_min_share",
    "overloaded_rejection",
    "share_with_slack",
    "shutting_down_rejection",
    "spread",
]
