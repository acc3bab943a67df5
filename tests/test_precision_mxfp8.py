"""MXFP8: bit-exact against the float64 reference and against torchao 0.18's emulated ``to_mx``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.precision.mxfp8 import ScaleRule, quantize_mxfp8, scale_codes
from tests.test_precision_reference import f32, mxfp8_reference


def _codes(x: torch.Tensor, scale_rule: ScaleRule) -> tuple[np.ndarray, np.ndarray]:
    q = quantize_mxfp8(x, scale_rule=scale_rule)
    return q.data.view(torch.uint8).numpy(), q.scale.view(torch.uint8).numpy()


def _assert_matches_reference(x: torch.Tensor, scale_rule: ScaleRule) -> None:
    data, scale = _codes(x, scale_rule)
    want_data, want_scale = mxfp8_reference(x.float().numpy(), scale_rule)
    assert np.array_equal(scale.astype(np.int64), want_scale)
    assert np.array_equal(data.astype(np.int64), want_data)


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student_t = torch.distributions.StudentT(torch.tensor(1.5)).sample((1024, 512))
    return {
        "normal": torch.randn(1024, 512, generator=generator),
        "heavy_tailed": student_t * torch.exp(3 * torch.randn(1024, 1, generator=generator)),
        "wide_exponents": torch.randn(1024, 512, generator=generator)
        * torch.exp2(
            torch.randint(-60, 60, (1024, 16), generator=generator).float()
        ).repeat_interleave(32, dim=1),
    }


@pytest.fixture(scope="module")
def torchao_to_mx() -> Callable[..., Any]:
    """torchao 0.18's eager ``to_mx`` (a dev dependency; its CUDA extensions need not load)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx_tensor = importlib.import_module("torchao.prototype.mx_formats.mx_tensor")
    to_mx: Callable[..., Any] = mx_tensor.to_mx
    return to_mx


@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_and_scales_match_torchao_to_mx(
    torchao_to_mx: Callable[..., Any], scale_rule: ScaleRule, dtype: torch.dtype
) -> None:
    config = importlib.import_module("torchao.prototype.mx_formats.config")
    mode = (
        config.ScaleCalculationMode.RCEIL
        if scale_rule == "rceil"
        else config.ScaleCalculationMode.FLOOR
    )
    torch.manual_seed(0)  # torch.distributions draws from the global generator
    for name, x in _inputs(seed=1).items():
        x = x.to(dtype)
        torchao_scale, torchao_data = torchao_to_mx(x, torch.float8_e4m3fn, 32, mode)
        data, scale = _codes(x, scale_rule)
        assert np.array_equal(scale, torchao_scale.view(torch.uint8).numpy()), name
        assert np.array_equal(data, torchao_data.view(torch.uint8).numpy()), name


@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
def test_sweeps_match_the_float64_reference(scale_rule: ScaleRule) -> None:
    torch.manual_seed(2)
    for x in _inputs(seed=3).values():
        _assert_matches_reference(x, scale_rule)
        _assert_matches_reference(x.bfloat16(), scale_rule)


@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
def test_float16_inputs_match_the_float64_reference(scale_rule: ScaleRule) -> None:
    # float16 cannot hold the reciprocal scales, so the quantizer widens it to float32.
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(256, 256, generator=generator) * torch.exp2(
        torch.randint(-20, 12, (256, 1), generator=generator).float()
    )
    _assert_matches_reference(x.half(), scale_rule)


def test_rceil_at_every_binade_edge_matches_the_reference() -> None:
    # amax = 448 * 2**k and its float32 neighbours: descale lands exactly on, or one
    # rounding away from, a power of two, where the ceiling decides the binade.
    k = torch.arange(-120, 120, dtype=torch.float32)
    edges = 448 * torch.exp2(k)
    amax = torch.cat(
        [edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges * 0)]
    ).unique()
    amax = amax[torch.isfinite(amax)]
    got = scale_codes(amax, "rceil").numpy()
    descale = f32(amax.double().numpy() / 448.0)
    mantissa, exponent = np.frexp(descale)
    want = np.clip(np.where(mantissa == 0.5, exponent - 1, exponent), -127, 127) + 127
    assert np.array_equal(got, want)


