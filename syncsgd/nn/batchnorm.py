"""BatchNorm's Numba kernels: per-feature sums over a micro-batch, normalisation, backward.

A hidden layer with BatchNorm computes, per feature j over the N samples of its statistics group
(the rank's shard, or the global batch when the sums are allreduced):
  z = x W + b,  mean = sum(z) / N,  var = sum((z - mean)^2) / N   (two passes, biased)
  zhat = (z - mean) / sqrt(var + eps),  h = act(gamma zhat + beta)
and backward, from g = d(sum of losses)/d(gamma zhat + beta):
  d gamma = sum(g zhat),  d beta = sum(g),
  dz = gamma / sqrt(var + eps) (g - sum(g) / N - zhat sum(g zhat) / N)
The kernels return sums, never means: the caller allreduces them before dividing by N. Every sum
is of one of three per-element terms (`term`), so one kernel sums any of them in float mode and
one extracts any of them at an agreed fixed point in exact mode (as `syncsgd.nn.exact` does for
the gradient): exact sums do not depend on how the samples are split. docs/batchnorm.md derives
the backward and states what exact mode guarantees.

This module compiles functions of `syncsgd.nn.kernels` and `syncsgd.nn.exact` into its own
kernels: after editing those, delete syncsgd/nn/__pycache__ (Numba's cache keys a function on
its own file only).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.exact import (
    MAX_EXPONENT,
    MIN_EXPONENT,
    ExactGradient,
    fixed_order_product_,
    peaks_,
)
from syncsgd.nn.kernels import (
    RELU,
    add_bias_activate_,
    layer_rows,
    matrix,
    times_slope_,
)
from syncsgd.nn.mlp import MLP

VALUE, CENTRED_SQUARE, PRODUCT = 0, 1, 2  # the term of a per-feature sum: a, (a - c)^2, a b


@njit(nogil=True, cache=True, inline="always")
def term(a, b, c, kind, i, j):
    """Sample i's term of feature j's sum, in float64."""
    value = np.float64(a[i, j])
    if kind == CENTRED_SQUARE:
        centred = value - c[j]
        return centred * centred
    if kind == PRODUCT:
        return value * np.float64(b[i, j])
    return value


@njit(nogil=True, cache=True)
def column_sums_(a, b, c, kind, out):
    """out[j] = sum over samples i, in sample order, of the term; float mode."""
    m, n = a.shape
    for j in range(n):
        out[j] = 0.0
    for i in range(m):
        for j in range(n):
            out[j] += term(a, b, c, kind, i, j)


@njit(nogil=True, cache=True)
def column_peaks_(a, b, c, kind, out):
    """out[j] = max over samples of |term|; inf where a term is NaN or infinite (0 if empty)."""
    m, n = a.shape
    for j in range(n):
        out[j] = 0.0
    for i in range(m):
        for j in range(n):
            magnitude = abs(term(a, b, c, kind, i, j))
            if not magnitude <= out[j]:  # larger, or NaN
                out[j] = magnitude if magnitude < np.inf else np.inf


@njit(nogil=True, cache=True)
def extract_column_sums_(a, b, c, kind, magics, out):
    """out[j] = sum over samples of hi(term), hi(v) = (magic_j + v) - magic_j: exact, any order."""
    m, n = a.shape
    for j in range(n):
        out[j] = 0.0
    for i in range(m):
        for j in range(n):
            out[j] += (magics[j] + term(a, b, c, kind, i, j)) - magics[j]


@njit(nogil=True, cache=True)
def normalise_activate_(z, mean, inv_std, gamma, beta, zhat, activation):
    """zhat = (z - mean) inv_std; z = act(gamma zhat + beta), in place: z becomes h."""
    m, n = z.shape
    zero = z.dtype.type(0)
    for i in range(m):
        for j in range(n):
            zhat[i, j] = (np.float64(z[i, j]) - mean[j]) * inv_std[j]
            out = gamma[j] * zhat[i, j] + beta[j]
            z[i, j] = max(out, zero) if activation == RELU else np.tanh(out)


@njit(nogil=True, cache=True)
def normalise_backward_(g, zhat, scale, mean_g, mean_gzhat):
    """g = scale (g - mean_g - zhat mean_gzhat) per element, scale = gamma / sqrt(var + eps)."""
    m, n = g.shape
    for i in range(m):
        for j in range(n):
            centred = np.float64(g[i, j]) - mean_g[j] - np.float64(zhat[i, j]) * mean_gzhat[j]
            g[i, j] = scale[j] * centred


@njit(nogil=True, cache=True)
def dense_(inputs, W, b, out, exact):
    """out = inputs @ W + b: BLAS in float mode, fixed-order products in exact mode."""
    if exact:
        fixed_order_product_(inputs, W, out)
    else:
        np.dot(inputs, W, out)
    add_bias_activate_(out, b, RELU, True)  # is_last: the bias only


@njit(nogil=True, cache=True)
def propagate_(delta, W, transposed, below, previous, activation, exact):
    """previous = (delta @ W^T) * act'(below): the gradient at the layer below's BN output."""
    if exact:
        fan_in, fan_out = W.shape
        W_T = matrix(transposed, 0, fan_out, fan_in)
        for k in range(fan_in):
            for j in range(fan_out):
                W_T[j, k] = W[k, j]
        fixed_order_product_(delta, W_T, previous)
    else:
        np.dot(delta, W.T, previous)
    times_slope_(previous, below, activation)


@njit(nogil=True, cache=True)
def dense_backward_(inputs, delta, grad_W, grad_b):
    """grad_W = inputs^T @ delta (BLAS), grad_b = column sums of delta in sample order."""
    np.dot(inputs.T, delta, grad_W)
    grad_b[:] = 0
    for i in range(delta.shape[0]):
        for j in range(grad_b.shape[0]):
            grad_b[j] += delta[i, j]


def magics(peaks: np.ndarray, count: int) -> np.ndarray:
    """Per feature, M = 1.5 * 2^E with 2^E >= 2 * count * peak: hi(term) is exact and so is
    the sum of `count` of them in any order. NaN where the peak is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        _, exponents = np.frexp(peaks * (2.0 * count))  # 2^e >= the bound, the bound < 2^e
    exponents = np.clip(exponents, MIN_EXPONENT, MAX_EXPONENT)
    exponents[peaks == 0] = MIN_EXPONENT
    result = np.ldexp(1.5, exponents)
    result[~np.isfinite(peaks * (2.0 * count))] = np.nan
    return result


