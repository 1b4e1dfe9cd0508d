"""Speed of the core's hot paths, on the real code.

    python benchmarks/bench_core.py [--json] [--prompts N] [--entries N] [--nodes N]

Keys printed (one JSON object with --json):
  route_p50_us, route_p99_us   one routing decision (candidate filter + index match +
                               kvgate policy scoring; hashing excluded) for 32 000-character
                               prompts, 64 nodes, 1 000 000 indexed (block, node) entries,
                               with the gateway holding a lease (normal operation)
  arrival_p50_us, arrival_p99_us
                               what the core costs one request on the same setup:
                               Controller.on_arrival (admission, routing, the index
                               insert, the node's load bookkeeping) plus its on_finished
                               (credit and load released), 32 requests in flight; the
                               route keys time route() alone on a frozen index and loads
  route_safe_mode_p50_us, ...  the same in safe mode (no lease: candidates are also
                               filtered by their reported load)
  hash_32k_p50_us              hashing one 32 000-character prompt into its chain (seeded
                               by a model name, as the gateway does)
  admit_p50_us, admit_p99_us   stage-1 admission plus the quota book, per request
  index_bytes_per_entry        traced memory of the whole index / (block, node) entries
Goals (issue "Core"): route p50 <= 50 us, p99 <= 200 us; hash <= 60 us; admit p50 <= 5 us,
p99 <= 20 us; <= 300 B per entry. The machine is shared and noisy: read p99 with care.
Percentiles are nearest-rank (benchmarks/benchstats.py): p99 of fewer than 100 samples
is the largest. Out-of-range options (``--help`` gives the ranges) are refused with
argparse's one-line error.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from pathlib import Path

# benchstats.py sits beside this file: importable when run as a script and when
# loaded by path (importlib), as tests do
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import percentile
from kvgate.core.admission import (
    AdmissionConfig,
    AdmissionRequest,
    Admitted,
    GatewayAdmission,
    InProcessCoordinator,
    Priority,
)
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.hashing import TextChunkHasher
from kvgate.core.ids import NodeId, RequestId, TenantId
from kvgate.core.index import ClusterIndex
from kvgate.core.nodes import NodeSpec
from kvgate.core.routing import RouteContext

PROMPT_CHARS = 32_000
MAX_HOLDERS = 16  # a prefix has 1..16 holders (fewer when there are fewer nodes)
# the options' ranges: (low, high) inclusive
RANGES = {"prompts": (1, 100_000), "entries": (1, 20_000_000), "nodes": (1, 4096),
          "reps": (2, 1000)}
ALPHABET = "abcdefghijklmnopqrstuvwxyz      .,\n"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(ALPHABET, k=n))


def _populate(
    index: ClusterIndex | Controller,
    rng: random.Random,
    hasher: TextChunkHasher,
    *,
    nodes: list[NodeId],
    prompts: int,
    entries: int,
) -> list[str]:
    """Index `prompts` query prompts with spread matches, then fill to `entries`.

    Returns the query prompts. Match lengths run from a miss at the first block to a
    full match; each prefix has 1-16 holders.
    """
    idx = index.index if isinstance(index, Controller) else index
    queries: list[str] = []
    now = 0.0
    for i in range(prompts):
        text = _text(rng, PROMPT_CHARS)
        chain = hasher.chain_for_prompt(text)
        queries.append(text)
        kind = i % 10
        if kind == 0:
            continue  # a miss at the first block
        depth = len(chain) if kind == 9 else rng.randint(1, len(chain))
        for node in rng.sample(nodes, rng.randint(1, min(MAX_HOLDERS, len(nodes)))):
            idx.insert(node, chain[: rng.randint(1, depth)], now)
    # filler: other prompts' chains on random nodes, up to the entry target
    while idx.num_entries() < entries:
        chain = hasher.chain_for_prompt(_text(rng, rng.randint(8, 125) * 256))
        for node in rng.sample(nodes, rng.randint(1, min(MAX_HOLDERS, len(nodes)))):
            idx.insert(node, chain, now)
            if idx.num_entries() >= entries:
                break
    return queries


def _contexts(ctl: Controller, hasher: TextChunkHasher, prompts: list[str]) -> list[RouteContext]:
    """Fresh contexts, built as the controller builds them on arrival (its hot-prefix
    depth included), from freshly hashed chains: new objects every pass, so nothing
    of a previous routing call can be reused, and block keys are equal to the
    index's keys but not the same objects, as for a real request."""
    hot_depth = ctl.config.hot_prefix_blocks
    out = []
    for text in prompts:
        chain = hasher.chain_for_prompt(text)
        hot_blocks = min(hot_depth, len(chain))
        out.append(
            RouteContext(
                chain=chain,
                prompt_tokens=hasher.estimate_tokens_prompt(text),
                tokens_per_block=hasher.tokens_per_block,
                hot_key=chain[hot_blocks - 1] if chain else None,
                hot_blocks=hot_blocks,
            )
        )
    return out


