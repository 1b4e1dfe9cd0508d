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
    the port of the first and listened on 0.0.0.0:8000). Merge keys (``<<: *anchor``)
    still work: the keys they bring in may be overridden by the mapping's own."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # ids of the mapping nodes whose keys were checked

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        self._check_keys(node)
        # SafeConstructor's flattens the merge keys first (BaseConstructor's has no
        # constructor for their tag), the mapping's own keys winning over merged ones
        return super().construct_mapping(node, deep=deep)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        self._check_keys(node)  # a merge's source may be flattened before it is built
        super().flatten_mapping(node)

    def _check_keys(self, node: yaml.MappingNode) -> None:
        """Its own keys, each once; checked before flattening (after it, a merged key
        and the mapping's own override of it look like a duplicate)."""
        if id(node) in self._checked:
            return
        self._checked.add(id(node))
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown_key(key)}", key_node.start_mark)
            seen.add(key)


_MERGE_TAG = "tag:yaml.org,2002:merge"
_PLAIN_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


def shown_key(key: object) -> str:
    """A mapping key fit for an error message: a setting's name as is; anything else
    (auth.keys' keys are client API keys) by its first 4 characters only."""
    if not isinstance(key, str):
        return repr(key)
    return repr(key) if _PLAIN_KEY.fullmatch(key) else f"{key[:4]!r}..."


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
    except yaml.YAMLError as exc:  # one line: the reader's own message takes two
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from exc
    except ValueError as exc:  # a constructor's: an int of 5000 digits, a 30th of February
        raise ConfigError(f"config file {path}: a value cannot be read: {_value_problem(exc)}"
                          ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return data


def env_overrides(env: Mapping[str, str]) -> Raw:
    """``KVGATE_<SECTION>_<KEY>=value`` for our sections; other variables are ignored,
    unless their section looks like a misspelt one of ours and the rest of the name is
    one of its keys. Kubernetes' service links (see :func:`is_service_link`) are not ours."""
    out: Raw = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or is_service_link(name, text):
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("_")
        if section not in _SECTION_TYPES:
            # other KVGATE_ variables (a deploy script's) are not ours, but one that
            # looks like a misspelt section is: it was silently ignored, where a
            # misspelt key is an error
            if suggested := _misspelt_section(section, key):
                raise ConfigError(f"{name}: no config section {section!r} "
                                  f"(did you mean {suggested!r}?)")
            continue
        if not key:
            raise ConfigError(f"{name}: names no key of section {section!r}")
        hints = _hints(_SECTION_TYPES[section])
        if key not in hints:
            raise ConfigError(f"{name}: {section} has no key {key!r}"
                              f"{_did_you_mean(key, hints)}; known: {', '.join(sorted(hints))}")
        out.setdefault(section, {})[key] = _env_value(text, hints[key], name)
    return out


# What Kubernetes injects into every pod of a namespace for each Service (with
# enableServiceLinks, on by default): a Service "kvgate-server" gives
# KVGATE_SERVER_SERVICE_HOST, KVGATE_SERVER_SERVICE_PORT[_<PORTNAME>],
# KVGATE_SERVER_PORT=tcp://10.96.0.12:8000 and KVGATE_SERVER_PORT_8000_TCP[_PROTO|_PORT|_ADDR].
_LINK_NAME = re.compile(
    r".+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)"
)
_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://\S+:\d+", re.IGNORECASE)


def is_service_link(name: str, value: str) -> bool:
    """A Kubernetes service-link variable: ``*_SERVICE_HOST``, ``*_SERVICE_PORT*``,
    ``*_PORT_<n>_<PROTO>*``, or ``*_PORT`` whose value is ``tcp://host:port`` (a real
    ``KVGATE_SERVER_PORT=8001`` is a number, and still read)."""
    if _LINK_NAME.fullmatch(name):
        return True
    return name.endswith("_PORT") and _LINK_VALUE.fullmatch(value.strip()) is not None


def _misspelt_section(section: str, key: str) -> str | None:
    """The section ``section`` is a misspelling of, when ``key`` is a key of it
    (KVGATE_SERVR_PORT); None for a name merely alike (KVGATE_SERVICE_ACCOUNT)."""
    for close in difflib.get_close_matches(section, SECTIONS, n=3):
        if key in _hints(_SECTION_TYPES[close]):
            return close
    return None


def _env_value(text: str, tp: Any, name: str) -> Any:
    if tp is str or (is_optional(tp) and strip_optional(tp) is str):
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # one line, and never the value: it may be API keys or a node's credentials
        raise ConfigError(f"{name}: {_yaml_problem(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"{name}: the value cannot be read: {_value_problem(exc)}") from exc


def _value_problem(exc: ValueError) -> str:
    """A YAML constructor's ValueError, its first clause (Python's int limit goes on
    about sys.set_int_max_str_digits)."""
    return str(exc).split(";")[0].split("\n")[0]


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in a few words and where (lines and columns from 1), on one line and
    without the text it quotes."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "not valid YAML"
        return f"{what} at line {mark.line + 1} column {mark.column + 1}" if mark else what
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character
        code = char[0] if isinstance(char, bytes) else char
        return f"unacceptable character #x{code:04x} at position {exc.position}"
    return "not valid YAML"


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
        # not shown as is: an API key put one level too high (auth: {sk-...: acme})
        shown = ", ".join(k if _PLAIN_KEY.fullmatch(k) else shown_key(k) for k in unknown)
        raise ConfigError(f"{section}: unknown key(s) {shown}{hint}; "
                          f"known: {', '.join(sorted(hints))}")
    required = [f.name for f in fields(cls) if f.name in hints and _required(f)]
    missing = [k for k in required if k not in values]
    if missing:  # a dataclass field without a default: its TypeError was a traceback
        raise ConfigError(f"{section}: missing required key(s) {', '.join(missing)}")
    kwargs = {k: coerce(v, hints[k], f"{section}.{k}", secret=k in SECRET_KEYS)
              for k, v in values.items()}
    return cls(**kwargs)


#: Settings whose values error messages never show (tokens, keys, URLs with passwords).
SECRET_KEYS = frozenset({"admin_token", "api_key", "redis_url", "url", "keys"})


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
        # urlsplit's words quote the "port", which may be a password cut short
        why = str(exc) if shown == url else _UNPARSABLE
        raise ConfigError(f"node url {shown!r} cannot be parsed: {why}") from exc
    if "@" in url.partition("://")[2] and "@" not in parts.netloc:
        raise ConfigError(f"node url {shown!r} cannot be parsed: {_UNPARSABLE}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"node url {shown!r} must look like http://host:port")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        # the gateway appends /v1/... and /health to the url: a query or fragment
        # would swallow them, and the node never answers
        raise ConfigError(f"node url {shown!r} must not have a query or fragment")
    if port == 0:
        raise ConfigError(f"node url {shown!r}: port 0 is no port to connect to")
    return url


_UNPARSABLE = ("a bad host or port, or a password with '#', '/' or '?' not percent-encoded "
               "(%23, %2F, %3F)")


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
    # its type only: a value here may be a node's credentials
    raise ConfigError(f"{where}: a node is a URL, NAME=URL or a mapping, got "
                      f"{_type_name(spec)}")


def parse_nodes(value: Any) -> tuple[NodeConfig, ...]:
    if isinstance(value, tuple) and all(isinstance(n, NodeConfig) for n in value):
        return value
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        # its type only: a mapping of nodes holds their api_keys and URLs
        raise ConfigError(f"nodes.static must be a list of nodes, got {_type_name(value)}")
    return tuple(parse_node(v, f"nodes.static[{i}]") for i, v in enumerate(value))


def _type_name(value: object) -> str:
    """What YAML calls a value's type, for messages that must not show the value."""
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "null"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


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
