"""More allreduce algorithms beside the ring: naive, recursive doubling, Rabenseifner, binary tree.

Each has the ring's contract (`syncsgd.collectives.ring`): SUM in place on a C-contiguous
float32, float64 or int64 array of any shape, any number of ranks P >= 1, any length (0,
fewer elements than ranks, not divisible by P), every rank ends with bitwise the same array,
and `trace` gets one `TraceEvent` per message operation. `allreduce(buf, comm, algorithm)`
picks one by name.

How each works (Thakur, Rabenseifner and Gropp 2005, "Optimization of collective communication
operations in MPICH"; r = P - p', p' the largest power of two <= P, L = log2 p'):

- naive: every rank sends its buffer to rank 0, which adds them in rank order; rank 0 then sends
  the sum to every rank in turn (point to point, not `Bcast`). 2(P-1) messages of n on rank 0.
- recursive doubling (MPIR_Allreduce_intra_recursive_doubling): L steps in which ranks whose
  (renumbered) ranks differ in bit k swap their whole buffers and add. When P is not a power of
  two, first the even ranks below 2r send their buffer to the odd rank above them and sit out
  ("fold"); at the end the odd ranks send them the result ("unfold").
- Rabenseifner (MPIR_Allreduce_intra_reduce_scatter_allgather): the same fold, then a
  recursive-halving reduce-scatter over p' chunks (step k: partners differ in bit k, each keeps one
  half of its current window of chunks and sends the other half), then a recursive-doubling
  allgather that retraces the steps backwards, then the unfold. MPICH uses it only when
  length >= p'; here any length works (chunks may be empty).
- tree: a binary tree in heap order (the children of rank i are 2i+1 and 2i+2). Each rank adds
  its left then its right child's subtree sum to its own buffer and sends the result to its
  parent; rank 0 then sends the total down the same tree.

Same bits everywhere: in naive, tree and Rabenseifner each element is summed at one place, in one
order, and then only copied. In recursive doubling every rank adds, so partners add in one order,
the lower rank's data first (IEEE addition is commutative, so this only pins NaN payloads).

Trace events: `phase` is "reduce"/"broadcast" (naive, tree), "exchange" (recursive doubling),
"reduce-scatter"/"allgather" (Rabenseifner) or "fold"/"unfold" (the non-power-of-two pre and post
steps); `step` counts within the phase (naive: the non-root rank involved, minus one; tree: the
round, by depth, so a parent has one event per child in a round). Chunks index the algorithm's
partition of the flattened buffer: one chunk, 0, the whole buffer (naive, tree, recursive
doubling), or the p' chunks of `chunk_bounds(length, p')` (Rabenseifner: the first chunk of the
range moved). Nothing sent or received in an event: chunk -1 and range (0, 0). `schedule()` gives
the same steps with the peers, for teaching views.

Agreement, as in the ring, at the cost of no extra message: every message's tag carries a
signature of the sender's buffer (length mod 4096, dtype) and a "something is wrong" flag; a rank
raises the flag in all later messages when its buffer is unusable or a message it receives has
another signature or size. Every message pattern here depends on P alone, so all ranks always take
all steps, and the flag reaches every rank: the messages that carry the sum to a rank form a
spanning tree of all ranks in which a rank receives before it sends on, so a disagreement on any
edge is seen on it and travels on to the root of that tree. Then every rank raises ValueError.
`allreduce` with "mpi" or "auto" first agrees with one extra `Allreduce(MAX)` of five int64s
(usable, length, -length, dtype, -dtype) - one latency-bound collective more - because the library
would hang or silently misbehave on mismatched buffers, and "auto" must make the same choice on
every rank. `check=False` skips that round, for callers that know every rank passes the same
buffer (as MPI itself requires): the training loop, whose ranks agreed on the model at start-up,
as PyTorch DDP checks parameter shapes once, not per call. Every rank must pass the same
`algorithm` and `check`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from syncsgd.collectives.ring import (  # the private names: the ring's agreement check, shared
    _DTYPE_CODE,
    _LENGTH_MODULUS,
    _NO_DTYPE,
    _NOTHING,
    SUPPORTED_DTYPES,
    Trace,
    TraceEvent,
    _disagree,
    _disagreement,
    _truncated,
    buffer_problem,
    chunk_bounds,
    ring_allreduce,
    step_event,
)
from syncsgd.comm.world import constants

ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree", "mpi", "auto")
# MPICH 3.x (MPIR_Allreduce_intra_auto) uses recursive doubling up to this many bytes, the default
# of MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE, and Rabenseifner above it. (MPICH 4 and 5 moved the
# choice to a JSON table whose default cut is 8 bytes, with shared-memory algorithms below.)
SHORT_MESSAGE_BYTES = 2048
# alpha/beta: the bytes whose transfer costs as much as sending one more message. Used to pick the
# ring over Rabenseifner for long messages on non-power-of-two P (see choose_algorithm).
LATENCY_BYTES = 64 * 1024

# "auto" hands messages shorter than this to the communicator's own Allreduce. Short messages cost
# what Python spends per message, and one library call beats any hand-written algorithm (at 8 B on
# P = 2 the ring takes about 3x its time); from 1 to 16 MiB the hand-written ones send the same
# bytes as MPICH, match it on a quiet machine and lose up to a fifth when neighbours thrash the
# shared cache, so the library keeps them. From
# 32 MiB - glibc's largest mmap threshold - MPICH's per-call temporary buffer gets fresh pages from
# the kernel on every call, while the hand-written algorithms reuse their cached scratch, and they
# take a half to a third of its time. (Measured at P = 2 with `mpiexec -n 2 syncsgd bench
# allreduce --algorithms ring,rabenseifner`; another machine or MPI may want another cut.)
AUTO_LIBRARY_BELOW = 32 << 20

COPY, ADD_OWN_FIRST, ADD_INCOMING_FIRST = 0, 1, 2  # what a step does with the data it receives
_NONE = slice(0, 0)


class CollectiveStep(NamedTuple):
    """One message operation of one rank: a send, a receive, or both at once (`Sendrecv`)."""

    phase: str
    step: int
    send_to: int  # -1: nothing sent
    recv_from: int  # -1: nothing received
    send_chunk: int  # -1: nothing sent
    recv_chunk: int  # -1: nothing received
    send: slice  # elements of the flattened buffer sent
    recv: slice  # elements of the flattened buffer the received data belongs to
    combine: int  # COPY into place, or add: own + incoming or incoming + own


def _send(phase: str, step: int, peer: int, chunk: int, where: slice) -> CollectiveStep:
    """A step that only sends."""
    return CollectiveStep(phase, step, peer, -1, chunk, -1, where, _NONE, COPY)


def _recv(
    phase: str, step: int, peer: int, chunk: int, where: slice, combine: int
) -> CollectiveStep:
    """A step that only receives."""
    return CollectiveStep(phase, step, -1, peer, -1, chunk, _NONE, where, combine)


def _added_in_order(rank: int, peer: int) -> int:
    """Add the lower rank's data first, so that both partners compute the same bits."""
    return ADD_INCOMING_FIRST if peer < rank else ADD_OWN_FIRST


