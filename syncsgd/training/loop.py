"""Synchronous data-parallel SGD: the training loop every rank runs, read top to bottom.

    syncsgd train --ranks 4                       # 4 thread ranks in this process
    mpiexec -n 4 syncsgd train                    # 4 MPI processes
    python -c "import syncsgd; print(syncsgd.train(ranks=4, steps=50).final_loss)"

One step on every rank: global batch (same on every rank) -> this rank's shard -> the SUM of the
shard's per-sample gradients (Numba kernels) -> ring allreduce of the sums -> divide once by the
global batch size -> the same update on every rank. Because the allreduce leaves every rank with
bitwise the same sum, every rank's parameters stay bitwise identical, step after step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import numpy as np

from syncsgd.collectives import allreduce as collective_allreduce
from syncsgd.comm.threads import ThreadComm
from syncsgd.comm.world import constants, launch
from syncsgd.nn.mlp import MLP, shape_size
from syncsgd.nn.optim import SGD, OptimConfig, learning_rate
from syncsgd.training import checkpoint, data, noise, pitfalls
from syncsgd.training.checkpoint import Checkpoint
from syncsgd.training.config import TrainConfig, _require, fingerprint
from syncsgd.training.timeline import Timeline
from syncsgd.training.timeline import write as write_timeline
from syncsgd.util.files import atomic_path


@dataclass
class Problem:
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


def prepare(config: TrainConfig) -> Problem:
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
        clip_norm=None if config.pitfall == "local-clip" else config.clip_norm,  # clipped per rank
    )  # fmt: skip
    problem = Problem(config, model, X, y, steps, optim, fingerprint(config, X, y, steps),
                      X_eval=X_eval, y_eval=y_eval)  # fmt: skip
    if config.init is not None:
        problem.init = model.from_arrays(load_npz(config.init))
    if config.checkpoint is not None:
        os.makedirs(config.checkpoint, exist_ok=True)  # fail now rather than after the first steps
    if config.resume is not None:
        path = checkpoint.latest(config.resume)
        problem.start = checkpoint.load(path, problem.fingerprint, model.n_params, model.dtype)
        _require(
            problem.start.step <= steps,
            f"{path} is at step {problem.start.step}, beyond --steps {steps}",
        )
    return problem


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


def bucket_slices(model: MLP, buffer: np.ndarray, bucket_bytes: int | None) -> list[slice]:
    """Cut the communication buffer into allreduce buckets of whole tensors, in parameter order.

    None: one bucket (full fusion). 0: one bucket per layer (W and b together). Otherwise
    consecutive tensors are grouped until a bucket holds at least `bucket_bytes` of `buffer`
    (float64 in exact mode, whatever the model's dtype). The trailing statistics slots ride with
    the last bucket.
    """
    total = buffer.size
    if bucket_bytes is None:
        return [slice(0, total)]
    ends, start = [], 0
    for name, shape, offset in model.layout():
        filled = offset + shape_size(shape)
        per_layer_done = bucket_bytes == 0 and name.startswith("b")
        if per_layer_done or (
            bucket_bytes > 0 and (filled - start) * buffer.itemsize >= bucket_bytes
        ):
            ends.append(filled)
            start = filled
    if not ends or ends[-1] != model.n_params:
        ends.append(model.n_params)
    ends[-1] = total
    return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def train_rank(
    comm: Any,
    problem: Problem,
    *,
    log_path: str | None = None,
    timeline_path: str | None = None,
    save_path: str | None = None,
    quiet: bool = True,
    record_digests: bool = False,
) -> TrainResult:
    """Run the whole training on this rank of `comm`; rank 0 logs, saves and prints a summary."""
    from syncsgd.nn.kernels import (  # imports Numba: only when training
        divide_finite_,
        evaluate,
        limit_blas_threads,
    )

    config, model, X, y = problem.config, problem.model, problem.X, problem.y
    rank, size = comm.Get_rank(), comm.Get_size()
    # One BLAS thread per rank, as torchrun does: ranks share the cores, and a BLAS that starts
    # threads in every rank oversubscribes them (tenfold slower at P = 2 here); its threads also
    # spin on a busy machine even at P = 1. OPENBLAS_NUM_THREADS, if set, wins. Takes effect
    # before the process's first kernel call only.
    limit_blas_threads(1)
    master_process = rank == 0
    n_samples, n_params = X.shape[0], model.n_params
    check_agreement(comm, problem)

    # Parameters: chosen on rank 0 and broadcast, so every rank starts from the same bits.
    params = np.empty(n_params, model.dtype)
    if master_process:
        params[:] = first_params(problem)
    comm.Bcast(params, root=0)
    sgd = SGD(problem.optim, n_params, model.dtype)
    first_step = 0
    if problem.start is not None:
        sgd.load_state_arrays(problem.start.optimizer)
        first_step = problem.start.step

    # One communication buffer: the gradient sum, then the STATS (loss sum, correct predictions,
    # ranks asked to stop - so that all stop after the same step - and the noise-scale sums);
    # one allreduce (or one per bucket). Exact mode carries its exact float64 representation,
    # whatever the model's dtype.
    largest_shard = -(-config.batch_size // size)
    local_gradient = (ExactLocalGradient if config.exact else FloatLocalGradient)(
        model, largest_shard, config.batch_size
    )
    comm_buffer = np.zeros(n_params + len(STATS), local_gradient.buffer_dtype)
    grad_sum, stats = comm_buffer[:n_params], comm_buffer[n_params:]
    # The mean gradient of the global batch: divided in place, unless exact mode's float64 sums
    # must be rounded to a float32 model.
    grad = grad_sum if grad_sum.dtype == model.dtype else np.empty(n_params, model.dtype)
    buckets = bucket_slices(model, comm_buffer, config.bucket_bytes)
    timeline = Timeline(comm) if timeline_path is not None else None
    # check=False: no agreement round before "mpi" and "auto" - every rank built the same buffer
    # from options and data that the start-up fingerprint showed to be the same on every rank.
    allreduce: Callable[..., np.ndarray] = functools.partial(
        collective_allreduce, algorithm=config.algorithm, check=False,
        trace=timeline.collective_step if timeline is not None else None,
    )  # fmt: skip
    if config.pitfall == "fp32-allreduce":
        allreduce = pitfalls.allreduce_in_float32(allreduce)
    X_shard = np.empty((largest_shard, X.shape[1]), X.dtype)
    y_shard = np.empty((largest_shard, *y.shape[1:]), y.dtype)
    order_seed = pitfalls.order_seed(config.pitfall, config.seed, rank)
    noise_meter = noise.NoiseScaleMeter(n_params) if config.noise_scale else None

    result = TrainResult(params, model, problem.steps)
    progress = _progress(problem.steps - first_step, enabled=master_process and not quiet)
    with _log_file(log_path if master_process else None) as log:
        started = time.perf_counter()
        for step in range(first_step, problem.steps):
            t0 = time.perf_counter()
            global_batch = data.global_batch(
                step, n_samples, config.batch_size, order_seed, config.shuffle
            )
            if config.pitfall == "pad-duplicate":
                global_batch = pitfalls.pad_duplicate(global_batch, size)
            shard = data.shard(global_batch, rank, size)
            m = shard.size
            np.take(X, shard, axis=0, out=X_shard[:m])
            np.take(y, shard, axis=0, out=y_shard[:m])
            local_gradient(comm, params, X_shard[:m], y_shard[:m], comm_buffer)
            if config.pitfall is not None:
                pitfalls.contribution_(config.pitfall, grad_sum, m, len(global_batch), size,
                                       config.clip_norm)  # fmt: skip
            stats[STOP] = 1 if stop_requested.is_set() else 0
            if noise_meter is not None:  # the small-batch side: this rank's shard
                noise_meter.local_(stats[NOISE_SLOTS], grad_sum, m)
            t1 = time.perf_counter()
            for bucket in buckets:
                allreduce(comm_buffer[bucket], comm)
            t2 = time.perf_counter()
            # The one place where the sum over the global batch becomes its mean: divide once by B,
            # after the allreduce (averaging per-rank means would weigh uneven shards wrongly).
            batch_size = len(global_batch)
            loss = float(stats[LOSS]) / batch_size
            divisor = grad_sum.dtype.type(batch_size)  # B in the sums' dtype, as NumPy would
            gradient_finite = divide_finite_(grad_sum, divisor, grad)
            # Every rank holds the same allreduced numbers, so every rank decides alike.
            finite = math.isfinite(loss) and gradient_finite
            if noise_meter is not None:  # the large-batch side: the allreduced gradient
                result.noise_scales.append(
                    noise_meter.add(stats[NOISE_SLOTS], grad, batch_size, finite)
                )
            if finite:
                info = sgd.step_(params, grad, step, want_norm=log is not None)
            elif config.skip_nonfinite:
                info = {"lr": learning_rate(problem.optim, step), "grad_norm": math.nan}
                result.skipped_steps.append(step)
            else:
                raise NonFiniteError(
                    f"non-finite loss or gradient at step {step} (loss {loss}); lower --lr, "
                    f"set --clip-norm, or pass --skip-nonfinite to skip such steps"
                )
            t3 = time.perf_counter()

            result.losses.append(loss)
            result.compute_seconds += t1 - t0
            result.comm_seconds += t2 - t1
            result.update_seconds += t3 - t2
            if timeline is not None:
                timeline.span("compute", "compute", t0, t1, step=step, samples=m)
                timeline.span("update", "update", t2, t3, step=step)
            if record_digests:
                result.digests.append(hashlib.blake2b(params.tobytes(), digest_size=16).digest())
            if log is not None:
                record = {
                    "step": step, "epoch": step // (n_samples // config.batch_size),
                    "loss": loss, "lr": info["lr"], "grad_norm": info["grad_norm"],
                    "seconds": t3 - t0, "comm_seconds": t2 - t1,
                }  # fmt: skip
                if config.noise_scale:
                    record["noise_scale"] = result.noise_scales[-1]
                log.write(json.dumps(record) + "\n")
            if progress is not None:
                progress(step - first_step, loss)
            stopping = stats[STOP] > 0
            if master_process and (checkpoint_due(config, step + 1, problem.steps) or stopping):
                if config.checkpoint is not None:
                    state = Checkpoint(step + 1, params, sgd.state_arrays())
                    checkpoint.save(config.checkpoint, state, problem.fingerprint)
            if stopping:
                result.stopped_after = step + 1
                break
            if problem.X_eval is not None and evaluation_due(config, step + 1, problem.steps):
                if held_out_target_met(comm, problem, params, step + 1, result):
                    break
        result.seconds = time.perf_counter() - started
    result.noise_scale = noise_meter.running.value if noise_meter is not None else None
    if progress is not None:
        progress(None, None)
    if timeline is not None:
        assert timeline_path is not None  # a timeline is kept only with a path to write it to
        write_timeline(comm, timeline, timeline_path)

    if master_process:
        result.final_loss, accuracy = evaluate(model, params, X, y)
        result.accuracy = None if config.loss != "xent" else accuracy
        if save_path is not None and result.stopped_after is None:
            save_params(save_path, result)
        if not quiet and result.stopped_after is None:
            backend = "threads" if isinstance(comm, ThreadComm) else "MPI"
            print(summary(result, size, backend), flush=True)
    return result


class FloatLocalGradient:
    """Float mode: the Numba kernels' sum of per-sample gradients, in the model's dtype."""

    def __init__(self, model: MLP, max_batch: int, global_batch: int) -> None:
        from syncsgd.nn.kernels import Gradient

        self.kernel = Gradient(model, max_batch)
        self.buffer_dtype = model.dtype
        self.n_params = model.n_params

    def __call__(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                 sums: np.ndarray) -> None:  # fmt: skip
        """Fill `sums` with [gradient sum..., loss sum, correct count] of this shard."""
        loss_sum, correct = self.kernel(params, X, y, sums[: self.n_params])
        sums[self.n_params + LOSS], sums[self.n_params + CORRECT] = loss_sum, correct


class ExactLocalGradient:
    """Exact mode: batch-invariant kernels, sums extracted at a fixed point all ranks agree on.

    The per-layer bounds of the products are MAX-reduced over all ranks first, so every rank (and
    every P) extracts at the same fixed point; then every partial sum, in the rank and in the ring,
    is exact, and the result does not depend on how the batch was split (see syncsgd.nn.exact).
    """

    def __init__(self, model: MLP, max_batch: int, global_batch: int) -> None:
        from syncsgd.nn.exact import ExactGradient

        self.kernel = ExactGradient(model, max_batch)
        self.bounds = np.zeros(self.kernel.bound_count, np.float64)
        self.global_batch = global_batch
        self.buffer_dtype = np.dtype(np.float64)
        self.n_params = model.n_params

    def __call__(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                 sums: np.ndarray) -> None:  # fmt: skip
        """Fill `sums` with [exact gradient sum..., exact loss sum, correct count]."""
        correct = self.kernel.local_pass(params, X, y, self.bounds)
        mpi = constants(comm)
        comm.Allreduce(mpi.IN_PLACE, self.bounds, op=mpi.MAX)  # agree on the fixed point
        if not np.isfinite(self.bounds).all():  # the same on every rank: all skip or stop alike
            sums[:] = np.nan
            return
        self.kernel.accumulate(self.bounds, self.global_batch, sums[: self.n_params + LOSS + 1])
        sums[self.n_params + CORRECT] = correct


def evaluation_due(config: TrainConfig, steps_done: int, total_steps: int) -> bool:
    """Evaluate every --eval-every steps (default 1 with a target) and after the last step."""
    has_target = config.target_loss is not None or config.target_accuracy is not None
    every = config.eval_every or (1 if has_target else 0)
    return every > 0 and (steps_done % every == 0 or steps_done == total_steps)


def held_out_target_met(comm: Any, problem: Problem, params: np.ndarray, steps_done: int,
                        result: TrainResult) -> bool:  # fmt: skip
    """Rank 0 evaluates on the held-out samples; True on every rank once a target is met."""
    from syncsgd.nn.kernels import evaluate

    config = problem.config
    met = np.zeros(1)
    if comm.Get_rank() == 0:
        assert problem.X_eval is not None and problem.y_eval is not None  # callers check X_eval
        loss, accuracy = evaluate(problem.model, params, problem.X_eval, problem.y_eval)
        result.evals.append((steps_done, loss, accuracy if config.loss == "xent" else math.nan))
        met[0] = (config.target_loss is not None and loss <= config.target_loss) or (
            config.target_accuracy is not None and accuracy >= config.target_accuracy
        )
        if met[0] and result.steps_to_target is None:
            result.steps_to_target = steps_done
    if config.target_loss is None and config.target_accuracy is None:
        return False
    comm.Bcast(met, root=0)  # rank 0 decides for everyone
    return bool(met[0])


class NonFiniteError(ValueError):
    """Training diverged: the loss or the gradient of a step is not finite."""


# Set by the command line's SIGINT/SIGTERM handlers; the ranks agree through the allreduce.
stop_requested = threading.Event()


# The slots after the gradient in the communication buffer, summed over the ranks each step.
STATS = ("loss sum", "correct", "stop", "small-batch |G|^2", "ranks with samples", "sum 1/b")
LOSS, CORRECT, STOP = 0, 1, 2
NOISE_SLOTS = slice(3, 6)


def checkpoint_due(config: TrainConfig, steps_done: int, total_steps: int) -> bool:
    """Write a checkpoint every --checkpoint-every steps, and always after the last step."""
    if config.checkpoint is None:
        return False
    every = config.checkpoint_every
    return steps_done == total_steps or (every is not None and steps_done % every == 0)


def check_agreement(comm: Any, problem: Problem) -> None:
    """Stop every rank with one message if the ranks were started with different options or data.

    Beside the fingerprint, the ranks must agree on how they communicate - the algorithm and the
    buckets - which the fingerprint leaves out (a checkpoint may be resumed with others): each
    step's allreduce trusts that every rank passes the same buffers (check=False).
    """
    config = problem.config
    agreed = f"{problem.fingerprint} {config.algorithm} {config.bucket_bytes}"
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


def first_params(problem: Problem) -> np.ndarray:
    """Where training starts: the checkpoint resumed, the --init file, or the seeded draw."""
    if problem.start is not None:
        return problem.start.params
    if problem.init is not None:
        return problem.init
    return problem.model.init_params(problem.config.seed)


def load_npz(path: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz file, loaded without pickle; ValueError for a missing or bad file."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read {path} as .npz: {exc}") from None


def save_params(path: str, result: TrainResult) -> None:
    """Write the final parameters as W0, b0, W1, b1, ... to an .npz file, atomically."""
    with atomic_path(path) as tmp:
        np.savez(tmp, **result.arrays())  # type: ignore[arg-type]  # stub: might fill allow_pickle


@contextlib.contextmanager
def _log_file(path: str | None) -> Iterator[TextIO | None]:
    """A JSON-lines file that appears, complete, at `path` when the run ends (None: no log)."""
    if path is None:
        yield None
        return
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        yield handle


def _progress(total: int, *, enabled: bool) -> Callable[[int | None, float | None], None] | None:
    """A progress bar on a terminal (tqdm if installed): call (step, loss), then (None, None)."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="step", leave=False, file=sys.stderr)

        def update(step: int | None, loss: float | None) -> None:
            if step is None:
                bar.close()
            else:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

        return update
    every = max(total // 50, 1)

    def update_line(step: int | None, loss: float | None) -> None:
        if step is None:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)
        elif step % every == 0 or step == total - 1:
            print(
                f"\rstep {step + 1}/{total}  loss {loss:.4f}", end="", file=sys.stderr, flush=True
            )

    return update_line


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


def train(config: TrainConfig | None = None, *, ranks: int = 1, backend: str = "threads",
          log: str | None = None, save: str | None = None, timeline: str | None = None,
          **options: Any) -> TrainResult:  # fmt: skip
    """Train on `ranks` thread ranks (or this MPI rank) and return rank 0's result.

    `options` are TrainConfig fields and override those of `config`; `log`, `save` and
    `timeline` are the paths of the outputs of `syncsgd train`.

    >>> result = syncsgd.train(ranks=4, steps=50, hidden=(32,))
    >>> result.final_loss, result.arrays()["W0"].shape
    """
    config = replace(config or TrainConfig(), **options)
    problem = prepare(config)  # loaded once, shared read-only by the thread ranks
    results = launch(train_rank, problem, backend=backend, ranks=ranks, log_path=log,
                     save_path=save, timeline_path=timeline)  # fmt: skip
    return results[0]


__all__ = ["Problem", "TrainConfig", "TrainResult", "prepare", "save_params", "train", "train_rank"]