class BatchNormWork(ExactGradient):
    """The workspaces of a pass with BatchNorm, in the layout exact mode's accumulation reads."""

    # Per layer l: h_l (the activations workspace), the delta at z_l (the deltas workspace), and
    # zhat_l of a normalised layer. The training step drives the pass layer by layer, because
    # the sums between two layers may travel through an allreduce first.

    def __init__(self, model: MLP, max_batch: int) -> None:
        super().__init__(model, max_batch)
        self._normalised = np.zeros_like(self._activations)

    def begin(self, X: np.ndarray) -> np.ndarray:
        """Copy the shard's inputs (kept for the accumulation) and return them."""
        m = X.shape[0]
        self._m = None  # a failed pass leaves nothing to accumulate
        inputs = self._shard_inputs(m)
        inputs[...] = X
        return inputs

    def rows(self, which: str, layer: int, m: int) -> np.ndarray:
        """The (m, fan_out) block of `layer` in workspace `which`: h, delta or zhat."""
        workspace = {"h": self._activations, "delta": self._deltas, "zhat": self._normalised}
        return layer_rows(workspace[which], self._layers, layer, m)

    def layer_input(self, layer: int, m: int) -> np.ndarray:
        """The (m, fan_in) input of `layer`: the shard's inputs, or h of the layer below."""
        return self._shard_inputs(m) if layer == 0 else self.rows("h", layer - 1, m)

    def losses(self, m: int) -> np.ndarray:
        """The per-sample losses of the pass (float64)."""
        return self._losses[:m]

    def transposed(self) -> np.ndarray:
        """Scratch for a transposed weight matrix (exact mode's backward)."""
        return self._transposed

    def end(self, m: int, bounds_out: np.ndarray) -> None:
        """The pass is complete: its peaks into bounds_out, ready for `accumulate`."""
        peaks_(self._layers, self._shard_inputs(m), self._activations, self._deltas,
               self._losses, bounds_out)  # fmt: skip
        self._local_bounds[:] = bounds_out
        self._m = m


__all__ = ["BatchNormWork", "column_peaks_", "column_sums_", "extract_column_sums_", "magics"]
