"""Where a tenant's flood is kept, and which nodes the other tenants route around.

A tenant that stage 1 refused lately for asking more than its quota (it is in
:class:`kvgate.core.admission.pressed.PressedTenants`) is *pressing*. For
``tenant_confine_s`` after its last refusal its requests go only to the nodes already
holding its requests, so its flood slows a few nodes, which the scores steer the
other tenants away from, instead of every node. In a fleet each gateway sees only
its own requests, so there the flood goes to the tenant's home node instead, the same
at every gateway without a word between them (the eligible node with the highest
rendezvous hash of tenant and node). The other tenants see the cache of those nodes
discounted while a first token there would wait behind prefill (the controller's
``evicting_cache_weight``), so they leave them (a miss) rather than wait behind the
flood; a fleet's home node is judged by its reports, since this gateway does not see
the others' flood requests there (:func:`_avoid_home`).

The controller (:class:`kvgate.core.controller.Controller`) owns one and asks it at
each dispatch; it holds nothing but a bounded cache of home nodes.
"""

from __future__ import annotations

from kvgate.core.admission.pressed import PressedTenants
from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeState, NodeTable, rendezvous_rank

__all__ = ["FloodConfinement"]

# pressing tenants are few; the home cache is bounded anyway
_MAX_HOMES = 1024


class FloodConfinement:
    """The confinement of pressing tenants over one node table (see the module)."""

    __slots__ = ("_fleet", "_homes", "_nodes", "_pressed", "window_s")

    def __init__(
        self, nodes: NodeTable, pressed: PressedTenants, *, window_s: float, fleet: bool
    ) -> None:
        self._nodes = nodes
        self._pressed = pressed
        self.window_s = window_s  # tenant_confine_s: 0 turns confinement off
        self._fleet = fleet
        # (tenant, model) -> (the eligible pool it was picked from, its home node)
        self._homes: dict[tuple[str, str], tuple[tuple[NodeState, ...], NodeState | None]] = {}

    def excluded_for(
        self, tenant: str, model: str, excluded: set[NodeId], now: float
    ) -> set[NodeId] | None:
        """The nodes to exclude so that a pressing ``tenant`` stays where its requests
        already run (its home node in a fleet), ``excluded`` included: None when it is
        not pressing its quota or has nothing in flight here (it goes where the policy
        says). The caller falls back to every candidate if these cannot take it, so the
        tenant stays served."""
        window = self.window_s
        if window <= 0.0:
            return None
        pressed = self._pressed.at(tenant)
        if pressed is None or now - pressed > window:
            return None
        nodes = self._nodes
        if self._fleet:
            home = self._home(tenant, model)
            if home is None:
                return None
            return {s.spec.node_id for s in nodes if s is not home} | excluded
        others = {s.spec.node_id for s in nodes if not s.tenant_inflight.get(tenant)}
        if len(others) == len(nodes):
            return None  # nothing in flight: it goes where the policy says
        return others | excluded

    def flood_nodes(self, tenant: str, model: str, now: float) -> list[NodeState]:
        """The nodes with prefill queued holding requests of tenants other than
        ``tenant`` that pressed their quota within the window (where confinement keeps
        their floods), and in a fleet their home nodes (where the other gateways keep
        them)."""
        window = self.window_s
        if window <= 0.0:
            return []
        pressing = self._pressed.since(now - window)
        if not pressing:  # the usual case: no set built per request
            return []
        floods = set(pressing)
        floods.discard(tenant)
        if not floods:
            return []
        # each node's tenants in flight are few: at most its requests. A node where the
        # flood only decodes makes nobody wait for a first token (the load terms count
        # its decode batch): only one with prefill queued is routed around
        held = [
            s
            for s in self._nodes
            if s.pending_prefill_tokens > 0 and not floods.isdisjoint(s.tenant_inflight)
        ]
        if self._fleet:
            pool, _ = self._nodes.eligible(model)
            running = sum(s.reported_running for s in pool)  # once, for every home
            for flood in sorted(floods):
                home = self._home(flood, model)
                if home is not None and home not in held and _avoid_home(home, pool, running):
                    held.append(home)
        return held

    def _home(self, tenant: str, model: str) -> NodeState | None:
        """Where every gateway of a fleet confines a pressing tenant: the eligible node
        with the highest rendezvous hash of (tenant, node), cached until the pool
        changes."""
        pool, _ = self._nodes.eligible(model)  # the same tuple until the pool changes
        hit = self._homes.get((tenant, model))
        if hit is not None and hit[0] is pool:
            return hit[1]
        home = max(
            pool,
            key=lambda s: rendezvous_rank(tenant, s.spec.node_id),
            default=None,
        )
        if len(self._homes) >= _MAX_HOMES:
            self._homes.clear()
        self._homes[(tenant, model)] = (pool, home)
        return home


def _avoid_home(home: NodeState, pool: tuple[NodeState, ...], running: int) -> bool:
    """Whether the other tenants route around a flood's home node. This gateway does not
    see the other gateways' flood requests there, only the node's reports: around it
    while a first token sent there would wait behind prefill (what this gateway sent
    there, or requests the node reported waiting), or while it runs at least as many
    requests as the average node of ``pool``, which runs ``running`` in all (a prefill
    in progress reports as running). Not once it runs fewer: avoided whatever its load,
    the home sat half idle while the others took its share (chat at x10 with 4
    gateways: the fleet's admission budget full, the others' TTFT p99 up 49-353 %
    against the run without the flood)."""
    if home.pending_prefill_tokens > 0 or home.reported_waiting > 0:
        return True
    return home.reported_running * len(pool) >= running
