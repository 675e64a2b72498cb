"""The instruments of a run, each a small hook the loop calls after every step.

A hook may send values along with the gradient (a `Rider`: the stop flag, the noise sums) and may
end training after the step (`after_step` returns True). Every rank calls every hook, in order;
hooks that print or write do so on rank 0 only.
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from syncsgd.nn.losses import loss_entry
from syncsgd.training import checkpoint, checkpoint_shards
from syncsgd.training.checkpoint import Checkpoint
from syncsgd.training.noise import NoiseScaleMeter
from syncsgd.training.result import NonFiniteError, TrainResult
from syncsgd.training.run import Run
from syncsgd.training.step import DataParallelStep, Rider, StepRecord
from syncsgd.training.timeline import Timeline
from syncsgd.util import jsonout

INITIAL_LOSS_SCALE = 2.0**16  # torch.cuda.amp.GradScaler's init_scale

# Set by the command line's SIGINT/SIGTERM handlers; the ranks agree through the allreduce.
stop_requested = threading.Event()
stop_agreed = threading.Event()  # set once the ranks agreed to stop after the step just taken


class Hook:
    """Does nothing: the base of every instrument."""

    rider: Rider | None = None

    def attach(self, stepper: DataParallelStep) -> None:
        """Called once, when the step's buffers exist."""

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        """Called after every step on every rank; True ends training after this step."""
        return False

    def close(self) -> None:
        """Called once, when training ends."""


class NonFinitePolicy(Hook):
    """A step whose loss or gradient is not finite stops training, or is skipped on every rank."""

    def __init__(self, skip: bool, result: TrainResult) -> None:
        self.skip, self.result = skip, result

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        if record.finite:
            return False
        if not self.skip:
            raise NonFiniteError(
                f"non-finite loss or gradient at step {record.step} (loss {record.loss}); lower "
                f"--lr, set --clip-norm, or pass --skip-nonfinite to skip such steps"
            )
        self.result.skipped_steps.append(record.step)
        return False


class LossScaler(Hook):
    """GradScaler's loss scale: halved and the step skipped on an inf or NaN, doubled after a
    window of finite steps; or a fixed scale. Every rank decides alike from the allreduce."""

    def __init__(self, result: TrainResult, fixed: float | None, window: int,
                 start: dict[str, np.ndarray] | None) -> None:  # fmt: skip
        self.result, self.dynamic, self.window = result, fixed is None, window
        self.scale, self.good_steps = INITIAL_LOSS_SCALE if fixed is None else fixed, 0
        if start:  # resumed: the scale and the count of finite steps in a row, as they were
            self.scale, self.good_steps = float(start["scale"]), int(start["good_steps"])
        self.overflowed = False
        self.rider = Rider("ranks with a non-finite gradient", 1, self.fill_, self.read_)

    def attach(self, stepper: DataParallelStep) -> None:
        self.gradient = stepper.local_gradient
        self.gradient.scale = self.scale

    def fill_(self, slots: np.ndarray, grad_sum: np.ndarray, shard_size: int) -> None:
        slots[0] = 0 if np.isfinite(grad_sum).all() else 1  # this rank's verdict, summed

    def read_(self, slots: np.ndarray, grad_mean: np.ndarray, batch_size: int,
              finite: bool) -> None:  # fmt: skip
        # An inf or NaN on any rank also makes the summed gradient non-finite on every rank, so
        # `finite` and the count agree; both are the same on every rank.
        self.overflowed = slots[0] > 0 or not finite

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        self.result.loss_scales.append(self.scale)  # the scale this step was taken with
        if self.overflowed:
            self.good_steps = 0
            self.scale = self.scale / 2 if self.dynamic else self.scale
        else:
            self.good_steps += 1
            if self.dynamic and self.good_steps == self.window:
                self.scale, self.good_steps = self.scale * 2, 0
        self.gradient.scale = self.scale
        return False

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps: the next step's scale and the finite steps in a row."""
        return {"scale": np.array(self.scale, np.float64),
                "good_steps": np.array(self.good_steps, np.int64)}  # fmt: skip


class Recorder(Hook):
    """The losses and the time spent computing, in the allreduce and in the update."""

    def __init__(self, result: TrainResult) -> None:
        self.result = result
        self.steady_from: float | None = None  # when the second step started

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        result = self.result
        result.losses.append(record.loss)
        compute, comm = record.computed - record.started, record.reduced - record.computed
        update = record.ended - record.reduced
        result.compute_seconds += compute
        result.comm_seconds += comm
        result.update_seconds += update
        if result.first_step_seconds is None:  # loads the kernels: kept apart from the rest
            result.first_step_seconds = record.ended - record.started
            return False
        if self.steady_from is None:
            self.steady_from = record.started
        result.steady_steps += 1
        result.steady_seconds = record.ended - self.steady_from  # the hooks' time included
        result.steady_compute_seconds += compute
        result.steady_comm_seconds += comm
        result.steady_update_seconds += update
        return False


