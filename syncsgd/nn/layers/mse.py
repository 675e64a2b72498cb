"""Mean squared error: per sample the mean over outputs of (z - t)^2, as torch.nn.MSELoss.

Its gradient at the outputs: 2 (z - t) / K for K outputs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Primitives


class MeanSquaredError:
    """The regression loss; it counts no hits."""

    kind = "mse"
    labels = False  # float target rows
    noun = "output"

    def forward_delta_(self, nx: Primitives, outputs: np.ndarray, targets: np.ndarray,
                       delta: np.ndarray, losses: np.ndarray) -> int:  # fmt: skip
        """Per-sample losses (float64) and delta = scale 2 (z - t) / K; returns 0."""
        width = outputs.shape[-1]
        mse_losses_(outputs.reshape(-1, width), targets.reshape(-1, width),
                    delta.reshape(-1, width), losses)  # fmt: skip
        nx.scale_(delta.reshape(-1, width))
        return 0


@njit(nogil=True, cache=True)
def mse_losses_(outputs, targets, delta, losses):
    """Per-sample mean over outputs of (z - t)^2 into `losses` (float64); delta = 2 (z - t) / K."""
    k = outputs.shape[1]
    two_over_k = outputs.dtype.type(2.0 / k)
    for i in range(outputs.shape[0]):
        sample_sum = 0.0
        for j in range(k):
            error = outputs[i, j] - targets[i, j]
            sample_sum += np.float64(error) * np.float64(error)
            delta[i, j] = two_over_k * error
        losses[i] = sample_sum / k
