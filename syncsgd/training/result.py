"""What a run returns, and the one-line summary of it."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from syncsgd.nn.losses import loss_entry
from syncsgd.nn.network import Network

if TYPE_CHECKING:
    from syncsgd.training.config import TrainConfig


@dataclass
class TrainResult:
    """The outcome of a run on one rank (evaluation fields are filled on rank 0 only)."""

    params: np.ndarray  # final flat parameters, identical on every rank
    model: Network
    steps: int  # steps done when training ended: fewer than asked for if a target was met
    losses: list[float] = field(default_factory=list)  # global-batch mean loss before each step
    seconds: float = 0.0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    update_seconds: float = 0.0
    # The first step of a process loads or compiles the kernels (0.5-0.8 s against ~2 ms for the
    # later ones), so the figures a user reads are those of the steady state: every step after it.
    first_step_seconds: float | None = None
    steady_steps: int = 0
    steady_seconds: float = 0.0  # from the start of the second step to the end of the last
    steady_compute_seconds: float = 0.0
    steady_comm_seconds: float = 0.0
    steady_update_seconds: float = 0.0
    final_loss: float | None = None  # mean loss over the whole data set after training
    accuracy: float | None = None  # xent only
    digests: list[bytes] = field(default_factory=list)  # per step, if asked for (verify)
    skipped_steps: list[int] = field(default_factory=list)  # non-finite steps (--skip-nonfinite)
    stopped_after: int | None = None  # steps done when a stop was requested (Ctrl-C, SIGTERM)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (steps, loss, accuracy)
    steps_to_target: int | None = None  # steps done at the first evaluation that met the target
    noise_scale: float | None = None  # B_simple = tr(Σ) / |G|² over the run (None at P = 1)
    noise_scales: list[float] = field(default_factory=list)  # its running estimate, per step
    loss_scales: list[float] = field(default_factory=list)  # per step, with loss scaling only
    running: np.ndarray | None = None  # BatchNorm's running statistics (rank 0's), if any
    batchnorm_comm_seconds: float = 0.0  # in BatchNorm's allreduces (within compute_seconds)
    steady_batchnorm_comm_seconds: float = 0.0
    # what rank 0 sends per step in the gradient's exchange, as the executor's messages carry it
    # (None: the library's own allreduce); BatchNorm's allreduces and exact mode's peaks aside
    bytes_sent_per_step: int | None = None
    # what rank 0 holds, by category: the bytes of the arrays each holds (allocated once, so
    # their peak over a step): parameters, gradients (the sums and the mean), optimizer state
    memory_bytes: dict[str, int] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        """The parameters as W0, b0, W1, b1, ... and BatchNorm's running statistics (copies)."""
        arrays = self.model.to_arrays(self.params)
        if self.running is not None:
            arrays.update({k: v.copy() for k, v in self.model.running_views(self.running).items()})
        return arrays


class NonFiniteError(ValueError):
    """Training diverged: the loss or the gradient of a step is not finite."""


def summary(result: TrainResult, comm_size: int, backend: str, saved: str | None = None) -> str:
    """One line: final loss, accuracy, and the steady state's steps/s and allreduce share."""
    extras = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    if result.evals:
        steps_done, held_loss, held_accuracy = result.evals[-1]
        extras += f", held-out loss {held_loss:.6g}" + (
            "" if math.isnan(held_accuracy) else f", held-out accuracy {held_accuracy:.4f}"
        )
    if result.noise_scale is not None:
        extras += f", noise scale B_simple {result.noise_scale:.3g}"
    if result.loss_scales:
        skipped = len(result.skipped_steps)
        extras += f", {skipped} step{'s' * (skipped != 1)} skipped by the loss scaler"
    steps, ranks = result.steps, comm_size
    if steps == 0:  # nothing trained: the loss is the initial parameters'
        where = f"; wrote the initial parameters to {saved}" if saved else ""
        return (f"trained 0 steps on {ranks} rank{'s' * (ranks != 1)} ({backend}): loss of the "
                f"initial parameters {result.final_loss:.6g}{extras}{where}")  # fmt: skip
    return (
        f"trained {steps} step{'s' * (steps != 1)} on {ranks} rank{'s' * (ranks != 1)} "
        f"({backend}): final loss {result.final_loss:.6g}{extras}; {timing(result)}"
    )


def timing(result: TrainResult) -> str:
    """Steps/s and the allreduce's share after the first step, and what the first step took."""
    taken = len(result.losses)  # in this process: a resumed run started further on
    if taken == 0:  # resumed at its last step
        return "no step taken in this run"
    if result.steady_steps == 0 or result.steady_seconds <= 0:  # one step: no steady state
        rate = taken / result.seconds if result.seconds > 0 else math.inf
        share = result.comm_seconds / result.seconds if result.seconds > 0 else 0.0
        return (f"{rate:.1f} steps/s, {100 * share:.1f}% of the time in the allreduce "
                f"(one step: start-up included)")  # fmt: skip
    rate = result.steady_steps / result.steady_seconds
    share = result.steady_comm_seconds / result.steady_seconds
    first = result.first_step_seconds or 0.0
    return (
        f"after the first step: {rate:.1f} steps/s, {100 * share:.1f}% of the time in the "
        f"allreduce (the first step, start-up included, took {_duration(first)})"
    )


def sha256(params: np.ndarray) -> str:
    """SHA-256 of the parameters' bytes (hex)."""
    return hashlib.sha256(np.ascontiguousarray(params).tobytes()).hexdigest()


SCALARS = {"int", "float", "bool", "None"}  # the annotations of a result's scalar fields


def document(result: TrainResult, comm_size: int, backend: str,
             config: TrainConfig) -> dict[str, Any]:  # fmt: skip
    """The run as JSON: every scalar field of the result, the losses, evaluations, the digest."""
    scalars = {item.name: getattr(result, item.name) for item in fields(result)
               if {part.strip() for part in str(item.type).split("|")} <= SCALARS}  # fmt: skip
    held = [{"step": step, "loss": held_loss, "accuracy": held_accuracy}
            for step, held_loss, held_accuracy in result.evals]  # fmt: skip
    out: dict[str, Any] = {"ranks": comm_size, "backend": backend, **scalars,
                           "losses": result.losses, "evals": held,
                           "skipped_steps": result.skipped_steps,
                           "params_sha256": sha256(result.params)}  # fmt: skip
    for kept in ("loss_scales", "noise_scales", "memory_bytes"):  # where kept
        if getattr(result, kept):
            out[kept] = getattr(result, kept)
    out["null_because"] = null_reasons(out, config)
    return out


def null_reasons(out: dict[str, Any], config: TrainConfig) -> dict[str, str]:
    """Why fields of the document `out` are null, where the reason is not plain."""
    targets = config.target_loss is not None or config.target_accuracy is not None
    no_accuracy = f"no accuracy with --loss {config.loss}"
    reasons = {
        "accuracy": no_accuracy,
        "first_step_seconds": "no step taken",
        "steps_to_target": "target not met" if targets else "no --target-loss/--target-accuracy",
        "noise_scale": "needs 2 or more ranks" if config.noise_scale else "no --noise-scale",
    }
    nulls = {name: why for name, why in reasons.items() if out.get(name) is None}
    if not loss_entry(config.loss).labels and out["evals"]:
        nulls["evals.accuracy"] = no_accuracy
    for name, value in out.items():  # written as null by the strict JSON
        if isinstance(value, float) and not math.isfinite(value):
            nulls[name] = "not finite"
    return nulls


def _duration(seconds: float) -> str:
    """'0.73 s' or '2.1 ms'."""
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"
