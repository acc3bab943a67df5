"""The expert grouped GEMM: the recipe's operands and blocking, accuracy against bf16,
per-token independence, the MoE layer's precision switch and the kernel-backend seam."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.trainer.precision import (
    EmulatedBackend,
    MoEExperts,
    MoELayer,
    PrecisionConfig,
    grouped_gemm,
    select_backend,
)
from services.trainer.precision.backends import (
    BlackwellBackend,
    agrees_with_emulation,
    grouped_mm_runs,
    swizzle_scales,
)
from services.trainer.precision.mxfp8 import MXFP8Tensor, quantize_mxfp8
from services.trainer.precision.nvfp4 import NVFP4Tensor, quantize_nvfp4
from tests.test_precision_reference import (
    E2M1_TABLE,
    E4M3_TABLE,
    f32,
    mxfp8_reference,
    nvfp4_reference,
)

RECIPE = PrecisionConfig(precision="nvfp4_fwd_mxfp8_bwd")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _run(
    x: torch.Tensor,
    weight: torch.Tensor,
    sizes: list[int],
    grad: torch.Tensor,
    config: PrecisionConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    out = grouped_gemm(x, weight, sizes, config)
    out.backward(grad)
    assert x.grad is not None and weight.grad is not None
    return out.detach(), x.grad, weight.grad


@pytest.mark.parametrize("activations", ["gaussian", "per_token_magnitudes"])
def test_forward_and_both_gradients_track_bf16_on_realistic_shapes(activations: str) -> None:
    generator = torch.Generator().manual_seed(0)
    num_tokens, d_in, d_out = 2048, 512, 1024
    sizes = [300, 0, 517, 211, 420, 96, 333, 171]  # uneven, one expert idle
    x = torch.randn(num_tokens, d_in, generator=generator)
    if activations == "per_token_magnitudes":
        x = x * torch.exp(torch.randn(num_tokens, 1, generator=generator))
    weight = torch.randn(len(sizes), d_out, d_in, generator=generator) / d_in**0.5
    grad = torch.randn(num_tokens, d_out, generator=generator)
    reference = _run(x, weight, sizes, grad, PrecisionConfig(precision="bf16"))
    quantized = _run(x, weight, sizes, grad, RECIPE)
    for name, want, got in zip(("output", "dgrad", "wgrad"), reference, quantized, strict=True):
        assert _cosine(want, got) >= 0.99, name
    assert torch.equal(quantized[2][1], torch.zeros(d_out, d_in))  # the idle expert


def _nvfp4_values(x: np.ndarray) -> np.ndarray:
    codes, block_codes, row_scale = nvfp4_reference(x)
    magnitudes = E2M1_TABLE[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    scale = f32(E4M3_TABLE[block_codes] * row_scale.astype(np.float64))
    return (magnitudes.reshape(*scale.shape, 16) * scale[..., None]).reshape(x.shape)


def _mxfp8_values(x: np.ndarray) -> np.ndarray:
    codes, scale_codes = mxfp8_reference(x, "rceil")
    magnitude = E4M3_TABLE[codes & 0x7F] * np.where(codes & 0x80, -1.0, 1.0)
    scale = np.exp2(scale_codes.astype(np.float64) - 127)
    return (magnitude.reshape(*scale.shape, 32) * scale[..., None]).reshape(x.shape)


def _pad_tokens(x: np.ndarray) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, -x.shape[1] % 32 or 0)))


def test_operands_are_quantized_along_each_gemms_reduction_dimension() -> None:
    # An independent float64 computation of the recipe: if any operand were blocked
    # along the wrong dimension, or the backward used the FP4 copies, this would differ.
    generator = torch.Generator().manual_seed(1)
    sizes = [40, 0, 57]
    x = torch.randn(97, 64, generator=generator)
    weight = torch.randn(3, 96, 64, generator=generator) / 8
    grad = torch.randn(97, 96, generator=generator)
    out, grad_x, grad_weight = _run(x, weight, sizes, grad, RECIPE)
    x64, w64, g64 = x.numpy(), weight.numpy(), grad.numpy()
    bounds = [(0, 40), (40, 40), (40, 97)]
    want_out = np.concatenate(
        [_nvfp4_values(x64[s:e]) @ _nvfp4_values(w64[i]).T for i, (s, e) in enumerate(bounds)]
    )
    want_grad_x = np.concatenate(
        [_mxfp8_values(g64[s:e]) @ _mxfp8_values(w64[i].T).T for i, (s, e) in enumerate(bounds)]
    )
    want_grad_w = np.stack(
        [
            _mxfp8_values(_pad_tokens(g64[s:e].T)) @ _mxfp8_values(_pad_tokens(x64[s:e].T)).T
            if e > s
            else np.zeros((96, 64))
            for s, e in bounds
        ]
    )
    for got, want in ((out, want_out), (grad_x, want_grad_x), (grad_weight, want_grad_w)):
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_tokens_output_bits_do_not_depend_on_other_tokens() -> None:
    generator = torch.Generator().manual_seed(2)
    sizes = [64, 64]
    x = torch.randn(128, 64, generator=generator)
    weight = torch.randn(2, 64, 64, generator=generator)
    before = grouped_gemm(x, weight, sizes, RECIPE)
    changed = x.clone()
    changed[10:] = torch.randn(118, 64, generator=generator) * 1000
    after = grouped_gemm(changed, weight, sizes, RECIPE)
    assert torch.equal(before[:10].view(torch.int32), after[:10].view(torch.int32))


def test_nonfinite_tokens_raise_or_propagate_to_their_own_rows() -> None:
    x = torch.randn(64, 32)
    x[5, 7] = float("nan")
    weight = torch.randn(2, 32, 32)
    with pytest.raises(ValueError, match="NaN or Inf"):
        grouped_gemm(x, weight, [32, 32], RECIPE)
    propagate = PrecisionConfig(precision="nvfp4_fwd_mxfp8_bwd", nonfinite="propagate")
    out = grouped_gemm(x, weight, [32, 32], propagate)
    assert torch.isnan(out[5]).all()
    assert torch.isfinite(out[torch.arange(64) != 5]).all()


def test_bad_shapes_and_group_sizes_are_rejected() -> None:
    x, weight = torch.randn(10, 32), torch.randn(2, 32, 32)
    with pytest.raises(ValueError, match="summing to the 10 rows"):
        grouped_gemm(x, weight, [4, 5], RECIPE)
    with pytest.raises(ValueError, match="non-negative"):
        grouped_gemm(x, weight, [11, -1], RECIPE)
    with pytest.raises(ValueError, match="N % 32"):
        grouped_gemm(x, torch.randn(2, 48, 32), [5, 5], RECIPE)
    with pytest.raises(ValueError, match=r"weight \[E, N, K\]"):
        grouped_gemm(x, torch.randn(2, 32, 16), [5, 5], RECIPE)
    with pytest.raises(ValueError, match="divisible by 32"):
        MoEExperts(4, 48, 64, "nvfp4_fwd_mxfp8_bwd")


def test_the_moe_layer_switches_recipe_by_config() -> None:
    generator = torch.Generator().manual_seed(3)
    layers = {
        precision: MoELayer(4, 64, 96, 2, precision, generator=torch.Generator().manual_seed(0))
        for precision in ("bf16", "nvfp4_fwd_mxfp8_bwd")
    }
    x = torch.randn(3, 50, 64, generator=generator)
    outputs = {name: layer(x) for name, layer in layers.items()}
    assert outputs["bf16"].shape == x.shape
    assert not torch.equal(outputs["bf16"], outputs["nvfp4_fwd_mxfp8_bwd"])
    # Two FP4 GEMMs in series (gate/up, then down) compound: ~0.97 for the whole block.
    assert _cosine(outputs["bf16"], outputs["nvfp4_fwd_mxfp8_bwd"]) >= 0.95
    outputs["nvfp4_fwd_mxfp8_bwd"].square().mean().backward()
    layer = layers["nvfp4_fwd_mxfp8_bwd"]
    for parameter in (layer.experts.gate_up, layer.experts.down, layer.router.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0
    assert layers["bf16"].experts.config.precision == "bf16"


def test_backend_seam_selects_by_capability() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend(cpu), EmulatedBackend)
    assert isinstance(select_backend(cpu, "emulated"), EmulatedBackend)
    assert not BlackwellBackend.supports(cpu)
    with pytest.raises(ValueError, match=r"compute capability >= 10\.0"):
        select_backend(cpu, "blackwell")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(cpu, "tpu")  # type: ignore[arg-type]


class _TransposingBackend(EmulatedBackend):
    """A kernel with a layout bug: it multiplies by the wrong operand orientation."""

    def nvfp4_matmul(self, a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
        return a.dequantize() @ b.dequantize().flip(0).T

    def mxfp8_matmul(self, a: MXFP8Tensor, b: MXFP8Tensor) -> torch.Tensor:
        return a.dequantize() @ b.dequantize().flip(0).T


def test_a_kernel_is_trusted_only_when_its_probe_agrees_with_the_emulation() -> None:
    cpu = torch.device("cpu")
    assert agrees_with_emulation(EmulatedBackend(), cpu)
    assert not agrees_with_emulation(_TransposingBackend(), cpu)


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (200, 9), (257, 33)])
def test_scale_swizzle_matches_the_cublas_layout(shape: tuple[int, int]) -> None:
    # cuBLAS "block scaling factors layout": 128x4 tiles of 512 bytes, tiles in row-major
    # order; inside a tile, scale (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c.
    rows, cols = shape
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(1, 255, shape, dtype=torch.uint8, generator=generator)
    got = swizzle_scales(codes.view(torch.float8_e8m0fnu)).view(torch.uint8)
    col_tiles = -(-cols // 4)
    assert got.numel() == -(-rows // 128) * col_tiles * 512
    want = torch.zeros_like(got)
    for row in range(rows):
        for col in range(cols):
            tile = (row // 128) * col_tiles + col // 4
            r, c = row % 128, col % 4
            want[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c] = codes[row, col]
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plain_grouped_gemm_and_its_gradients_equal_each_experts_own_matmul(
    precision: str,
) -> None:
    """The bf16/fp32 recipes split the tokens and unbind the experts (no per-expert slice,
    whose backward zero-fills a tensor the size of the whole input): forward and both
    gradients are those of each expert's matmul taken on its own, idle experts included."""
    generator = torch.Generator().manual_seed(3)
    sizes = [5, 0, 17, 1, 0, 9]
    x = torch.randn(sum(sizes), 24, generator=generator)
    weight = torch.randn(len(sizes), 40, 24, generator=generator)
    grad = torch.randn(sum(sizes), 40, generator=generator)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    out, grad_x, grad_w = _run(x, weight, sizes, grad, PrecisionConfig(precision=precision))

    expected_out = torch.zeros_like(out)
    expected_x, expected_w = torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for expert, size in enumerate(sizes):
        rows = slice(start, start + size)
        x_e = x[rows].detach().clone().requires_grad_()
        w_e = weight[expert].detach().clone().requires_grad_()
        y = (x_e.to(dtype) @ w_e.to(dtype).T).to(torch.float32)
        y.backward(grad[rows])
        expected_out[rows] = y.detach()
        if size:
            assert x_e.grad is not None and w_e.grad is not None
            expected_x[rows], expected_w[expert] = x_e.grad, w_e.grad
        start += size
    assert torch.equal(out, expected_out)
    assert torch.equal(grad_x, expected_x)
    assert torch.equal(grad_w, expected_w)
    assert torch.count_nonzero(grad_w[[1, 4]]) == 0


