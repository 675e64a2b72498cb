"""Smoke test of benchmarks/layers.py: a row per layer, each with its times, rates and floor.

No timing is asserted (the machines are shared and noisy): only the table's structure.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("exact", [False, True])
def test_layers_names_every_layer_with_its_floor(exact):
    spec = "conv(3, 3, pad=1) relu conv(2, 3) batchnorm relu maxpool(2) flatten dense(5) relu dense"
    command = [sys.executable, str(ROOT / "benchmarks" / "layers.py"), "--model", spec,
               "--input-shape", "2,8,8", "--batch", "6", "--repeats", "1", "--dtype", "float64",
               *(["--exact"] if exact else [])]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# conv(3, 3, pad=1) relu conv(2, 3)") and "GEMM rate" in lines[0]
    rows = {line.split()[1]: line.split() for line in lines[2:12]}
    assert [line.split()[0] for line in lines[2:12]] == [str(p) for p in range(10)]
    assert "(absorbed)" in " ".join(rows["relu"]) and "batchnorm" in rows
    for name in ("conv(3,", "dense(5)"):  # a layer with products: its rates and its floor share
        assert float(rows[name][-4]) > 0 and float(rows[name][-3]) > 0 and rows[name][-1] != "-"
    assert rows["maxpool(2)"][-1] == "-"  # no products: no floor
    assert any(line.startswith("# the most time beyond its floor: ") for line in lines)
    assert any(line.split()[:1] == ["maxpool"] for line in lines)  # the kernels' table