class TimelineSpans(Hook):
    """Compute and update spans on the timeline (the allreduce traces its own steps)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        parts = [("compute", record.started, record.computed)]
        if not math.isnan(record.backward):  # --overlap: the allreduces lie in the backward pass
            parts = [("forward", record.started, record.backward),
                     ("backward", record.backward, record.computed)]  # fmt: skip
        for name, start, end in parts:
            self.timeline.span(name, "compute", start, end, step=record.step,
                               samples=record.shard_size)  # fmt: skip
        self.timeline.span("update", "update", record.reduced, record.ended, step=record.step)
        return False


DIGEST_BYTES = 16  # of each parameter tensor's digest


class Digests(Hook):
    """A digest of each parameter tensor after every step, in buffer order, joined (verify finds
    the first step and the first tensor that differ)."""

    def __init__(self, result: TrainResult, spans: list[slice]) -> None:
        self.result, self.spans = result, spans

    def attach(self, stepper: DataParallelStep) -> None:
        self.stepper = stepper

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        params = self.stepper.whole_params()  # (ZeRO-3: gathered, on every rank)
        self.result.digests.append(b"".join(
            hashlib.blake2b(params[span].tobytes(), digest_size=DIGEST_BYTES).digest()
            for span in self.spans))  # fmt: skip
        return False


class NoiseScale(Hook):
    """The gradient noise scale from each rank's shard gradient and the allreduced one."""

    def __init__(self, result: TrainResult, n_params: int) -> None:
        self.result, self.meter = result, NoiseScaleMeter(n_params)
        self.rider = Rider("noise sums", 3, self.meter.local_, self.read_)
        self.sharded: Any = None  # a sharded step's end: its norm over every shard is |G_B|

    def attach(self, stepper: DataParallelStep) -> None:
        if stepper.end is not stepper:  # no rank holds the whole mean gradient
            self.sharded, stepper.want_grad_norm = stepper.end, True

    def read_(self, slots: np.ndarray, grad_mean: np.ndarray, batch_size: int,
              finite: bool) -> None:  # fmt: skip
        """Before the update changes the mean gradient: this step's running estimate."""
        whole = None if self.sharded is None else self.sharded.grad_norm
        self.result.noise_scales.append(self.meter.add(slots, grad_mean, batch_size, finite,
                                                       whole))  # fmt: skip

    def close(self) -> None:
        self.result.noise_scale = self.meter.running.value


class StopRequest(Hook):
    """Ctrl-C or SIGTERM on any rank: every rank stops after the same step."""

    def __init__(self, result: TrainResult, requested: threading.Event = stop_requested) -> None:
        self.result, self.requested, self.stop = result, requested, False
        self.rider = Rider("ranks asked to stop", 1, self.fill_, self.read_, needs_gradient=False)

    def fill_(self, slots: np.ndarray, grad_sum: np.ndarray, shard_size: int) -> None:
        slots[0] = 1 if self.requested.is_set() else 0

    def read_(self, slots: np.ndarray, grad_mean: np.ndarray, batch_size: int,
              finite: bool) -> None:  # fmt: skip
        self.stop = bool(slots[0] > 0)

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        if self.stop:
            self.result.stopped_after = record.step + 1
            stop_agreed.set()
        return self.stop


class Log(Hook):
    """One JSON line per step on rank 0: steady-state figures from the second, evaluations too."""

    def __init__(self, handle: TextIO, steps_per_epoch: int, result: TrainResult,
                 noise: bool) -> None:  # fmt: skip
        self.handle, self.steps_per_epoch, self.result, self.noise = (
            handle, steps_per_epoch, result, noise)  # fmt: skip

    def attach(self, stepper: DataParallelStep) -> None:
        stepper.want_grad_norm = True

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        line: dict[str, Any] = {
            "step": record.step, "epoch": record.step // self.steps_per_epoch,
            "loss": record.loss, "lr": record.lr, "grad_norm": record.grad_norm,
            "seconds": record.ended - record.started,
            "comm_seconds": record.reduced - record.computed,
        }  # fmt: skip
        result = self.result
        if result.steady_steps:  # from the second step on: the running steady-state figures
            line["steady_steps_per_s"] = result.steady_steps / result.steady_seconds
            line["steady_comm_share"] = result.steady_comm_seconds / result.steady_seconds
        if self.noise:
            line["noise_scale"] = result.noise_scales[-1]
        if result.loss_scales:
            line["loss_scale"] = result.loss_scales[-1]
        if not record.finite:  # skipped on every rank: loss and grad_norm are null
            line["skipped"] = True
        if result.evals and result.evals[-1][0] == record.step + 1:  # evaluated after this step
            line["eval_loss"], line["eval_accuracy"] = result.evals[-1][1:]
        self.handle.write(jsonout.dumps(line) + "\n")
        return False


class Progress(Hook):
    """Rank 0's progress: a bar on a terminal; elsewhere a line now and then in a long run."""

    def __init__(self, first_step: int, total: int) -> None:
        self.first_step, self.total = first_step, total - first_step
        terminal = sys.stderr.isatty()
        self.update = progress_bar(self.total) if terminal else progress_lines(self.total)

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        self.update(record.step - self.first_step, record.loss)
        return False

    def close(self) -> None:
        self.update(None, None)


