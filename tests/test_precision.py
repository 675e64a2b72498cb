"""The rounding kernels against well-kept references: ml_dtypes' bfloat16 and NumPy's float16."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from syncsgd.nn.precision import BF16, FP16, FP32, round_array

# The references overflow to infinity, as they should, and NumPy warns each time.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

REFERENCE = {BF16: ml_dtypes.bfloat16, FP16: np.float16}


def awkward_float32(fmt: int, count: int = 200_000) -> np.ndarray:
    """Random float32 values across the format's whole range, with its subnormals, overflow,
    exact ties, infinities, NaN and signed zeros."""
    rng = np.random.default_rng(fmt)
    info = ml_dtypes.finfo(REFERENCE[fmt]) if fmt == BF16 else np.finfo(np.float16)
    low, high = int(np.log2(float(info.smallest_subnormal))) - 2, int(np.log2(float(info.max))) + 2
    mantissas = rng.uniform(1, 2, count) * rng.choice([-1.0, 1.0], count)
    random = (mantissas * np.exp2(rng.integers(low, high, count))).astype(np.float32)
    # Ties: a value of the format plus half its quantum, the last kept bit even or odd.
    narrow = random.astype(REFERENCE[fmt]).astype(np.float32)
    narrow = narrow[np.isfinite(narrow) & (narrow != 0)]
    spacing = np.abs(np.spacing(narrow.astype(REFERENCE[fmt])).astype(np.float32))
    ties = narrow + spacing / 2
    largest = np.float32(info.max)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, largest, -largest,
                        largest * np.float32(1.001), float(info.smallest_subnormal),
                        float(info.smallest_subnormal) / 2, float(info.smallest_subnormal) * 1.5,
                        float(info.tiny)], np.float32)  # fmt: skip
    return np.concatenate([random, ties[np.isfinite(ties)], special])


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
def test_float32_rounding_matches_the_reference(fmt: int) -> None:
    values = awkward_float32(fmt)
    expected = values.astype(REFERENCE[fmt]).astype(np.float32)
    got = round_array(values, fmt)
    assert got.dtype == np.float32
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # signs too


def test_float64_rounding_to_float16_matches_numpy() -> None:
    values = awkward_float32(FP16).astype(np.float64)
    rng = np.random.default_rng(7)
    values = np.concatenate([values, values * (1 + rng.uniform(-1e-9, 1e-9, values.size))])
    expected = values.astype(np.float16).astype(np.float64)  # NumPy rounds float64 at once
    got = round_array(values, FP16)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint64), expected[~nan].view(np.uint64))


def test_float64_is_rounded_once_not_through_float32() -> None:
    # 1 + 2^-8 + 2^-30 lies just above a bfloat16 tie: rounded once it goes up; rounded to float32
    # first it becomes the tie 1 + 2^-8, which goes down to the even 1.
    value = np.array([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30)])
    assert list(round_array(value, BF16)) == [1 + 2.0**-7, -(1 + 2.0**-7)]
    assert list(round_array(value.astype(np.float32), BF16)) == [1.0, -1.0]


def test_float64_rounding_to_bfloat16_on_float32_values_matches_the_reference() -> None:
    values = awkward_float32(BF16)
    expected = values.astype(ml_dtypes.bfloat16).astype(np.float64)
    got = round_array(values.astype(np.float64), BF16)
    nan = np.isnan(expected)
    assert np.array_equal(got[~nan], expected[~nan])


def test_fp32_leaves_values_alone_and_other_dtypes_are_refused() -> None:
    values = np.array([1 / 3, 1e-40, 7e38], np.float64)
    assert np.array_equal(round_array(values, FP32), values)
    with pytest.raises(ValueError, match="float32 or float64"):
        round_array(np.arange(3), BF16)
