"""Ring allreduce checks that run on every rank of any communicator (thread ranks or MPI).

The thread tests import these functions; under `mpiexec -n P python tests/mpi_ring_check.py` they
run on `MPI.COMM_WORLD`, print `ok` on rank 0 and exit 0, or abort the whole job with exit status 1
on the first failure (an assertion on one rank must not leave the other ranks waiting).

    --mismatch        buffers that differ across ranks (MISMATCHES: longer, float32, ...): every
                      rank must raise ValueError for each, print it, and the job must end
    --mismatch-uncaught  the same, but nobody catches the ValueError: the job must exit non-zero
    --fail-on-rank K  rank K fails on purpose: the job must exit non-zero, not hang
"""

from __future__ import annotations

import sys
from typing import Any

import mpi_worker
import numpy as np
from mpi_worker import DTYPES, float32_on_last_rank, longer_on_last_rank, run_on_world

from syncsgd.collectives.ring import TraceEvent, ring_allreduce


def check_sum(
    comm: Any, shape: tuple[int, ...], dtype: str, integers: bool, seed: int = 0
) -> np.ndarray:
    """The ring's sum equals a naive sum (exactly for integer data) and is the same on all ranks."""
    return mpi_worker.check_sum(comm, ring_allreduce, "ring", shape, dtype, integers, seed)


def check_trace(comm: Any, length: int, dtype: str = "float64") -> list[TraceEvent]:
    """2(P-1) events per rank, in phase order, with array_split's chunks and the right bytes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    events: list[TraceEvent] = []
    ring_allreduce(np.ones(length, dtype), comm, trace=events.append)
    assert len(events) == 2 * (size - 1), f"rank {rank}: {len(events)} events"
    # The chunks of numpy.array_split, the independent reference for the ranges.
    pieces = np.array_split(np.arange(length), size)
    chunk_range = [(int(p[0]), int(p[-1]) + 1) if p.size else None for p in pieces]
    itemsize = np.dtype(dtype).itemsize
    phases = ["reduce-scatter"] * (size - 1) + ["allgather"] * (size - 1)
    for index, event in enumerate(events):
        step = index % (size - 1)
        assert (event.phase, event.step, event.rank) == (phases[index], step, rank), event
        if event.phase == "reduce-scatter":
            sent, received = (rank - step) % size, (rank - step - 1) % size
        else:
            sent, received = (rank + 1 - step) % size, (rank - step) % size
        assert (event.send_chunk, event.recv_chunk) == (sent, received), event
        for chunk, (start, stop) in ((sent, event.send_range), (received, event.recv_range)):
            expected = chunk_range[chunk]
            assert (start, stop) == expected or (expected is None and start == stop), event
        assert event.nbytes == (event.send_range[1] - event.send_range[0]) * itemsize, event
        assert event.start <= event.end, event
    # Reduce-scatter receives every chunk but this rank's own; allgather then fills in every
    # chunk but the one this rank finished: together with it they cover the whole buffer.
    gathered = np.zeros(length, np.int64)
    for event in events[size - 1 :]:
        gathered[event.recv_range[0] : event.recv_range[1]] += 1
    if size > 1:
        finished = chunk_range[(rank + 1) % size]
        if finished is not None:
            gathered[finished[0] : finished[1]] += 1
    assert size == 1 or np.all(gathered == 1), f"rank {rank}: allgather does not cover the buffer"
    reduced = {event.recv_chunk for event in events[: size - 1]}
    assert reduced == set(range(size)) - {rank}, f"rank {rank}: reduce-scatter got {reduced}"
    return events


def check_rejected_everywhere(comm: Any, make_buffer: Any) -> str:
    """Every rank raises ValueError for its buffer `make_buffer(rank, size)`; return the message."""
    return mpi_worker.check_rejected_everywhere(comm, ring_allreduce, "ring", make_buffer)


def int64_on_last_rank(rank: int, size: int) -> np.ndarray:
    """Seven float64, but int64 on the last rank: the same bytes, only the tag can tell."""
    return np.ones(7, np.int64 if rank == size - 1 else np.float64)


def strided_on_last_rank(rank: int, size: int) -> np.ndarray:
    """Seven float64, but not contiguous on the last rank."""
    return np.ones(14)[::2] if rank == size - 1 else np.ones(7)


def read_only_on_rank_0(rank: int, size: int) -> np.ndarray:
    """Seven float64, read-only on rank 0."""
    buf = np.ones(7)
    buf.flags.writeable = rank != 0
    return buf


# Buffers that differ across ranks, or are unusable on one: every rank must raise ValueError.
MISMATCHES = {
    "longer": longer_on_last_rank,
    "float32": float32_on_last_rank,
    "int64": int64_on_last_rank,
    "strided": strided_on_last_rank,
    "read-only": read_only_on_rank_0,
}


def standard_cases(size: int) -> list[tuple[tuple[int, ...], str, bool]]:
    """The (shape, dtype, integer-valued) cases run under MPI: edge lengths around P, shapes."""
    lengths = sorted({0, 1, max(size - 1, 0), size, size + 1, 2 * size + 3, 1000, 4099})
    cases = [((n,), dtype, True) for n in lengths for dtype in DTYPES]
    cases += [((n,), dtype, False) for n in (1, 7, 4099) for dtype in ("float64", "float32")]
    cases += [((3, 5), "float64", True), ((2, 3, 4), "int64", True), ((), "float32", True)]
    cases += [((4, 0), "float64", True), ((1 << 16,), "float64", False)]
    return cases


def main(argv: list[str]) -> int:
    """Run the checks on MPI.COMM_WORLD; any failure aborts every rank with exit status 1."""

    def checks(comm: Any) -> None:
        rank, size = comm.Get_rank(), comm.Get_size()
        if "--fail-on-rank" in argv:
            if rank == int(argv[argv.index("--fail-on-rank") + 1]):
                raise AssertionError("failing on purpose")
            ring_allreduce(np.zeros(10), comm)  # the other ranks wait here for the failed one
        elif "--mismatch-uncaught" in argv:
            ring_allreduce(longer_on_last_rank(rank, size), comm)  # must raise on every rank
            raise SystemExit("ring_allreduce returned although the lengths differ")
        elif "--mismatch" in argv:
            if size == 1:
                raise SystemExit("--mismatch needs at least 2 ranks")
            lines = [
                f"rank {rank}: {name}: ValueError: {check_rejected_everywhere(comm, make)}\n"
                for name, make in MISMATCHES.items()
            ]
            sys.stdout.write("".join(lines))  # one write: no interleaving
            sys.stdout.flush()
        else:
            for shape, dtype, integers in standard_cases(size):
                check_sum(comm, shape, dtype, integers, seed=len(shape) + sum(shape))
            for length in sorted({0, 1, size - 1, size + 2, 37}):
                check_trace(comm, length)

    return run_on_world(checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
