"""Numerics: the one place where float, narrow and exact mode differ, for every layer.

A layer computes with these primitives only, so a mode written here works for every layer:
  matmul_(a, b, out, transpose_b)   out = a b, or a b^T: per sample, a row of `a` times b
  affine_(a, b, bias, out, transpose_b, activation)    out = act(round(a b + bias)), or a b^T:
                                    a dense layer's forward pass (act: IDENTITY or RELU)
  round_(values)                    values as the format holds them (narrow modes; else nothing)
  outer_sum_(layer, a, b, g)        g += a^T b: the sum over samples of the outer products a_i b_i^T
  column_sum_(layer, d, g)          g += sum over samples of the rows d_i
  affine_sums_(layer, a, d, g_weight, g_bias, a_first, positions, y, activation)   a dense
                                    layer's sums: d = act'(y) d first (in place), then
                                    g_weight += a^T d (d^T a unless a_first), g_bias += columns of d
  loss_sum(losses)          the sum of the per-sample losses
A dense layer followed by a relu applies it in affine_ and affine_sums_ (Network.absorbed): in
float mode one call each around BLAS, a pass fewer each way than the relu's own, the same values.
Float mode calls BLAS and sums in sample order; its `free_order` lets a layer take its sums in
any order with kernels of its own (conv's chunks of patches), which the other modes refuse.
Narrow mode (bf16/fp16, emulated as autocast runs them) computes on float32 values of the format
and rounds every product's result. Exact mode runs per-sample products in a fixed order
(batch-invariant) and does not sum at once: each sum is a term it registers, with the peak of its
factors; once every rank agrees on the peaks (a MAX-allreduce), `accumulate_` extracts every term
at its agreed fixed point, so the sums are exact and their bits do not depend on how the batch is
split. docs/exact-mode.md has the proof.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numba import njit

from syncsgd.nn import exact as ex
from syncsgd.nn import precision as pr
from syncsgd.nn.layers.base import IDENTITY, RELU, Group, Primitives
from syncsgd.nn.layers.relu import rectified, rectified_grad, relu_, relu_backward_


@njit(nogil=True, cache=True)
def float_matmul_(a, b, out, transpose_b):
    """out = a b, or a b^T, through BLAS."""
    if transpose_b:
        np.dot(a, b.T, out)
    else:
        np.dot(a, b, out)


@njit(nogil=True, cache=True)
def add_bias_(out, bias):
    """out[i, j] += bias[j]."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] += bias[j]


@njit(nogil=True, cache=True)
def float_affine_(a, b, bias, out, transpose_b, activation):
    """out = act(a b + bias), or with b^T: the product through BLAS, then one pass."""
    float_matmul_(a, b, out, transpose_b)
    if activation != RELU:
        add_bias_(out, bias)
        return
    zero = out.dtype.type(0)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = rectified(out[i, j] + bias[j], zero)


@njit(nogil=True, cache=True)
def first_affine_sums_(a, d, g_weight, g_bias, a_first, y, activation):
    """d = act'(y) d in place, g_bias = its column sums in sample order (one pass), then
    g_weight = a^T d (or d^T a) through BLAS."""
    if activation != RELU:
        add_columns_(d, g_bias, True)
    else:
        g_bias[:] = 0
        zero = d.dtype.type(0)
        for i in range(d.shape[0]):
            for j in range(d.shape[1]):
                d[i, j] = rectified_grad(y[i, j], d[i, j], zero)
                g_bias[j] += d[i, j]
    if a_first:
        np.dot(a.T, d, g_weight)
    else:
        np.dot(d.T, a, g_weight)


def activate_(values: np.ndarray, activation: int) -> None:
    """values = act(values), in place."""
    if activation == RELU:
        flat = values.reshape(-1)
        relu_(flat, flat)


def activation_grad_(y: np.ndarray, d: np.ndarray, activation: int) -> None:
    """d = act'(y) d, in place, from the activation's output y."""
    if activation == RELU:
        flat = d.reshape(-1)
        relu_backward_(y.reshape(-1), flat, flat)


@njit(nogil=True, cache=True)
def add_columns_(d, g, first):
    """g += the column sums of d, in sample order (g = them if `first`)."""
    if first:
        g[:] = 0
    for i in range(d.shape[0]):
        for j in range(d.shape[1]):
            g[j] += d[i, j]


