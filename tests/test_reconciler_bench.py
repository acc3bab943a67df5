"""`etude bench reconciler` runs both ways of working and reports consistent figures."""

from __future__ import annotations

import pytest

from services.bench import reconciler as bench

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.slow]


def test_quick_run_reports_both_modes_against_ping() -> None:
    result = bench.run(quick=True)
    figures = result.figures
    assert figures["lifecycles_per_s"] > 0 and figures["lifecycles_per_s_unbatched"] > 0
    for workers in (1, 4):
        assert figures[f"lifecycles_per_s_{workers}_workers"] > 0
        assert figures[f"lifecycles_per_s_{workers}_workers_unbatched"] > 0
        assert result.baseline[f"ping_per_s_{workers}_workers"] > 0
    # One slot per call is three calls a lifecycle; batched, a claim and a heartbeat per
    # 8 slots and a completion each (a little more where a claim found fewer than 8).
    assert figures["calls_per_lifecycle_unbatched"] == 3.0
    assert 1 + 2 / bench.BATCH <= figures["calls_per_lifecycle"] < 2
    assert figures["calls_fraction_of_ping"] > 0 and figures["calls_fraction_of_ping_unbatched"] > 0
    assert figures["claim_p50_ms"] <= figures["claim_p99_ms"]
    assert result.details["slots_per_worker"] == bench.BATCH
