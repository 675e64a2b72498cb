"""gelu: y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, the exact form (torch.nn.GELU's default).

Its gradient: Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Primitives


class GELU(Layer):
    """The Gaussian error linear unit, element by element, rounded to the format in narrow modes."""

    kind = "gelu"
    signature = "gelu"

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(x Phi(x))."""
        gelu_(x.reshape(-1), y.reshape(-1))
        nx.round_(y)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(dy (Phi(x) + x phi(x)))."""
        gelu_backward_(x.reshape(-1), dy.reshape(-1), dx.reshape(-1))
        nx.round_(dx)


@njit(nogil=True, cache=True)
def gelu_(x, y):
    """y = x (1 + erf(x / sqrt 2)) / 2, element by element."""
    for i in range(x.size):
        value = np.float64(x[i])
        y[i] = 0.5 * value * (1.0 + math.erf(value / math.sqrt(2.0)))


@njit(nogil=True, cache=True)
def gelu_backward_(x, dy, dx):
    """dx = dy (Phi(x) + x phi(x)), element by element."""
    for i in range(x.size):
        value = np.float64(x[i])
        cdf = 0.5 * (1.0 + math.erf(value / math.sqrt(2.0)))
        pdf = math.exp(-0.5 * value * value) / math.sqrt(2.0 * math.pi)
        dx[i] = np.float64(dy[i]) * (cdf + value * pdf)
