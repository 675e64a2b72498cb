"""The collective timeout: a stuck rank ends the job, on threads and under a real mpiexec, and
every waiting rank names the collective and the rank it waits for; --timeout 0 waits forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import mpiexec_flags, mpiexec_path, requires_mpi

from syncsgd import train
from syncsgd.comm import threads
from syncsgd.comm.threads import CollectiveTimeout, run_threads
from syncsgd.comm.watchdog import collective_timeout
from syncsgd.training import hooks, loop, timeline

SMALL = {"samples": 256, "features": 8, "hidden": (8,), "batch_size": 32, "steps": 8}
GRACE = 8.0  # seconds beyond the timeout a test allows the job to end in (start-up excluded)


def stall_on(monkeypatch, module, name: str, rank_of, seconds: float) -> None:
    """Make `module.name` sleep `seconds` first on the rank `rank_of(args)` says is 1 (or 0)."""
    original = getattr(module, name)

    def stalled(*args, **kwargs):
        if rank_of(*args):
            time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, stalled)


def stall_allreduce(monkeypatch, seconds: float, at_step: int = 3) -> None:
    """Rank 1 sleeps before the allreduce of training step `at_step`."""
    from syncsgd.training.step import DataParallelStep

    original = DataParallelStep.take_

    def take_(self, step):
        if self.rank == 1 and step == at_step:
            time.sleep(seconds)
        return original(self, step)

    monkeypatch.setattr(DataParallelStep, "take_", take_)


def timed_out(**options) -> tuple[str, float]:
    """Train on 3 thread ranks expecting a timeout: its message and how long training took."""
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout) as caught:
        train(ranks=3, **{**SMALL, **options})
    return str(caught.value), time.monotonic() - started


def test_a_stuck_thread_rank_times_out_every_rank(monkeypatch):
    stall_allreduce(monkeypatch, 30)
    message, took = timed_out(timeout=1)
    assert took < 1 + GRACE  # not the 30 s the rank sleeps
    assert "no progress for 1 s (--timeout)" in message
    # Rank 2 receives from rank 1 in the ring; rank 0 sends to rank 1 (a synchronous send).
    assert "rank 2 in ring_allreduce (reduce-scatter step 0) at training step 3, " \
           "waiting for rank 1" in message  # fmt: skip
    assert "rank 0 in ring_allreduce" in message and "rank 1 in" not in message


def test_timeout_zero_waits_for_a_slow_rank(monkeypatch):
    stall_allreduce(monkeypatch, 1.5)
    assert train(ranks=3, timeout=0, **SMALL).steps == SMALL["steps"]
    with pytest.raises(CollectiveTimeout):  # the same stall, with a timeout shorter than it
        train(ranks=3, timeout=0.5, **SMALL)


@pytest.mark.parametrize(
    "where, stalled_rank, options, named",
    [
        ((loop, "check_agreement", lambda comm, run: comm.Get_rank() == 1), 1, {},
         "rank 0 in the start-up agreement (Bcast), waiting for rank 1 to receive"),
        ((loop, "first_params", lambda run: True), 0, {},
         "rank 1 in the broadcast of the first parameters, waiting for rank 0"),
        ((hooks.Evaluation, "evaluate", lambda self, steps: True), 0,
         {"holdout": 0.25, "eval_every": 2, "target_loss": 1e-9},
         "rank 1 in the evaluation (Bcast) at training step 1, waiting for rank 0"),
        ((timeline.Timeline, "chrome_events", lambda self: self.rank == 1), 1,
         {"timeline": "TIMELINE"},
         "rank 0 in the timeline's gather (Recv), waiting for rank 1"),
    ],
)  # fmt: skip
def test_the_training_loops_collectives_are_named(monkeypatch, tmp_path, where, stalled_rank,
                                                   options, named):  # fmt: skip
    module, name, is_stalled = where
    stall_on(monkeypatch, module, name, is_stalled, 30)
    # The stalled rank sleeps through any grace: waiting out the 2 s of it (which the test above
    # bounds) would not change the message these cases read.
    monkeypatch.setattr(threads, "TIMEOUT_GRACE", 0.1)
    if "timeline" in options:
        options = {**options, "timeline": str(tmp_path / "trace.json")}
    message, took = timed_out(timeout=1, **options)
    assert named in message
    assert f"rank {stalled_rank} in" not in message  # the stuck rank waits for nobody
    assert took < 1 + GRACE


def test_collective_timeout_restores_the_previous_setting():
    def rank(comm):
        with collective_timeout(comm, 5):
            inside = comm.set_timeout(5)
        return inside, comm.set_timeout(None)

    assert run_threads(2, rank) == [(5.0, None), (5.0, None)]


def test_timeout_is_checked():
    with pytest.raises(ValueError, match="--timeout must be >= 0"):
        train(ranks=1, timeout=-1, **SMALL)
    with pytest.raises(ValueError, match="--timeout must be a finite number"):
        train(ranks=1, timeout=float("inf"), **SMALL)


# -- under a real mpiexec -----------------------------------------------------------------------

# Rank 1 stops itself (SIGSTOP: as a node that stops answering) or sleeps before the allreduce
# of training step 3, then the command line trains as usual.
STALLING_RANK = textwrap.dedent("""
    import os, signal, sys, time
    from syncsgd.training.step import DataParallelStep
    how = sys.argv[1]
    original = DataParallelStep.take_
    def take_(self, step):
        if self.rank == 1 and step == 3:
            print(f"stalling at {time.time()}", file=sys.stderr, flush=True)
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(float(how))
        return original(self, step)
    DataParallelStep.take_ = take_
    from syncsgd.cli import main
    sys.exit(main(["train", *sys.argv[2:]]))
