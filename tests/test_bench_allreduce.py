"""Smoke test of `syncsgd bench allreduce` (threads; --check under mpiexec): table, JSON, CSV, bad
options."""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

import pytest
from conftest import requires_mpi, run_mpiexec

from syncsgd.apps.bench import allreduce
from syncsgd.cli import main

pytestmark = pytest.mark.timeout(120)

QUICK = ["--batches", "2", "--batch-seconds", "0.001", "--warmup", "1", "--max-iters", "3"]


def syncsgd_command() -> list[str]:
    """The installed console script, or the module behind it."""
    script = os.path.join(os.path.dirname(sys.executable), "syncsgd")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "syncsgd.cli"]


def test_sweep_prints_a_table_and_writes_json_and_csv(tmp_path, capsys):
    json_path, csv_path = tmp_path / "sweep.json", tmp_path / "sweep.csv"
    argv = ["bench", "allreduce", "--ranks", "3", "--max-bytes", "64", "--dtype", "float32",
            "--json", str(json_path), "--csv", str(csv_path), *QUICK]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "# allreduce sweep: 3 ranks, threads backend, float32"
    assert table[1].startswith("# baseline 'numpy-sum': threads backend")
    assert any(line.startswith("# paired = median over the rounds") for line in table)
    assert any(line.startswith("# medians = the baseline's median time") for line in table)

    result = json.loads(json_path.read_text())
    assert (result["backend"], result["ranks"], result["dtype"]) == ("threads", 3, "float32")
    rows = result["rows"]
    sizes = [8, 16, 32, 64]
    assert [(row["size_bytes"], row["algorithm"]) for row in rows] == [
        (size, name) for size in sizes for name in ("ring", "numpy-sum")
    ]
    for row in rows:
        assert row["count"] == row["size_bytes"] // 4 and row["dtype"] == "float32"
        assert row["time_us"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["time_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 2 / 3)  # 2(P-1)/P
    for ring, baseline in zip(rows[::2], rows[1::2], strict=True):
        assert baseline["vs_mpi"] == 1.0
        assert len(ring["batch_us"]) == len(baseline["batch_us"]) == 2  # --batches 2
        assert ring["time_us"] == pytest.approx(statistics.median(ring["batch_us"]))
        # vs mpi pairs the batches of one round: the median of 2 is the mean of the two ratios
        ratios = [b / r for b, r in zip(baseline["batch_us"], ring["batch_us"], strict=True)]
        assert ring["vs_mpi"] == pytest.approx(sum(ratios) / 2)
        # and beside it the ratio of the printed medians, which need not be the same
        assert ring["vs_mpi_of_medians"] == pytest.approx(baseline["time_us"] / ring["time_us"])
    # one table line per row, with the same numbers
    lines = [
        line.split() for line in table if line and not line.startswith(("#", " " * 2 + "size"))
    ]
    # on threads the baseline is a NumPy sum, and the table and the JSON say so alike
    assert [(int(f[0]), f[3]) for f in lines] == [(r["size_bytes"], r["algorithm"]) for r in rows]
    for fields, row in zip(lines, rows, strict=True):
        assert float(fields[7]) == pytest.approx(row["vs_mpi"], abs=0.006)
        assert float(fields[8]) == pytest.approx(row["vs_mpi_of_medians"], abs=0.006)
        assert float(fields[9]) == pytest.approx(row["iter_min_us"], abs=0.006)
        assert float(fields[-1]) == pytest.approx(row["rank_max_us"], abs=0.006)

    with open(csv_path, newline="") as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == len(rows) and "batch_us" not in records[0]
    for record, row in zip(records, rows, strict=True):
        assert (
            int(record["size_bytes"]) == row["size_bytes"]
            and record["algorithm"] == row["algorithm"]
        )
        assert float(record["time_us"]) == pytest.approx(row["time_us"])


def test_the_figure_names_the_threads_baseline_as_the_table_does(tmp_path, monkeypatch, capsys):
    drawn = []
    monkeypatch.setattr(allreduce, "draw_png", lambda rows, path, title: drawn.append(rows))
    argv = ["bench", "allreduce", "--ranks", "2", "--max-bytes", "16", "--png",
            str(tmp_path / "a.png"), *QUICK]  # fmt: skip
    assert main(argv) == 0
    assert "numpy-sum" in capsys.readouterr().out
    (rows,) = drawn
    assert {row["algorithm"] for row in rows} == {"ring", "numpy-sum"}


def test_help_explains_both_ratios(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "allreduce", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "paired = median over the rounds of (baseline time / this time)" in text
    assert "medians = the baseline's median time / this median time" in text
    assert "('numpy-sum') on the threads backend" in text


def test_the_bar_is_printed_only_with_check(monkeypatch, capsys):
    # A made-up MPI sweep that misses the bar: the verdict line appears with --check only.
    rows = [{"size_bytes": 8, "algorithm": "ring", "vs_mpi": 0.1},
            {"size_bytes": 8, "algorithm": "mpi", "vs_mpi": 1.0}]  # fmt: skip
    bar = allreduce.performance_bar(rows)
    assert bar is not None and not allreduce.bar_met(bar)
    monkeypatch.setattr(allreduce, "sweep", lambda comm, options, report: rows)
    monkeypatch.setattr(allreduce, "library_name", lambda comm: "a fake MPI")

    class FakeMpiComm:
        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 2

    for check in (False, True):
        options = argparse.Namespace(dtype="float64", batches=3, timeline=None, json=None,
                                     timeline_png=None, csv=None, png=None,
                                     check=check, algorithms=["ring"])  # fmt: skip
        allreduce.run(FakeMpiComm(), options)
        printed = capsys.readouterr().out
        assert ("# bar:" in printed) == check and ("MISSED" in printed) == check


def test_png_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(["bench", "allreduce", "--max-bytes", "32", *QUICK, "--png", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temporary file left over


def test_message_sizes_and_byte_parsing():
    assert allreduce.message_sizes(8, 64, 8) == [8, 16, 32, 64]
    assert allreduce.message_sizes(1, 10, 4) == [4, 8]  # at least one element
    assert allreduce.message_sizes(5, 40, 8) == [8, 16, 32]  # up to the next power of two
    assert allreduce.parse_bytes("64K") == 64 << 10
    assert allreduce.parse_bytes("1MiB") == 1 << 20
    assert allreduce.parse_bytes(" 2m ") == 2 << 20
    assert allreduce.parse_bytes("8B") == 8


def test_performance_bar_verdicts():
    def rows(latency_vs, busbw_vs):
        made = [{"size_bytes": 8, "algorithm": "ring", "vs_mpi": latency_vs}]
        made += [{"size_bytes": 1 << s, "algorithm": "ring", "vs_mpi": v} for s, v in busbw_vs]
        return made + [{"size_bytes": 8, "algorithm": "mpi", "vs_mpi": 1.0}]

    met = allreduce.performance_bar(rows(0.5, [(20, 0.96), (21, 1.3)]))
    assert met["latency_ratio"] == 2.0 and met["latency_met"] and met["busbw_met"]
    assert "MISSED" not in allreduce.describe_bar(met)
    assert not allreduce.performance_bar(rows(0.45, []))["latency_met"]  # 2.2x: over the 2x bar
    slow = allreduce.performance_bar(rows(0.25, [(20, 0.96), (22, 0.94)]))
    assert not slow["latency_met"] and not slow["busbw_met"]
    assert slow["busbw_worst_bytes"] == 1 << 22
    assert allreduce.describe_bar(slow).count("MISSED") == 2
    # sizes below 1 MiB do not count for the bandwidth bar
    assert allreduce.performance_bar(rows(0.5, [(19, 0.5)]))["busbw_met"]
    assert met["auto_worst_bytes"] is None and allreduce.bar_met(met)  # no auto rows: no verdict


def test_the_control_shows_the_noise_from_1_mib_and_decides_nothing():
    rows = [{"size_bytes": 1 << s, "algorithm": name, "vs_mpi": v}
            for s, name, v in [(3, "ring", 0.6), (20, "ring", 0.97), (21, "ring", 1.1),
                               (3, allreduce.CONTROL, 0.5), (20, allreduce.CONTROL, 0.8),
                               (21, allreduce.CONTROL, 1.25), (22, allreduce.CONTROL, 1.0)]]
    bar = allreduce.performance_bar(rows)
    assert bar["control_range"] == [0.8, 1.25]  # 8 B is below 1 MiB: not counted there
    assert bar["control_latency_ratio"] == 2.0  # but it is the latency size: time 1 / 0.5
    assert allreduce.bar_met(bar)  # the control's own 0.8 misses nothing: it only informs
    assert ("mpi-control/mpi time at 8 B = 2.00x; mpi-control/mpi busbw from 1 MiB = 0.80-1.25x "
            "(the library against itself") in allreduce.describe_bar(bar)  # fmt: skip
    assert allreduce.performance_bar(rows[:3])["control_range"] is None
    assert "mpi-control" not in allreduce.describe_bar(allreduce.performance_bar(rows[:3]))


@requires_mpi
def test_check_times_the_library_against_itself_under_mpi(tmp_path):
    json_path = tmp_path / "check.json"
    args = ["-m", "syncsgd.cli", "bench", "allreduce", "--max-bytes", "16", "--check",
            "--json", str(json_path), *QUICK]  # fmt: skip
    done = run_mpiexec(2, args, timeout=120)
    assert done.returncode in (0, 1), done.stderr  # 1: a bar missed on a busy machine
    rows = json.loads(json_path.read_text())["rows"]
    assert sorted(row["algorithm"] for row in rows if row["size_bytes"] == 8) == [
        "mpi", "mpi-control", "ring"]
    assert "mpi-control" in done.stdout and "# bar:" in done.stdout
    plain = tmp_path / "plain.json"  # without --check: no control
    done = run_mpiexec(2, [*args[:4], "--max-bytes", "8", "--json", str(plain), *QUICK])
    assert done.returncode == 0, done.stderr
    assert {row["algorithm"] for row in json.loads(plain.read_text())["rows"]} == {"ring", "mpi"}


def test_auto_bar_takes_the_worst_size():
    auto = [{"size_bytes": 1 << s, "algorithm": "auto", "vs_mpi": v}
            for s, v in [(3, 0.93), (10, 1.0), (25, 0.89)]]  # fmt: skip
    bar = allreduce.performance_bar(auto)
    assert (bar["auto_worst_bytes"], bar["auto_worst_ratio"]) == (1 << 25, 0.89)
    assert not bar["auto_met"] and not allreduce.bar_met(bar)
    assert "worst auto/mpi speed = 0.89x at 33554432 B (>= 0.9x: MISSED)" in (
        allreduce.describe_bar(bar)
    )
    auto[2]["vs_mpi"] = 0.9
    assert allreduce.bar_met(allreduce.performance_bar(auto))


@pytest.mark.parametrize(
    "bad_options, words",
    [
        (["--max-bytes", "0"], "--max-bytes"),
        (["--max-bytes", "lots"], "not a size in bytes"),
        (["--min-bytes", "-8"], "--min-bytes"),
        (["--batches", "0"], "--batches"),
        (["--batch-seconds", "nan"], "--batch-seconds"),
        (["--ranks", "two"], "--ranks"),
        (["--dtype", "int32"], "--dtype"),
        (["--backend", "gloo"], "--backend"),
        (["--min-bytes", "1M", "--max-bytes", "8"], "exceeds --max-bytes"),
        (["--json", "/no/such/directory/x.json"], "does not exist"),
        (["--png", "/no/such/directory/x.png"], "does not exist"),
        (["--max-bytes", str(10**15)], "memory needed"),  # refused before the first size
    ],
)
def test_bad_options_give_one_line_on_stderr(bad_options, words, capsys):
    try:
        status = main(["bench", "allreduce", "--max-bytes", "16", *QUICK, *bad_options])
    except SystemExit as exc:  # argparse rejects the value itself
        status = exc.code
    captured = capsys.readouterr()
    assert status not in (0, None)
    assert captured.err.count("\n") == 1 and words in captured.err, captured.err
    assert captured.out == ""


def test_console_script_runs_and_rejects_bad_input(tmp_path):
    json_path = tmp_path / "sweep.json"
    ok = subprocess.run(
        [*syncsgd_command(), "bench", "allreduce", "--max-bytes", "16", *QUICK,
         "--json", str(json_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "ring" in ok.stdout and json.loads(json_path.read_text())["rows"]
    bad = subprocess.run(
        [*syncsgd_command(), "bench", "allreduce", "--max-bytes", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and bad.stdout == ""
    assert len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr
