"""Rounding to the narrow float formats of mixed-precision training: bfloat16 and float16.

Values are rounded, not stored narrow: a rounded value is kept in a float32 or float64 array
(every bfloat16 and float16 value is exactly a float32), so the kernels compute on ordinary arrays.
Rounding is to nearest, ties to even, as the hardware's conversion does, with the format's
subnormals, overflow to a signed infinity and NaN kept (docs/mixed-precision.md).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from syncsgd.nn.kernels import (
    ACTIVATION_CODES,
    FAN_IN,
    FAN_OUT,
    RELU,
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
    mse_loss_delta_,
    times_slope_,
    xent_loss_delta_,
)
from syncsgd.nn.mlp import MLP

FP32, BF16, FP16 = 0, 1, 2  # format codes handed to the kernels; FP32: no rounding
PRECISION_CODES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}
ALLREDUCE_CODES = {"bfloat16": BF16, "float16": FP16}

# (significand bits with the implicit one, smallest normal exponent, largest finite value)
BF16_BITS, BF16_EMIN, BF16_MAX = 8, -126, float.fromhex("0x1.fep127")
FP16_BITS, FP16_EMIN, FP16_MAX = 11, -14, 65504.0


@njit(nogil=True, cache=True, inline="always")
def round_value(x, bits, emin, largest):
    """x (float64) rounded to nearest even in the format with `bits`, `emin` and `largest`."""
    # Quantum q = 2^(e - bits + 1) at x's binade e, never below the subnormal quantum; x / q is
    # exact (q is a power of two within float64's range) and rint rounds ties to even.
    if x != x or x == 0.0 or math.isinf(x):
        return x
    _, exponent = math.frexp(x)  # x = f * 2^exponent with 0.5 <= |f| < 1: binade exponent - 1
    quantum = math.ldexp(1.0, max(exponent - 1, emin) - bits + 1)
    rounded = np.rint(x / quantum) * quantum
    if abs(rounded) > largest:
        return math.copysign(math.inf, x)
    return rounded


@njit(nogil=True, cache=True, inline="always")
def round_to(x, fmt):
    """x (float64) rounded to format `fmt` (BF16 or FP16); FP32 leaves it as it is."""
    if fmt == BF16:
        return round_value(x, BF16_BITS, BF16_EMIN, BF16_MAX)
    if fmt == FP16:
        return round_value(x, FP16_BITS, FP16_EMIN, FP16_MAX)
    return x


@njit(nogil=True, cache=True)
def round_flat_(values, fmt):
    """Round every element of a contiguous 1-D float32 or float64 array in place."""
    if fmt == FP32:
        return
    for i in range(values.size):
        values[i] = round_to(np.float64(values[i]), fmt)


def round_array(values: np.ndarray, fmt: int) -> np.ndarray:
    """A rounded copy of a float32 or float64 array of any shape (the test's and tools' entry)."""
    out = np.array(values, copy=True, order="C")
    if out.dtype not in (np.float32, np.float64):
        raise ValueError(f"round_array takes float32 or float64 values, got {out.dtype}")
    round_flat_(out.reshape(-1), fmt)
    return out


# --- float mode's forward and backward passes in a narrow format (docs/mixed-precision.md) -------
# The default kernels (syncsgd.nn.kernels) are untouched: these run only with --precision bf16|fp16.
# Every value a matrix product or an activation reads is a value of the format, held in float32;
# the products accumulate in float32 (np.dot on float32 arrays) and their results are rounded.


@njit(nogil=True, cache=True)
def round_block_(block, fmt):
    """Round every element of a 2-D array (a view of a workspace) in place."""
    for i in range(block.shape[0]):
        for j in range(block.shape[1]):
            block[i, j] = round_to(np.float64(block[i, j]), fmt)


@njit(nogil=True, cache=True)
def narrow_copy_(source, out, fmt):
    """out[i] = source[i] rounded to the format: the values a pass computes with (may be source)."""
    for i in range(source.size):
        out[i] = round_to(np.float64(source[i]), fmt)


@njit(nogil=True, cache=True)
def activate_narrow_(outputs, activation, fmt):
    """outputs = round(act(outputs)) per element: relu keeps format values, tanh is rounded."""
    zero = outputs.dtype.type(0)
    for i in range(outputs.shape[0]):
        for j in range(outputs.shape[1]):
            value = outputs[i, j]
            if activation == RELU:
                outputs[i, j] = max(value, zero)
            else:
                outputs[i, j] = round_to(np.float64(np.tanh(value)), fmt)


@njit(nogil=True, cache=True)
def forward_narrow_(weights, layers, activation, X, activations, fmt):
    """Every layer: a = round(act(round(x @ W + b))), x, W, b values of the format; the logits."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(n_layers):
        W, b = layer_params(weights, layers, layer)
        outputs = layer_rows(activations, layers, layer, m)
        np.dot(layer_input(X, activations, layers, layer, m), W, outputs)
        add_bias_activate_(outputs, b, RELU, True)  # is_last: the bias only, no activation
        round_block_(outputs, fmt)  # x @ W + b rounded once, as a fused addmm
        if layer < n_layers - 1:
            activate_narrow_(outputs, activation, fmt)
    return layer_rows(activations, layers, n_layers - 1, m)


