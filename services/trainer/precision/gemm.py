"""The expert grouped GEMM, ``y[g] = x[g] @ weight[e].T`` for the tokens ``g`` of each expert.

Tokens arrive sorted by expert (``group_sizes[e]`` consecutive rows each). The recipes:

  * ``"bf16"``: bf16 GEMMs, ordinary autograd (``"fp32"``: the same in float32). With
    ``float32_output`` the bf16 operands' products are summed and returned in float32,
    unrounded, as a fused kernel's accumulator is (computed as a float32 GEMM of the
    bf16-rounded operands: products of bf16 numbers are exact in float32).
  * ``"nvfp4_fwd_mxfp8_bwd"`` (the report's asymmetric recipe):
      forward  ``y  = Q4(x) @ Q4(W).T``                    reduction over K
      dgrad    ``dx = Q8(dy) @ Q8(W.T).T``                  reduction over N
      wgrad    ``dW = Q8(dy.T) @ Q8(x.T).T``                reduction over the group's tokens
    where ``Q4`` is the row-scaled NVFP4 variant and ``Q8`` is MXFP8, each blocked along
    the reduction dimension of its GEMM (hardware block-scaled GEMMs need that). The
    backward quantizes the saved high-precision ``x`` and ``W``, not their FP4 copies.

``Q4(x)`` is per token, so a token's forward bits depend neither on the batch nor on
how tokens are grouped. The wgrad operands are blocked along tokens; each group is
zero-padded to a multiple of 32 tokens (zeros change neither the block amax nor the sum).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from services.trainer.precision.backends import (
    Bounds,
    KernelBackend,
    grouped_matmul,
    select_backend,
)
from services.trainer.precision.config import PrecisionConfig
from services.trainer.precision.mxfp8 import MXFP8_BLOCK_SIZE, MXFP8Tensor
from services.trainer.precision.nvfp4 import NVFP4_BLOCK_SIZE


def group_bounds(
    group_sizes: Sequence[int] | torch.Tensor, num_rows: int, num_groups: int
) -> Bounds:
    """``(start, end)`` row ranges of each group, checked against the tensors' shapes."""
    raw = group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else list(group_sizes)
    sizes = [int(size) for size in raw]
    if len(sizes) != num_groups or any(size < 0 for size in sizes) or sum(sizes) != num_rows:
        raise ValueError(
            f"group_sizes must be {num_groups} non-negative counts summing to the {num_rows} "
            f"rows of x, got {sizes}"
        )
    ends = list(itertools.accumulate(sizes))
    return tuple((end - size, end) for size, end in zip(sizes, ends, strict=True))


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pads the last dimension up to a positive multiple of ``multiple``."""
    length = x.shape[-1]
    padded = max(multiple, -(-length // multiple) * multiple)
    return F.pad(x, (0, padded - length)) if padded != length else x


class _NVFP4ForwardMXFP8Backward(torch.autograd.Function):
    """Grouped GEMM with an NVFP4-variant forward and an MXFP8 backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bounds: Bounds,
        backend: KernelBackend,
        config: PrecisionConfig,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bounds, ctx.backend, ctx.config = bounds, backend, config
        x_q = backend.quantize_nvfp4(x, config.nonfinite)
        weight_q = backend.quantize_nvfp4(weight, config.nonfinite)  # per output channel
        return backend.nvfp4_grouped_matmul(x_q, weight_q, bounds).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        bounds: Bounds = ctx.bounds
        backend: KernelBackend = ctx.backend
        config: PrecisionConfig = ctx.config

        def q8(tensor: torch.Tensor) -> MXFP8Tensor:
            return backend.quantize_mxfp8(tensor, config.mxfp8_scale_rule, config.nonfinite)

        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_out_q = q8(grad_out)  # blocks along N, per token
            weight_t_q = q8(weight.transpose(1, 2))  # [E, K, N], blocks along N
            grad_x = backend.mxfp8_grouped_matmul(grad_out_q, weight_t_q, bounds).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grads = []
            for start, end in bounds:
                if end == start:  # an expert with no tokens gets no gradient
                    grads.append(weight.new_zeros(weight.shape[1:], dtype=torch.float32))
                    continue
                grad_out_t = q8(_pad_last(grad_out[start:end].T, MXFP8_BLOCK_SIZE))
                x_t = q8(_pad_last(x[start:end].T, MXFP8_BLOCK_SIZE))
                grads.append(backend.mxfp8_matmul(grad_out_t, x_t))
            grad_weight = torch.stack(grads).to(weight.dtype)
        return grad_x, grad_weight, None, None, None


def _plain_grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bounds: Bounds,
    dtype: torch.dtype,
    accumulate: torch.dtype | None = None,
) -> torch.Tensor:
    """Operands rounded to ``dtype``; the GEMM in ``accumulate`` (default ``dtype``)."""
    accumulate = accumulate or dtype
    out = grouped_matmul(x.to(dtype).to(accumulate), weight.to(dtype).to(accumulate), bounds)
    return out if accumulate != dtype else out.to(x.dtype)


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    config: PrecisionConfig | None = None,
    backend: KernelBackend | None = None,
    *,
    float32_output: bool = False,
) -> torch.Tensor:
    """``x [T, K]`` (tokens sorted by expert) times ``weight [E, N, K]`` per group -> ``[T, N]``.

    ``backend`` defaults to the one ``config.backend`` selects for ``x``'s device.
    ``float32_output`` (recipes ``"bf16"`` and ``"fp32"``) returns the unrounded float32 sums.
    """
    config = config or PrecisionConfig()
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped_gemm needs x [T, K] and weight [E, N, K], got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    bounds = group_bounds(group_sizes, x.shape[0], weight.shape[0])
    if float32_output and config.precision not in ("bf16", "fp32"):
        raise ValueError(f"float32_output needs the bf16 or fp32 recipe, not {config.precision!r}")
    if config.precision == "bf16":
        accumulate = torch.float32 if float32_output else None
        return _plain_grouped_gemm(x, weight, bounds, torch.bfloat16, accumulate)
    if config.precision == "fp32":
        return _plain_grouped_gemm(x, weight, bounds, torch.float32)
    num_out, num_in = weight.shape[1], weight.shape[2]
    if num_in % NVFP4_BLOCK_SIZE or num_out % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"{config.precision} needs K % {NVFP4_BLOCK_SIZE} == 0 (forward blocks) and "
            f"N % {MXFP8_BLOCK_SIZE} == 0 (dgrad blocks), got weight [E, N, K] = "
            f"{tuple(weight.shape)}"
        )
    backend = backend or select_backend(x.device, config.backend)
    output: torch.Tensor = _NVFP4ForwardMXFP8Backward.apply(x, weight, bounds, backend, config)
    return output
