"""Precision-asymmetric MoE expert GEMMs: NVFP4-variant forward, MXFP8 backward.

Modules, by responsibility:
  * ``formats``  — E2M1, E4M3 and E8M0 codecs (round-to-nearest-even, saturating).
  * ``nvfp4``    — the row-scaled NVFP4 variant (per-token FP32 scale), batch-invariant.
  * ``mxfp8``    — MXFP8 with RCEIL (default) or FLOOR E8M0 scales.
  * ``backends`` — the kernel seam: exact emulation anywhere, FP4 tensor cores on sm_100+.
  * ``gemm``     — the expert grouped GEMM and its autograd recipe.
  * ``moe``      — SwiGLU experts, a top-k router and an MoE layer using them.
  * ``config``   — ``PrecisionConfig``.

See docs/precision.md.
"""

from services.trainer.precision.backends import (
    EmulatedBackend,
    KernelBackend,
    select_backend,
)
from services.trainer.precision.config import Precision, PrecisionConfig
from services.trainer.precision.gemm import grouped_gemm
from services.trainer.precision.moe import MoEExperts, MoELayer, TopKRouter
from services.trainer.precision.mxfp8 import MXFP8Tensor, quantize_mxfp8
from services.trainer.precision.nvfp4 import (
    NVFP4Tensor,
    quantize_nvfp4,
    quantize_nvfp4_with_scale,
)

__all__ = [
    "EmulatedBackend",
    "KernelBackend",
    "MXFP8Tensor",
    "MoEExperts",
    "MoELayer",
    "NVFP4Tensor",
    "Precision",
    "PrecisionConfig",
    "TopKRouter",
    "grouped_gemm",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_with_scale",
    "select_backend",
]