def _time_route(
    ctl: Controller, hasher: TextChunkHasher, prompts: list[str], reps: int, now: float
) -> list[float]:
    samples: list[float] = []
    route = ctl.route
    for rep in range(reps):
        ctxs = _contexts(ctl, hasher, prompts)  # outside the timing, like hashing
        gc.collect()
        gc.disable()
        try:
            for ctx in ctxs:
                t0 = time.perf_counter_ns()
                d = route(ctx, now)
                t1 = time.perf_counter_ns()
                if rep:  # the first pass warms up
                    samples.append((t1 - t0) / 1000)
                assert d is not None
        finally:
            gc.enable()
    return samples


ARRIVAL_IN_FLIGHT = 32  # requests between one's arrival and its on_finished


def _time_arrivals(
    ctl: Controller,
    coord: InProcessCoordinator,
    hasher: TextChunkHasher,
    prompts: list[str],
    reps: int,
    now: float,
) -> list[float]:
    """Per request, the time of on_arrival plus that of its on_finished (chains hashed
    beforehand, as for route). The index, loads and admission change as they would in
    traffic: every arrival inserts its chain on its node and adds to that node's load."""
    chains = [(hasher.chain_for_prompt(t), hasher.estimate_tokens_prompt(t)) for t in prompts]
    samples: list[float] = []
    arrive, finish = ctl.on_arrival, ctl.on_finished
    clock = time.perf_counter_ns
    k = 0
    for rep in range(reps):
        ctl.refresh_with(coord, now)  # a fresh lease every pass, outside the timing
        assert not ctl.admission.degraded
        reqs = []
        for chain, tokens in chains:
            k += 1
            reqs.append(RequestArrived(request_id=RequestId(f"bench-{k}"), block_ids=chain,
                                       prompt_tokens=tokens))
        gc.collect()
        gc.disable()
        try:
            in_flight: deque[tuple[RequestId, int]] = deque()
            # arrivals, each ending ARRIVAL_IN_FLIGHT arrivals later, then the last ends
            for i in range(len(reqs) + ARRIVAL_IN_FLIGHT):
                now += 1e-4
                if i < len(reqs):
                    req = reqs[i]
                    t0 = clock()
                    d = arrive(req, now)
                    t1 = clock()
                    assert isinstance(d, Dispatch), d
                    in_flight.append((req.request_id, t1 - t0))
                if in_flight and (len(in_flight) > ARRIVAL_IN_FLIGHT or i >= len(reqs)):
                    rid, spent = in_flight.popleft()
                    t0 = clock()
                    finish(rid, now)
                    t1 = clock()
                    if rep:  # the first pass warms up
                        samples.append((spent + t1 - t0) / 1000)
        finally:
            gc.enable()
    assert ctl.num_requests() == 0
    return samples


def _degraded(ctl: Controller) -> bool:
    return ctl.admission.degraded


def bench_route(args: argparse.Namespace, out: dict[str, float]) -> None:
    rng = random.Random(1)
    hasher = TextChunkHasher(block_chars=256)
    ctl = Controller(ControllerConfig(policy="kvgate", index_ttl_s=None), rng=random.Random(2))
    nodes = [NodeId(f"node-{i:02d}") for i in range(args.nodes)]
    per_node = 2 * args.entries // args.nodes + 1000
    for n in nodes:
        ctl.add_node(NodeSpec(node_id=n, cache_blocks=per_node, capacity=64), 0.0)
    prompts = _populate(ctl, rng, hasher, nodes=nodes, prompts=args.prompts, entries=args.entries)
    out["index_entries"] = ctl.index.num_entries()
    for i, n in enumerate(nodes):
        ctl.on_load_report(n, waiting=i % 5, running=8 + i % 7, kv_util=(i % 10) / 10, now=1.0)
    now = 1.5

    # Safe mode: a new controller has no lease yet.
    assert ctl.admission.degraded
    samples = _time_route(ctl, hasher, prompts, args.reps, now)
    out["route_safe_mode_p50_us"] = round(percentile(samples, 50), 2)
    out["route_safe_mode_p99_us"] = round(percentile(samples, 99), 2)

    # Normal operation: a lease from the coordinator.
    coord = InProcessCoordinator(ctl.config.admission)
    ctl.refresh_with(coord, 1.0)
    assert not _degraded(ctl)  # a call: mypy kept the narrowing of the assert above
    samples = _time_route(ctl, hasher, prompts, args.reps, now)
    out["route_p50_us"] = round(percentile(samples, 50), 2)
    out["route_p99_us"] = round(percentile(samples, 99), 2)
    out["route_samples"] = len(samples)
    matched = [len(ctl.index.match(hasher.chain_for_prompt(t), now)) for t in prompts]
    out["route_prompts_with_a_holder"] = sum(1 for m in matched if m)

    # The whole request on the same controller (last: its inserts change the index).
    samples = _time_arrivals(ctl, coord, hasher, prompts, args.reps, now)
    out["arrival_p50_us"] = round(percentile(samples, 50), 2)
    out["arrival_p99_us"] = round(percentile(samples, 99), 2)


MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def bench_hash(out: dict[str, float]) -> None:
    rng = random.Random(3)
    hasher = TextChunkHasher(block_chars=256)
    texts = [_text(rng, PROMPT_CHARS) for _ in range(50)]
    samples = []
    for _ in range(20):
        for t in texts:
            t0 = time.perf_counter_ns()
            hasher.chain_for_prompt(t, MODEL)  # the gateway's path: seeded by the model
            samples.append((time.perf_counter_ns() - t0) / 1000)
    out["hash_32k_p50_us"] = round(percentile(samples, 50), 2)


def bench_admit(out: dict[str, float]) -> None:
    cfg = AdmissionConfig(budget=512, tenant_quotas={TenantId(f"t{i}"): 64 for i in range(8)})
    coord = InProcessCoordinator(cfg)
    gw = GatewayAdmission(cfg, gateway_id="gw0")
    gw.set_cluster_capacity(healthy_capacity=1024, healthy_nodes=16, now=0.0)
    now = 0.0
    for _ in range(3):  # a few refreshes so the lease and tenant grants are active
        gw.apply_grant(coord.refresh(gw.make_refresh(now), now), now)
        now += 0.1
    reqs = [
        AdmissionRequest(
            request_id=RequestId(f"r{i}"),
            tenant=TenantId(f"t{i % 8}"),
            priority=Priority(i % 2),
            prompt_tokens=1000,
            max_seq_len=32768,
        )
        for i in range(2000)
    ]
    samples: list[float] = []
    admit, release = gw.admit, gw.release
    gc.disable()
    try:
        for rep in range(5):
            held = []
            for r in reqs:
                t0 = time.perf_counter_ns()
                v = admit(r, now)
                t1 = time.perf_counter_ns()
                if rep:
                    samples.append((t1 - t0) / 1000)
                if isinstance(v, Admitted):
                    held.append(v.ticket)
                if len(held) >= 32:  # keep the book busy but under its lease
                    release(held.pop(0), now)
            for t in held:
                release(t, now)
            now += 0.01
    finally:
        gc.enable()
    out["admit_p50_us"] = round(percentile(samples, 50), 2)
    out["admit_p99_us"] = round(percentile(samples, 99), 2)


def bench_memory(args: argparse.Namespace, out: dict[str, float]) -> None:
    rng = random.Random(4)
    hasher = TextChunkHasher(block_chars=256)
    nodes = [NodeId(f"node-{i:02d}") for i in range(args.nodes)]
    # chains are hashed before tracing starts, so only the index is measured
    chains = []
    total = 0
    while total < args.entries * 1.02:
        chain = hasher.chain_for_prompt(_text(rng, rng.randint(8, 125) * 256))
        holders = rng.sample(nodes, rng.randint(1, min(MAX_HOLDERS, len(nodes))))
        chains.append((chain, holders))
        total += len(chain) * len(holders)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = ClusterIndex(ttl_s=600.0)
    per_node = 2 * args.entries // args.nodes + 1000
    for n in nodes:
        index.add_node(n, per_node)
    for chain, holders in chains:
        for n in holders:
            index.insert(n, chain, 0.0)
            if index.num_entries() >= args.entries:
                break
        if index.num_entries() >= args.entries:
            break
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    out["index_bytes_per_entry"] = round(used / index.num_entries(), 1)
    out["index_memory_entries"] = index.num_entries()


def print_order(out: dict[str, float]) -> list[str]:
    """Keys sorted, but the arrival_* keys right after route_p99_us, to read beside it."""
    arrival = [k for k in sorted(out) if k.startswith("arrival_")]
    keys = [k for k in sorted(out) if not k.startswith("arrival_")]
    at = keys.index("route_p99_us") + 1 if "route_p99_us" in keys else len(keys)
    return keys[:at] + arrival + keys[at:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    def between(name: str, what: str, default: int) -> str:
        low, high = RANGES[name]
        return f"{what}, {low}..{high} ({default})"

    p.add_argument("--prompts", type=int, default=1000,
                   help=between("prompts", "distinct query prompts", 1000))
    p.add_argument("--entries", type=int, default=1_000_000,
                   help=between("entries", "indexed (block, node) entries", 1_000_000))
    p.add_argument("--nodes", type=int, default=64, help=between("nodes", "nodes", 64))
    p.add_argument("--reps", type=int, default=4,
                   help=between("reps", "passes over the prompts, the first a warm-up", 4))
    args = p.parse_args(argv)
    for name, (low, high) in RANGES.items():
        if not low <= getattr(args, name) <= high:
            p.error(f"--{name} must be {low}..{high}"
                    + (" (the first pass is a warm-up)" if name == "reps" else ""))
    out: dict[str, float] = {}
    steps: list[tuple[str, Callable[[], None]]] = [
        ("hash", lambda: bench_hash(out)),
        ("admit", lambda: bench_admit(out)),
        ("route", lambda: bench_route(args, out)),
        ("memory", lambda: bench_memory(args, out)),
    ]
    for name, step in steps:
        t0 = time.perf_counter()
        step()
        if not args.json:
            print(f"[{name}: {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for k in print_order(out):
            print(f"{k:32s} {out[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
