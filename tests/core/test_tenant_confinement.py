"""A tenant refused for asking more than its quota keeps to the nodes it already uses.

Without it, a flood held to its quota still spreads its requests over every node, and
each one's long prefill delays the first tokens of everybody queued behind it there.
"""

from __future__ import annotations

import random

from kvgate.core.admission import AdmissionConfig, InProcessCoordinator, LeaseConfig
from kvgate.core.config import ControllerConfig
from kvgate.core.controller import Controller
from kvgate.core.decisions import Dispatch, Hold, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId, TenantId
from kvgate.core.nodes import NodeSpec, NodeTable

NODES = [NodeId(f"n{i}") for i in range(4)]


def cluster(confine_s: float = 10.0) -> Controller:
    adm = AdmissionConfig(budget=256, tenant_quotas={"flood": 3})
    ctl = Controller(
        # load alone decides (no exploration, no new-session spread): an unconfined flood
        # goes to the idlest node
        ControllerConfig(
            hasher="trace", admission=adm, tenant_confine_s=confine_s,
            policy_params={"epsilon": 0, "session_spread_s": 0.0},
        ),
        rng=random.Random(1),
    )
    for nid in NODES:
        ctl.add_node(NodeSpec(node_id=nid), 0.0)
        ctl.on_load_report(nid, waiting=0, running=0, kv_util=0.0, now=0.0)
    coord = InProcessCoordinator(ctl.config.admission)
    ctl.refresh_with(coord, 0.0)
    # the flood tenant's first request teaches the coordinator its quota
    send(ctl, "warm", "flood", 0, 0.0)
    ctl.refresh_with(coord, 0.0)
    ctl.on_finished(RequestId("warm"), 0.0)
    return ctl


def send(
    ctl: Controller, rid: str, tenant: str, block: int, now: float, tokens: int = 20_000
) -> Dispatch | Reject:
    d = ctl.on_arrival(
        RequestArrived(
            request_id=RequestId(rid), tenant=TenantId(tenant), block_ids=(block,),
            prompt_tokens=tokens,  # 20k: a long uncached prefill loads its node for seconds
        ),
        now,
    )
    assert isinstance(d, Dispatch | Reject)
    return d


def test_a_pressing_tenant_stays_on_its_nodes_and_the_others_go_around() -> None:
    ctl = cluster()
    first = send(ctl, "f1", "flood", 1, 1.0)
    assert isinstance(first, Dispatch)
    home = first.node_id
    sent = [send(ctl, f"f{i}", "flood", i, 1.0) for i in (2, 3)]
    # not refused yet: its second and third requests go to idle nodes, as anyone's would
    assert all(isinstance(d, Dispatch) and d.node_id != home for d in sent)
    assert isinstance(send(ctl, "f4", "flood", 4, 1.1), Reject)  # over its quota of 3
    for d in sent:
        ctl.on_finished(d.request_id, 1.2)
    # pressing its quota now: its next requests stay on the node it still occupies
    again = [send(ctl, f"g{i}", "flood", 10 + i, 1.3) for i in range(2)]
    assert [d.node_id for d in again if isinstance(d, Dispatch)] == [home, home]
    assert ctl.stats.confined_dispatches == 2
    other = send(ctl, "o1", "other", 99, 1.3)
    assert isinstance(other, Dispatch) and other.node_id != home
    # the nodes count the tenant's requests in flight, and forget them when they end
    state = ctl.nodes.get(home)
    assert state is not None and state.tenant_inflight == {"flood": 3}
    for d in [first, *again]:
        ctl.on_finished(d.request_id, 1.4)
    assert state.tenant_inflight == {}


def test_confinement_ends_with_its_window_and_can_be_turned_off() -> None:
    for confine_s, at, confined in ((10.0, 12.0, False), (10.0, 5.0, True), (0.0, 5.0, False)):
        ctl = cluster(confine_s)
        first = send(ctl, "f1", "flood", 1, 1.0)
        assert isinstance(first, Dispatch)
        held = [send(ctl, f"f{i}", "flood", i, 1.0) for i in (2, 3)]
        assert isinstance(send(ctl, "f4", "flood", 4, 1.0), Reject)  # pressed at t=1
        for d in held:
            ctl.on_finished(d.request_id, 1.1)
        for nid in NODES:  # fresh reports and lease at ``at``: a normal, healthy cluster
            ctl.on_load_report(nid, waiting=0, running=0, kv_util=0.0, now=at)
        ctl.refresh_with(InProcessCoordinator(ctl.config.admission), at)
        d = send(ctl, "late", "flood", 50, at)
        assert isinstance(d, Dispatch)
        assert (d.node_id == first.node_id) is confined, (confine_s, at)


