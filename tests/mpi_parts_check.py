"""Broadcast, reduce, allgather, reduce-scatter and alltoall checked on every rank of any
communicator (thread ranks in test_collective_parts.py, MPI.COMM_WORLD under mpiexec).

Under `mpiexec -n P python tests/mpi_parts_check.py` every algorithm runs on the cases of
`part_cases` and is compared with the MPI library's own collective (Bcast, Reduce, Allgather,
Reduce_scatter_block, Alltoall); rank 0 prints `ok: P ranks`, or the job aborts with status 1.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from mpi_worker import rank_data, run_on_world, same_on_every_rank

from syncsgd.collectives import (
    COLLECTIVES,
    allgather,
    alltoall,
    broadcast,
    reduce,
    reduce_scatter,
)
from syncsgd.comm.world import constants

BLOCKS = (0, 1, 3)  # block lengths: empty, one element (a buffer of P), odd


def check_broadcast(comm: Any, algorithm: str, root: int, shape: tuple[int, ...], dtype: str,
                    seed: int = 0) -> np.ndarray:  # fmt: skip
    """Every rank ends with the root's data, in place, bit for bit."""
    rank = comm.Get_rank()
    buf = rank_data(rank, shape, dtype, False, seed)
    expected = rank_data(root, shape, dtype, False, seed)
    where = f"broadcast {algorithm}: root {root}, rank {rank} of {comm.Get_size()}, {shape}"
    assert broadcast(buf, comm, root, algorithm=algorithm) is buf, where
    assert buf.tobytes() == expected.tobytes(), where
    return buf


def check_reduce(comm: Any, algorithm: str, root: int, length: int, dtype: str) -> np.ndarray:
    """The root ends with the closed-form sum of ranks; the other ranks' buffers are untouched."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = (np.arange(length) + rank).astype(dtype)  # element i: sum over r of i + r
    before = buf.copy()
    before.flags.writeable = False
    if rank != root:  # any input will do: read-only, strided
        buf = np.repeat(buf, 2)[::2]
        buf.flags.writeable = False
    reduce(buf, comm, root, algorithm=algorithm)
    where = f"reduce {algorithm}: root {root}, rank {rank} of {size}, length {length}"
    if rank == root:
        expected = size * np.arange(length) + size * (size - 1) // 2
        assert np.array_equal(buf, expected.astype(dtype)), (where, buf)
    else:
        assert np.array_equal(buf, before), where
    return buf


def check_allgather(comm: Any, algorithm: str, block: int, dtype: str) -> np.ndarray:
    """Block r of the result is rank r's data, alike on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = np.full(block, rank, dtype)
    gathered = allgather(mine, comm, algorithm=algorithm)
    where = f"allgather {algorithm}: rank {rank} of {size}, block {block}"
    assert gathered.shape == (size * block,) and gathered.dtype == mine.dtype, where
    assert np.array_equal(gathered, np.repeat(np.arange(size), block).astype(dtype)), where
    into = np.zeros((size, block), dtype)  # a given recvbuf keeps its shape
    assert allgather(mine, comm, into, algorithm=algorithm) is into, where
    assert np.array_equal(into.reshape(-1), gathered), where
    return gathered


def check_reduce_scatter(comm: Any, algorithm: str, block: int, dtype: str) -> np.ndarray:
    """Rank r gets block r of the sum: the closed form, element i of the sum is P i + P(P-1)/2."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sendbuf = (np.arange(size * block) + rank).astype(dtype)
    before = sendbuf.copy()
    part = reduce_scatter(sendbuf, comm, algorithm=algorithm)
    where = f"reduce_scatter {algorithm}: rank {rank} of {size}, block {block}"
    total = size * np.arange(size * block) + size * (size - 1) // 2
    assert np.array_equal(part, total[rank * block : (rank + 1) * block].astype(dtype)), (
        where, part,
    )  # fmt: skip
    assert np.array_equal(sendbuf, before), f"{where}: sendbuf changed"
    return part


def check_alltoall(comm: Any, block: int, dtype: str) -> np.ndarray:
    """Block i of rank r's result is block r of rank i's data."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sendbuf = (100 * rank + np.arange(size * block)).astype(dtype)
    got = alltoall(sendbuf, comm)
    expected = np.concatenate(
        [100 * i + np.arange(rank * block, (rank + 1) * block) for i in range(size)] or [[]]
    ).astype(dtype)
    assert np.array_equal(got, expected), f"alltoall: rank {rank} of {size}, block {block}"
    return got


def check_every_part(comm: Any, dtype: str = "int64") -> None:
    """Every collective and algorithm on blocks of 0, 1, 3 elements, every root."""
    size = comm.Get_size()
    for block in BLOCKS:
        for algorithm in COLLECTIVES["allgather"]:
            check_allgather(comm, algorithm, block, dtype)
        for algorithm in COLLECTIVES["reduce-scatter"]:
            check_reduce_scatter(comm, algorithm, block, dtype)
        check_alltoall(comm, block, dtype)
    for root in range(size):
        for length in (0, max(size - 1, 1), 2 * size + 1):  # empty, shorter than P, odd
            for algorithm in COLLECTIVES["broadcast"]:
                check_broadcast(comm, algorithm, root, (length,), dtype, seed=root)
            for algorithm in COLLECTIVES["reduce"]:
                check_reduce(comm, algorithm, root, length, dtype)


def check_against_library(comm: Any) -> None:
    """Each algorithm gives the bits of the MPI library's own collective (integer-valued data)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mpi = constants(comm)
    for block in (0, 5):
        data = rank_data(rank, (size * block,), "float64", True, 7)
        library = np.empty(block)
        comm.Reduce_scatter_block(data, library, op=mpi.SUM)
        for algorithm in COLLECTIVES["reduce-scatter"]:
            assert reduce_scatter(data, comm, algorithm=algorithm).tobytes() == library.tobytes()
        mine = data[:block].copy()
        library = np.empty(size * block)
        comm.Allgather(mine, library)
        for algorithm in COLLECTIVES["allgather"]:
            assert allgather(mine, comm, algorithm=algorithm).tobytes() == library.tobytes()
        library = np.empty(size * block)
        comm.Alltoall(data, library)
        assert alltoall(data, comm).tobytes() == library.tobytes()
    for root in range(size):
        data = rank_data(rank, (2 * size + 1,), "float64", True, root)
        library = data.copy()
        comm.Bcast(library, root)
        for algorithm in COLLECTIVES["broadcast"]:
            assert broadcast(data.copy(), comm, root, algorithm=algorithm).tobytes() == (
                library.tobytes()
            )  # fmt: skip
        library = np.empty_like(data)
        comm.Reduce(data, library, op=mpi.SUM, root=root)
        for algorithm in COLLECTIVES["reduce"]:
            summed = reduce(data.copy(), comm, root, algorithm=algorithm)
            assert rank != root or summed.tobytes() == library.tobytes(), (algorithm, root)
    assert same_on_every_rank(comm, np.zeros(1))


def main(argv: list[str]) -> int:
    """Run the checks on MPI.COMM_WORLD; any failure aborts every rank with exit status 1."""

    def checks(comm: Any) -> None:
        check_every_part(comm, "int64")
        check_every_part(comm, "float32")
        check_against_library(comm)

    return run_on_world(checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
