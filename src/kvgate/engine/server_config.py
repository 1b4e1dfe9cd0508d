"""Configuration and fault specs of `kvgate engine`, the simulated engine's HTTP shell (pure).

Faults
------
One vocabulary for ``--fault`` flags (``ACTION[:VALUE]``) and ``POST
/admin/fault`` bodies (``{"action": ACTION, ...params}``):

==================  ==========================  ============================================
action              params (flag VALUE)         effect
==================  ==========================  ============================================
crash               -                           every in-flight request fails (streams end
                                                with an error event, the others get 503), the
                                                KV cache is cleared, /health and new requests
                                                answer 503 until ``recover``
slow                factor (K, default 2,       every engine step takes K times longer
                    at most 1000)
reject              on (default true)           every submission gets 503 retry-elsewhere
mass_evict          fraction (X, default 0.5)   ``engine.flush(X)``: X of the cached blocks
                                                not in use (LRU first), a forced flush:
                                                announced, then evicted in batches
midstream_error     after (N, default 3),       the next ``count`` streamed responses end after
                    count                       N token chunks with an error event + [DONE]
reset_connection    count                       the next ``count`` requests get their TCP
                                                connection reset before the first byte
slow_first_byte     seconds (S, default 1),     the next ``count`` requests wait S wall
                    count                       seconds before the engine sees them
recover             -                           heal every fault above
==================  ==========================  ============================================

``count`` defaults to 1 for the admin endpoint and to 0 for a ``--fault`` flag;
0 means "every request until recover". Engine times (slow) are modelled; wire
delays (slow_first_byte) are wall seconds, unaffected by ``--speedup``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kvgate.engine.api import SchedulingPolicy
from kvgate.engine.eviction import EvictionConfig
from kvgate.engine.node_admission import NodeAdmissionConfig
from kvgate.engine.profiles import DEFAULT_PROFILE, EngineProfile

__all__ = [
    "FAULT_ACTIONS",
    "MAX_SLOW_FACTOR",
    "EngineServerConfig",
    "FaultParamError",
    "FaultSpec",
    "WireFaults",
    "parse_fault_flag",
]

FaultAction = Literal[
    "crash", "slow", "reject", "mass_evict", "midstream_error", "reset_connection",
    "slow_first_byte", "recover",
]
FAULT_ACTIONS: Final[tuple[str, ...]] = (
    "crash", "slow", "reject", "mass_evict", "midstream_error", "reset_connection",
    "slow_first_byte", "recover",
)
_FLAG_PARAM: Final[dict[str, str]] = {
    "slow": "factor", "reject": "on", "mass_evict": "fraction", "midstream_error": "after",
    "slow_first_byte": "seconds", "reset_connection": "count",
}
_ALLOWED: Final[dict[str, frozenset[str]]] = {
    "crash": frozenset(), "recover": frozenset(), "slow": frozenset({"factor"}),
    "reject": frozenset({"on"}), "mass_evict": frozenset({"fraction", "reason"}),
    "midstream_error": frozenset({"after", "count"}),
    "reset_connection": frozenset({"count"}),
    "slow_first_byte": frozenset({"seconds", "count"}),
}
# A slow step is already 1000 times its modelled time (a 20 ms step: 20 s); beyond
# that a single step would outlast any test or benchmark and read as a hang.
MAX_SLOW_FACTOR: Final = 1000.0


class FaultParamError(ValueError):
    """A fault's parameter is missing its type or range; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _number(params: Mapping[str, Any], name: str, default: float, *, low: float,
            high: float = math.inf, low_open: bool = False) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultParamError(f"fault param {name!r} must be a number, got {value!r}", name)
    number = float(value)
    if not math.isfinite(number) or number < low or (low_open and number <= low) or number > high:
        bounds = f"{'>' if low_open else '>='} {low:g}"
        if high < math.inf:
            bounds += f" and <= {high:g}"
        raise FaultParamError(f"fault param {name!r} out of range: {value!r} (must be "
                              f"{bounds})", name)
    return number


def _count(params: Mapping[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FaultParamError(f"fault param {name!r} must be an integer >= 0, got {value!r}",
                              name)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """One validated fault action with its parameters filled in."""

    action: FaultAction
    factor: float = 2.0  # slow
    on: bool = True  # reject
    fraction: float = 0.5  # mass_evict
    reason: str = "fault"  # mass_evict
    after: int = 3  # midstream_error
    seconds: float = 1.0  # slow_first_byte
    count: int = 1  # wire faults; 0 = until recover

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, default_count: int = 1) -> FaultSpec:
        """Validate an admin body; ValueError on an unknown action or bad param."""
        action = obj.get("action")
        if not isinstance(action, str) or action not in FAULT_ACTIONS:
            raise ValueError(f"unknown fault action {action!r}; known: {', '.join(FAULT_ACTIONS)}")
        params = {k: v for k, v in obj.items() if k != "action"}
        unknown = sorted(set(params) - _ALLOWED[action])
        if unknown:
            raise ValueError(f"fault {action!r} takes no param(s) {unknown}")
        on = params.get("on", True)
        if not isinstance(on, bool):
            raise FaultParamError(f"fault param 'on' must be a boolean, got {on!r}", "on")
        reason = params.get("reason", "fault")
        if not isinstance(reason, str):
            raise FaultParamError(f"fault param 'reason' must be a string, got {reason!r}",
                                  "reason")
        return cls(
            action=action,  # type: ignore[arg-type]  # checked against FAULT_ACTIONS
            factor=_number(params, "factor", 2.0, low=0.0, high=MAX_SLOW_FACTOR,
                           low_open=True),
            on=on,
            fraction=_number(params, "fraction", 0.5, low=0.0, high=1.0, low_open=True),
            reason=reason,
            after=_count(params, "after", 3),
            seconds=_number(params, "seconds", 1.0, low=0.0),
            count=_count(params, "count", default_count),
        )


def parse_fault_flag(text: str) -> FaultSpec:
    """``--fault ACTION[:VALUE]``, e.g. ``crash``, ``slow:4``, ``slow_first_byte:0.5``."""
    action, sep, value = text.strip().partition(":")
    obj: dict[str, Any] = {"action": action}
    if sep:
        name = _FLAG_PARAM.get(action)
        if name is None:
            raise ValueError(f"fault {action!r} takes no value (got {text!r})")
        if name == "on":
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError(f"fault {text!r}: reject takes on|off")
            obj[name] = value.lower() in ("on", "true", "1")
        else:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"fault {text!r}: {value!r} is not a number") from None
            is_int = name in ("after", "count")
            if is_int and not number.is_integer():
                raise ValueError(f"fault {text!r}: {name} must be an integer")
            obj[name] = int(number) if is_int else number
    return FaultSpec.from_json(obj, default_count=0)


