"""Numba kernels: loss and the SUM of per-sample gradients of an MLP over one micro-batch.

The training loop divides the allreduced sum by the global batch size once, so these kernels return
sums, never means. Every kernel is `@njit(nogil=True, cache=True)`, so thread ranks compute in
parallel (given one BLAS thread per rank: see `limit_blas_threads`).

Structure of one gradient call (m samples, L layers, every array a view into a workspace that
`Gradient.__init__` allocated once):
  forward_       a[l+1] = act(a[l] @ W[l] + b[l])       (np.dot -> BLAS, then one fused loop)
  *_loss_delta_  loss sum and delta = d(sum of losses)/d logits, in one pass over the logits
  backward_      gW[l] = a[l]^T @ delta, gb[l] = column sums of delta,
                 delta <- (delta @ W[l]^T) * act'(a[l])  (ping-pong between two delta buffers)
The matrix products sum over samples inside BLAS, whose blocking may depend on m; every per-layer
function takes whole (m, n) blocks, so a batch-invariant variant (exact mode) can call them one
sample at a time and add the per-sample gradients in a fixed order instead.

np.dot inside Numba calls SciPy's BLAS (`scipy.linalg.cython_blas`, imported on the first call);
importing this module first picks its kernels for the CPU (`syncsgd.nn.blas`).

`syncsgd.nn.exact` compiles the layer views, bias and activation, activation slope and per-sample
losses of this module into its own kernels, and `syncsgd.nn.batchnorm` some of both. Numba's
on-disk cache keys a function on the contents of its own file only, so after editing one of them
delete syncsgd/nn/__pycache__: exact mode and BatchNorm would otherwise go on running the old code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

import numpy as np
from numba import njit

from syncsgd.nn import blas
from syncsgd.nn.mlp import MLP, describe

if importlib.util.find_spec("scipy") is None:
    raise ImportError(
        "syncsgd's Numba kernels need SciPy: np.dot inside Numba calls SciPy's BLAS "
        "(pip install scipy)"
    )
# The one place the kernels' BLAS kernels are chosen: SciPy's OpenBLAS loads at the first kernel
# call, after this import, and reads OPENBLAS_CORETYPE then.
blas.choose_core()

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
RELU, TANH = 0, 1
ACTIVATION_CODES = {"relu": RELU, "tanh": TANH}
EVALUATE_CHUNK = 1024  # samples per forward pass in `evaluate`

# Columns of the int64 layer table handed to the kernels, one row per layer.
FAN_IN, FAN_OUT, W_OFFSET, B_OFFSET, WIDTH_BEFORE = range(5)


def limit_blas_threads(threads: int = 1) -> bool:
    """Ask the kernels' BLAS for `threads` threads; False if already loaded or set by the user."""
    # SciPy's OpenBLAS reads OPENBLAS_NUM_THREADS once, when Numba first calls it (the first kernel
    # call); call this before. A multi-threaded OpenBLAS called from several thread ranks at once
    # serializes them, so the threads backend wants one BLAS thread per rank. A thread count the
    # user set in the environment wins. NumPy's own BLAS, loaded with NumPy, is not affected.
    if "scipy.linalg.cython_blas" in sys.modules:
        return False
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return False
    os.environ["OPENBLAS_NUM_THREADS"] = str(int(threads))
    return True


SLOW_LOAD_SECONDS = 1.0  # a first kernel call longer than this is announced
LOADING_MESSAGE = "syncsgd: compiling kernels, first run only ..."


