"""tanh: y = tanh(x); its gradient dy (1 - y^2)."""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Primitives


class Tanh(Layer):
    """The hyperbolic tangent, element by element, rounded to the format in narrow modes."""

    kind = "tanh"
    signature = "tanh"
    in_place, reads_output = True, True

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(tanh(x))."""
        tanh_(x.reshape(-1), y.reshape(-1))
        nx.round_(y)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(dy (1 - y^2))."""
        tanh_backward_(y.reshape(-1), dy.reshape(-1), dx.reshape(-1))
        nx.round_(dx)


@njit(nogil=True, cache=True)
def tanh_(x, y):
    """y = tanh(x), element by element."""
    for i in range(x.size):
        y[i] = np.tanh(x[i])


@njit(nogil=True, cache=True)
def tanh_backward_(y, dy, dx):
    """dx = dy (1 - y^2), element by element."""
    one = dx.dtype.type(1)
    for i in range(y.size):
        dx[i] = dy[i] * (one - y[i] * y[i])
