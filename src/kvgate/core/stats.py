"""Counters the controller keeps for metrics, reports and the dashboard.

Plain integers and floats in dicts keyed by small closed sets (reasons, buckets,
classes), so the gateway can export them as Prometheus series without per-request
labels.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvgate.core.config import PREFIX_BUCKETS, bucket_of
from kvgate.core.nodes import NodeState


@dataclass(slots=True)
class HitCounter:
    """Prompt tokens seen and tokens found cached, predicted and measured."""

    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    measured_prompt_tokens: int = 0  # prompt tokens of requests whose engine reported usage
    measured_hit_tokens: int = 0
    # the index's promises checked against the engine: of the requests whose engine
    # stated its cached tokens, the hit tokens predicted and how many of them it found
    # (per request the lesser of the two; the rest had been evicted or never stored)
    checked_predicted_tokens: int = 0
    confirmed_hit_tokens: int = 0

    @property
    def predicted_ratio(self) -> float:
        return self.predicted_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def measured_ratio(self) -> float:
        if not self.measured_prompt_tokens:
            return 0.0
        return self.measured_hit_tokens / self.measured_prompt_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionRecord:
    """One routing decision, kept in a short ring for the dashboard."""

    at: float
    request_id: str
    node_id: str
    reason: str
    matched_blocks: int
    best_matched_blocks: int
    score: float
    attempt: int


@dataclass(slots=True)
class ControllerStats:
    routed: Counter[str] = field(default_factory=Counter)  # by route reason
    outcomes: Counter[str] = field(default_factory=Counter)  # completed/failed/cancelled/...
    rejects: Counter[str] = field(default_factory=Counter)  # by reject reason
    retries: Counter[str] = field(default_factory=Counter)  # by failure kind
    failures: Counter[str] = field(default_factory=Counter)  # attempt failures by kind
    eviction_warnings: int = 0
    # index entries dropped when an announced eviction ended (approximate mode)
    eviction_blocks_forgotten: int = 0
    confined_dispatches: int = 0  # sent only to nodes its tenant held (tenant confinement)
    hits: dict[str, HitCounter] = field(
        default_factory=lambda: {name: HitCounter() for name, _ in PREFIX_BUCKETS}
    )
    recent: deque[DecisionRecord] = field(default_factory=lambda: deque(maxlen=50))

    def count_hits(
        self,
        node: NodeState | None,
        prompt_tokens: int,
        predicted_hit_tokens: int,
        cached_tokens: int | None,
        usage_reported: bool = False,
    ) -> None:
        """Count a completed request's prompt against what the index predicted cached
        and, when its node's usage said so, what the engine found cached."""
        name = bucket_of(prompt_tokens)
        # vLLM and SGLang leave prompt_tokens_details out when nothing was cached: from a
        # node that states its cached tokens, a usage without them is a miss (left out,
        # the measured hit ratio counted only hits and read twice the truth). Before its
        # first statement such a usage may be a miss or a node that never states them:
        # kept aside, and counted as misses once it states one.
        if cached_tokens is not None:
            if node is not None and not node.reports_cached_tokens:
                node.reports_cached_tokens = True
                for earlier, unstated in node.unstated_prompt_tokens.items():
                    self.hits[earlier].measured_prompt_tokens += unstated
                node.unstated_prompt_tokens.clear()
        elif usage_reported and node is not None:
            if node.reports_cached_tokens:
                cached_tokens = 0
            else:
                kept = node.unstated_prompt_tokens
                kept[name] = kept.get(name, 0) + prompt_tokens
        bucket = self.hits[name]
        bucket.prompt_tokens += prompt_tokens
        bucket.predicted_hit_tokens += predicted_hit_tokens
        if cached_tokens is not None:
            bucket.measured_prompt_tokens += prompt_tokens
            # an engine's figure is clamped to [0, prompt tokens]: a buggy (negative)
            # report must not move a counter down
            measured = min(max(cached_tokens, 0), prompt_tokens)
            bucket.measured_hit_tokens += measured
            bucket.checked_predicted_tokens += predicted_hit_tokens
            bucket.confirmed_hit_tokens += min(measured, predicted_hit_tokens)
