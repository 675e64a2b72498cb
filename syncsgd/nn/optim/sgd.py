"""SGD: its options (--momentum, --nesterov, --weight-decay) with their checks, and its update.

The update, in this order: clip the mean gradient to its global norm, add weight decay, momentum
or Nesterov momentum, step. Every rank applies it to bitwise the same allreduced gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from syncsgd.nn.optim.schedule import (
    OptimConfig,
    clipped_,
    integer_at_least,
)
from syncsgd.util.argtypes import nonnegative_float, unit_fraction
from syncsgd.util.options import at_least, errors, option
from syncsgd.util.validate import float_dtype


def _momentum(flag: str, value: float) -> str | None:
    return None if 0 <= value < 1 else f"{flag} must be in [0, 1), got {value}"


@dataclass(frozen=True)
class SGDOptions:
    """SGD's own options, declared once: TrainConfig takes these fields as they are."""

    momentum: float = option(0.0, "heavy-ball momentum", group="optimization", type=unit_fraction,
                             check=_momentum)  # fmt: skip
    nesterov: bool = option(False, "Nesterov momentum", group="optimization")
    weight_decay: float | None = option(
        None, "weight decay: L2 (added to the gradient) with sgd and adam, decoupled with adamw, "
        "lamb and lars", group="optimization", type=nonnegative_float, check=at_least(0),
        shown="0; 0.01 with --optimizer adamw",
    )  # fmt: skip

    def __post_init__(self) -> None:
        """Check every option and their combination; numbers become Python floats."""
        for error in sgd_errors(self):
            raise ValueError(error)
        object.__setattr__(self, "momentum", float(self.momentum))
        decay = 0.0 if self.weight_decay is None else self.weight_decay  # None: not given
        object.__setattr__(self, "weight_decay", float(decay))


def sgd_errors(options: SGDOptions) -> Iterator[str]:
    """What is wrong with SGD's options, each naming its command-line flag."""
    yield from errors(options)
    if options.nesterov and options.momentum == 0:
        yield "--nesterov needs --momentum > 0"


class SGD:
    """Plain, momentum and Nesterov SGD with weight decay and global-norm clipping, in place."""

    Options: ClassVar[type[SGDOptions]] = SGDOptions

    def __init__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                 options: SGDOptions | None = None,
                 layout: Sequence[tuple[str, tuple[int, ...], int]] | None = None,
                 ) -> None:  # fmt: skip
        # `layout`, the model's tensors, is for the per-tensor optimizers: SGD does not need it
        self.config = config
        self.options = SGDOptions() if options is None else options
        self.n_params = integer_at_least("n_params", n_params, low=0)
        self.dtype = float_dtype(dtype)
        # all buffers are allocated here, once; step_ allocates nothing of size n_params
        momentum = self.options.momentum
        self.velocity = np.zeros(self.n_params, dtype=self.dtype) if momentum > 0.0 else None
        self._scratch = np.empty(self.n_params, dtype=self.dtype)
        self._squares = np.empty(self.n_params, dtype=np.float64)
        from syncsgd.nn.kernels import add_momentum_, descend_  # Numba: when an SGD is made

        self._add_momentum_, self._descend_ = add_momentum_, descend_

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """Update `params` in place with the global batch's mean gradient `grad` (overwritten)."""
        # Order: clip to global norm, add weight decay, momentum / Nesterov, step. Returns {"lr":
        # learning rate used, "grad_norm": norm of grad before clipping}; the norm is nan when
        # neither clipping nor the caller (`want_norm`) needs that extra pass.
        self._check("params", params)
        self._check("grad", grad)
        config, options = self.config, self.options
        lr, grad_norm = clipped_(config, grad, step, self._squares, want_norm)
        if options.weight_decay:
            np.multiply(params, options.weight_decay, out=self._scratch)
            grad += self._scratch  # g + wd * theta
        direction = grad
        if self.velocity is not None:
            # v = mu * v + g (PyTorch's convention); mu rounded to the dtype, as NumPy would
            self._add_momentum_(self.velocity, grad, self.dtype.type(options.momentum))
            if options.nesterov:
                np.multiply(self.velocity, options.momentum, out=self._scratch)
                grad += self._scratch  # g + mu * v
            else:
                direction = self.velocity
        # lr * direction is rounded, then subtracted: one fused pass, lr rounded to the dtype
        self._descend_(params, direction, self.dtype.type(lr))
        return {"lr": lr, "grad_norm": grad_norm}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the state for a checkpoint: {"velocity": ...} with momentum, else {}."""
        return {} if self.velocity is None else {"velocity": self.velocity.copy()}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the state saved by `state_arrays` (other keys of `arrays` are ignored)."""
        if self.velocity is None:
            return
        if "velocity" not in arrays:
            raise ValueError("optimizer state has no 'velocity' array (saved without momentum?)")
        velocity = np.asarray(arrays["velocity"])
        if velocity.shape != self.velocity.shape or velocity.dtype != self.dtype:
            raise ValueError(
                f"optimizer state 'velocity' has shape {velocity.shape}, dtype {velocity.dtype}; "
                f"expected ({self.n_params},) {self.dtype}"
            )
        self.velocity[...] = velocity

    def _check(self, name: str, array: np.ndarray) -> None:
        """ValueError unless `array` is a contiguous (n_params,) array of the optimizer's dtype."""
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{name} must be a NumPy array, not {type(array).__name__}")
        if array.shape != (self.n_params,) or array.dtype != self.dtype:
            raise ValueError(
                f"{name} has shape {array.shape} and dtype {array.dtype}, "
                f"expected ({self.n_params},) {self.dtype}"
            )
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError(f"{name} must be a writeable contiguous array")
