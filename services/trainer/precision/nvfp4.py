"""The forward's NVFP4 variant: E2M1 elements, E4M3 per-16 scales, FP32 per-row scales.

Standard NVFP4 multiplies the E4M3 block scales by one FP32 scale per *tensor*
(``amax_tensor / (6 * 448)``). That makes every token's codes depend on the largest
value anywhere in the batch: the same token quantizes differently in a different
batch (batch variance), and a future token can change how a past token is quantized.
The report saw RL diverge with it. This variant keeps the two-level structure but
takes the FP32 scale per row (per token for activations, per output channel for
weights), so a row's bits depend on that row alone:

    s_row       = amax_row / (6 * 448)                              FP32
    block_scale = e4m3_rn(amax_block / (6 * s_row))                 E4M3, per 16
    element     = e2m1_rn(x / (block_scale * s_row))                E2M1
    value       = e2m1 * (block_scale * s_row)

Each ``/`` is an IEEE round-to-nearest float32 division (torch's ``/`` on CPU and on
CUDA, which PyTorch builds without fast-math). Why it matters: the E4M3 and E2M1
roundings that follow are discontinuous, so a quotient that is off by an ulp flips
every value sitting on or next to a rounding boundary, and on real data exact ties are
common (bf16 inputs have 8 significant bits; values already on a low-precision grid
divide into exact midpoints). An approximate reciprocal (``x * (1 / d)``, or a
hardware ``rcp.approx``) therefore changes codes, and makes training and inference
kernels disagree; the report saw RL diverge after ~100 steps with a fast divide.

Special rows, each chosen on purpose:
  * all-zero rows and blocks: zero scales and zero codes (never 0/0 = NaN);
  * denormal-only rows (``amax_row < 2**-126``): quantized to zeros with ``s_row = 0``;
    their values are below float32's (and bf16's) normal range, where the scale chain
    itself would run in subnormal arithmetic with a handful of significant bits;
  * blocks whose E4M3 scale rounds to zero (``amax_block`` below ~2**-19 of the row's
    amax): their elements become signed zeros, as their dequantized value is 0 anyway;
  * NaN/Inf: ``nonfinite="raise"`` raises ValueError; ``"propagate"`` sets the row's
    scale (and its block scales) to NaN so the whole row dequantizes to NaN. E2M1 has
    no NaN code, so the row scale is where the NaN lives; the codes of such a row are
    unspecified. Other rows are unaffected either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.trainer.precision.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FLOAT32_MIN_NORMAL,
    abs_max,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    pack_e2m1,
    unpack_e2m1,
)

NVFP4_BLOCK_SIZE = 16
NonFinitePolicy = Literal["raise", "propagate"]
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A row-scaled NVFP4 tensor of logical shape ``[..., K]``, blocks of 16 along K."""

    data: torch.Tensor
    """Packed E2M1 codes, ``float4_e2m1fn_x2`` ``[..., K // 2]``."""
    block_scale: torch.Tensor
    """E4M3 block scales, ``float8_e4m3fn`` ``[..., K // 16]``."""
    row_scale: torch.Tensor
    """FP32 row scales, ``float32`` ``[..., 1]``."""

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def codes(self) -> torch.Tensor:
        """The E2M1 codes as uint8 ``[..., K]`` (bit 3 is the sign)."""
        return unpack_e2m1(self.data)

    def scale_product(self) -> torch.Tensor:
        """``block_scale * row_scale`` in float32 ``[..., K // 16]``: the divisor of quantize."""
        return self.block_scale.to(torch.float32) * self.row_scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values, ``e2m1 * (block_scale * row_scale)``, in ``dtype``."""
        values = e2m1_decode(self.codes()).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
        return (values * self.scale_product().unsqueeze(-1)).flatten(-2).to(dtype)

    def __getitem__(self, key: int | slice) -> NVFP4Tensor:
        """Indexes the leading (row or expert) dimension of all parts alike (views)."""
        return NVFP4Tensor(self.data[key], self.block_scale[key], self.row_scale[key])


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"NVFP4 quantizes float32/bfloat16/float16 tensors, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 needs a last dimension that is a positive multiple of {NVFP4_BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )


def _block_amax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as blocks ``[..., K // 16, 16]`` and each block's amax in float32 (NaN if any NaN)."""
    blocks = x.contiguous().unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    # The amax in the input dtype is exact (it is one of the inputs); widening it is too.
    return blocks, abs_max(blocks).to(torch.float32)