def test_a_confined_tenant_whose_node_is_down_is_still_served() -> None:
    ctl = cluster()
    first = send(ctl, "f1", "flood", 1, 1.0)
    assert isinstance(first, Dispatch)
    held = [send(ctl, f"f{i}", "flood", i, 1.0) for i in (2, 3)]
    assert isinstance(send(ctl, "f4", "flood", 4, 1.0), Reject)
    for d in held:
        ctl.on_finished(d.request_id, 1.1)
    state = ctl.nodes.get(first.node_id)
    assert state is not None
    ctl.nodes.set_healthy(state, False)
    d = send(ctl, "after", "flood", 60, 1.2)
    assert isinstance(d, Dispatch) and d.node_id != first.node_id


def flood_on_the_others_cache(
    ctl: Controller, context: tuple[int, ...], flood_tokens: int
) -> Dispatch:
    """Another tenant's ``context`` is cached on the lowest slot; then the flood's first
    request (``flood_tokens`` long) takes that node, two more go elsewhere and end, and a
    fourth is refused: the flood presses its quota, confined to that node. Returns the
    flood's first request."""
    o0 = ctl.on_arrival(
        RequestArrived(request_id=RequestId("o0"), tenant=TenantId("other"),
                       block_ids=context, prompt_tokens=512 * len(context)),
        1.0,
    )
    assert isinstance(o0, Dispatch)
    ctl.on_finished(o0.request_id, 1.0)
    # all idle again: the flood's first request takes the same lowest slot
    first = send(ctl, "f1", "flood", 1, 1.0, tokens=flood_tokens)
    assert isinstance(first, Dispatch) and first.node_id == o0.node_id
    held = [send(ctl, f"f{i}", "flood", i, 1.0, tokens=4000) for i in (2, 3)]
    assert isinstance(send(ctl, "f4", "flood", 4, 1.0), Reject)  # pressing from t=1
    for d in held:
        ctl.on_finished(d.request_id, 1.0)
    return first


def the_others_next_turn(ctl: Controller, context: tuple[int, ...]) -> Dispatch:
    """The other tenant's next request: its context and one block more."""
    o1 = ctl.on_arrival(
        RequestArrived(request_id=RequestId("o1"), tenant=TenantId("other"),
                       block_ids=(*context, 600), prompt_tokens=512 * (len(context) + 1)),
        1.01,
    )
    assert isinstance(o1, Dispatch)
    return o1


def test_the_other_tenants_leave_a_flood_node_rather_than_wait_for_their_cache() -> None:
    """On the node a flood is confined to, another tenant's cache counts a tenth: a short
    context is recomputed on an idle node instead of waiting behind the flood there."""
    outcomes = {}
    for confine_s in (10.0, 0.0):
        ctl = cluster(confine_s)
        context = (500, 501, 502)  # 3 blocks of 512 tokens
        first = flood_on_the_others_cache(ctl, context, flood_tokens=4000)
        o1 = the_others_next_turn(ctl, context)
        outcomes[confine_s] = (o1.node_id == first.node_id, o1.route.matched_blocks)
        state = ctl.nodes.get(first.node_id)
        assert state is not None and state.cache_weight == 1.0  # the discount was per request
    assert outcomes[0.0] == (True, 3)  # off: it waits behind the flood for its context
    assert outcomes[10.0] == (False, 0)  # on: it goes to an idle node


def test_a_flood_node_that_only_decodes_keeps_the_other_tenants_cache() -> None:
    """Once the flood's prefill there is done, nobody would wait behind it for a first
    token: another tenant's context is not thrown away for its decode batch, which the
    load terms already count."""
    for prefilled, stays in ((False, False), (True, True)):
        ctl = cluster()
        context = (500, 501, 502, 503, 504, 505)  # 6 blocks of 512 tokens
        # a long flood prompt: its decode steps attend over 14k tokens of context
        first = flood_on_the_others_cache(ctl, context, flood_tokens=14_000)
        if prefilled:
            ctl.on_first_byte(first.request_id, 1.005)  # the flood's request now decodes
        o1 = the_others_next_turn(ctl, context)
        assert (o1.node_id == first.node_id) is stays, prefilled
        assert o1.route.matched_blocks == (6 if stays else 0)


def test_the_window_must_be_a_finite_number_of_seconds() -> None:
    import math

    import pytest

    from kvgate.core.errors import ConfigError

    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="tenant_confine_s"):
            ControllerConfig(tenant_confine_s=bad)


