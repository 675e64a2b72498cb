"""Exact mode: gradient sums whose bits do not depend on how the batch is split over ranks.

Two ingredients: per-sample passes with fixed-order products (batch-invariant kernels), and an
order-independent fixed-point sum of the per-sample terms at a scale agreed by a MAX-allreduce of
per-layer bounds. docs/exact-mode.md states the guarantee, the error bound and the proof.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from syncsgd.nn.kernels import (
    ACTIVATION_CODES,
    RELU,
    WIDTH_BEFORE,
    add_bias_activate_,
    check_batch,
    check_count,
    check_flat,
    first_load,
    layer_input,
    layer_params,
    layer_rows,
    layer_table,
    matrix,
    mse_sample_,
    times_slope_,
    xent_sample_,
)
from syncsgd.nn.mlp import MLP, describe
from syncsgd.nn.precision import activate_narrow_, narrow_copy_, round_block_, scale_round_

PRODUCT_BLOCK_BYTES = 262144  # rows of W used together by a product: they stay in the L2 cache
ACCUMULATOR_TILE_BYTES = 16384  # weight-sum rows extracted together: they stay in the L1 cache
MIN_EXPONENT, MAX_EXPONENT = -1022, 1022  # keep M = 1.5 * 2^E and ulp(M) = 2^(E-52) in float64
UNIT_BITS = 52  # ulp(M) = 2^(E - 52)


@njit(nogil=True, cache=True)
def fixed_order_product_(x, W, out):
    """out[i, j] = sum over ascending k of x[i, k] * W[k, j], the same order for any row count."""
    # Grouped rows (four share each loaded row of W) and leftover rows go through the same
    # acc = acc + x[i, k] * W[k, j] in ascending k; no term is skipped, so a NaN in W always shows.
    m, depth = x.shape
    n = W.shape[1]
    zero = out.dtype.type(0)
    for i in range(m):
        for j in range(n):
            out[i, j] = zero
    block = max(4, PRODUCT_BLOCK_BYTES // max(n * W.itemsize, 1) // 4 * 4)  # a block of W in L2
    for k_start in range(0, depth, block):  # blocks in ascending k: each element's order is kept
        k_stop = min(k_start + block, depth)
        for i in range(0, m - 3, 4):
            r0, r1, r2, r3 = out[i], out[i + 1], out[i + 2], out[i + 3]
            k = k_start
            while k + 4 <= k_stop:
                w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
                f00, f01, f02, f03 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
                f10, f11, f12, f13 = x[i + 1, k], x[i + 1, k + 1], x[i + 1, k + 2], x[i + 1, k + 3]
                f20, f21, f22, f23 = x[i + 2, k], x[i + 2, k + 1], x[i + 2, k + 2], x[i + 2, k + 3]
                f30, f31, f32, f33 = x[i + 3, k], x[i + 3, k + 1], x[i + 3, k + 2], x[i + 3, k + 3]
                for j in range(n):
                    v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
                    r0[j] = (((r0[j] + f00 * v0) + f01 * v1) + f02 * v2) + f03 * v3
                    r1[j] = (((r1[j] + f10 * v0) + f11 * v1) + f12 * v2) + f13 * v3
                    r2[j] = (((r2[j] + f20 * v0) + f21 * v1) + f22 * v2) + f23 * v3
                    r3[j] = (((r3[j] + f30 * v0) + f31 * v1) + f32 * v2) + f33 * v3
                k += 4
            for tail in range(k, k_stop):
                for row in range(i, i + 4):
                    add_scaled_row_(out[row], x[row, tail], W[tail])
        for row in range(m - m % 4, m):  # leftover rows, one term at a time
            for k in range(k_start, k_stop):
                add_scaled_row_(out[row], x[row, k], W[k])


@njit(nogil=True, cache=True)
def add_scaled_row_(row, factor, weights):
    """row += factor * weights, element by element (one rounding for the product, one for +)."""
    for j in range(row.shape[0]):
        row[j] += factor * weights[j]


@njit(nogil=True, cache=True)
def forward_exact_(params, layers, activation, X, activations):
    """Every layer on the m rows of X with fixed-order products; returns the (m, K) logits."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(n_layers):
        W, b = layer_params(params, layers, layer)
        outputs = layer_rows(activations, layers, layer, m)
        fixed_order_product_(layer_input(X, activations, layers, layer, m), W, outputs)
        # The bias is added after the k-sum, then the activation: per element, no cross-row work.
        add_bias_activate_(outputs, b, activation, layer == n_layers - 1)
    return layer_rows(activations, layers, n_layers - 1, m)


