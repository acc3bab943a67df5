"""`etude bench weight-sync`: how small and how fast a published version is.

For the factory's tiny and small models: fp32 master weights trained with AdamW on
real gradients (transformers' Qwen3-MoE causal-LM loss on the factory's code corpus)
for a few warm-up steps, then one more step; the bf16 weights before and after that
step are what two consecutive versions publish. Figures, per model and learning rate
(1e-6 and 1e-5):

* ``bytes_ratio``: delta bytes / full bf16 bytes (the report's anchor is ~1/20;
  target <= 1/40 at lr 1e-6);
* ``encode_gbps`` / ``decode_gbps``: bf16 bytes per second through the codec on one
  core, and ``memcpy_gbps`` of the same bytes in the same run (target: encode and
  decode >= 0.25 x memcpy).

Baseline, same run: plain zstd (level 1) of the full bf16 weights, its ratio and speed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from services.bench import BenchResult
from services.weights import codec

TARGET_RATIO_AT_1E6 = 1 / 40
TARGET_SPEED_FRACTION = 0.25
WARMUP_STEPS = 3
LEARNING_RATES = (1e-6, 1e-5)


def _best_seconds(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def _batches(
    model_dir: Path, seed: int, count: int, length: int = 128, size: int = 4
) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    from services.model_factory.corpus import corpus

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for document in corpus(seed + 1, count * size * length * 6):
        ids += tokenizer.encode(document)
    flat = torch.tensor(ids[: count * size * length]).reshape(count, size, length)
    return list(flat)


def _versions(
    preset: str, lr: float, work: Path
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """bf16 bits of consecutive versions: after WARMUP_STEPS and after one more step."""
    from transformers import AutoModelForCausalLM

    from services.model_factory.build import init_model

    model_dir = work / preset
    if not model_dir.exists():
        init_model(preset, model_dir, seed=0)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    batches = _batches(model_dir, 0, WARMUP_STEPS + 1)

    def bf16_bits() -> dict[str, np.ndarray]:
        return {
            name: codec.to_bits(p.detach().to(torch.bfloat16)).copy()
            for name, p in model.named_parameters()
        }

    before: dict[str, np.ndarray] = {}
    for step, batch in enumerate(batches):
        if step == len(batches) - 1:
            before = bf16_bits()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return before, bf16_bits()


def _measure(
    before: dict[str, np.ndarray], after: dict[str, np.ndarray], level: int
) -> dict[str, float]:
    names = sorted(after)
    raw_bytes = sum(after[n].nbytes for n in names)
    encoded = {n: codec.encode(after[n], before[n], level) for n in names}
    delta_bytes = sum(len(payload) for _, payload in encoded.values())
    repeats = max(3, int(2e8 // max(raw_bytes, 1)))
    encode_s = _best_seconds(
        lambda: [codec.encode(after[n], before[n], level) for n in names], repeats
    )
    decode_s = _best_seconds(
        lambda: [
            codec.decode(e, p, before[n], after[n].dtype, after[n].size)
            for n, (e, p) in encoded.items()
        ],
        repeats,
    )
    flat = np.concatenate([after[n].view(np.uint8) for n in names])
    target = np.empty_like(flat)
    memcpy_s = _best_seconds(lambda: np.copyto(target, flat), repeats)
    full = flat.tobytes()
    compressor = zstandard.ZstdCompressor(level=1)
    zstd_full = compressor.compress(full)
    zstd_s = _best_seconds(lambda: compressor.compress(full), repeats)
    return {
        "raw_bytes": raw_bytes,
        "bytes_ratio": delta_bytes / raw_bytes,
        "encode_gbps": raw_bytes / encode_s / 1e9,
        "decode_gbps": raw_bytes / decode_s / 1e9,
        "memcpy_gbps": raw_bytes / memcpy_s / 1e9,
        "changed_fraction": float(
            sum(np.count_nonzero(after[n] != before[n]) for n in names)
            / sum(after[n].size for n in names)
        ),
        "zstd_full_ratio": len(zstd_full) / raw_bytes,
        "zstd_full_gbps": raw_bytes / zstd_s / 1e9,
    }


def run(quick: bool) -> BenchResult:
    """Per model (tiny; small unless quick) and learning rate, delta size and codec speed."""
    torch.set_num_threads(1)  # the codec figures are for one core
    presets = ("tiny",) if quick else ("tiny", "small")
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    details: dict[str, Any] = {"warmup_steps": WARMUP_STEPS, "zstd_level": 1}
    with tempfile.TemporaryDirectory() as work_dir:
        for preset in presets:
            for lr in LEARNING_RATES:
                before, after = _versions(preset, lr, Path(work_dir))
                measured = _measure(before, after, level=1)
                tag = f"{preset}_lr{lr:.0e}"
                for key in (
                    "bytes_ratio",
                    "encode_gbps",
                    "decode_gbps",
                    "memcpy_gbps",
                    "changed_fraction",
                ):
                    figures[f"{key}_{tag}"] = measured[key]
                baseline[f"zstd_full_ratio_{tag}"] = measured["zstd_full_ratio"]
                baseline[f"zstd_full_gbps_{tag}"] = measured["zstd_full_gbps"]
                details[f"raw_bytes_{preset}"] = measured["raw_bytes"]
                if lr == LEARNING_RATES[0]:
                    level3 = _measure(before, after, level=3)
                    details[f"bytes_ratio_level3_{tag}"] = level3["bytes_ratio"]
                    details[f"encode_gbps_level3_{tag}"] = level3["encode_gbps"]
    main = presets[-1]
    tag = f"{main}_lr1e-06"
    figures["bytes_ratio"] = figures[f"bytes_ratio_{tag}"]
    figures["encode_gbps"] = figures[f"encode_gbps_{tag}"]
    figures["decode_gbps"] = figures[f"decode_gbps_{tag}"]
    figures["memcpy_gbps"] = figures[f"memcpy_gbps_{tag}"]
    figures["encode_fraction_of_memcpy"] = figures["encode_gbps"] / figures["memcpy_gbps"]
    figures["decode_fraction_of_memcpy"] = figures["decode_gbps"] / figures["memcpy_gbps"]
    ok = (
        figures["bytes_ratio"] <= TARGET_RATIO_AT_1E6
        and figures["encode_fraction_of_memcpy"] >= TARGET_SPEED_FRACTION
        and figures["decode_fraction_of_memcpy"] >= TARGET_SPEED_FRACTION
    )
    return BenchResult(
        figures=figures,
        baseline=baseline,
        ok=ok,
        target=(
            f"on the {main} model at lr 1e-6: bytes_ratio <= 1/40, encode and decode "
            f">= {TARGET_SPEED_FRACTION} x memcpy (one core)"
        ),
        details=details,
    )
