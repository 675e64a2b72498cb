"""`allreduce` by name: the hand-written algorithms, the library's own ("mpi"), and "auto".

Why "mpi" and "auto" agree in an extra round, and how the cut of "auto" was measured:
docs/collectives.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from syncsgd.collectives.executor import (
    DTYPE_CODE,
    NO_DTYPE,
    SUPPORTED_DTYPES,
    Trace,
    TraceEvent,
    buffer_defect,
    execute,
    naive_allreduce,
    rabenseifner_allreduce,
    recursive_doubling_allreduce,
    ring_allreduce,
    tree_allreduce,
)
from syncsgd.collectives.hierarchy import hierarchy_of
from syncsgd.comm.watchdog import records, watching
from syncsgd.comm.world import constants

ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree", "hierarchical", "mpi",
              "auto")
# The flat algorithms "hierarchical" may run between the nodes.
INTER_ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")
# MPICH 3.x (MPIR_Allreduce_intra_auto) uses recursive doubling up to this many bytes, the default
# of MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE, and Rabenseifner above it.
SHORT_MESSAGE_BYTES = 2048
# alpha/beta: the bytes whose transfer costs as much as sending one more message.
LATENCY_BYTES = 64 * 1024
# "auto" hands messages shorter than this to the communicator's own Allreduce (measured at P = 2:
# docs/collectives.md).
AUTO_LIBRARY_BELOW = 32 << 20

_HAND_WRITTEN: dict[str, Callable[..., np.ndarray]] = {
    "ring": ring_allreduce,
    "naive": naive_allreduce,
    "recursive-doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce,
    "tree": tree_allreduce,
}


def choose_algorithm(nbytes: int, count: int, size: int) -> str:
    """The hand-written algorithm "auto" uses for `count` elements, `nbytes` in all, on `size`
    ranks: MPICH 3.x's choice, with the ring for long messages on P not a power of two."""
    pof2 = 1 << (max(size, 1).bit_length() - 1)
    if nbytes <= SHORT_MESSAGE_BYTES or count < pof2:  # latency wins: log2(p') messages
        return "recursive-doubling"
    if pof2 == size:
        return "rabenseifner"
    # The ring saves Rabenseifner's fold and unfold (about 2n bytes) for 2(P-1) messages.
    levels = pof2.bit_length() - 1
    extra_messages = 2 * (size - 1) - 2 * (levels + 1)
    bytes_saved = nbytes * (2 + 2 * (pof2 - 1) / pof2 - 2 * (size - 1) / size)
    return "ring" if bytes_saved >= extra_messages * LATENCY_BYTES else "rabenseifner"


def auto_choice(nbytes: int, count: int, size: int) -> str:
    """What "auto" does with `count` elements of `nbytes` bytes on `size` ranks: "mpi" (the
    library) below AUTO_LIBRARY_BELOW bytes, else the hand-written `choose_algorithm`."""
    return "mpi" if nbytes < AUTO_LIBRARY_BELOW else choose_algorithm(nbytes, count, size)


def _agree(
    buf: Any, comm: Any, name: str, defect: str | None = None,
    alike: tuple[tuple[str, int], ...] = (), names: Sequence[str] = (),
) -> None:  # fmt: skip
    """Raise ValueError on every rank unless all buffers are usable and of one length and dtype.

    `defect`: why this rank cannot take part ("" for nothing) if the caller checked, else None
    (then `buffer_defect` tells); `alike`: (what, value) pairs every rank must pass alike, the
    first a position in `names` if given (what the message shows).
    """
    if defect is None:
        defect = buffer_defect(buf, name)
    if comm.Get_size() == 1:
        if defect:
            raise ValueError(defect)
        return
    length = 0 if defect else buf.size
    code = NO_DTYPE if defect else DTYPE_CODE[buf.dtype]
    mine = np.array([bool(defect), length, -length, code, -code]
                    + [v for _, value in alike for v in (value, -value)], np.int64)  # fmt: skip
    every = np.empty_like(mine)
    with watching(f"{name}'s agreement round"):  # the extra collective: 40 bytes and `alike`
        comm.Allreduce(mine, every, op=constants(comm).MAX)
    unusable, longest, minus_shortest, last_dtype, minus_first_dtype = every[:5].tolist()
    if defect:
        raise ValueError(defect)
    mine_text = f"rank {comm.Get_rank()} has {buf.dtype} of length {buf.size}"
    if unusable:  # that rank says why; its values in `alike` are no choice to compare
        *listed, final = ["buffer", *(what for what, _ in alike)]
        refused = f"{', '.join(listed)} or {final}" if listed else final
        raise ValueError(f"{name}: another rank passed an unusable {refused} ({mine_text}); "
                         "the result is not a sum")  # fmt: skip
    _check_alike(name, alike, every[5:].tolist(), names, comm.Get_rank())
    differences = []
    if -minus_shortest != longest:
        differences.append(f"lengths from {-minus_shortest} to {longest}")
    if -minus_first_dtype != last_dtype:
        first, last = SUPPORTED_DTYPES[-minus_first_dtype], SUPPORTED_DTYPES[last_dtype]
        differences.append(f"dtypes {first} and {last}")
    if differences:
        raise ValueError(
            f"{name}: the ranks' buffers differ ({' and '.join(differences)}; {mine_text}); "
            "every rank must pass the same length and dtype"
        )


