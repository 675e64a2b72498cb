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
and the flag travels around the whole ring before the 2(P-1) steps end (a mismatch is seen in step
0, and it needs at most P-1 hops). All ranks always take part in all 2(P-1) steps, so every rank
raises the same kind of error - no rank is left waiting, and no rank returns a silently wrong sum -
at the cost of no extra message. (Lengths that differ by a multiple of 4096 on more than 2048 ranks
could slip past the step-0 check; the byte counts of later steps still catch most of them.)

Receives use `ANY_TAG` from the left neighbour: do not leave point-to-point messages from the left
neighbour unreceived on `comm` across the call (or give the ring its own `comm.Dup()`).

Speed: at small sizes the cost is Python's, not the network's. So everything that depends only on
(length, dtype, P, rank, type of comm) - neighbours, tag, a Status, the slices of every step, the
scratch views chunks arrive in - is computed once per thread and kept in a `RingPlan`; scratch is
allocated when a plan needs more than this thread has, never per call or per step; messages go as
memoryviews of bytes (see `_bytes`); and a step that agrees with its neighbour costs one
`Sendrecv`, two status reads, two integer comparisons and the add.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from syncsgd.comm.threads import MessageTruncated
from syncsgd.comm.world import constants

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64))
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES)}
_NO_DTYPE = 3  # the code of an unusable buffer
_LENGTH_MODULUS = 4096  # signature = (length mod 4096) * 4 + dtype code < 2**14; tag < 2**15
_NOTHING = np.empty(0, np.uint8)  # what a rank with an unusable buffer sends and receives


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


class RingStep(NamedTuple):
    """One step of one rank: the chunk sent to the right, the chunk received from the left."""

    phase: str  # "reduce-scatter" or "allgather"
    step: int  # 0 .. P-2 within the phase
    send_chunk: int
    recv_chunk: int
    send: slice  # elements of the flattened buffer that go right
    recv: slice  # elements of the flattened buffer that the incoming chunk belongs to


class ReduceScatterStep(NamedTuple):
    """A reduce-scatter step as the loop uses it: slices, where the chunk arrives, and the step."""

    send_bytes: slice  # the bytes of the flattened buffer that go right
    recv: slice  # the elements the incoming chunk is added to
    incoming: np.ndarray  # the view of scratch the chunk arrives in ...
    arrival: memoryview  # ... and its bytes, which Sendrecv receives into
    arriving: int  # elements that arrive: 0 (nothing to add), 1 (a scalar add) or more
    arrival_bytes: int  # the size the message must have
    about: RingStep


class AllgatherStep(NamedTuple):
    """An allgather step as the loop uses it: the chunk arrives straight in its place."""

    send_bytes: slice
    recv_bytes: slice
    arrival_bytes: int  # the size the message must have
    about: RingStep


class RingPlan(NamedTuple):
    """What a ring allreduce needs that depends only on (length, dtype, P, rank, comm type)."""

    right: int  # the neighbour we send to
    left: int  # the neighbour we receive from
    tag: int  # the tag of our messages while nothing is wrong: our buffer's signature << 1
    any_tag: int  # the communicator's ANY_TAG
    status: Any  # the communicator's kind of Status, reused by every call of this thread
    reduce_scatter: tuple[ReduceScatterStep, ...]  # P-1 steps
    allgather: tuple[AllgatherStep, ...]  # P-1 steps


def chunk_bounds(length: int, parts: int) -> list[int]:
    """Start of each of `parts` chunks of `length` elements, plus `length`, as numpy.array_split."""
    base, extra = divmod(length, parts)
    return [c * base + min(c, extra) for c in range(parts + 1)]


