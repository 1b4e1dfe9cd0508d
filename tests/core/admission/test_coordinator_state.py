"""The coordinator's state survives a JSON round trip exactly (what a Redis fleet does:
load, refresh, store, on every refresh)."""

from __future__ import annotations

import json

import pytest
from admission_testlib import ClusterSim

from kvgate.core.admission import AdmissionConfig, InProcessCoordinator
from kvgate.core.admission.coordinator_state import dump_state, load_state
from kvgate.core.admission.types import LeaseGrant, RefreshRequest
from kvgate.core.errors import ConfigError


class StoredCoordinator:
    """Keeps only the JSON text between refreshes, as the Redis coordinator does."""

    def __init__(self, config: AdmissionConfig, *, learn_on_start: bool = False) -> None:
        self.config = config
        self.text = json.dumps(dump_state(InProcessCoordinator(
            config, learn_on_start=learn_on_start)))

    def _step(self) -> InProcessCoordinator:
        return load_state(self.config, json.loads(self.text))

    def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        coord = self._step()
        grant = coord.refresh(req, now)
        self.text = json.dumps(dump_state(coord))
        return grant

    def release_gateway(self, gateway_id: str) -> None:
        coord = self._step()
        coord.release_gateway(gateway_id)
        self.text = json.dumps(dump_state(coord))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_stored_coordinator_grants_exactly_what_one_in_memory_does(seed: int) -> None:
    # The same seeded fleet (4 gateways, overload, tenant quota, SLO windows) against
    # the in-memory coordinator and against one reloaded from JSON on every refresh:
    # every result, grant by grant, is the same.
    def run(factory: object) -> object:
        sim = ClusterSim(seed, gateways=4, budget=40, overload=3.0, duration_s=8.0,
                         traffic_before_first_refresh=True,
                         coordinator_factory=factory)  # type: ignore[arg-type]
        return sim.run()

    memory = run(lambda cfg: InProcessCoordinator(cfg, learn_on_start=True))
    stored = run(lambda cfg: StoredCoordinator(cfg, learn_on_start=True))
    assert stored == memory


def test_state_keeps_records_tenants_learning_and_slo() -> None:
    cfg = AdmissionConfig(budget=50, tenant_quotas={"t": 5})
    coord = InProcessCoordinator(cfg, epoch="e1", learn_on_start=True)
    coord.slo.p1_ceiling, coord.slo.p2_ceiling = 0.5, 0.0
    coord.refresh(RefreshRequest(gateway_id="g", epoch=None, inuse=(1, 2, 0),
                                 wants=(3, 4, 1), has=(0, 0, 0), has_total=0), 10.0)
    again = load_state(cfg, json.loads(json.dumps(dump_state(coord))))
    assert dump_state(again) == dump_state(coord)
    assert again.epoch == "e1" and again.learning_until == coord.learning_until == 12.0
    assert again.slo.ceilings == (1.0, 0.5, 0.0)
    assert again.records["g"].inuse == (1, 2, 0)


def test_p2_slow_start_survives_the_store_and_reads_the_version_before() -> None:
    cfg = AdmissionConfig(budget=10)
    coord = InProcessCoordinator(cfg)
    coord.slo.p2_ceiling = 0.4  # half-way through a slow start
    data = json.loads(json.dumps(dump_state(coord)))
    assert load_state(cfg, data).slo.ceilings[2] == 0.4
    assert data["slo"]["p2_on"] is True  # what a gateway of the version before reads
    for on, ceiling in ((True, 1.0), (False, 0.0)):  # written by that version: no ramp
        old = {**data, "slo": {k: v for k, v in data["slo"].items() if k != "p2_ceiling"}}
        old["slo"]["p2_on"] = on
        assert load_state(cfg, old).slo.ceilings[2] == ceiling


def test_a_state_of_another_version_is_refused() -> None:
    data = dump_state(InProcessCoordinator(AdmissionConfig(budget=10)))
    data["v"] = 99
    with pytest.raises(ConfigError, match="version"):
        load_state(AdmissionConfig(budget=10), data)