def test_emulated_grouped_matmuls_equal_the_per_expert_loop_bit_for_bit() -> None:
    """The emulation's one grouped GEMM over all experts gives the bits of the base
    class's matmul per expert (idle experts included), for both quantized formats."""
    generator = torch.Generator().manual_seed(5)
    sizes = [7, 0, 33, 1, 64, 0, 19]
    bounds = tuple(
        (sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))
    )  # the group_bounds layout
    x = torch.randn(sum(sizes), 64, generator=generator)
    weight = torch.randn(len(sizes), 32, 64, generator=generator)
    backend = EmulatedBackend()
    looped = super(EmulatedBackend, backend)
    x4, w4 = quantize_nvfp4(x), quantize_nvfp4(weight)
    assert torch.equal(
        backend.nvfp4_grouped_matmul(x4, w4, bounds), looped.nvfp4_grouped_matmul(x4, w4, bounds)
    )
    x8, w8 = quantize_mxfp8(x), quantize_mxfp8(weight)
    assert torch.equal(
        backend.mxfp8_grouped_matmul(x8, w8, bounds), looped.mxfp8_grouped_matmul(x8, w8, bounds)
    )


def test_grouped_mm_is_chosen_where_the_device_runs_it() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert grouped_mm_runs(cpu, dtype, 24, 40)  # any shape on CPU
    assert not grouped_mm_runs(torch.device("meta"), torch.bfloat16, 64, 64)
