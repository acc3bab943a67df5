"""Settings of the expert-GEMM precision recipe (pydantic only: importing this is fast)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.config import StrictModel

Precision = Literal["bf16", "nvfp4_fwd_mxfp8_bwd", "fp32"]


class PrecisionConfig(StrictModel):
    """How the MoE expert GEMMs compute: bf16, NVFP4-variant forward / MXFP8 backward, or fp32."""

    precision: Precision = Field(
        "bf16",
        description=(
            "'bf16': bf16 GEMMs. 'nvfp4_fwd_mxfp8_bwd': forward with row-scaled NVFP4 "
            "activations and weights, dgrad and wgrad with MXFP8 operands. 'fp32': float32 "
            "GEMMs (reference runs and parity checks against other implementations)."
        ),
    )
    mxfp8_scale_rule: Literal["rceil", "floor"] = Field(
        "rceil",
        description="E8M0 scale rule of the backward: 'rceil' (cuBLAS, never saturates) or "
        "'floor' (OCP MX v1.0).",
    )
    nonfinite: Literal["raise", "propagate"] = Field(
        "raise",
        description="NaN/Inf in a GEMM operand: 'raise' ValueError, or 'propagate' it as NaN.",
    )
    backend: Literal["auto", "emulated", "blackwell"] = Field(
        "auto",
        description="Kernel backend: 'auto' picks by device capability; 'emulated' runs anywhere.",
    )
