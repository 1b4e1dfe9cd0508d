"""Nodes that keep refusing requests, left out of routing for a while.

A node's second-stage admission answers "retry elsewhere" (a plain vLLM, a bare 503;
a node shedding load, a 429) when its queue is full: working, and busy, and its load
reports say so (requests waiting), which the load score reads. A node that refuses
while it reports nothing waiting is not busy but broken, refusing *everything* while
its health check passes, and it looks
idle: a refusal comes back at once, so the node has nothing of ours in flight, and the
load-based score keeps choosing it (a soak audit: one node of three refusing for 10 s
drew 63 % of the traffic, and 716 requests failed where two idle nodes had room; the
retry budget caps the fall-back at a few a second). Ejection is for faults (a reset,
a timeout), and a refusal is no fault: the node is not marked down.

:class:`RefusalBackoff` instead leaves such a node (the controller counts only the
refusals of a node reporting nothing waiting: a busy one's are left to the load score;
counted, round robin's saturation point on the conversation trace moved from x1.044 to
x1.079) out of the candidates after ``after`` refusals in a row with no request taken
in between, for ``first_s``,
doubled at each further refusal up to ``max_s``; the first request it takes (a first
byte) clears it. A node backing off is still routed to when no other candidate is
left: its refusal is then the answer, not the gateway's.
"""

from __future__ import annotations

from kvgate.core.admission import FailureKind
from kvgate.core.ids import NodeId

# what a node says when it will not take a request: busy, or refusing
REFUSALS = frozenset({FailureKind.RETRY_ELSEWHERE, FailureKind.HTTP_503, FailureKind.RATE_LIMITED})


class RefusalBackoff:
    def __init__(self, *, after: int = 2, first_s: float = 0.25, max_s: float = 5.0) -> None:
        if after < 1 or not 0.0 < first_s <= max_s:
            raise ValueError("refusal back-off: after >= 1 and 0 < first_s <= max_s")
        self.after = after
        self.first_s = first_s
        self.max_s = max_s
        self._refusals: dict[NodeId, int] = {}  # refusals in a row
        self._until: dict[NodeId, float] = {}  # backing off until
        self.backoffs = 0  # times a node was left out (a metric)

    def refused(self, node_id: NodeId, now: float) -> None:
        """``node_id`` refused a request at ``now``."""
        n = self._refusals.get(node_id, 0) + 1
        self._refusals[node_id] = n
        if n >= self.after:
            # the exponent capped: a node refusing for good refuses thousands in a row
            # (2.0 ** 1024 overflowed), and max_s caps the wait long before
            wait = min(self.max_s, self.first_s * 2.0 ** min(n - self.after, 64))
            if self._until.get(node_id, -1.0) <= now:
                self.backoffs += 1  # left out anew (not a refusal while left out)
            self._until[node_id] = now + wait

    def took(self, node_id: NodeId) -> None:
        """``node_id`` took a request (its first byte came): it is serving again."""
        if self._refusals:  # usually empty: one check per first byte
            self.forget(node_id)

    def forget(self, node_id: NodeId) -> None:
        """``node_id`` left the table (added again, it starts afresh)."""
        self._refusals.pop(node_id, None)
        self._until.pop(node_id, None)

    def left_out(self, now: float) -> frozenset[NodeId]:
        """The nodes backing off at ``now`` (usually none)."""
        until = self._until
        if not until:
            return frozenset()
        for node_id in [n for n, t in until.items() if t <= now]:
            del until[node_id]  # its time is up; its refusals in a row still count
        return frozenset(until)