class Checkpointing(Hook):
    """A checkpoint every --checkpoint-every steps, after the last, and on a stop: rank 0 writes
    the whole state; sharded, every rank its shard file and rank 0 the manifest."""

    def __init__(self, run: Run, scaler: LossScaler | None = None, writes: bool = True) -> None:
        self.run, self.scaler, self.writes = run, scaler, writes

    def attach(self, stepper: DataParallelStep) -> None:
        from syncsgd.training.batchnorm import running_of

        self.stepper, self.running = stepper, running_of(stepper)

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        config, steps_done = self.run.config, record.step + 1
        every = config.checkpoint_every
        due = steps_done == self.run.steps or (every is not None and steps_done % every == 0)
        if due or stopping:
            assert config.checkpoint is not None  # the hook is made for --checkpoint only
            scaler = self.scaler.state() if self.scaler is not None else {}
            if self.stepper.sharded is not None:  # no rank gathers the whole state
                shard = checkpoint_shards.shard_of(self.stepper, steps_done, scaler, self.running)
                checkpoint_shards.save(self.stepper, config.checkpoint, shard,
                                       self.run.fingerprint)  # fmt: skip
                return False
            state = Checkpoint(steps_done, self.stepper.whole_params(),
                               self.stepper.optimizer.state_arrays(), scaler,
                               self.running)  # fmt: skip
            if self.writes:
                checkpoint.save(config.checkpoint, state, self.run.fingerprint)
        return False


class Evaluation(Hook):
    """Rank 0 evaluates on the held-out samples; every rank stops once a target is met."""

    def __init__(self, comm: Any, run: Run, result: TrainResult) -> None:
        config = run.config
        self.comm, self.run, self.result = comm, run, result
        self.has_target = config.target_loss is not None or config.target_accuracy is not None
        self.every = config.eval_every or 1  # made with --eval-every or a target only

    def attach(self, stepper: DataParallelStep) -> None:
        from syncsgd.training.batchnorm import running_of

        self.stepper, self.running = stepper, running_of(stepper)

    def after_step(self, record: StepRecord, stopping: bool) -> bool:
        steps_done = record.step + 1
        due = steps_done % self.every == 0 or steps_done == self.run.steps
        if stopping or not due:
            return False
        met = np.zeros(1)
        params = self.stepper.whole_params()  # (ZeRO-3: gathered, on every rank)
        if self.comm.Get_rank() == 0:
            met[0] = self.evaluate(steps_done, params)
        if not self.has_target:
            return False
        self.comm.Bcast(met, root=0)  # rank 0 decides for everyone
        return bool(met[0])

    def evaluate(self, steps_done: int, params: np.ndarray) -> bool:
        """Evaluate on the held-out samples; True if a target is met."""
        from syncsgd.training.batchnorm import evaluate  # BatchNorm: its running statistics

        config, run, result = self.run.config, self.run, self.result
        assert run.X_eval is not None and run.y_eval is not None  # made with --holdout only
        loss, accuracy = evaluate(run.model, params, self.running, config.bn_eps, run.X_eval,
                                  run.y_eval)  # fmt: skip
        result.evals.append((steps_done, loss,
                             accuracy if loss_entry(config.loss).labels else math.nan))
        met = (config.target_loss is not None and loss <= config.target_loss) or (
            config.target_accuracy is not None and accuracy >= config.target_accuracy
        )
        if met and result.steps_to_target is None:
            result.steps_to_target = steps_done
        return met


def progress_bar(total: int) -> Callable[[int | None, float | None], None]:
    """Call with (step, loss) after each step, then (None, None): tqdm if installed, else a line."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _progress_line(total)
    bar = tqdm(total=total, unit="step", leave=False, file=sys.stderr)

    def update(step: int | None, loss: float | None) -> None:
        if step is None:
            bar.close()
        else:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    return update


def progress_lines(total: int, first: float = 10.0, every: float = 30.0,
                   clock: Callable[[], float] = time.monotonic,
                   ) -> Callable[[int | None, float | None], None]:  # fmt: skip
    """For a log file or a pipe: one line after `first` seconds, then every `every` seconds."""
    started = clock()
    due = [started + first]

    def update(step: int | None, loss: float | None) -> None:
        now = clock()
        if step is None or now < due[0]:
            return
        due[0] = now + every
        print(f"syncsgd: step {step + 1}/{total}, loss {loss:.4g}, {now - started:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip

    return update


def _progress_line(total: int) -> Callable[[int | None, float | None], None]:
    """A progress line rewritten in place about 50 times over the run."""
    every = max(total // 50, 1)

    def update(step: int | None, loss: float | None) -> None:
        if step is None:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)
        elif step % every == 0 or step == total - 1:
            print(f"\rstep {step + 1}/{total}  loss {loss:.4f}", end="", file=sys.stderr,
                  flush=True)  # fmt: skip

    return update
