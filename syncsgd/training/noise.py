"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A).

Data parallelism measures two batch sizes at once for free: each rank's shard gradient (a small
batch of b_r samples) and the allreduced gradient (the global batch of B). For a batch of b,
E|G_b|² = |G|² + tr(Σ)/b, so the sum S = Σ_r |G_r|² over the K ranks with samples and |G_B|² give
two equations in |G|² and tr(Σ), with H = Σ_r 1/b_r:

    tr(Σ) = (S − K |G_B|²) / (H − K/B),        |G|² = |G_B|² − tr(Σ)/B

Both estimates are unbiased but noisy, so B_simple is the ratio of their running means, not the
mean of per-step ratios. With one rank (or one rank holding every sample) H = K/B: no estimate.
"""

from __future__ import annotations

import math

import numpy as np

from syncsgd.nn.optim import global_norm


def estimate(small_norms_sq: float, ranks_with_samples: int, inverse_sizes: float,
             big_norm_sq: float, big_size: int) -> tuple[float, float] | None:  # fmt: skip
    """Unbiased estimates (tr Σ, |G|²) from one step, or None if the step has one batch size."""
    small_norms_sq, ranks_with_samples = float(small_norms_sq), int(ranks_with_samples)
    inverse_sizes, big_norm_sq = float(inverse_sizes), float(big_norm_sq)
    spread = inverse_sizes - ranks_with_samples / big_size
    if ranks_with_samples < 1 or spread <= 1e-12 * inverse_sizes:
        return None
    trace_sigma = (small_norms_sq - ranks_with_samples * big_norm_sq) / spread
    return trace_sigma, big_norm_sq - trace_sigma / big_size


class RunningNoiseScale:
    """B_simple from the running means of the per-step estimates of tr(Σ) and |G|²."""

    def __init__(self) -> None:
        self.trace_sum = 0.0
        self.norm_sum = 0.0
        self.steps = 0

    def add(self, estimates: tuple[float, float] | None) -> float:
        """Add one step's estimates; return the current B_simple (nan while undefined)."""
        if estimates is not None and all(map(math.isfinite, estimates)):
            self.trace_sum += estimates[0]
            self.norm_sum += estimates[1]
            self.steps += 1
        return self.value if self.value is not None else math.nan

    @property
    def value(self) -> float | None:
        """The current estimate, or None before any usable step (or if |G|² is not positive)."""
        if self.steps == 0 or self.norm_sum <= 0:
            return None
        return self.trace_sum / self.norm_sum


class NoiseScaleMeter:
    """The training loop's side of the estimate: fill the per-rank slots, read the reduced ones."""

    def __init__(self, n_params: int) -> None:
        self.running = RunningNoiseScale()
        self.squares = np.empty(n_params, np.float64)  # scratch of global_norm, allocated once

    def local_(self, slots: np.ndarray, grad_sum: np.ndarray, shard_size: int) -> None:
        """Before the allreduce: this rank's |G_r|^2 (of its mean gradient), 1, and 1/b_r."""
        if shard_size == 0:
            slots[:] = 0
            return
        mean_norm = global_norm(grad_sum, self.squares) / shard_size
        slots[:] = (mean_norm**2, 1, 1 / shard_size)

    def add(self, slots: np.ndarray, grad: np.ndarray, batch_size: int, finite: bool,
            whole_norm: float | None = None) -> float:  # fmt: skip
        """After it: the step's estimates from the summed slots and |G_B| (`whole_norm`, when no
        rank holds the whole mean gradient `grad`); the running B_simple."""
        if not finite:
            return self.running.add(None)
        big_norm_sq = (global_norm(grad, self.squares) if whole_norm is None else whole_norm) ** 2
        small_norms_sq, ranks_with_samples, inverse_sizes = slots
        return self.running.add(
            estimate(small_norms_sq, ranks_with_samples, inverse_sizes, big_norm_sq, batch_size)
        )
