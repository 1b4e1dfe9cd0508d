"""POST /admin/nodes: one engine is one node however its URL is spelt, and the refusal
never shows a password."""

from __future__ import annotations

from typing import Any


def test_adding_a_node_under_another_spelling_of_a_url_is_a_409(admin_kit: Any) -> None:
    password = "URLPASS-7431"

    async def body() -> None:
        async with admin_kit.stack(1) as s:
            extra = await admin_kit.start_engine("e5")
            try:
                port = extra.url.rsplit(":", 1)[1]
                url = f"http://ops:{password}@127.0.0.1:{port}"
                status, node, _ = await s.call("POST", "/admin/nodes", {"url": url, "id": "e5"})
                assert status == 201, node
                for twin in (f"http://ops:{password}@127.0.0.1:{port}",
                             f"http://127.0.0.1:0{port}", f"http://127.0.0.1:{port}/",
                             f"http://other:key@127.0.0.1:{port}"):
                    status, err, _ = await s.call("POST", "/admin/nodes",
                                                  {"url": twin, "id": "twin"})
                    assert status == 409, (twin, err)
                    msg = err["error"]["message"]
                    assert err["error"]["param"] == "url" and "'e5'" in msg
                    assert password not in msg and "ops:***@" in msg, msg
                assert len(s.gw.nodes) == 2
            finally:
                await extra.stop()

    admin_kit.run(body())
