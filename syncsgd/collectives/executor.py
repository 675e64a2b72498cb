"""One executor runs any schedule: agreement through the message tags, byte messages, cached plans.

Why the tag protocol reaches every rank, why messages are bytes, and the speed notes:
docs/collectives.md.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from syncsgd.collectives.schedules import (
    ADD_OWN_FIRST,
    COPY,
    SCHEDULES,
    Algorithm,
    Collective,
    CollectiveStep,
    Hierarchical,
    schedule,
)
from syncsgd.collectives.small import Adds, bound, gather_steps, gathers, row_adds, tail_steps
from syncsgd.comm.threads import MessageTruncated, ThreadComm
from syncsgd.comm.world import constants

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64))
DTYPE_CODE = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES)}
NO_DTYPE = 3  # the code of an unusable buffer
_LENGTH_MODULUS = 4096  # signature = (length mod 4096) * 4 + dtype code < 2**14; tag < 2**15
_NOTHING = np.empty(0, np.uint8)  # what a rank with an unusable buffer sends and receives
_COPIED = -1  # `arriving` of a step whose data lands straight in its place: nothing to add
# Under MPI, a step's send of at least this many bytes is left to finish during later steps;
# a shorter one goes eagerly (its send ends at once), where one Sendrecv is one call less.
OPEN_SEND_BYTES = 64 << 10
# The name each algorithm's errors carry: the function the user called.
FUNCTION_NAMES = {name: name.replace("-", "_") + "_allreduce" for name in SCHEDULES}


def function_name(algorithm: Algorithm) -> str:
    """The function the user called to run `algorithm`: `ring_allreduce`, `broadcast`, ..."""
    if isinstance(algorithm, Hierarchical):
        return "hierarchical_allreduce"
    if isinstance(algorithm, Collective):
        return algorithm.name.replace("-", "_")
    return FUNCTION_NAMES[algorithm]


class TraceEvent(NamedTuple):
    """What one rank did in one step of a collective."""

    phase: str  # e.g. "reduce-scatter" or "allgather"
    step: int  # counts within the phase
    rank: int
    send_chunk: int  # -1: nothing sent
    recv_chunk: int  # -1: nothing received
    send_range: tuple[int, int]  # [start, stop) in elements of the flattened buffer
    recv_range: tuple[int, int]
    nbytes: int  # bytes sent in this step
    start: float  # time.perf_counter() when the step began and ended
    end: float


Trace = Callable[[TraceEvent], Any]


class PlannedStep(NamedTuple):
    """A step as the executor takes it: byte slices and scratch views computed once."""

    send: slice  # the bytes of the flattened buffer sent
    dest: int  # -1: nothing sent
    recv: slice  # the bytes of the flattened buffer a copy lands in
    arrival: memoryview | None  # the bytes of scratch an addend lands in; None: a copy
    source: int  # -1: nothing received
    expected: int  # the size in bytes the incoming message must have
    target: slice  # the elements the incoming data is added to
    incoming: np.ndarray  # the scratch elements it arrives in
    arriving: int  # elements to add: 0 (none), 1 (a scalar add), more; or _COPIED
    own_first: bool  # own + incoming (else incoming + own): the order is part of the result
    about: CollectiveStep


class Plan(NamedTuple):
    """What a run needs that depends only on (algorithm, length, dtype, P, rank, comm type)."""

    tag: int  # the tag of our messages while nothing is wrong: our buffer's signature << 1
    any_tag: int  # the communicator's ANY_TAG
    status: Any  # the communicator's kind of Status, reused by every call of this thread
    steps: tuple[PlannedStep, ...]
    probe: bool = False  # receive only after a probe told the size: see _probed_exchange
    name: str = ""  # the function the user called, which errors name
    threads: bool = False  # on thread ranks: buffers sharing memory across ranks are refused
    gathering: Gathering | None = None  # a short ring's: then `steps` pass the buffers around
    rank: int = 0
    size: int = 1
    comm: Any = None  # kept, so that its id, which finds the plan, is not another's
    # A step's send may finish during later steps: under MPI, on more than two ranks (on two, each
    # step of the ring and of Rabenseifner receives into the bytes the step before sent)
    open_sends: bool = False


class Gathering(NamedTuple):
    """How a short ring runs (syncsgd.collectives.small): the buffers passed around in `rows`,
    then added up there."""

    rows: np.ndarray  # P buffers of `length` + 1 elements, then scratch rows; flattened
    own: np.ndarray  # this rank's buffer in `rows`
    passes: tuple[Pass, ...]  # the plan's `steps`, their message views made once
    adds: Adds
    tail: tuple[PlannedStep, ...]  # the ring's other steps, empty: taken if something is wrong
    requests: tuple[Any, ...]  # under MPI, every step's persistent receive and send


class Pass(NamedTuple):
    """One step of a short ring: its message views, and under MPI its persistent requests' calls
    (receive.Start, send.Start, send.Wait, receive.Wait): not parsed again at every call."""

    send: memoryview
    dest: int
    into: memoryview
    source: int
    expected: int  # bytes
    step: PlannedStep
    started: tuple[Callable[..., Any], ...] | None


def signature(length: int, dtype: np.dtype) -> int:
    """What the tag tells of a buffer: its length mod 4096 and its dtype's code."""
    return (length % _LENGTH_MODULUS) * 4 + DTYPE_CODE.get(dtype, NO_DTYPE)


