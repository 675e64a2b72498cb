"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2): Adam's update with decoupled weight decay, scaled per tensor by its trust
ratio. Its options are Adam's (--betas, --eps) and --weight-decay.

The update, in this order: clip the mean gradient to its global norm; t ← t + 1, Adam's moments
m, v; per tensor u = m̂ / (√v̂ + ε) + wd θ with m̂ = m / (1 − β1^t), √v̂ = √v / √(1 − β2^t);
θ ← θ − lr · (‖θ‖ / ‖u‖) · u, the ratio 1 where either norm is 0. The norms are summed in float64
in a fixed order, so every rank computes the same bits.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from syncsgd.nn.optim.adam import AdamOptions
from syncsgd.nn.optim.schedule import (
    OptimConfig,
    clipped_,
)
from syncsgd.nn.optim.tensors import LayerwiseOptimizer, Layout, Moments


@dataclass(frozen=True)
class LAMBOptions(AdamOptions):
    """LAMB's options: Adam's (--betas, --eps, --weight-decay, decoupled here, default 0)."""


class LAMB(LayerwiseOptimizer):
    """LAMB with decoupled weight decay and global-norm clipping, in place."""

    Options: ClassVar[type[LAMBOptions]] = LAMBOptions

    def __init__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                 options: LAMBOptions | None = None,
                 layout: Layout | None = None) -> None:  # fmt: skip
        super().__init__(config, n_params, dtype, options, layout)
        self.moments = Moments(self.n_params, self.dtype, self.options.betas, self.options.eps)
        self._update = np.empty(self.n_params, dtype=self.dtype)

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """Update `params` in place with the global batch's mean gradient `grad` (overwritten)."""
        self.check_(params, grad)
        lr, grad_norm = clipped_(self.config, grad, step, self._squares, want_norm)
        update = self.adam_update_(self.moments, params, grad)
        trusts = self.step_ratios(self.ratios(params, update))
        for part, trust in zip(self.slices, trusts, strict=True):
            update[part] *= lr * trust  # the factor formed in float64, rounded once
            params[part] -= update[part]
        return {"lr": lr, "grad_norm": grad_norm}

    def adam_update_(self, moments: Moments, params: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """Advance `moments` by `grad`; u = m̂ / (√v̂ + ε) + wd θ, in the optimizer's buffer."""
        decay, update = self.options.weight_decay, self._update
        moments.update_(grad, self._scratch)
        moments.denominator_(self._scratch)
        np.divide(moments.exp_avg, moments.bias_correction1(), out=update)  # m̂
        update /= self._scratch  # m̂ / (√v̂ + ε)
        if decay:
            np.multiply(params, decay, out=self._scratch)
            update += self._scratch  # + wd θ
        return update

    def ratios(self, params: np.ndarray, update: np.ndarray) -> list[float]:
        """‖θ‖ / ‖u‖ per tensor, 1 where either norm is 0."""
        param_norms, update_norms = self.norms(params), self.norms(update)
        return [theta / norm if theta > 0 and norm > 0 else 1.0
                for theta, norm in zip(param_norms, update_norms, strict=True)]  # fmt: skip

    def trust_ratios(self, params: np.ndarray, grad: np.ndarray) -> list[float]:
        """Every tensor's ratio were `grad` this step's mean gradient; the moments unchanged."""
        return self.ratios(params, self.adam_update_(copy.deepcopy(self.moments), params, grad))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the state for a checkpoint: exp_avg, exp_avg_sq and step (0-d int64)."""
        return self.moments.state_arrays()

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the state saved by `state_arrays` (other keys of `arrays` are ignored)."""
        self.moments.load_state_arrays(arrays)
