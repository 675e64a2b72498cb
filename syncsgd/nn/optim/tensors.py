"""What the Adam family shares: the model's tensor boundaries in the flat buffer, their norms,
Adam's moments (with their checkpoint state), and the check of a flat array.

Every reduction here (a tensor's norm) is squared and summed in float64 in NumPy's fixed order,
as `global_norm` is, so every rank computes the same bits from the same parameters; exact mode
sums the squares exactly (`nn.exact.exact_square_sum`), so that a tensor split over the ranks of a
sharded step (`shared_norms`) has the norm it has whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from syncsgd.nn.optim.schedule import global_norm, integer_at_least
from syncsgd.util.validate import float_dtype

# (name, shape, offset into the flat buffer) of every parameter tensor: a model's layout()
Layout = Sequence[tuple[str, tuple[int, ...], int]]


def tensor_slices(layout: Layout | None, n_params: int) -> list[slice]:
    """The slice of every tensor of `layout` in the flat buffer; one tensor of all if None."""
    if layout is None:
        return [slice(0, n_params)]
    slices, end = [], 0
    for name, shape, offset in layout:
        size = int(np.prod(shape, dtype=np.int64))
        if offset != end or offset + size > n_params:
            raise ValueError(
                f"layout: tensor {name!r} at offset {offset} does not follow the one before "
                f"(ends at {end}) within {n_params} parameters"
            )
        slices.append(slice(offset, offset + size))
        end = offset + size
    if end != n_params:
        raise ValueError(f"layout covers {end} of {n_params} parameters")
    return slices


def tensor_norms(values: np.ndarray, slices: Sequence[slice], squares: np.ndarray) -> list[float]:
    """The L2 norm of every tensor of `values`, each in float64 (`squares`: float64 scratch)."""
    return [global_norm(values[part], squares[part]) for part in slices]


def check_flat(name: str, array: np.ndarray, n_params: int, dtype: np.dtype) -> None:
    """ValueError unless `array` is a writeable contiguous (n_params,) array of `dtype`."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name} must be a NumPy array, not {type(array).__name__}")
    if array.shape != (n_params,) or array.dtype != dtype:
        raise ValueError(f"{name} has shape {array.shape} and dtype {array.dtype}, "
                         f"expected ({n_params},) {dtype}")  # fmt: skip
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"{name} must be a writeable contiguous array")


def load_array(arrays: Mapping[str, np.ndarray], name: str, into: np.ndarray) -> None:
    """Copy state array `name` of `arrays` into `into`, after checking its shape and dtype."""
    if name not in arrays:
        raise ValueError(f"optimizer state has no {name!r} array (saved by another optimizer?)")
    value = np.asarray(arrays[name])
    if value.shape != into.shape or value.dtype != into.dtype:
        raise ValueError(f"optimizer state {name!r} has shape {value.shape}, dtype {value.dtype}; "
                         f"expected {into.shape} {into.dtype}")  # fmt: skip
    into[...] = value


