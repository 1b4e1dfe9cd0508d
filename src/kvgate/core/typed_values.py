"""A value checked against a simple type annotation, for configuration (pure).

The gateway's YAML / environment loader and the routing policies' parameters take
values from users by name and check each against the annotation of the field or
constructor argument it lands in: a wrong type is a :class:`ConfigError` naming where
it came from, never a late crash (a quoted "3" for a number passed, and every request
then failed deep in the score).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from kvgate.core.errors import ConfigError

__all__ = ["coerce", "is_optional", "strip_optional"]


def is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (types.UnionType, typing.Union) and type(None) in (
        typing.get_args(tp)
    )


def strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


def coerce(value: Any, tp: Any, where: str, *, secret: bool = False) -> Any:
    """``value`` as annotation ``tp`` asks (an int for a float becomes a float); else a
    ConfigError saying ``where`` must be what. ``secret``: the message names the value's
    type, never the value (a token, a key, a URL with a password)."""
    if is_optional(tp):
        return None if value is None else coerce(value, strip_optional(tp), where, secret=secret)
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {_shown(value, secret)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {_shown(value, secret)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _as_float(value, where)
        raise ConfigError(f"{where} must be a number, got {_shown(value, secret)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {_shown(value, secret)}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where} must be one of {typing.get_args(tp)}, "
                          f"got {_shown(value, secret)}")
    if origin is tuple:
        if isinstance(value, tuple):  # already parsed (nodes.static)
            return value
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {_shown(value, secret)}")
        item_tp = typing.get_args(tp)[0]
        return tuple(coerce(v, item_tp, f"{where}[{i}]", secret=secret)
                     for i, v in enumerate(value))
    if origin is Mapping or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {_shown(value, secret)}")
        _, val_tp = typing.get_args(tp)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where}: keys must be strings, got {_shown(k, secret)}")
            out[k] = v if val_tp is object else coerce(v, val_tp, f"{where}.{k}", secret=secret)
        return out
    if isinstance(tp, type) and isinstance(value, tp):  # an already built value
        return value
    raise ConfigError(f"{where}: unsupported value {_shown(value, secret)}")  # pragma: no cover


def _as_float(value: int | float, where: str) -> float:
    """A float; an integer beyond a float's range (400 digits in a YAML file) is a
    ConfigError, not the OverflowError ``float()`` raises."""
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"{where} must be a finite number, got {_shown(value, False)}"
                          ) from None


def _shown(value: Any, secret: bool) -> str:
    """``value`` for an error message: its type alone when secret, else its repr (a
    huge integer by its size: its digits would fill the terminal)."""
    if secret:
        return f"a value of type {type(value).__name__}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)
