"""Timing profiles of one simulated inference node.

Theory of operation
-------------------
One engine step (one forward pass of a continuous batch) costs

    t_step = T0 + a*N + c * sum_i q_i*(h_i + q_i/2) + k * sum_j ctx_j

    N     = prefill tokens in the step + number of decode sequences
    q_i   = tokens of prefill chunk i
    h_i   = tokens of that request already in KV before the chunk
            (cached prefix + earlier chunks)
    ctx_j = current context length of decode sequence j

The first three terms are the GEMMs plus causal attention FLOPs (a chunk of q
queries over h earlier keys and a causal q x q triangle: q*h + q*q/2 pairs);
the last term is decode attention streaming the KV cache from HBM. Constants
come from research/workloads.md section 3.2 (Llama-3-8B BF16), converted from
milliseconds to seconds. Checks from that section: an uncached 8 K prefill on
A100 takes 11 + 541 + 114 = 666 ms; a 64 x 2 K decode step takes 27 ms.

Invariant: a profile is pure data; `step_time` is a pure function of its
arguments, so the simulator's timing is reproducible bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvgate.core.finite import require_finite

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "EngineProfile",
    "get_profile",
    "prefill_alone_s",
    "step_time",
]

_MS = 1e-3  # the research tables are in milliseconds; the engine works in seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineProfile:
    """Cost-model constants and batch limits of one node type.

    Attributes:
        name: registry key, e.g. "a100-8b".
        t0_s: fixed cost of a step (kernel launches, LM head, sampling).
        a_s_per_token: linear (GEMM) cost per token in the step.
        c_s_per_pair: attention cost per query-key pair of prefill chunks.
        k_s_per_ctx_token: decode attention cost per context token (HBM read).
        max_num_batched_tokens: token budget of one step (vLLM v1 online default 8192).
        max_num_seqs: cap on running sequences (vLLM default 256).
    """

    name: str
    t0_s: float
    a_s_per_token: float
    c_s_per_pair: float
    k_s_per_ctx_token: float
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        require_finite(self, "EngineProfile")  # before the range checks: NaN passes them
        for field_name in ("t0_s", "a_s_per_token", "c_s_per_pair", "k_s_per_ctx_token"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"EngineProfile.{field_name} must be >= 0")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


PROFILES: Mapping[str, EngineProfile] = MappingProxyType(
    {
        # Llama-3-8B BF16 on one A100-80GB (workloads.md 3.2): the default profile.
        "a100-8b": EngineProfile(
            name="a100-8b",
            t0_s=11 * _MS,
            a_s_per_token=0.066 * _MS,
            c_s_per_pair=3.4e-6 * _MS,
            k_s_per_ctx_token=8.7e-5 * _MS,
        ),
        # Llama-3-8B BF16 on one H100-80GB SXM (workloads.md 3.2).
        "h100-8b": EngineProfile(
            name="h100-8b",
            t0_s=6 * _MS,
            a_s_per_token=0.022 * _MS,
            c_s_per_pair=1.3e-6 * _MS,
            k_s_per_ctx_token=5.0e-5 * _MS,
        ),
    }
)

DEFAULT_PROFILE = "a100-8b"


def get_profile(name: str) -> EngineProfile:
    """Return the registered profile called `name`.

    Raises:
        ValueError: the name is unknown; the message lists the known names.
    """
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown engine profile {name!r}; known profiles: {known}") from None


def step_time(
    profile: EngineProfile,
    prefill_chunks: Iterable[tuple[int, int]],
    decode_ctx: Iterable[int],
) -> float:
    """Duration in seconds of one step.

    Args:
        profile: the node's constants.
        prefill_chunks: one `(q, h)` per prefill chunk in the step: q tokens
            computed now, h tokens of the same request already in KV.
        decode_ctx: the context length of each decoding sequence (tokens its
            new token attends to, itself included).

    Returns:
        T0 + a*N + c*sum(q*(h + q/2)) + k*sum(ctx), N = sum(q) + len(decodes).
    """
    num_tokens = 0
    pairs = 0.0
    for q, h in prefill_chunks:
        if q < 0 or h < 0:
            raise ValueError(f"negative prefill chunk ({q}, {h})")
        num_tokens += q
        pairs += q * (h + q / 2)
    num_decodes = 0
    ctx_total = 0
    for ctx in decode_ctx:
        if ctx < 0:
            raise ValueError(f"negative decode context {ctx}")
        num_decodes += 1
        ctx_total += ctx
    return step_time_of_sums(profile, num_tokens + num_decodes, pairs, ctx_total)


def step_time_of_sums(
    profile: EngineProfile, num_tokens: int, pairs: float, ctx_total: int
) -> float:
    """:func:`step_time` from its sums: N (prefill tokens plus decodes), the prefill
    chunks' sum of q*(h + q/2) (added in chunk order) and the decodes' contexts."""
    return (
        profile.t0_s
        + profile.a_s_per_token * num_tokens
        + profile.c_s_per_pair * pairs
        + profile.k_s_per_ctx_token * ctx_total
    )


def prefill_alone_s(profile: EngineProfile, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds from a request's first step to its first token on an idle node: its
    prefill after ``cached_tokens`` of cache, in chunks of the step's token budget,
    with nothing else in the batch (the last chunk's step samples the first token).
    The floor its TTFT could reach there; what a run adds on top is waiting (for the
    queue, for other requests' work in the same steps, on the network)."""
    if prompt_tokens < 1 or not 0 <= cached_tokens < prompt_tokens:
        raise ValueError(f"need 0 <= cached < prompt, got {cached_tokens} of {prompt_tokens}")
    budget = profile.max_num_batched_tokens
    total = 0.0
    h = cached_tokens
    while h < prompt_tokens:
        q = min(budget, prompt_tokens - h)
        total += step_time_of_sums(profile, q, q * (h + q / 2), 0)
        h += q
    return total
