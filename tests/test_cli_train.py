"""`syncsgd train` from the command line: outputs, --init, bad input, and real mpiexec runs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import requires_mpi, run_in_process, run_mpiexec
from oracle import serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.mlp import mlp

SMALL = ["--samples", "120", "--features", "6", "--hidden", "5", "--batch-size", "20",
         "--steps", "6", "--momentum", "0.9"]  # fmt: skip
SMALL_CONFIG = TrainConfig(samples=120, features=6, hidden=(5,), batch_size=20, steps=6,
                           momentum=0.9)  # fmt: skip


def syncsgd_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the console script's entry point in a fresh Python process."""
    command = [sys.executable, "-m", "syncsgd.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def load(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def test_train_saves_logs_and_prints_one_summary(tmp_path):
    saved, log = tmp_path / "params.npz", tmp_path / "log.jsonl"
    done = syncsgd_cli("train", "--ranks", "3", *SMALL, "--save", str(saved), "--log", str(log))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("trained 6 steps on 3 ranks") == 1  # rank 0 alone prints
    assert "accuracy" in done.stdout

    params = load(saved)
    assert sorted(params) == ["W0", "W1", "b0", "b1"]
    assert params["W0"].shape == (6, 5) and params["b1"].shape == (4,)
    expected = train(SMALL_CONFIG, ranks=3).arrays()
    for name, value in expected.items():
        assert params[name].tobytes() == value.tobytes()

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    assert set(records[0]) == {"step", "epoch", "loss", "lr", "grad_norm", "seconds",
                               "comm_seconds"}  # fmt: skip
    assert [r["epoch"] for r in records] == [0] * 6  # 120 // 20 = 6 steps per epoch
    assert all(r["lr"] == 0.1 and r["grad_norm"] > 0 for r in records)


def test_quiet_prints_nothing(tmp_path):
    done = syncsgd_cli("train", "--ranks", "2", *SMALL, "--quiet")
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_init_starts_from_the_given_parameters(tmp_path):
    model = mlp((6, 5, 4))
    seeded = tmp_path / "seeded.npz"
    np.savez(seeded, **model.to_arrays(model.init_params(0)))
    # The file holds exactly the seeded draw: the run is bitwise the seeded run.
    from_file = train(SMALL_CONFIG, ranks=2, init=str(seeded))
    assert from_file.params.tobytes() == train(SMALL_CONFIG, ranks=2).params.tobytes()

    other = tmp_path / "other.npz"
    start = model.to_arrays(model.init_params(123))
    np.savez(other, **start)
    saved = tmp_path / "out.npz"
    done = syncsgd_cli("train", "--ranks", "2", *SMALL, "--init", str(other), "--save", str(saved))
    assert done.returncode == 0, done.stderr
    problem_X, problem_y = _small_data()
    expected, _ = serial_sgd(problem_X, problem_y, start, steps=6, batch_size=20, lr=0.1,
                             momentum=0.9)  # fmt: skip
    got = load(saved)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12)


def _small_data():
    from syncsgd.training.loop import prepare

    problem = prepare(SMALL_CONFIG)
    return problem.X, problem.y


def _write_csv(path, text):
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--steps", "-1"], "--steps"),
    (["--ranks", "0"], "--ranks"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--hidden", "64,x"], "hidden"),
    (["--hidden", "0"], "hidden"),
    (["--activation", "sigmoid"], "--activation"),
    (["--loss", "hinge"], "--loss"),
    (["--dtype", "float16"], "--dtype"),
    (["--data", "imagenet"], "--data"),
    (["--data", "{tmp}/missing.npz"], "missing.npz"),
    (["--data", "{tmp}/nan.csv"], "nan.csv"),
    (["--samples", "50", "--batch-size", "51"], "batch"),
    (["--momentum", "1.5"], "--momentum"),
    (["--nesterov"], "--nesterov needs --momentum > 0"),
    (["--schedule", "noam"], "warmup"),
    (["--init", "{tmp}/missing-init.npz"], "missing-init.npz"),
    (["--init", "{tmp}/wrong.npz"], "W0"),
    (["--save", "{tmp}/no/such/dir/p.npz"], "does not exist"),
    (["--loss", "xent", "--data", "synthetic-regression"], "regression"),
    (["--steps", "5", "--epochs", "2"], "--epochs"),
]