def buffer_defect(buf: Any, name: str) -> str | None:
    """Why `buf` cannot be reduced in place by the function `name`, or None if it can."""
    if not isinstance(buf, np.ndarray):
        return f"{name} needs a NumPy array, got {type(buf).__name__}"
    if buf.dtype not in DTYPE_CODE:
        return f"{name} does not support dtype {buf.dtype} (use float32, float64 or int64)"
    flags = buf.flags
    if not flags.c_contiguous:
        return f"{name} needs a C-contiguous array (np.ascontiguousarray makes one)"
    if not flags.writeable:
        return f"{name} reduces in place, but the array is read-only"
    return None


def _byte_slice(elements: slice, itemsize: int) -> slice:
    return slice(elements.start * itemsize, elements.stop * itemsize)


def _planned(step: CollectiveStep, itemsize: int, scratch: np.ndarray) -> PlannedStep:
    """`step` with its byte slices, and the view of scratch an addend arrives in."""
    target, arriving_bytes = step.recv, (step.recv.stop - step.recv.start) * itemsize
    incoming = scratch[: target.stop - target.start]  # (for a copy, unused)
    if step.combine == COPY:
        arrival, arriving = None, _COPIED
    else:  # received into scratch (as bytes: see docs/collectives.md), then added
        arrival, arriving = incoming.data.cast("B"), incoming.size
    return PlannedStep(
        _byte_slice(step.send, itemsize), step.send_to, _byte_slice(target, itemsize), arrival,
        step.recv_from, arriving_bytes, target, incoming, arriving, step.combine == ADD_OWN_FIRST,
        step,
    )  # fmt: skip


# Per thread (each thread rank has its own): plans, and one scratch array per dtype as large as
# the largest addend seen - kept for the next call, as MPI libraries keep their buffers.
_local = threading.local()
_MAX_PLANS = 64  # plans kept per thread; more distinct buffer sizes start the cache afresh


def plan_for(
    algorithm: Algorithm, length: int, dtype: np.dtype, size: int, rank: int, comm: Any,
    traced: bool = False,
) -> Plan:  # fmt: skip
    """This thread's plan for `algorithm` on `length` x `dtype` on `comm` (of `size` ranks, this
    one `rank`); built once. `traced`: step through the schedule even where a short ring would
    gather."""
    key = algorithm, length, dtype, id(comm), traced
    try:
        return _local.plans[key]
    except (AttributeError, KeyError):
        pass
    if not hasattr(_local, "plans") or len(_local.plans) >= _MAX_PLANS:
        _forget_plans()
        _local.scratch = {}
    mpi = constants(comm)
    probe = _truncation_unsafe(comm)
    result = Plan(signature(length, dtype) << 1, mpi.ANY_TAG, mpi.Status(), (), probe,
                  function_name(algorithm), type(comm) is ThreadComm, None, rank, size, comm,
                  _is_mpi(comm) and not probe and size > 2)  # fmt: skip
    if not traced and gathers(algorithm, length * dtype.itemsize, size):
        result = _gathering(result, str(algorithm), length, dtype, size, rank, comm)
    else:
        result = result._replace(steps=_planned_steps(algorithm, length, dtype, size, rank))
    _local.plans[key] = result
    return result


