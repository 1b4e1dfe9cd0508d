"""A request's chain is scoped by its model name: one node's caches of a base model and of
its LoRA adapters hold different KV for the same text, so they must not match each other."""

from __future__ import annotations

import random

from kvgate.core.admission import InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.events import RequestArrived
from kvgate.core.hashing import TextChunkHasher
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec

TEXT = "You are a careful assistant. Answer briefly and cite sources. " * 40
MSGS = [("system", TEXT), ("user", "What is prefix caching?")]


def test_text_chains_differ_by_model_and_keep_the_prefix_property() -> None:
    h = TextChunkHasher()
    plain = h.chain_for_prompt(TEXT)
    assert h.chain_for_prompt(TEXT, "") == plain  # no model: the unscoped chain
    base, lora = h.chain_for_prompt(TEXT, "base"), h.chain_for_prompt(TEXT, "sql-lora")
    assert len(base) == len(lora) == len(plain)
    assert not set(base) & set(lora) and not set(base) & set(plain)
    longer = h.chain_for_prompt(TEXT + "and more text " * 40, "base")
    assert longer[: len(base)] == base
    chat = h.chain_for_messages(MSGS, "base")
    assert chat != h.chain_for_messages(MSGS) and chat != h.chain_for_messages(MSGS, "sql-lora")
    assert h.chain_for_messages([*MSGS, ("assistant", "x" * 600)], "base")[: len(chat)] == chat


def test_a_node_serving_a_model_and_its_adapter_matches_only_the_same_model() -> None:
    ctl = Controller(ControllerConfig(policy_params={"epsilon": 0}), rng=random.Random(1))
    both = frozenset({"base", "sql-lora"})
    for i in range(2):
        ctl.add_node(NodeSpec(node_id=NodeId(f"n{i}"), models=both), 0.0)
        ctl.on_load_report(NodeId(f"n{i}"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)

    def send(rid: str, model: str) -> Dispatch:
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), model=model, prompt=TEXT), 0.1)
        assert isinstance(d, Dispatch)
        return d

    first = send("r1", "base")
    assert first.route.best_matched_blocks == 0
    adapter = send("r2", "sql-lora")  # same text, another model: nothing of it is cached
    assert adapter.route.best_matched_blocks == 0
    again = send("r3", "base")
    assert again.route.best_matched_blocks > 0 and again.node_id == first.node_id
