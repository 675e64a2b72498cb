"""Smoke test of benchmarks/exact.py on a token model: exact mode checked against float mode, then
every mode timed, then whole steps. No timing is asserted, only the table's structure."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_exact_times_a_token_model_against_float():
    command = [sys.executable, str(ROOT / "benchmarks" / "exact.py"), "--model",
               "gpt(layers=1,d=16,heads=2)", "--context", "8", "--batch", "4",
               "--global-batch", "4", "--dtypes", "float32", "--batches", "1", "--iters", "1",
               "--warmup", "0", "--steps", "1", "--step-ranks", "1"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpt(layers=1,d=16,heads=2) on windows of 8 characters")
    modes = [line.split()[1] for line in lines[2:6]]
    assert modes == ["float", "exact", "passes", "extract"] and lines[2].split()[-1] == "1.00"
    steps = [line.split() for line in lines if line.split()[:1] == ["float32"]][-2:]
    assert [row[1] for row in steps] == ["float", "exact"] and float(steps[1][2]) > 0


def test_exact_refuses_a_context_without_a_token_model():
    command = [sys.executable, str(ROOT / "benchmarks" / "exact.py"), "--context", "8"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stderr.startswith("error: --context") and not done.stdout
