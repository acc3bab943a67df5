"""An independent float64 reference of the formats, and tests of the reference itself.

The reference shares no code with ``services.trainer.precision``: it rounds by
distance to the nearest value of each format's table (ties to the even code) in
numpy float64, and applies the float32 roundings of the recipe with ``np.float32``.
Computing a float32 ``+ - * /`` in float64 and rounding once to float32 gives the
correctly rounded float32 result (53 >= 2 * 24 + 2, so the double rounding is
innocuous), which is what makes this a reference for IEEE round-to-nearest.
Other precision tests import it.
"""

from __future__ import annotations

import numpy as np
import pytest

E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_table() -> np.ndarray:
    """Values of the non-negative finite E4M3 codes 0..126, from the format's definition."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(mantissa * 2.0**-9)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)


E4M3_TABLE = _e4m3_table()


def round_to_table(magnitude: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Codes of the table values nearest to ``magnitude >= 0``: ties to even, saturating."""
    magnitude = np.asarray(magnitude, dtype=np.float64)
    upper = np.clip(np.searchsorted(table, magnitude, side="left"), 1, len(table) - 1)
    lower = upper - 1
    to_lower = magnitude - table[lower]
    to_upper = table[upper] - magnitude
    codes = np.where(to_lower < to_upper, lower, upper)
    ties = to_lower == to_upper
    codes = np.where(ties, np.where(lower % 2 == 0, lower, upper), codes)
    codes = np.where(magnitude >= table[-1], len(table) - 1, codes)
    return codes.astype(np.int64)


def f32(value: np.ndarray | float) -> np.ndarray:
    """Rounds float64 to float32 (round-to-nearest-even) and back to float64."""
    return np.asarray(value, dtype=np.float64).astype(np.float32).astype(np.float64)


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign in bit 3) of float64 values."""
    return round_to_table(np.abs(y), E2M1_TABLE) | (np.signbit(y).astype(np.int64) << 3)


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (sign in bit 7) of finite float64 values, saturating at 448."""
    return round_to_table(np.abs(y), E4M3_TABLE) | (np.signbit(y).astype(np.int64) << 7)


def nvfp4_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(element codes ``[R, K]``, block-scale codes ``[R, K/16]``, row scales ``[R, 1]`` float32).

    Follows the spec line by line for finite ``x [R, K]`` (float32 values).
    """
    x64 = np.asarray(x, dtype=np.float64)
    rows, width = x64.shape
    blocks = x64.reshape(rows, width // 16, 16)
    amax_block = np.abs(blocks).max(axis=-1)
    amax_row = amax_block.max(axis=-1, keepdims=True)
    row_scale = np.where(amax_row < 2.0**-126, 0.0, f32(amax_row / 2688.0))
    six_row_scale = f32(6.0 * row_scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(six_row_scale > 0, f32(amax_block / six_row_scale), 0.0)
    block_codes = round_to_table(ratio, E4M3_TABLE)
    divisor = f32(E4M3_TABLE[block_codes] * row_scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(divisor[..., None] > 0, f32(blocks / divisor[..., None]), 0.0)
    codes = round_to_table(np.abs(scaled), E2M1_TABLE) | (np.signbit(blocks).astype(np.int64) << 3)
    return codes.reshape(rows, width), block_codes, row_scale.astype(np.float32)


def mxfp8_reference(x: np.ndarray, scale_rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(element codes ``[R, K]``, biased E8M0 codes ``[R, K/32]``) for finite ``x``."""
    x64 = np.asarray(x, dtype=np.float64)
    rows, width = x64.shape
    blocks = x64.reshape(rows, width // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    if scale_rule == "rceil":
        descale = f32(amax / 448.0)
        mantissa, exponent = np.frexp(
            descale
        )  # descale = mantissa * 2**exponent, mantissa in [0.5, 1)
        ceil_log2 = np.where(mantissa == 0.5, exponent - 1, exponent)
        unbiased = np.where(descale == 0, -127, ceil_log2)
    else:
        mantissa, exponent = np.frexp(amax)
        unbiased = np.where(amax == 0, -127, exponent - 1 - 8)
    unbiased = np.clip(unbiased, -127, 127)
    scaled = blocks / np.exp2(unbiased.astype(np.float64))[..., None]  # exact in float64
    return e4m3_codes(scaled).reshape(rows, width), (unbiased + 127).astype(np.int64)


def test_e4m3_table_is_the_format() -> None:
    assert E4M3_TABLE[1] == 2.0**-9 and E4M3_TABLE[7] == 7 * 2.0**-9
    assert E4M3_TABLE[8] == 2.0**-6 and E4M3_TABLE[56] == 1.0 and E4M3_TABLE[-1] == 448.0
    assert np.all(np.diff(E4M3_TABLE) > 0)


@pytest.mark.parametrize(
    ("value", "code"),
    [(0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (7.0, 7)],
)
def test_reference_e2m1_ties_go_to_even_codes(value: float, code: int) -> None:
    assert round_to_table(np.array([value]), E2M1_TABLE)[0] == code


def test_reference_nvfp4_on_a_hand_computed_row() -> None:
    # Row amax 2688 gives s_row = 1; the second block's amax 6 gives block scale 1.
    row = np.zeros((1, 32))
    row[0, 0] = 2688.0
    row[0, 16:20] = [6.0, -0.75, 1.25, 0.1]
    codes, block_codes, row_scale = nvfp4_reference(row)
    assert row_scale[0, 0] == 1.0
    assert E4M3_TABLE[block_codes[0]].tolist() == [448.0, 1.0]
    assert codes[0, 16:20].tolist() == [7, 8 | 2, 2, 0]
