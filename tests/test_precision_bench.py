"""`etude bench quant`: the benchmarks contract and its error figures (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_bench_quant_contract_and_error_figures() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "quant", "--quick", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr  # 1 only when a speed target is missed
    result = json.loads(done.stdout)
    assert result["bench"] == "quant" and result["ok"] == (done.returncode == 0)
    figures, baseline, details = result["figures"], result["baseline"], result["details"]
    assert details["torchao"].startswith("0.18")
    assert details["mxfp8_bits_identical_to_torchao"] is True
    for name in ("nvfp4", "mxfp8"):
        ratio = figures[f"{name}_gelem_per_s"] / baseline[f"torchao_{name}_gelem_per_s"]
        assert figures[f"{name}_speed_ratio"] == pytest.approx(ratio)
    assert result["ok"] == (min(figures["nvfp4_speed_ratio"], figures["mxfp8_speed_ratio"]) >= 1)
    # Deterministic data: per-token scales keep quiet tokens accurate, a tensor scale does not.
    per_token = figures["mean_token_sqnr_db_nvfp4_per_token"]
    per_tensor = figures["mean_token_sqnr_db_nvfp4_per_tensor"]
    assert per_token > per_tensor + 3
    assert 15 < figures["sqnr_db_nvfp4_per_token"] < 30 and figures["sqnr_db_mxfp8"] > 25
