"""What every optimizer shares: the learning-rate schedules and the global-norm clipping.

Every rank applies the same update to bitwise the same allreduced gradient, so every rank's
parameters stay bitwise equal. All reductions here (the gradient norm) are computed in a fixed order
that does not depend on the rank or on memory alignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from syncsgd.util.validate import choice, integer

SCHEDULES = ("constant", "cosine", "warmup", "noam")
LR_SCALINGS = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    """The learning-rate schedule and the clipping of a run (validated on creation)."""

    lr: float = 0.1
    clip_norm: float | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    lr_scaling: str = "none"
    base_batch: int = 256
    batch_size: int = 256
    noam_dim: int = 1
    # the global norm's squares summed exactly, rounded once (exact mode): the same bits however
    # the gradient is split over shards; else NumPy's pairwise float64 sum
    exact_norm: bool = False

    def __post_init__(self) -> None:
        """Check every field and normalise numbers to Python floats and ints."""
        values: dict[str, Any] = {
            "lr": _real("lr", self.lr, low=0.0, low_open=True),
            "clip_norm": None
            if self.clip_norm is None
            else _real("clip_norm", self.clip_norm, low=0.0, low_open=True),
            "schedule": choice("schedule", self.schedule, SCHEDULES),
            "warmup_steps": integer_at_least("warmup_steps", self.warmup_steps, low=0),
            "total_steps": integer_at_least("total_steps", self.total_steps, low=1),
            "lr_scaling": choice("lr_scaling", self.lr_scaling, LR_SCALINGS),
            "base_batch": integer_at_least("base_batch", self.base_batch, low=1),
            "batch_size": integer_at_least("batch_size", self.batch_size, low=1),
            "noam_dim": integer_at_least("noam_dim", self.noam_dim, low=1),
            "exact_norm": bool(self.exact_norm),
        }
        if values["schedule"] in ("warmup", "noam") and values["warmup_steps"] < 1:
            raise ValueError(f"schedule {values['schedule']!r} needs warmup_steps >= 1")
        for field in fields(self):
            object.__setattr__(self, field.name, values[field.name])


def learning_rate(config: OptimConfig, step: int) -> float:
    """The learning rate of step `step` (0-based) under the schedule and batch-size scaling rule."""
    step = integer_at_least("step", step, low=0)
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


def _real(name: str, value: float, *, low: float, low_open: bool = False) -> float:
    """`value` as a finite float with low <= value (low < value if low_open)."""
    if isinstance(value, bool | str) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{name} must be a number, not {value!r}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low:
        raise ValueError(
            f"{name} must be a finite number {'>' if low_open else '>='} {low:g}, got {value!r}"
        )
    return number


def integer_at_least(name: str, value: int, *, low: int) -> int:
    """`value` as an int >= low; ValueError for floats, bools and smaller values."""
    number = integer(name, value)
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number


def clipped_(config: OptimConfig, grad: np.ndarray, step: int, squares: np.ndarray,
             want_norm: bool) -> tuple[float, float]:
    """The step's learning rate and the gradient's norm (nan unless clipping or the caller needs
    it), the gradient clipped in place to --clip-norm: every optimizer's first move."""
    lr = learning_rate(config, step)
    needs_norm = want_norm or config.clip_norm is not None
    grad_norm = math.nan
    if needs_norm and config.exact_norm:
        from syncsgd.nn.exact import exact_square_sum  # Numba: only when a norm is taken

        grad_norm = math.sqrt(exact_square_sum(grad))
    elif needs_norm:
        grad_norm = global_norm(grad, squares)
    if config.clip_norm is not None:
        clip_(grad, config.clip_norm, grad_norm)
    return lr, grad_norm
