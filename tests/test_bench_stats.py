"""The sweep's per-iteration statistics against a table computed by hand, and in a real sweep."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from syncsgd import run_threads
from syncsgd.apps.bench import stats
from syncsgd.cli import main

pytestmark = pytest.mark.timeout(120)

# Two ranks, five timed iterations (microseconds). Per iteration the slowest rank: 2, 2, 5, 4, 10.
LAPS_US = [[1.0, 2.0, 3.0, 4.0, 10.0],
           [2.0, 1.0, 5.0, 4.0, 6.0]]  # fmt: skip
# By hand: min 2, median 4, max 10; p99 by nearest rank: the ceil(0.99 * 5) = 5th smallest, 10;
# mean 23/5 = 4.6, squared deviations 6.76 + 6.76 + 0.16 + 0.36 + 29.16 = 43.2, population
# variance 8.64, cv = sqrt(8.64) / 4.6; rank means 20/5 = 4 and 18/5 = 3.6: avg 3.8, min 3.6, max 4.
BY_HAND = {"iter_min_us": 2.0, "iter_median_us": 4.0, "iter_max_us": 10.0, "iter_p99_us": 10.0,
           "iter_cv": 8.64**0.5 / 4.6, "rank_avg_us": 3.8, "rank_min_us": 3.6,
           "rank_max_us": 4.0, "iterations": 5}  # fmt: skip


def test_the_statistics_are_the_hand_computed_table():
    found = stats.summarize(np.array(LAPS_US) * 1e-6)
    assert found.keys() == BY_HAND.keys() == set(stats.FIELDS)
    for name, value in BY_HAND.items():
        assert found[name] == pytest.approx(value, rel=1e-12), name


def test_p99_is_the_nearest_rank():
    assert stats.percentile(list(range(1, 101)), 0.99) == 99
    assert stats.percentile(list(range(200, 0, -1)), 0.99) == 198
    assert stats.percentile([7.0], 0.99) == 7.0


def test_busbw_factors_are_nccl_tests():
    assert stats.busbw("allreduce", 1.0, 4) == 1.5
    assert stats.busbw("allgather", 1.0, 4) == stats.busbw("reduce-scatter", 1.0, 4) == 0.75
    assert stats.busbw("broadcast", 1.0, 4) == 1.0
    assert "busbw = algbw * 2(P-1)/P for allreduce" in stats.definitions("allreduce")[0]


def test_every_rank_gets_every_ranks_laps():
    def laps(comm):
        return stats.gathered(comm, LAPS_US[comm.Get_rank()])

    for rows in run_threads(2, laps):
        assert rows.tolist() == LAPS_US


def test_the_sweep_writes_the_same_statistics_to_json_and_csv(tmp_path, capsys):
    json_path, csv_path = tmp_path / "s.json", tmp_path / "s.csv"
    argv = ["bench", "allreduce", "--ranks", "2", "--max-bytes", "16", "--batches", "3",
            "--batch-seconds", "0.001", "--warmup", "1", "--max-iters", "4",
            "--json", str(json_path), "--csv", str(csv_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("# algbw = size / time; busbw = algbw * 2(P-1)/P") == 1
    rows = json.loads(json_path.read_text())["rows"]
    with open(csv_path, newline="") as file:
        table = list(csv.DictReader(file))
    assert len(rows) == len(table) == 4  # 8 and 16 B, ring and numpy-sum
    for row, line in zip(rows, table, strict=True):
        assert row["iterations"] == 3 * row["iters"]  # every timed call of every batch
        assert row["iter_min_us"] <= row["iter_median_us"] <= row["iter_p99_us"]
        assert row["iter_p99_us"] <= row["iter_max_us"] and row["iter_cv"] >= 0
        assert row["rank_min_us"] <= row["rank_avg_us"] <= row["rank_max_us"]
        for name in stats.FIELDS:
            assert float(line[name]) == pytest.approx(row[name])


def test_bench_collective_has_the_same_statistics_with_each_collectives_busbw(tmp_path, capsys):
    json_path, csv_path = tmp_path / "c.json", tmp_path / "c.csv"
    argv = ["bench", "collective", "--ranks", "4", "--min-bytes", "64", "--max-bytes", "64",
            "--batches", "3", "--batch-seconds", "0.001", "--warmup", "1", "--max-iters", "3",
            "--json", str(json_path), "--csv", str(csv_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("# algbw = size / time; busbw = algbw * 1 for broadcast; 1 for reduce; "
                     "(P-1)/P for allgather; (P-1)/P for reduce-scatter; (P-1)/P for "
                     "alltoall") == 1  # fmt: skip
    rows = json.loads(json_path.read_text())["rows"]
    with open(csv_path, newline="") as file:
        table = list(csv.DictReader(file))
    assert len(rows) == len(table) == 9  # the nine hand-written algorithms (no library here)
    factors = {"broadcast": 1.0, "reduce": 1.0, "allgather": 0.75, "reduce-scatter": 0.75,
               "alltoall": 0.75}  # fmt: skip
    for row, line in zip(rows, table, strict=True):
        assert row["size_bytes"] == 64 and row["iterations"] == 3 * row["iters"]
        assert row["algbw_GBps"] == pytest.approx(64 / row["time_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factors[row["collective"]])
        assert row["iter_min_us"] <= row["iter_median_us"] <= row["iter_p99_us"]
        assert row["iter_p99_us"] <= row["iter_max_us"] and row["iter_cv"] >= 0
        assert row["rank_min_us"] <= row["rank_avg_us"] <= row["rank_max_us"]
        for name in (*stats.FIELDS, "algbw_GBps", "busbw_GBps", "time_us"):
            assert float(line[name]) == pytest.approx(row[name])