@njit(nogil=True, cache=True)
def xent_sample_losses_(logits, labels, delta, losses):
    """Per-sample softmax cross-entropy into `losses` (float64); delta = softmax - one_hot; hits."""
    correct = 0
    for i in range(logits.shape[0]):
        losses[i], best = xent_sample_(logits, labels, delta, i)
        correct += best == labels[i]
    return correct


@njit(nogil=True, cache=True)
def mse_sample_losses_(outputs, targets, delta, losses):
    """Per-sample mean over outputs of (z - t)^2 into `losses` (float64); delta = 2 (z - t) / K."""
    two_over_k = outputs.dtype.type(2.0 / outputs.shape[1])
    for i in range(outputs.shape[0]):
        losses[i] = mse_sample_(outputs, targets, delta, i, two_over_k)
    return 0


@njit(nogil=True, cache=True)
def backward_exact_(params, layers, activation, X, activations, deltas, transposed):
    """Per-sample deltas of every layer, from the logits' delta, with fixed-order products."""
    m = X.shape[0]
    for layer in range(layers.shape[0] - 1, 0, -1):
        W, _ = layer_params(params, layers, layer)
        fan_in, fan_out = W.shape
        W_T = matrix(transposed, 0, fan_out, fan_in)  # once per call: the inner loop runs along k
        for k in range(fan_in):
            for j in range(fan_out):
                W_T[j, k] = W[k, j]
        delta = layer_rows(deltas, layers, layer, m)
        previous = layer_rows(deltas, layers, layer - 1, m)
        fixed_order_product_(delta, W_T, previous)
        times_slope_(previous, layer_input(X, activations, layers, layer, m), activation)


@njit(nogil=True, cache=True)
def peak_magnitude(values):
    """max |v| over a 1-D array, in float64; inf if any value is NaN or infinite (0 if empty)."""
    peak = 0.0
    for value in values:
        magnitude = abs(np.float64(value))
        if not magnitude <= peak:  # larger, or NaN
            peak = magnitude if magnitude < np.inf else np.inf
    return peak


