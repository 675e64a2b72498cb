"""Adam and AdamW: their options (--betas, --eps, --weight-decay) with their checks, and the update
of torch.optim.Adam and torch.optim.AdamW (Kingma and Ba 2015; Loshchilov and Hutter 2019).

The update, in this order: clip the mean gradient to its global norm; Adam adds the L2 weight decay
wd θ to the gradient, AdamW decays the parameters first (θ ← θ (1 − lr wd)); t ← t + 1,
m ← β1 m + (1 − β1) g, v ← β2 v + (1 − β2) g², θ ← θ − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε).
Every operation is element-wise, so every rank's parameters stay bitwise equal.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from syncsgd.nn.optim.schedule import (
    OptimConfig,
    clipped_,
)
from syncsgd.nn.optim.sgd import SGDOptions
from syncsgd.nn.optim.tensors import FlatOptimizer, Layout, Moments
from syncsgd.util.argtypes import finite_float, positive_float
from syncsgd.util.options import errors, option, option_from


def beta_pair(text: str) -> tuple[float, float]:
    """Two numbers in [0, 1), e.g. 0.9,0.999 (argparse's type of --betas)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"must be two numbers B1,B2, got {text!r}")
    pair = (finite_float(parts[0]), finite_float(parts[1]))
    if not all(0 <= beta < 1 for beta in pair):
        raise argparse.ArgumentTypeError(f"must be two numbers in [0, 1), got {text}")
    return pair


def _betas(flag: str, value: Any) -> str | None:
    numbers = isinstance(value, tuple | list) and len(value) == 2 and all(
        isinstance(beta, int | float | np.floating) and not isinstance(beta, bool)
        for beta in value)  # fmt: skip
    if numbers and all(math.isfinite(beta) and 0 <= beta < 1 for beta in value):
        return None
    return f"{flag} must be two numbers B1,B2 in [0, 1), got {value!r}"


def _positive(flag: str, value: float) -> str | None:
    return None if value > 0 else f"{flag} must be > 0, got {value}"


@dataclass(frozen=True)
class AdamOptions:
    """Adam's own options, declared once: TrainConfig takes these fields as they are."""

    betas: tuple[float, float] = option(
        (0.9, 0.999), "Adam's (adam, adamw, lamb) moment decay rates β1,β2, each in [0, 1)",
        group="optimization", type=beta_pair, check=_betas, metavar="B1,B2",
    )  # fmt: skip
    eps: float = option(1e-8, "Adam's (adam, adamw, lamb) ε, added to √v̂", group="optimization",
                        type=positive_float, check=_positive)  # fmt: skip
    weight_decay: float | None = option_from(SGDOptions, "weight_decay")

    default_weight_decay: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        """Check every option; numbers become Python floats, no --weight-decay its default."""
        for error in adam_errors(self):
            raise ValueError(error)
        decay = self.default_weight_decay if self.weight_decay is None else self.weight_decay
        object.__setattr__(self, "weight_decay", float(decay))
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "eps", float(self.eps))


@dataclass(frozen=True)
class AdamWOptions(AdamOptions):
    """AdamW's options: Adam's, with PyTorch's default weight decay 0.01."""

    default_weight_decay: ClassVar[float] = 0.01


def adam_errors(options: AdamOptions) -> Iterator[str]:
    """What is wrong with Adam's options, each naming its command-line flag."""
    yield from errors(options)


class Adam(FlatOptimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient) with global-norm clipping."""

    Options: ClassVar[type[AdamOptions]] = AdamOptions
    decoupled: ClassVar[bool] = False  # AdamW: θ ← θ (1 − lr wd) before the step

    def __init__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                 options: AdamOptions | None = None,
                 layout: Layout | None = None) -> None:  # fmt: skip
        super().__init__(config, n_params, dtype, options, layout)
        self.moments = Moments(self.n_params, self.dtype, self.options.betas, self.options.eps)
        self._denom = np.empty(self.n_params, dtype=self.dtype)

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """Update `params` in place with the global batch's mean gradient `grad` (overwritten)."""
        self.check_(params, grad)
        config, decay = self.config, self.options.weight_decay
        lr, grad_norm = clipped_(config, grad, step, self._squares, want_norm)
        if decay and self.decoupled:
            params *= 1 - lr * decay  # the factor formed in float64, rounded once to the dtype
        elif decay:
            np.multiply(params, decay, out=self._scratch)
            grad += self._scratch  # g + wd θ
        moments = self.moments
        moments.update_(grad, self._scratch)
        moments.denominator_(self._denom)
        step_size = lr / moments.bias_correction1()
        np.multiply(moments.exp_avg, -step_size, out=self._scratch)  # addcdiv: (value m) / denom
        self._scratch /= self._denom
        params += self._scratch
        return {"lr": lr, "grad_norm": grad_norm}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the state for a checkpoint: exp_avg, exp_avg_sq and step (0-d int64)."""
        return self.moments.state_arrays()

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the state saved by `state_arrays` (other keys of `arrays` are ignored)."""
        self.moments.load_state_arrays(arrays)


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay θ ← θ (1 − lr wd) before Adam's step."""

    Options: ClassVar[type[AdamOptions]] = AdamWOptions
    decoupled: ClassVar[bool] = True
