"""Passwords in URLs (a node's, the Redis coordinator's) never leave the gateway."""

from __future__ import annotations

import json
from typing import Any

from kvgate.gateway.admin import redact_url, redacted_config
from kvgate.gateway.config import AdmissionSection, GatewayConfig, NodeConfig, NodesConfig


def test_redact_url_hides_passwords_and_keeps_the_rest() -> None:
    assert redact_url("http://10.0.0.1:8000") == "http://10.0.0.1:8000"
    assert redact_url("http://svc:pw@h:1/v1?x=1") == "http://svc:***@h:1/v1?x=1"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("http://token@h:1") == "http://***@h:1"
    assert redact_url("unix:///tmp/r.sock?db=0&password=pw") == (
        "unix:///tmp/r.sock?db=0&password=***")
    assert redact_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"
    # redis-py decodes the query's keys: pass%77ord is its password too
    shown = redact_url("redis://h:6379/0?pass%77ord=s3cret&db=1")
    assert "s3cret" not in shown and shown.endswith("password=***&db=1")


def test_redacted_config_hides_url_passwords() -> None:
    cfg = GatewayConfig(
        nodes=NodesConfig(static=(NodeConfig(id="a", url="http://svc:node-pw-1@h:1"),)),
        admission=AdmissionSection(redis_url="redis://:redis-pw-2@h:6379/0"),
    )
    out = redacted_config(cfg)
    text = json.dumps(out, allow_nan=False)
    assert "node-pw-1" not in text and "redis-pw-2" not in text
    assert out["nodes"]["static"][0]["url"] == "http://svc:***@h:1"
    assert out["admission"]["redis_url"] == "redis://:***@h:6379/0"


def test_node_url_passwords_stay_off_the_admin_api_and_dashboard(admin_kit: Any) -> None:
    secrets = ("node-url-pass-77", "redis-url-pass-88")

    async def body() -> None:
        async with admin_kit.stack(
            1, admission={"redis_url": f"redis://:{secrets[1]}@10.0.0.9:6379/0"},
        ) as s:
            extra = await admin_kit.start_engine("e5")
            try:
                url = extra.url.replace("http://", f"http://svc:{secrets[0]}@")
                status, node, _ = await s.call("POST", "/admin/nodes", {"url": url, "id": "e5"})
                assert status == 201
                assert node["url"] == extra.url.replace("http://", "http://svc:***@")
                seen = [json.dumps(node)]
                for path in ("/admin/config", "/admin/nodes", "/admin/nodes/e5"):
                    status, got, _ = await s.call("GET", path)
                    assert status == 200
                    seen.append(json.dumps(got))
                for path in ("/dashboard/state", "/dashboard"):
                    status, got, _ = await s.call("GET", path, token=None)
                    assert status == 200
                    seen.append(got if isinstance(got, str) else json.dumps(got))
            finally:
                await extra.stop()
            for text in seen:
                assert not any(sec in text for sec in secrets), text[:200]

    admin_kit.run(body())


def test_the_redis_coordinator_names_its_url_without_the_password() -> None:
    """Its refresh errors reach the gateway's warning log line by line."""
    import asyncio

    from kvgate.core.admission import AdmissionConfig, CoordinatorUnavailable, RefreshRequest
    from kvgate.gateway.redis_coordinator import RedisCoordinator

    async def body() -> str:
        coord = RedisCoordinator(
            AdmissionConfig(), "redis://:s3cret@127.0.0.1:1/0", socket_timeout_s=0.2
        )
        try:
            zero = (0, 0, 0)
            report = RefreshRequest(
                gateway_id="g", epoch=None, inuse=zero, wants=zero, has=zero, has_total=0
            )
            await coord.refresh(report, 0.0)
        except CoordinatorUnavailable as exc:
            return str(exc)
        finally:
            await coord.close()
        return ""

    message = asyncio.run(body())
    assert "127.0.0.1:1" in message and "s3cret" not in message and ":***@" in message