class FirstLoadNotice:
    """One line on a stream when the first kernel call (compile or cache load) takes long."""

    # Armed by the run's first rank; the first kernel call of any rank takes the notice, so it is
    # said at most once per process. Numba makes the other ranks wait for the same compile.

    def __init__(self) -> None:
        self.armed: TextIO | None = None
        self._lock = threading.Lock()

    def arm(self, stream: TextIO) -> None:
        """Announce on `stream` if the next first kernel call takes over SLOW_LOAD_SECONDS."""
        self.armed = stream

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Around a kernel call: the armed stream hears the message if the call takes long."""
        with self._lock:
            stream, self.armed = self.armed, None
        if stream is None:
            yield
            return
        timer = threading.Timer(SLOW_LOAD_SECONDS, say_loading, (stream,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def say_loading(stream: TextIO) -> None:
    """The message, flushed at once: the user is waiting for it."""
    print(LOADING_MESSAGE, file=stream, flush=True)


first_load = FirstLoadNotice()


def layer_table(model: MLP) -> np.ndarray:
    """Per layer: fan_in, fan_out, offsets of W and b, summed widths of the earlier layers."""
    offsets = {name: offset for name, _, offset in model.layout()}
    table = np.zeros((model.n_layers, 5), dtype=np.int64)
    width_before = 0
    for layer, (fan_in, fan_out) in enumerate(model.layer_shapes()):
        table[layer] = (fan_in, fan_out, offsets[f"W{layer}"], offsets[f"b{layer}"], width_before)
        width_before += fan_out
    return table


@njit(nogil=True, cache=True)
def matrix(flat, start, rows, cols):
    """A (rows, cols) C-contiguous view of flat[start : start + rows * cols]."""
    return flat[start : start + rows * cols].reshape(rows, cols)


@njit(nogil=True, cache=True)
def layer_params(flat, layers, layer):
    """(W, b) of `layer`: views into a flat buffer in the parameter layout (params or grads)."""
    fan_out = layers[layer, FAN_OUT]
    b_offset = layers[layer, B_OFFSET]
    W = matrix(flat, layers[layer, W_OFFSET], layers[layer, FAN_IN], fan_out)
    return W, flat[b_offset : b_offset + fan_out]


@njit(nogil=True, cache=True)
def layer_rows(workspace, layers, layer, m):
    """The (m, fan_out) block of `layer` in a per-layer workspace (activations or deltas)."""
    return matrix(workspace, m * layers[layer, WIDTH_BEFORE], m, layers[layer, FAN_OUT])


@njit(nogil=True, cache=True)
def layer_input(X, activations, layers, layer, m):
    """The (m, fan_in) input of `layer`: X for layer 0, else the previous layer's output."""
    if layer == 0:
        return X
    return layer_rows(activations, layers, layer - 1, m)


@njit(nogil=True, cache=True)
def dense_forward_(inputs, W, b, outputs, activation, is_last):
    """outputs = act(inputs @ W + b), act the identity on the last layer."""
    np.dot(inputs, W, outputs)
    add_bias_activate_(outputs, b, activation, is_last)


@njit(nogil=True, cache=True)
def add_bias_activate_(outputs, b, activation, is_last):
    """outputs = act(outputs + b) per element, act the identity on the last layer."""
    m, n = outputs.shape
    zero = outputs.dtype.type(0)
    # One fused pass for bias and activation; the branch is hoisted out of the loops.
    if is_last:
        for i in range(m):
            for j in range(n):
                outputs[i, j] += b[j]
    elif activation == RELU:
        for i in range(m):
            for j in range(n):
                outputs[i, j] = max(outputs[i, j] + b[j], zero)
    else:
        for i in range(m):
            for j in range(n):
                outputs[i, j] = np.tanh(outputs[i, j] + b[j])


@njit(nogil=True, cache=True)
def forward_(params, layers, activation, X, activations):
    """Runs every layer on the m rows of X; returns the (m, K) logits view of `activations`."""
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(n_layers):
        W, b = layer_params(params, layers, layer)
        outputs = layer_rows(activations, layers, layer, m)
        inputs = layer_input(X, activations, layers, layer, m)
        dense_forward_(inputs, W, b, outputs, activation, layer == n_layers - 1)
    return layer_rows(activations, layers, n_layers - 1, m)


# The per-sample functions are inlined: a call per sample would cost as much as an MSE row.
@njit(nogil=True, cache=True, inline="always")
def xent_sample_(logits, labels, delta, i):
    """Sample i's softmax cross-entropy (float64) and argmax; delta[i] = softmax - one_hot."""
    k = logits.shape[1]
    # Stable log-sum-exp: shift by the row maximum (the first one is the argmax, as np.argmax).
    best = 0
    for j in range(1, k):
        if logits[i, j] > logits[i, best]:
            best = j
    shift = logits[i, best]
    total = logits.dtype.type(0)
    for j in range(k):
        delta[i, j] = np.exp(logits[i, j] - shift)
        total += delta[i, j]
    scale = logits.dtype.type(1) / total
    for j in range(k):
        delta[i, j] *= scale
    label = labels[i]
    delta[i, label] -= 1
    return np.float64(shift) + np.log(np.float64(total)) - np.float64(logits[i, label]), best


