"""Node ids are [A-Za-z0-9._:-]{1,128}: they go out in the X-Kvgate-Node header (a
newline in one broke every answer routed to its node) and in metric labels."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.core.errors import ConfigError
from kvgate.gateway import load_config
from kvgate.gateway.config_load import parse_node

GOOD = ["a", "n0", "vllm-0.vllm.svc.cluster.local:8000", "pod_7", "::1:8000", "x" * 128]
BAD = ["we\"ird\nid", "a b", "a\r", "x" * 129, "é", "a/b", "a\tb", "a,b", "{x}"]


@pytest.mark.parametrize("node_id", GOOD)
def test_good_node_ids_load(node_id: str) -> None:
    cfg = load_config(env={}, overrides={"nodes": {"static": [
        {"id": node_id, "url": "http://127.0.0.1:8000"}]}})
    assert [n.id for n in cfg.nodes.static] == [node_id]
    assert parse_node(f"{node_id}=http://h:1").id == node_id


@pytest.mark.parametrize("node_id", BAD)
def test_bad_node_ids_are_a_config_error(node_id: str) -> None:
    with pytest.raises(ConfigError, match="node id"):
        load_config(env={}, overrides={"nodes": {"static": [
            {"id": node_id, "url": "http://127.0.0.1:8000"}]}})
    if "=" not in node_id and "," not in node_id and node_id.strip() == node_id:
        with pytest.raises(ConfigError, match="node id"):
            parse_node(f"{node_id}=http://127.0.0.1:8000")
    with pytest.raises(ConfigError):
        parse_node({"id": 7, "url": "http://127.0.0.1:8000"})


def test_default_ids_from_urls_are_valid() -> None:
    assert parse_node("http://10.0.0.1:8000/v1").id == "10.0.0.1:8000"
    assert parse_node("http://[::1]:8000").id == "::1:8000"
    assert parse_node({"url": "https://vllm-a.internal"}).id == "vllm-a.internal:443"


def test_admin_api_refuses_a_bad_node_id_with_a_400(kit: Any) -> None:
    headers = {"Authorization": "Bearer tok-tok-tok"}

    async def body() -> None:
        async with kit.cluster(1, server={"admin_token": "tok-tok-tok"}) as c:
            url = c.stubs[0].url
            for node_id in ['we"ird\nid', "a b", "x" * 129]:
                status, hdrs, out = await c.post(
                    "/admin/nodes", {"id": node_id, "url": url}, headers)
                assert status == 400, out
                err = json.loads(out)["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"] == "invalid_request_error" and err["param"] == "id"
            assert [n.spec.node_id for n in c.gw.nodes] == ["n0"]
            # answers routed to the node still go out
            status, hdrs, _ = await c.post("/v1/completions",
                                           {"model": kit.MODEL, "prompt": "x"})
            assert status == 200 and hdrs["X-Kvgate-Node"] == "n0"

    kit.run(body())
