"""The dashboard rendered by headless Chromium: numbers appear, and move with traffic."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

SCREENSHOT = Path(tempfile.gettempdir()) / "dashboard.png"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--virtual-time-budget=3000",
)


async def _chromium(binary: str, *args: str, timeout: float = 30.0) -> str:
    """Run headless Chromium with a throw-away profile; its stdout (the DOM for --dump-dom)."""
    profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
    proc = await asyncio.create_subprocess_exec(
        binary, *FLAGS, f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, err.decode("utf-8", "replace")[-2000:]
    return out.decode("utf-8", "replace")


def _number(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', dom)
    assert m is not None, f"#{element_id} not in the DOM"
    return html.unescape(m.group(1)).strip()


def test_dashboard_renders_live_numbers_in_chromium(e2e: Any, chromium: str) -> None:
    async def body() -> None:
        async with e2e.stack(2) as s:
            page = s.url + "/dashboard"
            first = await _chromium(chromium, "--dump-dom", page)
            assert _number(first, "requests-total") == "0"
            assert _number(first, "lease-state") == "active"
            assert _number(first, "node-e0-health") == "healthy"
            assert _number(first, "hit-ratio-1k_4k-measured") == "-"

            prompt = "Shared context for the dashboard check. " * 120  # ~1 200 tokens
            for i in range(3):
                async with s.session.post(
                    s.url + "/v1/chat/completions",
                    json={"model": e2e.MODEL, "max_tokens": 4,
                          "messages": [{"role": "user", "content": prompt + str(i)}]},
                ) as r:
                    assert r.status == 200

            second = await _chromium(chromium, "--dump-dom", page)
            assert _number(second, "requests-total") == "3"
            assert _number(second, "requests-completed") == "3"
            measured = _number(second, "hit-ratio-1k_4k-measured")
            assert measured.endswith("%") and float(measured[:-1]) > 0
            assert "cache_hit" in second  # the decisions table shows reasons
            # the page polled /dashboard/state itself (the CSP allows it)
            assert _number(second, "conn").startswith("live"), _number(second, "conn")

            if SCREENSHOT.exists():
                os.unlink(SCREENSHOT)
            await _chromium(chromium, f"--screenshot={SCREENSHOT}", "--window-size=1400,1100",
                            "--hide-scrollbars", page)
            assert SCREENSHOT.stat().st_size > 10_000

    e2e.run(body(), timeout=90)


def test_a_drained_node_that_goes_down_reads_down(e2e: Any, chromium: str) -> None:
    """A node being drained whose engine then dies showed amber "draining": an operator
    waiting for its in-flight work to finish did not see that it had crashed."""

    async def body() -> None:
        async with e2e.stack(2) as s:
            auth = {"Authorization": f"Bearer {e2e.TOKEN}"}
            async with s.session.post(s.url + "/admin/nodes/e1/drain", headers=auth) as r:
                assert r.status == 200, await r.text()
            page = s.url + "/dashboard"
            assert _number(await _chromium(chromium, "--dump-dom", page),
                           "node-e1-health") == "draining"
            await s.engine("e1").stop()

            async def down() -> bool:
                async with s.session.get(s.url + "/dashboard/state") as r:
                    nodes = (await r.json())["nodes"]
                return not next(n for n in nodes if n["id"] == "e1")["healthy"]

            await e2e.eventually(down, timeout=10.0)
            dom = await _chromium(chromium, "--dump-dom", page)
            assert _number(dom, "node-e1-health") == "down (draining)"
            assert re.search(r'class="l bad"[^>]*id="node-e1-health"|'
                             r'id="node-e1-health"[^>]*class="l bad"', dom)
            assert _number(dom, "node-e0-health") == "healthy"

    e2e.run(body(), timeout=90)
