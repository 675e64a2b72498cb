"""The ring's short messages: each rank gathers all P buffers in the ring's first P-1 steps and
adds them itself, in the order the ring's schedule adds them.

Why the bits are the ring's, why ranks on the two paths cannot hang each other, and what it saves:
docs/collectives.md.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from syncsgd.collectives.schedules import (
    ADD_OWN_FIRST,
    COPY,
    SCHEDULES,
    CollectiveStep,
    Schedule,
)

# The ring gathers instead of stepping for buffers of at most this many bytes on at most this many
# ranks: at P = 2 the gather sends what the ring sends, in one message instead of two; on more
# ranks it would send (P-1)n bytes where the ring sends 2(P-1)/P n (docs/collectives.md).
SMALL_MESSAGE_BYTES, SMALL_MESSAGE_RANKS = 2048, 2
# A sum as the schedule forms it: a rank's own value (its number), or (a, b) for a + b in that
# order. Elements whose sums are formed alike share one expression.
Expression = Any


def gathers(algorithm: Any, nbytes: int, size: int) -> bool:
    """True if the executor runs `algorithm` on `nbytes` over `size` ranks by gathering."""
    return algorithm == "ring" and nbytes <= SMALL_MESSAGE_BYTES and 1 < size <= SMALL_MESSAGE_RANKS


def gather_steps(size: int, rank: int) -> Schedule:
    """The ring's first P-1 steps as they carry whole buffers: in step s, rank r passes rank
    (r - s)'s buffer right and receives rank (r - s - 1)'s from the left (block b: rank b's)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    whole = slice(0, 0)  # the bytes are the plan's: each block is a buffer and one byte more
    return tuple(CollectiveStep("gather", s, right, left, (rank - s) % size,
                                (rank - s - 1) % size, whole, whole, COPY)
                 for s in range(size - 1))  # fmt: skip


def tail_steps(size: int, rank: int) -> Schedule:
    """The ring's last P-1 steps with nothing in them: what a rank that gathered takes when
    something is wrong, so that ranks that stepped through the ring find their partners."""
    right, left = (rank + 1) % size, (rank - 1) % size
    nothing = slice(0, 0)
    return tuple(CollectiveStep("allgather", s, right, left, -1, -1, nothing, nothing, COPY)
                 for s in range(size - 1))  # fmt: skip


@functools.lru_cache(maxsize=64)
def sum_expressions(algorithm: str, length: int, size: int, rank: int) -> tuple[Expression, ...]:
    """Element by element, the sum `rank` holds after `algorithm`'s schedule, as the schedule
    forms it: every rank's steps replayed on expressions in place of numbers."""
    held = [[r] * length for r in range(size)]
    steps = [SCHEDULES[algorithm](length, size, r) for r in range(size)]
    taken, posted = [0] * size, [False] * size
    mailbox: dict[tuple[int, int], deque] = {}
    while any(taken[r] < len(steps[r]) for r in range(size)):
        moved = False
        for r in range(size):
            if taken[r] == len(steps[r]):
                continue
            step = steps[r][taken[r]]
            if step.send_to >= 0 and not posted[r]:  # sent as it is now, before the receive
                mailbox.setdefault((r, step.send_to), deque()).append(held[r][step.send])
                posted[r] = moved = True
            if step.recv_from >= 0:
                queue = mailbox.get((step.recv_from, r))
                if not queue:
                    continue
                _combine(held[r], step, queue.popleft())
            taken[r], posted[r], moved = taken[r] + 1, False, True
        if not moved:
            raise RuntimeError(f"the {algorithm} schedule deadlocks on {size} ranks")
    return tuple(held[rank])


def _combine(own: list, step: CollectiveStep, incoming: list) -> None:
    """What `step` does with the incoming expressions: place them, or add in its order."""
    where = range(step.recv.start, step.recv.stop)
    if step.combine == COPY:
        own[step.recv] = incoming
    elif step.combine == ADD_OWN_FIRST:
        for i, value in zip(where, incoming, strict=True):
            own[i] = (own[i], value)
    else:
        for i, value in zip(where, incoming, strict=True):
            own[i] = (value, own[i])


def runs(expressions: tuple[Expression, ...]) -> list[tuple[int, int, Expression]]:
    """(start, stop, expression) of each run of consecutive elements summed alike."""
    found: list[tuple[int, int, Expression]] = []
    for i, expression in enumerate(expressions):
        if found and found[-1][2] == expression:
            found[-1] = (found[-1][0], i + 1, expression)
        else:
            found.append((i, i + 1, expression))
    return found


class Adds(NamedTuple):
    """The adds that turn the gathered buffers into the sums: first the inner ones, on views of
    the plan's rows, then each run's last, into the caller's buffer."""

    inner: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # (a, b, out): out = a + b
    inner_scalars: tuple[tuple[int, int, int], ...]  # the same as indices into the flat rows
    last: tuple[tuple[np.ndarray, np.ndarray, slice], ...]  # (a, b, where in the buffer)
    last_scalars: tuple[tuple[int, int, int], ...]  # (a, b in the rows, index in the buffer)


Add = tuple[int, int, int]  # (a, b, out): row out = row a + row b, in that order
RunAdds = tuple[int, int, tuple[Add, ...]]  # (start, stop, adds) of a run of elements


@functools.lru_cache(maxsize=64)
def row_adds(algorithm: str, length: int, size: int, rank: int) -> tuple[tuple[RunAdds, ...], int]:
    """Per run of elements summed alike, (start, stop, adds (a, b, out) as row numbers) that
    leave the sum in row P; and the rows they use in all. Rows 0..P-1 are the gathered buffers,
    the rows after P scratch for a sum of sums."""
    found, rows = [], size + 1
    for start, stop, expression in runs(sum_expressions(algorithm, length, size, rank)):
        adds: list[Add] = []
        if _emit(expression, size, adds) != size:
            raise ValueError(f"the {algorithm} schedule leaves an element unsummed")
        rows = max([rows, *(out + 1 for _, _, out in adds)])
        found.append((start, stop, tuple(adds)))
    return tuple(found), rows


def _emit(expression: Expression, out: int, adds: list[Add]) -> int:
    """Append the adds that leave `expression` in row `out`; the row it is in (a leaf: its own)."""
    if not isinstance(expression, tuple):
        return int(expression)
    first, second = expression
    if isinstance(first, tuple) and isinstance(second, tuple):
        a, b = _emit(first, out, adds), _emit(second, out + 1, adds)
    elif isinstance(second, tuple):  # the other operand is a rank's own: sum into `out` itself
        a, b = first, _emit(second, out, adds)
    else:
        a, b = _emit(first, out, adds), second
    adds.append((a, b, out))
    return out


def bound(algorithm: str, length: int, size: int, rank: int, rows: np.ndarray) -> Adds:
    """`row_adds` on `rows` (rows x (length + 1) elements): views, and flat indices for runs of
    one element (NumPy's ufuncs are slow on one element)."""
    inner: list[Any] = []
    inner_scalars: list[Any] = []
    last: list[Any] = []
    last_scalars: list[Any] = []
    width = rows.shape[1]
    for start, stop, adds in row_adds(algorithm, length, size, rank)[0]:
        *before, (first, second, _) = adds  # the last add leaves the run's sum: in the buffer
        if stop - start == 1:
            inner_scalars += [(a * width + start, b * width + start, out * width + start)
                              for a, b, out in before]  # fmt: skip
            last_scalars.append((first * width + start, second * width + start, start))
        else:
            inner += [(rows[a, start:stop], rows[b, start:stop], rows[out, start:stop])
                      for a, b, out in before]  # fmt: skip
            last.append((rows[first, start:stop], rows[second, start:stop], slice(start, stop)))
    return Adds(tuple(inner), tuple(inner_scalars), tuple(last), tuple(last_scalars))
