"""avgpool(k, stride=k): the mean of each k x k window, as torch.nn.AvgPool2d.

No padding; output (C, H', W'), H' = (H - k) // stride + 1. The window summed in row-major order,
then divided by k·k; backward: each input of a window receives dy / (k·k). Both are new values:
rounded in narrow modes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Primitives
from syncsgd.nn.layers.maxpool import Pool


class AvgPool(Pool):
    """Average pooling over k x k windows, as torch.nn.AvgPool2d (no padding)."""

    kind = "avgpool"
    signature = "avgpool(k, stride=k)"

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(sum of the window / (k k))."""
        avg_pool_(x, self.k, self.stride, y)
        nx.round_(y)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(sum over the windows holding each input of dy / (k k))."""
        avg_pool_backward_(dy, self.k, self.stride, dx)
        nx.round_(dx)

    def describe(self) -> str:
        """avgpool(k) or avgpool(k, stride=s)."""
        return f"avgpool({self.k}" + (f", stride={self.stride})" if self.stride != self.k else ")")


@njit(nogil=True, cache=True)
def avg_pool_(x, k, stride, y):
    """y[n, c, i, j] = the window's sum in row-major order, divided by k k."""
    m, channels, out_h, out_w = y.shape
    count = y.dtype.type(k * k)
    for n in range(m):
        for c in range(channels):
            for i in range(out_h):
                for j in range(out_w):
                    total = y.dtype.type(0)
                    for a in range(k):
                        for b in range(k):
                            total += x[n, c, i * stride + a, j * stride + b]
                    y[n, c, i, j] = total / count


@njit(nogil=True, cache=True)
def avg_pool_backward_(dy, k, stride, dx):
    """dx = 0; every input of window (i, j) += dy[n, c, i, j] / (k k)."""
    m, channels, out_h, out_w = dy.shape
    count = dx.dtype.type(k * k)
    for n in range(m):
        for c in range(channels):
            dx[n, c] = 0
            for i in range(out_h):
                for j in range(out_w):
                    share = dy[n, c, i, j] / count
                    for a in range(k):
                        for b in range(k):
                            dx[n, c, i * stride + a, j * stride + b] += share
