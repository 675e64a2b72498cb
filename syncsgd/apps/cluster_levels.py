"""The two levels of an MPI job's nodes, measured the way the two-level allreduce uses them.

`python -m syncsgd.apps.cluster_levels DIR [--min-bytes B --max-bytes B --batches K]`, under an
mpiexec of N nodes x R ranks (`syncsgd cluster --levels DIR` runs it), times the ring allreduce on
three sets of communicators, every rank of the job running or waiting as it would in the two-level
allreduce, and writes each as a `bench allreduce --json` sweep of the ring that `syncsgd model
--intra-fit/--inter-fit/--shared-fit` fits:

    DIR/intra.json     the ring inside every node, all nodes at once (ranks = R)
    DIR/shared.json    the ring among the ranks of one local index, all R local indices at once:
                       R rings over every node's one link (ranks = N)
    DIR/link.json      the ring among the ranks of local index 0 alone, one flow per link, the
                       other ranks waiting (ranks = N)

and, in the same rounds, what the model predicts from them, on all N x R ranks:

    DIR/measured.json  the flat ring and the hierarchical allreduce (`model --measured`)

Each time is the slowest rank's per-call time of a batch; per size the median over the rounds,
each of which times every size and kind once, so that the load of other jobs falls on all alike.
docs/cluster.md derives the model from them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("intra", "shared", "link", "ring", "hierarchical")
LEVELS = KINDS[:3]
BATCH_SECONDS = 0.02  # target length of one timed batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes and rounds of the level sweeps (the same flags as `bench allreduce`'s)."""
    from syncsgd.apps.bench.allreduce import parse_bytes

    parser.add_argument("--min-bytes", type=parse_bytes, default=16 << 10,
                        help="smallest size (16K)")  # fmt: skip
    parser.add_argument("--max-bytes", type=parse_bytes, default=8 << 20,
                        help="largest size (8M)")  # fmt: skip
    parser.add_argument("--batches", type=positive, default=7,
                        help="timed batches per size and level; medians (7)")