@njit(nogil=True, cache=True, inline="always")
def mse_sample_(outputs, targets, delta, i, two_over_k):
    """Sample i's mean over outputs of (z - t)^2 (float64); delta[i] = two_over_k (z - t)."""
    k = outputs.shape[1]
    sample_sum = 0.0
    for j in range(k):
        error = outputs[i, j] - targets[i, j]
        sample_sum += np.float64(error) * np.float64(error)
        delta[i, j] = two_over_k * error
    return sample_sum / k


@njit(nogil=True, cache=True)
def xent_loss_delta_(logits, labels, delta):
    """Sum of softmax cross-entropies and count of argmax hits; delta = softmax - one_hot."""
    loss_sum = 0.0
    correct = 0
    for i in range(logits.shape[0]):
        loss, best = xent_sample_(logits, labels, delta, i)
        loss_sum += loss
        correct += best == labels[i]
    return loss_sum, correct


@njit(nogil=True, cache=True)
def mse_loss_delta_(outputs, targets, delta):
    """Sum over samples of mean_k (z - t)^2; delta = 2 (z - t) / K."""
    loss_sum = 0.0
    two_over_k = outputs.dtype.type(2.0 / outputs.shape[1])
    for i in range(outputs.shape[0]):
        loss_sum += mse_sample_(outputs, targets, delta, i, two_over_k)
    return loss_sum, 0


@njit(nogil=True, cache=True)
def times_slope_(delta, below, activation):
    """delta *= act'(z) of the layer below, from its output a: relu' = (a > 0), tanh' = 1 - a^2."""
    m, n = delta.shape
    zero, one = delta.dtype.type(0), delta.dtype.type(1)
    if activation == RELU:
        for i in range(m):
            for j in range(n):
                if below[i, j] <= zero:
                    delta[i, j] = zero
    else:
        for i in range(m):
            for j in range(n):
                delta[i, j] *= one - below[i, j] * below[i, j]


@njit(nogil=True, cache=True)
def backward_(params, layers, activation, X, activations, delta_a, delta_b, grad_out):
    """Writes the summed gradient into grad_out, starting from the logits' delta in delta_a."""
    top = layers.shape[0] - 1
    backward_layers_(params, layers, activation, X, activations, delta_a, delta_b, grad_out, top, 0)


@njit(nogil=True, cache=True)
def backward_layers_(params, layers, activation, X, activations, delta_a, delta_b, grad_out, top,
                     bottom):  # fmt: skip
    """Layers top down to bottom of the backward pass: each one's delta, then its gradient sums."""
    # Called for every layer at once (backward_) or a few at a time (--overlap): the same sums.
    # A call ends with its bottom layer's sums, not the delta below it, so that --overlap can
    # send them while the next call propagates that delta.
    m = X.shape[0]
    n_layers = layers.shape[0]
    for layer in range(top, bottom - 1, -1):
        # The deltas ping-pong: the last layer's lies in delta_a, the one below it in delta_b, ...
        in_a = (n_layers - 1 - layer) % 2 == 0
        delta = matrix(delta_a if in_a else delta_b, 0, m, layers[layer, FAN_OUT])
        if layer < n_layers - 1:  # from the layer above (the loss gave the last layer's delta)
            above = matrix(delta_b if in_a else delta_a, 0, m, layers[layer + 1, FAN_OUT])
            W_above, _ = layer_params(params, layers, layer + 1)
            np.dot(above, W_above.T, delta)
            times_slope_(delta, layer_input(X, activations, layers, layer + 1, m), activation)
        inputs = layer_input(X, activations, layers, layer, m)
        grad_W, grad_b = layer_params(grad_out, layers, layer)
        # Sums over the m samples: inside BLAS for W, in sample order for b.
        np.dot(inputs.T, delta, grad_W)
        grad_b[:] = 0
        for i in range(m):
            for j in range(grad_b.shape[0]):
                grad_b[j] += delta[i, j]


@njit(nogil=True, cache=True)
def xent_gradient_(params, layers, activation, X, labels, activations, delta_a, delta_b, grad_out):
    """Cross-entropy: (loss sum, hits); grad_out = the sum of per-sample gradients."""
    logits = forward_(params, layers, activation, X, activations)
    delta = matrix(delta_a, 0, logits.shape[0], logits.shape[1])
    loss_sum, correct = xent_loss_delta_(logits, labels, delta)
    backward_(params, layers, activation, X, activations, delta_a, delta_b, grad_out)
    return loss_sum, correct


