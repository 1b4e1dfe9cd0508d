"""What a request missed of the SLO (kvgate.sim.report.slo_miss), by hand."""

from __future__ import annotations

import pytest

from kvgate.sim.cluster import RequestOutcome
from kvgate.sim.report import Slo, meets, slo_miss
from kvgate.sim.workload_types import SimRequest

SLO = Slo(ttft_s=5.0, tpot_s=0.1)


def _outcome(status: str, first: float | None, finished: float | None, out: int) -> RequestOutcome:
    req = SimRequest(
        request_id="r", arrival_s=0.0, prompt_tokens=10, output_tokens=out, block_ids=()
    )
    return RequestOutcome(
        req=req,
        gateway=0,
        status=status,
        first_token_s=first,
        finished_s=finished,
        output_tokens=out,
    )


@pytest.mark.parametrize(
    ("status", "first", "finished", "out", "kind"),
    [
        ("completed", 1.0, 1.0 + 0.1 * 10, 11, None),  # TPOT exactly on the target
        ("completed", 5.0, 5.0, 1, None),  # one token: no TPOT to miss
        ("completed", 6.0, 6.5, 11, "ttft"),
        ("completed", 1.0, 1.0 + 0.2 * 10, 11, "tpot"),
        ("completed", 6.0, 6.0 + 0.2 * 10, 11, "both"),
        ("rejected", None, None, 0, "not_completed"),
        ("failed", 2.0, None, 3, "not_completed"),  # failed after its first token
    ],
)
def test_slo_miss_says_which_part_was_missed(
    status: str, first: float | None, finished: float | None, out: int, kind: str | None
) -> None:
    o = _outcome(status, first, finished, out)
    assert slo_miss(o, SLO) == kind
    assert meets(o, SLO) is (kind is None)
