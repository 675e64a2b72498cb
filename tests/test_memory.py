"""Memory per rank: `train`'s measurement (training/memory.py) against `model --memory`'s
prediction (apps/costmodel_memory.py), category by category; the Numba kernels allocate nothing;
bad input is one line."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from syncsgd.apps import costmodel_memory
from syncsgd.cli import main
from syncsgd.training.config import TrainConfig
from syncsgd.training.loop import train
from syncsgd.training.memory import CATEGORIES

NETWORKS = {
    "mlp": dict(dtype="float32", optimizer="adam", batch_size=16, samples=64),
    "simple-cnn": dict(model="simple-cnn", features=784, input_shape=(1, 28, 28), batch_size=4,
                       samples=8, optimizer="sgd", momentum=0.9),
    "gpt": dict(model="gpt(layers=2,d=128,heads=4)", data="numbers-to-words", context=8,
                batch_size=4, samples=16, dtype="float32", optimizer="adamw", precision="bf16"),
}  # fmt: skip


def measured_and_predicted(ranks: int, **options) -> tuple[dict, dict]:
    """memory_bytes of a one-step run, and the prediction for its configuration."""
    result = train(ranks=ranks, steps=1, measure_memory=True, **options)
    config = TrainConfig(**options)
    shapes = costmodel_memory.shapes_of(config, ranks)
    return result.memory_bytes, costmodel_memory.predict(config, shapes)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_the_prediction_is_within_5_percent_of_the_measurement(network, stage, ranks):
    # stages 2 and 3 with a bucket per layer: the buckets under way are one layer's
    buckets = {"bucket_bytes": 0} if stage >= 2 else {}
    measured, predicted = measured_and_predicted(ranks, zero_stage=stage, **buckets,
                                                 **NETWORKS[network])  # fmt: skip
    for category in CATEGORIES:
        assert abs(predicted[category] - measured[category]) <= 0.05 * measured[category], (
            category, predicted[category], measured[category])
    total = sum(measured[category] for category in CATEGORIES)
    assert abs(sum(predicted.values()) - total) <= 0.05 * total
    assert measured["peak_resident"] > measured["total"]


@pytest.mark.parametrize("options", [
    dict(accumulate=2, batch_size=12, bucket_bytes=4096),
    dict(precision="bf16", optimizer="sgd", momentum=0.9, zero_stage=1, bucket_bytes=0),
    dict(batchnorm="sync", hidden=(16, 16), optimizer="lamb"),
])  # fmt: skip
def test_accumulate_buckets_and_batchnorm_are_predicted_too(options):
    measured, predicted = measured_and_predicted(3, **{"samples": 48, "batch_size": 12, **options})
    for category in CATEGORIES:
        assert abs(predicted[category] - measured[category]) <= 0.05 * measured[category], (
            category, predicted[category], measured[category])


def test_the_untimed_steps_leave_the_run_as_it_was():
    options = dict(ranks=2, steps=3, samples=32, batch_size=8, optimizer="adam", lr=0.01)
    plain = train(**options)
    measured = train(measure_memory=True, **options)
    assert plain.params.tobytes() == measured.params.tobytes()
    assert measured.memory_bytes["parameters"] == plain.params.nbytes


def test_no_numba_kernel_allocates_an_array():
    # tracemalloc sees NumPy's arrays only: a kernel that made its own would go unmeasured
    makers = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "copy",
              "array", "concatenate", "astype"}  # fmt: skip
    package = pathlib.Path(costmodel_memory.__file__).parents[1]
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any("njit" in ast.unparse(decorator) for decorator in node.decorator_list):
                continue
            calls = [inner.func.attr for inner in ast.walk(node) if isinstance(inner, ast.Call)
                     and isinstance(inner.func, ast.Attribute) and inner.func.attr in makers]
            assert not calls, f"{path.name}: {node.name} allocates ({calls})"


def test_model_memory_prints_the_table_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "memory.json"
    code = main(["model", "--memory", "--ranks", "2", "--zero-stage", "1", "--optimizer", "adam",
                 "--dtype", "float32", "--batch-size", "16", "--memory-limit", "1MiB",
                 "--json", str(path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    written = json.loads(path.read_text())
    assert set(written["memory_bytes"]) == {*CATEGORIES, "total"}
    assert [row["zero_stage"] for row in written["largest_batch"]] == [0, 1, 2, 3]
    batches = [row["batch_size"] for row in written["largest_batch"]]
    assert batches[0] > 16 and batches[1] >= batches[0]  # stage 2 and 3: docs/memory.md
    assert "optimizer_state" in out and "stage 3:" in out


@pytest.mark.parametrize(("args", "expected"), [
    (["--memory-limit=-3GiB"], "--memory-limit must be positive"),
    (["--memory-limit", "1KiB"], "does not fit even at batch 1"),
    (["--zero-stage", "7"], "--zero-stage must be one of"),
])  # fmt: skip
def test_bad_input_is_one_line(capsys, args, expected):
    try:
        code = main(["model", "--memory", *args])
    except SystemExit as exit:  # train's options are parsed when the subcommand runs
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and expected in err and "Traceback" not in err, err
