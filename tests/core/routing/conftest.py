"""Small builders for routing-policy tests: a node table, its load, a request."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from kvgate.core.ids import NodeId
from kvgate.core.nodes import NodeSpec, NodeState, NodeTable
from kvgate.core.routing.base import RouteContext

NOW = 100.0


class Cluster:
    """``n`` nodes ``n0..n{n-1}`` (slots 0..n-1), all with a fresh, empty report."""

    def __init__(self, n: int, *, now: float = NOW) -> None:
        self.now = now
        self.table = NodeTable()
        for i in range(n):
            state = self.table.add(NodeSpec(node_id=NodeId(f"n{i}")))
            assert state.slot == i
            self.table.report(state.node_id, waiting=0, running=0, kv_util=0.0, now=now)

    def __getitem__(self, name: str) -> NodeState:
        state = self.table.get(NodeId(name))
        assert state is not None, name
        return state

    def load(
        self,
        name: str,
        *,
        inflight: int = 0,
        waiting: int = 0,
        running: int = 0,
        kv_util: float = 0.0,
        stale: bool = False,
    ) -> None:
        """Give ``name`` ``inflight`` own requests and a report (queue = ``waiting``)."""
        state = self[name]
        for _ in range(inflight):
            self.table.on_sent(state, now=self.now)
        report_at = self.now - 60.0 if stale else self.now
        self.table.report(
            state.node_id, waiting=waiting, running=running, kv_util=kv_util, now=report_at
        )

    def candidates(self, *names: str) -> list[NodeState]:
        """The named nodes, or all nodes in slot order when none is named."""
        if not names:
            return sorted(self.table, key=lambda s: s.slot)
        return [self[n] for n in names]

    def add(self, name: str) -> NodeState:
        state = self.table.add(NodeSpec(node_id=NodeId(name)))
        self.table.report(state.node_id, waiting=0, running=0, kv_util=0.0, now=self.now)
        return state


def build_ctx(
    chain: Iterable[int] = (1, 2, 3, 4),
    *,
    prompt_tokens: int | None = None,
    tokens_per_block: int = 64,
    max_tokens: int = 256,
    model: str = "m",
    request_id: str = "",
) -> RouteContext:
    blocks = tuple(chain)
    return RouteContext(
        chain=blocks,
        prompt_tokens=len(blocks) * tokens_per_block if prompt_tokens is None else prompt_tokens,
        tokens_per_block=tokens_per_block,
        max_tokens=max_tokens,
        model=model,
        request_id=request_id,
    )


def build_matches(**kw: int) -> dict[NodeId, int]:
    """``build_matches(n0=3, n2=5)`` → a ``matches`` mapping."""
    return {NodeId(k): v for k, v in kw.items()}


class ScriptedRng:
    """Returns the given values in order (then repeats the last): exact control of draws."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.calls = 0

    def random(self) -> float:
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return v


# Fixtures hand the builders to the tests (no `import conftest`, which is fragile).
@pytest.fixture
def make_cluster() -> Callable[..., Cluster]:
    return Cluster


@pytest.fixture
def make_ctx() -> Callable[..., RouteContext]:
    return build_ctx


@pytest.fixture
def matches() -> Callable[..., dict[NodeId, int]]:
    return build_matches


@pytest.fixture
def scripted() -> type[ScriptedRng]:
    return ScriptedRng