def _planned_steps(algorithm: Algorithm, length: int, dtype: np.dtype, size: int,
                   rank: int) -> tuple[PlannedStep, ...]:  # fmt: skip
    """`algorithm`'s steps, planned on this thread's scratch (grown if they need more)."""
    steps = schedule(algorithm, length, size, rank)
    largest = max((s.recv.stop - s.recv.start for s in steps if s.combine != COPY), default=0)
    scratch = _local.scratch.get(dtype)
    if scratch is None or scratch.size < largest:
        scratch = _local.scratch[dtype] = np.empty(largest, dtype)
        _forget_plans()  # older plans receive into the smaller scratch: let them go
    return tuple(_planned(step, dtype.itemsize, scratch) for step in steps)


def forget_plans() -> None:
    """Let this thread's plans and scratch go: the next collective allocates them afresh."""
    _forget_plans()
    _local.scratch = {}


def _forget_plans() -> None:
    """Let this thread's plans go, and free their persistent requests."""
    dropped = getattr(_local, "plans", {}).values()
    _local.plans = {}
    for plan in dropped:
        if plan.gathering is not None and plan.gathering.requests:
            _free_requests(plan.gathering.requests)


# Every persistent request made and not yet freed: freed before MPI finalizes (mpi4py finalizes
# at exit, after the exit functions registered later than its own, as ours).
_PERSISTENT: list[tuple[Any, ...]] = []
_persistent_lock = threading.Lock()