""")
MPI_ARGS = ["--samples", "256", "--features", "8", "--hidden", "8", "--batch-size", "32",
            "--steps", "8", "--quiet"]  # fmt: skip


def run_job(ranks: int, how: str, args: list[str], limit: float = 180) -> tuple[int, str, float]:
    """Run the stalling script under mpiexec: (status, stderr, seconds from the stall to the end).

    The job runs in its own process group, killed whole if it outlives `limit` (a hang fails).
    """
    path = str(mpiexec_path())
    command = [path, *mpiexec_flags(path), "-n", str(ranks), sys.executable, "-c",
               STALLING_RANK, how, *MPI_ARGS, *args]  # fmt: skip
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        _, stderr = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job did not end within {limit} s: {' '.join(command[:6])} ...")
    ended = time.time()
    stalls = [float(line.split()[-1]) for line in stderr.splitlines() if "stalling at" in line]
    assert stalls, stderr
    return job.returncode, stderr, ended - stalls[0]


@requires_mpi
def test_a_stopped_mpi_rank_ends_the_job_with_one_line():
    status, stderr, took = run_job(3, "stop", ["--timeout", "2"])
    assert status != 0
    assert took < 2 + GRACE, stderr
    lines = [line for line in stderr.splitlines() if "no progress" in line]
    # One line for the job, by the lowest waiting rank: every waiting rank's collective and
    # peer, and the rank that sent no word (rank 1 sits in the stop: it never reports).
    assert len(lines) == 1, stderr
    assert lines[0].startswith("syncsgd: error: collective timeout: no progress for 2 s "
                               "(--timeout): rank 0 in ring_allreduce "), stderr  # fmt: skip
    assert ("; rank 2 in ring_allreduce (reduce-scatter step 0) at training step 3, waiting for "
            "rank 1; no report from rank 1; ending the job") in lines[0], stderr  # fmt: skip


@requires_mpi
def test_timeout_zero_lets_an_mpi_job_wait():
    status, stderr, _ = run_job(2, "3", ["--timeout", "0"])
    assert status == 0, stderr
    assert "no progress" not in stderr
