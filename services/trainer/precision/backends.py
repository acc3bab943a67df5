"""Kernel backends: where the quantized GEMMs run, chosen by what the device can do.

A backend quantizes (NVFP4 variant, MXFP8) and multiplies two quantized operands that
are both blocked along their shared last dimension, ``a [M, R] @ b [N, R].T``:

  * ``EmulatedBackend`` (CPU, and CUDA without FP4/MX tensor cores): the exact torch
    quantizers, then dequantize and an FP32 matmul. Quantization is bit-exact against
    the specs; the GEMM is an ordinary FP32 GEMM of the exactly represented values.
  * ``BlackwellBackend`` (CUDA capability >= 10.0): the same torch quantizers (on
    CUDA too they use only IEEE division, exact bit operations and torch's casts; no
    GPU was at hand to compare their bits with the CPU's) and ``F.scaled_mm`` with
    block-scaled FP4/FP8 operands on the tensor cores. The FP32 row scales of the NVFP4
    variant are not a hardware scaling mode, but they factor out of every dot product
    (``sum_k a_mk b_nk = s_m s_n sum_k a'_mk b'_nk``), so they are applied to the FP32
    output as an outer product. No sm_100 machine was available when this was
    written, so ``select_backend`` trusts it only after it agrees with the emulation
    on a probe GEMM, and otherwise falls back to the emulation with a warning.

Every backend divides with IEEE round-to-nearest: the quantizers use torch's ``/``,
which is correctly rounded on CPU (tested against float64) and on CUDA (PyTorch's
kernels are built without fast-math);
a fused kernel that plugs in here must use ``div.rn.f32``, not ``div.approx``/``rcp``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from services.trainer.precision.mxfp8 import MXFP8Tensor, ScaleRule, quantize_mxfp8
from services.trainer.precision.nvfp4 import NonFinitePolicy, NVFP4Tensor, quantize_nvfp4

BackendName = Literal["auto", "emulated", "blackwell"]
Bounds = tuple[tuple[int, int], ...]
"""``(start, end)`` row ranges of each expert's tokens, in expert order."""

log = logging.getLogger(__name__)


_per_expert_loop = False


@contextlib.contextmanager
def per_expert_loop() -> Iterator[None]:
    """Within the block, expert GEMMs run as one matmul per expert even where
    ``F.grouped_mm`` runs (the same bits on CPU): the baseline ``etude bench trainer``
    measures the grouped GEMM against."""
    global _per_expert_loop
    previous, _per_expert_loop = _per_expert_loop, True
    try:
        yield
    finally:
        _per_expert_loop = previous


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, num_in: int, num_out: int) -> bool:
    """Whether ``F.grouped_mm`` runs these operands: on CPU any float dtype (torch 2.13);
    on CUDA bf16 on sm_80+ with 16-byte-aligned rows, as its kernels require."""
    if _per_expert_loop:
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16 or num_in % 8 or num_out % 8:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _log_path(device_type: str, dtype: torch.dtype, grouped: bool) -> None:
    """Says once per device and dtype which expert GEMM runs."""
    path = "torch grouped_mm (one call)" if grouped else "a matmul per expert"
    log.info("expert GEMMs on %s in %s: %s", device_type, dtype, path)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for each expert ``e``: ``x [T, K]``, ``weight [E, N, K]``.

    One ``F.grouped_mm`` call where the device runs it (on CPU its result and gradients
    equal each expert's own matmul bit for bit, tested), else one matmul per expert.
    Autograd flows through either.
    """
    grouped = grouped_mm_runs(x.device, x.dtype, x.shape[1], weight.shape[1])
    _log_path(x.device.type, x.dtype, grouped)
    if grouped:
        ends = torch.tensor([end for _, end in bounds], dtype=torch.int32, device=x.device)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    # ``split`` and ``unbind``, not a slice per expert: a slice's backward zero-fills a
    # tensor the size of the whole input (or of every expert's weights) for each expert.
    sizes = [end - start for start, end in bounds]
    return torch.cat([rows @ w.T for rows, w in zip(x.split(sizes), weight.unbind(0), strict=True)])


class KernelBackend(ABC):
    """Quantizers and block-scaled GEMMs for one kind of device."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""

    def quantize_nvfp4(self, x: torch.Tensor, nonfinite: NonFinitePolicy) -> NVFP4Tensor:
        """Row-scaled NVFP4 of ``x``; a fused kernel must give the same bits."""
        return quantize_nvfp4(x, nonfinite=nonfinite)

    def quantize_mxfp8(
        self, x: torch.Tensor, scale_rule: ScaleRule, nonfinite: NonFinitePolicy
    ) -> MXFP8Tensor:
        """MXFP8 of ``x`` (blocks along the last dim); a fused kernel must give the same bits."""
        return quantize_mxfp8(x, scale_rule=scale_rule, nonfinite=nonfinite)

    @abstractmethod
    def nvfp4_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
        """``a [M, R] @ b [N, R].T`` in float32."""

    @abstractmethod
    def mxfp8_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor) -> torch.Tensor:
        """``a [M, R] @ b [N, R].T`` in float32."""

    def nvfp4_grouped_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor, bounds: Bounds) -> torch.Tensor:
        """``a [T, R]`` (rows grouped by ``bounds``) times ``b [E, N, R]`` per group, float32."""
        return torch.cat(
            [
                self.nvfp4_matmul(a[start:end], b[expert])
                for expert, (start, end) in enumerate(bounds)
            ]
        )

    def mxfp8_grouped_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, bounds: Bounds) -> torch.Tensor:
        """``a [T, R]`` (rows grouped by ``bounds``) times ``b [E, N, R]`` per group, float32."""
        return torch.cat(
            [
                self.mxfp8_matmul(a[start:end], b[expert])
                for expert, (start, end) in enumerate(bounds)
            ]
        )