def test_rceil_takes_the_ceiling_from_bits_where_a_float32_log2_would_round() -> None:
    # descale = 2**20 * (1 + 2**-21): float32 log2 gives exactly 20.0, so ceil(log2) says
    # 2**20 and the block's largest element would need 448.0002 (clamped). The rule wants 2**21.
    amax = torch.tensor([448 * 2.0**20 * (1 + 2.0**-21)], dtype=torch.float32)
    descale = amax / 448
    assert torch.ceil(torch.log2(descale)).item() == 20.0
    assert scale_codes(amax, "rceil").item() == 21 + 127
    block = torch.zeros(1, 32)
    block[0, 0] = amax
    block[0, 1:] = torch.linspace(-(2.0**24), 2.0**24, 31)  # the rest, in the rule's binade
    _assert_matches_reference(block, "rceil")


def test_rceil_never_saturates_and_floor_does() -> None:
    torch.manual_seed(4)
    x = _inputs(seed=5)["heavy_tailed"]
    blocks = x.unflatten(-1, (-1, 32))
    for scale_rule, saturates in (("rceil", False), ("floor", True)):
        q = quantize_mxfp8(x, scale_rule=scale_rule)
        scale = q.scale.to(torch.float32).unsqueeze(-1)
        exact = (blocks.double() / scale.double()).abs().amax(dim=-1)
        assert bool((exact > 448 * (1 + 2**-4)).any()) == saturates, scale_rule


def test_zero_blocks_get_the_smallest_scale_and_zero_elements() -> None:
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-3, 3, 32)
    q = quantize_mxfp8(x)
    assert (
        q.scale.view(torch.uint8)[:, 0].tolist() == [0, 0] and q.scale.view(torch.uint8)[0, 1] == 0
    )
    assert torch.equal(q.dequantize()[:, :32], torch.zeros(2, 32))
    assert not torch.isnan(q.dequantize()).any()
    _assert_matches_reference(x, "rceil")
    _assert_matches_reference(x, "floor")


def test_subnormal_inputs_match_the_reference() -> None:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(64, 64, generator=generator) * 2.0**-130
    for scale_rule in ("rceil", "floor"):
        _assert_matches_reference(x, scale_rule)  # type: ignore[arg-type]


def test_nonfinite_inputs_raise_or_propagate_as_nan_blocks() -> None:
    x = torch.randn(2, 64)
    x[0, 40] = float("inf")
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="2 block"):
        quantize_mxfp8(x)
    q = quantize_mxfp8(x, nonfinite="propagate")
    scale_codes_ = q.scale.view(torch.uint8)
    assert scale_codes_[0, 1] == 255 and scale_codes_[1, 0] == 255
    assert scale_codes_[0, 0] != 255 and scale_codes_[1, 1] != 255
    dequantized = q.dequantize()
    assert torch.isnan(dequantized[0, 32:]).all() and torch.isnan(dequantized[1, :32]).all()
    assert torch.isfinite(dequantized[0, :32]).all() and torch.isfinite(dequantized[1, 32:]).all()


def test_division_sweep_matches_float64_and_a_reciprocal_would_not() -> None:
    generator = torch.Generator().manual_seed(7)
    amax = (torch.rand(2_000_000, generator=generator) + 1) * torch.exp2(
        torch.randint(-110, 120, (2_000_000,), generator=generator).float()
    )
    got = scale_codes(amax, "rceil").numpy()
    descale = f32(amax.double().numpy() / 448.0)
    mantissa, exponent = np.frexp(descale)
    want = np.where(mantissa == 0.5, exponent - 1, exponent) + 127
    assert np.array_equal(got, want)
    fast = (amax * torch.tensor(1 / 448, dtype=torch.float32)).numpy().astype(np.float64)
    assert (fast != descale).sum() > 1000  # the sweep sees a reciprocal's double rounding


def test_bad_inputs_are_rejected_with_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp8(torch.zeros(2, 32), scale_rule="even")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_mxfp8(torch.zeros(2, 32, dtype=torch.float64))
