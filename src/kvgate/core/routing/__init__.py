"""Routing policies: one Protocol, one file per policy, one table of names.

``POLICIES`` is the only place a policy name is looked up; an unknown name is a
:class:`~kvgate.core.errors.ConfigError`, never a silent fallback.
"""

from __future__ import annotations

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
from kvgate.core.typed_values import coerce

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
    """``params`` checked against the policy's constructor annotations, as a config
    file's values are (:func:`~kvgate.core.typed_values.coerce`): a quoted "3" from YAML
    passed, and every request then failed with a TypeError deep in the score. Unknown
    names are left to the constructor."""
    init = next(vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c))
    hints = typing.get_type_hints(init)
    return {
        key: coerce(value, hints[key], f"routing policy {name!r}: {key}")
        if key in hints else value
        for key, value in params.items()
    }


__all__ = [
    "POLICIES",
    "RouteContext",
    "RouteDecision",
    "RouteReason",
    "RoutingPolicy",
    "make_policy",
]