class EmulatedBackend(KernelBackend):
    """Exact quantize-dequantize, then an FP32 GEMM; runs on any device."""

    name = "emulated"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """Always: the emulation is plain torch ops."""
        return True

    def nvfp4_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
        """FP32 GEMM of the dequantized operands."""
        return a.dequantize() @ b.dequantize().T

    def mxfp8_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor) -> torch.Tensor:
        """FP32 GEMM of the dequantized operands."""
        return a.dequantize() @ b.dequantize().T

    def nvfp4_grouped_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor, bounds: Bounds) -> torch.Tensor:
        """One FP32 grouped GEMM of the dequantized operands."""
        return grouped_matmul(a.dequantize(), b.dequantize(), bounds)

    def mxfp8_grouped_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, bounds: Bounds) -> torch.Tensor:
        """One FP32 grouped GEMM of the dequantized operands."""
        return grouped_matmul(a.dequantize(), b.dequantize(), bounds)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales ``[rows, cols]`` in cuBLAS's 32x4x4 tiled layout, flattened.

    Pads to multiples of 128 rows and 4 columns (zeros), then stores each
    128x4 tile as 32 rows of 16 (row r of the tile goes to row r % 32, column
    group r // 32); see the "block scaling factors layout" of the cuBLAS docs.
    """
    if scale.dim() != 2:
        raise ValueError(f"swizzle_scales takes a 2-D scale matrix, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = scale.view(torch.uint8)
    padded = torch.zeros((padded_rows, padded_cols), dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = raw
    tiles = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return swizzled.flatten().view(scale.dtype)


class BlackwellBackend(KernelBackend):
    """FP4/FP8 block-scaled tensor-core GEMMs through ``F.scaled_mm`` (sm_100 and later)."""

    name = "blackwell"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """CUDA devices of compute capability 10.0 or newer (FP4/MX tensor cores)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        return major >= 10

    def nvfp4_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
        """Block-scaled FP4 GEMM, then the FP32 row scales as an outer product."""
        out = F.scaled_mm(
            a.data,
            b.data.T,
            scale_a=swizzle_scales(a.block_scale),
            scale_recipe_a=F.ScalingType.BlockWise1x16,
            scale_b=swizzle_scales(b.block_scale),
            scale_recipe_b=F.ScalingType.BlockWise1x16,
            swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
            swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
            output_dtype=torch.float32,
        )
        return out * a.row_scale * b.row_scale.T

    def mxfp8_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor) -> torch.Tensor:
        """Block-scaled FP8 GEMM with E8M0 scales."""
        return F.scaled_mm(
            a.data,
            b.data.T,
            scale_a=swizzle_scales(a.scale),
            scale_recipe_a=F.ScalingType.BlockWise1x32,
            scale_b=swizzle_scales(b.scale),
            scale_recipe_b=F.ScalingType.BlockWise1x32,
            swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
            swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
            output_dtype=torch.float32,
        )


BACKENDS: dict[str, type[KernelBackend]] = {
    EmulatedBackend.name: EmulatedBackend,
    BlackwellBackend.name: BlackwellBackend,
}


def agrees_with_emulation(backend: KernelBackend, device: torch.device) -> bool:
    """Whether ``backend``'s GEMMs match the emulation on a probe (relative error <= 1e-3).

    The quantized operands are identical, so only FP32 accumulation order may differ.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(256, 128, device=device, generator=generator)
    b = torch.randn(128, 128, device=device, generator=generator)
    reference = EmulatedBackend()
    try:
        pairs = [
            (
                backend.nvfp4_matmul(quantize_nvfp4(a), quantize_nvfp4(b)),
                reference.nvfp4_matmul(quantize_nvfp4(a), quantize_nvfp4(b)),
            ),
            (
                backend.mxfp8_matmul(quantize_mxfp8(a), quantize_mxfp8(b)),
                reference.mxfp8_matmul(quantize_mxfp8(a), quantize_mxfp8(b)),
            ),
        ]
    except (RuntimeError, TypeError, ValueError) as error:  # a kernel this torch lacks
        warnings.warn(f"{backend.name} backend failed its probe: {error}", stacklevel=2)
        return False
    return all(
        bool(((got - want).abs().max() <= 1e-3 * want.abs().max()).item()) for got, want in pairs
    )


@functools.cache
def _auto_backend(device: torch.device) -> KernelBackend:
    """The recipe's backend for ``device``, chosen once by capability (and said once)."""
    backend: KernelBackend = EmulatedBackend()
    if BlackwellBackend.supports(device):
        candidate = BlackwellBackend()
        if agrees_with_emulation(candidate, device):
            backend = candidate
        else:
            warnings.warn(
                f"{device} has FP4 tensor cores but the blackwell backend disagrees with the "
                "exact emulation; using the emulation",
                stacklevel=2,
            )
    log.info("precision recipe on %s: the %s backend", device, backend.name)
    return backend


def select_backend(device: torch.device, name: BackendName = "auto") -> KernelBackend:
    """The backend named ``name`` for ``device``; ``"auto"`` picks by capability."""
    if name == "auto":
        return _auto_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: auto, {', '.join(sorted(BACKENDS))}")
    backend_class = BACKENDS[name]
    if not backend_class.supports(device):
        raise ValueError(
            f"backend {name!r} cannot run on {device}; 'blackwell' needs a CUDA device of "
            "compute capability >= 10.0, 'emulated' runs anywhere"
        )
    return backend_class()
