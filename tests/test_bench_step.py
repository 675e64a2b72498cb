"""Smoke tests of the training-step benchmark: it runs, its files parse, its bare loop is right.

No timing is asserted (the machines are shared and noisy): only the structure of the output and
the arithmetic of the bare loop (the passes called directly, `nn.local.local_gradient`) that the
overhead check compares against.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given
from hypothesis import strategies as st
from oracle import serial_sgd

from syncsgd.apps.bench import step
from syncsgd.training.loop import prepare

TINY = ["--features", "6", "--hidden", "5", "--classes", "3", "--samples", "48",
        "--per-rank-batch", "4", "--global-batch", "10", "--steps", "3", "--repeats", "2",
        "--warmup", "1", "--overhead-batch", "4,7", "--overhead-repeats", "2",
        "--cli-runs", "0"]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    return parser.parse_args(argv)


def test_threads_smoke_run_writes_json_and_csv(tmp_path, capsys):
    json_path, csv_path = tmp_path / "step.json", tmp_path / "step.csv"
    argv = ["--backend", "threads", "--ranks", "1,2,3", *TINY]
    assert step.main(parse([*argv, "--json", str(json_path), "--csv", str(csv_path)])) == 0

    result = json.loads(json_path.read_text())
    assert result["benchmark"] == "step" and result["backend"] == "threads"
    assert result["model"] == "6-5-3"
    assert set(result["load_average"]) == {"start", "end"}
    assert set(result["first_step"]) >= {
        "import_s",
        "first_step_s",
        "first_call_s",
        "source",
        "blas_threads",
    }
    assert result["first_step"]["source"] in {"JIT compile", "Numba cache load", "already loaded"}
    rows = result["scaling"]
    assert [(r["scaling"], r["ranks"]) for r in rows] == [
        (scaling, ranks) for scaling in ("weak", "strong") for ranks in (1, 2, 3)
    ]
    for row in rows:
        expected_batch = 4 * row["ranks"] if row["scaling"] == "weak" else 10
        assert row["global_batch"] == expected_batch
        assert row["shard"] == len(np.array_split(np.arange(expected_batch), row["ranks"])[0])
        for part in step.PARTS:
            assert np.isfinite(row[f"{part}_ms"]) and row[f"{part}_ms"] >= 0
        assert row["step_min_ms"] <= row["step_ms"] <= row["step_max_ms"]
        assert row["samples_per_s"] == pytest.approx(expected_batch / (row["step_ms"] / 1e3))
        assert (row["steps"], row["repeats"]) == (3, 2)
    for scaling in ("weak", "strong"):
        single = next(r for r in rows if r["scaling"] == scaling and r["ranks"] == 1)
        assert single["speedup"] == single["efficiency"] == 1.0

    overhead = result["overhead"]
    assert [row["batch"] for row in overhead] == [4, 7]
    for row in overhead:
        assert row["bitwise_equal"] is True
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["within_bar"] == (row["ratio"] <= 1.05)
        assert [piece["piece"] for piece in row["pieces"]] == [
            "batch indices", "allreduce (P=1)", "mean, finite check", "update"
        ]  # fmt: skip
    assert result["cli"] == []

    with open(csv_path, newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["scaling"], int(r["ranks"])) for r in table] == [
        (r["scaling"], r["ranks"]) for r in rows
    ]
    printed = capsys.readouterr().out
    assert step.SCALING_HEADER in printed and "overhead at P = 1" in printed


@given(
    batch=st.integers(1, 12),
    steps=st.integers(1, 7),
    hidden=st.lists(st.integers(1, 6), max_size=2),
    dtype=st.sampled_from(["float64", "float32"]),
)
def test_bare_loop_is_serial_sgd(batch, steps, hidden, dtype):
    options = parse(["--features", "5", "--classes", "3", "--samples", "24", "--steps",
                     str(steps), "--hidden", ",".join(map(str, hidden)), "--dtype", dtype,
                     "--lr", "0.3"])  # fmt: skip
    problem = prepare(step.train_config(options, batch))
    params, seconds = step.bare_loop(problem)
    model = problem.model
    expected, _ = serial_sgd(
        problem.X, problem.y, model.to_arrays(model.init_params(0)), steps=steps,
        batch_size=batch, lr=0.3, dtype=np.dtype(dtype),
    )  # fmt: skip
    tolerance = 1e-9 if dtype == "float64" else 1e-4
    for name, value in model.to_arrays(params).items():
        np.testing.assert_allclose(value, expected[name], rtol=tolerance, atol=tolerance)
    assert len(seconds) == len(step.PARTS) and seconds[1] == 0.0


def test_step_kernels_are_the_passes_numba_kernels():
    from syncsgd.nn.layers import relu, xent
    from syncsgd.nn.numerics import first_affine_sums_, float_affine_

    kernels = step.step_kernels()
    for kernel in (float_affine_, first_affine_sums_, relu.relu_, relu.relu_backward_,
                   xent.xent_losses_):  # fmt: skip
        assert any(found is kernel for found in kernels)
    hits, misses = step.cache_counts(kernels)
    assert hits >= 0 and misses >= 0


def test_too_few_samples_is_one_clear_error():
    options = parse(["--backend", "threads", *TINY, "--samples", "11", "--no-overhead"])
    with pytest.raises(ValueError, match=r"--samples 11 is smaller than the largest global batch"):
        step.main(options)


@pytest.mark.parametrize(
    "argv", [["--ranks", "0"], ["--ranks", "1,x"], ["--scaling", "sideways"], ["--steps", "0"]]
)
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "argument" in capsys.readouterr().err


def test_time_command_times_and_names_a_failure():
    assert len(step.time_command([sys.executable, "-c", "pass"], 2)) == 2
    with pytest.raises(RuntimeError, match="exited with 3: boom"):
        step.time_command(
            [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], 1
        )


@requires_mpi
def test_mpiexec_smoke_run(tmp_path):
    json_path = tmp_path / "step.json"
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "step.py"  # the thin script
    args = [str(script), *TINY, "--json", str(json_path)]
    done = run_mpiexec(2, args, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(json_path.read_text())
    assert result["backend"] == "mpi"
    assert [(r["scaling"], r["ranks"], r["global_batch"]) for r in result["scaling"]] == [
        ("weak", 2, 8), ("strong", 2, 10)
    ]  # fmt: skip
    assert result["overhead"] == [] and "overhead check skipped" in done.stdout
    assert done.stdout.count("# training step:") == 1  # rank 0 alone prints


def test_a_conv_model_spec_is_timed(tmp_path, capsys):
    json_path = tmp_path / "step.json"
    argv = ["--backend", "threads", "--ranks", "1,2", "--model", "conv(2, 3) relu maxpool(2) "
            "flatten dense", "--input-shape", "1,6,6", "--features", "36", "--classes", "3",
            "--samples", "48", "--scaling", "strong", "--global-batch", "8", "--steps", "2",
            "--repeats", "1", "--warmup", "1", "--overhead-batch", "4", "--overhead-repeats", "2",
            "--cli-runs", "0", "--json", str(json_path)]  # fmt: skip
    assert step.main(parse(argv)) == 0
    result = json.loads(json_path.read_text())
    assert result["model"] == "conv(2, 3) relu maxpool(2) flatten dense"
    assert [row["ranks"] for row in result["scaling"]] == [1, 2]
    assert result["overhead"][0]["bitwise_equal"] is True  # the bare loop runs the conv too
    assert "# training step: conv(2, 3) relu maxpool(2) flatten dense on 1,6,6" in (
        capsys.readouterr().out)


def test_a_model_that_does_not_fit_its_input_fails_first():
    argv = ["--backend", "threads", *TINY, "--model", "conv(2, 3) flatten dense",
            "--input-shape", "1,2,3"]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("a 3x3 window does not fit an input of 2x3")):
        step.main(parse(argv))


def test_a_transformer_step_is_timed_on_token_data(tmp_path, capsys):
    json_path = tmp_path / "step.json"
    argv = ["--backend", "threads", "--ranks", "1,2", "--model", "gpt(layers=1,d=4,heads=2)",
            "--data", "numbers-to-words", "--context", "3", "--samples", "16", "--scaling",
            "strong", "--global-batch", "4", "--steps", "2", "--repeats", "1", "--warmup", "1",
            "--overhead-batch", "3", "--overhead-repeats", "2", "--cli-runs", "0",
            "--json", str(json_path)]  # fmt: skip
    assert step.main(parse(argv)) == 0
    result = json.loads(json_path.read_text())
    assert (result["data"], result["context"]) == ("numbers-to-words", 3)
    assert [row["ranks"] for row in result["scaling"]] == [1, 2]
    assert result["overhead"][0]["bitwise_equal"] is True  # the bare loop divides by B x T too
    assert "gpt(layers=1,d=4,heads=2) on 3 tokens" in capsys.readouterr().out


def test_a_text_too_short_for_the_batch_is_one_clear_error(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("abcdefghij")  # (10 - 1) // 3 = 3 windows
    untaken = {"--features", "--hidden", "--classes"}  # not of token data
    tiny = [arg for index, arg in enumerate(TINY)
            if arg not in untaken and (index == 0 or TINY[index - 1] not in untaken)]
    argv = ["--backend", "threads", *tiny, "--model", "gpt(layers=1,d=4,heads=2)", "--data",
            str(text), "--context", "3"]  # fmt: skip
    with pytest.raises(ValueError, match="holds 3 windows of --context 3"):
        step.main(parse(argv))


def test_a_gpt_without_token_data_is_one_line_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "bench", "step", "--model",
                           "gpt(layers=1,d=4,heads=2)", "--ranks", "1"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "syncsgd: error: --model 'gpt(layers=1,d=4,heads=2)' starts with embed, which reads "
        "token ids: give token data (--data PATH.txt or numbers-to-words)"
    ]
