"""Configuration loading: Kubernetes service links, secrets kept out of error messages,
node URLs compared as URLs, YAML merge keys, huge numbers and untypable client keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate.core.errors import ConfigError
from kvgate.core.typed_values import coerce
from kvgate.gateway import load_config
from kvgate.gateway.config import url_key
from kvgate.gateway.config_load import env_overrides, is_service_link, read_yaml
from kvgate.gateway.redact import redact_url


def _links(prefix: str) -> dict[str, str]:
    """What Kubernetes injects for a Service whose name env-ifies to ``prefix``."""
    return {
        f"{prefix}_SERVICE_HOST": "10.96.0.12",
        f"{prefix}_SERVICE_PORT": "8000",
        f"{prefix}_SERVICE_PORT_HTTP": "8000",
        f"{prefix}_PORT": "tcp://10.96.0.12:8000",
        f"{prefix}_PORT_8000_TCP": "tcp://10.96.0.12:8000",
        f"{prefix}_PORT_8000_TCP_PROTO": "tcp",
        f"{prefix}_PORT_8000_TCP_PORT": "8000",
        f"{prefix}_PORT_8000_TCP_ADDR": "10.96.0.12",
    }


def _error(**kwargs: Any) -> str:
    """The message of the ConfigError ``load_config(**kwargs)`` raises."""
    with pytest.raises(ConfigError) as exc:
        load_config(**kwargs)
    return exc.value.message


# ------------------------------------------------------------- Kubernetes service links
@pytest.mark.parametrize("service", ["KVGATE", "KVGATE_SERVER", "KVGATE_NODES",
                                     "KVGATE_ADMISSION", "KVGATE_REDIS", "KVGATE_SERVER_PORT"])
def test_kubernetes_service_links_are_not_config(service: str) -> None:
    """A Service named kvgate, kvgate-server ... in the namespace: its variables made the
    gateway exit 2 (KVGATE_SERVICE_HOST read as a misspelt section 'server',
    KVGATE_SERVER_PORT=tcp://... as server.port)."""
    cfg = load_config(None, env=_links(service))
    assert cfg.server.port == 8000 and cfg.nodes.static == ()


def test_a_real_port_variable_is_still_read_next_to_service_links() -> None:
    env = {**_links("KVGATE_SERVER"), "KVGATE_SERVER_PORT": "8001"}
    assert load_config(None, env=env).server.port == 8001
    assert not is_service_link("KVGATE_SERVER_PORT", "8001")
    assert is_service_link("KVGATE_SERVER_PORT", "tcp://10.0.0.1:80")
    # a variable of ours that is no service link keeps its checks
    with pytest.raises(ConfigError, match="has no key 'colour'"):
        env_overrides({**_links("KVGATE_NODES"), "KVGATE_NODES_COLOUR": "1"})


def test_a_misspelt_section_is_an_error_only_before_one_of_its_keys() -> None:
    with pytest.raises(ConfigError, match=r"no config section 'servr' \(did you mean 'server'"):
        env_overrides({"KVGATE_SERVR_PORT": "1"})
    with pytest.raises(ConfigError, match="did you mean 'routing'"):
        env_overrides({"KVGATE_ROUTNG_POLICY": "x"})
    # 'service' is close to 'server', but 'account' is no key of it: not ours
    assert env_overrides({"KVGATE_SERVICE_ACCOUNT": "x", "KVGATE_SERVERS": "a,b"}) == {}


# ------------------------------------------------------------- secrets in error messages
def test_redact_url_hides_passwords_that_break_the_url() -> None:
    """A '#', '/' or '?' in a password ends the host for urlsplit: the password then sat
    in the 'fragment' or 'path', and the URL was shown as is."""
    for url in ("http://ops:Pq7#Zx9@10.0.0.1:8000", "http://ops:Pq7/Zx9@10.0.0.1:8000",
                "http://ops:Pq7?Zx9@10.0.0.1:8000", "http://ops:4521#Zx9@10.0.0.1:8000"):
        shown = redact_url(url)
        assert "Pq7" not in shown and "Zx9" not in shown and "4521" not in shown, shown
        assert shown == "http://***@10.0.0.1:8000"
    assert redact_url("redis://h:6379/0?password=ab@cd") == "redis://..."
    assert redact_url("http://[::1") == "http://[::1"  # nothing secret in it: as is
    assert redact_url("http://svc:pw@h:1/v1?x=1") == "http://svc:***@h:1/v1?x=1"


def test_a_node_url_error_never_shows_its_password() -> None:
    for url in ("http://ops:Pq7#Zx9@10.0.0.1:8000", "http://ops:4521#Zx9@10.0.0.1:8000",
                "http://ops:Pq7/Zx9@10.0.0.1:8000"):
        msg = _error(env={"KVGATE_NODES_STATIC": f"[{url!r}]"})
        assert "Pq7" not in msg and "Zx9" not in msg and "4521" not in msg, msg
        assert "http://***@10.0.0.1:8000" in msg and "percent-encoded" in msg


def test_an_unparsable_env_value_is_one_line_without_the_value() -> None:
    env = {"KVGATE_AUTH_KEYS": "{sk-live-CLIENTSECRET: acme, sk-live-OTHERSECRET: ops"}
    msg = _error(env=env)
    assert "SECRET" not in msg and "\n" not in msg, msg
    assert msg.startswith("KVGATE_AUTH_KEYS: ") and "at line 1 column 54" in msg
    msg = _error(env={"KVGATE_NODES_STATIC": "[http://a:1, {url: x, api_key: k-SECRET"})
    assert "SECRET" not in msg and "\n" not in msg, msg


def test_values_of_secret_settings_are_not_echoed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text('nodes: {static: {gpu1: {url: "http://10.0.0.1:8000", '
                    'api_key: NODEKEY-SECRET}}}\n')
    msg = _error(path=path, env={})
    assert "SECRET" not in msg and "must be a list of nodes, got a mapping" in msg
    path.write_text("server: {admin_token: 987654321987}\n")
    msg = _error(path=path, env={})
    assert "987654321987" not in msg and "server.admin_token must be a string" in msg
    path.write_text("nodes: {static: [{url: 'http://h:1', api_key: 1234567890}]}\n")
    msg = _error(path=path, env={})
    assert "1234567890" not in msg and "api_key must be a string" in msg
    # a client key given twice, or one level too high, is named by its start only
    path.write_text("auth:\n  keys:\n    sk-live-DUPSECRET: a\n    sk-live-DUPSECRET: b\n")
    msg = _error(path=path, env={})
    assert "DUPSECRET" not in msg and ":4:5: duplicate key 'sk-l'..." in msg, msg
    path.write_text("auth: {sk-live-TOPSECRET: acme}\n")
    msg = _error(path=path, env={})
    assert "TOPSECRET" not in msg and "auth: unknown key(s) 'sk-l'..." in msg, msg


def test_a_yaml_reader_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {gateway_id: a\x01b}\n")
    msg = _error(path=path, env={})
    assert "\n" not in msg and "unacceptable character #x0001" in msg, msg


# ------------------------------------------------------------- one engine, one node
@pytest.mark.parametrize("urls", [
    ["http://localhost:8000", "http://LOCALHOST:8000"],
    ["http://localhost:8000", "http://localhost:08000"],
    ["http://h", "http://h:80/"],
    ["https://h", "https://h:443"],
    ["http://[::1]:9", "http://[0:0::1]:9"],
    ["http://h:9", "http://user:pw@h:9"],
])
def test_one_engine_under_two_spellings_of_its_url_is_refused(urls: list[str]) -> None:
    nodes = [{"id": f"n{i}", "url": u} for i, u in enumerate(urls)]
    msg = _error(env={}, overrides={"nodes": {"static": nodes}})
    assert "nodes 'n0' and 'n1' have the same url" in msg


def test_url_key_tells_different_engines_apart() -> None:
    assert url_key("http://h:1") != url_key("http://h:2")
    assert url_key("http://h:1") != url_key("https://h:1")
    assert url_key("http://h:1/a") != url_key("http://h:1/b")
    assert url_key("http://a:1") != url_key("http://b:1")
    nodes = [{"id": "a", "url": "http://h:1"}, {"id": "b", "url": "http://h:2"}]
    assert len(load_config(None, env={}, overrides={"nodes": {"static": nodes}}).nodes.static) == 2


# ------------------------------------------------------------- YAML merge keys
def test_yaml_merge_keys_are_read(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "nodes:\n"
        "  static:\n"
        "    - &gpu {id: a, url: 'http://127.0.0.1:1', capacity: 32, api_key: sk-node-key}\n"
        "    - <<: *gpu\n"
        "      id: b\n"
        "      url: 'http://127.0.0.1:2'\n"
    )
    a, b = load_config(path, env={}).nodes.static
    assert (b.id, b.url, b.capacity, b.api_key) == ("b", "http://127.0.0.1:2", 32, "sk-node-key")
    assert (a.id, a.url) == ("a", "http://127.0.0.1:1")


def test_real_duplicates_are_still_refused_next_to_merge_keys(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("x: &n {id: a}\nnodes:\n  static:\n    - {<<: *n, id: b, id: c}\n")
    assert ":4:23: duplicate key 'id'" in _error(path=path, env={})
    # a mapping that merges, flattened (as another's merge source) before it is built
    path.write_text("k: [{m: &b {<<: {w: 1}, x: 2}}]\no: {<<: *b, x: 3}\n")
    assert read_yaml(path) == {"k": [{"m": {"w": 1, "x": 2}}], "o": {"w": 1, "x": 3}}
    path.write_text("server: {port: 1}\nserver: {host: h}\n")
    assert ":2:1: duplicate key 'server'" in _error(path=path, env={})


# ------------------------------------------------------------- numbers beyond a float
def test_a_huge_integer_for_a_float_setting_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("nodes: {health_interval_s: 1" + "0" * 400 + "}\n")
    msg = _error(path=path, env={})
    assert "nodes.health_interval_s must be a finite number" in msg and "0" * 50 not in msg
    msg = _error(env={"KVGATE_NODES_HEALTH_TIMEOUT_S": "1" + "0" * 400})
    assert "nodes.health_timeout_s must be a finite number" in msg
    with pytest.raises(ConfigError, match="must be a finite number"):
        coerce(-(10**400), float, "x")
    # beyond Python's int limit YAML itself cannot build it: a ValueError, a traceback
    path.write_text("server: {port: 1" + "0" * 5000 + "}\n")
    assert "a value cannot be read: Exceeds the limit" in _error(path=path, env={})
    msg = _error(env={"KVGATE_SERVER_PORT": "1" + "0" * 5000})
    assert msg.startswith("KVGATE_SERVER_PORT: the value cannot be read") and "\n" not in msg


def test_kvgate_serve_exits_2_on_a_huge_number(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvgate.gateway import add_serve_parser, run_serve

    path = tmp_path / "big.yaml"
    path.write_text("upstream: {request_timeout_s: 1" + "0" * 400 + "}\n")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert run_serve(parser.parse_args(["serve", "--port", "0", "--config", str(path)])) == 2
    assert "upstream.request_timeout_s must be a finite number" in capsys.readouterr().err


# ------------------------------------------------------------- client API keys
@pytest.mark.parametrize("key", ["sk-acme-key ", " sk-acme-key", "sk-acme-key\n",
                                 "sk-acme\x00key", "sk-acme\tkey"])
def test_a_client_key_no_client_could_send_is_refused(key: str) -> None:
    keys = {"sk-ops-0000": "ops", key: {"tenant": "acme"}}
    msg = _error(env={}, overrides={"auth": {"keys": keys}})
    assert "tenant 'acme' (#2)" in msg and "sk-acme" not in msg, msg


def test_a_client_key_with_inner_spaces_is_still_accepted() -> None:
    cfg = load_config(None, env={}, overrides={"auth": {"keys": {"sk a b": "acme"}}})
    assert list(cfg.auth.keys) == ["sk a b"]
