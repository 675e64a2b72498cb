"""Per-iteration statistics of a collective's sweep, as nccl-tests and the OSU benchmarks give them.

Every timed call is timed on every rank. An iteration's time is its slowest rank's (the
collective is done when every rank is); `iter_*` are the minimum, median, maximum, 99th
percentile (nearest rank: the ceil(0.99 n)-th smallest) and coefficient of variation (population
standard deviation / mean) of those n times. `rank_*` are OSU's columns: each rank's mean time per
iteration, averaged, least and largest over the ranks. Definitions and a worked table:
docs/benchmarks.md.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from syncsgd.comm.world import constants
from syncsgd.util import jsonout
from syncsgd.util.files import write_text

# busbw = algbw x this factor (nccl-tests' convention: the bytes a rank's link carries per byte
# of the buffer, so that a bandwidth-optimal algorithm reads as the link speed at any P).
BUSBW_FACTORS = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce-scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}
BUSBW_TEXT = {
    "allreduce": "2(P-1)/P",
    "reduce-scatter": "(P-1)/P",
    "allgather": "(P-1)/P",
    "alltoall": "(P-1)/P",
    "broadcast": "1",
    "reduce": "1",
}
FIELDS = ("iter_min_us", "iter_median_us", "iter_max_us", "iter_p99_us", "iter_cv",
          "rank_avg_us", "rank_min_us", "rank_max_us", "iterations")  # fmt: skip
# The statistics' columns of a table, after the sweep's own.
HEADER = (f"{'min':>9} {'p99':>9} {'max':>9} {'cv':>5} {'ranks avg':>9} {'min':>9} "
          f"{'max':>9}")  # fmt: skip


def busbw(collective: str, algbw: float, ranks: int) -> float:
    """The bus bandwidth of `collective` on `ranks` ranks whose algorithm bandwidth is `algbw`."""
    return algbw * BUSBW_FACTORS[collective](ranks)


def definitions(*collectives: str) -> list[str]:
    """The lines printed once under a table of `collectives`: what algbw, busbw and the
    statistics mean."""
    factors = "; ".join(f"{BUSBW_TEXT[name]} for {name}" for name in collectives)
    return [
        f"# algbw = size / time; busbw = algbw * {factors} (the bytes each rank's link carries "
        "per byte of the buffer: a bandwidth-optimal algorithm reads as the link speed at any P)",
        "# min, p99, max, cv: over the timed iterations (warm-up and each batch's first call "
        "skipped) of the slowest rank's time; p99 by nearest rank, cv = stdev / mean; ranks "
        "avg/min/max: each rank's mean iteration time, over the ranks",
    ]


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: the ceil(share x n)-th smallest value (share in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(math.ceil(share * len(ordered)), 1) - 1]


def summarize(laps: np.ndarray) -> dict[str, float]:
    """The statistics of `laps`, seconds per iteration with one row per rank, in microseconds."""
    slowest = laps.max(axis=0).tolist()  # per iteration, the slowest rank's time
    means = laps.mean(axis=1).tolist()  # per rank, its mean time per iteration
    mean = statistics.fmean(slowest)
    return {
        "iter_min_us": min(slowest) * 1e6,
        "iter_median_us": statistics.median(slowest) * 1e6,
        "iter_max_us": max(slowest) * 1e6,
        "iter_p99_us": percentile(slowest, 0.99) * 1e6,
        "iter_cv": statistics.pstdev(slowest) / mean if mean > 0 else 0.0,
        "rank_avg_us": statistics.fmean(means) * 1e6,
        "rank_min_us": min(means) * 1e6,
        "rank_max_us": max(means) * 1e6,
        "iterations": len(slowest),
    }


def gathered(comm: Any, mine: list[float]) -> np.ndarray:
    """Every rank's `mine` (all of one length), one row per rank, on every rank (by a SUM of
    zeros and one row each: the values come through unchanged)."""
    rows = np.zeros((comm.Get_size(), len(mine)))
    rows[comm.Get_rank()] = mine
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, rows, op=mpi.SUM)
    return rows


def format_fields(row: dict) -> str:
    """A row's statistics as the table prints them, under HEADER."""
    return (f"{row['iter_min_us']:>9.2f} {row['iter_p99_us']:>9.2f} {row['iter_max_us']:>9.2f} "
            f"{row['iter_cv']:>5.2f} {row['rank_avg_us']:>9.2f} {row['rank_min_us']:>9.2f} "
            f"{row['rank_max_us']:>9.2f}")  # fmt: skip


def write_rows(json_path: str | None, csv_path: str | None, result: dict,
               columns: Sequence[str]) -> None:  # fmt: skip
    """`result` as JSON (everything) and its rows as CSV (`columns`), those asked for."""
    if json_path:
        jsonout.write(json_path, result)
    if csv_path:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
        write_text(csv_path, text.getvalue())
