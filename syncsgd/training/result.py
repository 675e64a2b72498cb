"""What a run returns, and the one-line summary of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from syncsgd.nn.mlp import MLP


@dataclass
class TrainResult:
    """The outcome of a run on one rank (evaluation fields are filled on rank 0 only)."""

    params: np.ndarray  # final flat parameters, identical on every rank
    model: MLP
    steps: int
    losses: list[float] = field(default_factory=list)  # global-batch mean loss before each step
    seconds: float = 0.0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    update_seconds: float = 0.0
    final_loss: float | None = None  # mean loss over the whole data set after training
    accuracy: float | None = None  # xent only
    digests: list[bytes] = field(default_factory=list)  # per step, if asked for (verify)
    skipped_steps: list[int] = field(default_factory=list)  # non-finite steps (--skip-nonfinite)
    stopped_after: int | None = None  # steps done when a stop was requested (Ctrl-C, SIGTERM)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (steps, loss, accuracy)
    steps_to_target: int | None = None  # steps done at the first evaluation that met the target
    noise_scale: float | None = None  # B_simple = tr(Σ) / |G|² over the run (None at P = 1)
    noise_scales: list[float] = field(default_factory=list)  # its running estimate, per step

    def arrays(self) -> dict[str, np.ndarray]:
        """The parameters as W0, b0, W1, b1, ... (copies)."""
        return self.model.to_arrays(self.params)


class NonFiniteError(ValueError):
    """Training diverged: the loss or the gradient of a step is not finite."""



def summary(result: TrainResult, comm_size: int, backend: str) -> str:
    """One line: final loss, accuracy, steps/s and the share of time spent in the allreduce."""
    rate = result.steps / result.seconds if result.seconds > 0 else math.inf
    share = result.comm_seconds / result.seconds if result.seconds > 0 else 0.0
    accuracy = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    if result.evals:
        steps_done, held_loss, held_accuracy = result.evals[-1]
        accuracy += f", held-out loss {held_loss:.6g}" + (
            "" if math.isnan(held_accuracy) else f", held-out accuracy {held_accuracy:.4f}"
        )
    if result.noise_scale is not None:
        accuracy += f", noise scale B_simple {result.noise_scale:.3g}"
    return (
        f"trained {result.steps} steps on {comm_size} rank{'s' * (comm_size != 1)} ({backend}): "
        f"final loss {result.final_loss:.6g}{accuracy}, {rate:.1f} steps/s, "
        f"{100 * share:.1f}% of the time in the allreduce"
    )


