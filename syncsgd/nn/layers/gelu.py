"""gelu: y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, the exact form (torch.nn.GELU's default).

Its gradient: Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).

Float mode in float32 computes both in float32, in loops the compiler vectorises: erf as a
rational function of x on [-4, 4] (+-1 beyond, as in float32), exp by its powers of two and a
polynomial (`exp_float32`, which attention's softmax uses too). The other modes, and float64,
take erf and exp in float64 from the C library, element by element, the forward pass keeping
erf for the backward pass (docs/transformer.md has the float32 kernels' errors).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.exact import float_bits
from syncsgd.nn.layers.base import Layer, Primitives

F32 = np.float32  # the float32 kernels' constants: a float64 one would widen their arithmetic
# erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4] (the float32 erf of Eigen, TensorFlow's library)
ERF_P = (F32(-2.72614225801306e-10), F32(2.77068142495902e-08), F32(-2.10102402082508e-06),
         F32(-5.69250639462346e-05), F32(-7.34990630326855e-04), F32(-2.95459980854025e-03),
         F32(-1.60960333262415e-02))  # fmt: skip
ERF_Q = (F32(-1.45660718464996e-05), F32(-2.13374055278905e-04), F32(-1.68282697438203e-03),
         F32(-7.37332916720468e-03), F32(-1.42647390514189e-02))  # fmt: skip
ERF_EDGE = F32(4.0)  # beyond it erf is +-1 in float32
# exp(v) = 2^n exp(r), n = round(v / ln 2), r = v - n ln 2 (ln 2 in two parts: n ln2_hi exact)
LOG2E, LN2_HI, LN2_LO = F32(1.4426950408889634), F32(0.693359375), F32(-2.12194440e-4)
ROUNDER = F32(12582912.0)  # 1.5 * 2^23: v / ln 2 + ROUNDER holds round(v / ln 2) in its low bits
EXP_LOW, EXP_HIGH = F32(-87.0), F32(88.0)  # 2^n stays a normal float32
EXP_TAYLOR = tuple(F32(1.0 / math.factorial(k)) for k in range(7, 1, -1))  # 1/7! ... 1/2!
ONE, HALF = F32(1.0), F32(0.5)
SQRT_HALF, INV_SQRT_2PI = F32(math.sqrt(0.5)), F32(1.0 / math.sqrt(2.0 * math.pi))


class GELU(Layer):
    """The Gaussian error linear unit, element by element, rounded to the format in narrow modes."""

    kind = "gelu"
    signature = "gelu"

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(x Phi(x))."""
        if nx.free_order and x.dtype == np.float32:
            gelu_float32_(x.reshape(-1), y.reshape(-1))
        else:  # erf kept for the backward pass, which then takes only the exp
            gelu_(x.reshape(-1), self._erf(nx, x), y.reshape(-1))
        nx.round_(y)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(dy (Phi(x) + x phi(x)))."""
        if nx.free_order and x.dtype == np.float32:
            gelu_backward_float32_(x.reshape(-1), dy.reshape(-1), dx.reshape(-1))
        else:
            gelu_backward_(x.reshape(-1), self._erf(nx, x), dy.reshape(-1), dx.reshape(-1))
        nx.round_(dx)

    def _erf(self, nx: Primitives, x: np.ndarray) -> np.ndarray:
        """erf(x / sqrt 2) of the pass under way, in float64 (the C library's kernels)."""
        return self.workspaces(nx).keep("erf", (x.size,), np.float64)

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """erf(x / sqrt 2) in float64."""
        return m * shape_size(self.in_shape) * 8

    def free_kept_bytes(self, m: int, itemsize: int) -> int:
        """erf(x / sqrt 2) in float64, but in float32, whose kernels keep nothing."""
        return 0 if itemsize == 4 else self.kept_bytes(m, itemsize)

    def inner_size(self) -> int:
        """erf(x / sqrt 2) per value."""
        return shape_size(self.in_shape)


@njit(nogil=True, cache=True)
def gelu_(x, erf, y):
    """y = x (1 + erf(x / sqrt 2)) / 2, element by element; erf(x / sqrt 2) kept in `erf`."""
    for i in range(x.size):
        value = np.float64(x[i])
        erf[i] = math.erf(value / math.sqrt(2.0))
        y[i] = 0.5 * value * (1.0 + erf[i])


@njit(nogil=True, cache=True)
def gelu_backward_(x, erf, dy, dx):
    """dx = dy (Phi(x) + x phi(x)), element by element; erf: gelu_'s."""
    for i in range(x.size):
        value = np.float64(x[i])
        cdf = 0.5 * (1.0 + erf[i])
        pdf = math.exp(-0.5 * value * value) / math.sqrt(2.0 * math.pi)
        dx[i] = np.float64(dy[i]) * (cdf + value * pdf)


@intrinsic
def bits_float32(typingctx, value):
    """The float32 of a bit pattern held in an integer's low 32 bits (a bitcast)."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0]
        if value.bitwidth > 32:
            low = builder.trunc(low, context.get_value_type(types.int32))
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(value), codegen


@njit(inline="always")
def exp_float32(v):
    """exp(v) of a float32, within about 1 ulp; no branch, so a loop of it vectorises."""
    v = min(max(v, EXP_LOW), EXP_HIGH)
    shifted = v * LOG2E + ROUNDER
    n = shifted - ROUNDER  # round(v / ln 2)
    r = v - n * LN2_HI - n * LN2_LO
    p = EXP_TAYLOR[0]
    for c in EXP_TAYLOR[1:]:
        p = p * r + c
    p = (p * r + ONE) * r + ONE
    power = (float_bits(shifted) - float_bits(ROUNDER) + 127) << 23  # 2^n's bits
    return p * bits_float32(power)


@njit(inline="always", error_model="numpy")
def erf_float32(v):
    """erf(v) of a float32, within 5e-7; no branch, so a loop of it vectorises."""
    x = min(max(v, -ERF_EDGE), ERF_EDGE)
    x2 = x * x
    p = ERF_P[0]
    for c in ERF_P[1:]:
        p = p * x2 + c
    q = ERF_Q[0]
    for c in ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


@njit(nogil=True, cache=True, error_model="numpy")
def gelu_float32_(x, y):
    """y = x (1 + erf(x / sqrt 2)) / 2 in float32, element by element."""
    for i in range(x.size):
        value = x[i]
        y[i] = HALF * value * (ONE + erf_float32(value * SQRT_HALF))


@njit(nogil=True, cache=True, error_model="numpy")
def gelu_backward_float32_(x, dy, dx):
    """dx = dy (Phi(x) + x phi(x)) in float32, element by element."""
    for i in range(x.size):
        value = x[i]
        cdf = HALF * (ONE + erf_float32(value * SQRT_HALF))
        pdf = exp_float32(-HALF * value * value) * INV_SQRT_2PI
        dx[i] = dy[i] * (cdf + value * pdf)
