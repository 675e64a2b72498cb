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

Float mode (`nx.free_order`), whose sums may be taken in any order, runs its own kernels instead:
the patches of a few samples at a time (about PATCH_BYTES, so that they are still in the caches
when the product reads them), gathered again for the weight's sums rather than kept; the forward
product as rows (patches times W^T, the shape BLAS runs fastest), laid out NCHW with the bias and
an absorbed relu in the same pass; the weight's sums as (C·k·k, positions) x (positions, out)
products over the chunks' patches laid out by columns; the gradient at the input, sample by
sample, W^T times the sample's (out, H'·W') gradient, scattered back from the cache. On
CHANNELS_LAST or more input channels the patches come from a channels-last copy of each sample (k
runs of k·C contiguous values a patch, the weight permuted to match): the forward product as rows,
the weight's sums as dy times the rows, the gradient at the input as dy^T W's rows
added back onto the copy. A relu right after the conv is applied in its passes (`absorb`), in
every mode, with the relu's own bits; its mask in the backward pass by a max-pool after it
(`hand_mask`: from where the pool's forward pass found the maxima), then not by the conv.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from syncsgd.nn.gemm import gemm_add_
from syncsgd.nn.layers.base import IDENTITY, RELU, Layer, Param, Primitives, Shape, Workspaces
from syncsgd.nn.layers.relu import rectified, rectified_grad, relu_, relu_backward_

# float mode: the patches of a chunk of samples; short chunks (a sample of the Simple CNN's convs)
# ran its narrow products fastest (docs/measurements.md)
PATCH_BYTES = 1 << 17
# float mode: inputs of at least these channels gather their patches from a channels-last copy of
# each sample, k runs of k·C contiguous values a patch (docs/measurements.md)
CHANNELS_LAST = 8


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
        self.activation = IDENTITY  # RELU: the relu after it, applied in its passes (absorb)
        self.mask_handed = False  # True: the layer after that relu applies its mask backward

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

    def _padded_last_shape(self) -> tuple[int, int, int]:
        """(H + 2 pad, W + 2 pad, C): a padded sample, channels last."""
        channels, height, width = self._padded_shape()
        return height, width, channels

    def _padded_shape(self) -> tuple[int, int, int]:
        """(C, H + 2 pad, W + 2 pad): a sample with its padding, for float mode's kernels."""
        channels, height, width = self.in_shape
        return channels, height + 2 * self.pad, width + 2 * self.pad

    def _weight(self, p: dict[str, np.ndarray]) -> np.ndarray:
        """The weight as a (out, C·k·k) matrix (a view)."""
        return p["weight"].reshape(self.out_channels, -1)

    def absorb(self, following: Layer) -> bool:
        """A relu right after it is applied in its own passes (one pass fewer each way)."""
        if following.kind != "relu":
            return False
        self.activation = RELU
        return True

    def hand_mask(self, following: Layer) -> bool:
        """The layer after its absorbed relu (a max-pool) applies the relu's mask in its backward
        pass, if it can: then the conv's backward pass takes the gradient as it is."""
        self.mask_handed = self.activation == RELU and following.take_mask()
        return self.mask_handed

    def _backward_activation(self) -> int:
        """The element-wise function whose gradient its backward pass applies to dy."""
        return IDENTITY if self.mask_handed else self.activation

    def _chunk(self, itemsize: int) -> int:
        """Samples per chunk of float mode's patches: about PATCH_BYTES of them, at least one."""
        _, width, positions = self._sizes(1)
        return max(1, PATCH_BYTES // (positions * width * itemsize))

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(patches W^T + b), laid out NCHW: the bias after the product, one rounding;
        then the absorbed relu."""
        spaces = nx.group.stats(self.position, Workspaces, 0)
        if nx.free_order:  # the patches a chunk at a time, not kept
            self._free_forward_(spaces, p, x, y)
            return
        n_rows, width, _ = self._sizes(x.shape[0])
        cols = spaces.keep("cols", (n_rows, width), x.dtype)
        im2col_(x, self.kernel, self.stride, self.pad, cols)
        out = spaces.get("rows", (n_rows, self.out_channels), x.dtype)  # backward reuses it
        nx.matmul_(cols, self._weight(p), out, True)
        rows_to_channels_(out, p["bias"], y)
        nx.round_(y)
        if self.activation == RELU:
            relu_(y.reshape(-1), y.reshape(-1))

    def _planes_forward(self) -> bool:
        """Float mode's forward pass as W times a sample's patches by columns, landing NCHW: for
        patches no wider than the output channels (a first conv on one channel), where that
        product ran faster than the rows' (docs/measurements.md)."""
        return self._sizes(1)[1] <= self.out_channels

    def _channels_last(self) -> bool:
        """Float mode's patches from a channels-last copy of each sample (rows of k runs of k·C
        contiguous values), for inputs of at least CHANNELS_LAST channels."""
        return not self._planes_forward() and self.in_shape[0] >= CHANNELS_LAST

    def _last_weight(self, spaces: Workspaces, p: dict[str, np.ndarray]) -> np.ndarray:
        """The weight as (out, k·k·C), channels last: the channels-last patches' order."""
        _, width, _ = self._sizes(1)
        last = spaces.get("weight last", (self.out_channels, width), p["weight"].dtype)
        channels_last_weight_(p["weight"], last)
        return last

    def _free_forward_(self, spaces: Workspaces, p: dict[str, np.ndarray], x: np.ndarray,
                       y: np.ndarray) -> None:  # fmt: skip
        """Float mode's forward pass, a chunk of samples (or one, by columns) at a time."""
        if self._planes_forward():
            _, width, positions = self._sizes(1)
            columns = spaces.get("columns", (width, positions), x.dtype)  # the sums' too
            padded = spaces.get("padded", (1, *self._padded_shape()), x.dtype)
            conv_forward_planes_(x, self._weight(p), p["bias"], self.kernel, self.stride,
                                 self.pad, self.activation, padded, columns, y)  # fmt: skip
            return
        chunk = self._chunk(x.itemsize)
        n_rows, width, _ = self._sizes(chunk)
        cols = spaces.get("cols", (n_rows, width), x.dtype)
        out = spaces.get("rows", (n_rows, self.out_channels), x.dtype)
        if self._channels_last():
            padded = spaces.get("padded last", self._padded_last_shape(), x.dtype)
            conv_forward_last_(x, self._last_weight(spaces, p), p["bias"], self.kernel,
                               self.stride, self.pad, self.activation, chunk, padded, cols, out,
                               y)  # fmt: skip
            return
        conv_forward_(x, self._weight(p), p["bias"], self.kernel, self.stride, self.pad,
                      self.activation, chunk, cols, out, y)  # fmt: skip

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """dy through the absorbed relu (in place, unless the layer above applied its mask);
        g.weight += dy_rows^T patches, g.bias += column sums of dy_rows (H'·W' rows a sample)."""
        n_rows, width, positions = self._sizes(x.shape[0])
        spaces = nx.group.stats(self.position, Workspaces, 0)
        if nx.free_order:
            self._free_sums_(nx, spaces, g, x, y, dy)
            return
        if self._backward_activation() == RELU:
            relu_backward_(y.reshape(-1), dy.reshape(-1), dy.reshape(-1))
        d = spaces.get("rows", (n_rows, self.out_channels), dy.dtype)
        channels_to_rows_(dy, d)
        cols = spaces.keep("cols", (n_rows, width), x.dtype)  # the forward pass's patches
        weight_sum = nx.sparse_outer_sum_ if self.activation == RELU else nx.outer_sum_
        weight_sum(self.position, d, cols, g["weight"].reshape(self.out_channels, -1), positions)
        nx.column_sum_(self.position, d, g["bias"], positions)

    def _free_sums_(self, nx: Primitives, spaces: Workspaces, g: dict[str, np.ndarray],
                    x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """Float mode's sums, chunk by chunk of samples, then added into g."""
        chunk = self._chunk(x.itemsize)
        n_columns, width, _ = self._sizes(chunk)
        # a sample a chunk: its gradient, through the relu in place, is already (out, H'W')
        d = spaces.get("dcolumns", (self.out_channels * n_columns if chunk > 1 else 0,), dy.dtype)
        bias_sums = spaces.get("bias sums", (self.out_channels,), dy.dtype)
        if self._channels_last():
            weight_sums = spaces.get("weight sums", (self.out_channels, width), dy.dtype)
            cols = spaces.get("cols", (n_columns, width), x.dtype)
            padded = spaces.get("padded last", self._padded_last_shape(), x.dtype)
            conv_sums_last_(x, y, dy, self.kernel, self.stride, self.pad,
                            self._backward_activation(), chunk, padded, cols, d, weight_sums,
                            bias_sums)  # fmt: skip
            channels, k = self.in_shape[0], self.kernel  # (out, k, k, C) to (out, C, k, k)
            nx.add_(g["weight"], weight_sums.reshape(-1, k, k, channels).transpose(0, 3, 1, 2))
        else:
            weight_sums = spaces.get("weight sums", (width, self.out_channels), dy.dtype)
            columns = spaces.get("columns", (n_columns * width,), x.dtype)
            padded = spaces.get("padded", (chunk, *self._padded_shape()), x.dtype)
            conv_sums_(x, y, dy, self.kernel, self.stride, self.pad, self._backward_activation(),
                       chunk, padded, columns, d, weight_sums, bias_sums)  # fmt: skip
            nx.add_(g["weight"].reshape(self.out_channels, -1), weight_sums.T)
        nx.add_(g["bias"], bias_sums)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(col2im(dy_rows W)): from what backward_sums_ laid out (it runs first)."""
        n_rows, width, positions = self._sizes(x.shape[0])
        spaces = nx.group.stats(self.position, Workspaces, 0)
        if nx.free_order and self._channels_last():
            dcols = spaces.get("sample columns", (positions, width), dy.dtype)
            padded = spaces.get("padded last", self._padded_last_shape(), dy.dtype)
            conv_input_grad_last_(dy, self._last_weight(spaces, p), self.kernel, self.stride,
                                  self.pad, dcols, padded, dx)  # fmt: skip
            return
        if nx.free_order:
            columns = spaces.get("sample columns", (width, positions), dy.dtype)
            padded = spaces.get("padded", (1, *self._padded_shape()), dy.dtype)
            conv_input_grad_(dy, self._weight(p), self.kernel, self.stride, self.pad, columns,
                             padded[0], dx)  # fmt: skip
            return
        d = spaces.get("rows", (n_rows, self.out_channels), dy.dtype)
        dcols = spaces.get("dcols", (n_rows, width), dy.dtype)
        if self.activation == RELU:
            nx.sparse_matmul_(d, self._weight(p), dcols)
        else:
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

    def free_kept_bytes(self, m: int, itemsize: int) -> int:
        """Float mode's kernels keep nothing: the patches are gathered again for the sums."""
        return 0

    def free_scratch_bytes(self, m: int, itemsize: int) -> int:
        """Float mode's kernels: a chunk's patches and rows (forward, unless by columns), its
        patches by columns, its padded samples, their gradient (unless a sample a chunk), the
        weight's and the bias's sums (backward), and a sample's columns for the gradient at the
        input (but the first layer's). Channels last: the rows' patches serve the sums too, one
        padded sample, and the weight in their order."""
        chunk = self._chunk(itemsize)
        n_rows, width, positions = self._sizes(chunk)
        channels, height, breadth = self._padded_shape()
        forward = 0 if self._planes_forward() else n_rows * width + n_rows * self.out_channels
        if self._channels_last():
            patches = height * breadth * channels + self.out_channels * width
        else:
            patches = n_rows * width + chunk * channels * height * breadth
        values = (forward + patches
                  + (self.out_channels * n_rows if chunk > 1 else 0)
                  + self.out_channels * width + self.out_channels
                  + (width * positions if self.position else 0))  # fmt: skip
        return values * itemsize

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


# The gathers and scatters run four times faster when the kernel's size is a constant, faster
# again with a stride of 1 a constant too: each dispatches the common sizes to a copy of its loops
# compiled for them.
@njit(nogil=True, cache=True)
def im2col_(x, k, stride, pad, cols):
    """cols[(n H' + i) W' + j, (c k + a) k + b] = x[n, c, i stride + a - pad, j stride + b - pad],
    0 outside the input."""
    if k == 3 and stride == 1:
        gather_rows_(x, 3, 1, pad, cols)
    elif k == 5 and stride == 1:
        gather_rows_(x, 5, 1, pad, cols)
    elif k == 3:
        gather_rows_(x, 3, stride, pad, cols)
    elif k == 5:
        gather_rows_(x, 5, stride, pad, cols)
    else:
        gather_rows_(x, k, stride, pad, cols)


@njit(nogil=True, cache=True, inline="always")
def gather_rows_(x, k, stride, pad, cols):
    """im2col_'s loops."""
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
    if k == 3:
        scatter_rows_(dcols, 3, stride, pad, dx)
    elif k == 5:
        scatter_rows_(dcols, 5, stride, pad, dx)
    else:
        scatter_rows_(dcols, k, stride, pad, dx)


@njit(nogil=True, cache=True, inline="always")
def scatter_rows_(dcols, k, stride, pad, dx):
    """col2im_'s loops."""
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


# -- float mode's kernels: any order of sums, chunks of samples in the caches ---------------------


@njit(nogil=True, cache=True)
def rows_to_channels_act_(rows, bias, activation, y):
    """y[n, o, i, j] = act(rows[(n H' + i) W' + j, o] + bias[o])."""
    m, out, out_h, out_w = y.shape
    positions = out_h * out_w
    zero = y.dtype.type(0)
    for n in range(m):
        planes = y[n].reshape((out, positions))
        for r in range(positions):
            row = rows[n * positions + r]  # read along the row, written across the planes
            for o in range(out):
                value = row[o] + bias[o]
                planes[o, r] = rectified(value, zero) if activation == RELU else value


@njit(nogil=True, cache=True)
def conv_forward_(x, weight, bias, k, stride, pad, activation, chunk, cols, rows, y):
    """y = act(patches W^T + b), laid out NCHW, `chunk` samples at a time."""
    m = x.shape[0]
    positions = y.shape[2] * y.shape[3]
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        n_rows = (stop - start) * positions
        im2col_(x[start:stop], k, stride, pad, cols[:n_rows])
        np.dot(cols[:n_rows], weight.T, rows[:n_rows])
        rows_to_channels_act_(rows[:n_rows], bias, activation, y[start:stop])


@njit(nogil=True, cache=True)
def bias_act_(planes, bias, activation):
    """planes[o, r] = act(planes[o, r] + bias[o])."""
    zero = planes.dtype.type(0)
    for o in range(planes.shape[0]):
        for r in range(planes.shape[1]):
            value = planes[o, r] + bias[o]
            planes[o, r] = rectified(value, zero) if activation == RELU else value


@njit(nogil=True, cache=True)
def conv_forward_planes_(x, weight, bias, k, stride, pad, activation, padded, columns, y):
    """y[n] = act(W patches_n + b) sample by sample, the patches by columns: the product lands
    NCHW."""
    m, out, out_h, out_w = y.shape
    for n in range(m):
        im2col_columns_(x[n : n + 1], k, stride, pad, padded, columns)
        planes = y[n].reshape((out, out_h * out_w))
        np.dot(weight, columns, planes)
        bias_act_(planes, bias, activation)


@njit(nogil=True, cache=True)
def pad_(x, pad, padded):
    """padded = x with `pad` zeros around every plane."""
    m, channels, height, width = x.shape
    padded[...] = 0
    for n in range(m):
        for c in range(channels):
            for h in range(height):
                for w in range(width):
                    padded[n, c, h + pad, w + pad] = x[n, c, h, w]


@njit(nogil=True, cache=True)
def im2col_columns_(x, k, stride, pad, padded, columns):
    """columns[(c k + a) k + b, (n H' + i) W' + j] = x[n, c, i stride + a - pad, j stride + b -
    pad], 0 outside the input: the patches by columns (x padded into `padded` first)."""
    pad_(x, pad, padded)
    if k == 3 and stride == 1:
        gather_columns_(padded, 3, 1, columns)
    elif k == 5 and stride == 1:
        gather_columns_(padded, 5, 1, columns)
    elif k == 3:
        gather_columns_(padded, 3, stride, columns)
    elif k == 5:
        gather_columns_(padded, 5, stride, columns)
    else:
        gather_columns_(padded, k, stride, columns)


@njit(nogil=True, cache=True, inline="always")
def gather_columns_(padded, k, stride, columns):
    """im2col_columns_'s loops, over the padded input."""
    m, channels, height, width = padded.shape
    out_h, out_w = (height - k) // stride + 1, (width - k) // stride + 1
    positions = out_h * out_w
    for c in range(channels):
        for a in range(k):
            first = (c * k + a) * k
            for n in range(m):
                for i in range(out_h):
                    base, line = n * positions + i * out_w, padded[n, c, i * stride + a]
                    for b in range(k):  # along a column's row: Numba vectorises the copy
                        target = columns[first + b, base : base + out_w]
                        for j in range(out_w):
                            target[j] = line[j * stride + b]


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # the bias's sums in any order: they vectorise
def gradient_columns_(y, dy, activation, d, bias_sums):
    """dy through the relu in place (0 where y <= 0); bias_sums[o] += dy's values of channel o;
    d[o, n H'W' + r] = dy[n, o, r] unless d is empty (a sample a chunk: its dy is already so)."""
    m, out, out_h, out_w = dy.shape
    positions = out_h * out_w
    zero = dy.dtype.type(0)
    for n in range(m):
        for o in range(out):
            grads, outputs = dy[n, o].reshape(positions), y[n, o].reshape(positions)
            if activation == RELU:
                for r in range(positions):
                    grads[r] = rectified_grad(outputs[r], grads[r], zero)
            total = zero
            for r in range(positions):
                total += grads[r]
            bias_sums[o] += total
            if d.size:
                d[o, n * positions : (n + 1) * positions] = grads


@njit(nogil=True, cache=True)
def conv_sums_(x, y, dy, k, stride, pad, activation, chunk, padded, columns, d, weight_sums,
               bias_sums):  # fmt: skip
    """weight_sums = the sum over samples of patches_n (C·k·k, H'W') dy_n^T, bias_sums = dy's
    sums per channel, `chunk` samples at a time (dy through the relu first, in place)."""
    m, out, out_h, out_w = dy.shape
    positions, width = out_h * out_w, weight_sums.shape[0]
    bias_sums[:] = 0
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        n_columns = (stop - start) * positions
        part = columns[: width * n_columns].reshape((width, n_columns))
        im2col_columns_(x[start:stop], k, stride, pad, padded[: stop - start], part)
        if chunk == 1:
            grads = dy[start].reshape((out, n_columns))
            gradient_columns_(y[start:stop], dy[start:stop], activation, grads[:0], bias_sums)
        else:
            grads = d[: out * n_columns].reshape((out, n_columns))
            gradient_columns_(y[start:stop], dy[start:stop], activation, grads, bias_sums)
        if start == 0:
            np.dot(part, grads.T, weight_sums)
        else:
            gemm_add_(part, grads.T, weight_sums)


@njit(nogil=True, cache=True)
def col2im_columns_(columns, k, stride, pad, padded, dx):
    """dx = 0, then dx[c, i stride + a - pad, j stride + b - pad] += columns[(c k + a) k + b,
    i W' + j] inside the input: one sample's patches' gradient, laid out by columns, scattered
    onto `padded` (dx with `pad` around), whose inside is then dx."""
    padded[...] = 0
    if k == 3 and stride == 1:
        scatter_columns_(columns, 3, 1, padded)
    elif k == 5 and stride == 1:
        scatter_columns_(columns, 5, 1, padded)
    elif k == 3:
        scatter_columns_(columns, 3, stride, padded)
    elif k == 5:
        scatter_columns_(columns, 5, stride, padded)
    else:
        scatter_columns_(columns, k, stride, padded)
    channels, height, width = dx.shape
    for c in range(channels):
        for h in range(height):
            for w in range(width):
                dx[c, h, w] = padded[c, h + pad, w + pad]


@njit(nogil=True, cache=True, inline="always")
def scatter_columns_(columns, k, stride, padded):
    """col2im_columns_'s loops, onto the padded gradient."""
    channels, height, width = padded.shape
    out_h, out_w = (height - k) // stride + 1, (width - k) // stride + 1
    for c in range(channels):
        for a in range(k):
            first = (c * k + a) * k
            for i in range(out_h):
                base, h = i * out_w, i * stride + a
                for j in range(out_w):
                    for b in range(k):
                        padded[c, h, j * stride + b] += columns[first + b, base + j]


@njit(nogil=True, cache=True)
def conv_input_grad_(dy, weight, k, stride, pad, columns, padded, dx):
    """dx = col2im(W^T dy_n) sample by sample: the product's (C·k·k, H'W') in the caches."""
    m, out, out_h, out_w = dy.shape
    for n in range(m):
        np.dot(weight.T, dy[n].reshape((out, out_h * out_w)), columns)
        col2im_columns_(columns, k, stride, pad, padded, dx[n])


# -- float mode's channels-last kernels: a patch is k runs of k·C contiguous values ---------------


@njit(nogil=True, cache=True)
def channels_last_weight_(weight, last):
    """last[o, (a k + b) C + c] = weight[o, c, a, b]: the weight in the patches' order."""
    out, channels, k, _ = weight.shape
    for o in range(out):
        for a in range(k):
            for b in range(k):
                base = (a * k + b) * channels
                for c in range(channels):
                    last[o, base + c] = weight[o, c, a, b]


@njit(nogil=True, cache=True)
def pad_channels_last_(x, pad, padded):
    """padded[h + pad, w + pad, c] = x[c, h, w], 0 around: one sample, channels last."""
    channels, height, width = x.shape
    for h in range(pad):
        padded[h] = 0
        padded[padded.shape[0] - 1 - h] = 0
    for h in range(height):
        row = padded[h + pad]
        row[:pad] = 0
        row[pad + width :] = 0
        for c in range(channels):
            line = x[c, h]
            for w in range(width):
                row[w + pad, c] = line[w]


@njit(nogil=True, cache=True)
def gather_last_(padded, k, stride, cols):
    """cols[i W' + j, (a k + b) C + c] = padded[i stride + a, j stride + b, c]: a sample's patches
    as rows, each k copies of k·C contiguous values."""
    height, width, channels = padded.shape
    out_h, out_w = (height - k) // stride + 1, (width - k) // stride + 1
    run = k * channels
    flat = padded.reshape(-1)
    for i in range(out_h):
        for j in range(out_w):
            row = cols[i * out_w + j]
            for a in range(k):
                start, first = ((i * stride + a) * width + j * stride) * channels, a * run
                source, target = flat[start : start + run], row[first : first + run]
                for q in range(run):  # one loop over two slices: Numba vectorises it
                    target[q] = source[q]


@njit(nogil=True, cache=True)
def patches_last_(x, k, stride, pad, padded, cols):
    """cols = the patches of x's samples as rows, channels last, sample after sample."""
    positions = cols.shape[0] // x.shape[0]
    for n in range(x.shape[0]):
        pad_channels_last_(x[n], pad, padded)
        gather_last_(padded, k, stride, cols[n * positions : (n + 1) * positions])


@njit(nogil=True, cache=True)
def conv_forward_last_(x, weight_last, bias, k, stride, pad, activation, chunk, padded, cols,
                       rows, y):  # fmt: skip
    """y = act(patches W^T + b), laid out NCHW, `chunk` samples at a time, channels last."""
    m = x.shape[0]
    positions = y.shape[2] * y.shape[3]
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        n_rows = (stop - start) * positions
        patches_last_(x[start:stop], k, stride, pad, padded, cols[:n_rows])
        np.dot(cols[:n_rows], weight_last.T, rows[:n_rows])
        rows_to_channels_act_(rows[:n_rows], bias, activation, y[start:stop])


@njit(nogil=True, cache=True)
def conv_sums_last_(x, y, dy, k, stride, pad, activation, chunk, padded, cols, d, weight_sums,
                    bias_sums):  # fmt: skip
    """weight_sums = the sum over samples of dy_n (out, H'W') patches_n (H'W', k·k·C, channels
    last), bias_sums = dy's sums per channel, `chunk` samples at a time (dy through the relu
    first, in place)."""
    m, out, out_h, out_w = dy.shape
    positions = out_h * out_w
    bias_sums[:] = 0
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        n_rows = (stop - start) * positions
        patches_last_(x[start:stop], k, stride, pad, padded, cols[:n_rows])
        if chunk == 1:
            grads = dy[start].reshape((out, n_rows))
            gradient_columns_(y[start:stop], dy[start:stop], activation, grads[:0], bias_sums)
        else:
            grads = d[: out * n_rows].reshape((out, n_rows))
            gradient_columns_(y[start:stop], dy[start:stop], activation, grads, bias_sums)
        if start == 0:
            np.dot(grads, cols[:n_rows], weight_sums)  # both as they lie: the faster product
        else:
            gemm_add_(grads, cols[:n_rows], weight_sums)


@njit(nogil=True, cache=True)
def scatter_last_(dcols, k, stride, padded):
    """padded[i stride + a, j stride + b, c] += dcols[i W' + j, (a k + b) C + c]."""
    height, width, channels = padded.shape
    out_h, out_w = (height - k) // stride + 1, (width - k) // stride + 1
    run = k * channels
    flat = padded.reshape(-1)
    for i in range(out_h):
        for j in range(out_w):
            row = dcols[i * out_w + j]
            for a in range(k):
                start, first = ((i * stride + a) * width + j * stride) * channels, a * run
                target, source = flat[start : start + run], row[first : first + run]
                for q in range(run):
                    target[q] += source[q]


@njit(nogil=True, cache=True)
def unpad_channels_last_(padded, pad, dx):
    """dx[c, h, w] = padded[h + pad, w + pad, c]."""
    channels, height, width = dx.shape
    for c in range(channels):
        for h in range(height):
            for w in range(width):
                dx[c, h, w] = padded[h + pad, w + pad, c]


@njit(nogil=True, cache=True)
def conv_input_grad_last_(dy, weight_last, k, stride, pad, dcols, padded, dx):
    """dx = col2im(dy_n^T W) sample by sample, channels last: the product's (H'W', k·k·C) rows
    added onto a padded channels-last sample in the caches."""
    m, out, out_h, out_w = dy.shape
    for n in range(m):
        np.dot(dy[n].reshape((out, out_h * out_w)).T, weight_last, dcols)
        padded[...] = 0
        scatter_last_(dcols, k, stride, padded)
        unpad_channels_last_(padded, pad, dx[n])