def _persistent_requests(comm: Any, plan: Plan, passes: list[Pass]
                         ) -> tuple[list[Pass], tuple[Any, ...]]:  # fmt: skip
    """`passes` with persistent requests under MPI (unless receives are probed: Open MPI), and
    the requests, to be freed with the plan."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(comm, mpi.Comm) or plan.probe:
        return passes, ()
    made, requests = [], []
    for one in passes:
        receive = comm.Recv_init(one.into, one.source, plan.any_tag)
        send = comm.Send_init(one.send, one.dest, plan.tag)
        made.append(one._replace(started=(receive.Start, send.Start, send.Wait, receive.Wait)))
        requests += [receive, send]
    with _persistent_lock:
        if not _PERSISTENT:
            atexit.register(_free_all_requests)
        _PERSISTENT.append(tuple(requests))
        return made, _PERSISTENT[-1]


def _free_requests(requests: tuple[Any, ...]) -> None:
    """Free persistent requests (once; not after MPI has finalized)."""
    with _persistent_lock:
        known = [index for index, kept in enumerate(_PERSISTENT) if kept is requests]
        if not known:
            return
        del _PERSISTENT[known[0]]
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not mpi.Is_finalized():
        for request in requests:
            request.Free()


def _free_all_requests() -> None:
    for requests in list(_PERSISTENT):
        _free_requests(requests)


def _gathering(plan: Plan, algorithm: str, length: int, dtype: np.dtype, size: int,
               rank: int, comm: Any) -> Plan:  # fmt: skip
    """`plan` as a short ring runs it: gather the P buffers, then add them up here."""
    width, itemsize = length + 1, dtype.itemsize  # each buffer and one element more
    rows = np.zeros((row_adds(algorithm, length, size, rank)[1], width), dtype)
    message, block = rows.data.cast("B"), width * itemsize
    # A buffer's message is its bytes and one byte more: an odd size, which a message of the
    # ring's steps (whole elements) never has, so either kind of rank sees the other.
    sent = length * itemsize + 1

    def planned(step: CollectiveStep) -> PlannedStep:
        sends = slice(step.send_chunk * block, step.send_chunk * block + sent)
        if step.send_chunk < 0:  # the tail: nothing sent or received
            sends = slice(0, 0)
        receives = slice(sends.start - step.send_chunk * block + step.recv_chunk * block,
                         sends.stop - step.send_chunk * block + step.recv_chunk * block)
        return PlannedStep(sends, step.send_to, receives, None, step.recv_from,
                           receives.stop - receives.start, slice(0, 0), rows[0, :0], _COPIED,
                           False, step)  # fmt: skip

    steps = tuple(planned(step) for step in gather_steps(size, rank))
    passes, requests = _persistent_requests(comm, plan, [
        Pass(message[s.send], s.dest, message[s.recv], s.source, s.expected, s, None)
        for s in steps])  # fmt: skip
    gathering = Gathering(rows.reshape(-1), rows[rank, :length], tuple(passes),
                          bound(algorithm, length, size, rank, rows),
                          tuple(planned(step) for step in tail_steps(size, rank)),
                          requests)  # fmt: skip
    return plan._replace(steps=steps, gathering=gathering)


def sent_bytes(algorithm: Algorithm, length: int, itemsize: int, size: int, rank: int,
               stepped: bool = False) -> int:  # fmt: skip
    """The bytes `rank` sends in `algorithm` on `length` elements: its messages as it posts them
    (`stepped`: as it steps through the schedule, as a traced call does, never gathering)."""
    if size == 1:
        return 0
    if not stepped and gathers(algorithm, length * itemsize, size):  # P-1 buffers, a byte each
        return (size - 1) * (length * itemsize + 1)
    return itemsize * sum(step.send.stop - step.send.start
                          for step in schedule(algorithm, length, size, rank)
                          if step.send_to >= 0)  # fmt: skip


def execute(
    algorithm: Algorithm, buf: np.ndarray, comm: Any, trace: Trace | None = None
) -> np.ndarray:
    """Sum `buf` over all ranks of `comm` in place by `algorithm`'s schedule and return it (or
    run another collective's schedule on it: `Collective`)."""
    if type(buf) is np.ndarray and buf.flags.carray and buf.dtype in DTYPE_CODE:
        defect, flat = None, buf if buf.ndim == 1 else buf.ravel()  # the usual case, quickly
    else:
        defect = buffer_defect(buf, function_name(algorithm))
        # np.matrix & co. stay 2-D when raveled: view the memory as a plain array first
        flat = _NOTHING if defect else buf.view(np.ndarray).ravel()
    traced = trace is not None
    try:  # this thread's plan (the lookup of `plan_for`, inlined: it is hot); it knows P, rank
        planned = _local.plans[algorithm, flat.size, flat.dtype, id(comm), traced]
    except (AttributeError, KeyError):
        try:
            rank, size = comm.Get_rank(), comm.Get_size()
        except AttributeError:
            raise TypeError(f"{function_name(algorithm)}: comm must be a communicator (mpi4py's, "
                            f"or a ThreadComm of run_threads), not {comm!r}") from None  # fmt: skip
        if size == 1:
            if defect:
                raise ValueError(defect) from None
            return buf
        planned = plan_for(algorithm, flat.size, flat.dtype, size, rank, comm, traced)
    if planned.threads:  # ranks passing one array would sum into it: refuse
        shared = comm.claim(None if defect else flat, buf, planned.name)
        if shared:
            defect, flat = shared, _NOTHING
            planned = plan_for(algorithm, 0, _NOTHING.dtype, planned.size, planned.rank, comm,
                               traced)  # fmt: skip
    # With a defect, take part with empty messages and the flag raised, then report it.
    if planned.gathering is None:
        tag, mismatch = _take_steps(planned, flat, comm, planned.tag | (defect is not None), trace)
    else:  # a short ring
        tag, mismatch = _gathered(planned, planned.gathering, flat, comm,
                                  planned.tag | (defect is not None))  # fmt: skip
    if tag & 1:
        shared = comm.failed() if planned.threads else None
        raise ValueError(defect or shared
                         or _disagreement(buf, planned.rank, mismatch, planned.name))
    return buf


def _take_steps(
    plan: Plan, flat: np.ndarray, comm: Any, tag: int, trace: Trace | None
) -> tuple[int, str]:
    """Take every step of `plan` on `flat`: the tag after the last step, and what differed."""
    message, any_tag, status, mismatch = flat.data.cast("B"), plan.any_tag, plan.status, ""
    probe = plan.probe
    sendrecv = comm.exchange if plan.threads else comm.Sendrecv  # thread ranks: no re-checks
    # Under MPI a step's send is left to finish while the next steps run (the step waits for its
    # receive only), and is waited for before anything overwrites the bytes it sends, or at the end.
    pending: list[tuple[Any, slice]] = []  # (request, bytes sent) of the sends left to finish
    for step in plan.steps:  # `plan`, `step`: read from this frame by a collective timeout
        send, dest, recv, arrival, source, expected, target, incoming, arriving, own_first, _ = step
        start = time.perf_counter() if trace is not None else 0.0
        if source < 0:
            comm.Send(message[send], dest, tag)
        else:
            into = message[recv] if arrival is None else arrival
            try:
                if probe:
                    count = _probed_exchange(comm, message[send], dest, tag, into, source,
                                             any_tag, status)  # fmt: skip
                else:
                    count = _exchange(comm, plan, step, message, tag, into, sendrecv, pending)
            except Exception as exc:
                count = _truncated(exc)
            if status.Get_tag() != tag or count != expected:  # disagreement, or a flag
                tag, mismatch = _disagree(tag, status, count, expected, source, mismatch)
            if arriving <= 0 or tag & 1:  # a copy, nothing to add, or the sum is void (we raise)
                pass
            elif arriving == 1:  # NumPy's ufuncs take a slow path (~3x) for one-element outputs
                i = target.start
                flat[i] = flat[i] + incoming[0] if own_first else incoming[0] + flat[i]
            else:
                part = flat[target]
                if own_first:
                    np.add(part, incoming, out=part)
                else:
                    np.add(incoming, part, out=part)
        if trace is not None:
            trace(step_event(step.about, comm.Get_rank(), flat.itemsize, start))
    for request, _ in pending:
        request.Wait()
    return tag, mismatch


