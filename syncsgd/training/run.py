"""A prepared run: the data, the model and the optimizer settings a configuration describes."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from syncsgd.comm.world import constants
from syncsgd.nn.mlp import MLP
from syncsgd.nn.optim import OptimConfig
from syncsgd.training import checkpoint, data
from syncsgd.training.checkpoint import Checkpoint
from syncsgd.training.config import TrainConfig, _require, fingerprint
from syncsgd.training.variants import variant


@dataclass
class Run:
    """What every rank needs before the first step: the model, the data and the step count."""

    config: TrainConfig
    model: MLP
    X: np.ndarray
    y: np.ndarray
    steps: int
    optim: OptimConfig
    fingerprint: str  # SHA-256 of everything that determines the trajectory (not P, not steps)
    start: Checkpoint | None = None  # the state to resume from
    init: np.ndarray | None = None  # parameters from --init
    X_eval: np.ndarray | None = None  # the held-out samples (--holdout)
    y_eval: np.ndarray | None = None


def prepare(config: TrainConfig) -> Run:
    """Load the data and build the model and optimizer settings that `config` describes."""
    X, y = data.load_data(
        config.data, samples=config.samples, features=config.features, classes=config.classes,
        loss=config.loss, seed=config.seed, dtype=config.dtype,
    )  # fmt: skip
    X, y, X_eval, y_eval = split_holdout(X, y, config.holdout, config.seed)
    n_samples = X.shape[0]
    per_epoch = data.steps_per_epoch(n_samples, config.batch_size)
    if config.steps is not None:
        steps = config.steps
    elif config.epochs is not None:
        steps = config.epochs * per_epoch
    else:
        steps = 100
    outputs = data.n_outputs(y, config.loss)  # xent: max label + 1, which --classes may raise
    if config.loss == "xent" and config.classes is not None:
        outputs = max(outputs, config.classes)
    sizes = (X.shape[1], *config.hidden, outputs)
    model = MLP(sizes, activation=config.activation, loss=config.loss, dtype=np.dtype(config.dtype))
    optim = OptimConfig(
        lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
        weight_decay=config.weight_decay, schedule=config.schedule,
        warmup_steps=config.warmup_steps, total_steps=steps, lr_scaling=config.lr_scaling,
        base_batch=config.base_batch, batch_size=config.batch_size,
        noam_dim=max(config.hidden, default=sizes[0]),
        clip_norm=variant(config.pitfall, config.clip_norm).global_clip_norm(),
    )  # fmt: skip
    run = Run(config, model, X, y, steps, optim, fingerprint(config, X, y, steps),
                      X_eval=X_eval, y_eval=y_eval)  # fmt: skip
    if config.init is not None:
        run.init = model.from_arrays(load_npz(config.init))
    if config.checkpoint is not None:
        os.makedirs(config.checkpoint, exist_ok=True)  # fail now rather than after the first steps
    if config.resume is not None:
        path = checkpoint.latest(config.resume)
        run.start = checkpoint.load(path, run.fingerprint, model.n_params, model.dtype)
        _require(
            run.start.step <= steps,
            f"{path} is at step {run.start.step}, beyond --steps {steps}",
        )
    return run


def split_holdout(X: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    """(X, y, X_eval, y_eval): the last round(N * fraction) samples of a seeded permutation are
    held out (in their original order); with fraction 0, nothing is."""
    held = round(len(X) * fraction)
    if held == 0:
        _require(fraction == 0, f"--holdout {fraction} holds out no sample of {len(X)}")
        return X, y, None, None
    _require(held < len(X), f"--holdout {fraction} leaves no sample to train on")
    order = np.random.default_rng([seed, 2**31]).permutation(len(X))
    train_rows, eval_rows = np.sort(order[: len(X) - held]), np.sort(order[len(X) - held :])
    return X[train_rows], y[train_rows], X[eval_rows], y[eval_rows]


def check_agreement(comm: Any, run: Run) -> None:
    """Stop every rank with one message if the ranks were started with different options or data.

    Beside the fingerprint, the ranks must agree on how they communicate - the algorithm and the
    buckets - which the fingerprint leaves out (a checkpoint may be resumed with others): each
    step's allreduce trusts that every rank passes the same buffers (check=False).
    """
    config = run.config
    agreed = f"{run.fingerprint} {config.algorithm} {config.bucket_bytes}"
    mine = np.frombuffer(hashlib.sha256(agreed.encode()).digest(), np.uint8).copy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    differs = np.array([0 if np.array_equal(mine, root) else 1], np.int64)
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, differs, op=mpi.MAX)
    if differs[0]:
        raise ValueError(
            "the ranks were started with different options or data (their configuration "
            "fingerprints differ from rank 0's); start every rank with the same command and files"
        )


def first_params(run: Run) -> np.ndarray:
    """Where training starts: the checkpoint resumed, the --init file, or the seeded draw."""
    if run.start is not None:
        return run.start.params
    if run.init is not None:
        return run.init
    return run.model.init_params(run.config.seed)


def load_npz(path: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz file, loaded without pickle; ValueError for a missing or bad file."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read {path} as .npz: {exc}") from None


