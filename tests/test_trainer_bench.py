"""The trainer against a real inference service (vLLM on CPU, routed-expert capture on):
logprob parity on sampled tokens, and the `etude bench replay` contract (quick run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from services.bench import replay_turns
from services.bench.replay import (
    MODEL_DIR_VARIABLE,
    SHAPE_VARIABLE,
    STEPS_VARIABLE,
    collect,
    measure,
    result,
    served_model,
    shape_preset,
    tail_figures,
    training_settings,
)
from services.model_factory.build import init_model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A fresh tiny model, served by an inference process that sampled 8 x 24 tokens."""
    workdir = tmp_path_factory.mktemp("replay")
    init_model("tiny", workdir / "tiny", seed=0)
    return workdir / "tiny", collect(True, workdir, workdir / "tiny")


@pytest.fixture(scope="module")
def both_orders(served: tuple[Path, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    return measure(*served, ("eager", "fused"))


@pytest.fixture(scope="module")
def figures(both_orders: dict[str, dict[str, float]]) -> dict[str, float]:
    return both_orders["eager"]


@pytest.fixture(scope="module")
def fused_figures(both_orders: dict[str, dict[str, float]]) -> dict[str, float]:
    return both_orders["fused"]


@pytest.mark.parametrize("numerics", ["eager", "fused"])
def test_trainer_logprobs_match_vllm_on_generated_tokens(
    numerics: str, figures: dict[str, float], fused_figures: dict[str, float]
) -> None:
    """The trainer (bf16, its own routing) scores vLLM's samples to bf16 resolution."""
    measured = figures if numerics == "eager" else fused_figures
    assert measured["generated_tokens"] == 8 * 24
    assert measured["mismatch_max_without_replay"] < 0.05, measured
    assert measured["mismatch_without_replay"] < 0.01, measured


def test_fused_numerics_score_vllms_tokens_closer_than_transformers_order(
    figures: dict[str, float], fused_figures: dict[str, float]
) -> None:
    """Rounding where vLLM's CPU kernels round leaves a fraction of the eager gap (1/8 on
    the full run) and of the bf16 noise floor.

    ``"fused"`` follows the kernels vLLM runs on x86 CPUs without AMX (its VEC attention,
    ``cpu_fused_moe``). On a CPU with AMX tiles vLLM picks its AMX attention and AMX
    grouped-GEMM experts, which round elsewhere: there fused is only closer than eager
    (0.00053 against 0.00068 on a Xeon with AMX), not within a third of it.
    """
    fused = fused_figures["mismatch_with_replay"]
    if torch.cpu._is_amx_tile_supported():
        assert fused < figures["mismatch_with_replay"], (figures, fused_figures)
        return
    assert fused < figures["mismatch_with_replay"] / 3, (figures, fused_figures)
    assert fused < fused_figures["bf16_noise_floor"] / 3, fused_figures


def test_replayed_routes_are_inferences_and_leave_only_rounding_noise(
    served: tuple[Path, list[dict[str, Any]]], figures: dict[str, float]
) -> None:
    _, samples = served
    # Each sample's routes cover its prompt and all its generated tokens but the last.
    assert all(len(s["routes"]) == len(s["prompt"]) + len(s["tokens"]) - 1 for s in samples)
    assert 0.9 < figures["route_agreement_without_replay"] <= 1.0
    assert figures["replacement_rate"] == 0.0
    assert figures["mismatch_with_replay"] < 3 * figures["bf16_noise_floor"]
    assert figures["mismatch_max_with_replay"] <= figures["mismatch_max_without_replay"]
    assert figures["extreme_fraction_with_replay"] <= figures["extreme_fraction_without_replay"]


def test_tail_figures_count_tokens_two_times_apart_as_extreme() -> None:
    """R3's extreme tokens: probabilities more than a factor 2 apart, |Δlogp| > ln 2."""
    gap = torch.tensor([0.0] * 96 + [0.5, 0.69, 0.70, 3.0])
    tail = tail_figures(gap, "x")
    assert set(tail) == {"mismatch_p99_x", "mismatch_max_x", "extreme_fraction_x"}
    assert tail["extreme_fraction_x"] == pytest.approx(2 / 100)  # 0.70 and 3.0, not 0.69
    assert tail["mismatch_max_x"] == pytest.approx(3.0)
    # The 99th percentile of 100 values: 1% of the way from the 99th (0.70) to the 100th.
    assert tail["mismatch_p99_x"] == pytest.approx(0.70 + 0.01 * (3.0 - 0.70), abs=1e-5)


def test_bench_replay_contract(figures: dict[str, float], fused_figures: dict[str, float]) -> None:
    answer = result(figures, quick=True, fused=fused_figures).to_json("replay")
    assert set(answer) >= {"bench", "figures", "baseline", "ok", "target"}
    assert all(math.isfinite(value) and value >= 0 for value in answer["figures"].values())
    ratio = figures["mismatch_without_replay"] / figures["mismatch_with_replay"]
    assert answer["figures"]["mismatch_ratio"] == pytest.approx(ratio)
    assert answer["ok"] == (ratio >= 5.0)
    assert answer["baseline"] == {"mismatch_without_replay": figures["mismatch_without_replay"]}
    fused = fused_figures
    fused_ratio = fused["mismatch_without_replay"] / fused["mismatch_with_replay"]
    assert answer["figures"]["mismatch_ratio_fused"] == pytest.approx(fused_ratio)
    assert answer["figures"]["mismatch_with_replay_fused"] == fused["mismatch_with_replay"]


def test_bench_replay_multi_turn_workload_spans_an_update_with_stitched_routes(
    served: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The multi-turn workload's rollouts: tokens of both versions, a stitched table with a
    row for every token but the last, each row sent once; its figures in the answer."""
    model_dir = served[0]
    model_dirs, rollouts = replay_turns.collect(model_dir, tmp_path, quick=True)
    assert len(model_dirs) == 2 and model_dirs[min(model_dirs)] == model_dir
    for rollout in rollouts:
        versions = rollout["versions"]
        assert set(versions[versions >= 0].tolist()) == set(model_dirs)
        assert rollout["routes"].shape == (len(rollout["tokens"]) - 1, 2, 2)
        assert rollout["last_call_routes"].shape == rollout["routes"].shape
    figures = replay_turns.measure(model_dirs, rollouts)
    assert figures["multiturn_generated_tokens"] == 4 * replay_turns.NUM_TURNS * 16
    assert all(math.isfinite(value) and value >= 0 for value in figures.values())
    # Three turns: the whole context every call would have sent about twice the bytes.
    assert figures["multiturn_routing_bytes_whole_context_ratio"] > 1.5
    single = {"mismatch_without_replay": 0.04, "mismatch_with_replay": 0.004}
    for multiturn_ratio, ok in ((12.0, True), (8.0, False)):
        answer = result(
            single, quick=True, multiturn={**figures, "multiturn_ratio": multiturn_ratio}
        )
        assert answer.ok == ok and answer.figures["multiturn_ratio"] == multiturn_ratio


def test_bench_replay_shape_keeps_tiny_width_and_names_the_variable_when_wrong() -> None:
    preset = shape_preset("16:64:8")
    assert (preset.num_layers, preset.num_experts, preset.num_experts_per_token) == (16, 64, 8)
    assert preset.hidden_size == 64 and preset.vocab_size == 1024
    with pytest.raises(ValueError, match=f"{SHAPE_VARIABLE}='16x64': expected layers:experts"):
        shape_preset("16x64")
    with pytest.raises(ValueError, match=r"SHAPE='2:4:8'.*num_experts_per_token \(8\) exceeds"):
        shape_preset("2:4:8")
    with pytest.raises(ValueError, match=f"{SHAPE_VARIABLE}='0:8:2'.*greater than or equal to 1"):
        shape_preset("0:8:2")


def test_bench_replay_steps_train_a_shaped_model_and_name_the_variable_when_wrong(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def steps(text: str | None, quick: bool) -> tuple[int, int]:
        settings = training_settings(text, quick)
        return settings.cpt_steps, settings.sft_steps

    assert steps(None, quick=False) == (150, 150)
    assert steps(None, quick=True) == (30, 30)
    assert steps("150:600", quick=True) == (150, 600)
    assert steps("0:0", quick=False) == (0, 0)
    with pytest.raises(ValueError, match=f"{STEPS_VARIABLE}='600': expected cpt_steps:sft"):
        steps("600", quick=False)
    with pytest.raises(ValueError, match=f"{STEPS_VARIABLE}='1:2:3': expected cpt_steps:sft"):
        steps("1:2:3", quick=False)
    with pytest.raises(ValueError, match=f"{STEPS_VARIABLE}='150:-1': .*greater than or equal"):
        steps("150:-1", quick=False)
    monkeypatch.setenv(STEPS_VARIABLE, "150:600")
    monkeypatch.setenv(MODEL_DIR_VARIABLE, str(tmp_path))
    with pytest.raises(ValueError, match=f"{STEPS_VARIABLE} sets .*{MODEL_DIR_VARIABLE} serves"):
        served_model(True, tmp_path)


@pytest.mark.parametrize(
    ("quick", "shape", "steps", "expected"),
    [
        (False, None, None, ((8, 384, 8), (150, 150), "Kimi K2.5 routing")),
        (True, None, None, ((8, 384, 8), (30, 30), "Kimi K2.5 routing")),
        (False, "2:8:2", "0:0", ((2, 8, 2), (0, 0), "top-2 of 8 experts, after 0 CPT")),
    ],
)
def test_bench_replay_trains_composer_2s_routing_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    quick: bool,
    shape: str | None,
    steps: str | None,
    expected: tuple[tuple[int, int, int], tuple[int, int], str],
) -> None:
    """Without settings the benchmark builds 8 layers routing 8 of 384 experts (Kimi K2.5,
    Composer 2's base model), trained as the base model is; the settings replace it."""
    from services.launcher import base_model

    built: list[tuple[Any, Any]] = []
    monkeypatch.setattr(
        base_model,
        "build_base_model",
        lambda preset, _dir, settings, _con: built.append((preset, settings)),
    )
    for variable, value in ((SHAPE_VARIABLE, shape), (STEPS_VARIABLE, steps)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    monkeypatch.delenv(MODEL_DIR_VARIABLE, raising=False)
    model_dir, name = served_model(quick, tmp_path)
    ((preset, settings),) = built
    shape_seen = (preset.num_layers, preset.num_experts, preset.num_experts_per_token)
    assert (shape_seen, (settings.cpt_steps, settings.sft_steps)) == expected[:2]
    assert preset.hidden_size == 64 and model_dir == tmp_path / "shaped"
    assert expected[2] in name


def test_bench_replay_takes_a_model_dir_or_a_shape_not_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(MODEL_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(SHAPE_VARIABLE, "8:64:8")
    with pytest.raises(ValueError, match="not both"):
        served_model(True, tmp_path)
    monkeypatch.delenv(SHAPE_VARIABLE)
    with pytest.raises(ValueError, match=f"{MODEL_DIR_VARIABLE}=.*no model at"):
        served_model(True, tmp_path)
    init_model("tiny", tmp_path / "tiny", seed=0)
    monkeypatch.setenv(MODEL_DIR_VARIABLE, str(tmp_path / "tiny"))
    assert served_model(True, tmp_path) == (tmp_path / "tiny", str(tmp_path / "tiny"))