@njit(nogil=True, cache=True)
def mse_gradient_(params, layers, activation, X, targets, activations, delta_a, delta_b, grad_out):
    """Mean squared error: (loss sum, 0); grad_out = the sum of per-sample gradients."""
    outputs = forward_(params, layers, activation, X, activations)
    delta = matrix(delta_a, 0, outputs.shape[0], outputs.shape[1])
    loss_sum, correct = mse_loss_delta_(outputs, targets, delta)
    backward_(params, layers, activation, X, activations, delta_a, delta_b, grad_out)
    return loss_sum, correct


@njit(nogil=True, cache=True)
def xent_loss_(params, layers, activation, X, labels, activations, delta_a):
    """Cross-entropy (loss sum, hits) of a micro-batch, forward pass only."""
    logits = forward_(params, layers, activation, X, activations)
    delta = matrix(delta_a, 0, logits.shape[0], logits.shape[1])
    return xent_loss_delta_(logits, labels, delta)


@njit(nogil=True, cache=True)
def mse_loss_(params, layers, activation, X, targets, activations, delta_a):
    """Mean squared error (loss sum, 0) of a micro-batch, forward pass only."""
    outputs = forward_(params, layers, activation, X, activations)
    delta = matrix(delta_a, 0, outputs.shape[0], outputs.shape[1])
    return mse_loss_delta_(outputs, targets, delta)


@njit(nogil=True, cache=True)
def gather_rows_(X, rows, out):
    """out[i] = X[rows[i]]: a shard's samples, copied without holding the GIL."""
    # np.take holds the GIL while it copies: the other thread ranks' Python waited on it.
    for i in range(rows.shape[0]):
        out[i, :] = X[rows[i], :]


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # reassoc only: lets the check vectorise
def divide_finite_(total, divisor, out):
    """out = total / divisor, element by element; True if all of out is finite."""
    # One pass for the mean gradient and its finiteness check, bitwise what `np.divide(total,
    # divisor, out=out)` gives when `divisor` is a scalar of total's dtype (as NumPy converts a
    # Python int). Each result times 0.0 is 0 if it is finite and NaN if it is NaN or +-inf, so the
    # sum of those is 0 exactly when all are finite - unlike a plain sum, which overflows on large
    # finite values. `out` may be `total` (then the loop touches one array and vectorises);
    # otherwise the check reads out, so a float64 mean too large for a float32 out counts as the
    # infinity it becomes.
    poison = 0.0
    if out.ctypes.data == total.ctypes.data:
        for i in range(total.size):
            value = total[i] / divisor  # of total's dtype: stored as it is
            total[i] = value
            poison += value * 0.0
    else:
        for i in range(total.size):
            out[i] = total[i] / divisor
            poison += out[i] * 0.0
    return poison == 0.0


@njit(nogil=True, cache=True)
def descend_(params, direction, lr):
    """params -= lr * direction in one pass; lr of params' dtype, the product rounded first."""
    # Bitwise what `np.multiply(direction, lr, out=scratch); params -= scratch` gives: the same
    # two roundings (no fastmath, so no fused multiply-add), without the scratch array's pass.
    for i in range(params.size):
        params[i] -= direction[i] * lr


@njit(nogil=True, cache=True)
def add_momentum_(velocity, grad, momentum):
    """velocity = momentum * velocity + grad in one pass; momentum of velocity's dtype."""
    # Bitwise `velocity *= momentum; velocity += grad`: the product is rounded, then the sum.
    for i in range(velocity.size):
        velocity[i] = velocity[i] * momentum + grad[i]