class Moments:
    """Adam's first and second moments and its step count t, updated in place as PyTorch does."""

    def __init__(self, n_params: int, dtype: np.dtype, betas: tuple[float, float],
                 eps: float) -> None:  # fmt: skip
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.exp_avg = np.zeros(n_params, dtype=dtype)
        self.exp_avg_sq = np.zeros(n_params, dtype=dtype)
        self.t = 0  # steps taken: a skipped (non-finite) step does not count

    def update_(self, grad: np.ndarray, scratch: np.ndarray) -> None:
        """t += 1; m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g g (torch's order)."""
        self.t += 1
        weight = 1 - self.beta1
        np.subtract(grad, self.exp_avg, out=scratch)  # torch's lerp: from the nearer end
        if weight < 0.5:
            scratch *= weight
            self.exp_avg += scratch  # m + w (g - m)
        else:
            scratch *= 1 - weight
            np.subtract(grad, scratch, out=self.exp_avg)  # g - (g - m)(1 - w)
        self.exp_avg_sq *= self.beta2
        np.multiply(grad, 1 - self.beta2, out=scratch)  # addcmul: (value g) g
        scratch *= grad
        self.exp_avg_sq += scratch

    def denominator_(self, out: np.ndarray) -> None:
        """sqrt(v) / sqrt(1 - beta2^t) + eps into `out`: eps after the square root."""
        bias_correction2 = 1 - self.beta2**self.t
        np.sqrt(self.exp_avg_sq, out=out)
        out /= bias_correction2**0.5
        out += self.eps

    def bias_correction1(self) -> float:
        """1 - beta1^t."""
        return 1 - self.beta1**self.t

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of m, v and t (a 0-d int64 array) for a checkpoint."""
        return {"exp_avg": self.exp_avg.copy(), "exp_avg_sq": self.exp_avg_sq.copy(),
                "step": np.array(self.t, dtype=np.int64)}  # fmt: skip

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore m, v and t from `state_arrays`' arrays."""
        if "step" not in arrays:
            raise ValueError("optimizer state has no 'step' array (saved by another optimizer?)")
        step = np.asarray(arrays["step"])
        if step.size != 1 or step.dtype.kind not in "iu" or int(step.reshape(())) < 0:
            raise ValueError(f"optimizer state 'step' must be one step count, got {step!r}")
        load_array(arrays, "exp_avg", self.exp_avg)
        load_array(arrays, "exp_avg_sq", self.exp_avg_sq)
        self.t = int(step.reshape(()))


class FlatOptimizer:
    """What the optimizers over the flat buffer share: their settings, the buffer's length and
    dtype, its tensors' slices, the float64 scratch of the norms, and the checks of a step's
    arrays. A subclass sets `Options` and allocates its own state."""

    Options: ClassVar[Any]
    # How the squares of a tensor become its norm when its tensors are pieces of the model's,
    # held by several ranks (a sharded step's): (values, slices) -> every piece's tensor's norm
    shared_norms: Callable[[np.ndarray, list[slice]], list[float]] | None = None

    def __init__(self, config: Any, n_params: int, dtype: str | np.dtype, options: Any = None,
                 layout: Layout | None = None) -> None:  # fmt: skip
        self.config = config
        self.options = self.Options() if options is None else options
        self.n_params = integer_at_least("n_params", n_params, low=0)
        self.dtype = float_dtype(dtype)
        self.slices = tensor_slices(layout, self.n_params)
        # all buffers are allocated when the optimizer is made; a step allocates nothing this long
        self._scratch = np.empty(self.n_params, dtype=self.dtype)
        self._squares = np.empty(self.n_params, dtype=np.float64)

    def norms(self, values: np.ndarray) -> list[float]:
        """The L2 norm of every tensor of `values`: pairwise in float64, exact mode's squares
        summed exactly (the same bits however the tensor is split), or over the ranks."""
        if self.shared_norms is not None:
            return self.shared_norms(values, self.slices)
        if self.config.exact_norm:
            from syncsgd.nn.exact import exact_square_sum  # Numba: only when a norm is taken

            return [math.sqrt(exact_square_sum(values[part])) for part in self.slices]
        return tensor_norms(values, self.slices, self._squares)

    def check_(self, params: np.ndarray, grad: np.ndarray) -> None:
        """ValueError unless both are contiguous (n_params,) arrays of the optimizer's dtype."""
        check_flat("params", params, self.n_params, self.dtype)
        check_flat("grad", grad, self.n_params, self.dtype)


class LayerwiseOptimizer(FlatOptimizer):
    """An optimizer that scales each tensor's update by a trust ratio of its own (LAMB, LARS).

    `agreed_trust`, when set, replaces the ratios of the next step (then clears): what a run that
    agrees on them elsewhere uses (the local-trust-ratio pitfall)."""

    agreed_trust: list[float] | None = None

    def trust_ratios(self, params: np.ndarray, grad: np.ndarray) -> list[float]:
        """Every tensor's ratio were `grad` this step's mean gradient; no state changes."""
        raise NotImplementedError

    def step_ratios(self, computed: list[float]) -> list[float]:
        """The ratios this step uses: the agreed ones if set (once), else `computed`."""
        agreed, self.agreed_trust = self.agreed_trust, None
        return computed if agreed is None else agreed
