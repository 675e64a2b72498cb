"""What the MPI check scripts share: rank data, a naive reference sum, checks, the job wrapper.

mpi_ring_check.py and mpi_collectives_check.py run their checks on any communicator (thread ranks
in the tests, MPI.COMM_WORLD under mpiexec); `run_on_world` turns a failure on one rank into the
end of the whole job, so that no rank is left waiting.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd.comm.world import constants

DTYPES = ("float64", "float32", "int64")

Reduce = Callable[[np.ndarray, Any], np.ndarray]  # allreduce(buf, comm), in place


def rank_data(
    rank: int, shape: tuple[int, ...], dtype: str, integers: bool, seed: int
) -> np.ndarray:
    """The buffer rank `rank` contributes: small integers (exact sums) or random floats."""
    rng = np.random.default_rng([seed, rank])
    if integers or dtype == "int64":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


def naive_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of the ranks' buffers, one after the other, in float64 or int64."""
    wide = np.int64 if arrays[0].dtype.kind == "i" else np.float64
    total = np.zeros(arrays[0].shape, wide)
    for array in arrays:
        total = total + array.astype(wide)
    return total


def same_on_every_rank(comm: Any, array: np.ndarray) -> bool:
    """True on every rank when every rank's `array` has rank 0's bits (its bytes, compared)."""
    mine = np.frombuffer(array.tobytes(), np.uint8)
    root = mine.copy()
    comm.Bcast(root, root=0)
    agree = np.array([np.array_equal(mine, root)], np.int64)
    every = np.zeros(1, np.int64)
    comm.Allreduce(agree, every, op=constants(comm).MIN)
    return bool(every[0])


def check_sum(
    comm: Any, reduce: Reduce, label: str, shape: tuple[int, ...], dtype: str, integers: bool,
    seed: int,
) -> np.ndarray:  # fmt: skip
    """`reduce` sums like a naive sum (exactly for integer data), in place, alike on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = rank_data(rank, shape, dtype, integers, seed)
    expected = naive_sum([rank_data(r, shape, dtype, integers, seed) for r in range(size)])
    result = reduce(buf, comm)
    where = f"{label}: rank {rank} of {size}, shape {shape}, {dtype}"
    assert result is buf, f"{where}: the buffer reduced in place must be returned"
    assert buf.shape == tuple(shape) and buf.dtype == np.dtype(dtype), where
    if integers or dtype == "int64":
        assert np.array_equal(buf, expected), f"{where}: integer-valued sum is not exact"
    else:
        tolerance = 1e-5 if dtype == "float32" else 1e-12
        assert np.allclose(buf, expected, rtol=tolerance, atol=tolerance * size), where
    assert same_on_every_rank(comm, buf), f"{where}: ranks hold different bits"
    return buf


def check_rejected_everywhere(comm: Any, reduce: Reduce, label: str, make_buffer: Any) -> str:
    """Every rank raises a one-line ValueError for `make_buffer(rank, size)`; return the message."""
    buf = make_buffer(comm.Get_rank(), comm.Get_size())
    try:
        reduce(buf, comm)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {comm.Get_rank()}: {label} accepted a bad buffer")
    assert message and "\n" not in message, f"not a one-line message: {message!r}"
    return message


def longer_on_last_rank(rank: int, size: int) -> np.ndarray:
    """Five elements, but 4096 more on the last rank: same tag signature, different sizes."""
    return np.ones(5 + 4096 * (rank == size - 1 and size > 1))


def float32_on_last_rank(rank: int, size: int) -> np.ndarray:
    """Seven float64, but float32 on the last rank: messages whose size is not a multiple of 8."""
    return np.ones(7, np.float32 if rank == size - 1 else np.float64)


def run_on_world(checks: Callable[[Any], None]) -> int:
    """Run checks(MPI.COMM_WORLD); any failure aborts every rank with exit status 1.

    Rank 0 prints `ok: P ranks` when every rank passed.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        checks(comm)
        comm.Barrier()
    except BaseException as exc:
        # One write, summary first, and a moment for the launcher to forward it before Abort
        # tears the job down (output written just before MPI_Abort can be lost).
        sys.stderr.write(f"rank {rank} of {size} failed: {exc!r}\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(0.2)
        comm.Abort(1)
    if rank == 0:  # one write (print writes the newline apart): lines of ranks never interleave
        sys.stdout.write(f"ok: {size} ranks\n")
        sys.stdout.flush()
    return 0
