"""The trainer's CUDA paths against their CPU references: grouped-GEMM experts, varlen
attention over packed sequences and prefix trees, and the precision recipe on the device.

They need a CUDA device and are skipped without one (`make test` never needs a GPU);
`tools/gpu_check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.model.layers import causal_attention, varlen_runs
from services.trainer.precision import PrecisionConfig, grouped_gemm, select_backend
from services.trainer.precision.backends import BlackwellBackend, grouped_mm_runs
from services.trainer.precision.nvfp4 import quantize_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("precision", ["bf16", "nvfp4_fwd_mxfp8_bwd"])
def test_grouped_gemm_experts_on_the_device_match_the_cpu(precision: str) -> None:
    generator = torch.Generator().manual_seed(0)
    sizes = [96, 0, 160, 32, 224, 0, 64, 128]  # uneven, idle experts
    x = torch.randn(sum(sizes), 256, generator=generator)
    weight = torch.randn(len(sizes), 512, 256, generator=generator) / 16
    grad = torch.randn(sum(sizes), 512, generator=generator)
    config = PrecisionConfig.model_validate({"precision": precision})
    results = []
    for device in ("cpu", "cuda"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x_d = x.to(device, dtype).requires_grad_()
        w_d = weight.to(device).requires_grad_()
        out = grouped_gemm(x_d, w_d, sizes, config)
        out.backward(grad.to(device, out.dtype))
        assert x_d.grad is not None and w_d.grad is not None
        results.append((out.detach(), x_d.grad, w_d.grad))
    if precision == "bf16":
        assert grouped_mm_runs(CUDA, torch.bfloat16, 256, 512) == (
            torch.cuda.get_device_capability() >= (8, 0)
        )
    for want, got in zip(*results, strict=True):
        assert _relative_error(got, want) < 1e-2


def test_the_recipe_quantizes_to_the_same_bits_on_the_device() -> None:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 10
    on_cpu, on_cuda = quantize_nvfp4(x), quantize_nvfp4(x.to(CUDA))
    assert torch.equal(on_cpu.codes(), on_cuda.codes().cpu())
    assert torch.equal(
        on_cpu.block_scale.view(torch.uint8), on_cuda.block_scale.cpu().view(torch.uint8)
    )
    assert torch.equal(on_cpu.row_scale, on_cuda.row_scale.cpu())
    backend = select_backend(CUDA)
    assert isinstance(backend, BlackwellBackend) == BlackwellBackend.supports(CUDA)


@pytest.mark.parametrize("tree", [False, True])
def test_varlen_attention_matches_one_sdpa_per_sequence(tree: bool) -> None:
    """One flash-attention call over the pack (and over a prefix tree: runs see their
    ancestors' keys, then causally their own) equals the CPU's per-sequence SDPA."""
    assert varlen_runs(CUDA, torch.bfloat16) and not varlen_runs(CUDA, torch.float32)
    generator = torch.Generator().manual_seed(2)
    lengths = [37, 64, 5, 130]
    ancestors = [[], [0], [0], [0, 1]] if tree else None
    cu_seqlens = [0]
    for length in lengths:
        cu_seqlens.append(cu_seqlens[-1] + length)
    total = cu_seqlens[-1]
    q, k, v = (torch.randn(total, heads, 64, generator=generator) for heads in (8, 2, 2))
    grad = torch.randn(total, 8, 64, generator=generator)
    results = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        q_d, k_d, v_d = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
        out = causal_attention(q_d, k_d, v_d, cu_seqlens, ancestors)
        out.backward(grad.to(device, dtype))
        assert q_d.grad is not None and k_d.grad is not None and v_d.grad is not None
        results.append((out.detach(), q_d.grad, k_d.grad, v_d.grad))
    for want, got in zip(*results, strict=True):
        assert _relative_error(got, want) < 2e-2
    cpu_out, cuda_out = results[0][0], results[1][0].float().cpu()
    assert F.cosine_similarity(cpu_out.flatten(), cuda_out.flatten(), dim=0) > 0.999