@njit(nogil=True, cache=True)
def narrow_column_sum_(d, g, fmt, first, column):
    """g += round(column sums of d): summed in float32 (in `column`, a float32 workspace of
    d's width), rounded once (g = it if `first`)."""
    column[:] = 0
    for i in range(d.shape[0]):
        for j in range(d.shape[1]):
            column[j] += d[i, j]
    for j in range(column.shape[0]):
        rounded = pr.round_to(np.float64(column[j]), fmt)
        g[j] = rounded if first else g[j] + rounded


@njit(nogil=True, cache=True)
def add_narrow_(values, g, fmt, first):
    """g += round(values), element by element (flat arrays; g = them if `first`)."""
    for i in range(values.size):
        rounded = pr.round_to(np.float64(values[i]), fmt)
        g[i] = rounded if first else g[i] + rounded


@njit(nogil=True, cache=True)
def copy_transposed_in_strips_(W, out):
    """out = W^T, eight rows of W at a time: each column's eight values are one short run of a
    row of out."""
    rows, columns = W.shape
    for top in range(0, rows - 7, 8):
        for j in range(columns):
            for i in range(top, top + 8):
                out[j, i] = W[i, j]
    for i in range(rows - rows % 8, rows):
        for j in range(columns):
            out[j, i] = W[i, j]


@njit(nogil=True, cache=True)
def sum_in_order(values):
    """The sum of a 1-D array in float64, in index order."""
    total = 0.0
    for value in values:
        total += np.float64(value)
    return total


@njit(nogil=True, cache=True, inline="always")
def term(a, b, c, kind, i, j, k):
    """Value (i, j, k)'s term of channel j's sum, in float64: a, (a - c)^2 or a b."""
    value = np.float64(a[i, j, k])
    if kind == 1:
        centred = value - c[j]
        return centred * centred
    if kind == 2:
        return value * np.float64(b[i, j, k])
    return value


@njit(nogil=True, cache=True)
def channel_sums_(a, b, c, kind, out):
    """out[j] += the sum over samples and positions, in that order, of the term."""
    m, n, s = a.shape
    for i in range(m):
        for j in range(n):
            for k in range(s):
                out[j] += term(a, b, c, kind, i, j, k)


@njit(nogil=True, cache=True)
def channel_peaks_(a, b, c, kind, out):
    """out[j] = max |term| over channel j; inf where a term is NaN or infinite (0 if empty)."""
    m, n, s = a.shape
    out[:] = 0.0
    for i in range(m):
        for j in range(n):
            for k in range(s):
                magnitude = abs(term(a, b, c, kind, i, j, k))
                if not magnitude <= out[j]:  # larger, or NaN
                    out[j] = magnitude if magnitude < np.inf else np.inf


@njit(nogil=True, cache=True)
def extract_channel_sums_(a, b, c, kind, magics, out):
    """out[j] += the sum of hi(term), hi(v) = (magic_j + v) - magic_j: exact, in any order."""
    m, n, s = a.shape
    for i in range(m):
        for j in range(n):
            for k in range(s):
                out[j] += (magics[j] + term(a, b, c, kind, i, j, k)) - magics[j]


