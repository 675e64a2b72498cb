"""The configuration of a training run: every option, its default and its check."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

from syncsgd.collectives import ALGORITHMS
from syncsgd.training.pitfalls import PITFALLS

DATA_SOURCES = (
    "synthetic-classification",
    "synthetic-regression",
    "synthetic-classification-mlp",
    "synthetic-regression-mlp",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (the options of `syncsgd train`)."""

    data: str = "synthetic-classification"
    samples: int = 4096
    features: int = 32
    classes: int | None = None  # classes (xent) or regression outputs (mse); None: from the data
    hidden: tuple[int, ...] = (64, 64)
    activation: str = "relu"
    loss: str = "xent"
    batch_size: int = 256
    steps: int | None = None  # None: `epochs` epochs, or 100 steps if neither is given
    epochs: int | None = None
    lr: float = 0.1
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_norm: float | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    lr_scaling: str = "none"
    base_batch: int = 256
    seed: int = 0
    shuffle: bool = True
    dtype: str = "float64"
    init: str | None = None  # .npz with W0, b0, ... to start from instead of the seeded draw
    bucket_bytes: int | None = None  # None: one fused allreduce; 0: one per layer; else buckets
    algorithm: str = "ring"  # the allreduce: one of ALGORITHMS
    exact: bool = False  # bitwise the same result for every number of ranks (SPEC §6)
    pitfall: str | None = None  # one of PITFALLS: do deliberately what real systems get wrong
    checkpoint: str | None = None  # directory to write checkpoints to
    checkpoint_every: int | None = None  # steps between checkpoints (default: only at the end)
    resume: str | None = None  # directory to resume from (its latest checkpoint)
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is not finite, not stop
    holdout: float = 0.0  # fraction of the samples held out for evaluation
    eval_every: int = 0  # evaluate on the held-out samples every k steps and at the end; 0: never
    target_loss: float | None = None  # stop once the held-out loss is at most this
    target_accuracy: float | None = None  # stop once the held-out accuracy is at least this
    noise_scale: bool = False  # estimate the gradient noise scale B_simple (McCandlish et al.)

    def __post_init__(self) -> None:
        for name in ("samples", "features", "batch_size", "base_batch"):
            _require(
                getattr(self, name) >= 1, f"--{_flag(name)} must be >= 1, got {getattr(self, name)}"
            )
        for name in ("steps", "epochs", "classes"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"--{_flag(name)} must be >= 1, got {value}")
        _require(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        _require(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        _require(self.dtype in ("float64", "float32"), f"unknown --dtype {self.dtype!r}")
        _require(self.activation in ("relu", "tanh"), f"unknown --activation {self.activation!r}")
        _require(self.loss in ("xent", "mse"), f"unknown --loss {self.loss!r}")
        _require(all(h >= 1 for h in self.hidden), f"--hidden sizes must be >= 1: {self.hidden}")
        _require(
            self.bucket_bytes is None or self.bucket_bytes >= 0,
            f"--bucket-bytes must be >= 0, got {self.bucket_bytes}",
        )
        _require(
            self.algorithm in ALGORITHMS,
            f"unknown --algorithm {self.algorithm!r}: choose one of "
            f"{', '.join(ALGORITHMS)}",
        )
        _require(
            self.pitfall is None or self.pitfall in PITFALLS,
            f"unknown --pitfall {self.pitfall!r}: choose one of {', '.join(PITFALLS)}",
        )
        _require(
            self.pitfall != "local-clip" or self.clip_norm is not None,
            "--pitfall local-clip needs --clip-norm",
        )
        _require(
            self.checkpoint_every is None or self.checkpoint_every >= 1,
            f"--checkpoint-every must be >= 1, got {self.checkpoint_every}",
        )
        _require(
            self.checkpoint_every is None or self.checkpoint is not None,
            "--checkpoint-every needs --checkpoint DIR",
        )
        _require(0 <= self.holdout < 1, f"--holdout must be in [0, 1), got {self.holdout}")
        _require(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        wants_eval = self.eval_every > 0 or self.target_loss is not None
        _require(
            not (wants_eval or self.target_accuracy is not None) or self.holdout > 0,
            "--eval-every and --target-loss/--target-accuracy need --holdout (e.g. 0.2)",
        )
        _require(
            self.target_accuracy is None or self.loss == "xent",
            "--target-accuracy needs --loss xent",
        )
        source = self.data
        _require(
            source in DATA_SOURCES or source.endswith((".npz", ".csv")),
            f"unknown --data {source!r}: use one of {', '.join(DATA_SOURCES)} or a .npz/.csv path",
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def fingerprint(config: TrainConfig, X: np.ndarray, y: np.ndarray, steps: int) -> str:
    """A digest of the data and of every option that changes the trajectory.

    Left out: the number of ranks (the result does not depend on it), the run length (a resumed run
    may go further; only the cosine schedule depends on it, so it is kept then), where the first
    parameters came from, outputs, and how the allreduce is done (algorithm, buckets).
    """
    ignored = {"steps", "epochs", "init", "checkpoint", "checkpoint_every", "resume",
               "bucket_bytes", "algorithm", "skip_nonfinite", "eval_every", "target_loss",
               "target_accuracy", "noise_scale"}  # fmt: skip
    options = {k: v for k, v in asdict(config).items() if k not in ignored}
    if config.schedule == "cosine":
        options["total_steps"] = steps
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for array in (X, y):
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