@dataclass(slots=True)
class _Armed:
    left: int = -1  # -1 off, 0 every request until recover, n > 0 the next n
    value: float = 0.0

    def arm(self, count: int, value: float = 0.0) -> None:
        self.left, self.value = count, value

    def take(self) -> float | None:
        if self.left < 0:
            return None
        if self.left > 0:
            self.left -= 1
            if self.left == 0:
                self.left = -1
        return self.value

    def as_json(self) -> dict[str, Any] | None:
        if self.left < 0:
            return None
        return {"count": self.left, "value": self.value}


@dataclass(slots=True)
class WireFaults:
    """Faults of the HTTP shell itself (the engine model knows nothing of them)."""

    reset_connection: _Armed = field(default_factory=_Armed)
    slow_first_byte: _Armed = field(default_factory=_Armed)
    midstream_error: _Armed = field(default_factory=_Armed)

    def arm(self, spec: FaultSpec) -> bool:
        """Arm a wire fault; False when `spec` is not one."""
        if spec.action == "reset_connection":
            self.reset_connection.arm(spec.count)
        elif spec.action == "slow_first_byte":
            self.slow_first_byte.arm(spec.count, spec.seconds)
        elif spec.action == "midstream_error":
            self.midstream_error.arm(spec.count, spec.after)
        else:
            return False
        return True

    def heal(self) -> None:
        self.reset_connection.arm(-1)
        self.slow_first_byte.arm(-1)
        self.midstream_error.arm(-1)

    def as_json(self) -> dict[str, Any]:
        return {
            "reset_connection": self.reset_connection.as_json(),
            "slow_first_byte": self.slow_first_byte.as_json(),
            "midstream_error": self.midstream_error.as_json(),
        }


DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineServerConfig:
    """Everything `kvgate engine` needs. ``port=0`` picks a free port.

    ``profile`` is a registered name (``a100-8b``, ``h100-8b``) or an
    :class:`EngineProfile` (tests). ``max_model_len`` None = the pool capacity.
    ``speedup``: a modelled step of d seconds takes d / speedup wall seconds.
    ``kv_events_endpoint``: None disables KV events; vLLM's rule decides bind
    vs connect (bind when it contains ``*`` or ``::``, or is ipc/inproc).
    ``node_id`` defaults to ``host:port`` once the port is known.
    """

    host: str = "127.0.0.1"
    port: int = 8100
    model: str = "kvgate-sim"
    profile: str | EngineProfile = DEFAULT_PROFILE
    num_blocks: int = 1000
    block_size: int = 16
    max_model_len: int | None = None
    speedup: float = 1.0
    node_id: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_layout: Literal["map", "array"] = "map"
    kv_events_topic: str = ""
    faults: tuple[FaultSpec, ...] = ()
    scheduling_policy: SchedulingPolicy = "priority"
    admission: NodeAdmissionConfig = field(default_factory=NodeAdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 30.0  # a connection must send a whole request head in this
    body_timeout_s: float = 30.0  # and a request's whole body in this, once its head is in
    default_max_tokens_completion: int = 16
    default_max_tokens_chat: int = 256

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speedup) and self.speedup > 0):
            raise ValueError(f"speedup must be a finite number > 0, got {self.speedup}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.host.strip():
            raise ValueError("host must not be empty (0.0.0.0 listens on every interface)")
        if self.kv_events_endpoint is not None:
            _check_tcp_port(self.kv_events_endpoint)
        if self.kv_events_layout not in ("map", "array"):
            raise ValueError(f"kv_events_layout must be 'map' or 'array', got "
                             f"{self.kv_events_layout!r}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        for key in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {value}")
        if not self.model:
            raise ValueError("model must not be empty")


def _check_tcp_port(endpoint: str) -> None:
    """A ``tcp://host:port`` endpoint's port must be one (or ZMQ's ``*``, any free one):
    ZMQ took 99999 modulo 65536 and published on 34463, where no subscriber looks.
    Raises ValueError."""
    if not endpoint.startswith("tcp://"):
        return
    _, sep, port = endpoint.rpartition(":")
    if port == "*":
        return
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"kv events endpoint {endpoint!r}: the port must be in [1, 65535]")