def _exchange(comm: Any, plan: Plan, step: PlannedStep, message: memoryview, tag: int,
              into: memoryview, sendrecv: Callable[..., Any],
              pending: list[tuple[Any, slice]]) -> int:  # fmt: skip
    """A step's receive, with its send if it has one: the bytes that came. Under MPI a long send
    apart from the bytes received is started and left in `pending`; else both go in one exchange."""
    send, dest, source = step.send, step.dest, step.source
    any_tag, status = plan.any_tag, plan.status
    if pending:  # first let the sends of bytes this step overwrites finish
        _settle(pending, step.recv)
    if dest < 0:
        comm.Recv(into, source, any_tag, status)
    elif (plan.open_sends and send.stop - send.start >= OPEN_SEND_BYTES
          and not _overlap(send, step.recv)):  # fmt: skip
        pending.append((comm.Isend(message[send], dest, tag), send))
        comm.Recv(into, source, any_tag, status)
    else:
        sendrecv(message[send], dest, tag, into, source, any_tag, status)
    return int(status.Get_count())


def _overlap(one: slice, other: slice) -> bool:
    """True if the byte ranges `one` and `other` share a byte."""
    return one.start < other.stop and other.start < one.stop and one.start < one.stop


def _settle(pending: list[tuple[Any, slice]], written: slice) -> None:
    """Wait for the pending sends of bytes that `written` is about to overwrite."""
    for sent in [sent for sent in pending if _overlap(sent[1], written)]:
        sent[0].Wait()
        pending.remove(sent)


def _gathered(plan: Plan, gathering: Gathering, flat: np.ndarray, comm: Any,
              tag: int) -> tuple[int, str]:  # fmt: skip
    """A short ring: pass every rank's buffer around, then add them up in the ring's order. With
    something wrong, take the ring's other steps empty, as the ranks stepping through it do."""
    gathering.own[...] = flat
    any_tag, status, probe, mismatch = plan.any_tag, plan.status, plan.probe, ""
    sendrecv = comm.exchange if plan.threads else comm.Sendrecv  # thread ranks: no re-checks
    # `plan`, `step`: read from this frame by a collective timeout, as from _take_steps'
    for send, dest, into, source, expected, step, started in gathering.passes:  # noqa: B007
        try:
            if started is not None and tag == plan.tag:  # MPI, nothing wrong: made once
                start_receive, start_send, wait_send, wait_receive = started
                start_receive()
                start_send()
                wait_send()
                wait_receive(status)
                count = status.Get_count()
            elif probe:
                count = _probed_exchange(comm, send, dest, tag, into, source, any_tag, status)
            else:
                sendrecv(send, dest, tag, into, source, any_tag, status)
                count = status.Get_count()
        except Exception as exc:
            count = _truncated(exc)
        if status.Get_tag() != tag or count != expected:  # disagreement, or a flag
            tag, mismatch = _disagree(tag, status, count, expected, source, mismatch)
    if tag & 1:  # the flag has reached every rank by now (docs/collectives.md)
        tail = plan._replace(steps=gathering.tail, gathering=None)
        tag, late = _take_steps(tail, flat, comm, tag, None)
        return tag, mismatch or late
    adds, rows = gathering.adds, gathering.rows
    for a, b, out in adds.inner:  # each run's adds in order; the runs are apart
        np.add(a, b, out=out)
    for i, j, k in adds.inner_scalars:  # NumPy's ufuncs are slow on one element: scalars
        rows[k] = rows[i] + rows[j]
    for a, b, where in adds.last:
        np.add(a, b, out=flat[where])
    for i, j, k in adds.last_scalars:
        flat[k] = rows[i] + rows[j]
    return tag, mismatch


