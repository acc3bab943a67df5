"""`etude bench packing`: global sequence packing on RL-like rollout lengths.

Rollout lengths are heavy-tailed: log-normal with a median of 1,500 tokens and sigma 1.0
(most rollouts short, a few a hundred times longer), clipped to [64, 32,768] tokens (the
context). A sequence of ``L`` tokens costs ``a * L + b * L**2`` with the trainer's
default ``b / a`` (``[trainer.job.dist.packing]``, about a 4096-wide model: attention
is 57% of a 32k-token sequence's cost and 6% of a 1,500-token one). For 10,000 and
100,000 sequences over 8 and 64 dp ranks, each partitioner's ``imbalance`` is the
max / mean of the ranks' summed costs (1.0 is perfect):

* ``imbalance``: Karmarkar-Karp's worst over the four cases (target <= 1.02), against
  ``sorted_greedy`` and ``round_robin`` on the same lengths (baseline); the figures
  ``imbalance_vs_*`` are the ratios;
* ``seconds_100k``: Karmarkar-Karp on 100,000 sequences over 64 ranks, best of a few
  runs (target < 1 s). The numba code is compiled by a warm-up call first, which the
  figure leaves out (``details.compile_seconds`` says what the first call took);
* ``details.plan_seconds``: the whole step plan (``packing.plan_step``: partition, then
  each rank's microbatches under a 64k-token budget, the same count on every rank;
  10k sequences only with ``--quick``).

Each case's ``bound`` in the details is ``max(1, longest cost / mean rank cost)``: no
partitioner can do better than that. ``details.step_sized`` is one RL step's worth
(2,048 sequences over 64 ranks, 32 a rank), where the partitioners differ more.
``details.calibration`` is the cost model measured (``services.trainer.distributed.
calibration``, what ``[trainer.job.dist.packing] calibrate = true`` runs at start-up) on
one layer of the ``small`` preset, on CUDA when there is one, and the step-sized case
under it; on a busy CPU the timings are noisy, so read ``b_over_a`` as an estimate.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

from services.bench import BenchResult
from services.config.trainer import PackingConfig
from services.model_factory.presets import PRESETS
from services.trainer.distributed.calibration import fit, measure
from services.trainer.distributed.packing import (
    CostModel,
    imbalance,
    karmarkar_karp,
    plan_step,
    round_robin,
    sorted_greedy,
)
from services.trainer.model.architecture import Architecture

TARGET_IMBALANCE = 1.02
TARGET_SECONDS_100K = 1.0
NUM_SEQUENCES = (10_000, 100_000)
NUM_RANKS = (8, 64)
MEDIAN_TOKENS = 1500
SIGMA = 1.0
MIN_TOKENS, CONTEXT_TOKENS = 64, 32_768
TOKEN_BUDGET = 65_536
STEP_SIZED = (2048, 64)  # 256 groups of 8 rollouts over 64 ranks: 32 sequences a rank

Partitioner = Callable[[np.ndarray, int], list[list[int]]]
PARTITIONERS: dict[str, Partitioner] = {
    "karmarkar_karp": karmarkar_karp,
    "sorted_greedy": sorted_greedy,
    "round_robin": round_robin,
}


def rollout_lengths(num_sequences: int, seed: int = 0) -> np.ndarray:
    """Heavy-tailed lengths like RL rollouts' (see the module doc)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, num_sequences)
    return np.clip(lengths, MIN_TOKENS, CONTEXT_TOKENS).astype(np.int64)