class SweepParser(argparse.ArgumentParser):
    """The level sweep's options: a bad one is a ValueError (one line from the caller)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"--levels: {message} (after --: --min-bytes, --max-bytes, --batches)")


def sweep_arguments(given: list[str]) -> list[str]:
    """The sweep's options after `syncsgd cluster --levels DIR --`, checked; ValueError if one is
    unknown or its value bad."""
    parser = SweepParser(prog="syncsgd cluster --levels", add_help=False)
    add_arguments(parser)
    parsed = parser.parse_args(given)
    if parsed.min_bytes > parsed.max_bytes:
        raise ValueError("--levels: --min-bytes is larger than --max-bytes")
    return given


def positive(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def level_communicators(world: Any) -> tuple[Any, Any, int, int]:
    """(this rank's node, the ranks of its local index on every node, N, R): ValueError, on
    every rank, if the nodes differ in size."""
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = node.Get_size()
    sizes = world.allgather(per_node)
    if len(set(sizes)) != 1:
        raise ValueError(f"nodes of unequal size ({sorted(set(sizes))} ranks): the levels need "
                         "nodes of R ranks each")  # fmt: skip
    across = world.Split(node.Get_rank(), world.Get_rank())
    return node, across, world.Get_size() // per_node, per_node


def batch_seconds(world: Any, call: Callable[[], Any] | None, count: int) -> float:
    """Per-call seconds of `count` back-to-back calls, as seen by the slowest rank (ranks with
    no `call` wait for the others)."""
    from mpi4py import MPI

    world.Barrier()
    start = time.perf_counter()
    if call is not None:
        for _ in range(count):
            call()
    spent = np.array([(time.perf_counter() - start) / count])
    world.Allreduce(MPI.IN_PLACE, spent, op=MPI.MAX)
    return float(spent[0])


def sweep(world: Any, sizes: list[int], batches: int) -> dict[str, list[dict[str, Any]]]:
    """Per level, one row per size: the median, least and largest per-call time."""
    from syncsgd.collectives import allreduce

    node, across, _, _ = level_communicators(world)
    plan = []  # (size, kind, the call or None on a rank that waits, calls per batch)
    for size in sizes:
        buf = np.zeros(size // 8, np.float64)  # zeros: the sums stay zero however many calls
        calls = {"intra": functools.partial(allreduce, buf, node, "ring"),
                 "shared": functools.partial(allreduce, buf, across, "ring"),
                 "link": functools.partial(allreduce, buf, across, "ring")
                 if node.Get_rank() == 0 else None,
                 "ring": functools.partial(allreduce, buf, world, "ring"),
                 "hierarchical": functools.partial(allreduce, buf, world, "hierarchical")}
        plan += [(size, kind, call, calibrate(world, call)) for kind, call in calls.items()]
    times: dict[tuple[int, str], list[float]] = {(size, kind): [] for size, kind, _, _ in plan}
    # Every round times every size and kind once: a burst of other jobs' load, seconds long,
    # falls on all of them alike, not on the few sizes that a sweep size by size was timing.
    for _ in range(batches):
        for size, kind, call, count in plan:
            times[size, kind].append(batch_seconds(world, call, count))
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for (size, kind), found in times.items():
        rows[kind].append({"algorithm": "ring" if kind in LEVELS else kind, "size_bytes": size,
                           "time_us": statistics.median(found) * 1e6,
                           "iter_min_us": min(found) * 1e6, "iter_max_us": max(found) * 1e6})
    return rows


def calibrate(world: Any, call: Callable[[], Any] | None) -> int:
    """Calls per batch: about BATCH_SECONDS by one warm-up call's slowest rank, 1 to 50."""
    once = batch_seconds(world, call, 1)
    return max(1, min(50, int(BATCH_SECONDS / max(once, 1e-9))))


def write(directory: str, rows: dict[str, list[dict[str, Any]]], nodes: int, per_node: int,
          load: list[float]) -> None:  # fmt: skip
    """One `bench allreduce --json`-shaped file per level in `directory`, and measured.json."""
    ranks = {"intra": per_node, "shared": nodes, "link": nodes, "measured": nodes * per_node}
    pairs = zip(rows["ring"], rows["hierarchical"], strict=True)
    files = {**{kind: rows[kind] for kind in LEVELS},
             "measured": [row for pair in pairs for row in pair]}  # fmt: skip
    for name, found in files.items():
        document = {"benchmark": "allreduce", "level": name, "ranks": ranks[name],
                    "nodes": nodes, "ranks_per_node": per_node, "load_average": load,
                    "rows": found}  # fmt: skip
        path = os.path.join(directory, f"{name}.json")
        with open(path + ".part", "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
        os.replace(path + ".part", path)


def main(argv: list[str] | None = None) -> int:
    """Measure the levels under MPI; rank 0 writes DIR/{intra,shared,link,measured}.json."""
    from mpi4py import MPI

    from syncsgd.apps.bench.allreduce import message_sizes

    parser = argparse.ArgumentParser(prog="python -m syncsgd.apps.cluster_levels")
    parser.add_argument("directory", metavar="DIR")
    add_arguments(parser)
    options = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        if not os.path.isdir(options.directory):
            raise ValueError(f"{options.directory}: not a directory")
        before = os.getloadavg()[0]
        _, _, nodes, per_node = level_communicators(world)
        sizes = message_sizes(options.min_bytes, options.max_bytes, 8)
        rows = sweep(world, sizes, options.batches)
    except ValueError as exc:
        if world.Get_rank() == 0:
            print(f"cluster_levels: {exc}", file=sys.stderr)
        return 2
    if world.Get_rank() == 0:
        write(options.directory, rows, nodes, per_node, [before, os.getloadavg()[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
