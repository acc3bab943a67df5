"""The row-scaled NVFP4 variant: bit-exact against the float64 reference, batch-invariant,
no cross-token dependence, deliberate special rows, correctly rounded scale division."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.precision.formats import e2m1_decode, e2m1_encode
from services.trainer.precision.nvfp4 import (
    NVFP4Tensor,
    quantize_nvfp4,
    quantize_nvfp4_with_scale,
    row_scale_of,
)
from tests.test_precision_reference import (
    E2M1_TABLE,
    E4M3_TABLE,
    f32,
    nvfp4_reference,
    round_to_table,
)


def _rows_bits(q: NVFP4Tensor, rows: list[int]) -> tuple[bytes, bytes, bytes]:
    """Every bit of some rows of a quantized tensor: codes, block scales, row scales."""
    return (
        q.data.view(torch.uint8)[rows].numpy().tobytes(),
        q.block_scale.view(torch.uint8)[rows].numpy().tobytes(),
        q.row_scale.view(torch.int32)[rows].numpy().tobytes(),
    )


def _bits(x: torch.Tensor) -> tuple[bytes, bytes, bytes]:
    """Every bit of ``quantize_nvfp4(x)``."""
    return _rows_bits(quantize_nvfp4(x), list(range(x.shape[0])))


def _assert_matches_reference(x: torch.Tensor) -> None:
    q = quantize_nvfp4(x)
    codes, block_codes, row_scale = nvfp4_reference(x.float().numpy())
    assert np.array_equal(q.codes().numpy().astype(np.int64), codes)
    assert np.array_equal(q.block_scale.view(torch.uint8).numpy().astype(np.int64), block_codes)
    assert np.array_equal(q.row_scale.view(torch.int32).numpy(), row_scale.view(np.int32))


def _heavy_tailed(rows: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    per_row = torch.exp2(torch.randint(-40, 40, (rows, 1), generator=generator).float())
    per_element = torch.exp(2 * torch.randn(rows, width, generator=generator))
    return torch.randn(rows, width, generator=generator) * per_element * per_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_and_heavy_tailed_sweeps_match_the_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    _assert_matches_reference(torch.randn(1024, 256, generator=generator).to(dtype))
    _assert_matches_reference(_heavy_tailed(1024, 256, seed=1).to(dtype))


def test_float16_inputs_match_the_reference() -> None:
    generator = torch.Generator().manual_seed(11)
    _assert_matches_reference((torch.randn(512, 128, generator=generator) * 30).half())


def test_element_rounding_boundaries_inside_a_row() -> None:
    # Block 0 holds the row's amax 2688 (s_row = 1); block 1 has amax 6 (block scale 1),
    # so its elements are rounded as they are: every E2M1 midpoint and its neighbours.
    midpoints = (E2M1_TABLE[1:] + E2M1_TABLE[:-1]) / 2
    points = torch.tensor(np.concatenate([midpoints, E2M1_TABLE[1:]]), dtype=torch.float32)
    neighbours = torch.cat(
        [points, torch.nextafter(points, points * 0), torch.nextafter(points, points * 2)]
    )
    neighbours = torch.cat([neighbours, -neighbours])
    num_blocks = -(-len(neighbours) // 15)
    rows = torch.zeros(num_blocks, 32)
    rows[:, 0] = 2688.0
    rows[:, 16] = 6.0
    padded = torch.zeros(num_blocks * 15)
    padded[: len(neighbours)] = neighbours
    rows[:, 17:] = padded.reshape(num_blocks, 15)
    q = quantize_nvfp4(rows)
    assert (q.row_scale == 1).all() and (q.block_scale[:, 1].float() == 1).all()
    _assert_matches_reference(rows)


def test_block_scale_rounding_saturation_and_subnormal_scales() -> None:
    # With s_row = 1, a block of amax 6 * m asks for block scale e4m3_rn(m): m runs over
    # E4M3 midpoints (normal and subnormal: 2**-10 ties to 0, 3 * 2**-10 ties to 2**-8).
    midpoints = (E4M3_TABLE[1:] + E4M3_TABLE[:-1]) / 2
    ratios = np.concatenate([midpoints, E4M3_TABLE, [2.0**-10, 3 * 2.0**-10, 2.0**-12]])
    amaxes = torch.tensor(6 * ratios, dtype=torch.float32)
    rows = torch.zeros(len(amaxes), 32)
    rows[:, 0] = 2688.0
    rows[:, 16] = amaxes
    rows[:, 17] = -amaxes / 3
    q = quantize_nvfp4(rows)
    want = round_to_table(f32(amaxes.double().numpy() / 6.0), E4M3_TABLE)
    assert q.block_scale[:, 1].view(torch.uint8).numpy().astype(np.int64).tolist() == want.tolist()
    # A block whose scale rounds to zero is flushed to (signed) zeros, not inf or NaN codes.
    flushed = q.block_scale[:, 1].float() == 0
    assert flushed.any() and (q.codes()[flushed][:, 16:] & 7 == 0).all()
    assert torch.isfinite(q.dequantize()).all()
    _assert_matches_reference(rows)


def test_block_scale_saturates_at_448() -> None:
    # s_row rounds so that the largest block asks for slightly more than 448.
    generator = torch.Generator().manual_seed(3)
    rows = torch.rand(4096, 16, generator=generator) + 0.5
    q = quantize_nvfp4(rows)
    assert q.block_scale.float().max().item() == 448.0
    _assert_matches_reference(rows)


def test_zero_rows_and_blocks_are_zeros_not_nan() -> None:
    x = torch.zeros(3, 64)
    x[1, 16:32] = torch.linspace(-1, 1, 16)
    q = quantize_nvfp4(x)
    assert q.row_scale[0].item() == 0 and q.row_scale[2].item() == 0
    assert (q.block_scale.float()[[0, 2]] == 0).all() and (
        q.block_scale.float()[1, [0, 2, 3]] == 0
    ).all()
    assert torch.equal(q.dequantize()[[0, 2]], torch.zeros(2, 64))
    assert not torch.isnan(q.dequantize()).any()
    _assert_matches_reference(x)


def test_denormal_only_rows_quantize_to_zeros_and_the_smallest_normal_row_does_not() -> None:
    denormal = torch.full((1, 32), 2.0**-127)
    denormal[0, 5] = -(2.0**-149)
    smallest_normal = torch.full((1, 32), 2.0**-126)
    q = quantize_nvfp4(torch.cat([denormal, smallest_normal]))
    assert q.row_scale[0].item() == 0 and (q.dequantize()[0] == 0).all()
    # From 2**-126 on the spec's chain runs (its FP32 row scale is subnormal, ~12 bits),
    # so the row comes back close, not exact.
    assert q.row_scale[1].item() > 0
    assert torch.allclose(q.dequantize()[1], smallest_normal[0], rtol=1e-3, atol=0)
    _assert_matches_reference(torch.cat([denormal, smallest_normal]))


def test_nonfinite_inputs_raise_or_propagate_as_nan_rows() -> None:
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 20] = float("-inf")
    with pytest.raises(ValueError, match="2 row"):
        quantize_nvfp4(x)
    q = quantize_nvfp4(x, nonfinite="propagate")
    dequantized = q.dequantize()
    assert torch.isnan(dequantized[1]).all() and torch.isnan(dequantized[2]).all()
    assert torch.isfinite(dequantized[[0, 3]]).all()
    assert _bits(x[[0, 3]]) == _rows_bits(q, [0, 3])
    with pytest.raises(ValueError, match="nonfinite"):
        quantize_nvfp4(x, nonfinite="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_a_row_alone_or_in_any_batch_has_the_same_bits(dtype: torch.dtype) -> None:
    batch = _heavy_tailed(64, 128, seed=4).to(dtype)
    q = quantize_nvfp4(batch)
    generator = torch.Generator().manual_seed(5)
    for row in (0, 17, 63):
        alone = _bits(batch[row : row + 1])
        assert alone == _rows_bits(q, [row])
        others = batch.clone()
        others[(row + 1) % 64] *= 1000  # a louder neighbour changes nothing here
        assert alone == _rows_bits(quantize_nvfp4(others), [row])
        order = torch.randperm(64, generator=generator)
        shuffled = quantize_nvfp4(batch[order])
        assert alone == _rows_bits(shuffled, [int((order == row).nonzero())])
        bigger = torch.cat([batch, _heavy_tailed(100, 128, seed=row).to(dtype)])
        assert alone == _rows_bits(quantize_nvfp4(bigger), [row])


def test_no_cross_token_dependence_changing_token_t_plus_1_keeps_token_t() -> None:
    tokens = _heavy_tailed(32, 256, seed=6)
    before = quantize_nvfp4(tokens)
    for t in range(31):
        changed = tokens.clone()
        changed[t + 1] = torch.randn(256) * 1e6
        changed[t + 1 :] *= 3  # and every later token too
        after = quantize_nvfp4(changed)
        assert _rows_bits(before, list(range(t + 1))) == _rows_bits(after, list(range(t + 1)))


def test_per_tensor_scale_is_batch_variant_which_the_row_scale_fixes() -> None:
    # What per-row scales buy: with one tensor scale, a loud token changes a quiet one.
    tokens = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))

    def per_tensor(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax().float() / 2688
        return quantize_nvfp4_with_scale(x, scale).data.view(torch.uint8)[0]

    loud = tokens.clone()
    loud[1] *= 1000
    assert not torch.equal(per_tensor(tokens), per_tensor(loud))
    assert _rows_bits(quantize_nvfp4(tokens), [0]) == _rows_bits(quantize_nvfp4(loud), [0])
    # With a per-row outer scale the two entry points agree bit for bit.
    row_scale = row_scale_of(tokens.abs().amax(dim=-1, keepdim=True))
    assert torch.equal(
        quantize_nvfp4_with_scale(tokens, row_scale).data.view(torch.uint8),
        quantize_nvfp4(tokens).data.view(torch.uint8),
    )


def test_scale_division_is_correctly_rounded_on_a_large_sweep() -> None:
    generator = torch.Generator().manual_seed(8)
    mantissas = torch.rand(2_000_000, generator=generator) + 1
    exponents = torch.randint(-120, 120, (2_000_000,), generator=generator).float()
    amax = (mantissas * torch.exp2(exponents)).reshape(-1, 1)
    got = row_scale_of(amax).numpy().ravel()
    want = f32(amax.double().numpy().ravel() / 2688.0).astype(np.float32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    # The sweep can tell division from a fast reciprocal multiply, which rounds twice.
    reciprocal = (amax * torch.tensor(1 / 2688, dtype=torch.float32)).numpy().ravel()
    assert (reciprocal.view(np.int32) != want.view(np.int32)).sum() > 1000


def test_ties_through_a_non_power_of_two_scale_need_a_true_division() -> None:
    # s_row = 40320 / 2688 = 15 and block scale 1 make the divisor 15, and x = 15 * m lands
    # exactly on the E2M1 midpoints m: x / 15 is the tie, rounded to the even code. A fast
    # x * (1 / 15) overshoots by an ulp, so the ties at 1.25, 2.5 and 5 round up instead.
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.zeros(1, 32)
    row[0, 0] = 40320.0
    row[0, 16] = 90.0
    row[0, 17:24] = 15 * midpoints
    q = quantize_nvfp4(row)
    assert q.row_scale.item() == 15.0 and q.scale_product()[0, 1].item() == 15.0
    assert q.codes()[0, 17:24].tolist() == [0, 2, 2, 4, 4, 6, 6]
    fast = row[0, 17:24] * (1 / q.scale_product()[0, 1])
    assert e2m1_encode(fast).tolist() == [0, 2, 3, 4, 5, 6, 7]
    _assert_matches_reference(row)


def test_dequantize_is_codes_times_the_scale_product() -> None:
    x = _heavy_tailed(16, 64, seed=10)
    q = quantize_nvfp4(x)
    values = e2m1_decode(q.codes()).reshape(16, 4, 16) * q.scale_product().unsqueeze(-1)
    assert torch.equal(q.dequantize(), values.reshape(16, 64))
    error = (q.dequantize() - x).norm() / x.norm()
    assert error < 0.2


def test_bad_inputs_are_rejected_with_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 24))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_nvfp4(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="broadcast"):
        quantize_nvfp4_with_scale(torch.zeros(4, 32), torch.ones(3, 1))