def make_plan(
    length: int, dtype: np.dtype, size: int, rank: int, scratch: np.ndarray, mpi: Any
) -> RingPlan:
    """The neighbours, the tag and every step of `rank`, receiving into `scratch` to reduce."""
    bounds = chunk_bounds(length, size)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    chunk_bytes = [slice(c.start * dtype.itemsize, c.stop * dtype.itemsize) for c in chunk]

    def reduce_scatter(step: int) -> ReduceScatterStep:
        send_chunk, recv_chunk = (rank - step) % size, (rank - step - 1) % size
        send, recv = chunk[send_chunk], chunk[recv_chunk]
        incoming = scratch[: recv.stop - recv.start]
        about = RingStep("reduce-scatter", step, send_chunk, recv_chunk, send, recv)
        return ReduceScatterStep(
            chunk_bytes[send_chunk], recv, incoming, _bytes(incoming), incoming.size,
            incoming.nbytes, about,
        )  # fmt: skip

    def allgather(step: int) -> AllgatherStep:
        send_chunk, recv_chunk = (rank + 1 - step) % size, (rank - step) % size
        send, recv = chunk[send_chunk], chunk[recv_chunk]
        about = RingStep("allgather", step, send_chunk, recv_chunk, send, recv)
        arrival = chunk_bytes[recv_chunk]
        return AllgatherStep(chunk_bytes[send_chunk], arrival, arrival.stop - arrival.start, about)

    steps = range(size - 1)
    signature = (length % _LENGTH_MODULUS) * 4 + _DTYPE_CODE.get(dtype, _NO_DTYPE)
    return RingPlan(
        (rank + 1) % size, (rank - 1) % size, signature << 1, mpi.ANY_TAG, mpi.Status(),
        tuple(reduce_scatter(s) for s in steps), tuple(allgather(s) for s in steps),
    )  # fmt: skip