def test_in_a_fleet_every_gateway_confines_a_pressing_tenant_to_the_same_home_node() -> None:
    """Each gateway sees only its own requests; confining a flood to them would spread it
    over as many node sets as there are gateways. In a fleet a pressing tenant goes to
    its home node, the same at every gateway, and the other tenants discount it there."""
    adm = AdmissionConfig(
        budget=256, tenant_quotas={"flood": 16}, lease=LeaseConfig(expected_gateways=2)
    )
    coord = InProcessCoordinator(adm)
    gateways = []
    for g in range(2):
        ctl = Controller(
            ControllerConfig(hasher="trace", admission=adm, policy_params={"epsilon": 0}),
            rng=random.Random(g),
            gateway_id=f"gw{g}",
        )
        for nid in NODES:
            ctl.add_node(NodeSpec(node_id=nid), 0.0)
            ctl.on_load_report(nid, waiting=0, running=0, kv_util=0.0, now=0.0)
        gateways.append(ctl)
    for t in (0.0, 0.01):
        for ctl in gateways:
            ctl.refresh_with(coord, t)
    homes, firsts = set(), set()
    for g, ctl in enumerate(gateways):
        for nid in NODES:  # only NODES[g] is free: the tenant's first request goes there
            busy = 0 if nid == NODES[g] else 50
            ctl.on_load_report(nid, waiting=busy, running=busy, kv_util=0.0, now=0.05)
        # the tenant waits for its lease entry (a fleet asks), then runs where load says
        assert isinstance(ctl.on_arrival(_req(f"g{g}-0", "flood", 1), 0.1), Hold)
        (first,) = ctl.refresh_with(coord, 0.1)
        assert isinstance(first, Dispatch) and first.node_id == NODES[g]
        firsts.add(first.node_id)
        for nid in NODES:
            ctl.on_load_report(nid, waiting=0, running=0, kv_util=0.0, now=0.25)
        ctl.admission.pressed.note(TenantId("flood"), 0.2)  # refused over its quota
        d = send(ctl, f"g{g}-1", "flood", 2, 0.3)
        assert isinstance(d, Dispatch)
        homes.add(d.node_id)
        other = send(ctl, f"g{g}-o", "other", 99, 0.3)
        assert isinstance(other, Dispatch) and other.node_id != d.node_id
    assert len(firsts) == 2 and len(homes) == 1  # one node, whichever gateway sent it
    # the home goes down: the next home, again the same at every gateway
    (home,) = homes
    moved = set()
    for g, ctl in enumerate(gateways):
        state = ctl.nodes.get(home)
        assert state is not None
        ctl.nodes.set_healthy(state, False)
        confined = ctl.stats.confined_dispatches
        d = send(ctl, f"g{g}-2", "flood", 3, 0.4)
        assert isinstance(d, Dispatch) and d.node_id != home
        assert ctl.stats.confined_dispatches == confined + 1  # to the new home, not around
        moved.add(d.node_id)
    assert len(moved) == 1


def _req(rid: str, tenant: str, block: int) -> RequestArrived:
    return RequestArrived(
        request_id=RequestId(rid), tenant=TenantId(tenant), block_ids=(block,),
        prompt_tokens=20_000,
    )


def test_in_a_fleet_the_others_go_around_a_flood_home_only_while_it_is_busy() -> None:
    """A gateway does not see the other gateways' flood requests on the home node, so it
    reads the node's report: the other tenants route around the home (its cache
    discounted, nobody's new-session home) while it reports requests waiting, holds
    prefill this gateway sent, or runs at least as many requests as the average node,
    and use it like any node once it runs fewer. Avoided whatever its load, the home
    sat half idle while the other nodes took its share (chat at x10 with 4 gateways:
    the fleet's admission budget full, others' TTFT p99 +49 % to +353 % against the
    run without the flood)."""
    from kvgate.core.admission.pressed import PressedTenants
    from kvgate.core.flood_confinement import FloodConfinement

    table = NodeTable(stale_after_s=5.0)
    for nid in NODES:
        table.add(NodeSpec(node_id=nid))
        table.report(nid, waiting=0, running=0, kv_util=0.0, now=0.0)
    pressed = PressedTenants()
    floods = FloodConfinement(table, pressed, window_s=10.0, fleet=True)
    assert floods.flood_nodes("other", "", 1.0) == []  # nobody presses its quota
    pressed.note("flood", 0.5)
    excluded = floods.excluded_for("flood", "", set(), 1.0)
    assert excluded is not None and len(excluded) == len(NODES) - 1
    (home,) = (s for s in table if s.spec.node_id not in excluded)
    assert floods.flood_nodes("flood", "", 1.0) == []  # a tenant never avoids itself

    def report(waiting: int, running: int, now: float) -> list[NodeId]:
        for s in table:
            busy = s is home
            table.report(
                s.spec.node_id, waiting=waiting if busy else 0,
                running=running if busy else 8, kv_util=0.1, now=now,
            )  # fmt: skip
        return [s.spec.node_id for s in floods.flood_nodes("other", "", now)]

    assert report(waiting=0, running=8, now=1.1) == [home.spec.node_id]  # as busy as any
    assert report(waiting=0, running=3, now=1.2) == []  # underused: the others come back
    assert report(waiting=1, running=3, now=1.3) == [home.spec.node_id]  # a queue there
    assert report(waiting=1, running=3, now=11.0) == []  # the window has passed
    # a single gateway sees its own flood requests: only nodes holding them count
    alone = FloodConfinement(table, pressed, window_s=10.0, fleet=False)
    pressed.note("flood", 11.0)
    assert alone.flood_nodes("other", "", 11.1) == []
