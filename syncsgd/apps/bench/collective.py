"""Broadcast, reduce, allgather, reduce-scatter and alltoall: the hand-written schedules against
the MPI library's own (Bcast, Reduce, Allgather, Reduce_scatter_block, Alltoall).

    mpiexec -n 4 syncsgd bench collective --max-bytes 4M --json parts.json
    syncsgd bench collective --ranks 4       # threads backend: the hand-written ones only

Method as `bench allreduce`: every implementation first gives the library's bits on small
integers; then, per size, `--batches` rounds in ABBA order, each one batch of each implementation;
a batch's per-op time is the slowest rank's, `time` the median over the rounds, `vs_library` the
median over the rounds of the library's batch time over this one's. The size is n, the bytes of
the whole buffer (as in `syncsgd model --collectives`), rounded down to a multiple of P elements.
The hand-written calls skip the agreement round (`check=False`), as the library has none.
algbw, busbw and the per-iteration statistics (minimum, 99th percentile, maximum, coefficient of
variation; each rank's mean, over the ranks) are `bench allreduce`'s (`stats`), with each
collective's busbw factor; `--json` and `--csv` have the same fields.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd import collectives
from syncsgd.apps.bench import stats
from syncsgd.apps.bench.allreduce import message_sizes, parse_bytes, slowest, time_batch
from syncsgd.comm.threads import ThreadComm
from syncsgd.comm.watchdog import watching, within_timeout
from syncsgd.comm.world import constants, launch, resolve_backend
from syncsgd.util.argtypes import comma_separated, positive_float, positive_int
from syncsgd.util.machine import check_memory
from syncsgd.util.options import BACKEND, JSON, RANKS, TIMEOUT, writes

LIBRARY = "library"
Op = Callable[[], Any]
_NO_BUFFER = np.empty(0)  # the operations hold their own buffers


def operations(comm: Any, collective: str, count: int, dtype: np.dtype) -> dict[str, Op]:
    """Each hand-written algorithm of `collective`, and under MPI the library's, on buffers of
    `count` elements in all (a multiple of P), filled with small integers; each returns the array
    its result is in."""
    rank, size = comm.Get_rank(), comm.Get_size()
    block = count // size
    whole = ((np.arange(count) * 7 + rank * 3) % 64).astype(dtype)
    part = whole[:block].copy()
    out = np.empty(count, dtype)
    out_part = np.empty(block, dtype)
    function = getattr(collectives, collective.replace("-", "_"))
    ops: dict[str, Op] = {}
    for algorithm in collectives.COLLECTIVES[collective]:
        if collective in ("broadcast", "reduce"):
            ops[algorithm] = _rooted(function, whole, comm, algorithm)
        elif collective == "allgather":
            ops[algorithm] = _into(function, part, comm, out, algorithm)
        elif collective == "reduce-scatter":
            ops[algorithm] = _into(function, whole, comm, out_part, algorithm)
        else:
            ops[algorithm] = _into(function, whole, comm, out, algorithm)
    if not isinstance(comm, ThreadComm):
        ops[LIBRARY] = _library(comm, collective, whole, part, out, out_part)
    return ops


def _rooted(function: Callable, buf: np.ndarray, comm: Any, algorithm: str) -> Op:
    """broadcast or reduce from rank 0 in place."""
    return lambda: function(buf, comm, 0, algorithm=algorithm, check=False)


def _into(function: Callable, send: np.ndarray, comm: Any, recv: np.ndarray, algorithm: str) -> Op:
    """allgather, reduce_scatter or alltoall from `send` into `recv`."""
    return lambda: function(send, comm, recv, algorithm=algorithm, check=False)


def _library(comm: Any, collective: str, whole: np.ndarray, part: np.ndarray, out: np.ndarray,
             out_part: np.ndarray) -> Op:  # fmt: skip
    """The MPI library's own collective on the same buffers."""
    mpi = constants(comm)
    root = comm.Get_rank() == 0
    calls: dict[str, Op] = {  # each returns where its result is
        "broadcast": lambda: comm.Bcast(whole, 0) or whole,
        "reduce": lambda: comm.Reduce(mpi.IN_PLACE if root else whole, whole if root else None,
                                      op=mpi.SUM, root=0) or whole,  # fmt: skip
        "allgather": lambda: comm.Allgather(part, out) or out,
        "reduce-scatter": lambda: comm.Reduce_scatter_block(whole, out_part, op=mpi.SUM)
        or out_part,
        "alltoall": lambda: comm.Alltoall(whole, out) or out,
    }
    return calls[collective]


