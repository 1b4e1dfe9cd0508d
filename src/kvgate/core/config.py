"""The controller's configuration: one frozen value, built once at startup."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvgate.core.admission import AdmissionConfig
from kvgate.core.errors import ConfigError

# how the cache index learns: approximate from our own routing, precise from KV events
IndexMode = Literal["approximate", "precise"]
INDEX_MODES: tuple[str, ...] = get_args(IndexMode)

# Prompt-length buckets (tokens) for hit ratios, as the design brief asks: <1k, 1k-4k,
# 4k-16k, >=16k. Each bound is the exclusive upper edge of its bucket.
PREFIX_BUCKETS: tuple[tuple[str, int], ...] = (
    ("lt1k", 1024),
    ("1k_4k", 4096),
    ("4k_16k", 16384),
    ("ge16k", 1 << 62),
)


def bucket_of(prompt_tokens: int) -> str:
    for name, upper in PREFIX_BUCKETS:
        if prompt_tokens < upper:
            return name
    return PREFIX_BUCKETS[-1][0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    # hashing: "text" (default, no tokenizer), "tokens" (local tokenizer file), "trace"
    hasher: str = "text"
    hasher_params: Mapping[str, object] = field(default_factory=dict)
    # index: approximate learns from our own routing; precise from engine KV events
    index_mode: IndexMode = "approximate"
    index_ttl_s: float | None = 600.0
    speculative_ttl_s: float = 2.0
    # routing
    policy: str = "kvgate"
    policy_params: Mapping[str, object] = field(default_factory=dict)
    hot_prefix_blocks: int = 4  # the hot-prefix key is the chain's block at this depth
    hot_window_s: float = 10.0
    stale_after_s: float = 5.0  # a load report older than this is unknown, not healthy
    # a node failing this many attempts in a row is ejected for eject_s
    eject_after_failures: int = 5
    eject_s: float = 30.0
    # safe mode (coordinator lost): dispatch only to nodes with a fresh report and a
    # queue below this
    safe_mode_max_queue: int = 8
    # how strongly an announced eviction discounts a node's cache bonus (and, for the
    # other tenants, a node holding a confined flood: see tenant_confine_s)
    evicting_cache_weight: float = 0.1
    # a tenant refused for asking more than its quota keeps, for this long after, to the
    # nodes where it already has requests in flight, and there the other tenants' cache
    # counts evicting_cache_weight: a flood cannot spread over every node and slow
    # everybody's first tokens, and few wait behind it (0 turns it off)
    tenant_confine_s: float = 10.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tenant_confine_s) and self.tenant_confine_s >= 0):
            raise ConfigError(
                f"tenant_confine_s must be a finite number >= 0, got {self.tenant_confine_s}"
            )
