"""Config knobs that pass a naive check but break at run time: non-finite floats, a tick
slower than the lease refresh, an admin token no client can send; and the cached-tokens
counters (a negative report, a usage without them, the index's precision)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvgate.core.admission import InProcessCoordinator
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch
from kvgate.core.errors import ConfigError
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.core.nodes import NodeSpec
from kvgate.gateway import load_config
from kvgate.gateway.admin import redacted_config
from kvgate.gateway.config import GatewayConfig, RoutingConfig

FLOAT_KNOBS = [
    ("server", "header_timeout_s"), ("server", "body_timeout_s"),
    ("upstream", "request_timeout_s"), ("upstream", "stream_idle_timeout_s"),
    ("upstream", "connect_timeout_s"), ("upstream", "keepalive_s"),
    ("nodes", "health_timeout_s"), ("nodes", "metrics_timeout_s"),
    ("nodes", "startup_probe_timeout_s"), ("nodes", "health_interval_s"),
    ("routing", "eject_s"), ("routing", "stale_after_s"),
    ("admission", "tick_interval_s"), ("admission", "bypass_fraction"),
]


@pytest.mark.parametrize("section,key", FLOAT_KNOBS)
@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_non_finite_float_knobs_are_refused_naming_the_key(
    section: str, key: str, value: str, tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert f"{section}.{key}" in exc.value.message and "finite" in exc.value.message


def test_non_finite_knob_from_the_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"nodes\.health_timeout_s"):
        load_config(None, env={"KVGATE_NODES_HEALTH_TIMEOUT_S": ".inf"})


def test_tick_interval_must_be_below_the_lease_refresh(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("admission:\n  tick_interval_s: 5.0\n")
    with pytest.raises(ConfigError, match=r"admission\.tick_interval_s .* below"):
        load_config(path, env={})
    path.write_text("admission:\n  tick_interval_s: 0.2\n  lease_refresh_s: 0.5\n")
    assert load_config(path, env={}).admission.tick_interval_s == 0.2


def test_admin_config_view_is_strict_json() -> None:
    with pytest.raises(ConfigError, match=r"routing.params.epsilon"):
        RoutingConfig(params={"epsilon": float("inf")})
    json.dumps(redacted_config(GatewayConfig()), allow_nan=False)


@pytest.mark.parametrize("token", [" admintok123", "admintok123 ", "admintok123\n"])
def test_admin_token_with_surrounding_whitespace_is_refused(token: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"server": {"admin_token": token}}))
    with pytest.raises(ConfigError, match=r"server\.admin_token must not start or end"):
        load_config(path, env={})


def _one_node_controller() -> Controller:
    """A controller with one idle node and its credits: every arrival is dispatched."""
    ctl = Controller(ControllerConfig(hasher="trace"), rng=random.Random(1))
    ctl.add_node(NodeSpec(node_id=NodeId("n0")), 0.0)
    ctl.on_load_report(NodeId("n0"), waiting=0, running=0, kv_util=0.0, now=0.0)
    ctl.refresh_with(InProcessCoordinator(ctl.config.admission), 0.0)
    return ctl


def test_negative_cached_tokens_never_move_the_counter_down() -> None:
    ctl = _one_node_controller()

    def run(rid: str, cached: Any) -> None:
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=(1, 2),
                                          prompt_tokens=100), 0.1)
        assert isinstance(d, Dispatch)
        ctl.on_finished(RequestId(rid), 0.2, cached_tokens=cached)

    run("a", 16)
    totals = [sum(b.measured_hit_tokens for b in ctl.stats.hits.values())]
    for rid, cached in (("b", -5000), ("c", 10**9)):
        run(rid, cached)
        totals.append(sum(b.measured_hit_tokens for b in ctl.stats.hits.values()))
    assert totals == [16, 16, 116]  # clamped to [0, prompt tokens]


def test_a_usage_without_cached_tokens_is_a_miss_once_the_node_states_them() -> None:
    """vLLM and SGLang leave prompt_tokens_details out when nothing was cached: counted
    only when stated, the measured hit ratio read hits alone (twice the truth in the
    audit's repro)."""
    ctl = _one_node_controller()

    def run(rid: str, cached: int | None, usage: bool) -> tuple[int, int]:
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=(1, 2),
                                          prompt_tokens=100), 0.1)
        assert isinstance(d, Dispatch)
        ctl.on_finished(RequestId(rid), 0.2, cached_tokens=cached, usage_reported=usage)
        hits = ctl.stats.hits.values()
        return (sum(b.measured_prompt_tokens for b in hits),
                sum(b.measured_hit_tokens for b in hits))

    # before the node has stated any, a usage without details is kept aside: a miss, or a
    # node that never states them (no measured ratio then)
    assert run("a", None, True) == (0, 0)
    assert run("b", 64, True) == (200, 64)  # stated at last: "a" was a miss
    assert run("c", None, True) == (300, 64)  # a miss
    assert run("d", None, False) == (300, 64)  # no usage at all: not measured


def test_the_index_precision_counts_the_predicted_hits_the_engine_confirmed() -> None:
    """Per request the lesser of predicted and measured is confirmed; a request whose
    engine said nothing is not checked."""
    ctl = _one_node_controller()
    tpb = ctl.hasher.tokens_per_block

    def run(rid: str, cached: int | None, usage: bool = True, prompt: int = 3 * tpb + 10,
            blocks: tuple[int, ...] = (1, 2, 3, 4)) -> tuple[int, int, int]:
        d = ctl.on_arrival(RequestArrived(request_id=RequestId(rid), block_ids=blocks,
                                          prompt_tokens=prompt), 0.1)
        assert isinstance(d, Dispatch)
        ctl.on_finished(RequestId(rid), 0.2, cached_tokens=cached, usage_reported=usage)
        hits = ctl.stats.hits.values()
        return (sum(b.predicted_hit_tokens for b in hits),
                sum(b.checked_predicted_tokens for b in hits),
                sum(b.confirmed_hit_tokens for b in hits))

    assert run("a", 0) == (0, 0, 0)  # nothing was cached anywhere: nothing predicted
    full = 3 * tpb  # "a" taught the index its three whole blocks
    assert run("b", tpb) == (full, full, tpb)  # two of three blocks were gone
    assert run("c", None, usage=False) == (2 * full, full, tpb)  # no usage: unchecked
    assert run("d", None) == (3 * full, 2 * full, tpb)  # a usage without them: a miss
    assert run("e", 10 * full) == (4 * full, 3 * full, tpb + full)  # capped at predicted
    # a prompt of exactly three cached blocks: the engine computes its last token, so
    # two are promised, as vLLM hits at most num_tokens - 1 tokens
    assert run("f", 2 * tpb, prompt=full, blocks=(1, 2, 3)) == (
        4 * full + 2 * tpb, 3 * full + 2 * tpb, 2 * full)