def _best_seconds(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def _case(num_sequences: int, num_ranks: int, cost_model: CostModel) -> dict[str, float]:
    """Every partitioner's imbalance on one draw of lengths, and the best possible."""
    costs = cost_model.costs(rollout_lengths(num_sequences))
    case: dict[str, float] = {"num_sequences": num_sequences, "num_ranks": num_ranks}
    for name, partition in PARTITIONERS.items():
        case[name] = round(imbalance(costs, partition(costs, num_ranks)), 6)
    case["bound"] = round(max(1.0, float(costs.max()) / (float(costs.sum()) / num_ranks)), 6)
    return case


def calibrated(quick: bool) -> dict[str, object]:
    """``b / a`` measured on one decoder layer of the ``small`` preset (the CPU demo
    model), and Karmarkar-Karp under it on the step-sized case."""
    preset = PRESETS["small"]
    arch = Architecture(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        num_layers=preset.num_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        num_experts=preset.num_experts,
        top_k=preset.num_experts_per_token,
        moe_intermediate_size=preset.moe_intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = (128, 256, 512) if quick else (128, 256, 512, 1024, 2048)
    seconds = measure(arch, lengths=lengths, repeats=1 if quick else 5, device=device)
    cost_model = fit(seconds)
    return {
        "model": f"small preset (d_model {preset.hidden_size}), one layer, bf16, {device.type}",
        "seconds": {str(length): round(value, 5) for length, value in seconds.items()},
        "b_over_a": cost_model.per_token_pair,
        "step_sized": _case(*STEP_SIZED, cost_model),
    }


def run(quick: bool) -> BenchResult:
    """Imbalance of each partitioner per case, and Karmarkar-Karp's time on 100k."""
    repeats = 1 if quick else 5
    defaults = PackingConfig()
    cost_model = CostModel(defaults.cost_per_token, defaults.cost_per_token_pair)
    started = time.perf_counter()
    karmarkar_karp(cost_model.costs(rollout_lengths(64)), 8)  # compiles (or loads) numba code
    compile_seconds = time.perf_counter() - started

    cases = [_case(n, k, cost_model) for n in NUM_SEQUENCES for k in NUM_RANKS]
    step_sized = _case(*STEP_SIZED, cost_model)

    lengths = rollout_lengths(NUM_SEQUENCES[-1])
    costs = cost_model.costs(lengths)
    seconds = {
        name: _best_seconds(functools.partial(partition, costs, 64), repeats)
        for name, partition in PARTITIONERS.items()
    }
    plan_seconds: dict[str, float] = {}
    for num_sequences in NUM_SEQUENCES[:1] if quick else NUM_SEQUENCES:
        for num_ranks in NUM_RANKS:
            began = time.perf_counter()
            plan_step(lengths[:num_sequences], num_ranks, TOKEN_BUDGET, cost_model)
            plan_seconds[f"{num_sequences // 1000}k_over_{num_ranks}"] = round(
                time.perf_counter() - began, 4
            )

    def worst(name: str) -> float:
        return max(case[name] for case in cases)

    kk, greedy, robin = worst("karmarkar_karp"), worst("sorted_greedy"), worst("round_robin")
    return BenchResult(
        figures={
            "imbalance": round(kk, 6),
            "imbalance_vs_sorted_greedy": round(kk / greedy, 6),
            "imbalance_vs_round_robin": round(kk / robin, 6),
            "seconds_100k": round(seconds["karmarkar_karp"], 4),
            "seconds_vs_sorted_greedy": round(
                seconds["karmarkar_karp"] / seconds["sorted_greedy"], 3
            ),
        },
        baseline={
            "sorted_greedy_imbalance": round(greedy, 6),
            "round_robin_imbalance": round(robin, 6),
            "sorted_greedy_seconds_100k": round(seconds["sorted_greedy"], 4),
        },
        ok=kk <= TARGET_IMBALANCE and seconds["karmarkar_karp"] < TARGET_SECONDS_100K,
        target=(
            f"imbalance <= {TARGET_IMBALANCE:g} (max / mean rank cost) and seconds_100k < "
            f"{TARGET_SECONDS_100K:g} (100k sequences over 64 ranks, numba compile excluded)"
        ),
        details={
            "lengths": {
                "distribution": f"log-normal, median {MEDIAN_TOKENS}, sigma {SIGMA}",
                "clipped_to": [MIN_TOKENS, CONTEXT_TOKENS],
            },
            "cost_model": {"a": cost_model.per_token, "b": cost_model.per_token_pair},
            "cases": cases,
            "step_sized": step_sized,
            "compile_seconds": round(compile_seconds, 3),
            "plan_seconds": plan_seconds,
            "token_budget": TOKEN_BUDGET,
            "repeats": repeats,
            "numba": numba.__version__,
            "calibration": calibrated(quick),
        },
    )
