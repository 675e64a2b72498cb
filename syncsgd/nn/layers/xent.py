"""Softmax cross-entropy with integer labels, as torch.nn.CrossEntropyLoss (summed, not averaged).

Per sample: loss = logsumexp(z) - z[label]; its gradient at the logits softmax(z) - one_hot.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Primitives


class CrossEntropy:
    """The classification loss; accuracy counts the argmax hits."""

    kind = "xent"
    labels = True  # integer class labels; accuracy counts the argmax hits
    noun = "class"

    def forward_delta_(self, nx: Primitives, logits: np.ndarray, labels: np.ndarray,
                       delta: np.ndarray,
                       losses: np.ndarray) -> int:  # fmt: skip
        """Per-sample losses (float64) and delta = scale (softmax - one_hot); the argmax hits."""
        width = logits.shape[-1]
        correct = xent_losses_(logits.reshape(-1, width), labels.reshape(-1),
                               delta.reshape(-1, width), losses)  # fmt: skip
        nx.scale_(delta.reshape(-1, width))
        return int(correct)


@njit(nogil=True, cache=True)
def xent_losses_(logits, labels, delta, losses):
    """Per-sample softmax cross-entropy into `losses` (float64); delta = softmax - one_hot; hits."""
    correct = 0
    k = logits.shape[1]
    for i in range(logits.shape[0]):
        # Stable log-sum-exp: shift by the row maximum (the first one is the argmax, as np.argmax).
        best = 0
        for j in range(1, k):
            if logits[i, j] > logits[i, best]:
                best = j
        shift = logits[i, best]
        total = logits.dtype.type(0)
        for j in range(k):
            delta[i, j] = np.exp(logits[i, j] - shift)
            total += delta[i, j]
        scale = logits.dtype.type(1) / total
        for j in range(k):
            delta[i, j] *= scale
        label = labels[i]
        delta[i, label] -= 1
        losses[i] = np.float64(shift) + np.log(np.float64(total)) - np.float64(logits[i, label])
        correct += best == label
    return correct
