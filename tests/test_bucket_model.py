"""The bucket model of the overlapped step: the derived bucket size is the minimum of the exposed
tail, the closed form is the queue's, `model --overlap` names it, `bench step` sweeps sizes."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd.apps import costmodel
from syncsgd.apps.bench import buckets, step
from syncsgd.apps.costmodel_buckets import (
    RingLine,
    exposed_seconds,
    optimal_bucket_bytes,
    queued_step,
    ready_seconds,
)

positive = st.floats(1e-7, 1e-1)


@given(nbytes=st.floats(1e4, 1e9), backward=positive, latency=st.floats(1e-7, 1e-3),
       per_byte=st.floats(0, 1e-8))  # fmt: skip
def test_the_derived_size_minimises_the_exposed_tail(nbytes, backward, latency, per_byte):
    ring = RingLine(latency, per_byte)
    best = optimal_bucket_bytes(nbytes, backward, ring)
    assert 1 <= best <= nbytes
    grid = np.geomspace(1, nbytes, 4001)
    lowest = min(exposed_seconds(b, nbytes, backward, ring) for b in grid)
    assert exposed_seconds(best, nbytes, backward, ring) <= lowest * (1 + 1e-9) + 1e-15


@given(buckets_count=st.integers(1, 40), backward=positive, latency=st.floats(1e-7, 1e-3),
       per_byte=st.floats(0, 1e-8))  # fmt: skip
def test_the_closed_form_is_the_queue_of_equal_buckets(buckets_count, backward, latency,
                                                       per_byte):  # fmt: skip
    nbytes, ring = 1e6, RingLine(latency, per_byte)
    size = nbytes / buckets_count
    comms = [ring.seconds(size)] * buckets_count
    # parameter order: bucket 0 (the first layer's) is complete last, at the end of the pass
    ready = [backward * (buckets_count - j) / buckets_count for j in range(buckets_count)]
    step_seconds = queued_step(0.0, backward, comms, ready, 0.0)
    assert step_seconds - backward == pytest.approx(
        exposed_seconds(size, nbytes, backward, ring), rel=1e-9, abs=1e-15)


def mlp(sizes: str):
    parser = argparse.ArgumentParser()
    costmodel.add_arguments(parser)
    return costmodel.step_network(parser.parse_args(["--overlap", sizes]))


def test_a_bucket_is_ready_when_the_pass_has_done_its_first_tensors_layer():
    network = mlp("4,3,2")  # dense 4x3 (12 multiply-adds), relu, dense 3x2 (6)
    from syncsgd.training.step import MIN_RIDER_SLOTS, bucket_slices

    buffer = np.empty(network.n_params + MIN_RIDER_SLOTS, network.dtype)
    per_layer = bucket_slices(network, buffer, 0)
    # backward: the top layer's sums (6), its input gradient (6), the first layer's sums (12)
    assert ready_seconds(network, per_layer, 24.0) == [24.0, 6.0]
    assert ready_seconds(network, bucket_slices(network, buffer, None), 24.0) == [24.0]


def test_the_queue_is_between_the_ideal_overlap_and_the_plain_step():
    parts = costmodel.StepParts(1.0, 4.0, (0.5, 1.0, 2.0), 0.25)
    ready = [4.0, 3.5, 1.0]
    queued = queued_step(parts.forward, parts.backward, parts.comms, ready, parts.update)
    assert costmodel.overlapped_step(parts) <= queued <= costmodel.plain_step(parts)
    assert queued == 1.0 + max(4.0, max(1.0 + 2.0, 3.5) + 1.0) + 0.5 + 0.25


def test_model_overlap_names_the_derived_bucket(tmp_path, capsys):
    out = tmp_path / "model.json"
    parser = argparse.ArgumentParser()
    costmodel.add_arguments(parser)
    options = parser.parse_args(["--overlap", "784,256,256,10", "--ranks", "2,8", "--sizes", "1M",
                                 "--json", str(out)])  # fmt: skip
    assert costmodel.main(options) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["overlap"]
    for p in (2, 8):
        derived = [row for row in rows if row["ranks"] == p and row["derived"]]
        expected = costmodel.derived_bucket_bytes(mlp("784,256,256,10"), 64, 1e10, 8, p,
                                                  costmodel.Params(2e-6, 8e-11, 1e-10))  # fmt: skip
        assert [row["bucket_bytes"] for row in derived] == [expected]
        assert f"P = {p}: a = " in text and f"b* {costmodel.format_bytes(expected)}" in text
    assert "b* = min(n·sqrt(a/T_b), a/(T_b/n - s))" in text


TINY = ["--features", "6", "--hidden", "5,4", "--classes", "3", "--samples", "48",
        "--per-rank-batch", "4", "--steps", "3", "--repeats", "2", "--warmup", "1",
        "--scaling", "weak", "--no-overhead", "--cli-runs", "0"]  # fmt: skip


def test_bench_step_sweeps_bucket_sizes_beside_the_prediction(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    options = parser.parse_args(["--backend", "threads", "--ranks", "1,2", *TINY,
                                 "--bucket-bytes", "0,64,one", "--json", str(path)])  # fmt: skip
    assert step.main(options) == 0
    out = capsys.readouterr().out
    assert "# P = 1: skipped, nothing to overlap on one rank" in out
    (section,) = json.loads(path.read_text())["bucket_sweep"]
    assert section["ranks"] == 2 and section["ring_latency_us"] > 0
    assert [row["bucket_bytes"] for row in section["rows"]] == [0, 64, None]
    for row in section["rows"]:
        assert row["step_min_ms"] <= row["step_ms"] <= row["step_max_ms"]
        assert row["predicted_step_ms"] > 0
        assert row["predicted_over_measured"] == pytest.approx(
            row["predicted_step_ms"] / row["step_ms"])
    assert "pred/meas" in out and "per layer" in out


def test_bench_step_draws_the_sweep_as_a_slide(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from syncsgd.cli import main
    from syncsgd.util import figures

    json_path, png_path = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["bench", "step", "--backend", "threads", "--ranks", "2", *TINY,
                 "--bucket-bytes", "0,64,one", "--json", str(json_path),
                 "--png", str(png_path)]) == 0  # fmt: skip
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    sections = json.loads(json_path.read_text())["bucket_sweep"]
    assert [row["buckets"] for row in sections[0]["rows"]][-1] == 1  # 'one': a single bucket
    figure = buckets.sweep_figure(sections, "bench step")
    assert figures.legibility(figure) == []
    (axes,) = figure.axes
    predicted = next(line for line in axes.get_lines()
                     if line.get_label().startswith("P = 2: predicted"))  # fmt: skip
    derived = sections[0]["derived_bucket_bytes"]
    assert predicted.get_label().endswith(f"derived b* = {derived:,} B")
    assert list(predicted.get_ydata()) == [row["predicted_step_ms"] for row in sections[0]["rows"]]
    ticks = [tick.get_text() for tick in axes.get_xticklabels()]
    assert ticks[0].startswith("per layer") and ticks[-1] == "one\n1 bucket"


@pytest.mark.parametrize("argv", [["--bucket-bytes", "0"], ["--ranks", "1"]])
def test_a_figure_without_a_sweep_is_refused_in_one_line(tmp_path, capsys, argv):
    pytest.importorskip("matplotlib")
    from syncsgd.cli import main

    png = tmp_path / "sweep.png"
    base = ["bench", "step", "--backend", "threads", "--ranks", "2", *TINY,
            "--bucket-bytes", "0,one", "--png", str(png)]  # fmt: skip
    assert main(base + argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--png draws the --bucket-bytes sweep" in err[0]
    assert not png.exists()


@pytest.mark.parametrize("text", ["", "0,0", "16K,x", "-1"])
def test_a_bad_bucket_list_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        buckets.bucket_list(text)


def test_a_bucket_list_reads_sizes():
    assert buckets.bucket_list("0,16K,1M,one") == [0, 16384, 1 << 20, None]
