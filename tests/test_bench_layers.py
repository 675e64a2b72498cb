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


def test_layers_takes_a_token_model_apart_by_piece():
    command = [sys.executable, str(ROOT / "benchmarks" / "layers.py"), "--model",
               "gpt(layers=1,d=16,heads=2)", "--context", "8", "--batch", "4",
               "--repeats", "1"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# embed(16) block(16, 2) layernorm dense(") and " on 8," in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:16]}
    pieces = ["1.ln1", "1.in_proj", "1.attention", "1.out_proj", "1.ln2", "1.fc1", "1.gelu",
              "1.fc2", "1.rest"]  # fmt: skip
    assert list(rows) == ["0", "1", *pieces, "2", "3", "outside"]
    for name in ("1", "1.attention", "1.fc1", "3"):  # products: rates each way, a floor share
        assert float(rows[name][-4]) > 0 and float(rows[name][-3]) > 0 and rows[name][-1] != "-"
    assert rows["0"][-4] == "-" and float(rows["0"][-3]) > 0  # embed: its backward product only
    assert rows["1.ln1"][-1] == "-" and rows["1.gelu"][-1] == "-"
    assert any(line.startswith("# the most time beyond its floor: ") for line in lines)
    assert any(line.split()[:1] == ["block"] for line in lines)  # the attention's kernels


def test_layers_counts_a_token_models_products_by_hand():
    from benchmarks.layers import layer_flops, piece_flops
    from syncsgd.nn.network import build

    net = build("gpt(layers=1,d=16,heads=2)", (8,), 20, "xent", "float64")  # T 8, V 20
    embed, block, head = net.layers[0], net.layers[1], net.layers[3]
    batch = 3
    assert layer_flops(embed, batch) == (0, 2 * 3 * 8 * 20 * 16)  # one-hot^T dy: T x V x d
    # per head (e = 8): q k^T 8 x 8 x 8 and P v 8 x 8 x 8; two heads
    attention = 2 * (8 * 8 * 8 + 8 * 8 * 8)
    assert block.attention_multiply_adds() == attention == 2048
    assert piece_flops(block, "attention", batch) == (2 * 3 * 2048, 4 * 3 * 2048)
    dense = 8 * 16 * 48 + 8 * 16 * 16 + 8 * 16 * 64 + 8 * 64 * 16  # in/out_proj, fc1, fc2
    assert layer_flops(block, batch) == (2 * 3 * (dense + 2048), 4 * 3 * (dense + 2048))
    assert piece_flops(block, "fc1", batch) == (2 * 3 * 8 * 16 * 64, 4 * 3 * 8 * 16 * 64)
    assert piece_flops(block, "ln1", batch) == (0, 0)
    assert layer_flops(head, batch) == (2 * 3 * 8 * 16 * 20, 4 * 3 * 8 * 16 * 20)
