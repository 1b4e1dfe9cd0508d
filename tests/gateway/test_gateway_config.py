"""Configuration: YAML < environment < flags, validation, and `kvgate serve`."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvgate.core.errors import ConfigError
from kvgate.gateway import GatewayConfig, add_serve_parser, load_config
from kvgate.gateway.config_load import env_overrides, parse_nodes
from kvgate.gateway.serve import config_from_args

YAML = """\
server:
  port: 1000
  host: 0.0.0.0
  admin_token: from-yaml-123
nodes:
  static:
    - http://10.0.0.1:8000/v1/
    - {id: b, url: "http://10.0.0.2:9000", capacity: 32, max_model_len: 4096}
  metrics_interval_s: 0.5
routing:
  policy: least_loaded
admission:
  budget: 100
  tenant_quotas: {acme: 8}
auth:
  keys:
    sk-a: {tenant: acme, max_priority: 2}
    sk-b: beta
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_yaml_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    cfg = load_config(path, env={})
    assert cfg.server.port == 1000 and cfg.server.host == "0.0.0.0"
    assert [(n.id, n.url) for n in cfg.nodes.static] == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000"), ("b", "http://10.0.0.2:9000")]
    assert cfg.nodes.static[1].capacity == 32 and cfg.nodes.static[1].max_model_len == 4096
    assert cfg.routing.policy == "least_loaded"
    assert cfg.admission.admission_config().tenant_quotas == {"acme": 8}
    assert cfg.auth.keys["sk-a"].max_priority == 2 and cfg.auth.keys["sk-b"].tenant == "beta"

    env = {"KVGATE_SERVER_PORT": "2000", "KVGATE_ADMISSION_BUDGET": "50",
           "KVGATE_SERVER_ADMIN_TOKEN": "12345678", "KVGATE_SERVER_ROUTE_HEADERS": "false",
           "KVGATE_NODES_STATIC": "[http://c:1, d=http://e:2]", "KVGATE_ENGINE_X": "ignored",
           "OTHER": "1"}
    cfg = load_config(path, env=env)
    assert cfg.server.port == 2000 and cfg.admission.budget == 50
    assert cfg.server.admin_token == "12345678"  # strings stay strings
    assert cfg.server.route_headers is False
    assert [n.id for n in cfg.nodes.static] == ["c:1", "d"]
    assert cfg.server.host == "0.0.0.0"  # untouched keys keep the YAML value

    args = _parse(["--config", str(path), "--port", "3000", "--node", "http://f:3",
                   "--node", "g=http://h:4", "--budget", "7", "--policy", "round_robin",
                   "--no-route-headers", "--metrics-interval", "0.2", "--log-level", "debug",
                   "--admin-token", "flag-token-1"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = config_from_args(args)
    assert cfg.server.port == 3000 and cfg.admission.budget == 7
    assert [n.id for n in cfg.nodes.static] == ["f:3", "g"]
    assert cfg.routing.policy == "round_robin" and cfg.server.route_headers is False
    assert cfg.nodes.metrics_interval_s == 0.2 and cfg.server.log_level == "debug"
    assert cfg.server.admin_token == "flag-token-1"
    assert cfg.controller_config().admission.budget == 7


@pytest.mark.parametrize("raw, message", [
    ({"server": {"port": 70000}}, "server.port"),
    ({"server": {"prot": 1}}, "unknown key(s) prot (did you mean 'port'?)"),
    ({"servr": {}}, "unknown section 'servr' (did you mean 'server'?)"),
    ({"server": {"host": ""}}, "server.host must not be empty"),
    # a URL may hold '=' (a password); its errors never print the password
    ({"nodes": {"static": ["http://admin:S3cret=x@h:8o00"]}}, "'http://admin:***@h:8o00'"),
    ({"nodes": {"static": ["http://h:9/?x=1"]}}, "must not have a query or fragment"),
    ({"nodes": {"static": ["http://h:9#f"]}}, "must not have a query or fragment"),
    ({"nodes": {"static": ["http://h:0"]}}, "port 0 is no port"),
    ({"nodes": {"static": ["http://h:9", {"id": "b", "url": "http://h:9/v1"}]}},
     "nodes 'h:9' and 'b' have the same url"),
    ({"auth": {"keys": {"sk-abcdefgh": {"max_priority": 1}}}},
     "auth.keys[sk-a...]: missing required key(s) tenant"),
    # a quoted number passed, and then every request failed deep in the score
    ({"routing": {"params": {"decode_s": "3"}}},
     "routing policy 'kvgate': decode_s must be a number, got '3'"),
    ({"routing": {"params": {"explore_busy": "yes"}}}, "explore_busy must be true or false"),
    ({"server": {"port": "80"}}, "must be an integer"),
    ({"server": {"route_headers": "yes"}}, "true or false"),
    ({"nodes": {"static": ["ftp://x"]}}, "http://host:port"),
    ({"nodes": {"static": ["http://a:1", "http://a:1"]}}, "duplicate node id"),
    ({"nodes": {"static": [{"id": "x"}]}}, "needs a url"),
    ({"nodes": {"health_interval_s": 0}}, "must be > 0"),
    ({"nodes": {"metrics_interval_s": 12}},
     "nodes.metrics_interval_s (12) must be below routing.stale_after_s (5)"),
    ({"routing": {"policy": "magic"}}, "unknown routing policy"),
    ({"routing": {"params": {"bogus": 1}}}, "bad parameters"),
    ({"admission": {"budget": 0}}, "budget"),
    ({"auth": {"keys": {"k": {"tenant": "t", "max_priority": 5}}}}, "max_priority"),
    ({"auth": {"keys": ["k"]}}, "auth.keys"),
    ({"server": {"admin_token": "short"}}, "admin_token"),
    ({"server": {"header_timeout_s": 0}}, "server.header_timeout_s must be > 0"),
    ({"admission": {"expected_gateways": 0}}, "admission.expected_gateways must be >= 1"),
    ({"admission": {"expected_gateways": 2.5}}, "admission.expected_gateways must be an integer"),
    ({"admission": {"lease_ttl_s": 0.1}}, "admission.lease_ttl_s must be finite and > 0.2"),
    ({"admission": {"lease_refresh_s": 0}}, "admission.lease_refresh_s must be > 0"),
    ({"admission": {"lease_refresh_s": 3.0}}, "must be below admission.lease_ttl_s (2.0)"),
    ({"admission": {"reclaim_grace_s": -1}}, "admission.reclaim_grace_s must be finite and >= 0"),
    ({"admission": {"early_refresh_min_interval_s": 1.0}},
     "admission.early_refresh_min_interval_s must be in"),
    ({"admission": {"tenant_confine_s": -1}}, "admission.tenant_confine_s must be a finite"),
    ({"admission": {"p2_start": 0}}, "slo: p2_start must be in (0, 1]"),
    ({"admission": {"reclaim_p2": "sometimes"}}, "reclaim_p2"),
    ({"admission": {"reclaim_retry_after_s": -1}},
     "reclaim_retry_after_s and tenant_retry_after_s must be >= 0"),
    ({"admission": {"reclaim_retry_after_s": float("nan")}},
     "admission.reclaim_retry_after_s must be a finite number"),
    ({"admission": {"queue_timeout_s": float("inf")}},
     "admission.queue_timeout_s must be a finite number"),
    # the core's own wording, with the section it came from
    ({"admission": {"queue_timeout_s": 0}}, "admission: P0 queue_timeout_s must be > 0, got 0"),
    ({"admission": {"retry_budget_ratio": -1}}, "admission: retry budget ratio must be in"),
    ({"nodes": {"static": [{"url": "http://h:1", "capacity": 0}]}},
     "node h:1: capacity must be >= 1, got 0"),
    ({"admission": {"queue_limit": -1}}, "queue_limit must be >= 0, got -1"),
    # a key read from a file keeps its newline: every probe failed with a bare ValueError
    ({"nodes": {"static": [{"url": "http://h:1", "api_key": "sk-secret\n"}]}},
     "node h:1: api_key must be non-empty printable ASCII with no spaces or line breaks"),
    ({"nodes": {"static": [{"url": "http://h:1", "api_key": ""}]}}, "api_key must be"),
    ({"admission": {"tenant_quotas": {"acme": -2, "b": 3}}},
     "tenant quotas must be >= 0: acme = -2"),
])
def test_bad_config_is_a_clear_config_error(raw: dict[str, Any], message: str,
                                             tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert message in exc.value.message
    if "section" in message:  # a file's own mistake names the file
        assert f"config file {path}: unknown section" in exc.value.message


def test_env_and_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no key"):
        env_overrides({"KVGATE_SERVER_NOPE": "1"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2:1: .*"):  # one line: file:line:col
        load_config(bad, env={})
    # a key given twice: YAML's last-one-wins dropped the first block's port
    bad.write_text("server: {port: 18431}\nnodes: {}\nserver: {host: 0.0.0.0}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3:1: duplicate key 'server'"):
        load_config(bad, env={})
    bad.write_bytes(b'server: {gateway_id: "\xff"}\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(bad, env={})
    # a misspelt section was ignored where a misspelt key is an error
    with pytest.raises(ConfigError, match=r"no config section 'servr' \(did you mean 'server'"):
        env_overrides({"KVGATE_SERVR_PORT": "1"})
    parsed = parse_nodes(["a=http://127.0.0.1:9", "http://u:p=w@127.0.0.1:10"])
    assert [(n.id, n.url) for n in parsed] == [
        ("a", "http://127.0.0.1:9"), ("127.0.0.1:10", "http://u:p=w@127.0.0.1:10")]
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, env={})
    assert load_config(None, env={}) == GatewayConfig()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "nohup"])
def test_kvgate_serve_runs_until_sigterm(tmp_path: Path, sig: str) -> None:
    """SIGHUP (a closed terminal, a supervisor) drains as SIGTERM does: it used to end the
    process at once (exit 129), cutting every stream. Under nohup (SIGHUP ignored when
    it starts) a SIGHUP changes nothing: the gateway serves on until SIGTERM."""
    code = ("import sys; from kvgate.gateway.serve import *; import argparse; "
            "p = argparse.ArgumentParser(); add_serve_parser(p.add_subparsers(dest='c')); "
            "sys.exit(run_serve(p.parse_args(sys.argv[1:])))")
    def ignore_hup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVGATE_NODES_STATIC": "[]"},
        preexec_fn=ignore_hup if sig == "nohup" else None,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on http://" in line, line + (proc.stderr.read() if proc.stderr else "")
        url = line.split("serving on ")[1].split()[0]
        deadline = time.monotonic() + 5
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if sig == "nohup":
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert proc.poll() is None  # still serving
            sig = "SIGTERM"
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_kvgate_serve_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.gateway import run_serve

    assert run_serve(_parse(["--port", "99999"])) == 2
    assert "server.port" in capsys.readouterr().err


def test_request_ids_are_unique_and_reprefixed() -> None:
    from kvgate.gateway.proxy import RequestIds

    ids = RequestIds()
    first = [ids.next() for _ in range(1000)]
    assert len(set(first)) == 1000 and all(r.startswith("kvg-") for r in first)
    ids.reset()  # a restart or a forked worker: a new random prefix
    assert ids.next() not in first
    assert RequestIds().next() != RequestIds().next()


def test_header_timeout_from_yaml_and_env(tmp_path: Path) -> None:
    assert GatewayConfig().server.header_timeout_s == 30.0
    path = tmp_path / "gw.yaml"
    path.write_text("server: {header_timeout_s: 12}\n")
    assert load_config(path, env={}).server.header_timeout_s == 12.0
    env = {"KVGATE_SERVER_HEADER_TIMEOUT_S": "2.5"}
    assert load_config(path, env=env).server.header_timeout_s == 2.5


def test_lease_settings_from_yaml_and_env_reach_the_core(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("admission: {expected_gateways: 3, lease_ttl_s: 4, reclaim_grace_s: 1.5}\n")
    env = {"KVGATE_ADMISSION_LEASE_REFRESH_S": "1.0", "KVGATE_ADMISSION_EXPECTED_GATEWAYS": "4"}
    lease = load_config(path, env=env).controller_config().admission.lease
    assert (lease.expected_gateways, lease.ttl_s, lease.refresh_s, lease.reclaim_grace_s) == (
        4, 4.0, 1.0, 1.5)
    default = GatewayConfig().controller_config().admission.lease
    assert (default.expected_gateways, default.ttl_s, default.refresh_s) == (1, 2.0, 0.5)


def test_p2_settings_from_yaml_reach_the_core(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("admission: {reclaim_p2: false, p2_start: 0.5, reclaim_retry_after_s: 2}\n")
    adm = load_config(path, env={}).controller_config().admission
    assert (adm.reclaim_p2, adm.slo.p2_start, adm.reclaim_retry_after_s) == (False, 0.5, 2.0)
    default = GatewayConfig().controller_config().admission
    assert (default.reclaim_p2, default.slo.p2_start, default.reclaim_retry_after_s) == (
        True, 0.1, 5.0)


def test_tenant_confinement_from_yaml_reaches_the_core(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("admission: {tenant_quotas: {acme: 8}, tenant_confine_s: 0}\n")
    assert load_config(path, env={}).controller_config().tenant_confine_s == 0.0
    assert GatewayConfig().controller_config().tenant_confine_s == 10.0


def test_gateways_that_never_reach_the_coordinator_share_the_budget() -> None:
    """Three gateways with expected_gateways: 3 and no coordinator: each admits P0 up
    to K / 3 from its start-up allowance, however long the outage (NO_ASSIGNMENT does
    not fall to SAFE: with no grant there is no better bound), and says it is degraded."""
    from kvgate.core.admission import (
        AdmissionRequest,
        Admitted,
        GatewayAdmission,
        LeaseState,
        Priority,
    )
    from kvgate.gateway.config import AdmissionSection

    cfg = AdmissionSection(budget=103, expected_gateways=3).admission_config()  # K = 100
    gateways = [GatewayAdmission(cfg, f"g{i}") for i in range(3)]
    admitted = [0, 0, 0]
    n = 0
    for step in range(200):  # 20 s of refreshes failing every 100 ms
        now = 0.1 * step
        for i, gw in enumerate(gateways):
            if gw.refresh_due(now):
                gw.make_refresh(now)
                gw.refresh_failed(now)
            for _ in range(5):
                n += 1
                d = gw.admit(AdmissionRequest(request_id=f"r{n}", tenant="t",
                                              priority=Priority.P0, prompt_tokens=10,
                                              max_seq_len=None), now)
                admitted[i] += isinstance(d, Admitted)
            gw.poll(now)
            assert gw.lease_state is LeaseState.NO_ASSIGNMENT and gw.degraded
            assert gw.inuse_total <= 100 // 3
    assert admitted == [33, 33, 33] and sum(g.inuse_total for g in gateways) <= 100
    assert all(g.stats().refresh_failures >= 20 for g in gateways)
