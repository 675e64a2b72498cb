"""No hangs, no half-written files, clear errors: signals, non-finite steps, mismatched ranks, a
rank that dies, fuzzed data files; start-up errors on some MPI ranks only; outputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import mpiexec_command, mpiexec_flavour, mpiexec_path, requires_mpi
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import TrainConfig, train
from syncsgd.training.data import load_data

LONG = ["--samples", "512", "--features", "8", "--hidden", "16", "--batch-size", "32",
        "--steps", "1000000", "--quiet"]  # fmt: skip


def start(args: list[str], mpi_ranks: int | None = None) -> subprocess.Popen:
    """Start syncsgd in its own process group (so a test can signal the whole job)."""
    command = [sys.executable, "-m", "syncsgd.cli", *args]
    if mpi_ranks is not None:
        command = [*mpiexec_command(mpi_ranks), *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def wait_for(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_all_ranks_after_a_step_with_a_checkpoint(tmp_path, signum):
    ckpt = tmp_path / "ckpt"
    job = start(["train", "--ranks", "3", *LONG, "--checkpoint", str(ckpt),
                 "--checkpoint-every", "20", "--save", str(tmp_path / "p.npz")])  # fmt: skip
    wait_for(str(ckpt / "ckpt-00000020.npz"))
    job.send_signal(signum)
    try:
        _, stderr = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the run did not stop within 30 s of the signal")
    assert job.returncode == 130
    assert "interrupted after step" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "p.npz").exists()  # no final parameters from an unfinished run
    steps = sorted(int(name[5:13]) for name in os.listdir(ckpt))
    last = int(stderr.split("interrupted after step ")[1].split(";")[0])
    assert steps[-1] == last  # a checkpoint of the very step it stopped after
    assert not [name for name in os.listdir(ckpt) if name.startswith(".tmp")]


# Each micro-batch takes 50 ms more: a step of 500 micro-batches per rank takes 25 s.
SLOW_MICRO_BATCHES = """
import sys, time
from syncsgd.nn.numerics import Float
original = Float.begin_micro_batch_
def begin_micro_batch_(self, index, scale):
    if not getattr(sys, "announced", False):
        sys.announced = True
        print("in a step", file=sys.stderr, flush=True)
    time.sleep(0.05)
    return original(self, index, scale)
Float.begin_micro_batch_ = begin_micro_batch_
from syncsgd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def stops_mid_step(tmp_path, launcher: list[str]) -> None:
    """SIGTERM to a run in a 25 s step ends it 1 s later, without finishing the step."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_MICRO_BATCHES)
    command = [*launcher, sys.executable, str(script), "train", "--samples", "1000", "--features",
               "4", "--batch-size", "1000", "--accumulate", "500", "--steps", "3", "--quiet"]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stderr.readline() == "in a step\n"
        job.send_signal(signal.SIGTERM)  # under mpiexec: to the launcher, which forwards it
        signalled = time.monotonic()
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert time.monotonic() - signalled < 10, err
    assert job.returncode != 0 and "syncsgd: interrupted\n" in err and "Traceback" not in err, err
    assert "stopping after this step, or in 1 s if it is not over by then" in err


def test_a_signal_mid_step_ends_the_run_between_micro_batches(tmp_path):
    stops_mid_step(tmp_path, [])


@requires_mpi
def test_a_signal_mid_step_ends_an_mpi_job_between_micro_batches(tmp_path):
    if mpiexec_flavour(str(mpiexec_path()))[0] == "Open MPI":
        pytest.skip("Open MPI's launcher ends its ranks itself on SIGTERM: they print nothing")
    stops_mid_step(tmp_path, mpiexec_command(2))


def test_non_finite_training_stops_with_the_step_or_skips_it():
    config = TrainConfig(samples=200, features=4, hidden=(8,), batch_size=20, steps=30,
                         lr=1e6, loss="mse", data="synthetic-regression")  # fmt: skip
    with pytest.raises(ValueError, match=r"non-finite loss or gradient at step \d+"):
        train(config, ranks=3)
    result = train(config, ranks=3, skip_nonfinite=True)
    assert result.skipped_steps and len(result.losses) == 30
    serial = train(config, ranks=1, skip_nonfinite=True, exact=True)
    assert train(config, ranks=4, skip_nonfinite=True, exact=True).skipped_steps == (
        serial.skipped_steps
    )


@requires_mpi
@pytest.mark.parametrize(
    "option, first, second",
    [("--lr", "0.1", "0.2"),  # mpi_once: the same comparison of the settings, another option
     pytest.param("--algorithm", "ring", "auto", marks=pytest.mark.mpi_once),
     pytest.param("--bucket-bytes", "0", "4096", marks=pytest.mark.mpi_once)],
)  # fmt: skip
def test_ranks_started_with_different_options_all_stop_with_one_message(option, first, second):
    common = ["-m", "syncsgd.cli", "train", "--samples", "600", "--steps", "5"]
    command = [*mpiexec_command(1), sys.executable, *common, option, first, ":",
               "-n", "1", sys.executable, *common, option, second]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"different options: {option} {first} on rank 0, {second} on rank 1" in done.stderr
    assert "Traceback" not in done.stderr


def rank_processes(marker: str) -> list[int]:
    """Python processes whose command line holds `marker` (the ranks, not the launcher)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv and b"syncsgd.cli" in argv and b"mpiexec" not in argv[0]:
            found.append(int(entry))
    return found


