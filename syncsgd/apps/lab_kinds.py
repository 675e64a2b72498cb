"""The lab's exercises: for each kind, the student's function, its contract, its stub and hints,
what every rank must hold afterwards, and the fewest bytes a rank can move.

Every kind works on one buffer in place, as `MPI_IN_PLACE` does, with the block layout of
syncsgd's own schedules (syncsgd/collectives/schedules.py): block b of an n-element buffer is
chunk b of `numpy.array_split(buffer, P)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

Expected = list[tuple[np.ndarray, "np.ndarray | None"]]  # per rank: values, the mask that counts


class Case(NamedTuple):
    """One run of an answer: P ranks, rank r starting from inputs[r]."""

    size: int
    dtype: str
    inputs: tuple[np.ndarray, ...]
    root: int = 0
    extra: tuple = ()  # what else a kind's case holds (ddp-step: batch, seed, exact, lr)

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
    expected: Callable[[Case], Expected]  # per rank: what it must hold
    bound: Callable[[int, int], float]  # (n bytes, P) -> fewest bytes the busiest rank moves
    bound_text: str  # the bound as a formula
    library: Callable[[np.ndarray, Any, Case], Any]  # (buf, comm, case): syncsgd's own, in place
    library_name: str  # what the time names it
    mpi: Callable[[np.ndarray, Any, Case], Any]  # (buf, comm, case): the MPI library's own
    stub: str  # the file `lab new` writes
    rooted: bool = False  # the function takes a root rank third
    same_bits: bool = True  # every rank must hold the same bits
    multiple: bool = False  # the length is a multiple of P
    slack: float = 1.25  # the busiest rank may move this much more than the bound
    # A kind whose cases are not buffers of numbers (ddp-step) says how to make and show them:
    arguments: Callable[[Case, Any], tuple] | None = None  # the function's other arguments
    cases: Any = None  # drawn(sizes), standard(sizes), cost(size), timed(size), shown(case)
    bitwise: Callable[[Case], bool] | None = None  # whether a case's result must be bit-exact


def call(kind: Kind, function: Any, buf: np.ndarray, comm: Any, case: Case) -> None:
    """Call the student's `function` as the kind's contract says."""
    if kind.arguments is not None:
        function(buf, comm, *kind.arguments(case, comm))
    elif kind.rooted:
        function(buf, comm, case.root)
    else:
        function(buf, comm)


def total(inputs: list[np.ndarray]) -> np.ndarray:
    """The sum of the ranks' buffers in float64: what a float result is compared with."""
    out = np.zeros(inputs[0].shape, np.float64)
    for array in inputs:
        out += array.astype(np.float64)
    return out


def _allreduce_expected(case: Case) -> Expected:
    inputs = list(case.inputs)
    whole = total(inputs)
    return [(whole, None) for _ in inputs]


def _ring(buf: np.ndarray, comm: Any, case: Case) -> Any:
    from syncsgd.collectives import allreduce

    return allreduce(buf, comm, "ring")


def _mpi_allreduce(buf: np.ndarray, comm: Any, case: Case) -> Any:
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


def _blocks(length: int, size: int) -> list[slice]:
    """Block b of a buffer of `length` elements on `size` ranks (numpy.array_split's chunks)."""
    from syncsgd.collectives.schedules import chunk_bounds

    bounds = chunk_bounds(length, size)
    return [slice(bounds[b], bounds[b + 1]) for b in range(size)]


def _only(mask_of: slice | None, length: int) -> np.ndarray:
    """A mask: True on the elements of `mask_of` (None: none)."""
    mask = np.zeros(length, bool)
    if mask_of is not None:
        mask[mask_of] = True
    return mask


def _broadcast_expected(case: Case) -> Expected:
    inputs, root = list(case.inputs), case.root
    return [(inputs[root].astype(np.float64), None) for _ in inputs]


def _reduce_expected(case: Case) -> Expected:
    inputs, root = list(case.inputs), case.root
    whole, length = total(inputs), inputs[0].size
    return [(whole, None if rank == root else _only(None, length))
            for rank in range(len(inputs))]  # fmt: skip


def _allgather_expected(case: Case) -> Expected:
    inputs = list(case.inputs)
    gathered = np.zeros(inputs[0].size)
    for rank, block in enumerate(_blocks(inputs[0].size, len(inputs))):
        gathered[block] = inputs[rank][block]
    return [(gathered, None) for _ in inputs]


def _reduce_scatter_expected(case: Case) -> Expected:
    inputs = list(case.inputs)
    whole, length = total(inputs), inputs[0].size
    return [(whole, _only(block, length))
            for block in _blocks(length, len(inputs))]  # fmt: skip


def _alltoall_expected(case: Case) -> Expected:
    inputs = list(case.inputs)
    blocks = _blocks(inputs[0].size, len(inputs))
    out: Expected = []
    for rank in range(len(inputs)):
        received = np.zeros(inputs[0].size)
        for source, block in enumerate(blocks):
            received[block] = inputs[source][blocks[rank]]
        out.append((received, None))
    return out


