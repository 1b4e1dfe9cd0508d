"""Build a :class:`GatewayConfig` from YAML, environment variables and flag overrides.

Precedence, lowest first: defaults < YAML file < ``KVGATE_<SECTION>_<KEY>`` < flags.
Every value is type-checked against the dataclass field it lands in, so a typo or
a wrong type is a :class:`ConfigError` naming ``section.key``, never a late crash.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvgate.core.errors import ConfigError
from kvgate.core.typed_values import coerce, is_optional, strip_optional
from kvgate.gateway.config import (
    SECTIONS,
    AdmissionSection,
    ApiKey,
    AuthConfig,
    GatewayConfig,
    NodeConfig,
    NodesConfig,
    RoutingConfig,
    ServerConfig,
    UpstreamConfig,
)
from kvgate.gateway.redact import redact_url

ENV_PREFIX = "KVGATE_"
_SECTION_TYPES: dict[str, type] = {
    "server": ServerConfig,
    "upstream": UpstreamConfig,
    "nodes": NodesConfig,
    "routing": RoutingConfig,
    "admission": AdmissionSection,
    "auth": AuthConfig,
}

Raw = dict[str, dict[str, Any]]


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> GatewayConfig:
    """YAML file (optional) + environment (default ``os.environ``) + flag overrides."""
    raw: Raw = {s: {} for s in SECTIONS}
    if path is not None:
        _merge(raw, read_yaml(path), f"config file {path}")
    _merge(raw, env_overrides(os.environ if env is None else env), "environment")
    if overrides:
        _merge(raw, overrides, "flags")
    return build_config(raw)


class _StrictLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: YAML's "the last
    one wins" silently dropped a section's first half (a second ``server:`` block lost
    the port of the first and listened on 0.0.0.0:8000)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as exc:
        # one line, the file named: the problem and where (lines and columns from 1)
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = exc.problem or exc.context or "not valid YAML"
        raise ConfigError(f"config file {where}: {what}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return data


def env_overrides(env: Mapping[str, str]) -> Raw:
    """``KVGATE_<SECTION>_<KEY>=value`` for our sections; other variables are ignored,
    unless their section looks like a misspelt one of ours."""
    out: Raw = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("_")
        if section not in _SECTION_TYPES:
            # other KVGATE_ variables (a deploy script's) are not ours, but one that
            # looks like a misspelt section is: it was silently ignored, where a
            # misspelt key is an error
            if hint := _did_you_mean(section, SECTIONS):
                raise ConfigError(f"{name}: no config section {section!r}{hint}")
            continue
        if not key:
            raise ConfigError(f"{name}: names no key of section {section!r}")
        hints = _hints(_SECTION_TYPES[section])
        if key not in hints:
            raise ConfigError(f"{name}: {section} has no key {key!r}"
                              f"{_did_you_mean(key, hints)}; known: {', '.join(sorted(hints))}")
        out.setdefault(section, {})[key] = _env_value(text, hints[key], name)
    return out


def _env_value(text: str, tp: Any, name: str) -> Any:
    if tp is str or (is_optional(tp) and strip_optional(tp) is str):
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: cannot parse {text!r}: {exc}") from exc


def _merge(raw: Raw, source: Mapping[str, Any], what: str) -> None:
    for section, values in source.items():
        if section not in _SECTION_TYPES:
            hint = _did_you_mean(str(section), SECTIONS)
            raise ConfigError(f"{what}: unknown section {section!r}{hint}; "
                              f"known: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ConfigError(f"{what}: section {section!r} must be a mapping")
        raw[section].update(values)


def build_config(raw: Mapping[str, Mapping[str, Any]]) -> GatewayConfig:
    sections: dict[str, Any] = {}
    for name, cls in _SECTION_TYPES.items():
        values = dict(raw.get(name, {}))
        if name == "nodes" and "static" in values:
            values["static"] = parse_nodes(values["static"])
        if name == "auth" and "keys" in values:
            values["keys"] = _parse_keys(values["keys"])
        sections[name] = _build(cls, values, name)
    return GatewayConfig(**sections)


def _build(cls: type, values: Mapping[str, Any], section: str) -> Any:
    hints = _hints(cls)
    unknown = sorted(map(str, set(values) - set(hints)))
    if unknown:
        hint = _did_you_mean(unknown[0], hints) if len(unknown) == 1 else ""
        raise ConfigError(f"{section}: unknown key(s) {', '.join(unknown)}{hint}; "
                          f"known: {', '.join(sorted(hints))}")
    required = [f.name for f in fields(cls) if f.name in hints and _required(f)]
    missing = [k for k in required if k not in values]
    if missing:  # a dataclass field without a default: its TypeError was a traceback
        raise ConfigError(f"{section}: missing required key(s) {', '.join(missing)}")
    kwargs = {k: coerce(v, hints[k], f"{section}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING and f.init


def _did_you_mean(word: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


# ----------------------------------------------------------------------------- nodes

#: What a node id may be: hostnames, host:port, IPv6 host:port, pod names. The id
#: goes out in the X-Kvgate-Node header and in metric labels, so nothing else.
NODE_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_node_id(node_id: object, where: str = "nodes.static") -> str:
    """``node_id`` if it is a valid node id, else a :class:`ConfigError` naming ``where``."""
    if not isinstance(node_id, str) or NODE_ID_RE.fullmatch(node_id) is None:
        raise ConfigError(
            f"{where}: node id {node_id!r} must be 1 to 128 of the characters "
            "A-Z a-z 0-9 . _ : - (e.g. a hostname, host:port or pod name)",
            param="id",
        )
    return node_id


def default_node_id(url: str) -> str:
    """A node's short name when none is given: the URL's host:port."""
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    shown = redact_url(url)  # error messages never print a password
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"node url {shown!r}: {str(exc).replace(url, shown)}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"node url {shown!r} must look like http://host:port")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        # the gateway appends /v1/... and /health to the url: a query or fragment
        # would swallow them, and the node never answers
        raise ConfigError(f"node url {shown!r} must not have a query or fragment")
    if port == 0:
        raise ConfigError(f"node url {shown!r}: port 0 is no port to connect to")
    return url


_NAMED_URL = re.compile(r"([^=]*)=\s*(https?://.*)", re.IGNORECASE | re.DOTALL)


def parse_node(spec: Any, where: str = "nodes.static") -> NodeConfig:
    """``URL``, ``NAME=URL`` or a mapping with ``url`` and optional ``id`` and knobs."""
    if isinstance(spec, str):
        # NAME=URL only where what follows the first '=' starts with a scheme: a URL
        # may hold '=' itself (a password, a query)
        named = _NAMED_URL.fullmatch(spec.strip())
        name, url = named.groups() if named else ("", spec)
        url = normalise_url(url)
        node_id = check_node_id(name.strip() or default_node_id(url), where)
        return NodeConfig(id=node_id, url=url)
    if isinstance(spec, Mapping):
        values = dict(spec)
        if "url" not in values or not isinstance(values["url"], str):
            raise ConfigError(f"{where}: a node needs a url")
        values["url"] = normalise_url(values["url"])
        values.setdefault("id", default_node_id(values["url"]))
        check_node_id(values["id"], where)
        return typing.cast(NodeConfig, _build(NodeConfig, values, where))
    raise ConfigError(f"{where}: a node is a URL, NAME=URL or a mapping, got {spec!r}")


def parse_nodes(value: Any) -> tuple[NodeConfig, ...]:
    if isinstance(value, tuple) and all(isinstance(n, NodeConfig) for n in value):
        return value
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"nodes.static must be a list, got {value!r}")
    return tuple(parse_node(v, f"nodes.static[{i}]") for i, v in enumerate(value))


def _parse_keys(value: Any) -> dict[str, ApiKey]:
    if not isinstance(value, Mapping):
        raise ConfigError("auth.keys must be a mapping of API key -> {tenant, ...}")
    out: dict[str, ApiKey] = {}
    for key, spec in value.items():
        if not isinstance(key, str):
            raise ConfigError("auth.keys: API keys must be strings")
        where = f"auth.keys[{key[:4]}...]"
        if isinstance(spec, ApiKey):
            out[key] = spec
        elif isinstance(spec, str):
            out[key] = ApiKey(tenant=spec)
        elif isinstance(spec, Mapping):
            out[key] = typing.cast(ApiKey, _build(ApiKey, spec, where))
        else:
            raise ConfigError(f"{where}: expected a tenant name or a mapping")
    return out
