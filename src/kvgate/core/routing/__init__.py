"""Routing policies: one Protocol, one file per policy, one table of names.

``POLICIES`` is the only place a policy name is looked up; an unknown name is a
:class:`~kvgate.core.errors.ConfigError`, never a silent fallback.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping

from kvgate.core.errors import ConfigError
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason, RoutingPolicy
from kvgate.core.routing.consistent_hash import ConsistentHashPolicy
from kvgate.core.routing.dynamo_cost import DynamoCostPolicy
from kvgate.core.routing.kvgate import KvgatePolicy
from kvgate.core.routing.least_loaded import LeastLoadedPolicy
from kvgate.core.routing.power_of_two import PowerOfTwoPolicy
from kvgate.core.routing.preble_e2 import PrebleE2Policy
from kvgate.core.routing.random_choice import RandomPolicy
from kvgate.core.routing.round_robin import RoundRobinPolicy
from kvgate.core.routing.sglang_cache_aware import SglangCacheAwarePolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls
    for cls in (
        KvgatePolicy,
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadedPolicy,
        PowerOfTwoPolicy,
        ConsistentHashPolicy,
        SglangCacheAwarePolicy,
        DynamoCostPolicy,
        PrebleE2Policy,
    )
}


def make_policy(name: str, params: Mapping[str, object] | None = None) -> RoutingPolicy:
    """Build the policy called ``name`` with keyword ``params`` (its documented knobs)."""
    cls = POLICIES.get(name)
    if cls is None:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown routing policy {name!r}; known: {known}")
    try:
        return cls(**_typed_params(cls, dict(params or {}), name))
    except TypeError as exc:
        raise ConfigError(f"bad parameters for routing policy {name!r}: {exc}") from exc


def _typed_params(cls: type, params: dict[str, object], name: str) -> dict[str, object]:
    """``params`` checked against the policy's constructor annotations (a number where a
    number is due, ints taken as floats): a quoted "3" from YAML passed, and every
    request then failed with a TypeError deep in the score. Unknown names are left
    to the constructor."""
    init = next(vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c))
    hints = typing.get_type_hints(init)
    out = dict(params)
    for key, value in params.items():
        tp = hints.get(key)
        if tp is None:
            continue
        allowed = typing.get_args(tp) if typing.get_origin(tp) in (
            types.UnionType, typing.Union) else (tp,)
        if not any(_fits(value, a) for a in allowed):
            want = " or ".join(_type_name(a) for a in allowed)
            raise ConfigError(
                f"routing policy {name!r}: {key} must be {want}, got {value!r}", param=key
            )
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _fits(value: object, tp: object) -> bool:
    """Whether ``value`` is of the simple annotation ``tp`` (bool is no number here);
    annotations this does not know pass."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if tp is float:
        return number
    if tp is int:
        return number and isinstance(value, int)
    if tp in (bool, str, type(None)):
        return isinstance(value, tp)
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    return True


def _type_name(tp: object) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp)


__all__ = [
    "POLICIES",
    "RouteContext",
    "RouteDecision",
    "RouteReason",
    "RoutingPolicy",
    "make_policy",
]
