"""broadcast, reduce, allgather, reduce_scatter and alltoall: hand-written schedules run by the
allreduces' executor, with mpi4py's buffer conventions.

The buffers, the algorithms and their costs: docs/collectives.md.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from syncsgd.collectives.api import _agree
from syncsgd.collectives.executor import DTYPE_CODE, Trace, buffer_defect, execute
from syncsgd.collectives.schedules import PART_SCHEDULES, Collective

# Each collective's hand-written algorithms, the default first.
COLLECTIVES = {name: tuple(algorithms) for name, algorithms in PART_SCHEDULES.items()}


def _input_defect(buf: Any, name: str) -> str:
    """Why `buf` cannot be read as the input of `name` ("" if it can: it is copied, any layout)."""
    if isinstance(buf, np.ndarray) and buf.dtype in DTYPE_CODE:
        return ""
    return buffer_defect(buf, name) or ""


def _output_defect(buf: Any, dtype: np.dtype, count: int, name: str) -> str:
    """Why `buf` cannot receive `count` elements of `dtype` ("" if it can)."""
    defect = buffer_defect(buf, name)
    if defect:
        return defect.replace("the array", "recvbuf")
    if buf.dtype != dtype:
        return f"{name}: recvbuf has dtype {buf.dtype}, sendbuf {dtype}"
    if buf.size != count:
        return f"{name}: recvbuf holds {buf.size} elements, {count} expected"
    return ""


NO_ROOT = object()  # a collective without a root (allgather, ...), unlike a root of None


def _agreed(name: str, algorithm: str, buf: Any, comm: Any, check: bool, defect: str,
            root: Any = NO_ROOT) -> Collective:  # fmt: skip
    """The schedule's key, after every rank agreed on buffers, algorithm and root (or raised)."""
    function, size = name.replace("-", "_"), comm.Get_size()
    known = COLLECTIVES[name]
    if algorithm not in known and not defect:
        defect = f"{function}: unknown algorithm {algorithm!r} (choose one of {', '.join(known)})"
    alike = [("algorithm", known.index(algorithm) if algorithm in known else -1)]
    rank = 0
    if root is not NO_ROOT:
        rank, wrong = _root(function, root, size)
        defect = defect or wrong
        alike.append(("root", rank))
    if check:
        _agree(buf, comm, function, defect, tuple(alike), known)
    elif defect:
        raise ValueError(defect)
    return Collective(name, algorithm, rank)


def _root(function: str, root: Any, size: int) -> tuple[int, str]:
    """(the root as a rank, or -1; why it is not one of the `size` ranks, or "")."""
    try:
        rank = operator.index(root)
    except TypeError:
        rank = None
    if rank is None or isinstance(root, bool):  # None, 1.0, "1", True: no rank
        return -1, f"{function}: root must be a rank, an integer from 0 to {size - 1}, not {root!r}"
    if not 0 <= rank < size:
        return -1, f"{function}: root {rank} is not a rank of a communicator of size {size}"
    return rank, ""


