"""MXFP8 for the backward pass: E4M3 elements, one E8M0 power-of-two scale per 32 elements.

Per block of 32 along the last dimension, with ``amax`` the block's largest magnitude:

  * ``"rceil"`` (default; cuBLAS/TransformerEngine): ``scale = 2**ceil(log2(amax / 448))``,
    the smallest power of two with ``amax / scale <= 448``, so elements never saturate.
    ``amax / 448`` is an IEEE round-to-nearest float32 division, and the ceiling is
    taken on that float32 exactly (the rounding-up conversion ``cvt.rp.ue8m0`` of the
    hardware), from its bits rather than from a float32 ``log2``: just above a power of
    two ``2**k`` (|k| large enough), float32 ``log2`` rounds to exactly ``k`` and the
    ceiling then picks the binade below the rule's, clamping the largest element and
    changing every code of the block (torchao 0.18's eager fallback does this).
  * ``"floor"`` (OCP MX v1.0): ``scale = 2**(floor(log2(amax)) - 8)`` (8 = exponent of
    448); values above ``448 * scale`` saturate to ±448.

Elements are ``e4m3_rn(x / scale)``. Dividing by a power of two is exact (unless the
quotient is subnormal, where it is still correctly rounded), and the code multiplies by
the exact reciprocal instead, which gives identical bits. Scale exponents clamp to
E8M0's range [-127, 127]; an all-zero block gets code 0 (2**-127) and zero elements.
NaN/Inf: ``nonfinite="raise"`` raises ValueError; ``"propagate"`` gives the block the
NaN scale (code 255) and NaN elements, as the OCP spec does for a NaN scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.trainer.precision.formats import (
    E4M3_MAX,
    E8M0_NAN,
    FLOAT32_MANTISSA_BITS,
    abs_max,
    e4m3_encode,
    e8m0_from_codes,
    e8m0_reciprocal,
    e8m0_to_float,
)
from services.trainer.precision.nvfp4 import NonFinitePolicy

MXFP8_BLOCK_SIZE = 32
ScaleRule = Literal["rceil", "floor"]
_E4M3_MAX_EXPONENT = 8  # 448 = 1.75 * 2**8
_MANTISSA_MASK = (1 << FLOAT32_MANTISSA_BITS) - 1
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Tensor:
    """An MXFP8 tensor of shape ``[..., K]``, blocks of 32 along K."""

    data: torch.Tensor
    """E4M3 elements, ``float8_e4m3fn`` ``[..., K]``."""
    scale: torch.Tensor
    """E8M0 block scales, ``float8_e8m0fnu`` ``[..., K // 32]``."""

    @property
    def shape(self) -> torch.Size:
        """The logical shape."""
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values ``e4m3 * 2**(code - 127)`` in ``dtype``."""
        values = self.data.to(torch.float32).unflatten(-1, (-1, MXFP8_BLOCK_SIZE))
        return (values * e8m0_to_float(self.scale).unsqueeze(-1)).flatten(-2).to(dtype)

    def __getitem__(self, key: int | slice) -> MXFP8Tensor:
        """Indexes the leading (row or expert) dimension of both parts alike (views)."""
        return MXFP8Tensor(self.data[key], self.scale[key])


def _rceil_codes(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 codes ``ceil(log2(amax / 448))`` (int32), exact for every float32 amax."""
    descale = amax / E4M3_MAX  # IEEE round-to-nearest: its rounding decides the binade
    bits = descale.view(torch.int32)
    exponent_field = bits >> FLOAT32_MANTISSA_BITS  # descale >= 0, so no sign bit
    mantissa = bits & _MANTISSA_MASK
    # Normal descale 2**(e-127) * 1.m: the ceiling adds one unless m == 0. A subnormal
    # descale (field 0) is m * 2**-149: above 2**-127 (m > 2**22) its ceiling is -126
    # (code 1), otherwise -127 or below, which clamps to code 0.
    round_up_above = torch.where(exponent_field == 0, 1 << (FLOAT32_MANTISSA_BITS - 1), 0)
    return exponent_field + (mantissa > round_up_above).to(torch.int32)


def _floor_codes(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 codes ``floor(log2(amax)) - 8`` (int32), clamped at code 0."""
    exponent_field = amax.view(torch.int32) >> FLOAT32_MANTISSA_BITS
    # A subnormal amax has field 0 and a true exponent below -126; both clamp to code 0.
    return (exponent_field - _E4M3_MAX_EXPONENT).clamp(min=0)


def scale_codes(amax: torch.Tensor, scale_rule: ScaleRule = "rceil") -> torch.Tensor:
    """Biased E8M0 codes (int32) of float32 block amaxes; non-finite amax gives 255 (NaN)."""
    if amax.dtype != torch.float32:
        raise TypeError(f"scale_codes takes float32 amax, got {amax.dtype}")
    if scale_rule == "rceil":
        codes = _rceil_codes(amax)
    elif scale_rule == "floor":
        codes = _floor_codes(amax)
    else:
        raise ValueError(f"scale_rule must be 'rceil' or 'floor', got {scale_rule!r}")
    # Finite float32 amax never needs more than code 247; only NaN/Inf reach 255.
    return torch.where(torch.isfinite(amax), codes, E8M0_NAN)


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    scale_rule: ScaleRule = "rceil",
    nonfinite: NonFinitePolicy = "raise",
) -> MXFP8Tensor:
    """Quantizes ``x [..., K]`` to MXFP8 with blocks of 32 along the last dimension."""
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"MXFP8 quantizes float32/bfloat16/float16 tensors, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"MXFP8 needs a last dimension that is a positive multiple of {MXFP8_BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    blocks = x.contiguous().unflatten(-1, (-1, MXFP8_BLOCK_SIZE))
    # The amax of |x| is one of the inputs, so taking it in the input dtype is exact.
    amax = abs_max(blocks).to(torch.float32)
    if nonfinite == "raise":
        num_bad = int((~torch.isfinite(amax)).sum())
        if num_bad:
            raise ValueError(
                f"MXFP8 input has NaN or Inf in {num_bad} block(s); pass nonfinite='propagate' "
                "to carry them as NaN blocks instead"
            )
    codes = scale_codes(amax, scale_rule)
    # Exact power-of-two scaling (see module doc); NaN for code 255 makes NaN elements.
    # bfloat16 has float32's exponent range, so the scaled values are exact in bfloat16
    # as well (a quotient below 2**-126 becomes an E4M3 zero either way) and the float32
    # copy of the tensor is skipped; float16 cannot hold 2**-127..2**127, so it widens.
    work_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    reciprocal = e8m0_reciprocal(codes).to(work_dtype).unsqueeze(-1)
    scaled = blocks.to(work_dtype) * reciprocal
    data = e4m3_encode(scaled.flatten(-2))
    return MXFP8Tensor(data, e8m0_from_codes(codes))
