"""The node's refusal header: how a node tells the gateway where a refused request may go.

A kvgate node (the simulated engine, or anything in front of an engine that speaks it)
answers a request it is too busy to run with 503 and ``X-Kvgate-Reject: <kind>``
(``retry-elsewhere`` or ``pool-overloaded``); the gateway reads the kind to decide
between another node and the client. A request that can never run there (too long:
``BAD_REQUEST``) is a plain 400, and a 503 without the header (vLLM's own) a plain 503.
Both sides import these names from here, so the header cannot drift between them.
"""

from __future__ import annotations

import enum

REJECT_HEADER = "X-Kvgate-Reject"


class RejectKind(enum.Enum):
    """Why a node refused; the values are the ``X-Kvgate-Reject`` header values."""

    RETRY_ELSEWHERE = "retry-elsewhere"  # this node is busy or down; another may serve it
    POOL_OVERLOADED = "pool-overloaded"  # memory-saturated; do not retry elsewhere
    BAD_REQUEST = "bad-request"  # the request can never run here (too long)