def magics(peaks: np.ndarray, count: int) -> np.ndarray:
    """Per channel, M = 1.5 * 2^E with 2^E >= 2 * count * peak: hi(term) is exact and so is
    the sum of `count` of them in any order. NaN where the peak is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        _, exponents = np.frexp(peaks * (2.0 * count))  # 2^e >= the bound, the bound < 2^e
    exponents = np.clip(exponents, ex.MIN_EXPONENT, ex.MAX_EXPONENT)
    exponents[peaks == 0] = ex.MIN_EXPONENT
    result = np.ldexp(1.5, exponents)
    result[~np.isfinite(peaks * (2.0 * count))] = np.nan
    return result


class Numerics(Primitives, Protocol):
    """The primitives of a mode, and the lifecycle of a step the local gradient drives."""

    exact: bool  # whether every sum is extracted after the passes (exact mode)

    def weights(self, params: np.ndarray) -> np.ndarray: ...

    def inputs_(self, X: np.ndarray, workspace: np.ndarray) -> np.ndarray: ...

    def begin_step_(self, grads: np.ndarray, global_batch: int) -> None: ...

    def begin_micro_batch_(self, index: int, scale: float) -> None: ...

    def end_forward_(self, backward_: Callable[[], None], last: bool) -> None: ...

    def agree_(self, grads: np.ndarray, loss: np.ndarray) -> None: ...

    def layers_(self, backward_: Callable[[int, int], None], top: int, bottom: int) -> None: ...

    @property
    def sums_in_layers(self) -> bool: ...


class LocalGroup:
    """Whose samples BatchNorm's statistics are over: this rank's shard alone (or evaluation)."""

    alone = True

    def __init__(self, training: bool = True, eps: float = 1e-5, momentum: float = 0.1) -> None:
        self.training, self.eps, self.momentum = training, eps, momentum
        self._stats: dict[Hashable, Any] = {}

    def stats(self, position: Hashable, kind: Any, width: int) -> Any:
        """The statistics of the layer at `position`, made on first use."""
        if position not in self._stats:
            self._stats[position] = kind(width)
        return self._stats[position]

    def sum_(self, values: np.ndarray) -> None:
        """The shard's sums are the group's."""

    def max_(self, values: np.ndarray) -> None:
        """The shard's peaks are the group's."""


class Float:
    """BLAS products in the model's dtype; sums over samples in BLAS or in sample order."""

    exact = False
    free_order = True  # a layer may take its sums in any order, with kernels of its own

    def __init__(self, dtype: np.dtype, max_weights: int, group: Group | None = None) -> None:
        self.dtype = np.dtype(dtype)  # of the activations and deltas
        self.scale = 1.0  # the loss scale of the micro-batch under way: deltas are of it times
        self.group: Group = group or LocalGroup()  # BatchNorm's statistics group
        self.global_batch = 1  # B, which bounds how many terms a sum has (exact mode)
        # True while a micro-batch's sums are the first into their slots (the first, float mode):
        # each is written, not added, so the buffer needs no zeroing first and a weight sum is
        # its one BLAS call (the same bits as adding to zero, two passes fewer).
        self.first_sums = False
        self._product = np.zeros(max_weights, self.dtype)  # one weight gradient before it is added

    # -- a step's lifecycle, in the order nn/local.py calls it --------------------------------

    def begin_step_(self, grads: np.ndarray, global_batch: int) -> None:
        """A step over a shard of `global_batch` samples: the sums will be written into grads."""
        self.global_batch = global_batch

    def begin_micro_batch_(self, index: int, scale: float) -> None:
        """Micro-batch `index`'s passes, of `scale` times its loss: the first writes its sums,
        the others add to them."""
        self.first_sums, self.scale = index == 0, scale

    def end_forward_(self, backward_: Callable[[], None], last: bool) -> None:
        """After a micro-batch's forward pass: its whole backward pass, but for the last, whose
        layers the caller runs in pieces (`layers_`)."""
        if not last:
            backward_()

    def agree_(self, grads: np.ndarray, loss: np.ndarray) -> None:
        """Nothing to agree on: the loss sum is final and the sums are written as they come."""

    def layers_(self, backward_: Callable[[int, int], None], top: int, bottom: int) -> None:
        """The last micro-batch's backward pass through layers top down to bottom."""
        backward_(top, bottom)

    @property
    def sums_in_layers(self) -> bool:
        """Whether `layers_` sums values over the group (BatchNorm's statistics over the ranks)."""
        return not self.group.alone

    def weights(self, params: np.ndarray) -> np.ndarray:
        """The weights the passes read: the parameters themselves."""
        return params

    def inputs_(self, X: np.ndarray, workspace: np.ndarray) -> np.ndarray:
        """The shard's inputs as the passes read them: X itself (the caller keeps it for the
        step)."""
        return X

    def matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool) -> None:
        """out = a b, or a b^T."""
        float_matmul_(a, b, out, transpose_b)

    def affine_(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray, out: np.ndarray,
                transpose_b: bool, activation: int = IDENTITY) -> None:  # fmt: skip
        """out = act(a b + bias), or with b^T: one call."""
        float_affine_(a, b, bias, out, transpose_b, activation)

    def affine_apart_(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray, out: np.ndarray,
                      transpose_b: bool, activation: int = IDENTITY) -> None:  # fmt: skip
        """out = act(round(a b + bias)): the product, the bias, one rounding, then the activation
        (the order of the two layers apart: a relu of a rounded -0.0 keeps its sign)."""
        self.matmul_(a, b, out, transpose_b)
        add_bias_(out, bias)
        self.round_(out)
        activate_(out, activation)

    def round_(self, values: np.ndarray) -> None:
        """Nothing to round."""

    def scale_(self, delta: np.ndarray) -> None:
        """The loss's delta times the loss scale (none without a narrow format)."""
        if self.scale != 1.0:
            delta *= self.scale

    def outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                   per_sample: int = 1) -> None:  # fmt: skip
        """g += a^T b: the sum over samples inside BLAS."""
        if self.first_sums:
            float_matmul_(a.T, b, g, False)
            return
        product = self._product[: g.size].reshape(g.shape)
        float_matmul_(a.T, b, product, False)
        g += product

    def column_sum_(self, layer: int, d: np.ndarray, g: np.ndarray, per_sample: int = 1) -> None:
        """g += the column sums of d, in sample order."""
        add_columns_(d, g, self.first_sums)

    def sparse_matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out = a b for an `a` mostly of zeros (a conv's deltas after max pooling): matmul_'s."""
        self.matmul_(a, b, out, False)

    def sparse_outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                          per_sample: int = 1) -> None:  # fmt: skip
        """g += a^T b for an `a` mostly of zeros: outer_sum_'s."""
        self.outer_sum_(layer, a, b, g, per_sample)

    def affine_sums_(self, layer: int, a: np.ndarray, d: np.ndarray, g_weight: np.ndarray,
                     g_bias: np.ndarray, a_first: bool, per_sample: int, y: np.ndarray,
                     activation: int = IDENTITY) -> None:  # fmt: skip
        """d = act'(y) d, g_weight += a^T d (d^T a unless `a_first`), g_bias += the column sums
        of d: one call when they are the first sums; else apart."""
        if self.first_sums:
            first_affine_sums_(a, d, g_weight, g_bias, a_first, y, activation)
            return
        self.affine_sums_apart_(layer, a, d, g_weight, g_bias, a_first, per_sample, y, activation)

    def affine_sums_apart_(self, layer: int, a: np.ndarray, d: np.ndarray, g_weight: np.ndarray,
                           g_bias: np.ndarray, a_first: bool, per_sample: int, y: np.ndarray,
                           activation: int = IDENTITY) -> None:  # fmt: skip
        """The activation's gradient, the outer sum, then the column sum."""
        activation_grad_(y, d, activation)
        if a_first:
            self.outer_sum_(layer, a, d, g_weight, per_sample)
        else:
            self.outer_sum_(layer, d, a, g_weight, per_sample)
        self.column_sum_(layer, d, g_bias, per_sample)

    def add_(self, g: np.ndarray, sums: np.ndarray) -> None:
        """g += sums a layer computed itself (g = them when they are the first)."""
        if self.first_sums:
            g[...] = sums
        else:
            g += sums

    def agreed_sums_(self, kinds: tuple[int, ...], a: np.ndarray, b: np.ndarray, c: np.ndarray,
                     out: np.ndarray) -> None:  # fmt: skip
        """out += per-channel sums of each term over (m, C, S) blocks, in sample order (one
        block of C channels per kind)."""
        n = a.shape[1]
        for half, kind in enumerate(kinds):
            channel_sums_(a, b, c, kind, out[half * n : (half + 1) * n])

    def loss_sum(self, losses: np.ndarray, per_sample: int = 1) -> float:
        """The sum of the per-sample losses, in sample order."""
        return float(sum_in_order(losses))


class Narrow(Float):
    """bf16/fp16 as autocast: products of format values in float32, their results rounded."""

    free_order = False  # every product's result is rounded: the layers keep to the primitives

    def __init__(self, dtype: np.dtype, max_weights: int, fmt: int, n_params: int,
                 group: Group | None = None) -> None:  # fmt: skip
        super().__init__(np.dtype(np.float32), max_weights, group)
        self.fmt = fmt
        self._weights = np.zeros(0, self.dtype)  # made at the first call: a sharded step's
        # passes read the parameters of the buckets under way, rounded where they are gathered

    def weights(self, params: np.ndarray) -> np.ndarray:
        """The parameters rounded to the format (autocast's cast of the weights)."""
        if self._weights.size != params.size:
            self._weights = np.zeros(params.size, self.dtype)
        pr.narrow_copy_(params, self._weights, self.fmt)
        return self._weights

    def inputs_(self, X: np.ndarray, workspace: np.ndarray) -> np.ndarray:
        """The shard's inputs rounded to the format, in the workspace."""
        out = workspace[: X.size].reshape(X.shape)
        pr.narrow_copy_(X.reshape(-1), out.reshape(-1), self.fmt)
        return out

    def round_(self, values: np.ndarray) -> None:
        """Round every value to the format."""
        pr.round_flat_(values.reshape(-1), self.fmt)

    def scale_(self, delta: np.ndarray) -> None:
        """delta = round(delta * scale): the loss scale, then the format."""
        pr.scale_round_(delta, float(self.scale), self.fmt)

    def outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                   per_sample: int = 1) -> None:  # fmt: skip
        """g += round(a^T b), the product summed in float32."""
        product = self._product[: g.size].reshape(g.shape)
        float_matmul_(a.T, b, product, False)
        add_narrow_(product.reshape(-1), g.reshape(-1), self.fmt, self.first_sums)

    def column_sum_(self, layer: int, d: np.ndarray, g: np.ndarray, per_sample: int = 1) -> None:
        """g += round(column sums of d), summed in float32."""
        narrow_column_sum_(d, g, self.fmt, self.first_sums, self._product[: d.shape[1]])

    affine_ = Float.affine_apart_
    affine_sums_ = Float.affine_sums_apart_


