"""The training loop every rank runs: start alike, take the steps, call the hooks, finish.

    syncsgd train --ranks 4                       # 4 thread ranks in this process
    mpiexec -n 4 syncsgd train                    # 4 MPI processes
    python -c "import syncsgd; print(syncsgd.train(ranks=4, steps=50).final_loss)"
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple, TextIO, cast

import numpy as np

from syncsgd.comm.threads import ThreadComm
from syncsgd.comm.watchdog import Watched, bcast_peer, collective_timeout, current, watching
from syncsgd.comm.world import launch
from syncsgd.nn.losses import loss_entry
from syncsgd.nn.optim import Optimizer, make_optimizer
from syncsgd.training import checkpoint, data
from syncsgd.training.batchnorm import micro_batch_note, record_comm, start_running
from syncsgd.training.config import TrainConfig, loss_scaling
from syncsgd.training.hooks import (
    Checkpointing,
    Digests,
    Evaluation,
    Hook,
    Log,
    LossScaler,
    NoiseScale,
    NonFinitePolicy,
    Progress,
    Recorder,
    StopRequest,
    TimelineSpans,
)
from syncsgd.training.result import TrainResult, document, summary
from syncsgd.training.run import (
    Run,
    agree,
    check_agreement,
    check_outputs,
    first_params,
    prepare,
)
from syncsgd.training.step import DataParallelStep
from syncsgd.training.timeline import Timeline
from syncsgd.training.timeline import write as write_timeline
from syncsgd.training.variants import variant
from syncsgd.util import jsonout
from syncsgd.util.files import atomic_file


def train_rank(comm: Any, run: Run, *, log_path: str | None = None,
               timeline_path: str | None = None, save_path: str | None = None,
               json_path: str | None = None, quiet: bool = True,
               record_digests: bool = False,
               measure_memory: bool = False) -> TrainResult:  # fmt: skip
    """Run the whole training on this rank of `comm`; rank 0 logs, saves and prints a summary.

    A collective that makes no progress for `run.config.timeout` seconds ends the job.
    `measure_memory` (implied by `json_path`): result.memory_bytes, measured at start-up.
    """
    with collective_timeout(comm, run.config.timeout):
        return _train_rank(comm, run, log_path=log_path, timeline_path=timeline_path,
                           save_path=save_path, json_path=json_path, quiet=quiet,
                           record_digests=record_digests,
                           measure_memory=measure_memory or json_path is not None)  # fmt: skip


def _train_rank(comm: Any, run: Run, *, log_path: str | None, timeline_path: str | None,
                save_path: str | None, json_path: str | None, quiet: bool,
                record_digests: bool, measure_memory: bool) -> TrainResult:  # fmt: skip
    """`train_rank` within its collective timeout."""
    from syncsgd.nn.kernels import first_load, limit_blas_threads  # imports Numba: when training

    # One BLAS thread per rank, as torchrun does: ranks share the cores (see docs/measurements.md).
    limit_blas_threads(1)
    master_process = comm.Get_rank() == 0
    if master_process and not quiet:  # before the first step: what the run was given
        print(run.read, flush=True)
    if master_process and not quiet:  # armed before the first step's collectives reach any rank
        first_load.arm(sys.stderr)
    check_agreement(comm, run)
    params, optimizer, first_step = starting_state(comm, run)
    result = TrainResult(params, run.model, run.steps)
    timeline = Timeline(Watched(comm, "the timeline's start")) if timeline_path else None
    with contextlib.ExitStack() as outputs:
        hold_checkpoints(comm, run, outputs)
        log = outputs.enter_context(log_file(log_path if master_process else None))
        hooks = make_hooks(comm, run, result, first_step, log=log, timeline=timeline,
                           progress=master_process and not quiet,
                           digests=record_digests)  # fmt: skip
        riders = [hook.rider for hook in hooks if hook.rider is not None]
        trace = timeline.collective_step if timeline is not None else None
        config = run.config
        chosen = variant(config.pitfall, config.clip_norm, config.optimizer)  # or the correct run
        if measure_memory:  # before the real step is built: its copy, untimed
            result.memory_bytes = measured_memory(comm, run, params, chosen, riders)
        stepper = DataParallelStep(comm, run, params, optimizer, chosen, riders, trace=trace)
        result.params = stepper.params  # ZeRO-3: none, each rank keeps its blocks
        del params
        result.running = start_running(comm, run, stepper)  # BatchNorm's; None without
        started = time.perf_counter()
        result.steps = take_steps(stepper, hooks, range(first_step, run.steps))
        result.seconds = time.perf_counter() - started
        result.params = stepper.whole_params()
        record_comm(result, stepper)  # BatchNorm's allreduces, if any
        result.bytes_sent_per_step = stepper.bytes_per_step
    if timeline is not None:
        assert timeline_path is not None  # a timeline is kept only with a path to write it to
        write_timeline(Watched(comm, "the timeline's gather"), timeline, timeline_path)
    if master_process:
        finish(comm, run, result, Outputs(save_path, json_path), quiet)
    return result


def measured_memory(comm: Any, run: Run, params: np.ndarray, chosen: Any,
                    riders: list[Any]) -> dict[str, int]:  # fmt: skip
    """The bytes per category of a step like the run's, built apart and taken twice
    (training/memory.py), the largest over the ranks."""
    from syncsgd.training.memory import measure, quiet_riders

    def make_step(comm: Any, copy: np.ndarray, optimizer: Optimizer | None) -> DataParallelStep:
        return DataParallelStep(comm, run, copy, optimizer, chosen, quiet_riders(riders))

    return measure(comm, run, make_step, params)


def take_steps(stepper: DataParallelStep, hooks: list[Hook], steps: range) -> int:
    """Take the steps, each followed by every hook; stop after a step a hook ends the run at.

    Returns the number of steps done (counting those of a resumed run's start).
    """
    for hook in hooks:
        hook.attach(stepper)
    done = steps.start
    try:
        for step in steps:
            record = stepper.take_(step)
            stopping = False
            for hook in hooks:  # every hook sees the step, even after one asked to stop
                stopping = hook.after_step(record, stopping) or stopping
            done = step + 1
            if stopping:
                break
        return done
    finally:
        current().during = None  # a timeout after the steps names no step
        stepper.close()
        for hook in hooks:
            hook.close()


def starting_state(comm: Any, run: Run) -> tuple[np.ndarray, Optimizer | None, int]:
    """The parameters (rank 0's, broadcast: the same bits everywhere), the optimizer (None when
    sharded: each rank's step makes the optimizer of its shard), the step."""
    params = np.empty(run.model.n_params, run.model.dtype)
    if comm.Get_rank() == 0:
        params[:] = first_params(run)
    with watching("the broadcast of the first parameters", bcast_peer(comm, 0)):
        comm.Bcast(params, root=0)
    if run.config.zero_stage:  # each rank's step makes (and loads) the optimizer of its blocks
        return params, None, 0 if run.start is None else run.start.step
    optimizer = make_optimizer(run.config.optimizer, run.optim, run.model.n_params,
                               run.model.dtype, run.config, run.model.layout())  # fmt: skip
    if run.start is None:
        return params, optimizer, 0
    optimizer.load_state_arrays(run.start.optimizer)
    return params, optimizer, run.start.step


def make_hooks(comm: Any, run: Run, result: TrainResult, first_step: int, *,
               log: TextIO | None, timeline: Timeline | None, progress: bool,
               digests: bool) -> list[Hook]:  # fmt: skip
    """The run's instruments, in the order they see each step."""
    config, master_process = run.config, comm.Get_rank() == 0
    scaling = loss_scaling(config)  # None: none; 0.0: dynamic; else a fixed scale
    # The dynamic scaler skips a step with an inf or NaN, as GradScaler does, on every rank alike.
    skip = config.skip_nonfinite or scaling == 0.0
    hooks: list[Hook] = [NonFinitePolicy(skip, result), Recorder(result)]
    scaler = None
    if scaling is not None:
        start = run.start.scaler if run.start is not None else None
        scaler = LossScaler(result, scaling or None, config.scale_window, start)
        hooks.append(scaler)
    if timeline is not None:
        hooks.append(TimelineSpans(timeline))
    if digests:
        spans = [slice(offset, offset + math.prod(shape))
                 for _, shape, offset in run.model.layout()]  # fmt: skip
        hooks.append(Digests(result, spans))
    if config.noise_scale:
        hooks.append(NoiseScale(result, run.model.n_params))
    if progress:
        hooks.append(Progress(first_step, run.steps))
    hooks.append(StopRequest(result))
    wants_eval = config.eval_every > 0 or config.target_loss is not None
    if run.X_eval is not None and (wants_eval or config.target_accuracy is not None):
        hooks.append(Evaluation(Watched(comm, "the evaluation"), run, result))
    if log is not None:  # after the evaluation: a step's line carries the evaluation it had
        per_epoch = data.steps_per_epoch(len(run.X), config.batch_size)
        hooks.append(Log(log, per_epoch, result, config.noise_scale))
    # last: it sees a target met, too; sharded, every rank writes its shard
    if config.checkpoint is not None and (master_process or config.zero_stage):
        hooks.append(Checkpointing(run, scaler, writes=master_process))
    return hooks


def hold_checkpoints(comm: Any, run: Run, outputs: contextlib.ExitStack) -> None:
    """Rank 0 locks the checkpoint directory for the run; every rank learns if it could not.
    Sharded, every rank writes into it: every rank must see the directory rank 0 locked."""
    directory = run.config.checkpoint
    if directory is None:
        return
    error = None
    if comm.Get_rank() == 0:  # it writes the checkpoints (sharded: the manifests)
        try:
            os.makedirs(directory, exist_ok=True)
            outputs.enter_context(checkpoint.locked(directory, run.fingerprint))
        except (ValueError, OSError) as exc:
            error = str(exc)
    agree(comm, error)
    if run.config.zero_stage and comm.Get_size() > 1:
        agree(comm, sees_the_lock(comm, directory, run.config.zero_stage))


def sees_the_lock(comm: Any, directory: str, stage: int) -> str | None:
    """Why this rank does not see the lock file rank 0 holds in `directory` (a directory on a
    file system the ranks do not share), or None."""
    lock = np.zeros(32, np.uint8)
    try:
        with open(os.path.join(directory, checkpoint.LOCK), "rb") as handle:
            lock[:] = np.frombuffer(hashlib.sha256(handle.read()).digest(), np.uint8)
    except OSError:
        pass  # no lock here: this rank's digest stays zero
    rank_0s = lock.copy()
    with watching("the broadcast of the checkpoint lock's digest", bcast_peer(comm, 0)):
        comm.Bcast(rank_0s, root=0)
    if np.array_equal(lock, rank_0s):
        return None
    return (f"--zero-stage {stage}: every rank writes its shard of a checkpoint into --checkpoint "
            f"{directory}, and this rank does not see the lock file rank 0 holds there: give a "
            f"directory on a file system every rank shares")  # fmt: skip


class Outputs(NamedTuple):
    """What rank 0 writes when training ends (None: not asked for)."""

    save: str | None = None  # the final parameters (.npz)
    json: str | None = None  # the run's summary


def finish(comm: Any, run: Run, result: TrainResult, outputs: Outputs, quiet: bool) -> None:
    """Rank 0: loss and accuracy on all the data, then --save, --json and the summary line."""
    from syncsgd.training.batchnorm import evaluate  # BatchNorm: its running statistics

    result.final_loss, accuracy = evaluate(run.model, result.params, result.running,
                                           run.config.bn_eps, run.X, run.y)  # fmt: skip
    result.accuracy = accuracy if loss_entry(run.config.loss).labels else None
    threads, stopped = isinstance(comm, ThreadComm), result.stopped_after is not None
    if outputs.save is not None and not stopped:  # interrupted: a checkpoint, not final ones
        save_params(outputs.save, result)
    if outputs.json is not None:  # also after a stop: the run so far, with stopped_after
        backend = "threads" if threads else "mpi"
        jsonout.write(outputs.json, document(result, comm.Get_size(), backend, run.config))
    if not quiet and not stopped:
        print(summary(result, comm.Get_size(), "threads" if threads else "MPI", outputs.save),
              flush=True)  # fmt: skip
        if result.running is not None and run.config.accumulate > 1:
            print(micro_batch_note(run.config), flush=True)


def save_params(path: str, result: TrainResult) -> None:
    """Write the final parameters as W0, b0, W1, b1, ... (and BatchNorm's) to an .npz file."""
    # To a handle, not a name: np.savez appends .npz to a name that lacks it.
    with atomic_file(path) as handle:
        np.savez(handle, **result.arrays())  # type: ignore[arg-type]  # stub: might fill allow_pickle


@contextlib.contextmanager
def log_file(path: str | None) -> Iterator[TextIO | None]:
    """A JSON-lines file that appears, complete, at `path` when the run ends (None: no log)."""
    if path is None:
        yield None
        return
    with atomic_file(path, "w", encoding="utf-8") as handle:
        yield cast(TextIO, handle)  # opened in text mode


def train(config: TrainConfig | None = None, *, ranks: int = 1, backend: str = "threads",
          log: str | None = None, save: str | None = None, timeline: str | None = None,
          json: str | None = None, measure_memory: bool = False,
          **options: Any) -> TrainResult:  # fmt: skip
    """Train on `ranks` thread ranks (or this MPI rank) and return rank 0's result.

    `options` are TrainConfig fields and override those of `config`; `log`, `save`,
    `timeline` and `json` are the paths of the outputs of `syncsgd train`; `measure_memory`
    (implied by `json`): the result's memory_bytes.
    """
    config = replace(config or TrainConfig(), **options)
    check_outputs(config, save=save, log=log, timeline=timeline, json=json)
    # Loaded once, shared read-only by the thread ranks.
    run = prepare(config, ranks if backend == "threads" else 1)
    results = launch(train_rank, run, backend=backend, ranks=ranks, log_path=log,
                     save_path=save, timeline_path=timeline, json_path=json,
                     measure_memory=measure_memory)  # fmt: skip
    return results[0]


__all__ = ["Run", "TrainConfig", "TrainResult", "prepare", "save_params", "train", "train_rank"]
