"""Fault injection state of the simulated engine.

Theory of operation
-------------------
Faults are plain state that `SimEngine` consults; nothing here acts by
itself or reads a clock:

* crashed: every in-flight request has failed (returned by `crash()`), the KV
  cache is gone (`AllBlocksCleared`), submissions are refused with
  RETRY_ELSEWHERE and `step()` does no work until `recover()`;
* slow_factor: every step takes `factor` times its modelled time (a thermally
  throttled or noisy-neighbour GPU);
* reject_all: every submission is refused with RETRY_ELSEWHERE (a node that
  sheds load, or answers 503, while looking healthy);
* mass eviction is not a state: it is `SimEngine.flush(share)` (a forced flush
  of a share of the cache, announced whatever its size) or
  `SimEngine.bulk_evict(fraction)` (announced above the bulk threshold).

`recover()` heals all three. A driver running decode runs settles the run before
a fault (`SimEngine.settle`; `SimCluster`'s fault wrappers do). Wire-level faults
(mid-stream errors, connection resets, slow first byte) belong to the HTTP shell,
not to the pure model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.engine.node_admission import NodeAdmission, RejectKind

__all__ = ["FaultState"]


@dataclass(slots=True)
class FaultState:
    """Which faults are active. Owned and mutated by one `SimEngine`."""

    crashed: bool = False
    slow_factor: float = 1.0
    reject_all: bool = False

    def set_slow(self, factor: float) -> None:
        if not (math.isfinite(factor) and factor > 0):  # an inf step would never end
            raise ValueError(f"slow factor must be a finite number > 0, got {factor}")
        self.slow_factor = factor

    def submit_refusal(self) -> NodeAdmission | None:
        """The rejection every submission gets while a fault is active, if any."""
        if self.crashed:
            return NodeAdmission.reject(RejectKind.RETRY_ELSEWHERE, "engine crashed")
        if self.reject_all:
            return NodeAdmission.reject(
                RejectKind.RETRY_ELSEWHERE, "rejecting all requests (fault injection)"
            )
        return None

    def heal(self) -> None:
        self.crashed = False
        self.slow_factor = 1.0
        self.reject_all = False

    @property
    def active(self) -> bool:
        return self.crashed or self.reject_all or self.slow_factor != 1.0