@requires_mpi
def test_a_rank_that_dies_ends_the_whole_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = start(["train", *LONG, "--checkpoint", str(ckpt), "--checkpoint-every", "10"],
                mpi_ranks=2)  # fmt: skip
    try:
        wait_for(str(ckpt / "ckpt-00000010.npz"), timeout=90)
        victims = [pid for pid in rank_processes(str(ckpt)) if pid != job.pid]
        assert victims, "no rank processes found"
        os.kill(victims[-1], signal.SIGKILL)
        job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("the job did not end within 60 s of a rank's death")
    assert job.returncode != 0


@given(content=st.binary(max_size=300))
def test_random_bytes_as_data_files_are_clean_errors(tmp_path_factory, content):
    directory = tmp_path_factory.mktemp("fuzz")
    for name in ("data.npz", "data.csv"):
        path = directory / name
        path.write_bytes(content)
        try:
            X, y = load_data(str(path))
        except ValueError as exc:
            assert str(exc) and "\n" not in str(exc)
        else:  # bytes that happen to be a valid CSV must give a valid data set
            assert X.ndim == 2 and len(X) == len(y) and np.isfinite(X).all()


@given(
    rows=st.integers(0, 6),
    columns=st.integers(0, 4),
    y_shape=st.sampled_from(["match", "short", "2d", "scalar"]),
    dtype=st.sampled_from(["float64", "int64", "bool", "complex128", "U3"]),
    nan=st.booleans(),
)
def test_npz_files_of_any_shape_load_or_fail_cleanly(tmp_path_factory, rows, columns, y_shape,
                                                     dtype, nan):  # fmt: skip
    X = np.ones((rows, columns)).astype(dtype)
    if nan and dtype == "float64" and X.size:
        X.flat[0] = np.nan
    y = {"match": np.zeros(rows, np.int64), "short": np.zeros(max(rows - 1, 0), np.int64),
         "2d": np.zeros((rows, 2)), "scalar": np.array(3)}[y_shape]  # fmt: skip
    path = tmp_path_factory.mktemp("npz") / "data.npz"
    np.savez(path, X=X, y=y)
    try:
        X_loaded, y_loaded = load_data(str(path), loss="xent")
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert X_loaded.shape == (rows, columns) and len(y_loaded) == rows
        assert np.isfinite(X_loaded).all()


# -- start-up errors under a real mpiexec: some ranks fail, the job ends with one line ----------

