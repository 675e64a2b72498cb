"""The ring allreduce: reduce-scatter then allgather, each P-1 `Sendrecv` steps with the neighbours.

The flattened buffer is cut into P chunks whose sizes differ by at most one (as
`numpy.array_split`). In reduce-scatter step s, rank r sends chunk (r - s) mod P to its right
neighbour and adds the chunk (r - s - 1) mod P that arrives from its left neighbour; after P-1 steps
rank r holds chunk (r + 1) mod P summed over all ranks. In allgather step s it forwards chunk
(r + 1 - s) mod P and stores the finished chunk (r - s) mod P. Every rank sends 2(P-1)/P of the
buffer in all, the bandwidth-optimal amount. Each finished chunk was summed once, in one order, and
then copied, so every rank ends with bitwise the same array.

Agreement for free: every message's MPI tag carries a signature of the sender's buffer (length mod
4096 and dtype) and a "something is wrong" flag. A rank whose left neighbour's signature or message
size differs from its own, or whose own buffer is unusable, raises the flag in every later message,
and the flag travels around the whole ring before the 2(P-1) steps end (a mismatch is seen in step 0,
and it needs at most P-1 hops). All ranks always take part in all 2(P-1) steps, so every rank raises
the same kind of error - no rank is left waiting, and no rank returns a silently wrong sum - at the
cost of no extra message. (Lengths that differ by a multiple of 4096 on more than 2048 ranks could
slip past the step-0 check; the byte counts of later steps still catch most of them.)

Receives use `ANY_TAG` from the left neighbour: do not leave point-to-point messages from the left
neighbour unreceived on `comm` across the call (or give the ring its own `comm.Dup()`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from syncsgd.comm import MessageTruncated, constants

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64))
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES)}
_NO_DTYPE = 3  # the code of an unusable buffer
_LENGTH_MODULUS = 4096  # signature = (length mod 4096) * 4 + dtype code < 2**14; tag < 2**15


class TraceEvent(NamedTuple):
    """What one rank did in one step of a collective."""

    phase: str  # "reduce-scatter" or "allgather"
    step: int  # 0 .. P-2 within the phase
    rank: int
    send_chunk: int
    recv_chunk: int
    send_range: tuple[int, int]  # [start, stop) in elements of the flattened buffer
    recv_range: tuple[int, int]
    nbytes: int  # bytes sent in this step
    start: float  # time.perf_counter() when the step began and ended
    end: float


Trace = Callable[[TraceEvent], Any]


def chunk_bounds(length: int, parts: int) -> list[int]:
    """Start of each of `parts` chunks of `length` elements, plus `length`, as numpy.array_split."""
    base, extra = divmod(length, parts)
    return [c * base + min(c, extra) for c in range(parts + 1)]


def buffer_problem(buf: Any) -> str | None:
    """Why `buf` cannot be reduced in place, or None if it can."""
    if not isinstance(buf, np.ndarray):
        return f"ring_allreduce needs a NumPy array, got {type(buf).__name__}"
    if buf.dtype not in _DTYPE_CODE:
        return f"ring_allreduce does not support dtype {buf.dtype} (use float32, float64 or int64)"
    if not buf.flags.c_contiguous:
        return "ring_allreduce needs a C-contiguous array (np.ascontiguousarray makes one)"
    if not buf.flags.writeable:
        return "ring_allreduce reduces in place, but the array is read-only"
    return None


_cache = threading.local()  # one scratch buffer per thread: each thread rank has its own


def _scratch(nbytes: int) -> np.ndarray:
    """A byte buffer of at least `nbytes`, reused across calls and grown when too small."""
    scratch = getattr(_cache, "scratch", None)
    if scratch is None or scratch.size < nbytes:
        scratch = _cache.scratch = np.empty(max(nbytes, 64), dtype=np.uint8)
    return scratch


def _is_truncation(exc: BaseException) -> bool:
    """True for a 'message longer than receive buffer' error from either backend."""
    if isinstance(exc, MessageTruncated):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return (
        mpi is not None
        and isinstance(exc, mpi.Exception)
        and exc.Get_error_class() == mpi.ERR_TRUNCATE
    )


def ring_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks of `comm` in place by a ring allreduce and return it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = buffer_problem(buf)
    if size == 1:
        if problem:
            raise ValueError(problem)
        return buf
    right, left = (rank + 1) % size, (rank - 1) % size
    mpi = constants(comm)
    status = mpi.Status()

    if problem:  # take part with empty messages and the flag raised, then report it
        flat = raw = np.empty(0, np.uint8)
        itemsize, signature, bounds = 1, _NO_DTYPE, [0] * (size + 1)
        scratch = flat
    else:
        flat = buf.reshape(-1)
        raw = flat.view(np.uint8)
        itemsize = buf.dtype.itemsize
        signature = (flat.size % _LENGTH_MODULUS) * 4 + _DTYPE_CODE[buf.dtype]
        bounds = chunk_bounds(flat.size, size)
        largest_chunk = bounds[1] - bounds[0]  # the first chunk is never smaller than the others
        scratch = _scratch(largest_chunk * itemsize)[: largest_chunk * itemsize].view(buf.dtype)
    flag = 1 if problem else 0  # the "something is wrong" bit, carried in the lowest tag bit
    mismatch = ""  # what this rank saw of its left neighbour, if anything was wrong

    def exchange(send: tuple[int, int], recv_into: np.ndarray) -> None:
        """Send elements send[0]:send[1] right while receiving from the left; check agreement."""
        nonlocal flag, mismatch
        outgoing = raw[send[0] * itemsize : send[1] * itemsize]
        incoming = recv_into.view(np.uint8)
        try:
            comm.Sendrecv(
                outgoing, dest=right, sendtag=signature << 1 | flag,
                recvbuf=incoming, source=left, recvtag=mpi.ANY_TAG, status=status,
            )  # fmt: skip
        except Exception as exc:  # a longer message than expected: the buffers differ
            if not _is_truncation(exc):
                raise
            tag, count = status.Get_tag(), -1
        else:
            tag, count = status.Get_tag(), status.Get_count()
        if (tag >> 1 != signature or count != incoming.size) and not mismatch:
            mismatch = _describe_mismatch(buf, problem, rank, left, tag >> 1)
        flag |= (tag & 1) | (tag >> 1 != signature) | (count != incoming.size)

    # Reduce-scatter: after step s, the chunk received has been summed over s + 2 ranks.
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank - step) % size, (rank - step - 1) % size
        send = bounds[send_chunk], bounds[send_chunk + 1]
        recv = bounds[recv_chunk], bounds[recv_chunk + 1]
        start = time.perf_counter() if trace is not None else 0.0
        incoming = scratch[: recv[1] - recv[0]]
        exchange(send, incoming)
        target = flat[recv[0] : recv[1]]
        np.add(target, incoming, out=target)
        if trace is not None:
            trace(TraceEvent("reduce-scatter", step, rank, send_chunk, recv_chunk, send, recv,
                             (send[1] - send[0]) * itemsize, start, time.perf_counter()))  # fmt: skip

    # Allgather: pass the finished chunks around; each arrives straight in its place.
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank + 1 - step) % size, (rank - step) % size
        send = bounds[send_chunk], bounds[send_chunk + 1]
        recv = bounds[recv_chunk], bounds[recv_chunk + 1]
        start = time.perf_counter() if trace is not None else 0.0
        exchange(send, flat[recv[0] : recv[1]])
        if trace is not None:
            trace(TraceEvent("allgather", step, rank, send_chunk, recv_chunk, send, recv,
                             (send[1] - send[0]) * itemsize, start, time.perf_counter()))  # fmt: skip

    if flag:
        raise ValueError(
            problem
            or mismatch
            or f"ring_allreduce: another rank passed a different or unusable buffer "
            f"(rank {rank} has {_describe(buf)}); the result is not a sum"
        )
    return buf


def _describe(buf: np.ndarray) -> str:
    return f"{buf.size} x {buf.dtype}"


def _describe_mismatch(buf: Any, problem: str | None, rank: int, left: int, theirs: int) -> str:
    """One line saying how this rank's buffer and its left neighbour's disagree."""
    if problem:
        return problem
    their_dtype = theirs & 3
    if their_dtype == _NO_DTYPE:
        what = "an unusable buffer"
    elif their_dtype != _DTYPE_CODE[buf.dtype]:
        what = f"dtype {SUPPORTED_DTYPES[their_dtype]}"
    else:
        what = "a different length"
    return (
        f"ring_allreduce: the ranks' buffers differ: rank {rank} has {_describe(buf)}, "
        f"rank {left} has {what}; every rank must pass the same length and dtype"
    )
