"""E2M1, E4M3 and E8M0 codecs: every rounding boundary, ties, saturation, subnormals, packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.precision.formats import (
    abs_max,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_from_codes,
    e8m0_reciprocal,
    e8m0_to_float,
    pack_e2m1,
    unpack_e2m1,
)
from tests.test_precision_reference import (
    E2M1_TABLE,
    E4M3_TABLE,
    e2m1_codes,
    e4m3_codes,
)


def _around(points: np.ndarray) -> torch.Tensor:
    """Each point, the float32 just below and just above it, and their negatives."""
    center = torch.tensor(points, dtype=torch.float32)
    below = torch.nextafter(center, torch.full_like(center, -np.inf))
    above = torch.nextafter(center, torch.full_like(center, np.inf))
    values = torch.cat([center, below, above])
    return torch.cat([values, -values])


def test_e2m1_values_and_ties_by_hand() -> None:
    values = torch.tensor(
        [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, -0.1, -5.0, -5.01]
    )
    expected = [0, 8, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 8 | 6, 8 | 7]
    assert e2m1_encode(values).tolist() == expected
    assert e2m1_encode(torch.tensor([float("inf"), float("-inf")])).tolist() == [7, 15]


def test_e2m1_every_value_midpoint_and_neighbour_matches_the_reference() -> None:
    midpoints = (E2M1_TABLE[1:] + E2M1_TABLE[:-1]) / 2
    values = _around(np.concatenate([E2M1_TABLE, midpoints, [6.5, 12.0]]))
    got = e2m1_encode(values)
    want = e2m1_codes(values.double().numpy())
    assert got.tolist() == want.tolist()


def test_e2m1_random_sweep_matches_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(200_000, generator=generator) * 3
    assert np.array_equal(e2m1_encode(values).numpy(), e2m1_codes(values.double().numpy()))


def test_e2m1_decode_round_trips_all_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == E2M1_TABLE.tolist()
    assert torch.signbit(values[8:]).all()
    assert e2m1_encode(values).tolist() == codes.tolist()


def test_e4m3_every_value_midpoint_and_neighbour_matches_the_reference() -> None:
    # 127 values, 126 midpoints (subnormal ones included: 2**-10 is the tie to zero),
    # and the saturation region above 448 (464 is where a wider format would round up).
    midpoints = (E4M3_TABLE[1:] + E4M3_TABLE[:-1]) / 2
    extra = [2.0**-10, 3 * 2.0**-10, 2.0**-11, 464.0, 480.0, 1e6, 3.0e38]
    values = _around(np.concatenate([E4M3_TABLE, midpoints, extra]))
    got = e4m3_encode(values).view(torch.uint8).numpy().astype(np.int64)
    assert np.array_equal(got, e4m3_codes(values.double().numpy()))


def test_e4m3_subnormal_ties_and_saturation_by_hand() -> None:
    values = torch.tensor([2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 449.0, 1e9, -1e9])
    codes = e4m3_encode(values).view(torch.uint8).tolist()
    # 2**-10 ties 0 and 2**-9: even code 0; 3*2**-10 ties codes 1 and 2: even 2; 5*2**-10 -> 2.
    assert codes == [0, 2, 2, 0x7E, 0x7E, 0xFE]
    assert e4m3_encode(torch.tensor([float("nan")])).view(torch.uint8).item() & 0x7F == 0x7F


def test_e4m3_of_every_finite_bfloat16_matches_the_reference() -> None:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    got = e4m3_encode(values).view(torch.uint8).numpy().astype(np.int64)
    assert np.array_equal(got, e4m3_codes(values.double().numpy()))


def test_e4m3_random_sweep_matches_the_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(200_000, generator=generator) * torch.exp2(
        torch.randint(-14, 10, (200_000,), generator=generator).float()
    )
    got = e4m3_encode(values).view(torch.uint8).numpy().astype(np.int64)
    assert np.array_equal(got, e4m3_codes(values.double().numpy()))


def test_e8m0_values_and_exact_reciprocals() -> None:
    codes = torch.arange(255, dtype=torch.int32)
    values = e8m0_to_float(e8m0_from_codes(codes)).double()
    assert torch.equal(values, torch.exp2(codes.double() - 127))
    reciprocals = e8m0_reciprocal(codes).double()
    assert torch.equal(reciprocals * values, torch.ones(255, dtype=torch.float64))
    assert torch.isnan(e8m0_reciprocal(torch.tensor([255]))).all()
    assert torch.isnan(e8m0_to_float(e8m0_from_codes(torch.tensor([255])))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_abs_max_on_bits_is_abs_amax_and_propagates_nan(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 32, generator=generator) * 100).to(dtype)
    x[3, 5], x[4, :] = -float("inf"), -0.0
    x[5, 7] = -float("nan")
    got = abs_max(x)
    want = x.abs().amax(dim=-1)
    assert got.dtype == dtype and torch.isnan(got[5]) and got[3] == float("inf")
    assert torch.equal(got[torch.arange(64) != 5], want[torch.arange(64) != 5])
    assert not torch.signbit(got[4])


def test_pack_unpack_round_trip_and_nibble_order() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat(3).reshape(3, 16)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (3, 8)
    assert packed.view(torch.uint8)[0, 0].item() == 0x10  # element 0 low, element 1 high
    assert torch.equal(unpack_e2m1(packed), codes)


def test_codecs_reject_wrong_dtypes_and_shapes() -> None:
    with pytest.raises(TypeError, match="float32"):
        e2m1_encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        e4m3_encode(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float4_e2m1fn_x2"):
        unpack_e2m1(torch.zeros(3, dtype=torch.uint8))
