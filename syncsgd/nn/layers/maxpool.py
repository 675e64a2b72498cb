"""maxpool(k, stride=k): the largest value of each k x k window, as torch.nn.MaxPool2d.

No padding; output (C, H', W'), H' = (H - k) // stride + 1. A tie goes to the first maximum in
the window's row-major order, and a NaN wins, as PyTorch's kernel. The forward pass records where
each maximum is (an int32 workspace per numerics, grown once, as conv's); the backward pass
scatters the gradient there. No new value is formed, so nothing is rounded, unless windows overlap
(stride < k): then the gradients that meet at one input are a sum, rounded in narrow modes.

After a relu that the layer before absorbed (`take_mask`), the pool applies the relu's mask too:
a window whose maximum is not positive (so all its values are 0) records no maximum (-1), and
its gradient lands nowhere; elsewhere the maximum is positive and the relu passes its gradient.
The gradient at the input is the one the relu's own pass would give, bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.layers.base import Layer, Primitives, Shape
from syncsgd.nn.layers.conv import Workspaces, window_positions


class Pool(Layer):
    """What max and average pooling share: k x k windows every `stride`, no padding."""

    def __init__(self, k: int, stride: int | None = None) -> None:
        super().__init__()
        self.k, self.stride = k, k if stride is None else stride
        if self.k < 1 or self.stride < 1:
            raise ValueError(f"{self.describe()}: k and stride must be >= 1")

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """(C, H', W') of a (C, H, W) input."""
        return (in_shape[0], *window_positions(self.describe(), in_shape, self.k, self.stride,
                                               0))  # fmt: skip


class MaxPool(Pool):
    """Max pooling over k x k windows, as torch.nn.MaxPool2d (no padding)."""

    kind = "maxpool"
    signature = "maxpool(k, stride=k)"

    def __init__(self, k: int, stride: int | None = None) -> None:
        super().__init__(k, stride)
        self.masks = False  # True: its input is a relu's output, whose mask it applies

    def take_mask(self) -> bool:
        """It applies the mask of the relu before it: windows whose maximum is not positive pass
        no gradient."""
        self.masks = True
        return True

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = the maximum of each window; where it is, recorded."""
        where = nx.group.stats(self.position, Workspaces, 0).keep("argmax", y.shape, self._index())
        max_pool_(x, self.k, self.stride, self.masks, y, where)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = 0, then each window's dy added at its maximum (none where it recorded -1)."""
        where = nx.group.stats(self.position, Workspaces, 0).keep("argmax", y.shape, self._index())
        max_pool_backward_(dy, where, self.k, self.stride, dx)
        if self.stride < self.k:
            nx.round_(dx)

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """Where each window's maximum is: an index per output value."""
        return m * shape_size(self.out_shape) * np.dtype(self._index()).itemsize

    def _index(self) -> type:
        """The dtype of the maxima's indices: int32 when a plane's indices fit (half the
        traffic), else int64."""
        return np.int32 if self.in_shape[1] * self.in_shape[2] < 2**31 else np.int64

    def describe(self) -> str:
        """maxpool(k) or maxpool(k, stride=s)."""
        return f"maxpool({self.k}" + (f", stride={self.stride})" if self.stride != self.k else ")")


@njit(nogil=True, cache=True)
def max_pool_(x, k, stride, masks, y, where):
    """y[n, c, i, j] = the window's maximum, where[n, c, i, j] = its index h W + w in the plane
    (-1 if `masks` and the maximum is not positive: the relu's mask)."""
    # Four times faster with the window's size a constant (and the stride, 2 x 2 windows every 2
    # twice as fast again): the common sizes get their own loops.
    if k == 2 and stride == 2:
        window_maxima_(x, 2, 2, masks, y, where)
    elif k == 2:
        window_maxima_(x, 2, stride, masks, y, where)
    elif k == 3:
        window_maxima_(x, 3, stride, masks, y, where)
    else:
        window_maxima_(x, k, stride, masks, y, where)


@njit(nogil=True, cache=True, inline="always")
def window_maxima_(x, k, stride, masks, y, where):
    """max_pool_'s loops: the first maximum in row-major order wins, a NaN wins over numbers."""
    m, channels, out_h, out_w = y.shape
    width = x.shape[3]
    zero = x.dtype.type(0)
    for n in range(m):
        for c in range(channels):
            for i in range(out_h):
                for j in range(out_w):
                    top, left = i * stride, j * stride
                    best, index = x[n, c, top, left], top * width + left
                    for a in range(k):
                        for b in range(k):
                            value = x[n, c, top + a, left + b]
                            taken = value > best or value != value  # larger, or NaN
                            best = value if taken else best
                            index = (top + a) * width + left + b if taken else index
                    y[n, c, i, j] = best
                    # as the relu's gradient: none where its output is <= 0 (a NaN passes)
                    where[n, c, i, j] = -1 if masks and best <= zero else index


@njit(nogil=True, cache=True)
def max_pool_backward_(dy, where, k, stride, dx):
    """dx = 0; dx at each window's maximum += dy."""
    # Windows that tile the input (stride k) are written whole, without a pass of zeros first.
    if stride == k == 2:
        tiled_backward_(dy, where, 2, dx)
    elif stride == k:
        tiled_backward_(dy, where, k, dx)
    else:
        scattered_backward_(dy, where, dx)


@njit(nogil=True, cache=True, inline="always")
def tiled_backward_(dy, where, k, dx):
    """max_pool_backward_ for windows every k: each window's values dy at its maximum, else 0;
    the rows and columns no window covers, 0."""
    m, channels, out_h, out_w = dy.shape
    height, width = dx.shape[2], dx.shape[3]
    zero = dx.dtype.type(0)
    for n in range(m):
        for c in range(channels):
            for h in range(out_h * k, height):
                dx[n, c, h] = 0
            for i in range(out_h):
                for a in range(k):
                    h = i * k + a
                    line = dx[n, c, h]
                    for w in range(out_w * k, width):
                        line[w] = 0
                    for j in range(out_w):
                        index, value = where[n, c, i, j], zero + dy[n, c, i, j]  # as 0 += dy
                        for b in range(k):
                            w = j * k + b
                            line[w] = value if h * width + w == index else zero


@njit(nogil=True, cache=True)
def scattered_backward_(dy, where, dx):
    """max_pool_backward_'s loops for any windows: dx = 0, then each dy added at its maximum
    (none at -1)."""
    m, channels, out_h, out_w = dy.shape
    width = dx.shape[3]
    for n in range(m):
        for c in range(channels):
            dx[n, c] = 0
            for i in range(out_h):
                for j in range(out_w):
                    index = where[n, c, i, j]
                    if index >= 0:
                        dx[n, c, index // width, index % width] += dy[n, c, i, j]
