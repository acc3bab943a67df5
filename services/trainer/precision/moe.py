"""MoE expert layer whose GEMMs follow a precision recipe, and a minimal top-k router.

``MoEExperts`` is the reusable part: SwiGLU experts run as two grouped GEMMs over
tokens sorted by expert (gate and up projections fused into one), in the recipe
``precision`` names. ``TopKRouter`` and ``MoELayer`` are the smallest complete MoE
block around it (softmax router, top-k, renormalized weights, sort, combine); the
trainer's model adds router replay and expert parallelism on top.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.precision.config import Precision, PrecisionConfig
from services.trainer.precision.gemm import grouped_gemm
from services.trainer.precision.mxfp8 import MXFP8_BLOCK_SIZE
from services.trainer.precision.rounding import kernel_round


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU experts, ``down(silu(gate(x)) * up(x))``, as grouped GEMMs.

    Weights are kept in float32 (the optimizer's master copy) and cast or quantized per
    GEMM. ``precision`` is a recipe name or a full ``PrecisionConfig``.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        precision: Precision | PrecisionConfig = "bf16",
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if min(num_experts, d_model, d_ff) < 1:
            raise ValueError(
                f"num_experts, d_model and d_ff must be >= 1, got {num_experts}, {d_model}, {d_ff}"
            )
        config = (
            precision
            if isinstance(precision, PrecisionConfig)
            else PrecisionConfig(precision=precision)
        )
        if config.precision == "nvfp4_fwd_mxfp8_bwd" and (
            d_model % MXFP8_BLOCK_SIZE or d_ff % MXFP8_BLOCK_SIZE
        ):
            raise ValueError(
                f"precision {config.precision!r} needs d_model and d_ff divisible by "
                f"{MXFP8_BLOCK_SIZE} (quantization blocks), got d_model={d_model}, d_ff={d_ff}"
            )
        self.config = config
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        # Rows [0, d_ff) of gate_up are the gate projection, [d_ff, 2 d_ff) the up projection.
        self.gate_up = nn.Parameter(
            torch.randn(num_experts, 2 * d_ff, d_model, generator=generator) / math.sqrt(d_model)
        )
        self.down = nn.Parameter(
            torch.randn(num_experts, d_model, d_ff, generator=generator) / math.sqrt(d_ff)
        )

    def forward(
        self,
        tokens_sorted: torch.Tensor,
        group_sizes: torch.Tensor | list[int],
        *,
        fused: bool = False,
    ) -> torch.Tensor:
        """``tokens_sorted [T, d_model]`` grouped by expert (``group_sizes [E]``) -> same shape.

        ``fused``: see ``swiglu_experts``.
        """
        return swiglu_experts(
            tokens_sorted, self.gate_up, self.down, group_sizes, self.config, fused=fused
        )


def swiglu_experts(
    tokens_sorted: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group_sizes: torch.Tensor | list[int],
    config: PrecisionConfig,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` per expert group, in ``tokens_sorted``'s dtype.

    ``fused`` computes as a fused MoE kernel does (bf16 recipe): SwiGLU in float32 on the
    gate/up GEMM's float32 sums, rounded once into the down GEMM, whose float32 output is
    returned unrounded for the router-weighted combine.
    """
    d_ff = down.shape[-1]
    if fused:
        hidden = grouped_gemm(tokens_sorted, gate_up, group_sizes, config, float32_output=True)
        gate, up = hidden.split(d_ff, dim=-1)
        activated = kernel_round(F.silu(gate) * up, tokens_sorted.dtype)
        return grouped_gemm(activated, down, group_sizes, config, float32_output=True)
    hidden = grouped_gemm(tokens_sorted, gate_up, group_sizes, config)
    gate, up = hidden.split(d_ff, dim=-1)
    return grouped_gemm(F.silu(gate) * up, down, group_sizes, config)


class TopKRouter(nn.Module):
    """Softmax router: each token's ``top_k`` experts and their renormalized probabilities."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.top_k = top_k
        self.weight = nn.Parameter(
            torch.randn(num_experts, d_model, generator=generator) / math.sqrt(d_model)
        )

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [T, d_model]`` -> (expert indices ``[T, k]``, weights ``[T, k]``, sum 1)."""
        # The router stays in float32: its scores decide discrete routes.
        probs = torch.softmax(tokens.float() @ self.weight.T, dim=-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        return indices, weights / weights.sum(dim=-1, keepdim=True)


class MoELayer(nn.Module):
    """Router plus experts: route, sort tokens by expert, run the experts, combine."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        top_k: int,
        precision: Precision | PrecisionConfig = "bf16",
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(d_model, num_experts, top_k, generator=generator)
        self.experts = MoEExperts(num_experts, d_model, d_ff, precision, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d_model]`` -> ``[..., d_model]``."""
        tokens = x.reshape(-1, x.shape[-1])
        indices, weights = self.router(tokens)
        top_k = indices.shape[1]
        flat_experts = indices.flatten()
        # A stable sort keeps each expert's tokens in their original order.
        order = torch.argsort(flat_experts, stable=True)
        source_token = order // top_k
        group_sizes = torch.bincount(flat_experts, minlength=self.experts.num_experts)
        expert_out = self.experts(tokens[source_token], group_sizes)
        weighted = expert_out * weights.flatten()[order].unsqueeze(-1).to(expert_out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, source_token, weighted)
        return combined.reshape(x.shape)
