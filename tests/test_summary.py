"""The summary line and the log report the steady state: the first step, with start-up, apart."""

from __future__ import annotations

import io
import json

import numpy as np

from syncsgd.nn.mlp import mlp
from syncsgd.training.hooks import Log, Recorder
from syncsgd.training.result import TrainResult, summary
from syncsgd.training.step import StepRecord


def record(step: int, started: float, compute: float, comm: float, update: float) -> StepRecord:
    """A step that computed, reduced and updated for the given seconds, from `started`."""
    computed = started + compute
    return StepRecord(step, 8, 32, 1.0, True, 0.1, 1.0, started, computed, computed + comm,
                      computed + comm + update)  # fmt: skip


def recorded(durations: list[tuple[float, float, float]]) -> tuple[TrainResult, list[dict]]:
    """A result and its log lines after steps of the given (compute, allreduce, update) seconds."""
    model = mlp((2, 2))
    result = TrainResult(np.zeros(model.n_params), model, len(durations), final_loss=0.5)
    handle = io.StringIO()
    hooks = [Recorder(result), Log(handle, 10, result, noise=False)]
    clock = 0.0
    for step, (compute, comm, update) in enumerate(durations):
        for hook in hooks:
            hook.after_step(record(step, clock, compute, comm, update), False)
        clock += compute + comm + update
    result.seconds = clock
    return result, [json.loads(line) for line in handle.getvalue().splitlines()]


def test_a_slow_first_step_does_not_hide_the_allreduce():
    # A first step of 0.6 s with 0.1 s of allreduce, then 19 steps of 2 ms, 95% of it allreduce:
    # over the whole run the allreduce is 21% of the time; in the steady state 95%.
    result, lines = recorded([(0.5, 0.1, 0.0)] + [(0.0001, 0.0019, 0.0)] * 19)
    line = summary(result, 4, "threads")
    assert "after the first step: 500.0 steps/s, 95.0% of the time in the allreduce" in line
    assert "the first step, start-up included, took 0.60 s" in line
    assert result.comm_seconds / result.seconds < 0.25  # what the line said before
    assert "steady_comm_share" not in lines[0]
    assert abs(lines[-1]["steady_comm_share"] - 0.95) < 1e-9
    assert abs(lines[-1]["steady_steps_per_s"] - 500.0) < 1e-6


def test_one_step_says_that_start_up_is_included():
    result, _ = recorded([(0.5, 0.1, 0.0)])
    line = summary(result, 1, "threads")
    assert line.startswith("trained 1 step on 1 rank (threads)")
    assert "(one step: start-up included)" in line
