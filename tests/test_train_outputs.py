"""`syncsgd train --json`, `--steps 0 --save`, strict JSON outputs, evaluations in the log."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec

from syncsgd import TrainConfig, TrainResult, train
from syncsgd.apps.verify import sha256 as verify_sha256
from syncsgd.cli import main
from syncsgd.nn.mlp import mlp
from syncsgd.util import jsonout

TINY = ["--samples", "64", "--features", "4", "--hidden", "8", "--batch-size", "16"]
TINY_CONFIG = TrainConfig(samples=64, features=4, hidden=(8,), batch_size=16, steps=3)
TINY_MODEL = mlp((4, 8, 4))  # 4 features, a hidden layer of 8, 4 classes (the default)
REGRESSION = ["--loss", "mse", "--data", "synthetic-regression"]


def _refuse(token: str) -> float:
    raise ValueError(f"not strict JSON: {token}")


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity."""
    return json.loads(text, parse_constant=_refuse)


def load_arrays(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def run_cli(capsys, *args: str) -> str:
    """`syncsgd train TINY ARGS` in this process: exit 0, and its stdout."""
    code = main(["train", *TINY, *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_json_holds_every_scalar_of_the_result_and_the_runs_lists(tmp_path, capsys):
    path = tmp_path / "run.json"
    run_cli(capsys, "--steps", "3", "--ranks", "3", "--holdout", "0.25", "--eval-every", "2",
            "--json", str(path), "--quiet")  # fmt: skip
    document = strict_loads(path.read_text())
    scalars = [item.name for item in dataclasses.fields(TrainResult)
               if str(item.type) in ("int", "float", "float | None", "int | None")]  # fmt: skip
    assert {"steps", "seconds", "steady_seconds", "final_loss", "accuracy", "stopped_after",
            "steps_to_target", "noise_scale", "first_step_seconds",
            "batchnorm_comm_seconds"} <= set(scalars)  # fmt: skip
    for name in (*scalars, "ranks", "backend", "losses", "evals", "skipped_steps",
                 "params_sha256"):  # fmt: skip
        assert name in document, name
    assert document["ranks"] == 3 and document["backend"] == "threads"
    assert document["steps"] == 3 and len(document["losses"]) == 3
    assert [row["step"] for row in document["evals"]] == [2, 3]  # every 2 steps and at the end
    assert set(document["evals"][0]) == {"step", "loss", "accuracy"}
    assert 0 <= document["accuracy"] <= 1 and document["skipped_steps"] == []
    assert "loss_scales" not in document  # kept with loss scaling only
    assert document["null_because"]["noise_scale"] == "no --noise-scale"


def test_json_sha256_is_that_of_the_saved_parameters_and_verifys(tmp_path):
    saved, path = tmp_path / "p.npz", tmp_path / "run.json"
    result = train(TINY_CONFIG, ranks=2, save=str(saved), json=str(path))
    flat = result.model.from_arrays(load_arrays(saved))
    document = strict_loads(path.read_text())
    assert document["params_sha256"] == hashlib.sha256(flat.tobytes()).hexdigest()
    assert document["params_sha256"] == verify_sha256(result.params)
    assert document["final_loss"] == result.final_loss


def test_digest_prints_the_sha256_that_json_and_verify_give(tmp_path, capsys):
    path = tmp_path / "run.json"
    out = run_cli(capsys, "--steps", "2", "--ranks", "2", "--digest", "--quiet", "--json",
                  str(path))  # fmt: skip
    [line] = out.splitlines()  # --quiet: the digest alone
    assert line == f"parameters' SHA-256: {strict_loads(path.read_text())['params_sha256']}"
    assert "SHA-256" not in run_cli(capsys, "--steps", "1", "--ranks", "2")  # only when asked


def test_mse_writes_null_accuracy_with_the_reason_and_a_strict_log(tmp_path, capsys):
    path, log = tmp_path / "run.json", tmp_path / "log.jsonl"
    run_cli(capsys, *REGRESSION, "--steps", "3", "--holdout", "0.25", "--eval-every", "1",
            "--json", str(path), "--log", str(log), "--quiet")  # fmt: skip
    document = strict_loads(path.read_text())
    assert document["accuracy"] is None
    assert document["null_because"]["accuracy"] == "no accuracy with --loss mse"
    assert all(row["accuracy"] is None for row in document["evals"])
    lines = [strict_loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3 and all(line["eval_accuracy"] is None for line in lines)
    assert all(isinstance(line["eval_loss"], float) for line in lines)


def test_skipped_steps_log_null_not_nan(tmp_path, capsys):
    # The first update with a huge learning rate sends the loss to inf: later steps are skipped.
    path, log = tmp_path / "run.json", tmp_path / "log.jsonl"
    run_cli(capsys, "--steps", "3", "--lr", "1e300", "--skip-nonfinite", "--json", str(path),
            "--log", str(log), "--quiet")  # fmt: skip
    text = log.read_text()
    assert "NaN" not in text and "Infinity" not in text
    lines = [strict_loads(line) for line in text.splitlines()]
    assert lines[-1]["loss"] is None and lines[-1]["grad_norm"] is None and lines[-1]["skipped"]
    document = strict_loads(path.read_text())
    assert document["skipped_steps"] == [1, 2]
    assert document["final_loss"] is None and document["null_because"]["final_loss"] == (
        "not finite")  # fmt: skip


def test_strict_replaces_every_non_finite_number():
    value = {"a": [1.0, float("nan"), (np.float32("inf"), -np.inf)], "b": np.array([np.nan, 2])}
    assert jsonout.strict(value) == {"a": [1.0, None, [None, None]], "b": [None, 2.0]}
    assert jsonout.dumps({"x": np.int64(3), "y": np.float64(-np.inf)}) == '{"x": 3, "y": null}'


def test_log_carries_the_evaluation_of_its_step_and_a_target_still_stops(tmp_path, capsys):
    log, path = tmp_path / "log.jsonl", tmp_path / "run.json"
    run_cli(capsys, "--steps", "4", "--holdout", "0.25", "--eval-every", "2", "--log", str(log),
            "--quiet")  # fmt: skip
    lines = [strict_loads(line) for line in log.read_text().splitlines()]
    assert ["eval_loss" in line for line in lines] == [False, True, False, True]
    assert 0 <= lines[1]["eval_accuracy"] <= 1
    run_cli(capsys, "--steps", "6", "--holdout", "0.25", "--eval-every", "2", "--target-loss",
            "1e9", "--log", str(log), "--json", str(path), "--quiet")  # fmt: skip
    lines = [strict_loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 and "eval_loss" in lines[-1]  # stopped at the first evaluation
    document = strict_loads(path.read_text())
    assert document["steps"] == 2 and document["steps_to_target"] == 2


def test_steps_0_saves_the_seeded_initial_parameters(tmp_path, capsys):
    saved, path = tmp_path / "init.npz", tmp_path / "run.json"
    out = run_cli(capsys, "--steps", "0", "--seed", "3", "--save", str(saved), "--json", str(path))
    read, line = out.splitlines()  # what was read, then the summary
    assert read == "data synthetic-classification: 64 samples of 4 features, 4 classes, loss xent"
    assert line.startswith("trained 0 steps on 2 ranks (threads)")
    assert f"wrote the initial parameters to {saved}" in out and "nan" not in out
    expected = TINY_MODEL.init_params(3)
    assert TINY_MODEL.from_arrays(load_arrays(saved)).tobytes() == expected.tobytes()
    document = strict_loads(path.read_text())
    assert document["steps"] == 0 and document["losses"] == [] and document["evals"] == []
    assert document["first_step_seconds"] is None
    assert document["params_sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()
    result = train(TINY_CONFIG, steps=0, seed=3)  # the loss of the initial parameters
    assert document["final_loss"] == result.final_loss and document["accuracy"] == result.accuracy


def test_steps_0_with_init_gives_back_the_init_files_arrays(tmp_path):
    start, saved = tmp_path / "start.npz", tmp_path / "again.npz"
    rng = np.random.default_rng(7)
    arrays = {name: rng.normal(size=shape) for name, shape, _ in TINY_MODEL.layout()}
    np.savez(start, **arrays)
    result = train(TINY_CONFIG, ranks=3, steps=0, init=str(start), save=str(saved))
    assert result.steps == 0 and result.losses == []
    got = load_arrays(saved)
    assert sorted(got) == sorted(arrays)
    for name, value in arrays.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_steps_0_does_not_resume_a_checkpoint_beyond_it(tmp_path, capsys):
    train(TINY_CONFIG, checkpoint=str(tmp_path / "ckpt"))
    code = main(["train", *TINY, "--steps", "0", "--resume", str(tmp_path / "ckpt"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "is at step 3, beyond --steps 0" in err


@pytest.mark.parametrize("other", ["--save", "--log", "--data", "--init"])
def test_json_over_another_output_or_an_input_is_refused(tmp_path, capsys, other):
    target = tmp_path / "taken.npz"
    rng = np.random.default_rng(0)
    if other == "--data":
        np.savez(target, X=rng.normal(size=(64, 4)), y=rng.integers(0, 4, 64))
    else:
        np.savez(target, **TINY_MODEL.to_arrays(TINY_MODEL.init_params(0)))
    before, stamp = target.read_bytes(), os.stat(target).st_mtime_ns
    code = main(["train", *TINY, "--steps", "1", other, str(target), "--json", str(target)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "is the same file as" in err and f"--json {target}" in err and f"{other} {target}" in err
    assert target.read_bytes() == before and os.stat(target).st_mtime_ns == stamp
    assert sorted(os.listdir(tmp_path)) == ["taken.npz"]


@requires_mpi
def test_mpiexec_steps_0_writes_the_initial_parameters_and_the_json(tmp_path):
    saved, path = tmp_path / "init.npz", tmp_path / "run.json"
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "train", *TINY, "--steps", "0", "--save",
                           str(saved), "--json", str(path)], timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("trained 0 steps on 2 ranks (MPI)") == 1  # rank 0 alone prints
    expected = TINY_MODEL.init_params(0)
    assert TINY_MODEL.from_arrays(load_arrays(saved)).tobytes() == expected.tobytes()
    document = strict_loads(path.read_text())
    assert document["ranks"] == 2 and document["backend"] == "mpi" and document["steps"] == 0
    assert document["params_sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()
