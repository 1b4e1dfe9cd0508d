"""`kvgate demo`: the core routing a few requests, explaining each decision.

A tiny driver: four nodes, three tenants' conversations that share a system
prompt and grow turn by turn, load reports now and then, and one node announcing
a bulk eviction. Every decision is printed with its reason and score parts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvgate.core.admission import InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch, Hold, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId, TenantId
from kvgate.core.nodes import NodeSpec

SYSTEM = (
    "You are a careful assistant for an online bookshop. Answer briefly, cite the "
    "catalogue entry you used, never invent prices, and ask for the order number "
    "before discussing a delivery. "
) * 6


def _conversation(topic: str, turns: int) -> list[tuple[tuple[str, str], ...]]:
    """Successive chat histories: each is a prefix of the next."""
    history: list[tuple[str, str]] = [("system", SYSTEM)]
    out = []
    for t in range(turns):
        history.append(("user", f"Question {t + 1} about {topic}: " + "details " * 40))
        out.append(tuple(history))
        history.append(("assistant", f"Answer {t + 1} on {topic}. " + "words " * 60))
    return out


def run_demo(write: Callable[[str], None] = print, *, seed: int = 7) -> int:
    cfg = ControllerConfig(policy_params={"epsilon": 0.0})
    ctl = Controller(cfg, rng=random.Random(seed))
    coordinator = InProcessCoordinator(cfg.admission)
    now = 0.0
    for i in range(4):
        ctl.add_node(NodeSpec(node_id=NodeId(f"node-{i}"), capacity=16, cache_blocks=2000), now)
        ctl.on_load_report(NodeId(f"node-{i}"), waiting=0, running=0, kv_util=0.1, now=now)
    ctl.refresh_with(coordinator, now)  # the first lease: until then only P0 is admitted

    convs = {
        "alice": _conversation("returns", 3),
        "bob": _conversation("gift cards", 3),
        "carol": _conversation("rare first editions", 3),
    }
    write(
        f"{'t':>5}  {'request':<10} {'tenant':<6} {'node':<7} {'reason':<12} "
        f"{'match':>5} {'best':>5} {'score':>7}  parts"
    )
    n = 0
    for turn in range(3):
        for tenant, histories in convs.items():
            now += 0.25
            n += 1
            if ctl.refresh_due(now):
                ctl.refresh_with(coordinator, now)
            rid = RequestId(f"req-{n:02d}")
            req = RequestArrived(
                request_id=rid, tenant=TenantId(tenant), messages=histories[turn], max_tokens=64
            )
            d = ctl.on_arrival(req, now)
            if isinstance(d, Dispatch):
                r = d.route
                parts = " ".join(f"{k}={v:.2f}" for k, v in r.parts.items())
                write(
                    f"{now:5.2f}  {rid:<10} {tenant:<6} {r.node_id:<7} {r.reason.value:<12} "
                    f"{r.matched_blocks:>5} {r.best_matched_blocks:>5} {r.score:>7.3f}  {parts}"
                )
            elif isinstance(d, Hold):
                write(f"{now:5.2f}  {rid:<10} {tenant:<6} queued until {d.deadline:.2f}")
            elif isinstance(d, Reject):
                write(f"{now:5.2f}  {rid:<10} {tenant:<6} rejected: {d.rejected.message}")
        # the nodes report load; the turn's requests finish
        for i in range(4):
            ctl.on_load_report(NodeId(f"node-{i}"), waiting=0, running=1, kv_util=0.2, now=now)
        for k in range(n - 2, n + 1):
            ctl.on_finished(RequestId(f"req-{k:02d}"), now, cached_tokens=None)
        if turn == 1:
            busiest = ctl.stats.recent[-1].node_id
            write(f"       {busiest} announces a bulk eviction: its cache bonus drops")
            ctl.on_eviction_warning(NodeId(busiest), now)
    write("")
    write("routing reasons: " + ", ".join(f"{k}={v}" for k, v in sorted(ctl.stats.routed.items())))
    return 0