# Run in a fresh Python: an option argparse refuses, a data file the run refuses, an output path
# refused before any work; the others by the console script's main in this process.
BAD_INPUTS_IN_FRESH_PROCESSES = (["--batch-size", "0"], ["--data", "{tmp}/nan.csv"],
                                 ["--save", "{tmp}/no/such/dir/p.npz"])  # fmt: skip


@pytest.mark.parametrize(("args", "needle"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_on_stderr(tmp_path, args, needle):
    _write_csv(tmp_path / "nan.csv", "1,2,0\nnan,3,1\n4,5,0\n")
    np.savez(tmp_path / "wrong.npz", W0=np.zeros((3, 3)), b0=np.zeros(3))
    fresh = args in BAD_INPUTS_IN_FRESH_PROCESSES
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    arguments = ["train", "--steps", "2", "--samples", "300", *args, "--quiet"]
    done = syncsgd_cli(*arguments, timeout=60) if fresh else run_in_process(arguments, tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and needle in lines[0]
    assert not (tmp_path / "no").exists()


def test_a_momentum_out_of_range_is_one_line_naming_its_flag():
    done = syncsgd_cli("train", "--momentum", "2", "--quiet", timeout=60)
    assert done.returncode in (1, 2), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--momentum" in lines[0] and "[0, 1)" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["--hidden", "64,x"], 2),  # a value argparse cannot read: usage error
        (["--holdout", "1"], 2),
        (["--steps", "5", "--epochs", "2"], 1),  # values that do not go together: the config's
        (["--pitfall", "local-clip"], 1),
    ],
)
def test_a_bad_value_exits_2_and_a_bad_combination_1(args, status):
    done = syncsgd_cli("train", *args, "--quiet", timeout=60)
    assert done.returncode == status, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_debug_after_the_subcommand_shows_the_traceback():
    done = syncsgd_cli("train", "--debug", "--steps", "5", "--epochs", "2", timeout=60)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "give --steps or --epochs, not both" in done.stderr


# -- the same training under a real mpiexec ------------------------------------------------------


# P = 2 under mpiexec: exact mode's (tests/test_reproducibility.py), the same ring at P = 2.
@requires_mpi
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.mpi_once), 3,
                                   pytest.param(4, marks=pytest.mark.mpi_once)])  # fmt: skip
def test_mpiexec_training_equals_threads_and_oracle(tmp_path, ranks):
    """MPI ranks and thread ranks run the same ring in the same order: bitwise the same result."""
    saved = tmp_path / "mpi.npz"
    done = run_mpiexec(ranks, ["-m", "syncsgd.cli", "train", *SMALL, "--save", str(saved)],
                       timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"on {ranks} rank") == 1 and "(MPI)" in done.stdout
    got = load(saved)
    threads = train(SMALL_CONFIG, ranks=ranks).arrays()
    for name, value in threads.items():
        assert got[name].tobytes() == value.tobytes()
    X, y = _small_data()
    model = mlp((6, 5, 4))
    expected, _ = serial_sgd(X, y, model.to_arrays(model.init_params(0)), steps=6,
                             batch_size=20, lr=0.1, momentum=0.9)  # fmt: skip
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12)


@requires_mpi
def test_mpiexec_rejects_a_disagreeing_ranks_option():
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "train", "--ranks", "3", *SMALL], timeout=120)
    assert done.returncode != 0
    assert "--ranks 3 disagrees with the MPI world size 2" in done.stderr
    assert "Traceback" not in done.stderr