@njit(nogil=True, cache=True)
def scale_round_(delta, scale, fmt):
    """delta = round(delta * scale): the loss scale, then the gradient as the format holds it."""
    for i in range(delta.shape[0]):
        for j in range(delta.shape[1]):
            delta[i, j] = round_to(np.float64(delta[i, j]) * scale, fmt)


@njit(nogil=True, cache=True)
def backward_narrow_(weights, layers, activation, X, activations, delta_a, delta_b, grad_out,
                     fmt):  # fmt: skip
    """grad_out = the shard's gradient sums, each layer's rounded once, from the logits' delta."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    delta = matrix(delta_a, 0, m, layers[n_layers - 1, FAN_OUT])
    spare_is_b = True
    for layer in range(n_layers - 1, -1, -1):
        inputs = layer_input(X, activations, layers, layer, m)
        grad_W, grad_b = layer_params(grad_out, layers, layer)
        # dW = round(x^T @ delta) and db = round(column sums of delta), both summed in float32.
        product = np.dot(inputs.T, delta)
        column = np.zeros(delta.shape[1], np.float32)
        for i in range(m):
            for j in range(delta.shape[1]):
                column[j] += delta[i, j]
        for k in range(product.shape[0]):
            for j in range(product.shape[1]):
                grad_W[k, j] = round_to(np.float64(product[k, j]), fmt)
        for j in range(column.shape[0]):
            grad_b[j] = round_to(np.float64(column[j]), fmt)
        if layer == 0:
            break
        W, _ = layer_params(weights, layers, layer)
        previous = matrix(delta_b if spare_is_b else delta_a, 0, m, layers[layer, FAN_IN])
        np.dot(delta, W.T, previous)
        round_block_(previous, fmt)
        times_slope_(previous, inputs, activation)
        if activation != RELU:  # tanh: delta * (1 - a^2) is a new value; relu's mask is exact
            round_block_(previous, fmt)
        spare_is_b = not spare_is_b
        delta = previous


@njit(nogil=True, cache=True)
def narrow_xent_gradient_(weights, layers, activation, X, labels, activations, delta_a, delta_b,
                          grad_out, fmt, scale):  # fmt: skip
    """Cross-entropy in float32 on the rounded logits; grad_out = the scaled, rounded sums."""
    logits = forward_narrow_(weights, layers, activation, X, activations, fmt)
    delta = matrix(delta_a, 0, logits.shape[0], logits.shape[1])
    loss_sum, correct = xent_loss_delta_(logits, labels, delta)
    scale_round_(delta, scale, fmt)
    backward_narrow_(weights, layers, activation, X, activations, delta_a, delta_b, grad_out, fmt)
    return loss_sum, correct


@njit(nogil=True, cache=True)
def narrow_mse_gradient_(weights, layers, activation, X, targets, activations, delta_a, delta_b,
                         grad_out, fmt, scale):  # fmt: skip
    """Mean squared error in float32 on the rounded outputs; grad_out as for cross-entropy."""
    outputs = forward_narrow_(weights, layers, activation, X, activations, fmt)
    delta = matrix(delta_a, 0, outputs.shape[0], outputs.shape[1])
    loss_sum, correct = mse_loss_delta_(outputs, targets, delta)
    scale_round_(delta, scale, fmt)
    backward_narrow_(weights, layers, activation, X, activations, delta_a, delta_b, grad_out, fmt)
    return loss_sum, correct


class NarrowGradient:
    """Float mode's loss and gradient SUM with the passes in bf16 or fp16 (float32 workspaces)."""

    def __init__(self, model: MLP, max_batch: int, fmt: int) -> None:
        self.model, self.fmt = model, fmt
        self.max_batch = check_count("max_batch", max_batch, low=0)
        self._layers = layer_table(model)
        self._activation = ACTIVATION_CODES[model.activation]
        widest = max(model.sizes[1:])
        self._weights = np.zeros(model.n_params, np.float32)
        self._inputs = np.zeros(self.max_batch * model.sizes[0], np.float32)
        self._activations = np.zeros(self.max_batch * sum(model.sizes[1:]), np.float32)
        self._delta_a = np.zeros(self.max_batch * widest, np.float32)
        self._delta_b = np.zeros(self.max_batch * widest, np.float32)

    def __call__(self, params: np.ndarray, X: np.ndarray, y: np.ndarray, grad_out: np.ndarray,
                 scale: float = 1.0) -> tuple[float, int]:  # fmt: skip
        """(sum of losses, hits); grad_out = the sum of gradients of `scale` times the loss."""
        check_flat(self.model, "params", params)
        check_flat(self.model, "grad_out", grad_out)
        X, y = check_batch(self.model, self.max_batch, X, y)
        m, features = X.shape
        inputs = self._inputs[: m * features].reshape(m, features)
        narrow_copy_(params, self._weights, self.fmt)  # autocast's cast of the weights
        narrow_copy_(X.reshape(-1), inputs.reshape(-1), self.fmt)
        kernel = narrow_xent_gradient_ if self.model.loss == "xent" else narrow_mse_gradient_
        with first_load.timing():
            loss_sum, correct = kernel(
                self._weights, self._layers, self._activation, inputs, y, self._activations,
                self._delta_a, self._delta_b, grad_out, self.fmt, float(scale),
            )  # fmt: skip
        return float(loss_sum), int(correct)
