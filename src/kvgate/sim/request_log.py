"""One JSON line per request of a simulation run: what ``kvgate simulate --requests`` writes.

The report's aggregates (TTFT p99, the cache-loss funnel, ``ttft_parts``) say how a
policy did; the log says which requests made it so. A TTFT tail of long prompts and a
tail of short turns kept waiting for their cache read the same in a percentile and
differently here: ``prefill_alone_s`` is the request's own prefill on an idle node
after the cache it found, ``queued_s`` its time before the node first scheduled it,
and ``ttft_s`` less both is what other requests' work in its steps added.

Each line carries the run it belongs to (``policy``, ``speedup``, ``seed`` and, under a
scenario, ``variant``), so one file holds every run of a comparison, of a saturation
sweep and of its replays; rows follow the workload's order within a run. Keys
(documented in the README): :data:`REQUEST_LOG_KEYS`. Times are seconds on the
simulation's clock; a request that did not complete has ``null`` latencies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

from kvgate.engine import EngineProfile, get_profile, prefill_alone_s
from kvgate.sim.cluster import RequestOutcome, SimCluster
from kvgate.sim.report import _r, e2e, queued, tpot, ttft

# the run a line belongs to: its first keys
RUN_KEYS = ("policy", "speedup", "seed", "variant")
# the keys of every line, in the order written
REQUEST_LOG_KEYS = (
    *RUN_KEYS,
    "request_id",
    "session",
    "tenant",
    "priority",
    "arrived_s",
    "prompt_tokens",
    "output_tokens",
    "status",
    "reason",
    "node",
    "attempts",
    "route_reason",
    "matched_blocks",
    "best_matched_blocks",
    "cached_tokens",
    "ttft_s",
    "queued_s",
    "prefill_alone_s",
    "tpot_s",
    "e2e_s",
)


def request_rows(cluster: SimCluster, labels: Mapping[str, object]) -> Iterator[dict[str, object]]:
    """The log's rows of one finished run, in the workload's order; ``labels`` are the
    run's (``policy``, ``speedup``, ``seed``, ``variant``)."""
    profile = get_profile(cluster.config.profile)
    outcomes = cluster.outcomes  # filled in arrival order (a closed loop's is not the plan's)
    for req in cluster.workload.requests:
        o = outcomes[req.request_id]
        yield {key: labels.get(key) for key in RUN_KEYS} | _request_fields(o, profile)


def _request_fields(o: RequestOutcome, profile: EngineProfile) -> dict[str, object]:
    req = o.req
    first = ttft(o)
    return {
        "request_id": req.request_id,
        "session": req.session,
        "tenant": req.tenant,
        "priority": req.priority,
        "arrived_s": _r(o.arrived_s, 6),
        "prompt_tokens": req.prompt_tokens,
        "output_tokens": req.output_tokens,
        "status": o.status,
        "reason": o.reason,
        "node": o.node or None,
        "attempts": o.attempts,
        "route_reason": o.route_reason or None,
        "matched_blocks": o.matched_blocks,
        "best_matched_blocks": o.best_matched_blocks,
        "cached_tokens": o.cached_tokens,
        "ttft_s": _r(first, 6),
        "queued_s": _r(queued(o), 6),
        # the engine finds at most all but the prompt's last token cached
        "prefill_alone_s": None
        if first is None
        else _r(prefill_alone_s(profile, req.prompt_tokens, o.cached_tokens), 6),
        "tpot_s": _r(tpot(o), 6),
        "e2e_s": _r(e2e(o), 6),
    }


class RequestLog:
    """The ``--requests`` file, open for a whole ``kvgate simulate``: each run's rows are
    written as the run ends, so memory holds one run's outcomes at a time. The file is
    created with the first run's rows: a run that fails before (a missing trace) leaves
    an earlier log as it was."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[str] | None = None

    def write_run(self, cluster: SimCluster, labels: Mapping[str, object]) -> None:
        if self._file is None:
            self._file = self._path.open("w", encoding="utf-8")
        for row in request_rows(cluster, labels):
            self._file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


__all__ = ["REQUEST_LOG_KEYS", "RUN_KEYS", "RequestLog", "request_rows"]