CLI = [sys.executable, "-m", "syncsgd.cli"]
QUICK = ["--samples", "200", "--features", "4", "--hidden", "4", "--batch-size", "20", "--steps",
         "3", "--quiet"]  # fmt: skip


def mpmd(first: list[str], second: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """`mpiexec -n 1 syncsgd FIRST : -n 1 syncsgd SECOND`; a job that outlives `timeout` fails."""
    command = [*mpiexec_command(1), *CLI, *first, ":", "-n", "1", *CLI, *second]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # a hung rank ignores SIGTERM
        job.communicate()
        pytest.fail(f"{' '.join(command)} did not end within {timeout} s")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line]


@requires_mpi
@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize(
    "option, expected",
    [(["--data", "missing.csv"], "data file missing.csv does not exist"),
     # mpi_once: which path a rank finds missing is its own; the agreement is the same
     pytest.param(["--init", "missing.npz"], "file missing.npz does not exist",
                  marks=pytest.mark.mpi_once),
     pytest.param(["--resume", "missing-dir"], "--resume missing-dir: no such directory",
                  marks=pytest.mark.mpi_once)],
)  # fmt: skip
def test_a_start_up_error_on_one_rank_ends_the_job_with_one_line(tmp_path, failing, option,
                                                                 expected):  # fmt: skip
    ranks = [["train", *QUICK], ["train", *QUICK, *option]]
    if failing == 0:
        ranks.reverse()
    done = mpmd(*ranks)
    assert done.returncode != 0
    [line] = error_lines(done.stderr)
    assert line.startswith(f"syncsgd: error: rank {failing}: {expected}"), done.stderr
    assert "Traceback" not in done.stderr


@requires_mpi
def test_a_parse_error_on_one_rank_ends_the_job_and_one_on_all_is_printed_once():
    done = mpmd(["train", *QUICK], ["train", "--lr", "abc"])
    assert done.returncode != 0
    assert error_lines(done.stderr) == [
        "syncsgd: error: rank 1: argument --lr: not a number: 'abc' (see --help)"
    ], done.stderr
    done = mpmd(["train", "--lr", "abc"], ["train", "--lr", "abc"])
    assert done.returncode == 2
    assert done.stderr.count("not a number: 'abc'") == 1, done.stderr
    done = mpmd(["train", "--data", "missing.csv"], ["train", "--data", "missing.csv"])
    assert error_lines(done.stderr) == ["syncsgd: error: data file missing.csv does not exist"]


@requires_mpi
def test_commands_on_thread_ranks_print_once_per_job():
    alone = subprocess.run([*CLI, "ring-demo", "--ranks", "3", "--length", "6"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    done = mpmd(["ring-demo", "--ranks", "3", "--length", "6"],
                ["ring-demo", "--ranks", "3", "--length", "6"], timeout=60)  # fmt: skip
    assert done.returncode == 0 and alone.returncode == 0
    assert done.stdout == alone.stdout and "\x1b[" not in done.stdout
    done = mpmd(["--version"], ["--version"])
    assert done.returncode == 0 and done.stdout.count("syncsgd ") == 1, done.stdout


def test_a_double_interrupt_leaves_no_temporary_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = start(["train", "--ranks", "2", *LONG, "--checkpoint", str(ckpt), "--checkpoint-every",
                 "20", "--log", str(tmp_path / "log.jsonl"), "--save", str(tmp_path / "p.npz")])
    wait_for(str(ckpt / "ckpt-00000020.npz"))
    job.send_signal(signal.SIGINT)
    job.send_signal(signal.SIGINT)  # the second: stop at once
    try:
        _, stderr = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the run did not stop within 30 s of two interrupts")
    assert job.returncode == 130 and "Traceback" not in stderr, stderr
    assert [name for name in os.listdir(tmp_path) if name.startswith(".tmp")] == []
    assert [name for name in os.listdir(ckpt) if name.startswith(".tmp")] == []
    assert not (tmp_path / "p.npz").exists()
