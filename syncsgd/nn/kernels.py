"""Numba kernels of the step around the layers: the shard's gather, the one division by B, the
update's passes; the BLAS threads; the notice of a slow first kernel call.

Every kernel is `@njit(nogil=True, cache=True)`, so thread ranks compute in parallel (given one
BLAS thread per rank: see `limit_blas_threads`). The layers' own kernels sit beside each layer in
syncsgd/nn/layers/, the numerics' in syncsgd/nn/numerics.py.

np.dot inside Numba calls SciPy's BLAS (`scipy.linalg.cython_blas`, imported on the first call);
importing this module first picks its kernels for the CPU (`syncsgd.nn.blas`). Numba's on-disk
cache keys a function on the contents of its own file only: a kernel that inlines another file's
function (the numerics' rounding, say) goes on running the old code after that file is edited
until syncsgd/nn/__pycache__ is deleted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

import numpy as np
from numba import njit

from syncsgd.nn import blas

if importlib.util.find_spec("scipy") is None:
    raise ImportError(
        "syncsgd's Numba kernels need SciPy: np.dot inside Numba calls SciPy's BLAS "
        "(pip install scipy)"
    )
# The one place the kernels' BLAS kernels are chosen: SciPy's OpenBLAS loads at the first kernel
# call, after this import, and reads OPENBLAS_CORETYPE then.
blas.choose_core()

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


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


@njit(nogil=True, cache=True)
def gather_rows_(X, rows, out):
    """out[i] = X[rows[i]]: a shard's samples, copied without holding the GIL."""
    # np.take holds the GIL while it copies: the other thread ranks' Python waited on it.
    # Element by element: a slice assignment would copy each row through a temporary first.
    for i in range(rows.shape[0]):
        row = rows[i]
        for j in range(X.shape[1]):
            out[i, j] = X[row, j]


@njit(nogil=True, cache=True)
def label_range(labels):
    """(smallest, largest) of a non-empty integer array, in one pass."""
    low = high = labels[0]
    for label in labels:
        low, high = min(low, label), max(high, label)
    return low, high


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




def check_count(name: str, value: int, low: int) -> int:
    """`value` as a Python int >= low; ValueError for bools, floats and smaller values."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


