"""`kvgate up`: engine processes behind a gateway, started, used and stopped cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from kvgate.commands.up import start_cluster

PROMPT = "A long description of the deployment runbook, step by step. " * 50


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


async def _stop_leftovers(
    proc: asyncio.subprocess.Process, engine_pids: list[int], e2e: Any
) -> None:
    """After a failed test: kill ``kvgate up`` if it still runs, and its engines."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    _kill_leftovers([p for p in engine_pids if e2e.pid_alive(p)])


async def _start_up(*args: str, nohup: bool = False) -> asyncio.subprocess.Process:
    """``kvgate up --port 0 *args`` as a child process, its output piped (``nohup``:
    started with SIGHUP ignored, as ``nohup`` starts it)."""
    def ignore_hup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "up", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ignore_hup if nohup else None,
    )


async def _banner(proc: asyncio.subprocess.Process) -> str:
    """What ``kvgate up`` printed up to its "Press Ctrl-C" line (it is serving then)."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(25):
        while not lines or "Press Ctrl-C" not in lines[-1]:
            line = await proc.stdout.readline()
            assert line, f"kvgate up exited early: {await proc.stderr.read()!r}"
            lines.append(line.decode())
    return "".join(lines)


def test_kvgate_up_subprocess_serves_and_stops_cleanly(e2e: Any) -> None:
    async def body() -> None:
        proc = await _start_up("--nodes", "2", "--engine-num-blocks", "2048")
        assert proc.stdout is not None and proc.stderr is not None
        engine_pids: list[int] = []
        try:
            out = await _banner(proc)
            gateway = re.search(r"gateway\s+(http://127\.0\.0\.1:\d+)", out)
            assert gateway is not None, out
            url = gateway.group(1)
            for needle in (f"{url}/v1", f"{url}/dashboard", f"{url}/metrics", "curl "):
                assert needle in out
            engine_pids = [int(p) for p in re.findall(r"engine-\d\s+http://\S+\s+\(pid (\d+)\)",
                                                      out)]
            assert len(engine_pids) == 2
            token = re.search(r"admin token \(generated\): (\S+)", out)
            assert token is not None

            async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                   timeout=10.0) as client:
                # What README's Quick start shows: the first request misses, and every
                # later one lands on its holder and hits (on an idle cluster the prefix is
                # not sent exploring: nobody waits for the holder)
                cached = []
                for _ in range(4):
                    done = await client.chat.completions.create(
                        model="kvgate-sim", max_tokens=8,
                        messages=[{"role": "user", "content": PROMPT}])
                    assert done.usage is not None
                    assert done.usage.prompt_tokens_details is not None
                    cached.append(done.usage.prompt_tokens_details.cached_tokens or 0)
                assert cached[0] == 0 and min(cached[1:]) > 0, cached
            async with aiohttp.ClientSession() as session:
                headers = {"Authorization": f"Bearer {token.group(1)}"}
                async with session.get(url + "/admin/nodes", headers=headers) as r:
                    nodes = await r.json()
                assert [n["id"] for n in nodes["data"]] == ["engine-0", "engine-1"]
                async with session.get(url + "/dashboard/state") as r:
                    assert (await r.json())["requests"]["completed"] == 4

            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                rest = await proc.stdout.read()
                code = await proc.wait()
            err = await proc.stderr.read()
            assert code == 0, (rest, err)
            assert b"kvgate up: stopped" in rest
            for pid in engine_pids:
                assert not e2e.pid_alive(pid), f"engine pid {pid} left behind"
        finally:
            await _stop_leftovers(proc, engine_pids, e2e)

    e2e.run(body(), timeout=50)


def test_start_cluster_survives_a_killed_engine_process(e2e: Any) -> None:
    async def body() -> None:
        cluster = await start_cluster(
            nodes=2, port=0, engine_num_blocks=2048, admin_token="test-admin-token",
            gateway_overrides={"nodes": {"health_interval_s": 5.0},
                               "routing": {"params": {"epsilon": 0.0}}},
        )
        pids = cluster.engine_pids
        try:
            assert len(cluster.engine_urls) == 2
            async with aiohttp.ClientSession() as session:
                body = {"model": "kvgate-sim", "max_tokens": 4,
                        "messages": [{"role": "user", "content": PROMPT}]}
                async with session.post(cluster.gateway_url + "/v1/chat/completions",
                                        json=body) as r:
                    assert r.status == 200
                    holder = r.headers["X-Kvgate-Node"]
                victim = next(e for e in cluster.engines if e.node_id == holder)
                os.kill(victim.pid, signal.SIGKILL)
                async with asyncio.timeout(5):
                    while victim.alive():
                        await asyncio.sleep(0.02)
                # not yet started anywhere: retried on the other engine, and it succeeds
                async with session.post(cluster.gateway_url + "/v1/chat/completions",
                                        json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Kvgate-Node"] != holder
            assert sum(cluster.gateway.controller.stats.retries.values()) == 1
        finally:
            await cluster.stop()
            _kill_leftovers([p for p in pids if e2e.pid_alive(p)])
        for pid in pids:
            assert not e2e.pid_alive(pid)
        assert not cluster.log_dir.exists()  # the temporary log directory is removed

    e2e.run(body(), timeout=40)


def test_kvgate_up_stops_everything_on_sighup_with_its_reader_gone(e2e: Any) -> None:
    """The terminal closed: its reader is gone and SIGHUP arrives. kvgate up used to die
    on the signal, or on printing "stopping" to the dead pipe, before its teardown:
    the gateway undrained, the engines left to the kernel (Linux only), the log
    folder behind. Now every process and the folder go, and it exits 0."""

    async def body() -> None:
        proc = await _start_up("--nodes", "1", "--engine-num-blocks", "512")
        assert proc.stdout is not None and proc.stderr is not None
        engine_pids: list[int] = []
        try:
            out = await _banner(proc)
            engine_pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
            logs = re.search(r"engine logs (\S+)", out)
            assert len(engine_pids) == 1 and logs is not None
            transport = proc._transport  # type: ignore[attr-defined]
            transport.get_pipe_transport(1).close()  # the reader goes away
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(15):
                code = await proc.wait()
            err = await proc.stderr.read()
            assert code == 0, err
            assert b"Traceback" not in err
            for pid in engine_pids:
                assert not e2e.pid_alive(pid), f"engine pid {pid} left behind"
            assert not os.path.exists(logs.group(1))
        finally:
            await _stop_leftovers(proc, engine_pids, e2e)

    e2e.run(body(), timeout=50)


def test_kvgate_up_under_nohup_outlives_its_terminal(e2e: Any) -> None:
    """Started under nohup (SIGHUP ignored), kvgate up set its own SIGHUP handler and
    stopped when the terminal closed; kvgate serve already kept nohup's promise."""

    async def body() -> None:
        proc = await _start_up("--nodes", "1", "--engine-num-blocks", "512", nohup=True)
        engine_pids: list[int] = []
        try:
            out = await _banner(proc)
            engine_pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert proc.returncode is None, "kvgate up stopped on SIGHUP under nohup"
            assert all(e2e.pid_alive(p) for p in engine_pids)
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                assert await proc.wait() == 0
        finally:
            await _stop_leftovers(proc, engine_pids, e2e)

    e2e.run(body(), timeout=50)