def _bytes(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array, as messages travel.

    Messages go as bytes: MPICH aborts (an assertion, not an error code) when a message's size is
    not a multiple of the receive datatype's, as when another rank passes float32 to our float64;
    received as bytes, the mismatch is only seen in the byte count, and reported. mpi4py also
    takes a memoryview faster than a NumPy array.
    """
    return array.data.cast("B")


def buffer_problem(buf: Any) -> str | None:
    """Why `buf` cannot be reduced in place, or None if it can."""
    if not isinstance(buf, np.ndarray):
        return f"ring_allreduce needs a NumPy array, got {type(buf).__name__}"
    if buf.dtype not in _DTYPE_CODE:
        return f"ring_allreduce does not support dtype {buf.dtype} (use float32, float64 or int64)"
    flags = buf.flags
    if not flags.c_contiguous:
        return "ring_allreduce needs a C-contiguous array (np.ascontiguousarray makes one)"
    if not flags.writeable:
        return "ring_allreduce reduces in place, but the array is read-only"
    return None


# Per thread (each thread rank has its own): plans, and one scratch array per dtype as large as
# the largest chunk seen - kept for the next call, as MPI libraries keep their buffers.
_local = threading.local()
_MAX_PLANS = 64  # plans kept per thread; more distinct buffer sizes start the cache afresh


def ring_plan(length: int, dtype: np.dtype, size: int, rank: int, comm: Any) -> RingPlan:
    """This thread's plan for a ring allreduce of `length` x `dtype` on `comm`; built once."""
    key = length, dtype, size, rank, type(comm)
    try:
        return _local.plans[key]
    except (AttributeError, KeyError):
        pass
    if not hasattr(_local, "plans") or len(_local.plans) >= _MAX_PLANS:
        _local.plans, _local.scratch = {}, {}
    largest = -(-length // size)  # the first chunk is the largest
    scratch = _local.scratch.get(dtype)
    if scratch is None or scratch.size < largest:
        scratch = _local.scratch[dtype] = np.empty(largest, dtype)
        _local.plans = {}  # older plans receive into the smaller scratch: let them go
    plan = make_plan(length, dtype, size, rank, scratch, constants(comm))
    _local.plans[key] = plan
    return plan


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


def _truncated(exc: Exception) -> int:
    """The byte count to report for a failed receive: -1 if the message was too long, else raise."""
    if not _is_truncation(exc):
        raise exc
    return -1  # a message longer than the receive buffer: the buffers differ


def _disagree(
    tag: int, status: Any, count_agrees: bool, left: int, mismatch: str
) -> tuple[int, str]:
    """Our next tag and mismatch note, after the left neighbour's message showed a problem."""
    received = status.Get_tag()
    signature, their_signature = tag >> 1, received >> 1
    wrong = their_signature != signature or not count_agrees
    if wrong and not mismatch:
        mismatch = f"rank {left} has " + _describe_signature(their_signature, signature)
    return tag | (received & 1) | wrong, mismatch


def ring_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks of `comm` in place by a ring allreduce and return it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if type(buf) is np.ndarray and buf.flags.carray and buf.dtype in _DTYPE_CODE:
        problem, flat = None, buf.ravel()  # the usual case, checked quickly; ravel: a flat view
    else:
        problem = buffer_problem(buf)
        # np.matrix & co. stay 2-D when raveled: view the memory as a plain array first
        flat = _NOTHING if problem else buf.view(np.ndarray).ravel()
    if size == 1:
        if problem:
            raise ValueError(problem)
        return buf
    try:  # this thread's plan for these sizes (the lookup of ring_plan, inlined: it is hot)
        plan = _local.plans[flat.size, flat.dtype, size, rank, type(comm)]
    except (AttributeError, KeyError):
        plan = ring_plan(flat.size, flat.dtype, size, rank, comm)
    right, left, tag, any_tag, status, reduce_scatter, allgather = plan
    if problem:  # take part with empty messages and the flag raised, then report it
        tag |= 1
    mismatch = ""  # how the left neighbour's buffer differs from ours, once seen
    message = flat.data.cast("B")  # messages go as bytes: see _bytes

    # Reduce-scatter: after step s, the chunk received has been summed over s + 2 ranks.
    for send_bytes, recv, incoming, arrival, arriving, arrival_bytes, about in reduce_scatter:
        start = time.perf_counter() if trace is not None else 0.0
        try:
            comm.Sendrecv(message[send_bytes], right, tag, arrival, left, any_tag, status)
            count = status.Get_count()
        except Exception as exc:
            count = _truncated(exc)
        if status.Get_tag() != tag or count != arrival_bytes:  # disagreement, or a flag
            tag, mismatch = _disagree(tag, status, count == arrival_bytes, left, mismatch)
        if tag & 1:  # something is wrong: the sum is void (we raise at the end), add nothing
            pass
        elif arriving == 1:  # NumPy's ufuncs take a slow path (~3x) for one-element outputs
            flat[recv.start] += incoming[0]
        elif arriving:  # (an empty chunk, as when length < P, has nothing to add)
            target = flat[recv]
            np.add(target, incoming, out=target)  # own partial sum + the left neighbour's
        if trace is not None:
            trace(step_event(about, rank, flat.itemsize, start))

    # Allgather: pass the finished chunks around; each arrives straight in its place.
    for send_bytes, recv_bytes, arrival_bytes, about in allgather:
        start = time.perf_counter() if trace is not None else 0.0
        try:
            comm.Sendrecv(
                message[send_bytes], right, tag, message[recv_bytes], left, any_tag, status
            )
            count = status.Get_count()
        except Exception as exc:
            count = _truncated(exc)
        if status.Get_tag() != tag or count != arrival_bytes:  # disagreement, or a flag
            tag, mismatch = _disagree(tag, status, count == arrival_bytes, left, mismatch)
        if trace is not None:
            trace(step_event(about, rank, flat.itemsize, start))

    if tag & 1:
        raise ValueError(problem or _disagreement(buf, rank, mismatch))
    return buf


def step_event(about: Any, rank: int, itemsize: int, start: float) -> TraceEvent:
    """The trace event of a step that has just finished (any step record with the ring's
    phase, step, send_chunk, recv_chunk, send and recv fields: RingStep, CollectiveStep)."""
    send, recv = about.send, about.recv
    return TraceEvent(
        about.phase, about.step, rank, about.send_chunk, about.recv_chunk,
        (send.start, send.stop), (recv.start, recv.stop),
        (send.stop - send.start) * itemsize, start, time.perf_counter(),
    )  # fmt: skip


def _describe_signature(signature: int, mine: int) -> str:
    """How a neighbour's buffer signature (length mod 4096, dtype code) differs from ours."""
    dtype = signature & 3
    if dtype == _NO_DTYPE:
        return "an unusable buffer"
    if dtype != mine & 3:
        return f"dtype {SUPPORTED_DTYPES[dtype]}"
    return "a different length"


def _disagreement(buf: np.ndarray, rank: int, mismatch: str) -> str:
    """One line saying that the ranks' buffers differ, as far as this rank can tell."""
    mine = f"rank {rank} has {buf.dtype} of length {buf.size}"
    if mismatch:
        return (
            f"ring_allreduce: the ranks' buffers differ: {mine}, {mismatch}; "
            "every rank must pass the same length and dtype"
        )
    return (
        f"ring_allreduce: another rank passed a different or unusable buffer ({mine}); "
        "the result is not a sum"
    )
