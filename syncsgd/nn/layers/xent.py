"""Softmax cross-entropy with integer labels, as torch.nn.CrossEntropyLoss (summed, not averaged).

Per sample: loss = logsumexp(z) - z[label]; its gradient at the logits softmax(z) - one_hot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from syncsgd.nn import exact


class CrossEntropy:
    """The classification loss; accuracy counts the argmax hits."""

    kind = "xent"

    def forward_delta_(self, nx: Any, logits: np.ndarray, labels: np.ndarray, delta: np.ndarray,
                       losses: np.ndarray) -> int:  # fmt: skip
        """Per-sample losses (float64) and delta = scale (softmax - one_hot); the argmax hits."""
        width = logits.shape[-1]
        flat_labels = labels.reshape(-1)
        correct = exact.xent_sample_losses_(logits.reshape(-1, width), flat_labels,
                                            delta.reshape(-1, width), losses)  # fmt: skip
        nx.scale_(delta.reshape(-1, width))
        return int(correct)
