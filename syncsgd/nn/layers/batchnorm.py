"""batchnorm: per feature (after a dense layer) or per channel (over N·H·W), as BatchNorm1d/2d.

Training, per channel c over the N values of its statistics group (this rank's shard: local; the
global batch: sync, the sums allreduced):
  mean = sum(x) / N,  var = sum((x - mean)^2) / N   (two passes, biased)
  zhat = (x - mean) / sqrt(var + eps),  y = weight zhat + bias
and backward, from g = dL/dy:
  d weight = sum(g zhat),  d bias = sum(g),
  dx = weight / sqrt(var + eps) (g - sum(g) / N - zhat sum(g zhat) / N)
The running statistics (running_mean, running_var: the unbiased variance) move with momentum m,
running = (1 - m) running + m batch, and evaluation normalises with them. docs/batchnorm.md
derives the backward pass and says what exact mode guarantees.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Param, Primitives

VALUE, CENTRED_SQUARE, PRODUCT = 0, 1, 2  # the term of a per-channel sum: a, (a - c)^2, a b


class BatchNorm(Layer):
    """Batch normalisation with a learned scale (weight) and shift (bias) per channel."""

    kind = "batchnorm"
    signature = "batchnorm"

    def params(self) -> list[Param]:
        """weight (C,) starting at 1, bias (C,) at 0."""
        channels = (self.in_shape[0],)
        return [Param("weight", channels, "ones"), Param("bias", channels, "zeros")]

    def buffers(self) -> list[Param]:
        """running_mean (C,) starting at 0, running_var (C,) at 1."""
        channels = (self.in_shape[0],)
        return [Param("running_mean", channels, "zeros"), Param("running_var", channels, "ones")]

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = weight zhat + bias, the statistics the group's (training) or the running ones."""
        x3, y3 = channels(x), channels(y)
        if not nx.group.training:
            inv_std = 1.0 / np.sqrt(p["running_var"].astype(np.float64) + nx.group.eps)
            normalise_(x3, p["running_mean"].astype(np.float64), inv_std, p["weight"],
                       p["bias"], y3, y3)  # fmt: skip
            nx.round_(y)
            return
        stats = nx.group.stats(self.position, Stats, x3.shape[1])
        stats.count = forward_sums_(nx, stats, x3)
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty group: no sample uses it
            stats.mean[:] = stats.forward[:-1] / stats.count
            stats.forward[:-1] = 0.0
            nx.agreed_sums_((CENTRED_SQUARE,), x3, x3, stats.mean, stats.forward[:-1])
            stats.forward[-1] = 0.0
            nx.group.sum_(stats.forward)
            variance = stats.forward[:-1] / stats.count  # biased: what the normalisation uses
            stats.inv_std[:] = 1.0 / np.sqrt(variance + nx.group.eps)
        normalise_(x3, stats.mean, stats.inv_std, p["weight"], p["bias"], stats.zhat(x3), y3)
        nx.round_(y)
        update_running_(p, stats, variance, nx.group.momentum)

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g.bias += sum(dy), g.weight += sum(dy zhat): this shard's, summed with the gradient
        later; the group's sums of both, which the input's gradient needs."""
        stats = nx.group.stats(self.position, Stats, x.shape[1])
        dy3 = channels(dy)
        n = dy3.shape[1]
        stats.backward[:] = 0.0
        nx.agreed_sums_((VALUE, PRODUCT), dy3, stats.zhat(dy3), stats.mean, stats.backward)
        nx.add_(g["bias"], stats.backward[:n])
        nx.add_(g["weight"], stats.backward[n:])
        nx.group.sum_(stats.backward)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = weight / sqrt(var + eps) (dy - mean(dy) - zhat mean(dy zhat)), the group's means."""
        stats = nx.group.stats(self.position, Stats, x.shape[1])
        dy3 = channels(dy)
        n = dy3.shape[1]
        with np.errstate(invalid="ignore", divide="ignore"):
            means = stats.backward / stats.count
        scale = p["weight"] * stats.inv_std
        normalise_backward_(dy3, stats.zhat(dy3), scale, means[:n], means[n:], channels(dx))
        nx.round_(dx)


class Stats:
    """One batchnorm layer's statistics of the current step (float64, per channel)."""

    def __init__(self, width: int) -> None:
        self.forward = np.zeros(width + 1)  # the sum, then the count; reused for the squares
        self.backward = np.zeros(2 * width)  # sum of g, then sum of g zhat
        self.mean = np.zeros(width)
        self.inv_std = np.zeros(width)
        self.count = 0.0  # N: the values each channel's statistics are over
        self._zhat = np.zeros(0)

    def zhat(self, like: np.ndarray) -> np.ndarray:
        """The normalised values of the pass, shaped as `like` (m, C, S); grown once if needed."""
        if self._zhat.size < like.size or self._zhat.dtype != like.dtype:
            self._zhat = np.zeros(like.size, like.dtype)
        return self._zhat[: like.size].reshape(like.shape)


def channels(values: np.ndarray) -> np.ndarray:
    """An (m, C, S) view of an (m, C, ...) block: S = 1 after a dense layer, H·W after a conv."""
    return values.reshape(values.shape[0], values.shape[1], math.prod(values.shape[2:]))


def forward_sums_(nx: Primitives, stats: Stats, x3: np.ndarray) -> float:
    """The per-channel sums of x and their count, over the group; returns N."""
    stats.forward[:] = 0.0
    nx.agreed_sums_((VALUE,), x3, x3, stats.mean, stats.forward[:-1])
    stats.forward[-1] = x3.shape[0] * x3.shape[2]  # the count travels with the sum: N, any P
    nx.group.sum_(stats.forward)
    return float(stats.forward[-1])


def update_running_(p: dict[str, np.ndarray], stats: Stats, variance: np.ndarray,
                    momentum: float) -> None:  # fmt: skip
    """PyTorch's update: running = (1 - m) running + m batch, the variance unbiased."""
    # A group of one value has no unbiased variance: its running variance stays (PyTorch refuses
    # such a batch in training); an empty group changes nothing.
    count = stats.count
    if count < 1:
        return
    mean, var = p["running_mean"], p["running_var"]
    mean[:] = (1 - momentum) * mean + momentum * stats.mean
    if count >= 2:
        var[:] = (1 - momentum) * var + momentum * (variance * (count / (count - 1)))


@njit(nogil=True, cache=True)
def normalise_(x, mean, inv_std, weight, bias, zhat, y):
    """zhat = (x - mean) inv_std; y = weight zhat + bias (zhat may be y: evaluation)."""
    m, c, s = x.shape
    for i in range(m):
        for j in range(c):
            for k in range(s):
                zhat[i, j, k] = (np.float64(x[i, j, k]) - mean[j]) * inv_std[j]
                y[i, j, k] = weight[j] * zhat[i, j, k] + bias[j]


@njit(nogil=True, cache=True)
def normalise_backward_(g, zhat, scale, mean_g, mean_gzhat, dx):
    """dx = scale (g - mean_g - zhat mean_gzhat), scale = weight / sqrt(var + eps)."""
    m, c, s = g.shape
    for i in range(m):
        for j in range(c):
            for k in range(s):
                centred = np.float64(g[i, j, k]) - mean_g[j] - np.float64(zhat[i, j, k]) * (
                    mean_gzhat[j])  # fmt: skip
                dx[i, j, k] = scale[j] * centred
