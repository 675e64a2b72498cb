"""The update: learning-rate schedules, clipping, weight decay, momentum, the SGD step.

Every rank applies the same update to bitwise the same allreduced gradient, so every rank's
parameters stay bitwise equal. All reductions here (the gradient norm) are computed in a fixed order
that does not depend on the rank or on memory alignment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from syncsgd.util.validate import choice, float_dtype, integer

SCHEDULES = ("constant", "cosine", "warmup", "noam")
LR_SCALINGS = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    """Hyper-parameters of the optimizer and its learning-rate schedule (validated on creation)."""

    lr: float = 0.1
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_norm: float | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    lr_scaling: str = "none"
    base_batch: int = 256
    batch_size: int = 256
    noam_dim: int = 1

    def __post_init__(self) -> None:
        """Check every field and normalise numbers to Python floats and ints."""
        values: dict[str, Any] = {
            "lr": _real("lr", self.lr, low=0.0, low_open=True),
            "momentum": _real("momentum", self.momentum, low=0.0, high=1.0),
            "nesterov": bool(self.nesterov),
            "weight_decay": _real("weight_decay", self.weight_decay, low=0.0),
            "clip_norm": None
            if self.clip_norm is None
            else _real("clip_norm", self.clip_norm, low=0.0, low_open=True),
            "schedule": choice("schedule", self.schedule, SCHEDULES),
            "warmup_steps": _integer("warmup_steps", self.warmup_steps, low=0),
            "total_steps": _integer("total_steps", self.total_steps, low=1),
            "lr_scaling": choice("lr_scaling", self.lr_scaling, LR_SCALINGS),
            "base_batch": _integer("base_batch", self.base_batch, low=1),
            "batch_size": _integer("batch_size", self.batch_size, low=1),
            "noam_dim": _integer("noam_dim", self.noam_dim, low=1),
        }
        if values["nesterov"] and values["momentum"] == 0.0:
            raise ValueError("nesterov needs momentum > 0")
        if values["schedule"] in ("warmup", "noam") and values["warmup_steps"] < 1:
            raise ValueError(f"schedule {values['schedule']!r} needs warmup_steps >= 1")
        for field in fields(self):
            object.__setattr__(self, field.name, values[field.name])


def learning_rate(config: OptimConfig, step: int) -> float:
    """The learning rate of step `step` (0-based) under the schedule and batch-size scaling rule."""
    step = _integer("step", step, low=0)
    ratio = config.batch_size / config.base_batch
    base = config.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.lr_scaling]
    warmup = config.warmup_steps
    if config.schedule == "constant":
        return base
    if config.schedule == "warmup":
        return base * min(1.0, (step + 1) / warmup)
    if config.schedule == "cosine":
        ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return base * ramp * 0.5 * (1.0 + math.cos(math.pi * step / config.total_steps))
    # noam: d^-0.5 * min(t^-0.5, t * w^-1.5) with the 1-based step t = step + 1
    t = step + 1
    return base * config.noam_dim**-0.5 * min(t**-0.5, t * warmup**-1.5)


def global_norm(values: np.ndarray, squares: np.ndarray | None = None) -> float:
    """L2 norm of a 1-D array, squared and summed in float64 (NumPy's fixed pairwise order)."""
    # `squares`, a float64 array of the same length, is used as scratch to avoid an allocation.
    if squares is None:
        squares = np.empty(values.shape, dtype=np.float64)
    np.square(values, out=squares, dtype=np.float64)  # square in float64, not in values' dtype
    return math.sqrt(float(squares.sum()))


def clip_(grad: np.ndarray, clip_norm: float, norm: float) -> bool:
    """Scale `grad` in place to L2 norm `clip_norm` if its norm `norm` exceeds it; True if so."""
    if not norm > clip_norm:
        return False
    grad *= clip_norm / norm  # the ratio is formed in float64, then rounded once to grad's dtype
    return True


class SGD:
    """Plain, momentum and Nesterov SGD with weight decay and global-norm clipping, in place."""

    def __init__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype) -> None:
        self.config = config
        self.n_params = _integer("n_params", n_params, low=0)
        self.dtype = float_dtype(dtype)
        # all buffers are allocated here, once; step_ allocates nothing of size n_params
        self.velocity = np.zeros(self.n_params, dtype=self.dtype) if config.momentum > 0.0 else None
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
        config = self.config
        lr = learning_rate(config, step)
        needs_norm = want_norm or config.clip_norm is not None
        grad_norm = global_norm(grad, self._squares) if needs_norm else math.nan
        if config.clip_norm is not None:
            clip_(grad, config.clip_norm, grad_norm)
        if config.weight_decay:
            np.multiply(params, config.weight_decay, out=self._scratch)
            grad += self._scratch  # g + wd * theta
        direction = grad
        if self.velocity is not None:
            # v = mu * v + g (PyTorch's convention); mu rounded to the dtype, as NumPy would
            self._add_momentum_(self.velocity, grad, self.dtype.type(config.momentum))
            if config.nesterov:
                np.multiply(self.velocity, config.momentum, out=self._scratch)
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


def _real(
    name: str, value: float, *, low: float, high: float | None = None, low_open: bool = False
) -> float:
    """`value` as a finite float with low <= value (< if low_open) and value < high (if given)."""
    if isinstance(value, bool | str) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{name} must be a number, not {value!r}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or (high is not None and number >= high):
        bounds = f"{'>' if low_open else '>='} {low:g}" + (
            f" and < {high:g}" if high is not None else ""
        )
        raise ValueError(f"{name} must be a finite number {bounds}, got {value!r}")
    return number


def _integer(name: str, value: int, *, low: int) -> int:
    """`value` as an int >= low; ValueError for floats, bools and smaller values."""
    number = integer(name, value)
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number