def check_against_library(comm: Any, collective: str, count: int, dtype: np.dtype) -> None:
    """Every hand-written algorithm must give the library's bits, on every rank (MPI only)."""
    if isinstance(comm, ThreadComm):
        return
    expected = operations(comm, collective, count, dtype)[LIBRARY]().tobytes()
    differ = [name for name in collectives.COLLECTIVES[collective]  # fresh buffers for each
              if operations(comm, collective, count, dtype)[name]().tobytes() != expected]
    if collective == "reduce" and comm.Get_rank() != 0:
        differ = []  # only the root has a result
    if slowest(comm, float(bool(differ))):  # on every rank, or none
        raise RuntimeError(f"{collective} {', '.join(differ) or '(on another rank)'} disagrees "
                           f"with the library at {count} elements")  # fmt: skip


def _timed(comm: Any, op: Op, iters: int, laps: list[float] | None = None) -> float:
    """Per-op seconds of `iters` calls of `op`, as the slowest rank saw them (after one more);
    `laps` gets this rank's time of each call."""
    return time_batch(comm, lambda _: op(), _NO_BUFFER, iters, "a timed batch of collectives",
                      laps)  # fmt: skip


def sweep(comm: Any, options: argparse.Namespace, report: Callable[[dict], None]) -> list[dict]:
    """Time every collective's implementations at every size."""
    size, dtype = comm.Get_size(), np.dtype(options.dtype)
    rows = []
    for collective in options.collectives:
        sizes = message_sizes(options.min_bytes, options.max_bytes, dtype.itemsize)
        counts = dict.fromkeys(max(n // dtype.itemsize // size, 1) * size for n in sizes)
        for count in counts:  # multiples of P elements
            with watching(f"the check of {collective} against the library"):
                check_against_library(comm, collective, count, dtype)
            for row in _timed_rows(comm, options, collective, count, dtype):
                rows.append(row)
                report(row)
    return rows


def _timed_rows(comm: Any, options: argparse.Namespace, collective: str, count: int,
                dtype: np.dtype) -> list[dict]:  # fmt: skip
    """Every implementation of `collective` on `count` elements: warm-up, ABBA rounds, a row
    each."""
    ops = operations(comm, collective, count, dtype)
    warm = max(_timed(comm, op, options.warmup) for op in ops.values())
    iters = int(min(max(options.batch_seconds / max(warm, 1e-9), 1), options.max_iters))
    times: dict[str, list[float]] = {name: [] for name in ops}
    laps: dict[str, list[float]] = {name: [] for name in ops}  # this rank's, per call
    for batch in range(options.batches):
        order = list(ops) if batch % 2 == 0 else list(reversed(ops))  # ABBA
        for name in order:
            times[name].append(_timed(comm, ops[name], iters, laps[name]))
    rows = []
    for name, measured in times.items():
        seconds, nbytes = statistics.median(measured), count * dtype.itemsize
        algbw = nbytes / seconds / 1e9
        row = {"collective": collective, "algorithm": name, "count": count,
               "size_bytes": nbytes, "dtype": dtype.name, "time_us": seconds * 1e6,
               "algbw_GBps": algbw, "busbw_GBps": stats.busbw(collective, algbw, comm.Get_size()),
               **stats.summarize(stats.gathered(comm, laps[name])), "iters": iters,
               "batches": options.batches, "batch_us": [t * 1e6 for t in measured]}  # fmt: skip
        if LIBRARY in times:
            row["vs_library"] = statistics.median(
                [b / t for b, t in zip(times[LIBRARY], measured, strict=True)]
            )
        rows.append(row)
    return rows


COLUMNS = ("collective", "algorithm", "size_bytes", "count", "dtype", "time_us", "algbw_GBps",
           "busbw_GBps", "vs_library")  # fmt: skip
CSV_COLUMNS = [*COLUMNS, *stats.FIELDS, "iters", "batches"]
HEADER = (f"{'collective':>15} {'algorithm':>19} {'size (B)':>11} {'time (us)':>11} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'vs_library':>10} {stats.HEADER}")  # fmt: skip


def format_row(row: dict) -> str:
    """One line of the table."""
    ratio = f"{row['vs_library']:>10.2f}" if "vs_library" in row else f"{'-':>10}"
    return (f"{row['collective']:>15} {row['algorithm']:>19} {row['size_bytes']:>11} "
            f"{row['time_us']:>11.2f} {row['algbw_GBps']:>10.3f} {row['busbw_GBps']:>10.3f} "
            f"{ratio} {stats.format_fields(row)}")  # fmt: skip


def run(comm: Any, options: argparse.Namespace) -> list[dict] | None:
    """The sweep on one rank; rank 0 prints the table and writes the JSON and CSV."""
    master_process = comm.Get_rank() == 0
    backend = "threads" if isinstance(comm, ThreadComm) else "mpi"
    if master_process:
        print(f"# collectives: {comm.Get_size()} ranks, {backend} backend, {options.dtype}")
        if backend == "threads":
            print("# threads backend: no library to compare with; the hand-written ones only")
        print(f"# time: median over {options.batches} rounds of the slowest rank's per-op time; "
              "vs_library: median over the rounds of library time / this time")  # fmt: skip
        print(HEADER, flush=True)
    rows = sweep(comm, options, lambda row: master_process and print(format_row(row), flush=True))
    if not master_process:
        return None
    print("\n".join(stats.definitions(*options.collectives)), flush=True)
    stats.write_rows(options.json, options.csv,
                     {"benchmark": "collective", "backend": backend, "ranks": comm.Get_size(),
                      "dtype": options.dtype, "command": sys.argv, "rows": rows},
                     CSV_COLUMNS)  # fmt: skip
    return rows


def collective_list(text: str) -> list[str]:
    """broadcast,allgather -> names from syncsgd.collectives.COLLECTIVES."""
    names = comma_separated(text)
    unknown = [name for name in names if name not in collectives.COLLECTIVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown collective {', '.join(unknown) or repr(text)} "
                                         f"(choose from {', '.join(collectives.COLLECTIVES)})")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd bench collective`."""
    RANKS.add(parser, help="thread ranks (threads backend; default 2); under mpiexec, -n decides")
    BACKEND.add(parser)
    parser.add_argument("--collectives", type=collective_list,
                        default=list(collectives.COLLECTIVES),
                        help="which (default all: " + ",".join(collectives.COLLECTIVES) + ")")
    parser.add_argument("--dtype", choices=("float64", "float32", "int64"), default="float64")
    parser.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest size (8)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=4 << 20,
                        help="largest size (4M)")  # fmt: skip
    parser.add_argument("--batches", type=positive_int, default=9,
                        help="timed rounds per size; medians (9)")  # fmt: skip
    parser.add_argument("--batch-seconds", type=positive_float, default=0.005,
                        help="target duration of one batch in seconds (0.005)")  # fmt: skip
    parser.add_argument("--warmup", type=positive_int, default=3,
                        help="warm-up calls, left out of the statistics (3)")  # fmt: skip
    parser.add_argument("--max-iters", type=positive_int, default=1000,
                        help="most calls in one batch (1000)")  # fmt: skip
    JSON.add(parser, help="write the results as JSON")
    writes(parser.add_argument("--csv", metavar="PATH", help="write the rows as CSV"))
    TIMEOUT.add(parser)


def main(options: argparse.Namespace) -> int:
    """Run the sweep on the backend the options ask for."""
    if options.min_bytes > options.max_bytes:
        raise ValueError(f"--min-bytes {options.min_bytes} exceeds --max-bytes {options.max_bytes}")
    ranks = options.ranks
    if ranks is None and options.backend != "mpi":
        ranks = 2 if resolve_backend(options.backend) == "threads" else None
    check_memory(6 * options.max_bytes * (ranks or 1), f"messages of {options.max_bytes} bytes")
    launch(within_timeout(run, options.timeout), options, backend=options.backend, ranks=ranks)
    return 0