def test_two_engines_handed_the_same_free_port_each_get_their_own(
    e2e: Any, monkeypatch: Any
) -> None:
    """The OS may hand the same free port out twice in a row: the second engine failed to
    bind, passed /health on the first one's answer, and the cluster failed to start."""
    import kvgate.commands.up as up

    real = up.free_port
    handed = [real("127.0.0.1")] * 2  # the first two calls get the same port

    def same_port_twice(host: str) -> int:
        return handed.pop() if handed else real(host)

    monkeypatch.setattr(up, "free_port", same_port_twice)

    async def body() -> None:
        cluster = await start_cluster(nodes=2, port=0, engine_num_blocks=512)
        try:
            assert len(set(cluster.engine_urls)) == 2
        finally:
            await cluster.stop()

    e2e.run(body(), timeout=40)


def test_up_in_precise_mode_learns_the_cache_from_engine_events(e2e: Any) -> None:
    """``kvgate up --index-mode precise``: engines publish KV events on private Unix
    sockets, the gateway's index follows them, and the sockets go with the cluster."""

    async def body() -> None:
        cluster = await start_cluster(
            nodes=2, port=0, engine_num_blocks=2048, index_mode="precise",
            gateway_overrides={"routing": {"params": {"epsilon": 0.0}}},
        )
        pids = cluster.engine_pids
        sockets = cluster.socket_dir
        try:
            assert sockets is not None and sorted(p.name for p in sockets.iterdir()) == [
                "engine-0-1", "engine-1-1"]
            watcher = cluster.gateway.gateway.watcher
            async with aiohttp.ClientSession() as session:
                nodes = []
                for question in ("first?", "second?"):
                    body = {"model": "kvgate-sim", "max_tokens": 4, "messages": [
                        {"role": "system", "content": PROMPT},
                        {"role": "user", "content": question}]}
                    async with session.post(cluster.gateway_url + "/v1/chat/completions",
                                            json=body) as r:
                        assert r.status == 200, await r.text()
                        nodes.append(r.headers["X-Kvgate-Node"])
                        cached = (await r.json())["usage"]["prompt_tokens_details"]
                    if question == "first?":
                        rt = next(rt for rt in watcher.nodes.values() if rt.node_id == nodes[0])
                        async with asyncio.timeout(5):  # its BlockStored events arrive
                            while not (rt.kv and rt.kv.ingest.counts["stored_blocks"]):
                                await asyncio.sleep(0.02)
            assert nodes[1] == nodes[0] and cached["cached_tokens"] >= 16 * 40
        finally:
            await cluster.stop()
            _kill_leftovers([p for p in pids if e2e.pid_alive(p)])
        assert not sockets.exists()

    e2e.run(body(), timeout=40)


def test_bad_gateway_settings_fail_before_any_engine_starts(
    monkeypatch: Any, capsys: Any
) -> None:
    """A bad port, policy or model is a usage error (exit 2) found before any engine
    process starts; it was found once every engine was up, seconds later, exit 1."""
    import argparse

    import pytest

    from kvgate.commands import up
    from kvgate.core.errors import ConfigError

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(up, "spawn_engine", no_engine)
    for kwargs in ({"port": -5}, {"policy": "nope"}, {"model": " "}, {"nodes": 65}):
        with pytest.raises(ConfigError):
            asyncio.run(start_cluster(**kwargs))  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    assert up.run_up(parser.parse_args(["up", "--port", "70000"])) == 2
    assert "server.port must be in [0, 65535]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--nodes", "1000"])
    # a short token is the flag's error, not the config file's `server.admin_token`
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--admin-token", "short"])
    err = capsys.readouterr().err
    assert "argument --admin-token: must be at least 8 characters" in err
    assert "server.admin_token" not in err
