"""LARS (You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional Networks",
Algorithm 1): a local learning rate per tensor, then heavy-ball momentum. Its options are
--momentum, --weight-decay and --trust-coefficient.

The update, in this order: clip the mean gradient to its global norm; per tensor the local rate
λ = η ‖θ‖ / (‖g‖ + wd ‖θ‖) (η the trust coefficient; λ = 1 where either norm is 0),
v ← μ v + lr λ (g + wd θ), θ ← θ − v (without momentum θ ← θ − lr λ (g + wd θ)). The norms are
summed in float64 in a fixed order, so every rank computes the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from syncsgd.nn.optim.schedule import (
    OptimConfig,
    clipped_,
)
from syncsgd.nn.optim.sgd import SGDOptions
from syncsgd.nn.optim.tensors import LayerwiseOptimizer, Layout, load_array
from syncsgd.util.argtypes import positive_float
from syncsgd.util.options import errors, option, option_from


def _positive(flag: str, value: float) -> str | None:
    return None if value > 0 else f"{flag} must be > 0, got {value}"


@dataclass(frozen=True)
class LARSOptions:
    """LARS's options: SGD's --momentum and --weight-decay, and its own --trust-coefficient."""

    momentum: float = option_from(SGDOptions, "momentum")
    weight_decay: float | None = option_from(SGDOptions, "weight_decay")
    trust_coefficient: float = option(
        0.001, "LARS's trust coefficient η: local lr = η ‖θ‖ / (‖g‖ + wd ‖θ‖) per tensor",
        group="optimization", type=positive_float, check=_positive, metavar="ETA",
    )  # fmt: skip

    def __post_init__(self) -> None:
        """Check every option; numbers become Python floats, no --weight-decay 0."""
        for error in lars_errors(self):
            raise ValueError(error)
        decay = 0.0 if self.weight_decay is None else self.weight_decay
        object.__setattr__(self, "weight_decay", float(decay))
        object.__setattr__(self, "momentum", float(self.momentum))
        object.__setattr__(self, "trust_coefficient", float(self.trust_coefficient))


def lars_errors(options: LARSOptions) -> Iterator[str]:
    """What is wrong with LARS's options, each naming its command-line flag."""
    yield from errors(options)


class LARS(LayerwiseOptimizer):
    """LARS with heavy-ball momentum, weight decay and global-norm clipping, in place."""

    Options: ClassVar[type[LARSOptions]] = LARSOptions

    def __init__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                 options: LARSOptions | None = None,
                 layout: Layout | None = None) -> None:  # fmt: skip
        super().__init__(config, n_params, dtype, options, layout)
        momentum = self.options.momentum
        self.velocity = np.zeros(self.n_params, dtype=self.dtype) if momentum > 0.0 else None

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """Update `params` in place with the global batch's mean gradient `grad` (overwritten)."""
        self.check_(params, grad)
        config, options = self.config, self.options
        decay = options.weight_decay or 0.0  # a float by now
        lr, grad_norm = clipped_(config, grad, step, self._squares, want_norm)
        trusts = self.step_ratios(self.trust_ratios(params, grad))
        if decay:
            np.multiply(params, decay, out=self._scratch)
            grad += self._scratch  # g + wd θ
        for part, local in zip(self.slices, trusts, strict=True):
            scaled = self._scratch[part]
            np.multiply(grad[part], lr * local, out=scaled)  # lr λ rounded once to the dtype
            if self.velocity is not None:
                velocity = self.velocity[part]
                velocity *= options.momentum
                velocity += scaled  # v = μ v + lr λ (g + wd θ)
                scaled = velocity
            params[part] -= scaled
        return {"lr": lr, "grad_norm": grad_norm}

    def trust_ratios(self, params: np.ndarray, grad: np.ndarray) -> list[float]:
        """λ = η ‖θ‖ / (‖g‖ + wd ‖θ‖) per tensor for the mean gradient `grad` (before decay)."""
        decay, eta = self.options.weight_decay or 0.0, self.options.trust_coefficient
        param_norms, grad_norms = self.norms(params), self.norms(grad)
        return [eta * theta / (norm + decay * theta) if theta > 0 and norm > 0 else 1.0
                for theta, norm in zip(param_norms, grad_norms, strict=True)]  # fmt: skip

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the state for a checkpoint: {"velocity": ...} with momentum, else {}."""
        return {} if self.velocity is None else {"velocity": self.velocity.copy()}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the state saved by `state_arrays` (other keys of `arrays` are ignored)."""
        if self.velocity is not None:
            load_array(arrays, "velocity", self.velocity)
