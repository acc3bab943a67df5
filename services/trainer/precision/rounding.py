"""How a fused kernel stores its float32 result in bf16, as the inference kernels do on
the device the tensor is on.

vLLM's CPU kernels convert float32 to bf16 by round-to-nearest-even on a CPU with
AVX-512 (measured on AVX-512 BF16 Xeons and EPYCs), and by truncation, dropping the low
16 bits, on an AVX2 CPU, which has no bf16 conversion instruction: measured bit for bit
against vLLM's rotary and fused-MoE kernels on a 2-core AVX2 EPYC
(tests/test_trainer_numerics.py), and end to end for its attention kernel
(tests/test_trainer_bench.py). Its RMSNorm, a scalar op, rounds to nearest there too.
CUDA kernels round to nearest even. ``numerics = "fused"`` stores each fused operation's
output with ``kernel_round``, so the trainer rounds where, and how, the engine it
replays does.
"""

from __future__ import annotations

import torch

CPU_TRUNCATES_BF16 = torch.backends.cpu.get_cpu_capability() == "AVX2"
"""vLLM's CPU kernels on this CPU store bf16 by truncation (AVX2), not to nearest even."""

_HIGH_HALF = -65536  # 0xFFFF0000 as an int32: the bits a bf16 keeps of a float32


class _TruncateToBfloat16(torch.autograd.Function):
    """float32 -> bf16 keeping the high 16 bits; the gradient passes as a cast's does."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        high = x.contiguous().view(torch.int32) & _HIGH_HALF
        return high.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.float()


def truncate_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """A float32 tensor in bf16 by truncation (toward zero in magnitude)."""
    if x.dtype != torch.float32:
        raise ValueError(f"truncation to bf16 takes float32, not {x.dtype}")
    result: torch.Tensor = _TruncateToBfloat16.apply(x)
    return result


def kernel_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fused kernel's float32 result ``x`` stored in ``dtype``: by truncation for bf16
    on a CPU whose vLLM kernels truncate, else by ``Tensor.to`` (nearest even)."""
    if (
        CPU_TRUNCATES_BF16
        and dtype == torch.bfloat16
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        return truncate_to_bfloat16(x)
    return x.to(dtype)
