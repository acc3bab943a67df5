"""`etude bench trainer`: tokens/s and MFU of an RL and an SFT step of the `small` preset.

The batches are `etude bench prefix-sharing`'s (``services.bench.prefix_sharing``): RL,
8 groups x 4 rollouts of the harness's transcripts with the reference forward for the KL;
SFT, one 8,192-token step of the base model's SFT data. Fresh weights, the trainer's
compute dtype (``auto``), one thread. Each step runs two ways in one process, taken
alternately (best of a few):

* **current** (the baseline): the path the trainer had before its throughput work: every
  sequence packed whole (no prefix sharing) and one matmul per expert
  (``services.trainer.precision.backends.per_expert_loop``);
* **new**: the defaults now: prefix trees (``prefix_sharing = "auto"``) and one grouped
  GEMM for all experts (``F.grouped_mm``).

Figures: ``rl_speedup`` and ``sft_speedup`` (tokens/s of new / current; the tokens are
the sequences' tokens, each counted whole, so both paths do the same work; target: the
RL step at least 2x), ``mfu_rl`` and ``mfu_sft``: the FLOPs the new path computes,
counted from the model's shape (``step_flops``), per second, over ``peak_gflops``, the
best of a square bf16 (compute dtype) matmul measured in the same run on the same
threads. The full run also times the new path with activation checkpointing against
without (``details.activation_checkpointing``), and with ``ETUDE_BENCH_TRAINER_COMPILE=1``
with ``torch.compile`` of each decoder layer (``details.compile``: the first steps, which
compile, and the best after).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from services.bench import BenchResult
from services.trainer.model.architecture import Architecture
from services.trainer.model.transformer import PackedInputs

TARGET_RL_SPEEDUP = 2.0
TARGET_MFU_RL = 0.25
COMPILE_VARIABLE = "ETUDE_BENCH_TRAINER_COMPILE"
NUM_GROUPS = 8  # groups of prefix_sharing.GROUP_SIZE rollouts


def forward_flops(arch: Architecture, inputs: PackedInputs, num_head_rows: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of one forward over ``inputs``: the projections,
    router and top-k experts of every computed token, attention over the keys each query
    sees (prefix-tree runs see their ancestors), and the LM head on ``num_head_rows``."""
    hidden, heads, kv_heads = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads
    head_dim = arch.head_dim
    per_token = (
        hidden * heads * head_dim * 2  # q and o projections
        + hidden * kv_heads * head_dim * 2  # k and v
        + hidden * arch.num_experts  # router
        + arch.top_k * 3 * hidden * arch.moe_intermediate_size  # SwiGLU experts
    )
    pairs = 0
    lengths = [end - start for start, end in itertools.pairwise(inputs.cu_seqlens)]
    for run, length in enumerate(lengths):
        above = inputs.ancestors[run] if inputs.ancestors is not None else ()
        prefix = sum(lengths[a] for a in above)
        pairs += length * prefix + length * (length + 1) // 2
    num_tokens = int(inputs.input_ids.shape[0])
    per_layer = 2 * per_token * num_tokens + 2 * 2 * heads * head_dim * pairs
    return float(arch.num_layers * per_layer + 2 * hidden * arch.vocab_size * num_head_rows)


def step_flops(
    arch: Architecture, inputs: PackedInputs, num_trained: int, *, reference: bool
) -> float:
    """Model FLOPs of one training step on a microbatch: forward and backward (3 forwards'
    worth) of the policy, and one forward of the reference when the KL needs it.
    Recomputation (activation checkpointing) is not counted: MFU counts the model's work."""
    forward = forward_flops(arch, inputs, num_trained)
    return (3 + (1 if reference else 0)) * forward


def matmul_peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a ``size``-square matmul in ``dtype`` on this process's threads."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up (kernel selection, oneDNN primitive cache)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


@contextlib.contextmanager
def _path(current: bool) -> Iterator[None]:
    from services.trainer.precision.backends import per_expert_loop

    with per_expert_loop() if current else contextlib.nullcontext():
        yield


