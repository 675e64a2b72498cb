"""The collectives' contract checks, run on every rank of any communicator (threads or MPI).

The thread tests (test_collectives.py) import these functions; under `mpiexec -n P python
tests/mpi_collectives_check.py` the same checks run on `MPI.COMM_WORLD` for every algorithm, rank 0
prints `ok: P ranks` and the job exits 0, or it aborts with exit status 1 on the first failure.

    --mismatch           for every algorithm and every buffer of MISMATCHES, every rank must raise
                         ValueError and print `rank R: ALGORITHM: NAME: ValueError: ...`
    --mismatch-uncaught  ring_allreduce on lengths that differ, uncaught: the job must exit non-zero
    --fail-on-rank K     rank K fails on purpose: the job must exit non-zero, not hang
"""

from __future__ import annotations

import sys
from typing import Any

import mpi_worker
import numpy as np
from mpi_worker import DTYPES, float32_on_last_rank, longer_on_last_rank, run_on_world

from syncsgd.collectives import ALGORITHMS, TraceEvent, allreduce, ring_allreduce

HAND_WRITTEN = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")


def reducer(algorithm: str) -> mpi_worker.Reduce:
    """allreduce(buf, comm) with `algorithm`."""
    return lambda buf, comm: allreduce(buf, comm, algorithm)


def check_sum(
    comm: Any, algorithm: str, shape: tuple[int, ...], dtype: str, integers: bool, seed: int = 0
) -> np.ndarray:
    """The sum equals a naive sum (exactly for integer data) and is the same on every rank."""
    return mpi_worker.check_sum(comm, reducer(algorithm), algorithm, shape, dtype, integers, seed)


def check_rejected_everywhere(comm: Any, algorithm: str, make_buffer: Any) -> str:
    """Every rank raises a one-line ValueError for `make_buffer(rank, size)`; return the message."""
    return mpi_worker.check_rejected_everywhere(comm, reducer(algorithm), algorithm, make_buffer)


def sum_cases(size: int) -> list[tuple[tuple[int, ...], str, bool]]:
    """(shape, dtype, integer-valued) cases: lengths 0, 1, around P and p', odd, long; shapes."""
    lengths = sorted({0, 1, max(size - 1, 0), size, size + 1, 2 * size + 3, 1000, 4099})
    cases = [((n,), dtype, True) for n in lengths for dtype in DTYPES]
    cases += [((n,), dtype, False) for n in (1, 7, 4099) for dtype in ("float64", "float32")]
    cases += [((3, 5), "float64", True), ((2, 3, 4), "int64", True), ((), "float32", True)]
    return cases + [((4, 0), "float64", True), ((1 << 16,), "float64", False)]


def folding(rank: int, size: int) -> tuple[int, bool, bool]:
    """(log2 p', folded, sits out): MPICH's non-power-of-two pre-step, from its description."""
    levels = size.bit_length() - 1
    extra = size - (1 << levels)
    folded = rank < 2 * extra
    return levels, folded, folded and rank % 2 == 0


def expected_phases(algorithm: str, rank: int, size: int) -> list[tuple[str, int]]:
    """The (phase, step) of every event `rank` should report, in order (an independent list)."""
    if size == 1:
        return []
    if algorithm == "ring":
        return [(phase, s) for phase in ("reduce-scatter", "allgather") for s in range(size - 1)]
    if algorithm == "naive":
        if rank == 0:
            return [(phase, s) for phase in ("reduce", "broadcast") for s in range(size - 1)]
        return [("reduce", rank - 1), ("broadcast", rank - 1)]
    if algorithm == "tree":  # heap order: rank i's children are 2i+1, 2i+2
        depth, height = int(np.log2(rank + 1)), int(np.log2(size))
        children = sum(child < size for child in (2 * rank + 1, 2 * rank + 2))
        up = [("reduce", height - depth - 1)] * children + [("reduce", height - depth)] * (rank > 0)
        return up + [("broadcast", depth - 1)] * (rank > 0) + [("broadcast", depth)] * children
    levels, folded, sits_out = folding(rank, size)
    fold, unfold = [("fold", 0)] * folded, [("unfold", 0)] * folded
    if sits_out:
        return fold + unfold
    if algorithm == "recursive-doubling":
        return fold + [("exchange", k) for k in range(levels)] + unfold
    assert algorithm == "rabenseifner", algorithm
    halving = [("reduce-scatter", k) for k in range(levels)]
    return fold + halving + [("allgather", k) for k in range(levels)] + unfold


