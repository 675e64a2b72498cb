"""relu: y = max(x, 0); its gradient passes where the output is positive."""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Primitives


class ReLU(Layer):
    """The rectifier, element by element (a format's values stay the format's: no rounding)."""

    kind = "relu"
    signature = "relu"
    in_place, reads_output = True, True

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = max(x, 0)."""
        relu_(x.reshape(-1), y.reshape(-1))

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = dy where y > 0, else 0."""
        relu_backward_(y.reshape(-1), dy.reshape(-1), dx.reshape(-1))


# Select, not branch: the signs of a layer's outputs are as good as random, and a branch on them
# is mispredicted half the time. The selects keep max's values bit for bit (NaN stays NaN, -0.0
# stays -0.0). A dense layer's passes apply the same two (syncsgd.nn.numerics).
@njit(nogil=True, cache=True, inline="always")
def rectified(value, zero):
    """max(value, 0)."""
    return zero if value < zero else value


@njit(nogil=True, cache=True, inline="always")
def rectified_grad(output, grad, zero):
    """The gradient at the input: grad where the output is positive, else 0."""
    return zero if output <= zero else grad


@njit(nogil=True, cache=True)
def relu_(x, y):
    """y = max(x, 0), element by element."""
    zero = y.dtype.type(0)
    for i in range(x.size):
        y[i] = rectified(x[i], zero)


@njit(nogil=True, cache=True)
def relu_backward_(y, dy, dx):
    """dx = 0 where y <= 0, else dy (dx may be dy)."""
    zero = dx.dtype.type(0)
    for i in range(y.size):
        dx[i] = rectified_grad(y[i], dy[i], zero)