def _library_part(name: str) -> Callable[[np.ndarray, Any, Case], Any]:
    """syncsgd's own `name` on the lab's one buffer (n a multiple of P, as the timed case)."""

    def run(buf: np.ndarray, comm: Any, case: Case) -> Any:
        from syncsgd import collectives

        root, size, rank = case.root, comm.Get_size(), comm.Get_rank()
        block = buf.size // size
        if name in ("broadcast", "reduce"):
            return getattr(collectives, name)(buf, comm, root)
        if name == "allgather":
            return collectives.allgather(buf[rank * block : (rank + 1) * block].copy(), comm, buf)
        if name == "reduce-scatter":
            mine = buf[rank * block : (rank + 1) * block]
            return collectives.reduce_scatter(buf, comm, np.empty_like(mine))
        return collectives.alltoall(buf.copy(), comm, buf)

    return run


def _mpi_part(name: str) -> Callable[[np.ndarray, Any, Case], Any]:
    """The MPI library's own `name` on the lab's one buffer, in place where MPI allows it."""

    def run(buf: np.ndarray, comm: Any, case: Case) -> Any:
        from mpi4py import MPI

        root = case.root
        mine = comm.Get_rank() == root
        if name == "broadcast":
            return comm.Bcast(buf, root)
        if name == "reduce":
            return comm.Reduce(MPI.IN_PLACE if mine else buf, buf if mine else None, MPI.SUM, root)
        if name == "allgather":
            return comm.Allgather(MPI.IN_PLACE, buf)
        if name == "reduce-scatter":
            return comm.Reduce_scatter_block(MPI.IN_PLACE, buf, MPI.SUM)
        return comm.Alltoall(MPI.IN_PLACE, buf)

    return run


PART_STUB = '''"""Lab: TITLE. Write `FUNCTION` below, then grade it (0: it holds):

    syncsgd lab check {file} --kind KIND
    mpiexec -n 4 syncsgd lab check {file} --kind KIND --mpi
"""

import numpy as np


def SIGNATURE:
    """CONTRACT

    buf   a 1-D, C-contiguous NumPy array of n elements, float32 or float64; the same n and
          dtype on every rank. Block b is chunk b of np.array_split(buf, P).BLOCKS
{comm}

    The grader checks P from 1 to 9 and many n (0, fewer than P, ...) against the true result,
    times you against syncsgd's own, and counts the bytes each rank sends and receives
    against BOUND.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
HINTS    raise NotImplementedError("write TITLE")
'''


def _part_stub(kind: str, function: str, title: str, signature: str, contract: str,
               hints: str, bound: str, blocks: str = "") -> str:  # fmt: skip
    """A stub of another collective, from PART_STUB."""
    text = PART_STUB
    for key, value in (("SIGNATURE", signature), ("CONTRACT", contract), ("HINTS", hints),
                       ("BOUND", bound), ("BLOCKS", blocks), ("FUNCTION", function),
                       ("TITLE", title), ("KIND", kind)):  # fmt: skip
        text = text.replace(key, value)
    return text


BROADCAST_STUB = _part_stub(
    "broadcast", "broadcast", "a pipelined ring broadcast", "broadcast(buf, comm, root)",
    "Copy rank `root`'s `buf` into `buf` on every rank, in place (MPI's Bcast). Returns\n"
    "    nothing. root is a rank, the same on every rank.",
    "    # Round 0 - number the ranks from the root: v = (rank - root) % P; pass blocks on to\n"
    "    #   (rank + 1) % P, receive them from (rank - 1) % P.\n"
    "    # Rounds 1 .. 2P-2 - a pipeline: the rank v receives block c from its left neighbour in\n"
    "    #   round c + v - 1 and passes it right in round c + v, while the next block arrives.\n"
    "    #   Blocks, not the whole buffer: each rank sends n in all, and the last rank (v = P-1)\n"
    "    #   sends nothing. Whole-buffer sends from the root cost it (P-1)n; a binomial tree\n"
    "    #   costs it log2(P)n.\n",
    "n: each rank receives the buffer once (up to 2n passes)")
REDUCE_STUB = _part_stub(
    "reduce", "reduce", "a pipelined ring reduce", "reduce(buf, comm, root)",
    "Sum `buf` over every rank into `buf` on rank `root`, in place (MPI's Reduce with\n"
    "    IN_PLACE on the root). The other ranks' buf may hold anything afterwards. Returns\n"
    "    nothing.",
    "    # Round 0 - number the ranks from the root: v = (rank - root) % P. Partial sums travel\n"
    "    #   towards the root, from (rank + 1) % P to (rank - 1) % P: v = P-1 starts.\n"
    "    # Rounds 1 .. 2P-2 - a pipeline, as broadcast's backwards: the rank v receives block c\n"
    "    #   from the rank behind it, adds its own block c, and passes the sum on one round\n"
    "    #   later; the farthest rank (v = P-1) only sends, the root only receives and adds.\n",
    "n: each rank's data leaves it once (up to 2n passes)")
