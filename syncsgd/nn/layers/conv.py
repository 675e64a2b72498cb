"""conv(out_channels, kernel, stride=1, pad=0): a 2-D convolution of (C, H, W) samples, as Conv2d.

Square kernels; weight (out, C, k, k), bias (out,); output (out, H', W'),
H' = (H + 2 pad - k) // stride + 1. As im2col: each sample's patches are gathered into rows, one
per output position and C·k·k wide (zero padding); then the dense layer's product with the weight
seen as (out, C·k·k), the bias, the NCHW layout. Backward: the gradient at the output as rows
(m·H'·W', out); the weight's sum rows^T patches and the bias's column sums (H'·W' rows per sample);
the gradient at the input: rows times the weight, scattered back onto the input (col2im) sample by
sample in a fixed order, so that exact mode's bits do not depend on how the batch is split.

The workspaces (the patches, the rows, the patches' gradient) belong to the pass: exact mode
extracts its sums from them after the whole backward pass. The ranks' threads share one network,
so they are kept per numerics (`nx.group`, as batchnorm's statistics), grown once to the largest
micro-batch seen, in the dtype of x.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Param, Primitives, Shape, Workspaces


class Conv(Layer):
    """A 2-D convolution with square kernels, as torch.nn.Conv2d: im2col, then one product."""

    kind = "conv"
    signature = "conv(out_channels, kernel, stride=1, pad=0)"

    def __init__(self, out_channels: int, kernel: int, stride: int = 1, pad: int = 0) -> None:
        super().__init__()
        for name, value, low in (("out_channels", out_channels, 1), ("kernel", kernel, 1),
                                 ("stride", stride, 1), ("pad", pad, 0)):  # fmt: skip
            if value < low:
                raise ValueError(f"conv: {name} must be >= {low}, got {value}")
        self.out_channels, self.kernel, self.stride, self.pad = out_channels, kernel, stride, pad

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """(out_channels, H', W') of a (C, H, W) input."""
        return (self.out_channels, *window_positions(self.describe(), in_shape, self.kernel,
                                                     self.stride, self.pad))  # fmt: skip

    def model_width(self) -> int:
        """Its output channels."""
        return self.out_channels

    def params(self) -> list[Param]:
        """weight (out, C, k, k) and bias (out,), both U(±1/sqrt(C·k·k)) as PyTorch starts them."""
        fan_in = self.in_shape[0] * self.kernel * self.kernel
        bound = 1.0 / math.sqrt(fan_in)
        return [Param("weight", (self.out_channels, self.in_shape[0], self.kernel, self.kernel),
                      "uniform", bound),
                Param("bias", (self.out_channels,), "uniform", bound)]  # fmt: skip

    def _sizes(self, m: int) -> tuple[int, int, int]:
        """(rows of the pass: m·H'·W', patch width C·k·k, output positions per sample H'·W')."""
        positions = self.out_shape[1] * self.out_shape[2]
        return m * positions, self.in_shape[0] * self.kernel * self.kernel, positions

    def _weight(self, p: dict[str, np.ndarray]) -> np.ndarray:
        """The weight as a (out, C·k·k) matrix (a view)."""
        return p["weight"].reshape(self.out_channels, -1)

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(patches W^T + b), laid out NCHW: the bias after the product, one rounding."""
        n_rows, width, _ = self._sizes(x.shape[0])
        spaces = nx.group.stats(self.position, Workspaces, 0)
        cols = spaces.keep("cols", (n_rows, width), x.dtype)
        im2col_(x, self.kernel, self.stride, self.pad, cols)
        out = spaces.get("rows", (n_rows, self.out_channels), x.dtype)  # backward reuses it
        nx.matmul_(cols, self._weight(p), out, True)
        rows_to_channels_(out, p["bias"], y)
        nx.round_(y)

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g.weight += dy_rows^T patches, g.bias += column sums of dy_rows (H'·W' rows a sample)."""
        n_rows, width, positions = self._sizes(x.shape[0])
        spaces = nx.group.stats(self.position, Workspaces, 0)
        d = spaces.get("rows", (n_rows, self.out_channels), dy.dtype)
        channels_to_rows_(dy, d)
        cols = spaces.keep("cols", (n_rows, width), x.dtype)  # the forward pass's patches
        nx.outer_sum_(self.position, d, cols, g["weight"].reshape(self.out_channels, -1),
                      positions)  # fmt: skip
        nx.column_sum_(self.position, d, g["bias"], positions)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(col2im(dy_rows W)): the rows backward_sums_ laid out (it runs first)."""
        n_rows, width, _ = self._sizes(x.shape[0])
        spaces = nx.group.stats(self.position, Workspaces, 0)
        d = spaces.get("rows", (n_rows, self.out_channels), dy.dtype)
        dcols = spaces.get("dcols", (n_rows, width), dy.dtype)
        nx.matmul_(d, self._weight(p), dcols, False)
        col2im_(dcols, self.kernel, self.stride, self.pad, dx)
        nx.round_(dx)

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """The patches, which the weight's sums read."""
        n_rows, width, _ = self._sizes(m)
        return n_rows * width * itemsize

    def scratch_bytes(self, m: int, itemsize: int) -> int:
        """The output's rows (the gradient's, backward) and the patches' gradient (none for
        the first layer, whose input has no gradient)."""
        n_rows, width, _ = self._sizes(m)
        return n_rows * (self.out_channels + (width if self.position else 0)) * itemsize

    def multiply_adds(self) -> int:
        """H'·W' output positions x C·k·k x out_channels per sample: im2col's product."""
        _, width, positions = self._sizes(1)
        return positions * width * self.out_channels

    def describe(self) -> str:
        """conv(out_channels, kernel, stride=..., pad=...), the defaults left out."""
        extra = (f", stride={self.stride}" if self.stride != 1 else "") + (
            f", pad={self.pad}" if self.pad else "")  # fmt: skip
        return f"conv({self.out_channels}, {self.kernel}{extra})"


