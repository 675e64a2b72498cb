"""Allreduce sweep, OSU / nccl-tests style: the hand-written ring against the library's Allreduce.

    syncsgd bench allreduce                          # threads backend, 2 thread ranks
    mpiexec -n 2 syncsgd bench allreduce --json a.json --csv a.csv --png a.png
    python benchmarks/allreduce.py --max-bytes 1M    # the same, run as a script

Method: for each message size, check once that every algorithm gives the same sum, warm up, then
time `--batches` rounds; in each round every algorithm runs one batch of iterations (after one
untimed call), in ABBA order (this machine is shared and noisy: comparing numbers taken minutes
apart measures the neighbours).
A batch's per-op time is the slowest rank's; `time` is the median over the rounds. `paired` is the
median over the rounds of the baseline's batch time over the algorithm's in the same round (load
that comes and goes during the sweep slows both sides of a pair alike), so it need not equal the
ratio of the printed medians, printed beside it as `medians`. busbw =
algbw * 2(P-1)/P, the nccl-tests convention, so a bandwidth-optimal allreduce reads as the link
speed at any P. The JSON file keeps every batch time.

The baseline is the communicator's own Allreduce: the MPI library's ("mpi"), or on the threads
backend `ThreadComm.Allreduce`, a plain NumPy sum of all ranks' buffers, named "numpy-sum" there:
in the table, the JSON and CSV rows and the figure's legend alike. (The ratio columns keep their
names, `vs_mpi`: the baseline's time over the algorithm's, whichever the baseline is.)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from syncsgd.apps.bench import stats
from syncsgd.collectives import (
    ALGORITHMS,
    INTER_ALGORITHMS,
    Trace,
    allreducer,
    set_hierarchy,
)
from syncsgd.collectives.executor import execute
from syncsgd.comm.threads import ThreadComm
from syncsgd.comm.watchdog import watching, within_timeout
from syncsgd.comm.world import constants, launch, resolve_backend
from syncsgd.training.timeline import Timeline, draw_gantt_file
from syncsgd.training.timeline import write as write_timeline
from syncsgd.util.argtypes import positive_float, positive_int
from syncsgd.util.figures import figure_path
from syncsgd.util.machine import check_memory
from syncsgd.util.options import BACKEND, JSON, RANKS, TIMEOUT, writes

BASELINE = "mpi"  # the role: the communicator's own Allreduce
# With --check under MPI, the library's Allreduce timed a second time in the same rounds, as if it
# were another algorithm: its ratio to the baseline is the noise the bar is read against.
CONTROL = "mpi-control"
THREADS_BASELINE = "numpy-sum"  # what that is on the threads backend
PAIRED = "paired = median over the rounds of (baseline time / this time) within a round"
MEDIANS = "medians = the baseline's median time / this median time (the printed times' ratio)"
RATIOS_EXPLAINED = f"{PAIRED}; {MEDIANS}"
MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold: mallocs this big get fresh pages
# The bar, both ratios taken in the same run: the ring's time at 8 B at most 2x the MPI
# library's, and its busbw at least 0.95x the library's at every size from 1 MiB.
LATENCY_BAR, LATENCY_AT, BUSBW_BAR, BUSBW_FROM = 2.0, 8, 0.95, 1 << 20
# And "auto": at least 0.9x the library's speed at every size, in the same run.
AUTO_BAR = 0.9


def algorithms(comm: Any, names: Sequence[str] = ("ring",),
               trace: Trace | None = None) -> dict[str, Callable[[np.ndarray], Any]]:  # fmt: skip
    """The allreduce implementations to compare, each summing a buffer in place.

    The baseline is the library's Allreduce called directly (not `collectives.allreduce(...,
    "mpi")`, which first checks that the ranks' buffers agree). The others are called as the
    training loop calls them, with `check=False`: no agreement round before "auto" (the
    hand-written algorithms agree through their message tags, at no cost, either way).
    """
    mpi = constants(comm)
    in_place, add = mpi.IN_PLACE, mpi.SUM  # looked up once: the baseline pays no Python extra
    ops: dict[str, Callable[[np.ndarray], Any]] = {}
    for name in names:
        reduce_ = allreducer(comm, name, check=False)
        ops[name] = reduce_ if trace is None else functools.partial(reduce_, trace=trace)
    if "ring" in ops and trace is None:
        ops["ring"] = lambda buf: execute("ring", buf, comm)  # no dispatch in the way
    ops[BASELINE] = lambda buf: comm.Allreduce(in_place, buf, add)
    return ops


def with_control(comm: Any, ops: dict[str, Callable[[np.ndarray], Any]]
                 ) -> dict[str, Callable[[np.ndarray], Any]]:  # fmt: skip
    """`ops` and, last, the library's Allreduce again under the name CONTROL: in ABBA order the
    control then stands where the first algorithm stands, on the baseline's other side."""
    mpi = constants(comm)
    in_place, add = mpi.IN_PLACE, mpi.SUM
    return {**ops, CONTROL: lambda buf: comm.Allreduce(in_place, buf, add)}


def algorithm_list(text: str) -> list[str]:
    """ring,rabenseifner -> the hand-written algorithms (and auto) to time against the library."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    allowed = [name for name in ALGORITHMS if name != BASELINE]
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {', '.join(unknown) or text!r}: choose from {', '.join(allowed)}"
        )
    return list(dict.fromkeys(names))


def parse_bytes(text: str) -> int:
    """'8', '64K', '1M', '64MiB' -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = cleaned[-1:] if cleaned[-1:] in units else ""
    try:
        value = int(cleaned[: len(cleaned) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 8, 64K, 1M)"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return value


def message_sizes(min_bytes: int, max_bytes: int, itemsize: int) -> list[int]:
    """Powers of two from min_bytes to max_bytes, each at least one element."""
    sizes, size = [], max(itemsize, 1 << (max(min_bytes, 1) - 1).bit_length())
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def slowest(comm: Any, seconds: float) -> float:
    """The largest value of `seconds` over all ranks."""
    mpi = constants(comm)
    value = np.array([seconds])
    comm.Allreduce(mpi.IN_PLACE, value, op=mpi.MAX)
    return float(value[0])


def time_batch(comm: Any, op: Callable[[np.ndarray], Any], buf: np.ndarray, iters: int,
               what: str = "a timed batch of allreduces",
               laps: list[float] | None = None) -> float:  # fmt: skip
    """Per-op seconds of `iters` back-to-back calls, as seen by the slowest rank; `laps` gets
    this rank's time of each call.

    One untimed call first: the batches of different algorithms alternate, and the first call
    after another algorithm's pays for bringing this one's buffers back into the caches (at 8 MiB,
    with a few calls per batch, that alone moved the ratio of two identical library calls by 10%).
    """
    clock = time.perf_counter
    with watching(what):  # what --timeout names if the library's call hangs
        op(buf)
        comm.Barrier()
        start = lap = clock()
        for _ in range(iters):
            op(buf)
            if laps is not None:
                now = clock()
                laps.append(now - lap)
                lap = now
        return slowest(comm, (clock() - start) / iters)


def check_agreement(comm: Any, ops: dict[str, Callable], count: int, dtype: np.dtype) -> None:
    """Every algorithm must produce bitwise the baseline's sum of small integers."""
    rank = comm.Get_rank()
    data = ((np.arange(count) * 7 + rank * 3) % 64).astype(dtype)
    expected = data.copy()
    ops[BASELINE](expected)
    for name, op in ops.items():
        result = data.copy()
        op(result)
        if not np.array_equal(result, expected):
            raise RuntimeError(f"{name} allreduce disagrees with {BASELINE} at {count} elements")


def sweep(comm: Any, options: argparse.Namespace, report: Callable[[dict], None]) -> list[dict]:
    """Time every algorithm at every size; call `report` with each finished row."""
    size = comm.Get_size()
    dtype = np.dtype(options.dtype)
    ops = algorithms(comm, options.algorithms)
    if getattr(options, "check", False) and not isinstance(comm, ThreadComm):
        ops = with_control(comm, ops)
    rows = []
    for nbytes in message_sizes(options.min_bytes, options.max_bytes, dtype.itemsize):
        count = nbytes // dtype.itemsize
        with watching("the check of the algorithms against the library"):  # for --timeout
            check_agreement(comm, ops, count, dtype)
        buf = np.zeros(count, dtype)  # zeros: sums stay finite and free of denormals
        # Warm up, and size the batches so that one takes about --batch-seconds.
        warm = max(time_batch(comm, op, buf, options.warmup) for op in ops.values())
        iters = int(min(max(options.batch_seconds / max(warm, 1e-9), 1), options.max_iters))
        times: dict[str, list[float]] = {name: [] for name in ops}
        laps: dict[str, list[float]] = {name: [] for name in ops}  # this rank's, per call
        for batch in range(options.batches):
            order = list(ops) if batch % 2 == 0 else list(reversed(ops))  # ABBA interleaving
            for name in order:
                times[name].append(time_batch(comm, ops[name], buf, iters, laps=laps[name]))
        for name in ops:
            spread = stats.summarize(stats.gathered(comm, laps[name]))
            seconds = statistics.median(times[name])
            paired = [base / mine for base, mine in zip(times[BASELINE], times[name], strict=True)]
            algbw = nbytes / seconds / 1e9
            row = {
                "size_bytes": nbytes,
                "count": count,
                "dtype": dtype.name,
                "algorithm": name,
                "time_us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": stats.busbw("allreduce", algbw, size),
                # busbw / busbw_mpi, round by round (and defined at P = 1 too)
                "vs_mpi": statistics.median(paired),
                "vs_mpi_of_medians": statistics.median(times[BASELINE]) / seconds,
                "iters": iters,
                "batches": options.batches,
                **spread,
                "batch_us": [t * 1e6 for t in times[name]],  # JSON only
            }
            rows.append(row)
            report(row)
    return rows


COLUMNS = ("size_bytes", "count", "dtype", "algorithm", "time_us", "algbw_GBps", "busbw_GBps",
           "vs_mpi", "vs_mpi_of_medians")  # fmt: skip
CSV_COLUMNS = [*COLUMNS, *stats.FIELDS, "iters", "batches"]
HEADER = (
    f"{'size (B)':>10} {'count':>9} {'dtype':>7} {'algorithm':>18} {'time (us)':>10} "
    f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'paired':>7} {'medians':>7} {stats.HEADER}"
)


def format_row(row: dict, baseline: str = BASELINE) -> str:
    """A table line; the baseline's rows named `baseline` (on threads, what it really is)."""
    name = baseline if row["algorithm"] == BASELINE else row["algorithm"]
    return (
        f"{row['size_bytes']:>10} {row['count']:>9} {row['dtype']:>7} {name:>18} "
        f"{row['time_us']:>10.2f} {row['algbw_GBps']:>10.3f} {row['busbw_GBps']:>10.3f} "
        f"{row['vs_mpi']:>7.2f} {row['vs_mpi_of_medians']:>7.2f} {stats.format_fields(row)}"
    )


def performance_bar(rows: list[dict]) -> dict | None:
    """The ring's time ratio at 8 B, its worst busbw ratio from 1 MiB and auto's worst speed ratio
    at any size, against their bars (None for a measure the sweep has no rows for)."""
    ring = {row["size_bytes"]: row for row in rows if row["algorithm"] == "ring"}
    smallest = min(ring, default=None)
    if smallest is None or smallest > LATENCY_AT:
        smallest = latency = None  # the sweep has no latency-sized message
    else:
        latency = 1 / ring[smallest]["vs_mpi"]  # ring time / baseline time
    large = [row for size, row in ring.items() if size >= BUSBW_FROM]
    worst = min(large, key=lambda row: row["vs_mpi"]) if large else None
    auto = min((row for row in rows if row["algorithm"] == "auto"),
               key=lambda row: row["vs_mpi"], default=None)  # fmt: skip
    if latency is None and worst is None and auto is None:
        return None
    control = {row["size_bytes"]: row["vs_mpi"] for row in rows if row["algorithm"] == CONTROL}
    large_control = [ratio for size, ratio in control.items() if size >= BUSBW_FROM]
    return {
        "latency_bytes": smallest,
        "latency_ratio": latency,
        "latency_met": latency is None or latency <= LATENCY_BAR,
        "busbw_worst_bytes": worst["size_bytes"] if worst else None,
        "busbw_worst_ratio": worst["vs_mpi"] if worst else None,
        "busbw_met": worst is None or worst["vs_mpi"] >= BUSBW_BAR,
        "auto_worst_bytes": auto["size_bytes"] if auto else None,
        "auto_worst_ratio": auto["vs_mpi"] if auto else None,
        "auto_met": auto is None or auto["vs_mpi"] >= AUTO_BAR,
        # the library against itself, time at the latency size and from 1 MiB the range of busbw
        # ratios: what noise alone gave in this run
        "control_latency_ratio": 1 / control[smallest] if smallest in control else None,
        "control_range": [min(large_control), max(large_control)] if large_control else None,
    }


def bar_met(bar: dict) -> bool:
    """True if every measure of the bar that the sweep has was met."""
    return bar["latency_met"] and bar["busbw_met"] and bar["auto_met"]


def describe_bar(bar: dict) -> str:
    """The bar's verdict in one line."""
    verdict = {True: "met", False: "MISSED"}
    parts = []
    if bar["latency_bytes"] is not None:
        parts.append(
            f"ring/mpi time at {bar['latency_bytes']} B = {bar['latency_ratio']:.2f}x "
            f"(<= {LATENCY_BAR:g}x: {verdict[bar['latency_met']]})"
        )
    if bar["busbw_worst_bytes"] is not None:
        parts.append(
            f"worst ring/mpi busbw from {BUSBW_FROM >> 20} MiB = {bar['busbw_worst_ratio']:.2f}x "
            f"at {bar['busbw_worst_bytes']} B (>= {BUSBW_BAR:g}x: {verdict[bar['busbw_met']]})"
        )
    if bar["auto_worst_bytes"] is not None:
        parts.append(
            f"worst auto/mpi speed = {bar['auto_worst_ratio']:.2f}x at {bar['auto_worst_bytes']} B "
            f"(>= {AUTO_BAR:g}x: {verdict[bar['auto_met']]})"
        )
    if bar.get("control_latency_ratio"):
        parts.append(f"{CONTROL}/mpi time at {bar['latency_bytes']} B = "
                     f"{bar['control_latency_ratio']:.2f}x")  # fmt: skip
    if bar.get("control_range"):
        low, high = bar["control_range"]
        parts.append(f"{CONTROL}/mpi busbw from {BUSBW_FROM >> 20} MiB = {low:.2f}-{high:.2f}x")
    if bar.get("control_latency_ratio") or bar.get("control_range"):
        parts[-1] += " (the library against itself: the ratios' noise in this run)"
    return "# bar: " + "; ".join(parts)


def library_name(comm: Any) -> str:
    if isinstance(comm, ThreadComm):
        return "threads backend: comm.Allreduce is a NumPy sum of all ranks' buffers"
    from mpi4py import MPI

    # Open MPI's version string ends in a NUL byte, which would reach the header and the JSON
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]


def run(comm: Any, options: argparse.Namespace) -> dict | None:
    """The sweep on one rank; rank 0 prints the table, writes the files and returns the rows."""
    master_process = comm.Get_rank() == 0
    backend = "threads" if isinstance(comm, ThreadComm) else "mpi"
    baseline = THREADS_BASELINE if backend == "threads" else BASELINE
    nodes = hierarchy_line(comm, options)
    if master_process:
        print_header(comm, options, baseline, nodes)

    def report(row: dict) -> None:
        if master_process:
            print(format_row(row, baseline), flush=True)

    rows = sweep(comm, options, report)
    if master_process:
        print("\n".join(stats.definitions("allreduce")), flush=True)
    if baseline != BASELINE:  # the rows name the baseline as the table does
        rows = [{**row, "algorithm": baseline} if row["algorithm"] == BASELINE else row
                for row in rows]  # fmt: skip
    if options.timeline or options.timeline_png:
        traced_calls(comm, options)
    if not master_process:
        return None
    if backend == "mpi" and any(r["size_bytes"] >= MMAP_THRESHOLD for r in rows):
        print(
            f"# note: from {MMAP_THRESHOLD >> 20} MiB on, the MPI library's Allreduce may pay for "
            "fresh memory (glibc mmap) on every call while the hand-written algorithms reuse "
            "their cached scratch; a ratio above 1 there is not a win of the algorithm"
        )
    # The bar compares with an MPI library; on threads the baseline is only a NumPy sum.
    bar = performance_bar(rows) if backend == "mpi" else None
    if bar and options.check:  # the verdict is asked for; the JSON keeps it either way
        print(describe_bar(bar), flush=True)
    result = {
        "benchmark": "allreduce",
        "backend": backend,
        "ranks": comm.Get_size(),
        "dtype": options.dtype,
        "baseline": library_name(comm),
        "command": sys.argv,
        "rows": rows,
        "bar": bar,
    }
    write_outputs(options, result, f"allreduce, {comm.Get_size()} ranks, {backend} backend")
    return {"rows": rows, "bar": bar}


def write_outputs(options: argparse.Namespace, result: dict, title: str) -> None:
    """--json (everything), --csv (the rows, CSV_COLUMNS) and --png, those asked for."""
    stats.write_rows(options.json, options.csv, result, CSV_COLUMNS)
    if options.png:
        draw_png(result["rows"], options.png, title)


def print_header(comm: Any, options: argparse.Namespace, baseline: str, nodes: str | None
                 ) -> None:  # fmt: skip
    """The lines above the table: the run, the baseline, the nodes, what the columns hold."""
    backend = "threads" if isinstance(comm, ThreadComm) else "mpi"
    print(f"# allreduce sweep: {comm.Get_size()} ranks, {backend} backend, {options.dtype}")
    print(f"# baseline '{baseline}': {library_name(comm)}")
    if nodes:
        print(f"# {nodes}")
    print(f"# time: median over {options.batches} rounds of the slowest rank's per-op time")
    print(f"# {PAIRED}\n# {MEDIANS}")
    print(HEADER, flush=True)


def hierarchy_line(comm: Any, options: argparse.Namespace) -> str | None:
    """With "hierarchical" among the algorithms: find and keep the nodes (a collective call);
    what they are, in one line."""
    if "hierarchical" not in options.algorithms:
        return None
    spec = set_hierarchy(comm, options.ranks_per_node, options.inter_algorithm)
    nodes, per_node = len(spec.nodes), len(spec.nodes[0])
    found = "MPI's shared-memory split"
    if options.ranks_per_node:
        found = "--ranks-per-node"
    elif isinstance(comm, ThreadComm):
        found = "threads: one process"
    alone = "; one node: the ring" if nodes == 1 else ""
    return (f"hierarchical: {nodes} node(s) x {per_node} rank(s) ({found}), {spec.inter} between "
            f"the nodes{alone}")  # fmt: skip


def traced_calls(comm: Any, options: argparse.Namespace) -> None:
    """One traced call of every algorithm at every size, written as a Chrome trace (--timeline)."""
    timeline = Timeline(comm)
    ops = algorithms(comm, options.algorithms, trace=timeline.collective_step)
    dtype = np.dtype(options.dtype)
    for nbytes in message_sizes(options.min_bytes, options.max_bytes, dtype.itemsize):
        buf = np.zeros(nbytes // dtype.itemsize, dtype)
        for name, op in ops.items():
            with watching(f"the traced call of {name}"):  # what --timeout names
                comm.Barrier()  # calls one after the other, not overlapping, on the timeline
                start = time.perf_counter()
                op(buf)
            timeline.span(f"{name} {nbytes} B", "call", start, time.perf_counter(), bytes=nbytes)
    with tempfile.TemporaryDirectory(prefix="syncsgd-trace-") as scratch:
        path = options.timeline or os.path.join(scratch, "trace.json")
        write_timeline(comm, timeline, path)  # collective: rank 0 writes
        if options.timeline_png and comm.Get_rank() == 0:
            ranks = comm.Get_size()
            title = f"bench allreduce: a traced call per algorithm and size, {ranks} ranks"
            draw_gantt_file(path, options.timeline_png, title)


def draw_png(rows: list[dict], path: str, title: str) -> None:
    """Time and busbw against message size, one line per algorithm, written to `path`."""
    from syncsgd.util import figures

    figures.save(sweep_figure(rows, title), path)


def sweep_figure(rows: list[dict], title: str) -> Any:
    """The slide: time and busbw against size, each algorithm in its colour, marker and dashes."""
    from syncsgd.util import figures

    figure = figures.new_figure(layout="constrained")
    time_axes, busbw_axes = figure.subplots(1, 2)
    for index, name in enumerate(dict.fromkeys(row["algorithm"] for row in rows)):
        mine = [row for row in rows if row["algorithm"] == name]
        sizes = [row["size_bytes"] for row in mine]
        style = {"linewidth": 2.2, "markersize": 8, **figures.algorithm_style(name, index)}
        time_axes.plot(sizes, [row["time_us"] for row in mine], label=name, **style)
        busbw_axes.plot(sizes, [row["busbw_GBps"] for row in mine], label=name, **style)
    time_axes.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (µs)")
    busbw_axes.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)")
    handles, labels = time_axes.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4),
                  fontsize=figures.TEXT_POINTS, frameon=False)  # fmt: skip
    for axes in (time_axes, busbw_axes):
        figures.slide_axes(axes)
    figure.suptitle(title, fontsize=figures.TEXT_POINTS + 2)
    return figure


CHECK_HELP = (
    f"exit with status 1 if a bar is missed (MPI backend): the ring's time at 8 B "
    f"<= {LATENCY_BAR:g}x MPI's and its busbw >= {BUSBW_BAR:g}x MPI's from 1 MiB; auto's speed "
    f">= {AUTO_BAR:g}x MPI's at every size (with --algorithms auto); the library's Allreduce is "
    f"also timed against itself ('{CONTROL}'), to show the ratios' noise"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd bench allreduce`."""
    parser.epilog = (
        f"Columns: time = median per-op time of the slowest rank; {RATIOS_EXPLAINED}. The "
        f"baseline is the library's Allreduce under MPI, a NumPy sum ('{THREADS_BASELINE}') on "
        f"the threads backend."
    )
    RANKS.add(parser, help="thread ranks (threads backend; default 2); under mpiexec, -n decides")
    BACKEND.add(parser)
    TIMEOUT.add(parser)
    parser.add_argument("--dtype", choices=("float64", "float32", "int64"), default="float64")
    parser.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest size (8)")
    parser.add_argument(
        "--max-bytes", type=parse_bytes, default=64 << 20, help="largest size (64M)"
    )
    parser.add_argument(
        "--batches",
        type=positive_int,
        default=15,
        help="timed rounds per size, one batch of each algorithm per round; medians (15)",
    )
    parser.add_argument(
        "--batch-seconds",
        type=positive_float,
        default=0.01,
        help="target duration of one batch in seconds (0.01)",
    )
    parser.add_argument("--warmup", type=positive_int, default=5, help="warm-up calls (5)")
    parser.add_argument(
        "--max-iters", type=positive_int, default=2000, help="most calls in one batch (2000)"
    )
    JSON.add(parser, help="write the results as JSON")
    writes(parser.add_argument("--csv", metavar="PATH", help="write the rows as CSV"))
    writes(parser.add_argument("--png", metavar="PATH", type=figure_path,
                               help="plot time and busbw against size (.png, .svg or .pdf)"))
    parser.add_argument(
        "--algorithms",
        type=algorithm_list,
        default=["ring"],
        help="hand-written algorithms to time against the library's, e.g. "
        "ring,recursive-doubling,rabenseifner,tree,naive,hierarchical,auto (default ring)",
    )
    parser.add_argument("--ranks-per-node", type=positive_int, metavar="R",
                        help="--algorithms hierarchical: nodes of R consecutive ranks (default: "
                        "MPI's shared-memory split; thread ranks are one node)")  # fmt: skip
    parser.add_argument("--inter-algorithm", choices=INTER_ALGORITHMS, default="ring",
                        help="--algorithms hierarchical: the allreduce among the nodes (ring)")
    writes(parser.add_argument("--timeline", metavar="PATH",
                               help="after the sweep, one traced call per algorithm and size as "
                               "a Chrome trace (one row per rank, a span per step)"))  # fmt: skip
    writes(parser.add_argument("--timeline-png", metavar="PATH", type=figure_path,
                               help="the same traced calls as a Gantt chart per rank: .png, "
                               ".svg or .pdf"))  # fmt: skip
    parser.add_argument("--check", action="store_true", help=CHECK_HELP)


def main(options: argparse.Namespace) -> int:
    """Run the sweep on the backend the options ask for."""
    if options.min_bytes > options.max_bytes:
        raise ValueError(f"--min-bytes {options.min_bytes} exceeds --max-bytes {options.max_bytes}")
    if options.png or options.timeline_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RuntimeError("--png needs matplotlib: pip install 'syncsgd[plot]'") from None
    ranks = options.ranks
    if ranks is None and options.backend != "mpi":
        ranks = 2 if resolve_backend(options.backend) == "threads" else None
    # Each rank in this process holds the buffer, scratch of about its size and, on threads, the
    # baseline's sum: refuse now rather than fail at the largest size after the smaller ones.
    check_memory(3 * options.max_bytes * (ranks or 1), f"messages of {options.max_bytes} bytes")
    result = launch(within_timeout(run, options.timeout), options, backend=options.backend,
                    ranks=ranks)[0]  # fmt: skip
    bar = result and result["bar"]
    if options.check and bar and not bar_met(bar):
        print("syncsgd: the performance bar was missed (see the '# bar' line)", file=sys.stderr)
        return 1
    return 0
