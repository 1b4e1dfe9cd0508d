"""kvgate.engine: a pure, deterministic simulated LLM inference engine.

Modelled on vLLM's v1 core: a paged KV block pool with a prefix cache and KV
events (block_pool.py, kv_events.py), continuous batching with chunked prefill
and preemption (scheduler.py), a per-profile step-time model (profiles.py),
second-stage node admission (node_admission.py), announced bulk eviction
(eviction.py) and fault injection (faults.py), behind one facade, `SimEngine`
(engine.py). No module here imports asyncio, aiohttp, socket, time, random,
threading or logging: time comes in as `now`, and there is no randomness.
The HTTP shell lives beside it in engine/server.py.
"""

from kvgate.engine.api import (
    EngineConfig,
    EngineMetrics,
    EngineRequest,
    FinishedRequest,
    RejectedRequest,
    SchedulingPolicy,
    StepOutput,
)
from kvgate.engine.block_pool import BlockPool, KVBlock
from kvgate.engine.engine import SimEngine
from kvgate.engine.eviction import EvictionConfig
from kvgate.engine.faults import FaultState
from kvgate.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EvictionAnnounced,
    EvictionDone,
    KvEvent,
)
from kvgate.engine.node_admission import (
    AdmissionStatus,
    NodeAdmission,
    NodeAdmissionConfig,
    RejectKind,
)
from kvgate.engine.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    EngineProfile,
    get_profile,
    prefill_alone_s,
    step_time,
)
from kvgate.engine.sequence import (
    SIM_VOCAB_SIZE,
    ReqStatus,
    generated_block_hash,
    generated_token_id,
    prompt_key,
)

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "SIM_VOCAB_SIZE",
    "AdmissionStatus",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "EngineConfig",
    "EngineMetrics",
    "EngineProfile",
    "EngineRequest",
    "EvictionAnnounced",
    "EvictionConfig",
    "EvictionDone",
    "FaultState",
    "FinishedRequest",
    "KVBlock",
    "KvEvent",
    "NodeAdmission",
    "NodeAdmissionConfig",
    "RejectKind",
    "RejectedRequest",
    "ReqStatus",
    "SchedulingPolicy",
    "SimEngine",
    "StepOutput",
    "generated_block_hash",
    "generated_token_id",
    "get_profile",
    "prefill_alone_s",
    "prompt_key",
    "step_time",
]
