"""Workloads for the simulator: requests as chained block ids, trace replay, helpers.

The pieces live in ``workload_types`` (:class:`SimRequest`, :class:`Workload`,
cache-only hit ratios), ``workload_mooncake`` (:func:`load_mooncake_trace`) and
``workload_ops`` (class assignment, rate scaling, windows, merge/concat); this module
is the one to import.
"""

from kvgate.sim.workload_mooncake import BucketMode, load_mooncake_trace
from kvgate.sim.workload_ops import (
    assign_classes,
    concat,
    merge,
    scale_rate,
    time_window,
    with_priority,
    with_tenant,
)
from kvgate.sim.workload_types import (
    PRIORITIES,
    SimRequest,
    Workload,
    ideal_hit_ratio,
    leading_run,
    percentile,
    pooled_lru_hit_ratio,
)

__all__ = [
    "PRIORITIES",
    "BucketMode",
    "SimRequest",
    "Workload",
    "assign_classes",
    "concat",
    "ideal_hit_ratio",
    "leading_run",
    "load_mooncake_trace",
    "merge",
    "percentile",
    "pooled_lru_hit_ratio",
    "scale_rate",
    "time_window",
    "with_priority",
    "with_tenant",
]