@njit(nogil=True, cache=True)
def peaks_(layers, X, activations, deltas, losses, bounds_out):
    """bounds_out = max|input| and max|delta| of every layer, then the largest loss."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(n_layers):
        inputs = layer_input(X, activations, layers, layer, m)
        bounds_out[2 * layer] = peak_magnitude(inputs.ravel())
        bounds_out[2 * layer + 1] = peak_magnitude(layer_rows(deltas, layers, layer, m).ravel())
    bounds_out[2 * n_layers] = peak_magnitude(losses[:m])


@njit(nogil=True, cache=True)
def xent_local_pass_(params, layers, activation, X, labels, activations, deltas, transposed,
                     losses, bounds_out):  # fmt: skip
    """Cross-entropy: forward, per-sample losses and deltas, backward, peaks; returns the hits."""
    logits = forward_exact_(params, layers, activation, X, activations)
    m = X.shape[0]
    delta = layer_rows(deltas, layers, layers.shape[0] - 1, m)
    correct = xent_sample_losses_(logits, labels, delta, losses[:m])
    backward_exact_(params, layers, activation, X, activations, deltas, transposed)
    peaks_(layers, X, activations, deltas, losses, bounds_out)
    return correct


@njit(nogil=True, cache=True)
def mse_local_pass_(params, layers, activation, X, targets, activations, deltas, transposed,
                    losses, bounds_out):  # fmt: skip
    """Mean squared error: forward, per-sample losses and deltas, backward, peaks; returns 0."""
    outputs = forward_exact_(params, layers, activation, X, activations)
    m = X.shape[0]
    delta = layer_rows(deltas, layers, layers.shape[0] - 1, m)
    mse_sample_losses_(outputs, targets, delta, losses[:m])
    backward_exact_(params, layers, activation, X, activations, deltas, transposed)
    peaks_(layers, X, activations, deltas, losses, bounds_out)
    return 0


@intrinsic
def float_bits(typingctx, value):
    """The IEEE-754 bit pattern of a float64, as an int64 (a bitcast: no instruction at all)."""
    if value != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int64))

    return types.int64(types.float64), codegen


@njit(nogil=True, cache=True)
def extract_outer_sum_(A, D, magic, unit, sums, counts):
    """sums[k, j] = sum over samples i of hi(A[i, k] * D[i, j]), hi(v) = (magic + v) - magic."""
    # D is float64 (float32 deltas are widened first). magic + v and magic share a binade, so
    # hi(v) / unit = bits(magic + v) - bits(magic): int64 counts of `unit` give the same exact sum
    # on integer lanes, without two more float additions per term.
    m, depth = A.shape
    n = D.shape[1]
    magic_bits = float_bits(magic)
    # Exact sums may be taken in any order: a tile of rows of `counts` stays in the L1 cache
    # while the samples' delta rows stream past it, four samples per load and store.
    tile = accumulator_rows(n)
    for start in range(0, depth, tile):
        stop = min(start + tile, depth)
        for row in range(stop - start):
            for j in range(n):
                counts[row, j] = 0
        for i in range(0, m - 3, 4):
            d0, d1, d2, d3 = D[i], D[i + 1], D[i + 2], D[i + 3]
            for k in range(start, stop):
                f0, f1 = np.float64(A[i, k]), np.float64(A[i + 1, k])
                f2, f3 = np.float64(A[i + 2, k]), np.float64(A[i + 3, k])
                if f0 == 0.0 and f1 == 0.0 and f2 == 0.0 and f3 == 0.0:
                    continue  # every product extracts to 0
                row = counts[k - start]
                for j in range(n):
                    # The products of widened float32 factors are exact.
                    c0 = float_bits(magic + f0 * d0[j]) - magic_bits
                    c1 = float_bits(magic + f1 * d1[j]) - magic_bits
                    c2 = float_bits(magic + f2 * d2[j]) - magic_bits
                    c3 = float_bits(magic + f3 * d3[j]) - magic_bits
                    row[j] += (c0 + c1) + (c2 + c3)
        for i in range(m - m % 4, m):
            delta = D[i]
            for k in range(start, stop):
                factor = np.float64(A[i, k])
                if factor == 0.0:
                    continue
                row = counts[k - start]
                for j in range(n):
                    row[j] += float_bits(magic + factor * delta[j]) - magic_bits
        for k in range(start, stop):
            for j in range(n):
                sums[k, j] = np.float64(counts[k - start, j]) * unit  # |count| < 2^53: exact


@njit(nogil=True, cache=True)
def accumulator_rows(n):
    """Rows of an (n wide) int64 accumulator tile that fit ACCUMULATOR_TILE_BYTES."""
    return max(1, ACCUMULATOR_TILE_BYTES // (8 * max(n, 1)))


@njit(nogil=True, cache=True)
def extract_column_sum_(D, magic, sums):
    """sums[j] = sum over samples i of hi(D[i, j])."""
    m, n = D.shape
    for j in range(n):
        sums[j] = 0.0
    for i in range(m):
        for j in range(n):
            sums[j] += (magic + np.float64(D[i, j])) - magic


@njit(nogil=True, cache=True)
def accumulate_(layers, X, activations, deltas, losses, magics, units, widened, counts, sums_out):
    """Extracted per-sample gradient sums in the flat layout, then the extracted loss sum."""
    n_layers = layers.shape[0]
    accumulate_layers_(layers, X, activations, deltas, magics, units, widened, counts, sums_out,
                       n_layers - 1, 0)  # fmt: skip
    accumulate_loss_(losses, X.shape[0], magics[2 * n_layers], sums_out)


@njit(nogil=True, cache=True)
def accumulate_loss_(losses, m, magic, sums_out):
    """The extracted loss sum of the m samples, into the last slot of sums_out."""
    loss_sum = 0.0
    for i in range(m):
        loss_sum += (magic + losses[i]) - magic
    sums_out[sums_out.shape[0] - 1] = loss_sum


@njit(nogil=True, cache=True)
def accumulate_layers_(layers, X, activations, deltas, magics, units, widened, counts, sums_out,
                       top, bottom):  # fmt: skip
    """Extracted per-sample gradient sums of layers top down to bottom, in the flat layout."""
    # Exact sums: any order of the layers (all at once, or a few at a time) gives the same bits.
    m = X.shape[0]
    for layer in range(top, bottom - 1, -1):
        inputs = layer_input(X, activations, layers, layer, m)
        delta = layer_rows(deltas, layers, layer, m)
        fan_out = delta.shape[1]
        wide_delta = matrix(widened, 0, m, fan_out)
        for i in range(m):  # float64 deltas once, not once per product
            for j in range(fan_out):
                wide_delta[i, j] = delta[i, j]
        sums_W, sums_b = layer_params(sums_out, layers, layer)
        tile = matrix(counts, 0, accumulator_rows(fan_out), fan_out)
        extract_outer_sum_(inputs, wide_delta, magics[2 * layer], units[2 * layer], sums_W, tile)
        extract_column_sum_(wide_delta, magics[2 * layer + 1], sums_b)


def slot_bounds(bounds: np.ndarray) -> np.ndarray:
    """Per slot (W0, b0, W1, b1, ..., loss): the bound v_s on |term|, from the agreed peaks."""
    bounds = np.asarray(bounds, dtype=np.float64)
    values = bounds.copy()
    with np.errstate(over="ignore"):  # an overflow to inf is reported by extraction_exponents
        values[0:-1:2] = bounds[0:-1:2] * bounds[1:-1:2]  # max|a_l| * max|delta_l|, after the MAX
    return values


def extraction_exponents(bounds: np.ndarray, global_batch: int) -> np.ndarray:
    """E_s per slot: the least integer with 2^E_s >= 2 * B * v_s, clamped to [-1022, 1022]."""
    # ValueError for a non-finite peak (a NaN or infinity in the pass) or a bound beyond float64.
    if not np.all(np.isfinite(bounds)):
        raise ValueError(NON_FINITE)
    exponents = np.empty(len(bounds), dtype=np.int64)
    for slot, value in enumerate(slot_bounds(bounds)):
        exponents[slot] = slot_exponent(value, global_batch)
    return exponents


NON_FINITE = ("non-finite gradient in exact mode: a NaN or infinity appeared in the inputs, "
              "activations, deltas or losses (diverging training? lower --lr)")  # fmt: skip


def slot_exponent(value: float, global_batch: int) -> int:
    """The least integer E with 2^E >= 2 * B * value, clamped to [-1022, 1022]."""
    if not math.isfinite(value):
        raise ValueError(
            f"gradient too large for exact mode: a term bound of {value} overflows float64"
        )
    if value == 0.0:
        return MIN_EXPONENT
    numerator, denominator = float(value).as_integer_ratio()  # denominator = 2^d, exact
    target = 2 * global_batch * numerator
    # 2^(E + d) >= target  <=>  E + d >= bit_length(target - 1)
    exponent = (target - 1).bit_length() - (denominator.bit_length() - 1)
    if exponent > MAX_EXPONENT:
        raise ValueError(
            f"gradient too large for exact mode: term bound {value:.3g} times 2 x batch "
            f"{global_batch} exceeds the float64 range"
        )
    return max(exponent, MIN_EXPONENT)


def exactness_bound(model: MLP, bounds: np.ndarray, global_batch: int) -> np.ndarray:
    """Per element (flat layout, then the loss): the bound on |exact-mode mean - exact mean|."""
    # 2^(E_s - 53), plus the rounded product's 2^-53 v_s + 2^-1075 for a float64 model's weights
    # (derived in docs/exact-mode.md).
    bounds = _checked_bounds(model, bounds)
    global_batch = check_count("global_batch", global_batch, low=1)
    per_slot = np.ldexp(1.0, extraction_exponents(bounds, global_batch) - (UNIT_BITS + 1))
    if model.dtype == np.float64:
        per_slot[0:-1:2] += np.ldexp(slot_bounds(bounds)[0:-1:2], -53) + 2.0**-1075
    per_element = np.empty(model.n_params + 1)
    for slot, (_, shape, offset) in enumerate(model.layout()):
        per_element[offset : offset + math.prod(shape)] = per_slot[slot]
    per_element[-1] = per_slot[-1]
    return per_element


class ExactGradient:
    """Exact-mode gradient in two phases around the MAX-allreduce of the bounds."""

    # Per step on every rank: `local_pass` (per-sample forward/backward of the shard, fills the
    # local peaks), MAX-allreduce of the peaks (float64, `bound_count` long), `accumulate` (the
    # extracted sums), SUM-allreduce of the float64 sums, divide once by B. Workspaces are allocated
    # once; one instance per thread.

    def __init__(self, model: MLP, max_batch: int) -> None:
        self.model = model
        self.max_batch = check_count("max_batch", max_batch, low=0)
        self._layers = layer_table(model)
        self._activation = ACTIVATION_CODES[model.activation]
        widths = sum(model.sizes[1:])
        self._inputs = np.zeros(self.max_batch * model.sizes[0], dtype=model.dtype)
        self._activations = np.zeros(self.max_batch * widths, dtype=model.dtype)
        self._deltas = np.zeros(self.max_batch * widths, dtype=model.dtype)
        transposed = max((a * b for a, b in model.layer_shapes()[1:]), default=0)
        self._transposed = np.zeros(transposed, dtype=model.dtype)
        self._losses = np.zeros(self.max_batch, dtype=np.float64)
        self._widened = np.zeros(self.max_batch * max(model.sizes[1:]), dtype=np.float64)
        tiles = (accumulator_rows(fan_out) * fan_out for _, fan_out in model.layer_shapes())
        self._counts = np.zeros(max(tiles), dtype=np.int64)
        self._local_bounds = np.zeros(self.bound_count)
        self._m: int | None = None  # samples of the last local_pass; None before the first

    @property
    def bound_count(self) -> int:
        """Length of the bounds vector: max|a_l|, max|delta_l| per layer, then the peak loss."""
        return _bound_count(self.model)

    def local_pass(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray, bounds_out: np.ndarray
    ) -> int:
        """Per-sample pass over the shard into the workspaces; returns the argmax hits (xent)."""
        # bounds_out (float64, `bound_count`) receives, per layer, max|input| and max|delta| over
        # the shard, then the largest per-sample loss; inf where a NaN or infinity appeared, so that
        # after the MAX-allreduce every rank's `accumulate` raises the same ValueError.
        check_flat(self.model, "params", params)
        _check_float64_out("bounds_out", bounds_out, self.bound_count)
        X, y = check_batch(self.model, self.max_batch, X, y)
        m = X.shape[0]
        inputs = self._shard_inputs(m)
        inputs[...] = X  # a copy: the caller may reuse its shard buffer before `accumulate`
        self._m = None  # a failed pass must not leave stale workspaces to accumulate
        with first_load.timing():  # the first call compiles or loads the kernels: maybe say so
            correct = self._pass(params, inputs, y, bounds_out)
        self._local_bounds[:] = bounds_out
        self._m = m
        return int(correct)

    def _pass(self, params: np.ndarray, inputs: np.ndarray, y: np.ndarray,
              bounds_out: np.ndarray) -> int:  # fmt: skip
        """The per-sample kernels on the shard's copy; returns the hits."""
        kernel = xent_local_pass_ if self.model.loss == "xent" else mse_local_pass_
        return kernel(
            params, self._layers, self._activation, inputs, y, self._activations, self._deltas,
            self._transposed, self._losses, bounds_out,
        )  # fmt: skip

    def accumulate(self, bounds: np.ndarray, global_batch: int, sums_out: np.ndarray) -> None:
        """sums_out (float64, n_params + 1) = extracted per-sample gradient sums, then loss sum."""
        # `bounds` are the MAX-allreduced peaks of every rank and `global_batch` is B; both must be
        # the same on every rank. The result is exact, so summing it over ranks in any order (the
        # float64 ring allreduce) gives the same bits for every sharding of the global batch.
        _check_float64_out("sums_out", sums_out, self.model.n_params + 1)
        magics, units = self.extraction_scales(bounds, global_batch)
        accumulate_(
            self._layers, self._shard_inputs(self._m or 0), self._activations, self._deltas,
            self._losses, magics, units, self._widened, self._counts, sums_out,
        )  # fmt: skip

    def extraction_scales(self, bounds: np.ndarray,
                          global_batch: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(M_s, ulp(M_s)) per slot from the agreed bounds; ValueError for unusable bounds."""
        if self._m is None:
            raise ValueError("accumulate needs a successful local_pass first")
        bounds = _checked_bounds(self.model, bounds)
        global_batch = check_count("global_batch", global_batch, low=1)
        if global_batch < self._m:
            raise ValueError(
                f"global batch {global_batch} is smaller than this rank's shard of {self._m}"
            )
        exponents = extraction_exponents(bounds, global_batch)  # raises for NaN or infinity
        if np.any(bounds < self._local_bounds):
            raise ValueError(
                "bounds are below this rank's own peaks: MAX-allreduce the local_pass bounds "
                "of every rank before accumulate"
            )
        magics = np.ldexp(1.5, exponents)  # M_s = 1.5 * 2^E_s
        units = np.ldexp(1.0, exponents - UNIT_BITS)  # ulp(M_s)
        return magics, units

    def accumulate_layers(self, magics: np.ndarray, units: np.ndarray, sums_out: np.ndarray,
                          top: int, bottom: int) -> None:  # fmt: skip
        """Layers top down to bottom of `accumulate`, at `extraction_scales`' scales."""
        accumulate_layers_(
            self._layers, self._shard_inputs(self._m or 0), self._activations, self._deltas,
            magics, units, self._widened, self._counts, sums_out, top, bottom,
        )  # fmt: skip

    def accumulate_loss(self, magics: np.ndarray, sums_out: np.ndarray) -> None:
        """The extracted loss sum of `accumulate`, into the last slot of `sums_out`."""
        accumulate_loss_(self._losses, self._m or 0, magics[-1], sums_out)

    def sample_terms(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Views of the last pass: each layer's (m, fan_in) input and (m, fan_out) delta; losses."""
        if self._m is None:
            raise ValueError("no local_pass has run yet")
        m, model = self._m, self.model
        inputs = [self._shard_inputs(m)]
        deltas = []
        for layer, (_, fan_out) in enumerate(model.layer_shapes()):
            start = m * int(self._layers[layer, WIDTH_BEFORE])
            deltas.append(self._deltas[start : start + m * fan_out].reshape(m, fan_out))
            if layer < model.n_layers - 1:
                inputs.append(self._activations[start : start + m * fan_out].reshape(m, fan_out))
        return inputs, deltas, self._losses[:m]

    def _shard_inputs(self, m: int) -> np.ndarray:
        """The (m, features) copy of the shard that `local_pass` keeps for `accumulate`."""
        features = self.model.sizes[0]
        return self._inputs[: m * features].reshape(m, features)


def _bound_count(model: MLP) -> int:
    """Length of the bounds vector of `model`: two peaks per layer, then the peak loss."""
    return 2 * model.n_layers + 1


def _check_float64_out(name: str, out: np.ndarray, length: int) -> None:
    """ValueError unless `out` is a writable contiguous float64 array of `length` entries."""
    if (
        not isinstance(out, np.ndarray)
        or out.shape != (length,)
        or out.dtype != np.float64
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"{name} must be a writable contiguous float64 array of shape ({length},), "
            f"got {describe(out)}"
        )


def _checked_bounds(model: MLP, bounds: np.ndarray) -> np.ndarray:
    """The agreed peaks as a float64 array of `bound_count` entries >= 0 (NaN/inf pass)."""
    count = _bound_count(model)
    if not isinstance(bounds, np.ndarray) or bounds.shape != (count,):
        raise ValueError(f"bounds must be an array of shape ({count},), got {describe(bounds)}")
    bounds = bounds.astype(np.float64, copy=False)
    if np.any(bounds < 0):
        raise ValueError("bounds must be >= 0 (they are peaks of absolute values)")
    return bounds


__all__ = ["ExactGradient", "exactness_bound", "extraction_exponents", "slot_bounds"]


# --- exact mode with --precision bf16|fp16 (docs/mixed-precision.md) ------------------------------
# The same per-sample passes with the rounding of float mode's narrow kernels: every product reads
# values of the format and its result is rounded, sample by sample, so the work stays
# batch-invariant; the products accumulate in the model's dtype, in the fixed order. The weight
# gradient's terms are products of two values of the format, exact in float64, and their sums are
# extracted exactly as always: no sum over samples is rounded to the format.


@njit(nogil=True, cache=True)
def forward_exact_narrow_(weights, layers, activation, X, activations, fmt):
    """Fixed-order products of format values; a = round(act(round(x @ W + b))); the logits."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(n_layers):
        W, b = layer_params(weights, layers, layer)
        outputs = layer_rows(activations, layers, layer, m)
        fixed_order_product_(layer_input(X, activations, layers, layer, m), W, outputs)
        add_bias_activate_(outputs, b, activation, True)  # is_last: the bias only
        round_block_(outputs, fmt)
        if layer < n_layers - 1:
            activate_narrow_(outputs, activation, fmt)
    return layer_rows(activations, layers, n_layers - 1, m)


@njit(nogil=True, cache=True)
def backward_exact_narrow_(weights, layers, activation, X, activations, deltas, transposed, fmt):
    """Per-sample deltas of every layer with fixed-order products, each rounded to the format."""
    m = X.shape[0]
    for layer in range(layers.shape[0] - 1, 0, -1):
        W, _ = layer_params(weights, layers, layer)
        fan_in, fan_out = W.shape
        W_T = matrix(transposed, 0, fan_out, fan_in)
        for k in range(fan_in):
            for j in range(fan_out):
                W_T[j, k] = W[k, j]
        previous = layer_rows(deltas, layers, layer - 1, m)
        fixed_order_product_(layer_rows(deltas, layers, layer, m), W_T, previous)
        round_block_(previous, fmt)
        times_slope_(previous, layer_input(X, activations, layers, layer, m), activation)
        if activation != RELU:  # tanh: delta * (1 - a^2) is a new value; relu's mask is exact
            round_block_(previous, fmt)


@njit(nogil=True, cache=True)
def xent_narrow_pass_(weights, layers, activation, X, labels, activations, deltas, transposed,
                      losses, bounds_out, fmt, scale):  # fmt: skip
    """Cross-entropy, the passes in the format, the logits' delta scaled; returns the hits."""
    logits = forward_exact_narrow_(weights, layers, activation, X, activations, fmt)
    delta = layer_rows(deltas, layers, layers.shape[0] - 1, X.shape[0])
    correct = xent_sample_losses_(logits, labels, delta, losses[: X.shape[0]])
    scale_round_(delta, scale, fmt)
    backward_exact_narrow_(weights, layers, activation, X, activations, deltas, transposed, fmt)
    peaks_(layers, X, activations, deltas, losses, bounds_out)
    return correct


@njit(nogil=True, cache=True)
def mse_narrow_pass_(weights, layers, activation, X, targets, activations, deltas, transposed,
                     losses, bounds_out, fmt, scale):  # fmt: skip
    """Mean squared error, the passes in the format, the outputs' delta scaled; returns 0."""
    outputs = forward_exact_narrow_(weights, layers, activation, X, activations, fmt)
    delta = layer_rows(deltas, layers, layers.shape[0] - 1, X.shape[0])
    mse_sample_losses_(outputs, targets, delta, losses[: X.shape[0]])
    scale_round_(delta, scale, fmt)
    backward_exact_narrow_(weights, layers, activation, X, activations, deltas, transposed, fmt)
    peaks_(layers, X, activations, deltas, losses, bounds_out)
    return 0


class NarrowExactGradient(ExactGradient):
    """Exact mode with the passes in bf16 or fp16: bitwise the same sums for every split."""

    def __init__(self, model: MLP, max_batch: int, fmt: int) -> None:
        super().__init__(model, max_batch)
        self.fmt, self.scale = fmt, 1.0
        self._weights = np.zeros(model.n_params, model.dtype)

    def _pass(self, params: np.ndarray, inputs: np.ndarray, y: np.ndarray,
              bounds_out: np.ndarray) -> int:  # fmt: skip
        """Round the weights and the shard's inputs (kept for `accumulate`), then the passes."""
        narrow_copy_(params, self._weights, self.fmt)
        flat = inputs.reshape(-1)
        narrow_copy_(flat, flat, self.fmt)
        kernel = xent_narrow_pass_ if self.model.loss == "xent" else mse_narrow_pass_
        return kernel(
            self._weights, self._layers, self._activation, inputs, y, self._activations,
            self._deltas, self._transposed, self._losses, bounds_out, self.fmt, float(self.scale),
        )  # fmt: skip
