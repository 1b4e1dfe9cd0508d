"""The admin API: auth, nodes (list, add, drain, remove), config redaction, admission,
decisions; against a gateway in front of real engine servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from kvgate.core.ids import NodeId
from kvgate.testing import raw_exchange

PATHS = [
    ("GET", "/admin/nodes"), ("POST", "/admin/nodes"), ("GET", "/admin/nodes/e0"),
    ("DELETE", "/admin/nodes/e0"), ("POST", "/admin/nodes/e0/drain"), ("GET", "/admin/config"),
    ("GET", "/admin/admission"), ("GET", "/admin/decisions"),
]


def _is_openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"}
            and {"message", "type", "param", "code"} <= set(body["error"]))


def test_admin_disabled_without_token(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(1, server={"admin_token": None}) as s:
            for method, path in PATHS:
                status, data, _ = await s.call(method, path, {})
                assert status == 403, (method, path)
                assert _is_openai_error(data)
                assert data["error"]["message"] == "admin API disabled: set server.admin_token"
            assert len(s.gw.nodes) == 1  # nothing was removed

    admin_kit.run(body())


def test_admin_needs_the_bearer_token(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(1) as s:
            for token in (None, "wrong-token-123", admin_kit.TOKEN + "x", ""):
                for method, path in PATHS:
                    status, data, headers = await s.call(method, path, {}, token=token)
                    assert status == 401, (token, method, path)
                    assert _is_openai_error(data)
                    assert headers.get("WWW-Authenticate") == "Bearer"
            status, _, _ = await s.call("GET", "/admin/nodes",
                                        headers={"Authorization": f"Basic {admin_kit.TOKEN}"},
                                        token=None)
            assert status == 401
            assert len(s.gw.nodes) == 1
            status, data, _ = await s.call("GET", "/admin/nodes")
            assert status == 200 and data["object"] == "list"

    admin_kit.run(body())


def test_list_nodes_shows_health_load_index_and_spec(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2) as s:
            status, node = await s.chat("tell me about caches " * 100)
            assert status == 200 and node is not None
            await admin_kit.eventually(lambda: all(
                st.report_time is not None for st in s.gw.nodes))
            status, data, _ = await s.call("GET", "/admin/nodes")
            assert status == 200
            assert data["healthy"] == 2
            by_id = {n["id"]: n for n in data["data"]}
            assert set(by_id) == {"e0", "e1"}
            for n in by_id.values():
                assert n["healthy"] is True and n["draining"] is False
                assert n["url"] == s.engine(n["id"]).url
                load = n["load"]
                for key in ("waiting", "running", "kv_usage", "report_age_s", "inflight",
                            "queue", "cache_weight"):
                    assert key in load
                assert load["report_age_s"] is not None and load["report_age_s"] >= 0
                assert n["spec"]["models"] == [admin_kit.MODEL]
                assert n["spec"]["max_model_len"] == s.engine(n["id"]).max_model_len
                assert n["spec"]["capacity"] == 64
            assert by_id[node]["index"]["entries"] > 0
            other = ({"e0", "e1"} - {node}).pop()
            assert by_id[other]["index"]["entries"] == 0
            status, one, _ = await s.call("GET", f"/admin/nodes/{node}")
            assert status == 200 and one["id"] == node
            status, err, _ = await s.call("GET", "/admin/nodes/nope")
            assert status == 404 and _is_openai_error(err)

    admin_kit.run(body())


def test_add_node_probes_it_and_routes_to_it(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(1) as s:
            extra = await admin_kit.start_engine("e9")
            try:
                status, node, _ = await s.call(
                    "POST", "/admin/nodes", {"url": extra.url + "/v1", "id": "e9",
                                             "capacity": 8})
                assert status == 201, node
                assert node["id"] == "e9" and node["healthy"] is True
                assert node["url"] == extra.url
                assert node["spec"]["capacity"] == 8
                assert node["spec"]["models"] == [admin_kit.MODEL]  # discovered
                status, data, _ = await s.call("GET", "/admin/nodes")
                assert [n["id"] for n in data["data"]] == ["e0", "e9"]
                # capacity feeds the budget: C_eff = 64 + 8
                _, adm, _ = await s.call("GET", "/admin/admission")
                assert adm["c_eff"] == 72
                # the new node takes traffic once e0 is drained
                await s.call("POST", "/admin/nodes/e0/drain", {"draining": True})
                assert (await s.chat("hello there")) == (200, "e9")
                # duplicates and bad bodies are refused, and change nothing
                status, err, _ = await s.call("POST", "/admin/nodes",
                                              {"url": extra.url, "id": "e9"})
                assert status == 409 and _is_openai_error(err)
                # the same engine under a second id: its capacity would count twice
                status, err, _ = await s.call("POST", "/admin/nodes",
                                              {"url": extra.url + "/", "id": "twin"})
                assert status == 409 and err["error"]["param"] == "url", err
                for bad in ({"id": "x"}, {"url": "ftp://a:1"}, {"url": extra.url, "capacity": 0},
                            {"url": extra.url, "colour": "red"}, [1, 2], b"{not json"):
                    status, err, _ = await s.call("POST", "/admin/nodes", bad)
                    assert status == 400, bad
                    assert _is_openai_error(err)
                assert len(s.gw.nodes) == 2
                # a node that does not answer is added, but out of rotation until it does
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    closed = sock.getsockname()[1]
                status, node, _ = await s.call(
                    "POST", "/admin/nodes", {"url": f"http://127.0.0.1:{closed}"})
                assert status == 201
                assert node["id"] == f"127.0.0.1:{closed}" and node["healthy"] is False
            finally:
                await extra.stop()

    admin_kit.run(body())


def test_drain_and_undrain(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2) as s:
            status, node, _ = await s.call("POST", "/admin/nodes/e0/drain", {"draining": True})
            assert status == 200 and node["draining"] is True and node["eligible"] is False
            assert s.gw.nodes.get("e0").draining  # type: ignore[arg-type,union-attr]
            for i in range(6):
                assert (await s.chat(f"prompt number {i} " * 40)) == (200, "e1")
            _, data, _ = await s.call("GET", "/admin/nodes")
            assert data["healthy"] == 1
            _, adm, _ = await s.call("GET", "/admin/admission")
            assert adm["c_eff"] == 64  # the drained node's capacity left the budget
            status, node, _ = await s.call("POST", "/admin/nodes/e0/drain", {"draining": False})
            assert status == 200 and node["draining"] is False and node["eligible"] is True
            status, node, _ = await s.call("POST", "/admin/nodes/e0/drain")  # default: drain
            assert status == 200 and node["draining"] is True
            status, err, _ = await s.call("POST", "/admin/nodes/e0/drain", {"draining": "yes"})
            assert status == 400 and err["error"]["param"] == "draining"
            status, _, _ = await s.call("POST", "/admin/nodes/zz/drain", {"draining": True})
            assert status == 404

    admin_kit.run(body())


def test_remove_node(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2) as s:
            status, data, _ = await s.call("DELETE", "/admin/nodes/e1")
            assert status == 200 and data == {"id": "e1", "deleted": True}
            _, data, _ = await s.call("GET", "/admin/nodes")
            assert [n["id"] for n in data["data"]] == ["e0"]
            assert s.gw.gateway.watcher.get("e1") is None
            for i in range(3):
                assert (await s.chat(f"after removal {i}")) == (200, "e0")
            status, err, _ = await s.call("DELETE", "/admin/nodes/e1")
            assert status == 404 and err["error"]["code"] == "node_not_found"

    admin_kit.run(body())


def test_config_is_redacted(admin_kit: Any) -> None:
    secrets = ("sk-acme-very-secret", "sk-ops-also-secret", "node-api-key-secret")

    async def body() -> None:
        async with admin_kit.stack(
            1,
            auth={"keys": {secrets[0]: {"tenant": "acme", "max_priority": 1},
                           secrets[1]: {"tenant": "ops", "max_priority": 0, "bypass": True}}},
            admission={"budget": 100, "tenant_quotas": {"acme": 5}},
        ) as s:
            extra = await admin_kit.start_engine("e5")
            try:
                status, _, _ = await s.call("POST", "/admin/nodes",
                                            {"url": extra.url, "id": "e5",
                                             "api_key": secrets[2]})
                assert status == 201
                status, cfg, _ = await s.call("GET", "/admin/config")
            finally:
                await extra.stop()
            assert status == 200
            text = json.dumps(cfg)
            for secret in (*secrets, admin_kit.TOKEN):
                assert secret not in text
            assert cfg["server"]["admin_token"] == "***"
            assert cfg["admission"]["budget"] == 100
            assert cfg["admission"]["tenant_quotas"] == {"acme": 5}
            assert cfg["routing"]["policy"] == "kvgate"
            assert cfg["nodes"]["static"][0]["id"] == "e0"
            keys = cfg["auth"]["keys"]
            assert [k["tenant"] for k in keys] == ["acme", "ops"]
            assert all(k["key"] == "***" for k in keys)
            assert keys[1]["bypass"] is True
            # the dashboard is served without a token and carries no secret either
            status, state, _ = await s.call("GET", "/dashboard/state", token=None)
            assert status == 200
            assert not any(sec in json.dumps(state) for sec in (*secrets, admin_kit.TOKEN))

    admin_kit.run(body())


def test_admission_json(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2, admission={"budget": 50, "tenant_quotas": {"acme": 3}},
                                   auth={"keys": {"sk-acme-1": {"tenant": "acme"}}}) as s:
            for i in range(3):
                async with s.session.post(
                    s.url + "/v1/chat/completions",
                    json={"model": admin_kit.MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": f"hi {i}"}]},
                    headers={"Authorization": "Bearer sk-acme-1"},
                ) as r:
                    assert r.status == 200
            status, adm, _ = await s.call("GET", "/admin/admission")
            assert status == 200
            assert adm["lease_state"] == "active"
            assert adm["degraded"] is False
            assert adm["c_eff"] == 50
            assert adm["lease_total"] > 0
            assert set(adm["classes"]) == {"P0", "P1", "P2"}
            for c in adm["classes"].values():
                assert {"inuse", "queued", "cap", "admitted", "rejected"} <= set(c)
            assert adm["classes"]["P1"]["admitted"] == 3
            assert adm["classes"]["P1"]["inuse"] == 0
            assert adm["counters"]["admitted"] == 3
            assert adm["breaker"]["state"] == "closed"
            assert {"inuse", "limit"} <= set(adm["bypass"])
            # a request in flight shows in its class and under its tenant
            async with s.session.post(
                s.url + "/v1/chat/completions",
                json={"model": admin_kit.MODEL, "max_tokens": 3000, "stream": True,
                      "messages": [{"role": "user", "content": "a long answer please"}]},
                headers={"Authorization": "Bearer sk-acme-1"},
            ) as r:
                assert r.status == 200
                await r.content.readany()
                _, adm, _ = await s.call("GET", "/admin/admission")
            assert adm["classes"]["P1"]["inuse"] == 1
            assert adm["inuse_total"] == 1
            assert adm["tenants"]["acme"]["inflight"] == 1
            assert adm["tenants"]["acme"]["queued"] == 0
            assert adm["tenants"]["acme"]["limit"] in (None, 1, 2, 3)

    admin_kit.run(body())


def test_recent_decisions_with_reasons(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2) as s:
            prefix = "a long shared system prompt " * 60
            nodes = [(await s.chat(prefix + f"question {i}"))[1] for i in range(4)]
            status, data, _ = await s.call("GET", "/admin/decisions")
            assert status == 200
            decisions = data["data"]
            assert len(decisions) == 4
            assert [d["node"] for d in decisions] == nodes[::-1]  # newest first
            assert decisions[-1]["reason"] == "load"  # nothing cached yet
            assert decisions[0]["reason"] == "cache_hit"
            assert decisions[0]["matched_blocks"] > 0
            for d in decisions:
                assert {"request_id", "node", "reason", "score", "attempt", "age_s"} <= set(d)
            _, data, _ = await s.call("GET", "/admin/decisions?limit=1")
            assert len(data["data"]) == 1
            status, _, _ = await s.call("GET", "/admin/decisions?limit=-1")
            assert status == 400

    admin_kit.run(body())


def test_dashboard_page_and_state(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(2) as s:
            await s.chat("hello")
            status, html, headers = await s.call("GET", "/dashboard", token=None)
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            # not framed by another site, no base or form target to hijack
            policy = headers["Content-Security-Policy"]
            for rule in ("frame-ancestors 'none'", "base-uri 'none'", "form-action 'none'"):
                assert rule in policy
            for el in ('id="requests-total"', 'id="nodes-body"', 'id="lease-state"',
                       'id="decisions-body"', 'id="hits-body"'):
                assert el in html
            assert "/*__KVGATE_STATE__*/" not in html  # the state is embedded
            assert "http://" not in html.split("<script>")[0]  # no external assets
            assert "<script src" not in html and "<link" not in html
            status, state, _ = await s.call("GET", "/dashboard/state", token=None)
            assert status == 200
            assert state["requests"]["total"] == 1
            assert state["requests"]["completed"] == 1
            assert [n["id"] for n in state["nodes"]] == ["e0", "e1"]
            assert [h["bucket"] for h in state["hit_ratio"]] == ["lt1k", "1k_4k", "4k_16k",
                                                                  "ge16k"]
            assert state["admission"]["lease_state"] == "active"
            assert len(state["decisions"]) == 1
            # the admin API's node URLs are not for anonymous eyes
            assert all("url" not in n for n in state["nodes"])
            assert state["admission"]["tenants_active"] == 0  # nothing in flight now

    admin_kit.run(body())


def test_the_dashboard_shows_only_the_busiest_tenants() -> None:
    from kvgate.gateway.dashboard import busiest_tenants

    tenants = {f"t{i}": {"inflight": i % 7, "queued": i % 3, "limit": 8} for i in range(500)}
    shown, active = busiest_tenants(tenants, 50)
    assert active == sum(1 for v in tenants.values() if v["inflight"] or v["queued"])
    assert len(shown) == 50
    loads = [v["inflight"] + v["queued"] for v in shown.values()]
    assert loads == sorted(loads, reverse=True) and loads[0] == 8
    assert busiest_tenants({"idle": {"inflight": 0, "queued": 0, "limit": 8}}, 50) == ({}, 0)


def test_the_dashboard_can_be_turned_off(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(1, server={"dashboard": False}) as s:
            for path in ("/dashboard", "/dashboard/state"):
                status, _, _ = await s.call("GET", path, token=None)
                assert status == 404
            status, _, _ = await s.call("GET", "/admin/nodes")
            assert status == 200

    admin_kit.run(body())


def test_admin_body_badly_encoded_is_400_and_slow_is_408(admin_kit: Any) -> None:
    async def body() -> None:
        async with admin_kit.stack(1, server={"body_timeout_s": 0.3}) as s:
            status, data, _ = await s.call("POST", "/admin/nodes", b'{"url": "http://x:1"}',
                                           headers={"Content-Encoding": "gzip"})
            assert status == 400 and _is_openai_error(data), data
            assert data["error"]["code"] == "invalid_body"
            # a body that never completes: 408 at body_timeout_s, then the close
            data, _ = await raw_exchange(
                s.url,
                b"POST /admin/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + admin_kit.TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{",
                timeout=3,
            )
            assert data.startswith(b"HTTP/1.1 408"), data[:60]
            assert len(s.gw.nodes) == 1

    admin_kit.run(body())


def test_drain_refuses_unknown_keys_and_a_node_deleted_during_its_body(admin_kit: Any) -> None:
    """{"drainig": false} drained the node (200); a node deleted while the drain's body
    arrived was answered 200 with its old view."""

    async def body() -> None:
        async with admin_kit.stack(2) as s:
            status, err, _ = await s.call("POST", "/admin/nodes/e0/drain", {"drainig": False})
            assert status == 400 and err["error"]["param"] == "drainig"
            assert not s.gw.nodes.get("e0").draining  # type: ignore[arg-type,union-attr]
            payload = b'{"draining": true}'
            head = (b"POST /admin/nodes/e1/drain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + admin_kit.TOKEN.encode()
                    + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(payload))
            drain = asyncio.ensure_future(raw_exchange(s.url, head, payload, pause=0.5))
            await asyncio.sleep(0.2)  # the head is in, the body not yet
            status, _, _ = await s.call("DELETE", "/admin/nodes/e1")
            assert status == 200
            data, _ = await drain
            assert data.startswith(b"HTTP/1.1 404"), data[:80]

    admin_kit.run(body())


def test_admin_expect_continue_is_refused_before_the_body_without_the_token(
    admin_kit: Any,
) -> None:
    """The admin routes answered 'Expect: 100-continue' with a 100 for a caller without
    the token, inviting (and reading) its body before the 401."""

    async def body() -> None:
        async with admin_kit.stack(1) as s:
            head = (b"POST /admin/nodes HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n"
                    b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
            data, _ = await raw_exchange(s.url, head, timeout=3)
            assert data.startswith(b"HTTP/1.1 401"), data[:80]
            data, _ = await raw_exchange(s.url, head.replace(
                b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer " + admin_kit.TOKEN.encode()
                + b"\r\n"), b'{"url": "http://x:1"', pause=0.2, timeout=3)
            assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400"), data[:80]

    admin_kit.run(body())


def test_a_node_with_url_credentials_and_an_api_key_is_refused(admin_kit: Any) -> None:
    """Both are an Authorization header: the node was accepted (201) and never became
    healthy, every probe refused by aiohttp without a word in the log."""

    async def body() -> None:
        async with admin_kit.stack(1) as s:
            status, err, _ = await s.call("POST", "/admin/nodes", {
                "id": "both", "url": "http://u:p@127.0.0.1:1", "api_key": "k"})
            assert status == 400 and err["error"]["param"] == "api_key"
            assert s.gw.nodes.get("both") is None

    admin_kit.run(body())


def test_admin_delete_refuses_expect_continue_without_the_token(admin_kit: Any) -> None:
    """DELETE answered 'Expect: 100-continue' with a 100 for anyone, as POST once did."""

    async def body() -> None:
        async with admin_kit.stack(1) as s:
            head = (b"DELETE /admin/nodes/e0 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                    b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
            data, _ = await raw_exchange(s.url, head, timeout=3)
            assert data.startswith(b"HTTP/1.1 401"), data[:80]
            assert s.gw.nodes.get("e0") is not None

    admin_kit.run(body())


def test_an_absurd_max_model_len_is_refused_and_a_node_reporting_one_harms_nobody(
    admin_kit: Any,
) -> None:
    """A node added with max_model_len 10**400 made every request of its model a 500
    (admission's float check overflowed), the node down or not."""
    from kvgate.gateway.node_probe import parse_models

    async def body() -> None:
        async with admin_kit.stack(1) as s:
            for key in ("max_model_len", "capacity", "cache_blocks"):
                status, err, _ = await s.call("POST", "/admin/nodes", {
                    "id": "c", "url": "http://127.0.0.1:1", key: 10**400})
                assert status == 400, (key, err)
                assert err["error"]["param"] == key
            assert s.gw.nodes.get("c") is None

    admin_kit.run(body())
    # an engine reporting one: taken as not said (the default applies)
    info = parse_models({"data": [{"id": "m", "max_model_len": 10**400}]})
    assert info is not None and info.max_model_len is None


def test_a_node_being_added_is_out_of_the_budget_until_its_probe_passes(
    admin_kit: Any,
) -> None:
    """A node that never answers counted as healthy, and in C_eff, for the whole first
    probe (up to startup_probe_timeout_s)."""

    async def body() -> None:
        # a server that accepts connections and never answers
        done = asyncio.Event()
        writers: list[asyncio.StreamWriter] = []

        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            await done.wait()

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with admin_kit.stack(1) as s:
                ctl = s.gw.controller
                before = ctl.admission.c_eff
                seen: list[tuple[bool, int]] = []

                async def watch() -> None:
                    while True:
                        state = ctl.nodes.get(NodeId("hung"))
                        if state is not None:
                            seen.append((state.healthy, ctl.admission.c_eff))
                        await asyncio.sleep(0.02)

                watcher = asyncio.ensure_future(watch())
                status, _, _ = await s.call("POST", "/admin/nodes", {
                    "id": "hung", "url": f"http://127.0.0.1:{port}", "capacity": 64})
                watcher.cancel()
                assert status == 201
                assert seen, "the probe ended before the node could be seen"
                assert all(not healthy for healthy, _ in seen), seen[:5]
                assert all(c_eff == before for _, c_eff in seen)
        finally:
            done.set()
            for w in writers:
                w.close()
            server.close()
            await server.wait_closed()

    admin_kit.run(body(), timeout=30)
