"""The cluster breaker: stop admitting when the pool is failing or gone.

CLOSED -> OPEN when, over the last ``window_s`` (bucketed), at least ``min_outcomes``
outcomes were recorded and failures / outcomes >= ``error_rate``. OPEN lasts
``open_s``, then HALF_OPEN lets ``half_open_probes`` requests through: that many
successes close it (with a fresh window), any failure opens it again.

Independently, the breaker is forced open while no node is healthy (reason
"no healthy node"); when a node comes back it returns to its own state.

The breaker sees only outcomes (``record``) and admits (``allow``); it does not know
which outcome belongs to which request, so in HALF_OPEN the next outcomes decide.
An outcome that says nothing about the cluster's health (a client's own bad request,
a node refusing for load) is ``ignore``d: not counted, and in HALF_OPEN its probe is
handed back.
"""

from __future__ import annotations

import math

from kvgate.core.admission.config import BreakerConfig
from kvgate.core.admission.types import BreakerState

NO_HEALTHY_NODE = "no healthy node"
ERROR_RATE = "error rate"


class ClusterBreaker:
    __slots__ = (
        "_bucket_s",
        "_fail",
        "_half_open_successes",
        "_no_healthy",
        "_ok",
        "_opened_at",
        "_probed_at",
        "_probes_left",
        "_stamp",
        "_state",
        "config",
        "opens",
        "state",
    )

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        n = config.buckets
        self._bucket_s = config.window_s / n
        self._ok = [0] * n
        self._fail = [0] * n
        self._stamp = [-1] * n  # the absolute bucket index each slot holds
        self._state = BreakerState.CLOSED  # the error-rate state machine
        self._no_healthy = False
        self._opened_at = 0.0
        self._probed_at = 0.0  # half-open: when the last probe went (or half-open began)
        self._probes_left = 0
        self._half_open_successes = 0
        self.opens = 0
        # the effective state, kept current so the hot path reads one attribute
        self.state = BreakerState.CLOSED

    # ----------------------------------------------------------------- inputs
    def set_no_healthy(self, no_healthy: bool) -> None:
        self._no_healthy = no_healthy
        self._publish()

    def record(self, success: bool, now: float) -> None:
        self.tick(now)
        if self._state is BreakerState.HALF_OPEN:
            if not success:
                self._open(now)
            else:
                self._half_open_successes += 1
                if self._half_open_successes >= self.config.half_open_probes:
                    self._close()
            return
        if self._state is BreakerState.OPEN:
            return  # outcomes of requests admitted before opening say nothing new
        slot = self._slot(now)
        if success:
            self._ok[slot] += 1
        else:
            self._fail[slot] += 1
            ok, fail = self.window_counts(now)
            total = ok + fail
            if total >= self.config.min_outcomes and fail >= self.config.error_rate * total:
                self._open(now)

    def ignore(self, now: float) -> None:
        """An outcome that is neither a success nor a failure of the cluster."""
        self.tick(now)
        if self._state is BreakerState.HALF_OPEN:
            # The probe it may have used proved nothing: let another one through, or
            # the breaker could stay half-open with no probe left.
            self._probes_left = min(self._probes_left + 1, self.config.half_open_probes)

    def tick(self, now: float) -> None:
        """Time-based transitions: OPEN -> HALF_OPEN after ``open_s``, and in HALF_OPEN
        new probes when the last ones went ``open_s`` ago with no verdict."""
        if self._state is BreakerState.OPEN and now >= self._opened_at + self.config.open_s:
            self._state = BreakerState.HALF_OPEN
            self._probes_left = self.config.half_open_probes
            self._half_open_successes = 0
            self._probed_at = now
            self._publish()
        elif (
            self._state is BreakerState.HALF_OPEN
            and self._probes_left <= 0
            and now >= self._probed_at + self.config.open_s
        ):
            # A probe whose request never reports an outcome (cancelled by its client,
            # found no node, timed out in the queue) would hold the breaker half-open
            # with no probe left, refusing everything until a restart: re-arm.
            self._probes_left = self.config.half_open_probes
            self._probed_at = now

    def refusing(self, now: float) -> bool:
        """Whether a request would be refused now, without taking a probe: open, no
        healthy node, or half-open with every probe out. A request that will not be
        admitted now (queued, or refused for its class) must not spend a probe, or a
        class refused in safe mode took every probe from the classes admitted."""
        if self.state is BreakerState.CLOSED:
            return False
        self.tick(now)
        if self._no_healthy or self._state is BreakerState.OPEN:
            return True
        return self._state is BreakerState.HALF_OPEN and self._probes_left <= 0

    def allow(self, now: float) -> bool:
        """May one more request be admitted now? Consumes a probe when half-open."""
        if self.refusing(now):
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probes_left -= 1
            self._probed_at = now
        return True

    # ----------------------------------------------------------------- views
    @property
    def reason(self) -> str:
        if self._no_healthy:
            return NO_HEALTHY_NODE
        return ERROR_RATE if self._state is not BreakerState.CLOSED else ""

    def retry_after(self, now: float) -> float:
        if self._no_healthy:
            return self.config.open_s
        if self._state is BreakerState.OPEN:
            return max(0.1, self._opened_at + self.config.open_s - now)
        return 1.0

    def window_counts(self, now: float) -> tuple[int, int]:
        current = math.floor(now / self._bucket_s)
        oldest = current - self.config.buckets + 1
        ok = fail = 0
        for i, stamp in enumerate(self._stamp):
            if stamp >= oldest:
                ok += self._ok[i]
                fail += self._fail[i]
        return ok, fail

    # ----------------------------------------------------------------- internals
    def _slot(self, now: float) -> int:
        index = math.floor(now / self._bucket_s)
        slot = index % self.config.buckets
        if self._stamp[slot] != index:
            self._stamp[slot] = index
            self._ok[slot] = 0
            self._fail[slot] = 0
        return slot

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._probes_left = 0
        self.opens += 1
        self._publish()

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        n = self.config.buckets
        self._ok = [0] * n
        self._fail = [0] * n
        self._stamp = [-1] * n
        self._publish()

    def _publish(self) -> None:
        self.state = BreakerState.OPEN if self._no_healthy else self._state