ALLGATHER_STUB = _part_stub(
    "allgather", "allgather", "the ring allgather", "allgather(buf, comm)",
    "Gather every rank's block into every rank's `buf`, in place (MPI's Allgather with\n"
    "    IN_PLACE): on entry rank r's own data is its block r (its other blocks hold anything);\n"
    "    afterwards block b holds rank b's block b on every rank. Returns nothing.",
    "    # Rounds 1 .. P-1 - around the ring: in round s (s = 0 .. P-2) send block (rank - s) % P\n"
    "    #   to (rank + 1) % P and receive block (rank - s - 1) % P from (rank - 1) % P, straight\n"
    "    #   into its place. Each block moves P-1 times, each rank sends (P-1)/P n in all.\n",
    "(P-1)/P·n")
REDUCE_SCATTER_STUB = _part_stub(
    "reduce-scatter", "reduce_scatter", "the ring reduce-scatter", "reduce_scatter(buf, comm)",
    "Sum block r of every rank's `buf` into block r of rank r's `buf`, in place (MPI's\n"
    "    Reduce_scatter_block with IN_PLACE, the blocks left where they are); the other blocks\n"
    "    may hold anything afterwards. Returns nothing.",
    "    # Rounds 1 .. P-1 - around the ring: in round s (s = 0 .. P-2) send block\n"
    "    #   (rank - s - 1) % P to (rank + 1) % P, receive block (rank - s - 2) % P from\n"
    "    #   (rank - 1) % P into a scratch array and add it to your own. Block b starts at rank\n"
    "    #   b + 1 and reaches rank b, whole, after P-1 rounds.\n",
    "(P-1)/P·n")
ALLTOALL_STUB = _part_stub(
    "alltoall", "alltoall", "a pairwise alltoall", "alltoall(buf, comm)",
    "Exchange blocks, in place (MPI's Alltoall with IN_PLACE): on entry block j of rank r's\n"
    "    `buf` is for rank j; afterwards block i of rank r's buf holds what rank i had in its\n"
    "    block r. Returns nothing.",
    "    # Round 0 - keep a copy of the buffer: the blocks you receive land where blocks you\n"
    "    #   have not sent yet are. Your own block r stays where it is.\n"
    "    # Rounds 1 .. P-1 - pairwise: in round s send your block (rank + s) % P to that rank\n"
    "    #   and receive from rank (rank - s) % P into block (rank - s) % P. Sendrecv: every rank\n"
    "    #   sends and receives in every round.\n",
    "(P-1)/P·n", "\n          Here n is a multiple of P: every block has n/P elements.")


def _part(name: str, function: str, about: str, expected: Any, bound: Callable[[int, int], float],
          bound_text: str, stub: str, **flags: Any) -> Kind:  # fmt: skip
    library = "pairwise" if name == "alltoall" else "ring"
    return Kind(name=name, function=function, about=about, expected=expected, bound=bound,
                bound_text=bound_text, library=_library_part(name), library_name=library,
                mpi=_mpi_part(name), stub=stub, **flags)  # fmt: skip


def _share(n: int, p: int) -> float:
    return (p - 1) / p * n


KINDS: dict[str, Kind] = {
    "ring-allreduce": Kind(
        name="ring-allreduce", function="allreduce",
        about="sum a buffer over every rank, in place, as a ring (reduce-scatter, allgather)",
        expected=_allreduce_expected, bound=lambda n, p: 2 * (p - 1) / p * n,
        bound_text="2(P-1)/P·n", library=_ring, library_name="ring", mpi=_mpi_allreduce,
        stub=RING_STUB,
    ),
    "broadcast": _part(
        "broadcast", "broadcast", "copy the root's buffer to every rank, in place",
        _broadcast_expected, lambda n, p: float(n) * (p > 1), "n", BROADCAST_STUB,
        rooted=True, slack=2.0),
    "reduce": _part(
        "reduce", "reduce", "sum every rank's buffer into the root's, in place",
        _reduce_expected, lambda n, p: float(n) * (p > 1), "n", REDUCE_STUB,
        rooted=True, same_bits=False, slack=2.0),
    "allgather": _part(
        "allgather", "allgather", "every rank's block to every rank, in place",
        _allgather_expected, _share, "(P-1)/P·n", ALLGATHER_STUB),
    "reduce-scatter": _part(
        "reduce-scatter", "reduce_scatter", "the sum of block r on rank r, in place",
        _reduce_scatter_expected, _share, "(P-1)/P·n", REDUCE_SCATTER_STUB, same_bits=False),
    "alltoall": _part(
        "alltoall", "alltoall", "block j of rank r to block r of rank j, in place",
        _alltoall_expected, _share, "(P-1)/P·n", ALLTOALL_STUB, same_bits=False, multiple=True),
}  # fmt: skip


# Every kind --kind takes: ddp-step's is in lab_ddp (it imports syncsgd.nn: only when used).
NAMES = (*KINDS, "ddp-step")


def stub_text(kind: Kind, file_name: str) -> str:
    """The stub `lab new` writes for `kind` as `file_name`."""
    return kind.stub.format(file=file_name, comm=COMM_CONTRACT)