def _flat(buf: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array (np.matrix & co. as plain arrays)."""
    return buf.view(np.ndarray).reshape(-1)


def broadcast(buf: np.ndarray, comm: Any, root: int = 0, *, algorithm: str = "ring",
              trace: Trace | None = None, check: bool = True) -> np.ndarray:  # fmt: skip
    """Copy rank `root`'s `buf` into `buf` on every rank in place, as `comm.Bcast(buf, root)`."""
    key = _agreed("broadcast", algorithm, buf, comm, check, buffer_defect(buf, "broadcast") or "",
                  root)  # fmt: skip
    return execute(key, buf, comm, trace)


def reduce(buf: np.ndarray, comm: Any, root: int = 0, *, algorithm: str = "ring",
           trace: Trace | None = None, check: bool = True) -> np.ndarray:  # fmt: skip
    """Sum `buf` over all ranks into `buf` on rank `root`; other ranks' `buf` stays as it was."""
    mine = comm.Get_rank() == root
    defect = (buffer_defect(buf, "reduce") or "") if mine else _input_defect(buf, "reduce")
    key = _agreed("reduce", algorithm, buf, comm, check, defect, root)
    # Off the root, the partial sums go into a copy, as MPI's Reduce leaves sendbuf alone.
    execute(key, buf if mine else np.asarray(buf).flatten(), comm, trace)
    return buf


def allgather(sendbuf: np.ndarray, comm: Any, recvbuf: np.ndarray | None = None, *,
              algorithm: str = "ring", trace: Trace | None = None,
              check: bool = True) -> np.ndarray:  # fmt: skip
    """Every rank's `sendbuf` into `recvbuf` on every rank, rank r's as block r (P x its size
    elements; a new 1-D array if None), as `comm.Allgather(sendbuf, recvbuf)`; returns recvbuf."""
    size, rank = comm.Get_size(), comm.Get_rank()
    defect = _input_defect(sendbuf, "allgather")
    if not defect and recvbuf is not None:
        defect = _output_defect(recvbuf, sendbuf.dtype, size * sendbuf.size, "allgather")
    key = _agreed("allgather", algorithm, sendbuf, comm, check, defect)
    if recvbuf is None:
        recvbuf = np.empty(size * sendbuf.size, sendbuf.dtype)
    gathered, block = _flat(recvbuf), sendbuf.size
    gathered[rank * block : (rank + 1) * block] = sendbuf.reshape(-1)
    execute(key, gathered, comm, trace)
    return recvbuf


def reduce_scatter(sendbuf: np.ndarray, comm: Any, recvbuf: np.ndarray | None = None, *,
                   algorithm: str = "ring", trace: Trace | None = None,
                   check: bool = True) -> np.ndarray:  # fmt: skip
    """Block r of P equal blocks of the sum of `sendbuf` over all ranks, into `recvbuf` on rank r
    (a new 1-D array if None), as `comm.Reduce_scatter_block(sendbuf, recvbuf)`; returns it.

    The length of `sendbuf` must be a multiple of P, as for MPI_Reduce_scatter_block.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    defect = _input_defect(sendbuf, "reduce_scatter")
    if not defect and sendbuf.size % size:
        defect = (f"reduce_scatter: {sendbuf.size} elements do not split into {size} equal blocks "
                  "(the length must be a multiple of the number of ranks)")  # fmt: skip
    block = 0 if defect else sendbuf.size // size
    if not defect and recvbuf is not None:
        defect = _output_defect(recvbuf, sendbuf.dtype, block, "reduce_scatter")
    key = _agreed("reduce-scatter", algorithm, sendbuf, comm, check, defect)
    if recvbuf is None:
        recvbuf = np.empty(block, sendbuf.dtype)
    partial = np.asarray(sendbuf).flatten()  # a copy: MPI leaves sendbuf alone
    execute(key, partial, comm, trace)
    _flat(recvbuf)[:] = partial[rank * block : (rank + 1) * block]
    return recvbuf


def alltoall(sendbuf: np.ndarray, comm: Any, recvbuf: np.ndarray | None = None, *,
             algorithm: str = "pairwise", trace: Trace | None = None,
             check: bool = True) -> np.ndarray:  # fmt: skip
    """Block j of `sendbuf` (P equal blocks) to rank j, rank i's block r into block i of
    `recvbuf` (a new 1-D array if None), as `comm.Alltoall(sendbuf, recvbuf)`; returns it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    defect = _input_defect(sendbuf, "alltoall")
    if not defect and sendbuf.size % size:
        defect = (f"alltoall: {sendbuf.size} elements do not split into {size} equal blocks "
                  "(the length must be a multiple of the number of ranks)")  # fmt: skip
    if not defect and recvbuf is not None:
        defect = _output_defect(recvbuf, sendbuf.dtype, sendbuf.size, "alltoall")
    key = _agreed("alltoall", algorithm, sendbuf, comm, check, defect)
    if recvbuf is None:
        recvbuf = np.empty(sendbuf.size, sendbuf.dtype)
    n, block = sendbuf.size, sendbuf.size // size
    both = np.empty(2 * n, sendbuf.dtype)  # blocks sent, then blocks received
    both[:n] = sendbuf.reshape(-1)
    both[n + rank * block : n + (rank + 1) * block] = both[rank * block : (rank + 1) * block]
    execute(key, both, comm, trace)
    _flat(recvbuf)[:] = both[n:]
    return recvbuf
