"""What a request missed of the SLO (kvgate.sim.report.slo_miss), by hand."""

from __future__ import annotations

import pytest

from kvgate.sim.cluster import RequestOutcome
from kvgate.sim.report import Slo, latency_summary, meets, pct, slo_miss, thinned
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


def test_no_completed_request_has_no_latency_not_a_perfect_one() -> None:
    shed = [_outcome("rejected", None, None, 0), _outcome("failed", 2.0, None, 3)]
    summary = latency_summary(shed)
    assert summary["completed"] == 0
    for key in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "tpot_p99_s", "e2e_p99_s"):
        assert summary[key] is None, key
    assert pct([], 0.99) is None


def test_a_group_summary_has_tpot_and_e2e_too() -> None:
    done = _outcome("completed", 1.0, 2.0, 11)  # arrived at 0: TTFT 1 s, TPOT 0.1 s, E2E 2 s
    summary = latency_summary([done])
    assert (summary["ttft_p99_s"], summary["tpot_p99_s"], summary["e2e_p99_s"]) == (1.0, 0.1, 2.0)


def test_thinned_keeps_the_extremes_and_at_most_n_points() -> None:
    xs = [float(i) for i in range(1_999)]
    sample = thinned(xs, 500)
    assert len(sample) == 500 and sample[0] == 0.0 and sample[-1] == 1_998.0
    assert sample == sorted(sample)
    assert thinned(xs[:7], 500) == xs[:7]
