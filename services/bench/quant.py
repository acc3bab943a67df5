"""`etude bench quant`: the recipe's quantizers against torchao's, and what row scales buy.

Speed: the row-scaled NVFP4 quantizer and the MXFP8 (RCEIL) quantizer of
``services.trainer.precision`` are timed against torchao 0.18's emulated quantizers
(``nvfp4_quantize`` with a per-tensor scale, ``to_mx`` with RCEIL) on the same bf16
activations in the same run; ``*_speed_ratio`` = torchao seconds / ours (target >= 1).
Error: SQNR (dB) of per-token and per-tensor NVFP4 on heavy-tailed activations (Student-t
elements, log-normal token magnitudes, and a few tokens whose first channels are 10**4
times larger, like the "massive activations" of LLMs), both
with this codec so only the outer scale differs, overall and averaged over tokens.
torchao is a dev dependency; without it the speed ratios are missing and ``ok`` is false.
"""

from __future__ import annotations

import importlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.bench import BenchResult
from services.trainer.precision.mxfp8 import quantize_mxfp8
from services.trainer.precision.nvfp4 import quantize_nvfp4, quantize_nvfp4_with_scale

TARGET_RATIO = 1.0


def heavy_tailed_activations(num_tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """bf16 activations with heavy tails across elements and across tokens."""
    generator = torch.Generator().manual_seed(seed)
    # Student-t with 3 degrees of freedom: normal / sqrt(chi2_3 / 3).
    normals = torch.randn(4, num_tokens, width, generator=generator)
    student_t = normals[0] / torch.sqrt(normals[1:].square().sum(dim=0) / 3)
    token_scale = torch.exp(1.5 * torch.randn(num_tokens, 1, generator=generator))
    x = student_t * token_scale
    massive = torch.randperm(num_tokens, generator=generator)[: max(1, num_tokens // 256)]
    x[massive, : max(1, width // 64)] *= 1e4
    return x.to(torch.bfloat16)


def _best_seconds(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function over ``repeats`` interleaved rounds, after a warm-up.

    Interleaving exposes every contender to the same machine load, and the best time is
    the one least disturbed by other processes (on a busy 2-core machine a single
    descheduled OpenMP thread can stall a call by tens of milliseconds).
    """
    for function in functions.values():
        function()
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    noise = (reference - approximation).double().pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise))


def _mean_token_sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    signal = reference.double().pow(2).sum(dim=-1)
    noise = (reference - approximation).double().pow(2).sum(dim=-1).clamp_min(1e-300)
    return float((10 * torch.log10(signal / noise)).mean())


def _error_figures(x: torch.Tensor) -> dict[str, float]:
    reference = x.float()
    per_token = quantize_nvfp4(x).dequantize()
    tensor_scale = reference.abs().amax() / (6 * 448)
    per_tensor = quantize_nvfp4_with_scale(x, tensor_scale).dequantize()
    mxfp8 = quantize_mxfp8(x).dequantize()
    return {
        "sqnr_db_nvfp4_per_token": _sqnr_db(reference, per_token),
        "sqnr_db_nvfp4_per_tensor": _sqnr_db(reference, per_tensor),
        "mean_token_sqnr_db_nvfp4_per_token": _mean_token_sqnr_db(reference, per_token),
        "mean_token_sqnr_db_nvfp4_per_tensor": _mean_token_sqnr_db(reference, per_tensor),
        "sqnr_db_mxfp8": _sqnr_db(reference, mxfp8),
    }


@dataclass(frozen=True)
class _Torchao:
    """torchao 0.18's emulated quantizers, bound to one input tensor."""

    version: str
    nvfp4: Callable[[], object]
    mxfp8_rceil: Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _torchao(x: torch.Tensor) -> _Torchao | str:
    """torchao's quantizers for ``x``, or why torchao is unusable here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torchao = importlib.import_module("torchao")
            nvfp4 = importlib.import_module("torchao.prototype.mx_formats.nvfp4_tensor")
            mx = importlib.import_module("torchao.prototype.mx_formats.mx_tensor")
            config = importlib.import_module("torchao.prototype.mx_formats.config")
    except ImportError as error:  # a dev dependency: the bench still reports what it can
        return f"torchao not importable ({error}); install the dev extras"
    # Standard NVFP4: the two-level scheme with a per-tensor FP32 scale.
    tensor_scale = nvfp4.per_tensor_amax_to_scale(x.abs().amax().float())
    rceil = config.ScaleCalculationMode.RCEIL
    return _Torchao(
        version=str(torchao.__version__),
        nvfp4=lambda: nvfp4.nvfp4_quantize(x, 16, tensor_scale),
        mxfp8_rceil=lambda: mx.to_mx(x, torch.float8_e4m3fn, 32, rceil),
    )


def run(quick: bool) -> BenchResult:
    """Times both quantizers against torchao and measures per-token vs per-tensor error."""
    num_tokens, width, repeats = (1024, 1024, 5) if quick else (4096, 2048, 20)
    x = heavy_tailed_activations(num_tokens, width)
    num_elements = x.numel()
    details: dict[str, Any] = {
        "shape": [num_tokens, width],
        "dtype": "bfloat16",
        "timing": f"best of {repeats} interleaved rounds, {torch.get_num_threads()} threads",
    }
    contenders: dict[str, Callable[[], object]] = {
        "nvfp4": lambda: quantize_nvfp4(x),
        "mxfp8": lambda: quantize_mxfp8(x),
    }
    torchao = _torchao(x)
    if isinstance(torchao, _Torchao):
        contenders |= {"torchao_nvfp4": torchao.nvfp4, "torchao_mxfp8": torchao.mxfp8_rceil}
    seconds = _best_seconds(contenders, repeats)
    figures = {
        "nvfp4_gelem_per_s": num_elements / seconds["nvfp4"] / 1e9,
        "mxfp8_gelem_per_s": num_elements / seconds["mxfp8"] / 1e9,
        **_error_figures(x),
    }
    if not isinstance(torchao, _Torchao):
        details["torchao"] = torchao
        return BenchResult(
            figures=figures,
            baseline={},
            ok=False,
            target=f"nvfp4_speed_ratio and mxfp8_speed_ratio >= {TARGET_RATIO} (no baseline)",
            details=details,
        )
    figures["nvfp4_speed_ratio"] = seconds["torchao_nvfp4"] / seconds["nvfp4"]
    figures["mxfp8_speed_ratio"] = seconds["torchao_mxfp8"] / seconds["mxfp8"]
    torchao_scale, torchao_data = torchao.mxfp8_rceil()
    ours = quantize_mxfp8(x)
    details["torchao"] = torchao.version
    details["mxfp8_bits_identical_to_torchao"] = bool(
        torch.equal(ours.data.view(torch.uint8), torchao_data.view(torch.uint8))
        and torch.equal(ours.scale.view(torch.uint8), torchao_scale.view(torch.uint8))
    )
    return BenchResult(
        figures=figures,
        baseline={
            "torchao_nvfp4_gelem_per_s": num_elements / seconds["torchao_nvfp4"] / 1e9,
            "torchao_mxfp8_gelem_per_s": num_elements / seconds["torchao_mxfp8"] / 1e9,
        },
        ok=min(figures["nvfp4_speed_ratio"], figures["mxfp8_speed_ratio"]) >= TARGET_RATIO,
        target=f"nvfp4_speed_ratio and mxfp8_speed_ratio (torchao s / ours) >= {TARGET_RATIO}",
        details=details,
    )