def _best(calls: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Best seconds of each call over ``repeats`` rounds, the calls taken alternately."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
    return best


def run(quick: bool) -> BenchResult:
    """RL and SFT steps of the small preset, the current path against the new one."""

    from services.bench.prefix_sharing import rl_items, small_learner
    from services.config.launcher import BaseModelConfig
    from services.launcher.base_model import sft_records
    from services.trainer.batch import RLBatch, pack_microbatch
    from services.trainer.sft import ExampleStream, JsonlSource, to_microbatch

    torch.set_num_threads(1)
    repeats = 1 if quick else 3
    num_groups = 2 if quick else NUM_GROUPS
    with tempfile.TemporaryDirectory(prefix="etude-bench-trainer-") as scratch:
        tokenizer, learner = small_learner(Path(scratch))
        model, dtype = learner.model, learner.model.dtype
        arch = model.arch
        items = rl_items(tokenizer, num_groups)
        rl_batches = {
            current: RLBatch(
                [pack_microbatch(items, arch.num_layers, arch.top_k, share_prefixes=not current)],
                num_rollouts=len(items),
                rewards=[],
                advantages=[],
                group_weights=[],
            )
            for current in (True, False)
        }
        settings = BaseModelConfig()
        records = Path(scratch) / "sft.jsonl"
        records.write_text(
            "".join(
                json.dumps(record) + "\n"
                for record in sft_records(0, 200, settings.sft_flawed_fraction)
            )
        )
        source = JsonlSource(tokenizer, max_seq_len=settings.max_seq_len, path=records)
        tokens_per_step = settings.tokens_per_step // (4 if quick else 1)
        examples = ExampleStream(source, tokens_per_step).next_batch()
        sft_batches = {
            current: to_microbatch(examples, share_prefixes=not current)
            for current in (True, False)
        }

        def rl(current: bool) -> Callable[[], float]:
            def call() -> float:
                with _path(current):
                    return learner.rl_step(rl_batches[current], 0)["loss"]

            return call

        def sft(current: bool) -> Callable[[], float]:
            def call() -> float:
                with _path(current):
                    return learner.sft_step([sft_batches[current]], 0)["loss"]

            return call

        for warm_up in (rl(True), rl(False), sft(True), sft(False)):
            warm_up()  # allocations, kernel selection
        peaks: list[float] = []

        def peak() -> float:
            peaks.append(matmul_peak_gflops(dtype))
            return peaks[-1]

        # The peak is measured between the steps, in every round, and its best taken as the
        # steps' best are: on a shared machine both see the same interference.
        calls = {
            "peak": peak,
            "rl_current": rl(True),
            "rl_new": rl(False),
            "sft_current": sft(True),
            "sft_new": sft(False),
        }
        timed = _best(calls, repeats)
        variants: dict[str, Any] = {}
        if not quick:
            compiled = os.environ.get(COMPILE_VARIABLE) == "1"
            variants = _variants(learner, rl(False), sft(False), repeats, compiled)
        peak_gflops = max(peaks)

    new_rl, new_sft = rl_batches[False].microbatches[0], sft_batches[False]
    rl_flops = step_flops(arch, new_rl.inputs, int(new_rl.trained.sum()), reference=True)
    sft_flops = step_flops(arch, new_sft.inputs, int(new_sft.trained.sum()), reference=False)
    tokens: dict[str, int] = {"rl": new_rl.num_data_tokens, "sft": new_sft.num_data_tokens}
    speedup = {name: timed[f"{name}_current"] / timed[f"{name}_new"] for name in tokens}
    mfu = {
        "rl": rl_flops / timed["rl_new"] / (peak_gflops * 1e9),
        "sft": sft_flops / timed["sft_new"] / (peak_gflops * 1e9),
    }
    return BenchResult(
        figures={
            "rl_speedup": round(speedup["rl"], 3),
            "sft_speedup": round(speedup["sft"], 3),
            "mfu_rl": round(mfu["rl"], 4),
            "mfu_sft": round(mfu["sft"], 4),
            "peak_gflops": round(peak_gflops, 1),
            **{
                f"{name}_tokens_per_s": round(tokens[name] / timed[f"{name}_new"], 1)
                for name in tokens
            },
        },
        baseline={
            f"{name}_tokens_per_s": round(tokens[name] / timed[f"{name}_current"], 1)
            for name in tokens
        },
        ok=speedup["rl"] >= TARGET_RL_SPEEDUP and mfu["rl"] >= TARGET_MFU_RL,
        target=f"rl_speedup >= {TARGET_RL_SPEEDUP:g} and mfu_rl >= {TARGET_MFU_RL:g}",
        details={
            "model": f"small preset, fresh weights, {str(dtype).removeprefix('torch.')}, "
            f"{torch.get_num_threads()} thread(s)",
            "current": "every sequence packed whole, one matmul per expert",
            "new": "prefix trees, one grouped GEMM (F.grouped_mm) for all experts",
            "rl": {
                "rollouts": len(items),
                "tokens": tokens["rl"],
                "tokens_computed": new_rl.num_tokens,
                "seconds_current": round(timed["rl_current"], 3),
                "seconds_new": round(timed["rl_new"], 3),
                "gflops_new": round(rl_flops / 1e9, 2),
            },
            "sft": {
                "examples": len(examples),
                "tokens": tokens["sft"],
                "tokens_computed": new_sft.num_tokens,
                "seconds_current": round(timed["sft_current"], 3),
                "seconds_new": round(timed["sft_new"], 3),
                "gflops_new": round(sft_flops / 1e9, 2),
            },
            **variants,
            "repeats": repeats,
        },
    )


def _variants(
    learner: Any,
    rl: Callable[[], float],
    sft: Callable[[], float],
    repeats: int,
    compiled: bool,
) -> dict[str, Any]:
    """The new path's step seconds with activation checkpointing against without, taken
    alternately; with ``compiled``, then with each decoder layer compiled (the first calls
    compile; then the best of ``repeats``)."""
    from services.trainer.model import Qwen3MoE

    model, reference = learner.model, learner.reference

    def checkpointed(call: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            model.activation_checkpointing = True
            try:
                return call()
            finally:
                model.activation_checkpointing = False

        return run

    timed = _best(
        {
            "rl": rl,
            "rl_checkpointed": checkpointed(rl),
            "sft": sft,
            "sft_checkpointed": checkpointed(sft),
        },
        repeats,
    )
    variants: dict[str, Any] = {
        "activation_checkpointing": {f"{name}_seconds": round(s, 3) for name, s in timed.items()}
    }
    if compiled:
        for each in (model, reference):
            assert isinstance(each, Qwen3MoE)
            each.compile_layers()
        first = {}
        for name, call in (("rl", rl), ("sft", sft)):
            started = time.perf_counter()
            call()
            first[f"{name}_first_step_seconds"] = round(time.perf_counter() - started, 3)
        steady = _best({"rl": rl, "sft": sft}, repeats)
        variants["compile"] = first | {f"{n}_seconds": round(s, 3) for n, s in steady.items()}
    return variants