def row_scale_of(amax_row: torch.Tensor) -> torch.Tensor:
    """The FP32 row scale ``amax_row / (6 * 448)``, with the special rows of the module doc.

    ``6 * 448 = 2688`` is exact in float32, so this is one correctly rounded division.
    """
    row_scale = amax_row / (E2M1_MAX * E4M3_MAX)
    row_scale = torch.where(amax_row >= FLOAT32_MIN_NORMAL, row_scale, 0.0)
    return torch.where(torch.isfinite(amax_row), row_scale, torch.nan)


def _encode_blocks(
    blocks: torch.Tensor, amax_block: torch.Tensor, row_scale: torch.Tensor
) -> NVFP4Tensor:
    """Block scales and elements given the FP32 outer scale (``[..., 1]``, broadcastable)."""
    six_row_scale = E2M1_MAX * row_scale  # float32 product, rounded once
    # A zero row scale (zero or denormal-only row) must give zero block scales, not 0/0.
    ratio = amax_block / torch.where(six_row_scale == 0, torch.inf, six_row_scale)
    # ratio can exceed 448 by a rounding or two; the E4M3 cast saturates it.
    block_scale = e4m3_encode(ratio)
    divisor = block_scale.to(torch.float32) * row_scale  # the spec's block_scale * s_row
    # Zero divisors (zero blocks, block scales below E4M3's range) make signed zeros.
    divisor = torch.where(divisor == 0, torch.inf, divisor)
    # IEEE round-to-nearest division, in place on one float32 copy of the input.
    scaled = blocks.to(torch.float32, copy=True).div_(divisor.unsqueeze(-1))
    codes = e2m1_encode(scaled.flatten(-2))
    row_scale = torch.broadcast_to(row_scale, (*amax_block.shape[:-1], 1)).contiguous()
    return NVFP4Tensor(pack_e2m1(codes), block_scale, row_scale)


def _check_finite(amax_row: torch.Tensor, nonfinite: NonFinitePolicy) -> None:
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    if nonfinite == "raise":
        num_bad = int((~torch.isfinite(amax_row)).sum())
        if num_bad:
            raise ValueError(
                f"NVFP4 input has NaN or Inf in {num_bad} row(s); pass nonfinite='propagate' "
                "to carry them as NaN rows instead"
            )


def quantize_nvfp4(x: torch.Tensor, *, nonfinite: NonFinitePolicy = "raise") -> NVFP4Tensor:
    """Quantizes ``x [..., K]`` to the row-scaled NVFP4 variant (one FP32 scale per row).

    Each row's codes and scales are a function of that row alone, so the result is
    identical whether the row is quantized alone or inside any batch.
    """
    _check_input(x)
    blocks, amax_block = _block_amax(x)
    amax_row = amax_block.amax(dim=-1, keepdim=True)
    _check_finite(amax_row, nonfinite)
    return _encode_blocks(blocks, amax_block, row_scale_of(amax_row))


def quantize_nvfp4_with_scale(
    x: torch.Tensor, outer_scale: torch.Tensor, *, nonfinite: NonFinitePolicy = "raise"
) -> NVFP4Tensor:
    """Quantizes with a given FP32 outer scale, broadcastable to ``[..., 1]``.

    With ``outer_scale = amax(x) / (6 * 448)`` (a scalar) this is standard per-tensor
    NVFP4, which is batch-variant; it exists to measure what the per-row variant buys,
    not for training.
    """
    _check_input(x)
    if outer_scale.dtype != torch.float32:
        raise TypeError(f"outer_scale must be float32, got {outer_scale.dtype}")
    rows_shape = (*x.shape[:-1], 1)
    try:
        torch.broadcast_shapes(outer_scale.shape, rows_shape)
    except RuntimeError as error:
        raise ValueError(
            f"outer_scale of shape {tuple(outer_scale.shape)} does not broadcast to {rows_shape}"
        ) from error
    blocks, amax_block = _block_amax(x)
    amax_row = amax_block.amax(dim=-1, keepdim=True)
    _check_finite(amax_row, nonfinite)
    outer_scale = torch.where(torch.isfinite(amax_row), outer_scale, torch.nan)
    return _encode_blocks(blocks, amax_block, outer_scale)