# -- schedules: each rank's steps, which depend only on (length, P, rank) and are cached ----------


@functools.lru_cache(maxsize=256)
def naive_schedule(length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """Reduce to rank 0 in rank order, then rank 0 sends the sum to each rank in turn."""
    whole = slice(0, length)
    if rank == 0:  # step s: the message of rank s + 1
        reduce = [_recv("reduce", s, s + 1, 0, whole, ADD_OWN_FIRST) for s in range(size - 1)]
        return (*reduce, *(_send("broadcast", s, s + 1, 0, whole) for s in range(size - 1)))
    return _send("reduce", rank - 1, 0, 0, whole), _recv("broadcast", rank - 1, 0, 0, whole, COPY)


@functools.lru_cache(maxsize=256)
def tree_schedule(length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """Binary-tree reduce to rank 0 (own, then left, then right subtree), binary-tree broadcast."""
    whole = slice(0, length)
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < size]
    parent = (rank - 1) // 2
    depth, height = (rank + 1).bit_length() - 1, size.bit_length() - 1  # height: deepest depth
    # Reduce round t: ranks at depth height - t send to their parents; broadcast round t: ranks at
    # depth t send to their children.
    steps = [_recv("reduce", height - depth - 1, c, 0, whole, ADD_OWN_FIRST) for c in children]
    if rank:
        steps += [_send("reduce", height - depth, parent, 0, whole)]
        steps += [_recv("broadcast", depth - 1, parent, 0, whole, COPY)]
    steps += [_send("broadcast", depth, child, 0, whole) for child in children]
    return tuple(steps)


def _folding(size: int, rank: int) -> tuple[int, int, int]:
    """(p', r, this rank's number among the p' ranks or -1) of MPICH's non-power-of-two fold."""
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    if rank < 2 * extra:
        return pof2, extra, -1 if rank % 2 == 0 else rank // 2
    return pof2, extra, rank - extra


def _real_rank(newrank: int, extra: int) -> int:
    """The rank of comm whose number among the p' folded ranks is `newrank`."""
    return newrank * 2 + 1 if newrank < extra else newrank + extra


def _fold(phase: str, rank: int, extra: int, whole: slice) -> list[CollectiveStep]:
    """The non-power-of-two pre ("fold") or post ("unfold") step of the first 2r ranks."""
    if rank >= 2 * extra:
        return []
    even = rank % 2 == 0
    if phase == "fold":  # even ranks hand their data to the odd rank above: lower rank first
        if even:
            return [_send(phase, 0, rank + 1, 0, whole)]
        return [_recv(phase, 0, rank - 1, 0, whole, ADD_INCOMING_FIRST)]
    if even:  # unfold: the odd rank returns the result
        return [_recv(phase, 0, rank + 1, 0, whole, COPY)]
    return [_send(phase, 0, rank - 1, 0, whole)]


@functools.lru_cache(maxsize=256)
def recursive_doubling_schedule(length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """Fold, log2(p') whole-buffer exchanges with the partner in bit k, unfold (as MPICH)."""
    whole = slice(0, length)
    pof2, extra, newrank = _folding(size, rank)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        for k in range(pof2.bit_length() - 1):
            peer = _real_rank(newrank ^ (1 << k), extra)
            combine = _added_in_order(rank, peer)
            steps.append(CollectiveStep("exchange", k, peer, peer, 0, 0, whole, whole, combine))
    return tuple(steps + _fold("unfold", rank, extra, whole))


@functools.lru_cache(maxsize=256)
def rabenseifner_schedule(length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """Fold, recursive-halving reduce-scatter, recursive-doubling allgather, unfold (as MPICH)."""
    whole = slice(0, length)
    pof2, extra, newrank = _folding(size, rank)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        bounds = chunk_bounds(length, pof2)
        levels = pof2.bit_length() - 1

        def elements(first: int, stop: int) -> slice:
            return slice(bounds[first], bounds[stop])

        lo, hi = 0, pof2  # the window of chunks this rank is still responsible for
        for k in range(levels):  # partners at distance 1 first, as MPICH
            peer = _real_rank(newrank ^ (1 << k), extra)
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if newrank >> k & 1 == 0 else ((mid, hi), (lo, mid))
            moved, kept = elements(*give), elements(*keep)
            combine = _added_in_order(rank, peer)
            steps.append(
                CollectiveStep(
                    "reduce-scatter", k, peer, peer, give[0], keep[0], moved, kept, combine
                )
            )
            lo, hi = keep
        for step, k in enumerate(reversed(range(levels))):  # the same partners, backwards
            peer = _real_rank(newrank ^ (1 << k), extra)
            width = hi - lo
            other = (hi, hi + width) if newrank >> k & 1 == 0 else (lo - width, lo)
            mine, theirs = elements(lo, hi), elements(*other)
            steps.append(
                CollectiveStep("allgather", step, peer, peer, lo, other[0], mine, theirs, COPY)
            )
            lo, hi = min(lo, other[0]), max(hi, other[1])
    return tuple(steps + _fold("unfold", rank, extra, whole))


@functools.lru_cache(maxsize=256)
def _ring_steps(length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """The ring's steps (see `syncsgd.collectives.ring`) in this module's form."""
    bounds = chunk_bounds(length, size)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for step in range(size - 1):  # reduce-scatter: add the chunk from the left
        send, recv = (rank - step) % size, (rank - step - 1) % size
        steps.append(CollectiveStep("reduce-scatter", step, right, left, send, recv, chunk[send],
                                    chunk[recv], ADD_OWN_FIRST))  # fmt: skip
    for step in range(size - 1):  # allgather: pass the finished chunks on
        send, recv = (rank + 1 - step) % size, (rank - step) % size
        steps.append(CollectiveStep("allgather", step, right, left, send, recv, chunk[send],
                                    chunk[recv], COPY))  # fmt: skip
    return tuple(steps)


_SCHEDULES: dict[str, Callable[[int, int, int], tuple[CollectiveStep, ...]]] = {
    "ring": _ring_steps,
    "naive": naive_schedule,
    "recursive-doubling": recursive_doubling_schedule,
    "rabenseifner": rabenseifner_schedule,
    "tree": tree_schedule,
}


def schedule(algorithm: str, length: int, size: int, rank: int) -> tuple[CollectiveStep, ...]:
    """The steps `rank` takes in a hand-written allreduce of `length` elements on `size` ranks."""
    try:
        steps_of = _SCHEDULES[algorithm]
    except KeyError:
        raise ValueError(
            f"no schedule for allreduce algorithm {algorithm!r} (choose {', '.join(_SCHEDULES)})"
        ) from None
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a communicator of size {size}")
    return steps_of(length, size, rank)


# -- running a schedule ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _plan(schedule_of: Callable, length: int, itemsize: int, size: int, rank: int) -> tuple:
    """This rank's steps, the bytes each sends and receives, and the scratch elements it needs."""
    steps = schedule_of(length, size, rank)
    byte_ranges = tuple(
        (
            slice(step.send.start * itemsize, step.send.stop * itemsize),
            slice(step.recv.start * itemsize, step.recv.stop * itemsize),
        )
        for step in steps
    )
    scratch = max((s.recv.stop - s.recv.start for s in steps if s.combine != COPY), default=0)
    return steps, byte_ranges, scratch


_local = threading.local()  # per thread (each thread rank has its own): scratch arrays by dtype


def _scratch(dtype: np.dtype, count: int) -> np.ndarray:
    """This thread's scratch array of `dtype`, at least `count` long; reused across calls."""
    try:
        arrays = _local.arrays
    except AttributeError:
        arrays = _local.arrays = {}
    scratch = arrays.get(dtype)
    if scratch is None or scratch.size < count:
        scratch = arrays[dtype] = np.empty(max(count, 8), dtype)
    return scratch


def _renamed(message: str, name: str) -> str:
    """A message of `ring.py`'s buffer checks, naming the function the user called."""
    return message.replace("ring_allreduce", name)


def _run(name: str, schedule_of: Callable, buf: np.ndarray, comm: Any, trace: Trace | None):
    """Take this rank's steps of a schedule on `buf`; raise on every rank if any buffer is wrong."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = buffer_problem(buf)
    if size == 1:
        if problem:
            raise ValueError(_renamed(problem, name))
        return buf
    if problem:  # take part with empty messages and the flag raised, then report it
        flat, signature = _NOTHING, _NO_DTYPE
    else:
        flat = buf.view(np.ndarray).ravel()  # a view (C-contiguous); np.matrix would stay 2-D
        signature = (flat.size % _LENGTH_MODULUS) * 4 + _DTYPE_CODE[flat.dtype]
    steps, byte_ranges, scratch_length = _plan(schedule_of, flat.size, flat.itemsize, size, rank)
    scratch = _scratch(flat.dtype, scratch_length)
    # Messages travel as bytes: MPICH aborts the job when a message is not a whole number of the
    # receiving buffer's elements (float32 sent, float64 expected), where we want a ValueError.
    raw, raw_scratch = flat.view(np.uint8), scratch.view(np.uint8)
    mpi = constants(comm)
    any_tag, status = mpi.ANY_TAG, mpi.Status()
    tag = signature << 1 | (1 if problem else 0)  # the lowest bit: "something is wrong"
    mismatch = ""
    for step, (send, recv) in zip(steps, byte_ranges, strict=True):
        start = time.perf_counter() if trace is not None else 0.0
        if step.recv_from < 0:
            comm.Send(raw[send], step.send_to, tag)
        else:
            incoming = raw[recv] if step.combine == COPY else raw_scratch[: recv.stop - recv.start]
            try:
                if step.send_to < 0:
                    comm.Recv(incoming, step.recv_from, any_tag, status)
                else:
                    source = step.recv_from
                    comm.Sendrecv(raw[send], step.send_to, tag, incoming, source, any_tag, status)
                count = status.Get_count()
            except Exception as exc:
                count = _truncated(exc)
            if status.Get_tag() != tag or count != incoming.nbytes:  # disagreement, or a flag
                agrees = count == incoming.nbytes
                tag, mismatch = _disagree(tag, status, agrees, step.recv_from, mismatch)
            if step.combine != COPY and not tag & 1:  # (once wrong, the sum is void: skip it)
                _add_(flat[step.recv], scratch, step.combine)
        if trace is not None:
            trace(step_event(step, rank, flat.itemsize, start))
    if tag & 1:
        raise ValueError(_renamed(problem or _disagreement(buf, rank, mismatch), name))
    return buf


def _add_(target: np.ndarray, scratch: np.ndarray, combine: int) -> None:
    """Add the data received into `scratch` to `target`, the lower rank's partial sum first."""
    incoming = scratch[: target.size]
    if target.size == 1:  # NumPy's ufuncs take a slow path for one-element outputs
        # The order of the operands is fixed, so partners that both add get the same bits.
        own = target[0]
        target[0] = own + incoming[0] if combine == ADD_OWN_FIRST else incoming[0] + own
    elif combine == ADD_OWN_FIRST:
        np.add(target, incoming, out=target)
    else:
        np.add(incoming, target, out=target)


# -- the algorithms -------------------------------------------------------------------------------


def naive_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: reduce to rank 0 in rank order, then send it back."""
    return _run("naive_allreduce", naive_schedule, buf, comm, trace)


def recursive_doubling_allreduce(
    buf: np.ndarray, comm: Any, *, trace: Trace | None = None
) -> np.ndarray:
    """Sum `buf` over all ranks in place by log2(P) whole-buffer exchanges (any P, as MPICH)."""
    return _run("recursive_doubling_allreduce", recursive_doubling_schedule, buf, comm, trace)


def rabenseifner_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: recursive-halving reduce-scatter, doubling allgather."""
    return _run("rabenseifner_allreduce", rabenseifner_schedule, buf, comm, trace)


def tree_allreduce(buf: np.ndarray, comm: Any, *, trace: Trace | None = None) -> np.ndarray:
    """Sum `buf` over all ranks in place: binary-tree reduce to rank 0, binary-tree broadcast."""
    return _run("tree_allreduce", tree_schedule, buf, comm, trace)


_HAND_WRITTEN: dict[str, Callable[..., np.ndarray]] = {
    "ring": ring_allreduce,
    "naive": naive_allreduce,
    "recursive-doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce,
    "tree": tree_allreduce,
}


def choose_algorithm(nbytes: int, count: int, size: int) -> str:
    """The algorithm "auto" uses for `count` elements of `nbytes` bytes in all on `size` ranks.

    As MPICH 3.x's MPIR_Allreduce_intra_auto: recursive doubling for short messages (at most
    SHORT_MESSAGE_BYTES = 2048 bytes) and whenever there are fewer elements than p' (the largest
    power of two <= P, the number of chunks Rabenseifner cuts), because there latency wins: it
    sends log2(p') messages where Rabenseifner sends twice as many. Longer messages on a power of
    two: Rabenseifner, which sends 2(p'-1)/p' of the buffer instead of log2(p') buffers, in
    2 log2(p') messages. Longer messages on other P: Rabenseifner's fold and unfold send the
    whole buffer twice more, about 2n extra bytes, while the ring sends 2(P-1)/P n bytes in
    2(P-1) messages; so the ring when the bytes it saves outweigh its extra messages, each
    worth LATENCY_BYTES (alpha/beta) of transfer, else Rabenseifner.
    """
    pof2 = 1 << (max(size, 1).bit_length() - 1)
    if nbytes <= SHORT_MESSAGE_BYTES or count < pof2:
        return "recursive-doubling"
    if pof2 == size:
        return "rabenseifner"
    levels = pof2.bit_length() - 1
    extra_messages = 2 * (size - 1) - 2 * (levels + 1)
    bytes_saved = nbytes * (2 + 2 * (pof2 - 1) / pof2 - 2 * (size - 1) / size)
    return "ring" if bytes_saved >= extra_messages * LATENCY_BYTES else "rabenseifner"


def auto_choice(nbytes: int, count: int, size: int) -> str:
    """What "auto" does with `count` elements of `nbytes` bytes on `size` ranks: "mpi" (the
    library) below AUTO_LIBRARY_BELOW bytes, else the hand-written `choose_algorithm`."""
    return "mpi" if nbytes < AUTO_LIBRARY_BELOW else choose_algorithm(nbytes, count, size)


def _agree(buf: Any, comm: Any, name: str) -> None:
    """Raise ValueError on every rank unless all buffers are usable and of one length and dtype."""
    problem = buffer_problem(buf)
    if comm.Get_size() == 1:
        if problem:
            raise ValueError(_renamed(problem, name))
        return
    length = 0 if problem else buf.size
    code = _NO_DTYPE if problem else _DTYPE_CODE[buf.dtype]
    mine = np.array([problem is not None, length, -length, code, -code], np.int64)
    every = np.empty_like(mine)
    comm.Allreduce(mine, every, op=constants(comm).MAX)  # the extra collective: 40 bytes
    unusable, longest, minus_shortest, last_dtype, minus_first_dtype = every.tolist()
    if problem:
        raise ValueError(_renamed(problem, name))
    if unusable:
        raise ValueError(
            f"{name}: another rank passed an unusable buffer (rank {comm.Get_rank()} has "
            f"{buf.dtype} of length {buf.size}); the result is not a sum"
        )
    shortest, first_dtype = -minus_shortest, -minus_first_dtype
    differences = []
    if shortest != longest:
        differences.append(f"lengths from {shortest} to {longest}")
    if first_dtype != last_dtype:
        differences.append(
            f"dtypes {SUPPORTED_DTYPES[first_dtype]} and {SUPPORTED_DTYPES[last_dtype]}"
        )
    if differences:
        raise ValueError(
            f"{name}: the ranks' buffers differ ({' and '.join(differences)}; rank "
            f"{comm.Get_rank()} has {buf.dtype} of length {buf.size}); every rank must pass "
            "the same length and dtype"
        )


def _library_allreduce(
    buf: np.ndarray, comm: Any, trace: Trace | None, check: bool = True
) -> np.ndarray:
    """The communicator's own `Allreduce(IN_PLACE, buf, SUM)`, after the agreement check."""
    if check:
        _agree(buf, comm, "allreduce")
    start = time.perf_counter() if trace is not None else 0.0
    mpi = constants(comm)
    flat = buf.view(np.ndarray).ravel()  # as MPI sees it: ThreadComm's Allreduce wants one shape
    comm.Allreduce(mpi.IN_PLACE, flat, op=mpi.SUM)
    if trace is not None:
        whole = (0, buf.size)  # the library's steps are hidden: one event for the whole call
        event = TraceEvent(
            "allreduce", 0, comm.Get_rank(), 0, 0, whole, whole, buf.nbytes, start,
            time.perf_counter(),
        )  # fmt: skip
        trace(event)
    return buf


def allreduce(
    buf: np.ndarray, comm: Any, algorithm: str = "ring", *, trace: Trace | None = None,
    check: bool = True,
) -> np.ndarray:  # fmt: skip
    """Sum `buf` over all ranks of `comm` in place with the named algorithm and return it.

    `algorithm` is one of ALGORITHMS: a hand-written one, "mpi" (the communicator's own
    `Allreduce`, the baseline), or "auto" (`auto_choice`: the library below AUTO_LIBRARY_BELOW
    bytes, else `choose_algorithm`). `check=False` skips the agreement round of "mpi" and "auto"
    (see the module's docstring). Every rank must pass the same `algorithm` and `check`.
    """
    if algorithm in _HAND_WRITTEN:
        return _HAND_WRITTEN[algorithm](buf, comm, trace=trace)
    if algorithm == "mpi":
        return _library_allreduce(buf, comm, trace, check)
    if algorithm == "auto":
        if check:
            _agree(buf, comm, "allreduce")
        chosen = auto_choice(buf.nbytes, buf.size, comm.Get_size())
        if chosen == "mpi":
            return _library_allreduce(buf, comm, trace, check=False)
        return _HAND_WRITTEN[chosen](buf, comm, trace=trace)
    raise _unknown(algorithm)


def _unknown(algorithm: str) -> ValueError:
    return ValueError(
        f"unknown allreduce algorithm {algorithm!r} (choose one of {', '.join(ALGORITHMS)})"
    )


def allreducer(
    comm: Any, algorithm: str = "ring", *, check: bool = True
) -> Callable[..., np.ndarray]:
    """`allreduce` with `comm`, `algorithm` and `check` resolved once: `reduce_(buf, trace=None)`.

    For loops of latency-bound calls: unchecked "auto" then costs a short message little more than
    the library's own call (its names are looked up here, once, not on every call).
    """
    if algorithm not in ALGORITHMS:
        raise _unknown(algorithm)
    if algorithm != "auto" or check:
        return functools.partial(allreduce, comm=comm, algorithm=algorithm, check=check)
    library_sum, mpi = comm.Allreduce, constants(comm)
    in_place, add = mpi.IN_PLACE, mpi.SUM

    def auto_(buf: np.ndarray, *, trace: Trace | None = None) -> np.ndarray:
        if buf.nbytes < AUTO_LIBRARY_BELOW and trace is None:  # the hot path: no more than this
            library_sum(in_place, buf, add)
            return buf
        return allreduce(buf, comm, "auto", trace=trace, check=False)

    return auto_
