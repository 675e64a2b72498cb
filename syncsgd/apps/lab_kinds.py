"""The lab's exercises: for each kind, the student's function, its contract, its stub and hints,
what every rank must hold afterwards, and the fewest bytes a rank can move.

Every kind works on one buffer in place, as `MPI_IN_PLACE` does, with the block layout of
syncsgd's own schedules (syncsgd/collectives/schedules.py): block b of an n-element buffer is
chunk b of `numpy.array_split(buffer, P)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Expected = list[tuple[np.ndarray, "np.ndarray | None"]]  # per rank: values, the mask that counts

COMM_CONTRACT = """\
    comm  one rank's communicator, with mpi4py's buffer methods: comm.Get_rank(),
          comm.Get_size(), comm.Send(buf, dest, tag=0), comm.Recv(buf, source, tag),
          comm.Sendrecv(sendbuf, dest, sendtag=0, recvbuf=None, source=..., recvtag=...),
          comm.Isend(buf, dest, tag) and comm.Irecv(buf, source, tag), whose requests have
          .Wait(). Nothing else (no Bcast, no Allreduce): the collective is yours to write.
          It is the thread ranks' communicator, or MPI's under `mpiexec ... --mpi`; on threads
          a Send completes only when its receiver has the bytes (as MPI's Ssend), so an answer
          that relies on MPI buffering a Send deadlocks there and is told so."""


@dataclass(frozen=True)
class Kind:
    """One exercise of the lab."""

    name: str  # the --kind
    function: str  # the stub's function, the default FUNCTION
    about: str  # one line: what the function does
    expected: Callable[[list[np.ndarray], int], Expected]  # (inputs, root) -> per rank
    bound: Callable[[int, int], float]  # (n bytes, P) -> fewest bytes the busiest rank moves
    bound_text: str  # the bound as a formula
    library: Callable[[np.ndarray, Any, int], Any]  # (buf, comm, root): syncsgd's own, in place
    library_name: str  # what the time names it
    mpi: Callable[[np.ndarray, Any, int], Any]  # (buf, comm, root): the MPI library's own
    stub: str  # the file `lab new` writes
    rooted: bool = False  # the function takes a root rank third
    same_bits: bool = True  # every rank must hold the same bits
    multiple: bool = False  # the length is a multiple of P


def call(kind: Kind, function: Any, buf: np.ndarray, comm: Any, root: int) -> None:
    """Call the student's `function` as the kind's contract says."""
    if kind.rooted:
        function(buf, comm, root)
    else:
        function(buf, comm)


def total(inputs: list[np.ndarray]) -> np.ndarray:
    """The sum of the ranks' buffers in float64: what a float result is compared with."""
    out = np.zeros(inputs[0].shape, np.float64)
    for array in inputs:
        out += array.astype(np.float64)
    return out


def _allreduce_expected(inputs: list[np.ndarray], root: int) -> Expected:
    whole = total(inputs)
    return [(whole, None) for _ in inputs]


def _ring(buf: np.ndarray, comm: Any, root: int) -> Any:
    from syncsgd.collectives import allreduce

    return allreduce(buf, comm, "ring")


def _mpi_allreduce(buf: np.ndarray, comm: Any, root: int) -> Any:
    from mpi4py import MPI

    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


RING_STUB = '''"""Lab: the ring allreduce. Write `allreduce` below, then grade it (0: it holds):

    syncsgd lab check {file} --kind ring-allreduce
    mpiexec -n 4 syncsgd lab check {file} --kind ring-allreduce --mpi
"""

import numpy as np


def allreduce(buf, comm):
    """Sum `buf` over every rank of `comm` in place: afterwards every rank's `buf` holds the
    element-wise sum of all the ranks' buffers, the same bits on every rank. Returns nothing.

    buf   a 1-D, C-contiguous NumPy array of n elements, float32 or float64; the same n and
          dtype on every rank. n may be 0, or smaller than the number of ranks P.
{comm}

    The grader checks every P from 1 to 9 and many n against the true sum (within float
    rounding: your order of additions may differ from the library's), counts the bytes each
    rank sends and receives against the ring's 2(P-1)/P * n, and times you against
    syncsgd's own ring.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    # Round 0 (no messages) - the chunks: split the n elements into P chunks, as
    #   np.array_split does (some are empty when n < P). Keep a scratch array for what arrives.
    # Rounds 1 .. P-1 - reduce-scatter: in round s (s = 0 .. P-2) send chunk (rank - s) % P to
    #   the right neighbour (rank + 1) % P, receive chunk (rank - s - 1) % P from the left one
    #   into the scratch array, and add it to your own copy of that chunk. Sendrecv does both
    #   at once; a Send before a Recv on every rank would have every rank wait for a receiver.
    #   After the last of these rounds, rank r holds the whole sum of chunk (r + 1) % P.
    # Rounds P .. 2P-2 - allgather: in round s (s = 0 .. P-2) send chunk (rank + 1 - s) % P to
    #   the right, receive chunk (rank - s) % P from the left and copy it into place. No adds:
    #   each chunk's sum was computed once, so every rank ends with the same bits.
    raise NotImplementedError("write the ring allreduce")
'''


KINDS: dict[str, Kind] = {
    "ring-allreduce": Kind(
        name="ring-allreduce", function="allreduce",
        about="sum a buffer over every rank, in place, as a ring (reduce-scatter, allgather)",
        expected=_allreduce_expected, bound=lambda n, p: 2 * (p - 1) / p * n,
        bound_text="2(P-1)/P·n", library=_ring, library_name="ring", mpi=_mpi_allreduce,
        stub=RING_STUB,
    ),
}  # fmt: skip


def stub_text(kind: Kind, file_name: str) -> str:
    """The stub `lab new` writes for `kind` as `file_name`."""
    return kind.stub.format(file=file_name, comm=COMM_CONTRACT)
