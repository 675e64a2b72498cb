"""Memory per rank: `train`'s measurement (training/memory.py) against `model --memory`'s
prediction (apps/costmodel_memory.py), category by category; the Numba kernels allocate nothing;
bad input is one line."""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys

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


# Every network at every stage, each at P = 1, 2 and 4 in turn (P rotates with the stage, so
# each network meets each P and each stage meets each P across the three networks).
STAGE_RANKS = [(network, stage, (1, 2, 4)[(index + stage) % 3])
               for index, network in enumerate(sorted(NETWORKS)) for stage in range(4)]


@pytest.mark.parametrize("network, stage, ranks", STAGE_RANKS)
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


def test_bench_step_reports_the_memory_train_measures(tmp_path, capsys):
    from syncsgd.apps.bench import step

    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    path = tmp_path / "step.json"
    options = parser.parse_args([
        "--backend", "threads", "--ranks", "1,2", "--scaling", "weak", "--features", "6",
        "--hidden", "5", "--classes", "3", "--samples", "32", "--per-rank-batch", "4",
        "--steps", "2", "--repeats", "1", "--warmup", "1", "--no-overhead", "--cli-runs", "0",
        "--optimizer", "adam", "--json", str(path)])  # fmt: skip
    assert step.main(options) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["scaling"]
    for row in rows:
        config = step.train_config(options, row["global_batch"])
        alone = train(config, ranks=row["ranks"], steps=1, measure_memory=True).memory_bytes
        assert set(row["memory_bytes"]) == set(alone)
        assert [row["memory_bytes"][name] for name in CATEGORIES] == [
            alone[name] for name in CATEGORIES]
    line = next(line for line in out.splitlines() if line.startswith("# memory per rank"))
    assert "weak P=1:" in line and "weak P=2:" in line and "peak resident" in line


def test_the_figure_has_a_line_per_stage_and_the_measured_points(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, json_path = tmp_path / "memory.svg", tmp_path / "memory.json"
    code = main(["model", "--memory", "--ranks", "2", "--batch-size", "8", "--samples", "64",
                 "--hidden", "32", "--features", "16", "--classes", "3", "--optimizer", "adam",
                 "--svg", str(path), "--measured", "1,2", "--json", str(json_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[-1] == f"wrote {path}"
    svg = path.read_text()
    assert svg.startswith("<?xml") and all(f"stage {k}, predicted" in svg for k in range(4))
    assert "measured at P = 1, 2" in svg
    rows = json.loads(json_path.read_text())["figure"]
    assert {(row["zero_stage"], row["ranks"]) for row in rows} == {
        (stage, ranks) for stage in range(4) for ranks in costmodel_memory.FIGURE_RANKS}
    for row in rows:
        assert row["batch_size"] == 4 * row["ranks"]  # the per-rank batch held
        if row["ranks"] in (1, 2):
            assert abs(row["predicted"] - row["measured"]) <= 0.05 * row["measured"]
        else:
            assert row["measured"] is None
    stage = {k: [row["predicted"] for row in rows if row["zero_stage"] == k] for k in range(4)}
    assert stage[1][-1] < stage[0][-1]  # sharding the optimizer's state pays at P = 64


def test_the_figure_is_legible_on_a_slide(tmp_path):
    pytest.importorskip("matplotlib")
    from syncsgd.training.config import TrainConfig
    from syncsgd.util.figures import legibility, new_figure

    config = TrainConfig(batch_size=8, samples=64, hidden=(8,), features=6, classes=3)
    shapes = costmodel_memory.shapes_of(config, 2)
    rows = costmodel_memory.figure_rows(config, shapes, [])
    drawn = []
    original = new_figure

    def keep(*args, **kwargs):
        drawn.append(original(*args, **kwargs))
        return drawn[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("syncsgd.util.figures.new_figure", keep)
        costmodel_memory.draw(config, shapes, rows, str(tmp_path / "memory.png"))
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert legibility(drawn[0]) == []


@pytest.mark.parametrize(("args", "expected"), [
    (["--png", "memory.gif"], "a figure is written as .png, .svg or .pdf"),
    (["--measured"], "--measured draws its points on the figure"),
    (["--pdf", "memory.pdf", "--measured", "0"], "--measured"),
])  # fmt: skip
def test_bad_figure_options_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, args,
                                                           expected):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["model", "--memory", *args])
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_figure_without_matplotlib_is_one_line(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    root = pathlib.Path(costmodel_memory.__file__).parents[2]
    path = os.pathsep.join([str(blocker), str(root)])  # the package under test, no matplotlib
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "model", "--memory", "--png",
                           "memory.png"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1 and "pip install" in done.stderr, done.stderr
    assert not (tmp_path / "memory.png").exists()


def test_a_stage_is_predicted_alike_from_any_stage_the_command_gives():
    # --memory-limit and the figure predict every stage from one command line's options
    options = dict(NETWORKS["mlp"], bucket_bytes=0)
    shapes = costmodel_memory.shapes_of(TrainConfig(**options), 4)
    for stage in (1, 2, 3):
        given = costmodel_memory.predict(TrainConfig(**options, zero_stage=stage), shapes)
        assert costmodel_memory.predict(TrainConfig(**options), shapes, stage) == given
