"""layernorm: over the last axis, position by position, as torch.nn.LayerNorm(width).

Per row x of width D (one position of one sample):
  mean = sum(x) / D,  var = sum((x - mean)^2) / D   (two passes in float64, in index order)
  xhat = (x - mean) / sqrt(var + eps),  y = weight xhat + bias
and backward, from g = dL/dy, with gh = weight g:
  d weight = sum over rows of g xhat,  d bias = sum over rows of g,
  dx = (gh - mean(gh) - xhat mean(gh xhat)) / sqrt(var + eps)
Each row's statistics are its own: a sample's output does not depend on the samples beside it.
Float mode (`nx.free_order`) takes each row's sums in any order (`free_layer_norm_`, vectorised).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.layers.base import Layer, Param, Primitives, rows

EPS = 1e-5


class LayerNorm(Layer):
    """Layer normalisation of each position's features, with a learned weight and bias."""

    kind = "layernorm"
    signature = "layernorm"

    def params(self) -> list[Param]:
        """weight (D,) starting at 1, bias (D,) at 0."""
        width = (self.in_shape[-1],)
        return [Param("weight", width, "ones"), Param("bias", width, "zeros")]

    def _arrays(self, nx: Primitives, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(xhat as rows, 1 / sqrt(var + eps) per row) of the pass under way."""
        spaces, n = self.workspaces(nx), x.size // self.in_shape[-1]
        return (spaces.keep("xhat", (n, self.in_shape[-1]), x.dtype),
                spaces.keep("inv_std", (n,), np.float64))  # fmt: skip

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(weight xhat + bias)."""
        xhat, inv_std = self._arrays(nx, x)
        width = self.in_shape[-1]
        kernel = free_layer_norm_ if nx.free_order else layer_norm_
        kernel(rows(x, width), p["weight"], p["bias"], EPS, xhat, inv_std, rows(y, width))
        nx.round_(y)

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g.weight += sum of dy xhat, g.bias += sum of dy, over every position of the samples."""
        xhat, _ = self._arrays(nx, x)
        d = rows(dy, self.in_shape[-1])
        product = self.workspaces(nx).get("dy_xhat", xhat.shape, d.dtype)  # exact mode reads
        np.multiply(d, xhat, out=product)  # it after the pass: a workspace of its own
        positions = shape_size(self.in_shape[:-1])  # rows per sample
        nx.column_sum_(self.position, product, g["weight"], positions)
        nx.column_sum_(self.position, d, g["bias"], positions)

    def inner_size(self) -> int:
        """xhat, dy xhat and a statistic per position."""
        return 2 * shape_size(self.in_shape) + shape_size(self.in_shape[:-1])

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """xhat, and 1 / sqrt(var + eps) per position in float64."""
        return m * (shape_size(self.in_shape) * itemsize + shape_size(self.in_shape[:-1]) * 8)

    def scratch_bytes(self, m: int, itemsize: int) -> int:
        """dy xhat, whose column sums are the weight's."""
        return m * shape_size(self.in_shape) * itemsize

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round((gh - mean(gh) - xhat mean(gh xhat)) / sqrt(var + eps)), gh = weight dy."""
        xhat, inv_std = self._arrays(nx, x)
        width = self.in_shape[-1]
        kernel = free_layer_norm_backward_ if nx.free_order else layer_norm_backward_
        kernel(rows(dy, width), xhat, inv_std, p["weight"], rows(dx, width))
        nx.round_(dx)


@njit(nogil=True, cache=True)
def layer_norm_(x, weight, bias, eps, xhat, inv_std, y):
    """Row by row: xhat = (x - mean) / sqrt(var + eps), y = weight xhat + bias."""
    n, width = x.shape
    for i in range(n):
        total = 0.0
        for j in range(width):
            total += np.float64(x[i, j])
        mean = total / width
        squares = 0.0
        for j in range(width):
            centred = np.float64(x[i, j]) - mean
            squares += centred * centred
        inv = 1.0 / np.sqrt(squares / width + eps)
        inv_std[i] = inv
        for j in range(width):
            xhat[i, j] = (np.float64(x[i, j]) - mean) * inv
            y[i, j] = weight[j] * xhat[i, j] + bias[j]


@njit(nogil=True, cache=True)
def layer_norm_backward_(dy, xhat, inv_std, weight, dx):
    """Row by row: dx = (gh - mean(gh) - xhat mean(gh xhat)) inv_std, gh = weight dy."""
    n, width = dy.shape
    for i in range(n):
        mean_g, mean_gx = 0.0, 0.0
        for j in range(width):
            gh = np.float64(weight[j]) * np.float64(dy[i, j])
            mean_g += gh
            mean_gx += gh * np.float64(xhat[i, j])
        mean_g /= width
        mean_gx /= width
        for j in range(width):
            gh = np.float64(weight[j]) * np.float64(dy[i, j])
            dx[i, j] = (gh - mean_g - np.float64(xhat[i, j]) * mean_gx) * inv_std[i]


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # the sums in any order: they vectorise
def free_layer_norm_(x, weight, bias, eps, xhat, inv_std, y):
    """layer_norm_, each row's two sums in float64 in any order."""
    n, width = x.shape
    for i in range(n):
        total = 0.0
        for j in range(width):
            total += np.float64(x[i, j])
        mean = total / width
        squares = 0.0
        for j in range(width):
            centred = np.float64(x[i, j]) - mean
            squares += centred * centred
        inv = 1.0 / np.sqrt(squares / width + eps)
        inv_std[i] = inv
        for j in range(width):
            value = (np.float64(x[i, j]) - mean) * inv
            xhat[i, j] = value
            y[i, j] = weight[j] * value + bias[j]


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # the sums in any order: they vectorise
def free_layer_norm_backward_(dy, xhat, inv_std, weight, dx):
    """layer_norm_backward_, each row's two sums in float64 in any order."""
    n, width = dy.shape
    for i in range(n):
        mean_g, mean_gx = 0.0, 0.0
        for j in range(width):
            gh = np.float64(weight[j]) * np.float64(dy[i, j])
            mean_g += gh
            mean_gx += gh * np.float64(xhat[i, j])
        mean_g /= width
        mean_gx /= width
        for j in range(width):
            gh = np.float64(weight[j]) * np.float64(dy[i, j])
            dx[i, j] = (gh - mean_g - np.float64(xhat[i, j]) * mean_gx) * inv_std[i]