@dataclass
class Term:
    """One sum exact mode extracts: its kind, its factors, where it goes and its peaks' slots."""

    layer: int
    kind: str  # "outer" (a^T b), "columns" (column sums of a) or "loss"
    out: np.ndarray
    a: np.ndarray
    b: np.ndarray | None
    first_bound: int  # index of its first peak in the bounds vector
    per_sample: int  # terms per sample in each element's sum (positions of a sequence or image)
    sparse: bool = False  # an outer sum whose `a` is mostly zeros, extracted skipping them


class Exact(Float):
    """Per-sample products in a fixed order; every sum extracted at an agreed fixed point."""

    exact = True
    free_order = False  # the order of every sum is fixed

    def __init__(self, dtype: np.dtype, max_weights: int, max_block: int,
                 group: Group | None = None, ranks: Group | None = None) -> None:  # fmt: skip
        super().__init__(dtype, max_weights, group)
        self.ranks: Group = ranks or LocalGroup()  # whose peaks the extraction must cover
        self.agreed: list[tuple[float, float]] | None = None  # (M, ulp(M)) per term; None: inf
        self._bounds = np.zeros(0)
        self.terms: list[Term] = []
        self.peaks: list[float] = []
        # A later micro-batch's terms share the first micro-batch's peak slots: the next slot to
        # raise, or None while the terms register slots of their own.
        self._shared: int | None = None
        self._kept: dict[tuple[int, str], np.ndarray] = {}  # factors kept past their pass
        self._transposed = np.zeros(max_weights, self.dtype)
        self._sums = np.zeros(max_weights, np.float64)
        self._widened = np.zeros(max_block, np.float64)
        # a tile of accumulator rows: at most ACCUMULATOR_TILE_BYTES, or one row of the widest
        self._counts = np.zeros(max(ex.ACCUMULATOR_TILE_BYTES // 8, max_weights), np.int64)

    def agreed_sums_(self, kinds: tuple[int, ...], a: np.ndarray, b: np.ndarray, c: np.ndarray,
                     out: np.ndarray) -> None:  # fmt: skip
        """out += per-channel sums extracted at the fixed point of the group's agreed peaks (one
        MAX-allreduce for every kind)."""
        n = a.shape[1]
        parts = [slice(half * n, (half + 1) * n) for half in range(len(kinds))]
        peaks = np.zeros(out.size)
        for kind, part in zip(kinds, parts, strict=True):
            channel_peaks_(a, b, c, kind, peaks[part])
        self.group.max_(peaks)
        count = self.global_batch * a.shape[2]  # the most terms a channel's sum has, any split
        scales = magics(peaks, count)
        for kind, part in zip(kinds, parts, strict=True):
            extract_channel_sums_(a, b, c, kind, scales[part], out[part])

    def inputs_(self, X: np.ndarray, workspace: np.ndarray) -> np.ndarray:
        """A copy of the shard's inputs: the caller may reuse its buffer before the extraction."""
        out = workspace[: X.size].reshape(X.shape)
        out[...] = X
        return out

    # -- a step's lifecycle: every term registered, the peaks agreed, then the extraction -----

    def begin_step_(self, grads: np.ndarray, global_batch: int) -> None:
        """Forget the last step's terms; the extracted sums are added into grads, zeroed."""
        grads[...] = 0
        self.global_batch = global_batch
        self.terms.clear()
        self.peaks.clear()
        self._shared = None
        self.agreed = None

    def begin_micro_batch_(self, index: int, scale: float) -> None:
        """Micro-batch `index`'s passes, of `scale` times its loss; after the first, their terms
        add to the first's."""
        self.scale = scale
        if index > 0:
            self.next_micro_batch_()

    def end_forward_(self, backward_: Callable[[], None], last: bool) -> None:
        """The whole backward pass now: the peaks are agreed on over every term."""
        backward_()

    def agree_(self, grads: np.ndarray, loss: np.ndarray) -> None:
        """The peaks of every term, MAX over the ranks, then the loss sum extracted into loss[0];
        NaN in grads and loss if a peak is not finite (every rank alike)."""
        if self._bounds.size != len(self.peaks):
            self._bounds = np.zeros(len(self.peaks))
        self.bounds(self._bounds)
        self.ranks.max_(self._bounds)
        if not np.isfinite(self._bounds).all():
            grads[...] = np.nan
            loss[...] = np.nan
            return
        self.agreed = self.scales(self._bounds, self.global_batch)
        loss[0] = self.extract_loss(self.agreed)

    def layers_(self, backward_: Callable[[int, int], None], top: int, bottom: int) -> None:
        """Extract the sums of layers top down to bottom (their passes ran in the forward)."""
        if self.agreed is not None:
            self.accumulate_(self.agreed, top, bottom)

    @property
    def sums_in_layers(self) -> bool:
        """Nothing: `layers_` only extracts."""
        return False

    def next_micro_batch_(self) -> None:
        """The next pass adds to this one's sums: keep the factors of the terms registered so
        far (the workspaces are the next pass's), and let its terms share their peak slots."""
        assert self._shared in (None, len(self.peaks)), "micro-batches register alike"
        for index, term in enumerate(self.terms):
            term.a = self._keep(index, "a", term.a)
            if term.b is not None:
                term.b = self._keep(index, "b", term.b)
        self._shared = 0

    def _keep(self, index: int, factor: str, values: np.ndarray) -> np.ndarray:
        """`values` in an array of the term's own (reused from step to step), unless kept."""
        kept = self._kept.get((index, factor))
        if kept is not None and values.base is kept:
            return values  # kept after an earlier micro-batch
        if kept is None or kept.size < values.size or kept.dtype != values.dtype:
            kept = self._kept[(index, factor)] = np.empty(values.size, values.dtype)
        copy = kept[: values.size].reshape(values.shape)
        copy[...] = values
        return copy

    def _peaks_(self, *values: float) -> int:
        """Where a term's peaks are: slots of its own, or (a later micro-batch) those of the
        first micro-batch's same term, raised to cover these values. Returns the first."""
        if self._shared is None:
            first = len(self.peaks)
            self.peaks += values
            return first
        first = self._shared
        for offset, value in enumerate(values):
            self.peaks[first + offset] = max(self.peaks[first + offset], value)
        self._shared += len(values)
        return first

    def matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool) -> None:
        """out = a b (or a b^T), every element summed over ascending k whatever the rows."""
        if transpose_b:  # the fixed-order kernel reads rows of b: one transposed copy per call
            b_T = self._transposed[: b.size].reshape(b.shape[1], b.shape[0])
            copy_transposed_in_strips_(b, b_T)
            b = b_T
        ex.fixed_order_product_(a, b, out)

    affine_ = Float.affine_apart_
    affine_sums_ = Float.affine_sums_apart_

    def outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                   per_sample: int = 1) -> None:  # fmt: skip
        """Register g += sum of a_i b_i^T, with the peaks of a and b."""
        first = self._peaks_(ex.peak_magnitude(a.reshape(-1)), ex.peak_magnitude(b.reshape(-1)))
        self._register(Term(layer, "outer", g, a, b, first, per_sample))

    def sparse_matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out = a b as matmul_ gives it, skipping the zeros of `a` (the same bits)."""
        # the counts' scratch is free during the passes: the extraction comes after them all
        ex.sparse_fixed_order_product_(a, b, out, self._counts[: a.shape[1]])

    def sparse_outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                          per_sample: int = 1) -> None:  # fmt: skip
        """Register g += sum of a_i b_i^T, extracted skipping the zeros of `a` (the same bits)."""
        first = self._peaks_(ex.peak_magnitude(a.reshape(-1)), ex.peak_magnitude(b.reshape(-1)))
        self._register(Term(layer, "outer", g, a, b, first, per_sample, sparse=True))

    def column_sum_(self, layer: int, d: np.ndarray, g: np.ndarray, per_sample: int = 1) -> None:
        """Register g += the column sums of d, with the peak of d."""
        first = self._peaks_(ex.peak_magnitude(d.reshape(-1)))
        self._register(Term(layer, "columns", g, d, None, first, per_sample))

    def loss_sum(self, losses: np.ndarray, per_sample: int = 1) -> float:
        """Register the loss sum (extracted with the gradient); its value comes later."""
        first = self._peaks_(ex.peak_magnitude(losses))
        self._register(Term(-1, "loss", np.zeros(1), losses.reshape(-1, 1), None, first,
                            per_sample))  # fmt: skip
        return 0.0

    def _register(self, term: Term) -> None:
        """Add a term to the pass's list."""
        self.terms.append(term)

    def bounds(self, out: np.ndarray) -> None:
        """The peaks of every term, in registration order, into `out` (float64)."""
        out[:] = self.peaks

    def scales(self, bounds: np.ndarray, global_batch: int) -> list[tuple[float, float]]:
        """(M, ulp(M)) per term from the agreed peaks: M = 1.5 * 2^E, 2^E >= 2 B v."""
        # Below this rank's own peaks (no MAX-allreduce) or a B below its shard, a term may
        # leave M's binade: the sums would be silently wrong, so refuse.
        if np.shape(bounds) != (len(self.peaks),):
            raise ValueError(f"bounds must hold the pass's {len(self.peaks)} peaks, got shape "
                             f"{np.shape(bounds)}")  # fmt: skip
        if np.any(np.asarray(bounds) < self.peaks):
            raise ValueError("bounds are below this rank's own peaks: MAX-allreduce the bounds "
                             "of every rank before extracting")  # fmt: skip
        scales = []
        for term in self.terms:
            if term.a.shape[0] > global_batch * term.per_sample:
                raise ValueError(f"global batch {global_batch} is smaller than this rank's "
                                 f"shard of {term.a.shape[0] // term.per_sample}")  # fmt: skip
            value = float(bounds[term.first_bound])
            if term.kind == "outer":
                value *= float(bounds[term.first_bound + 1])
            exponent = ex.slot_exponent(value, global_batch * term.per_sample)
            scales.append((float(np.ldexp(1.5, exponent)),
                           float(np.ldexp(1.0, exponent - ex.UNIT_BITS))))  # fmt: skip
        return scales

    def error_bound(self, bounds: np.ndarray, global_batch: int, grads: np.ndarray) -> np.ndarray:
        """Per element of `grads` (the buffer the pass registered its sums into), then for the
        loss: how far the exact-mode mean may be from the exact mean (docs/exact-mode.md)."""
        # 2^(E - 53) per term, plus a float64 product's rounding, 2^-53 v + 2^-1075.
        per_element = np.zeros(grads.size + 1)
        base = grads.__array_interface__["data"][0]
        for term, (magic, _) in zip(self.terms, self.scales(bounds, global_batch), strict=True):
            bound = magic / 3.0 * 2.0**-52  # M = 1.5 * 2^E: 2^(E - 53)
            if term.kind == "outer" and self.dtype == np.float64:
                value = float(bounds[term.first_bound]) * float(bounds[term.first_bound + 1])
                bound += value * 2.0**-53 + 2.0**-1075
            if term.kind == "loss":
                per_element[-1] = bound
                continue
            start = (term.out.__array_interface__["data"][0] - base) // grads.itemsize
            per_element[start : start + term.out.size] = bound
        return per_element

    def accumulate_(self, scales: list[tuple[float, float]], top: int, bottom: int) -> None:
        """Extract the terms of layers top down to bottom (the loss with layer -1)."""
        for term, (magic, unit) in zip(self.terms, scales, strict=True):
            if bottom <= term.layer <= top:
                self._extract_(term, magic, unit)

    def extract_loss(self, scales: list[tuple[float, float]]) -> float:
        """The extracted loss sum (of every micro-batch's: exact sums of one fixed point, so
        their sum is exact too)."""
        total: float | None = None
        for term, (magic, unit) in zip(self.terms, scales, strict=True):
            if term.kind == "loss":
                self._extract_(term, magic, unit)
                total = float(term.out[0]) if total is None else total + float(term.out[0])
        return 0.0 if total is None else total

    def _extract_(self, term: Term, magic: float, unit: float) -> None:
        """out += the term's exact sum at the fixed point `magic`."""
        out = term.out
        sums = self._sums[: out.size].reshape(out.shape if term.kind != "loss" else (1,))
        if term.kind == "outer" and term.sparse:
            assert term.b is not None
            depth, width = term.a.shape[1], term.b.shape[1]
            counts = self._counts[: depth * width].reshape(depth, width)
            ex.extract_sparse_outer_sum_(term.a, term.b, magic, unit, sums, counts)
        elif term.kind == "outer" and in_panels(term.b):
            assert term.b is not None  # a factor wider than the L2 cache: a panel at a time
            if self._widened.size < ex.PANEL_BYTES // 8:
                self._widened = np.zeros(ex.PANEL_BYTES // 8, np.float64)
            ex.extract_outer_sum_in_panels_(term.a, term.b, magic, unit, sums, self._widened,
                                            self._counts)  # fmt: skip
        elif term.kind == "outer":
            assert term.b is not None
            m, width = term.b.shape
            if self._widened.size < m * width:  # a conv's patches: wider than any layer's block
                self._widened = np.zeros(m * width, np.float64)
            wide = self._widened[: m * width].reshape(m, width)  # float64 once, not per product
            wide[...] = term.b
            tile = ex.accumulator_rows(width)
            counts = self._counts[: tile * width].reshape(tile, width)
            widened = term.a.dtype == term.b.dtype == np.float32  # exact float64 products
            extract_ = ex.extract_outer_sum_widened_ if widened else ex.extract_outer_sum_
            extract_(term.a, wide, magic, unit, sums, counts)
        else:
            ex.extract_column_sum_(term.a, magic, sums)
        if term.kind == "loss":
            out[0] = sums[0]
        else:
            out += sums


def in_panels(b: np.ndarray | None) -> bool:
    """Whether an outer sum's factor b is wider than the L2 cache, extracted a panel at a time
    (panels of at least MIN_PANEL_COLUMNS)."""
    return b is not None and ex.MIN_PANEL_COLUMNS <= ex.panel_columns(*b.shape) < b.shape[1]


class ExactNarrow(Exact):
    """Exact mode with the passes in bf16/fp16: per-sample products of format values, rounded."""

    def __init__(self, dtype: np.dtype, max_weights: int, max_block: int, fmt: int,
                 n_params: int, group: Group | None = None,
                 ranks: Group | None = None) -> None:  # fmt: skip
        super().__init__(dtype, max_weights, max_block, group, ranks)
        self.fmt = fmt
        self._weights = np.zeros(0, self.dtype)

    weights = Narrow.weights
    inputs_ = Narrow.inputs_
    round_ = Narrow.round_
    scale_ = Narrow.scale_


def sums_dtype(exact: bool, dtype: np.dtype) -> np.dtype:
    """The dtype of the gradient sums a mode writes: exact mode extracts them in float64; the
    others write them in the model's dtype."""
    return np.dtype(np.float64) if exact else np.dtype(dtype)


def numerics(exact: bool, precision: str, dtype: np.dtype, max_weights: int, max_block: int,
             n_params: int, group: Group | None = None,
             ranks: Group | None = None) -> Numerics:  # fmt: skip
    """The numerics of a mode and precision, with workspaces for the largest weight matrix;
    `group`: BatchNorm's statistics' (default: this process alone), `ranks`: the group exact
    mode's peaks are agreed over (default: this process alone)."""
    fmt = pr.PRECISION_CODES[precision]
    if exact:
        if fmt:
            return ExactNarrow(dtype, max_weights, max_block, fmt, n_params, group, ranks)
        return Exact(dtype, max_weights, max_block, group, ranks)
    if fmt:
        return Narrow(dtype, max_weights, fmt, n_params, group)
    return Float(dtype, max_weights, group)


__all__ = ["Exact", "ExactNarrow", "Float", "Group", "LocalGroup", "Narrow", "Numerics", "numerics"]