class Gradient:
    """Loss and SUM of per-sample gradients of a micro-batch, with workspaces allocated once."""

    # One instance per thread: calls share the workspaces, so two threads need two instances.

    def __init__(self, model: MLP, max_batch: int) -> None:
        self.model = model
        self.max_batch = check_count("max_batch", max_batch, low=0)
        self._layers = layer_table(model)
        self._activation = ACTIVATION_CODES[model.activation]
        widest = max(model.sizes[1:])
        self._activations = np.zeros(self.max_batch * sum(model.sizes[1:]), dtype=model.dtype)
        self._delta_a = np.zeros(self.max_batch * widest, dtype=model.dtype)
        self._delta_b = np.zeros(self.max_batch * widest, dtype=model.dtype)

    def __call__(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray, grad_out: np.ndarray
    ) -> tuple[float, int]:
        """(sum of losses, argmax hits); grad_out is overwritten with the summed gradient."""
        check_flat(self.model, "params", params)
        check_flat(self.model, "grad_out", grad_out)
        if not grad_out.flags.writeable:
            raise ValueError("grad_out is read-only")
        X, y = check_batch(self.model, self.max_batch, X, y)
        kernel = xent_gradient_ if self.model.loss == "xent" else mse_gradient_
        if first_load.armed is not None:
            with first_load.timing():
                return self._run(kernel, params, X, y, grad_out)
        return self._run(kernel, params, X, y, grad_out)

    def _run(self, kernel: Callable, params: np.ndarray, X: np.ndarray, y: np.ndarray,
             grad_out: np.ndarray) -> tuple[float, int]:  # fmt: skip
        """The kernel call on checked arguments."""
        loss_sum, correct = kernel(
            params,
            self._layers,
            self._activation,
            X,
            y,
            self._activations,
            self._delta_a,
            self._delta_b,
            grad_out,
        )
        return float(loss_sum), int(correct)

    def backward_layers(self, params: np.ndarray, X: np.ndarray, grad_out: np.ndarray, top: int,
                        bottom: int) -> None:  # fmt: skip
        """Layers top down to bottom of the backward pass after `loss(params, X, ...)`."""
        # X: the contiguous array of the model's dtype that `loss` ran on; checked there.
        backward_layers_(params, self._layers, self._activation, X, self._activations,
                         self._delta_a, self._delta_b, grad_out, top, bottom)  # fmt: skip

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """(sum of losses, argmax hits) of the micro-batch, without the backward pass."""
        check_flat(self.model, "params", params)
        X, y = check_batch(self.model, self.max_batch, X, y)
        kernel = xent_loss_ if self.model.loss == "xent" else mse_loss_
        loss_sum, correct = kernel(
            params, self._layers, self._activation, X, y, self._activations, self._delta_a
        )
        return float(loss_sum), int(correct)


def evaluate(model: MLP, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean loss, accuracy) over all samples of X, y; accuracy is nan for mse."""
    n_samples = len(X)
    if n_samples == 0:
        raise ValueError("evaluate needs at least one sample")
    gradient = Gradient(model, min(n_samples, EVALUATE_CHUNK))
    loss_sum = 0.0
    correct = 0
    for start in range(0, n_samples, EVALUATE_CHUNK):
        chunk_loss, chunk_correct = gradient.loss(
            params, X[start : start + EVALUATE_CHUNK], y[start : start + EVALUATE_CHUNK]
        )
        loss_sum += chunk_loss
        correct += chunk_correct
    accuracy = correct / n_samples if model.loss == "xent" else float("nan")
    return loss_sum / n_samples, accuracy


# --- argument checks, shared with syncsgd.nn.exact ------------------------------------------------


def check_count(name: str, value: int, low: int) -> int:
    """`value` as a Python int >= low; ValueError for bools, floats and smaller values."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_flat(model: MLP, name: str, flat: np.ndarray) -> None:
    """ValueError unless `flat` is a contiguous (n_params,) array of the model's dtype."""
    if (
        not isinstance(flat, np.ndarray)
        or flat.shape != (model.n_params,)
        or flat.dtype != model.dtype
        or not flat.flags.c_contiguous
    ):
        raise ValueError(
            f"{name} must be a contiguous {model.dtype} array of shape ({model.n_params},), "
            f"got {describe(flat)}"
        )


def check_batch(
    model: MLP, max_batch: int, X: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """X and y as the kernels need them (C-contiguous, right dtypes), or a ValueError."""
    features, outputs = model.sizes[0], model.sizes[-1]
    X = np.ascontiguousarray(X, dtype=model.dtype)
    if X.ndim != 2 or X.shape[1] != features:
        raise ValueError(f"X must have shape (m, {features}), got shape {X.shape}")
    m = X.shape[0]
    if m > max_batch:
        raise ValueError(f"micro-batch of {m} samples exceeds max_batch={max_batch}")
    if model.loss == "xent":
        y = np.asarray(y)
        if y.shape != (m,) or (y.dtype.kind not in "iu" and m > 0):
            raise ValueError(f"labels must be an integer array of shape ({m},), got {describe(y)}")
        y = np.ascontiguousarray(y, dtype=np.int64)
        # Checked here: an out-of-range label would index outside the kernels' arrays.
        if m and (y.min() < 0 or y.max() >= outputs):
            raise ValueError(f"labels must lie in [0, {outputs}), got {y.min()}..{y.max()}")
    else:
        y = np.ascontiguousarray(y, dtype=model.dtype)
        if y.shape != (m, outputs):
            raise ValueError(f"targets must have shape ({m}, {outputs}), got {y.shape}")
    return X, y
