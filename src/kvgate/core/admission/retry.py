"""The gateway's retry rule: at most one retry, before the first byte, within a budget.

Envoy's defaults are the anchor (``num_retries`` = 1, previous-host predicate, a
retry budget of 20 % of active requests with a minimum of 3; admission-anchors 8.8):

- only an attempt that failed **before the first byte** may be retried (after it the
  client has seen output, and a replay would duplicate it);
- only for failures that say "another node may do it": a connect error, a bare 503
  (plain vLLM), an explicit ``retry-elsewhere`` reject, a node refusing the gateway's
  credentials (401 / 403 / 407), or an attempt aborted because its node was marked
  down before it answered;
- never ``pool-overloaded`` (the whole pool is full: a retry only adds load), never a
  timeout (the deadline is spent), an upstream error after work began, a 429 or a
  client error;
- never when the request is itself a client retry naming a node it wants avoided
  (the client is retrying; two layers of retries multiply);
- only while retries in flight < max(minimum, ratio x active requests).

A retry reuses the request's admission ticket, so it takes no new global credit;
the resulting amplification is at most 1 + ratio (1.2x).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kvgate.core.errors import ConfigError

if TYPE_CHECKING:
    from kvgate.core.admission.config import AdmissionConfig


class FailureKind(StrEnum):
    """Why an attempt at a node failed, as the gateway classifies it."""

    CONNECT_ERROR = "connect_error"  # no connection: the node never saw the request
    NODE_DOWN = "node_down"  # the node was marked down before it answered: aborted
    HTTP_503 = "http_503"  # a bare 503 (plain vLLM): treated as retry-elsewhere
    RETRY_ELSEWHERE = "retry_elsewhere"  # node reject: this node is busy, try another
    POOL_OVERLOADED = "pool_overloaded"  # node reject: the whole pool is full, do not retry
    TIMEOUT = "timeout"  # no first byte in time
    UPSTREAM_ERROR = "upstream_error"  # 5xx other than 503, reset, protocol error
    RATE_LIMITED = "rate_limited"  # 429: the node sheds load (not the client's fault)
    CLIENT_ERROR = "client_error"  # 4xx but 429: the request itself is bad, the node is fine
    # 401 / 403 / 407 from a node: it refused the gateway's own credentials (the client's
    # are never forwarded), so it never ran the request and will refuse every request
    NODE_AUTH = "node_auth"


RETRYABLE_FAILURES: frozenset[FailureKind] = frozenset(
    {
        FailureKind.CONNECT_ERROR,
        FailureKind.NODE_DOWN,
        FailureKind.HTTP_503,
        FailureKind.RETRY_ELSEWHERE,
        FailureKind.NODE_AUTH,
    }
)

# The node never ran the request (it refused it, or went down before answering): the
# client may send it again as it is, so when the gateway cannot retry it the answer is
# a 503, not a 502 Bad Gateway.
NOT_RUN_FAILURES: frozenset[FailureKind] = frozenset(
    {
        FailureKind.NODE_DOWN,
        FailureKind.HTTP_503,
        FailureKind.RETRY_ELSEWHERE,
        FailureKind.POOL_OVERLOADED,
        FailureKind.RATE_LIMITED,
    }
)

MAX_ATTEMPTS = 2  # the first attempt plus one retry


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudget:
    """Retries in flight may not reach max(minimum, ratio x active requests)."""

    ratio: float = 0.2
    minimum: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"retry budget ratio must be in [0, 1], got {self.ratio}")
        if self.minimum < 0:
            raise ConfigError(f"retry budget minimum must be >= 0, got {self.minimum}")

    def limit(self, active_requests: int) -> float:
        return max(float(self.minimum), self.ratio * max(0, active_requests))

    def allows(self, *, active_requests: int, retries_in_flight: int) -> bool:
        return retries_in_flight < self.limit(active_requests)


class RetryPolicy:
    """Decides whether a failed attempt is retried once on another node.

    ``RetryPolicy()`` uses the default budget; ``RetryPolicy(budget)`` or
    ``RetryPolicy(admission_config)`` (its ``retry`` budget) configure it.
    """

    __slots__ = ("budget",)

    def __init__(self, config: AdmissionConfig | RetryBudget | None = None) -> None:
        if config is None:
            self.budget = RetryBudget()
        elif isinstance(config, RetryBudget):
            self.budget = config
        else:
            self.budget = config.retry

    def decide(
        self,
        failure: FailureKind,
        *,
        before_first_byte: bool,
        attempts_so_far: int,
        client_named_excluded_node: bool,
        active_requests: int,
        retries_in_flight: int,
    ) -> bool:
        """True: retry once on a different node (excluding the failed one), same ticket."""
        if attempts_so_far < 1 or attempts_so_far >= MAX_ATTEMPTS:
            return False
        if not before_first_byte or client_named_excluded_node:
            return False
        if failure not in RETRYABLE_FAILURES:
            return False
        return self.budget.allows(
            active_requests=active_requests, retries_in_flight=retries_in_flight
        )