def check_trace(comm: Any, algorithm: str, length: int, dtype: str = "float64") -> list[TraceEvent]:
    """The events follow the algorithm's steps, with consistent ranges and bytes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    events: list[TraceEvent] = []
    allreduce(np.ones(length, dtype), comm, algorithm, trace=events.append)
    where = f"{algorithm}: rank {rank} of {size}, length {length}"
    phases = [(event.phase, event.step) for event in events]
    assert phases == expected_phases(algorithm, rank, size), f"{where}: {phases}"
    itemsize = np.dtype(dtype).itemsize
    for event in events:
        assert event.rank == rank, (where, event)
        for chunk, (start, stop) in ((event.send_chunk, event.send_range),
                                     (event.recv_chunk, event.recv_range)):  # fmt: skip
            assert 0 <= start <= stop <= length, (where, event)
            assert chunk >= 0 or start == stop, (where, event)
        assert event.nbytes == (event.send_range[1] - event.send_range[0]) * itemsize, event
        assert event.start <= event.end, event
        assert event.send_chunk >= 0 or event.recv_chunk >= 0, f"{where}: an empty step {event}"
    if algorithm in ("naive", "tree", "recursive-doubling"):  # whole buffers only
        for event in events:
            assert (0, length) in (event.send_range, event.recv_range), (where, event)
    if algorithm == "rabenseifner" and not folding(rank, size)[2]:
        check_halving_and_doubling(events, length, size, where)
    if algorithm == "ring":
        check_ring_chunks(events, length, rank, size)
    return events


def check_ring_chunks(events: list[TraceEvent], length: int, rank: int, size: int) -> None:
    """The ring's chunks are numpy.array_split's, moved as the textbook says."""
    pieces = np.array_split(np.arange(length), size)
    chunk_range = [(int(p[0]), int(p[-1]) + 1) if p.size else None for p in pieces]
    for event in events:
        step = event.step
        if event.phase == "reduce-scatter":
            sent, received = (rank - step) % size, (rank - step - 1) % size
        else:
            sent, received = (rank + 1 - step) % size, (rank - step) % size
        assert (event.send_chunk, event.recv_chunk) == (sent, received), event
        for chunk, (start, stop) in ((sent, event.send_range), (received, event.recv_range)):
            expected = chunk_range[chunk]
            assert (start, stop) == expected or (expected is None and start == stop), event
    # Reduce-scatter receives every chunk but this rank's own; allgather then fills in every
    # chunk but the one this rank finished: together with it they cover the whole buffer.
    gathered = np.zeros(length, np.int64)
    for event in events[size - 1 :]:
        gathered[event.recv_range[0] : event.recv_range[1]] += 1
    finished = chunk_range[(rank + 1) % size]
    if size > 1 and finished is not None:
        gathered[finished[0] : finished[1]] += 1
    assert size == 1 or np.all(gathered == 1), f"rank {rank}: allgather does not cover the buffer"
    reduced = {event.recv_chunk for event in events[: size - 1]}
    assert size == 1 or reduced == set(range(size)) - {rank}, f"rank {rank}: got {reduced}"


def check_halving_and_doubling(events: list[TraceEvent], length: int, size: int, where: str):
    """Reduce-scatter halves the range kept; allgather then fills in all of the rest once."""
    halving = [event for event in events if event.phase == "reduce-scatter"]
    kept = (0, length)
    for event in halving:
        sent, received = event.send_range, event.recv_range
        # The range kept so far, cut in two: one half sent, the other received and kept.
        assert sent[1] == received[0] or received[1] == sent[0], (where, event)
        assert min(sent[0], received[0]) == kept[0], (where, event)
        assert max(sent[1], received[1]) == kept[1], (where, event)
        kept = received
    pof2 = 1 << (size.bit_length() - 1)
    pieces = np.array_split(np.arange(length), pof2)
    assert kept[1] - kept[0] in {piece.size for piece in pieces}, f"{where}: kept {kept}"
    covered = np.zeros(length, np.int64)
    covered[kept[0] : kept[1]] += 1
    for event in events:
        if event.phase == "allgather":
            covered[event.recv_range[0] : event.recv_range[1]] += 1
    assert np.all(covered == 1), f"{where}: allgather does not fill the buffer exactly once"


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


def read_only_on_last_rank(rank: int, size: int) -> np.ndarray:
    """Six zeros, read-only on the last rank."""
    buf = np.zeros(6)
    buf.flags.writeable = rank != size - 1
    return buf


# Buffers that differ across ranks, or are unusable on one: every rank must raise ValueError.
MISMATCHES = {
    "longer": longer_on_last_rank,
    "float32": float32_on_last_rank,
    "int64": int64_on_last_rank,
    "strided": strided_on_last_rank,
    "read-only": read_only_on_rank_0,
    "read-only-last": read_only_on_last_rank,
}


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
                f"rank {rank}: {algorithm}: {name}: ValueError: "
                f"{check_rejected_everywhere(comm, algorithm, make)}\n"
                for algorithm in ALGORITHMS
                for name, make in MISMATCHES.items()
            ]
            sys.stdout.write("".join(lines))  # one write: no interleaving
            sys.stdout.flush()
        else:
            for algorithm in ALGORITHMS:
                for index, (shape, dtype, integers) in enumerate(sum_cases(size)):
                    check_sum(comm, algorithm, shape, dtype, integers, seed=index)
            for algorithm in HAND_WRITTEN:
                for length in sorted({0, 1, max(size - 1, 0), size + 2, 37}):
                    check_trace(comm, algorithm, length)

    return run_on_world(checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