def window_positions(what: str, in_shape: Shape, kernel: int, stride: int,
                     pad: int) -> tuple[int, int]:  # fmt: skip
    """(H', W') of a window sliding over a (C, H, W) input; ValueError if none fits."""
    if len(in_shape) != 3:
        raise ValueError(f"{what} needs (channels, height, width) samples, got shape {in_shape}: "
                         "give the input's shape (--input-shape C,H,W)")  # fmt: skip
    _, height, width = in_shape
    if height + 2 * pad < kernel or width + 2 * pad < kernel:
        raise ValueError(f"{what}: a {kernel}x{kernel} window does not fit an input of "
                         f"{height}x{width} (padding {pad})")  # fmt: skip
    return (height + 2 * pad - kernel) // stride + 1, (width + 2 * pad - kernel) // stride + 1


@njit(nogil=True, cache=True)
def im2col_(x, k, stride, pad, cols):
    """cols[(n H' + i) W' + j, (c k + a) k + b] = x[n, c, i stride + a - pad, j stride + b - pad],
    0 outside the input."""
    m, channels, height, width = x.shape
    per_sample = cols.shape[0] // max(m, 1)
    out_w = (width + 2 * pad - k) // stride + 1
    zero = cols.dtype.type(0)
    for n in range(m):
        for r in range(per_sample):
            i, j = r // out_w, r % out_w
            row = n * per_sample + r
            for c in range(channels):
                for a in range(k):
                    h = i * stride + a - pad
                    for b in range(k):
                        w = j * stride + b - pad
                        q = (c * k + a) * k + b
                        if 0 <= h < height and 0 <= w < width:
                            cols[row, q] = x[n, c, h, w]
                        else:
                            cols[row, q] = zero


@njit(nogil=True, cache=True)
def col2im_(dcols, k, stride, pad, dx):
    """dx = 0, then dx[n, c, i stride + a - pad, j stride + b - pad] += dcols[row, (c k + a) k + b]
    inside the input: sample by sample, in the same order whatever the samples beside it."""
    m, channels, height, width = dx.shape
    per_sample = dcols.shape[0] // max(m, 1)
    out_w = (width + 2 * pad - k) // stride + 1
    zero = dx.dtype.type(0)
    for n in range(m):
        for c in range(channels):
            for h in range(height):
                for w in range(width):
                    dx[n, c, h, w] = zero
        for r in range(per_sample):
            i, j = r // out_w, r % out_w
            row = n * per_sample + r
            for c in range(channels):
                for a in range(k):
                    h = i * stride + a - pad
                    if h < 0 or h >= height:
                        continue
                    for b in range(k):
                        w = j * stride + b - pad
                        if 0 <= w < width:
                            dx[n, c, h, w] += dcols[row, (c * k + a) * k + b]


@njit(nogil=True, cache=True)
def rows_to_channels_(rows, bias, y):
    """y[n, o, i, j] = rows[(n H' + i) W' + j, o] + bias[o]."""
    m, out, out_h, out_w = y.shape
    for n in range(m):
        for o in range(out):
            for i in range(out_h):
                for j in range(out_w):
                    y[n, o, i, j] = rows[(n * out_h + i) * out_w + j, o] + bias[o]


@njit(nogil=True, cache=True)
def channels_to_rows_(dy, rows):
    """rows[(n H' + i) W' + j, o] = dy[n, o, i, j]."""
    m, out, out_h, out_w = dy.shape
    for n in range(m):
        for i in range(out_h):
            for j in range(out_w):
                for o in range(out):
                    rows[(n * out_h + i) * out_w + j, o] = dy[n, o, i, j]