def _is_mpi(comm: Any) -> bool:
    """True for an mpi4py communicator."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(comm, mpi.Comm)


def _truncation_unsafe(comm: Any) -> bool:
    """True under Open MPI, whose truncated receives of large messages corrupt memory."""
    return _is_mpi(comm) and sys.modules["mpi4py.MPI"].get_vendor()[0] == "Open MPI"


def _probed_exchange(
    comm: Any, send: memoryview, dest: int, tag: int, into: memoryview, source: int,
    any_tag: int, status: Any,
) -> int:  # fmt: skip
    """Sendrecv with no receive that can truncate: probe the size first; the bytes that came."""
    # Open MPI 4.1 copies a too-long rendezvous message whole into the posted buffer (a heap
    # overrun, "malloc(): invalid size"), so a longer message goes to a throwaway buffer instead.
    request = comm.Isend(send, dest, tag) if dest >= 0 else None
    message = comm.Mprobe(source, any_tag, status)
    count = int(status.Get_count())
    message.Recv(into if count <= len(into) else bytearray(count))
    if request is not None:
        request.Wait()
    return count


def step_event(about: CollectiveStep, rank: int, itemsize: int, start: float) -> TraceEvent:
    """The trace event of a step that has just finished."""
    send, recv = about.send, about.recv
    return TraceEvent(
        about.phase, about.step, rank, about.send_chunk, about.recv_chunk,
        (send.start, send.stop), (recv.start, recv.stop),
        (send.stop - send.start) * itemsize, start, time.perf_counter(),
    )  # fmt: skip


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
    tag: int, status: Any, count: int, expected: int, source: int, mismatch: str
) -> tuple[int, str]:
    """Our next tag and mismatch note, after the message from `source` showed a problem
    (`count`: the bytes that came, -1 if more than the `expected` ones)."""
    received = status.Get_tag()
    mine, theirs = tag >> 1, received >> 1
    wrong = theirs != mine or count != expected
    if wrong and not mismatch:
        mismatch = f"rank {source} has " + _describe_signature(theirs, mine)
        if theirs == mine:  # the same length mod 4096 and dtype: the sizes tell it
            sent = "more than" if count < 0 else f"{count} bytes, not"
            mismatch += (f" or called another algorithm (it sent {sent} the {expected} bytes "
                         "this rank's schedule expects)")  # fmt: skip
    return tag | (received & 1) | wrong, mismatch


def _describe_signature(theirs: int, mine: int) -> str:
    """How another rank's buffer signature (length mod 4096, dtype code) differs from ours."""
    dtype = theirs & 3
    if dtype == NO_DTYPE:
        return "an unusable buffer"
    if dtype != mine & 3:
        return f"dtype {SUPPORTED_DTYPES[dtype]}"
    return "a different length"


def _disagreement(buf: np.ndarray, rank: int, mismatch: str, name: str) -> str:
    """One line saying that the ranks' buffers differ, as far as this rank can tell."""
    mine = f"rank {rank} has {buf.dtype} of length {buf.size}"
    if mismatch:
        return (
            f"{name}: the ranks' calls differ: {mine}, {mismatch}; "
            "every rank must call the same algorithm with the same length and dtype"
        )
    return (
        f"{name}: another rank passed a different or unusable buffer ({mine}); "
        "the result is not a sum"
    )


def ring_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks of `comm` in place by a ring allreduce and return it."""
    return execute("ring", buf, comm, trace)


def naive_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: reduce to rank 0 in rank order, then send it back."""
    return execute("naive", buf, comm, trace)


def recursive_doubling_allreduce(
    buf: np.ndarray, comm: Any, *, trace: Trace | None = None
) -> np.ndarray:
    """Sum `buf` over all ranks in place by log2(P) whole-buffer exchanges (any P, as MPICH)."""
    return execute("recursive-doubling", buf, comm, trace)


def rabenseifner_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: recursive-halving reduce-scatter, doubling allgather."""
    return execute("rabenseifner", buf, comm, trace)


def tree_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: binary-tree reduce to rank 0, binary-tree broadcast."""
    return execute("tree", buf, comm, trace)
