"""``dtype = "auto"``: bfloat16 only where bf16 GEMMs are native, for inference as for training."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import dtypes
from services.config.inference import EngineConfig
from services.inference.engine import Engine


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_on_accelerators_and_on_cpus_with_native_bf16(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    assert dtypes.resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert dtypes.resolve_dtype("auto", "cuda") == "bfloat16"
    assert dtypes.resolve_dtype("float16", "cpu") == "float16"
    assert dtypes.resolve_dtype("float32", "cuda") == "float32"


@pytest.mark.parametrize("native", [True, False])
def test_the_inference_engine_resolves_auto_before_vllm_sees_it(
    native: bool, monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    engine = Engine(EngineConfig(model_dir=tiny_model))
    expected = "bfloat16" if native or engine.on_cuda else "float32"
    assert engine.dtype == expected
    assert engine._engine_args().dtype == expected
    pinned = Engine(EngineConfig(model_dir=tiny_model, dtype="bfloat16"))
    assert pinned._engine_args().dtype == "bfloat16"