def _check_alike(name: str, alike: tuple[tuple[str, int], ...], bounds: list[int],
                 names: Sequence[str], rank: int) -> None:  # fmt: skip
    """ValueError if the ranks passed different values in `alike`: `bounds` holds each one's
    largest and minus its smallest over the ranks; the first is shown as one of `names`."""
    for index, (what, value) in enumerate(alike):
        largest, minus_smallest = bounds[2 * index : 2 * index + 2]
        if largest != -minus_smallest:
            other = largest if value != largest else -minus_smallest
            shown = [names[v] for v in (value, other)] if index == 0 and names else [value, other]
            raise ValueError(f"{name}: the ranks passed different {what}s: {shown[0]} on rank "
                             f"{rank}, {shown[1]} on another; every rank must pass the same "
                             f"{what}")  # fmt: skip


def _library_allreduce(
    buf: np.ndarray, comm: Any, trace: Trace | None, check: bool = True
) -> np.ndarray:
    """The communicator's own `Allreduce(IN_PLACE, buf, SUM)`, after the agreement check."""
    if check:
        _agree(buf, comm, "allreduce")
    start = time.perf_counter() if trace is not None else 0.0
    mpi = constants(comm)
    flat = buf.view(np.ndarray).ravel()  # as MPI sees it: ThreadComm's Allreduce wants one shape
    doing = records.doing  # what a collective timeout names (stored inline: this is hot)
    outer, doing.what = doing.what, "the library's allreduce"
    doing.calls += 1
    try:
        comm.Allreduce(mpi.IN_PLACE, flat, op=mpi.SUM)
    finally:
        doing.what = outer
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
    """Sum `buf` over all ranks of `comm` in place with one of ALGORITHMS and return it.

    `check=False` skips the agreement round of "mpi" and "auto". Every rank must pass the same
    `algorithm` and `check`. "hierarchical" runs on the nodes `set_hierarchy` kept on `comm`
    (by default: found now, MPI's shared-memory split; thread ranks are one node).
    """
    if algorithm in _HAND_WRITTEN:
        return execute(algorithm, buf, comm, trace)
    if algorithm == "hierarchical":  # on the nodes kept on comm (collectives.set_hierarchy)
        return execute(hierarchy_of(comm), buf, comm, trace)
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
    """`allreduce` with `comm`, `algorithm` and `check` resolved once: `reduce_(buf, trace=...)`."""
    if algorithm not in ALGORITHMS:
        raise _unknown(algorithm)
    if algorithm in _HAND_WRITTEN:  # straight to the executor: two Python calls less per use
        return functools.partial(execute, algorithm, comm=comm)
    if algorithm == "hierarchical":
        return functools.partial(execute, hierarchy_of(comm), comm=comm)
    if algorithm != "auto" or check:
        return functools.partial(allreduce, comm=comm, algorithm=algorithm, check=check)
    library_sum, mpi = comm.Allreduce, constants(comm)  # looked up here, once, not per call
    in_place, add = mpi.IN_PLACE, mpi.SUM

    def auto_(buf: np.ndarray, *, trace: Trace | None = None) -> np.ndarray:
        if buf.nbytes < AUTO_LIBRARY_BELOW and trace is None:  # the hot path: no more than this
            library_sum(in_place, buf, add)
            return buf
        return allreduce(buf, comm, "auto", trace=trace, check=False)

    return auto_
