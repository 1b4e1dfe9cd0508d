"""Configuration defaults, validation, purity of the package and the hot-path cost."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
from admission_testlib import lease, leased_gateway, req

import kvgate.core.admission as admission
from kvgate.core.admission import (
    AdmissionConfig,
    Admitted,
    BreakerConfig,
    ClassConfig,
    LeaseConfig,
    Priority,
    RejectReason,
    SloConfig,
    make_rejection,
    overloaded_rejection,
)
from kvgate.core.errors import ConfigError


def test_defaults_are_the_documented_ones() -> None:
    cfg = AdmissionConfig()
    assert cfg.budget == 256 and cfg.bypass_fraction == 0.03
    assert [c.share for c in cfg.classes] == [0.7, 0.3, 0.0]
    assert [c.lendable for c in cfg.classes] == [0.5, 1.0, 1.0]
    assert [c.queue_timeout_s for c in cfg.classes] == [30.0, 30.0, 60.0]
    assert [c.queue_limit for c in cfg.classes] == [1024] * 3
    assert cfg.default_tenant_quota is None and cfg.quota_for("anyone") is None
    b = cfg.breaker
    assert (b.error_rate, b.window_s, b.min_outcomes, b.open_s) == (0.5, 10.0, 20, 5.0)
    lc = cfg.lease
    assert (lc.refresh_s, lc.ttl_s, lc.reuse_timeout_s) == (0.5, 2.0, 5.0)
    assert (lc.low_watermark_fraction, lc.low_watermark_min) == (0.1, 2)
    assert lc.early_refresh_min_interval_s == 0.05
    assert (cfg.retry.ratio, cfg.retry.minimum) == (0.2, 3)
    s = cfg.slo
    assert (s.p0_ttft_p99_s, s.window_s, s.decrease, s.floor, s.increase, s.cap) == (
        2.0,
        10.0,
        0.8,
        0.1,
        0.05,
        1.0,
    )
    assert (s.breach_windows, s.healthy_windows) == (2, 3)


def test_tenant_quotas_are_read_only() -> None:
    quotas = {"a": 3}
    cfg = AdmissionConfig(tenant_quotas=quotas, default_tenant_quota=1)
    quotas["a"] = 99
    assert cfg.quota_for("a") == 3 and cfg.quota_for("b") == 1
    with pytest.raises(TypeError):
        cfg.tenant_quotas["a"] = 5  # type: ignore[index]


BAD: list[dict[str, Any]] = [
    {"budget": 0},
    {"classes": (ClassConfig(share=0.0, lendable=0.5),) * 3},
    {
        "classes": (
            ClassConfig(share=0.8, lendable=0.5),
            ClassConfig(share=0.3, lendable=1.0),
            ClassConfig(share=0.0, lendable=1.0),
        )
    },
    {
        "classes": (
            ClassConfig(share=0.7, lendable=1.5),
            ClassConfig(share=0.3, lendable=1.0),
            ClassConfig(share=0.0, lendable=1.0),
        )
    },
    {"bypass_fraction": 0.9},
    {"tenant_quotas": {"a": -1}},
    {"breaker": BreakerConfig(error_rate=0.0)},
    {"breaker": BreakerConfig(half_open_probes=0)},
    {"lease": LeaseConfig(ttl_s=0.4)},
    {"lease": LeaseConfig(margin_s=3.0)},
    {"lease": LeaseConfig(expected_gateways=0)},
    {"slo": SloConfig(decrease=1.2)},
    {"slo": SloConfig(floor=0.0)},
    {"slo": SloConfig(healthy_windows=0)},
    {"slo": SloConfig(p2_start=0.0)},
    {"slo": SloConfig(p2_start=1.5)},
    # NaN passes every range check by comparison, and inf is no time at all
    {"lease": LeaseConfig(reuse_timeout_s=math.nan)},  # never SAFE: fails open
    {"lease": LeaseConfig(ttl_s=math.inf)},
    {"lease": LeaseConfig(refresh_s=math.nan)},
    {
        "classes": (
            ClassConfig(share=0.7, lendable=0.5, queue_timeout_s=math.nan),  # never expires
            ClassConfig(share=0.3, lendable=1.0),
            ClassConfig(share=0.0, lendable=1.0),
        )
    },
    {
        "classes": (
            ClassConfig(share=math.nan, lendable=0.5),
            ClassConfig(share=0.3, lendable=1.0),
            ClassConfig(share=0.0, lendable=1.0),
        )
    },
    {"reclaim_retry_after_s": math.inf},
    {"tenant_retry_after_s": -1.0},
    {"slo": SloConfig(p0_ttft_p99_s=math.nan)},
    {"breaker": BreakerConfig(open_s=math.inf)},
]


@pytest.mark.parametrize("kwargs", BAD)
def test_bad_config_is_a_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AdmissionConfig(**kwargs)


def test_rejection_helpers() -> None:
    r = overloaded_rejection("no node can take it")
    assert (r.reason, r.http_status, r.retryable_by_client) == (RejectReason.OVERLOADED, 503, False)
    assert r.request_id == ""
    assert make_rejection(RejectReason.DEGRADED, "x").retryable_by_client
    assert make_rejection(RejectReason.QUEUE_TIMEOUT, "x").http_status == 429


FORBIDDEN = {"asyncio", "aiohttp", "socket", "time", "random", "logging", "redis", "zmq"}


def test_the_admission_package_is_pure() -> None:
    pkg = Path(admission.__file__).parent
    files = sorted(pkg.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        tree = ast.parse(path.read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
        assert not roots & FORBIDDEN, (path.name, roots & FORBIDDEN)
        assert len(path.read_text().splitlines()) <= 400, path.name


def test_hot_path_admit_and_release_balance() -> None:
    """admit + release on a warmed gateway, many times over: every credit comes back.
    (Its cost is measured by ``benchmarks/bench_core.py``, not asserted here: these
    machines are shared and noisy.)"""
    gw = leased_gateway(
        lease((100, 100, 0), tenants={"t": 1000}),
        AdmissionConfig(budget=1000, tenant_quotas={"t": 1000}),
    )
    reqs = [req(i % 2, "t") for i in range(200)]
    for _ in range(21):
        for r in reqs:
            d = gw.admit(r, 0.1)
            assert isinstance(d, Admitted)
            gw.release(d.ticket, 0.1)
    assert gw.inuse_total == 0 and gw.stats().admitted[Priority.P0] == 2100
