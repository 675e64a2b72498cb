"""Rounding to the narrow float formats of mixed-precision training: bfloat16 and float16.

Values are rounded, not stored narrow: a rounded value is kept in a float32 or float64 array
(every bfloat16 and float16 value is exactly a float32), so the kernels compute on ordinary arrays.
Rounding is to nearest, ties to even, as the hardware's conversion does, with the format's
subnormals, overflow to a signed infinity and NaN kept (docs/mixed-precision.md).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

FP32, BF16, FP16 = 0, 1, 2  # format codes handed to the kernels; FP32: no rounding
PRECISION_CODES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}
ALLREDUCE_CODES = {"bfloat16": BF16, "float16": FP16}

# (significand bits with the implicit one, smallest normal exponent, largest finite value)
BF16_BITS, BF16_EMIN, BF16_MAX = 8, -126, float.fromhex("0x1.fep127")
FP16_BITS, FP16_EMIN, FP16_MAX = 11, -14, 65504.0


@njit(nogil=True, cache=True, inline="always")
def round_value(x, bits, emin, largest):
    """x (float64) rounded to nearest even in the format with `bits`, `emin` and `largest`."""
    # Quantum q = 2^(e - bits + 1) at x's binade e, never below the subnormal quantum; x / q is
    # exact (q is a power of two within float64's range) and rint rounds ties to even.
    if x != x or x == 0.0 or math.isinf(x):
        return x
    _, exponent = math.frexp(x)  # x = f * 2^exponent with 0.5 <= |f| < 1: binade exponent - 1
    quantum = math.ldexp(1.0, max(exponent - 1, emin) - bits + 1)
    rounded = np.rint(x / quantum) * quantum
    if abs(rounded) > largest:
        return math.copysign(math.inf, x)
    return rounded


@njit(nogil=True, cache=True, inline="always")
def round_to(x, fmt):
    """x (float64) rounded to format `fmt` (BF16 or FP16); FP32 leaves it as it is."""
    if fmt == BF16:
        return round_value(x, BF16_BITS, BF16_EMIN, BF16_MAX)
    if fmt == FP16:
        return round_value(x, FP16_BITS, FP16_EMIN, FP16_MAX)
    return x


@njit(nogil=True, cache=True)
def round_flat_(values, fmt):
    """Round every element of a contiguous 1-D float32 or float64 array in place."""
    if fmt == FP32:
        return
    for i in range(values.size):
        values[i] = round_to(np.float64(values[i]), fmt)


def round_array(values: np.ndarray, fmt: int) -> np.ndarray:
    """A rounded copy of a float32 or float64 array of any shape (the test's and tools' entry)."""
    out = np.array(values, copy=True, order="C")
    if out.dtype not in (np.float32, np.float64):
        raise ValueError(f"round_array takes float32 or float64 values, got {out.dtype}")
    round_flat_(out.reshape(-1), fmt)
    return out


@njit(nogil=True, cache=True)
def round_block_(block, fmt):
    """Round every element of a 2-D array (a view of a workspace) in place."""
    for i in range(block.shape[0]):
        for j in range(block.shape[1]):
            block[i, j] = round_to(np.float64(block[i, j]), fmt)


@njit(nogil=True, cache=True)
def narrow_copy_(source, out, fmt):
    """out[i] = source[i] rounded to the format: the values a pass computes with (may be source)."""
    for i in range(source.size):
        out[i] = round_to(np.float64(source[i]), fmt)


@njit(nogil=True, cache=True)
def scale_round_(delta, scale, fmt):
    """delta = round(delta * scale): the loss scale, then the gradient as the format holds it."""
    for i in range(delta.shape[0]):
        for j in range(delta.shape[1]):
            delta[i, j] = round_to(np.float64(delta[i, j]) * scale, fmt)


