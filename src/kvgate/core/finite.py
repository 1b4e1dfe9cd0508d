"""Config values that must be finite numbers.

Range checks compare, and a NaN passes every comparison (``not nan > 0`` is the only
form that catches it), while an infinite time breaks the timer or timeout it sets:
configs refuse both before any range check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def first_nonfinite(obj: object, path: str = "") -> tuple[str, float] | None:
    """The dotted name (``lease.ttl_s``, ``classes[0].queue_timeout_s``, ``params.x``)
    and value of the first float in ``obj`` that is NaN or infinite, else None. ``obj``
    is a float, or a config dataclass, tuple or mapping holding such things."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path, obj)
    if isinstance(obj, tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, Mapping):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
    else:
        names = getattr(obj, "__dataclass_fields__", None)
        if names is None:
            return None
        items = ((f"{path}.{n}" if path else n, getattr(obj, n)) for n in names)
    for sub, value in items:
        if (bad := first_nonfinite(value, sub)) is not None:
            return bad
    return None


def require_finite(obj: object, name: str) -> None:
    """ValueError naming ``name.field`` when ``obj`` holds a NaN or infinite float: for
    the engine's configs, whose ``__post_init__`` calls it before any range check."""
    if (bad := first_nonfinite(obj)) is not None:
        raise ValueError(f"{name}.{bad[0]} must be a finite number, got {bad[1]}")
