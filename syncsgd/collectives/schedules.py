"""Every allreduce algorithm as a schedule: which chunk goes where in which step, on each rank.

How each algorithm works, and why every rank ends with the same bits: docs/collectives.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

COPY, ADD_OWN_FIRST, ADD_INCOMING_FIRST = 0, 1, 2  # what a step does with the data it receives
_NONE = slice(0, 0)


class CollectiveStep(NamedTuple):
    """One message operation of one rank: a send, a receive, or both at once (`Sendrecv`)."""

    phase: str
    step: int  # counts within the phase
    send_to: int  # -1: nothing sent
    recv_from: int  # -1: nothing received
    send_chunk: int  # -1: nothing sent
    recv_chunk: int  # -1: nothing received
    send: slice  # elements of the flattened buffer sent
    recv: slice  # elements of the flattened buffer the received data belongs to
    combine: int  # COPY into place, or add: own + incoming or incoming + own


Schedule = tuple[CollectiveStep, ...]


def chunk_bounds(length: int, parts: int) -> list[int]:
    """Start of each of `parts` chunks of `length` elements, plus `length`, as numpy.array_split."""
    base, extra = divmod(length, parts)
    return [c * base + min(c, extra) for c in range(parts + 1)]


@functools.lru_cache(maxsize=256)
def ring_schedule(length: int, size: int, rank: int) -> Schedule:
    """Reduce-scatter, then allgather, each P-1 steps around the ring."""
    bounds = chunk_bounds(length, size)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):  # send a partial sum right, add the one from the left to our own
        send, recv = (rank - s) % size, (rank - s - 1) % size
        steps.append(CollectiveStep("reduce-scatter", s, right, left, send, recv,
                                    chunk[send], chunk[recv], ADD_OWN_FIRST))  # fmt: skip
    for s in range(size - 1):  # pass the finished chunks on
        send, recv = (rank + 1 - s) % size, (rank - s) % size
        steps.append(CollectiveStep("allgather", s, right, left, send, recv,
                                    chunk[send], chunk[recv], COPY))  # fmt: skip
    return tuple(steps)


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


@functools.lru_cache(maxsize=256)
def naive_schedule(length: int, size: int, rank: int) -> Schedule:
    """Reduce to rank 0 in rank order, then rank 0 sends the sum to each rank in turn."""
    whole = slice(0, length)
    if rank == 0:  # step s: the message of rank s + 1
        reduce = [_recv("reduce", s, s + 1, 0, whole, ADD_OWN_FIRST) for s in range(size - 1)]
        return (*reduce, *(_send("broadcast", s, s + 1, 0, whole) for s in range(size - 1)))
    return _send("reduce", rank - 1, 0, 0, whole), _recv("broadcast", rank - 1, 0, 0, whole, COPY)


@functools.lru_cache(maxsize=256)
def tree_schedule(length: int, size: int, rank: int) -> Schedule:
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
def recursive_doubling_schedule(length: int, size: int, rank: int) -> Schedule:
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


def _halving_and_doubling(
    rank: int, newrank: int, extra: int, bounds: list[int]
) -> list[CollectiveStep]:
    """Rabenseifner's recursive-halving reduce-scatter, then the doubling allgather backwards."""
    levels = (len(bounds) - 1).bit_length() - 1  # len(bounds) = p' + 1

    def elements(first: int, stop: int) -> slice:
        return slice(bounds[first], bounds[stop])

    steps = []
    lo, hi = 0, len(bounds) - 1  # the window of chunks this rank is still responsible for
    for k in range(levels):  # partners at distance 1 first, as MPICH
        peer, mid = _real_rank(newrank ^ (1 << k), extra), (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if newrank >> k & 1 == 0 else ((mid, hi), (lo, mid))
        combine = _added_in_order(rank, peer)
        steps.append(CollectiveStep("reduce-scatter", k, peer, peer, give[0], keep[0],
                                    elements(*give), elements(*keep), combine))  # fmt: skip
        lo, hi = keep
    for step, k in enumerate(reversed(range(levels))):  # the same partners, backwards
        peer, width = _real_rank(newrank ^ (1 << k), extra), hi - lo
        other = (hi, hi + width) if newrank >> k & 1 == 0 else (lo - width, lo)
        steps.append(CollectiveStep("allgather", step, peer, peer, lo, other[0],
                                    elements(lo, hi), elements(*other), COPY))  # fmt: skip
        lo, hi = min(lo, other[0]), max(hi, other[1])
    return steps


@functools.lru_cache(maxsize=256)
def rabenseifner_schedule(length: int, size: int, rank: int) -> Schedule:
    """Fold, recursive-halving reduce-scatter, recursive-doubling allgather, unfold (as MPICH)."""
    whole = slice(0, length)
    pof2, extra, newrank = _folding(size, rank)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        steps += _halving_and_doubling(rank, newrank, extra, chunk_bounds(length, pof2))
    return tuple(steps + _fold("unfold", rank, extra, whole))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "ring": ring_schedule,
    "naive": naive_schedule,
    "recursive-doubling": recursive_doubling_schedule,
    "rabenseifner": rabenseifner_schedule,
    "tree": tree_schedule,
}


def schedule(algorithm: str, length: int, size: int, rank: int) -> Schedule:
    """The steps `rank` takes in a hand-written allreduce of `length` elements on `size` ranks."""
    try:
        steps_of = SCHEDULES[algorithm]
    except KeyError:
        raise ValueError(
            f"no schedule for allreduce algorithm {algorithm!r} (choose {', '.join(SCHEDULES)})"
        ) from None
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a communicator of size {size}")
    return steps_of(length, size, rank)
