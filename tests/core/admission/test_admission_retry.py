"""Retry policy: at most one retry, before the first byte, retryable kinds, in budget."""

from __future__ import annotations

import pytest

from kvgate.core.admission import (
    AdmissionConfig,
    FailureKind,
    RetryBudget,
    RetryPolicy,
)
from kvgate.core.errors import ConfigError

F = FailureKind
# failure, before first byte, attempts so far, client named excluded node, active, retries
# in flight -> retry?
ROWS: list[tuple[str, FailureKind, bool, int, bool, int, int, bool]] = [
    ("connect error", F.CONNECT_ERROR, True, 1, False, 10, 0, True),
    ("bare 503 (plain vLLM)", F.HTTP_503, True, 1, False, 10, 0, True),
    ("node says retry elsewhere", F.RETRY_ELSEWHERE, True, 1, False, 10, 0, True),
    ("pool overloaded: never", F.POOL_OVERLOADED, True, 1, False, 10, 0, False),
    ("client error: never", F.CLIENT_ERROR, True, 1, False, 10, 0, False),
    ("timeout: deadline spent", F.TIMEOUT, True, 1, False, 10, 0, False),
    ("upstream error", F.UPSTREAM_ERROR, True, 1, False, 10, 0, False),
    ("after the first byte: never", F.CONNECT_ERROR, False, 1, False, 10, 0, False),
    ("503 after first byte", F.HTTP_503, False, 1, False, 10, 0, False),
    ("second failure: at most one retry", F.RETRY_ELSEWHERE, True, 2, False, 10, 0, False),
    ("not attempted yet", F.CONNECT_ERROR, True, 0, False, 10, 0, False),
    ("client retry naming a node", F.RETRY_ELSEWHERE, True, 1, True, 10, 0, False),
    ("budget minimum 3: 2 in flight ok", F.HTTP_503, True, 1, False, 5, 2, True),
    ("budget minimum 3: 3 in flight no", F.HTTP_503, True, 1, False, 5, 3, False),
    ("budget 20 % of 100: 19 ok", F.CONNECT_ERROR, True, 1, False, 100, 19, True),
    ("budget 20 % of 100: 20 no", F.CONNECT_ERROR, True, 1, False, 100, 20, False),
]


@pytest.mark.parametrize(
    ("name", "failure", "before", "attempts", "named", "active", "retries", "expected"),
    ROWS,
    ids=[r[0] for r in ROWS],
)
def test_retry_policy_table(
    name: str,
    failure: FailureKind,
    before: bool,
    attempts: int,
    named: bool,
    active: int,
    retries: int,
    expected: bool,
) -> None:
    policy = RetryPolicy()
    got = policy.decide(
        failure,
        before_first_byte=before,
        attempts_so_far=attempts,
        client_named_excluded_node=named,
        active_requests=active,
        retries_in_flight=retries,
    )
    assert got is expected


def test_retry_budget() -> None:
    b = RetryBudget()
    assert (b.ratio, b.minimum) == (0.2, 3)
    assert b.limit(0) == 3 and b.limit(10) == 3 and b.limit(50) == 10 and b.limit(1000) == 200
    assert b.allows(active_requests=0, retries_in_flight=2)
    assert not b.allows(active_requests=0, retries_in_flight=3)
    tight = RetryBudget(ratio=0.1, minimum=0)
    assert tight.allows(active_requests=5, retries_in_flight=0) is not False  # 0 < 0.5
    assert not tight.allows(active_requests=0, retries_in_flight=0)
    with pytest.raises(ConfigError):
        RetryBudget(ratio=1.5)
    with pytest.raises(ConfigError):
        RetryBudget(minimum=-1)


def test_policy_takes_the_budget_from_the_admission_config() -> None:
    cfg = AdmissionConfig(retry=RetryBudget(ratio=0.0, minimum=1))
    policy = RetryPolicy(cfg)
    kw = {"before_first_byte": True, "attempts_so_far": 1, "client_named_excluded_node": False}
    assert policy.decide(F.HTTP_503, active_requests=1000, retries_in_flight=0, **kw)
    assert not policy.decide(F.HTTP_503, active_requests=1000, retries_in_flight=1, **kw)
    assert RetryPolicy(RetryBudget(minimum=7)).budget.minimum == 7


def test_amplification_under_total_node_failure_is_bounded() -> None:
    """Every first attempt fails retryably: attempts / requests <= 1 + ratio."""
    policy = RetryPolicy()
    active, retries, attempts = 1000, 0, 0
    for _ in range(active):
        attempts += 1
        if policy.decide(
            F.CONNECT_ERROR,
            before_first_byte=True,
            attempts_so_far=1,
            client_named_excluded_node=False,
            active_requests=active,
            retries_in_flight=retries,
        ):
            retries += 1  # the retry also fails but stays in flight (worst case)
            attempts += 1
    assert attempts / active <= 1.2
