"""`ring-demo --zero-stage 1`: one training step of ZeRO stage 1 on small integers.

The step of `training/sharded.py`, on P thread ranks and a buffer of n parameters:

    local gradient sums   rank r's is B·10**r in every element (one sample per rank, B = P), so
                          digit r of a partial sum says whether rank r's is in it, as in the
                          allreduce demo, and the sum divided by B is 11...1
    reduce-scatter        the ring allreduce's first half (`Collective("reduce-scatter",
                          "ring-allreduce")`): rank r ends with block (r + 1) mod P summed
    divide, update        each rank its own block: SGD with momentum, m = 0.9·m + g/B (m starts at
                          0), θ = θ - lr·m with lr = 1; θ_i starts at (i + 1)·10**k, k the digits
                          of g/B, so θ - g/B keeps the digits readable
    allgather             the ring allreduce's second half, carrying the parameters

Each half runs through the executor on the thread ranks, traced step by step, and is kept as a
`Demo`, so that the text reuses the allreduce demo's rounds. The sums are integers, and the
division by B exact: every rank's parameters must equal the serial step's, element for element.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from syncsgd.apps.demo_core import (
    ADDED,
    DIGIT_RANKS,
    MAX_LENGTH,
    MAX_RANKS,
    Demo,
    _annotate,
    _buffer_lines,
    _count,
    _group_rounds,
    _step_lines,
    format_buffer,
    schedule_rounds,
    starting_buffer,
)
from syncsgd.collectives import chunk_bounds, schedule
from syncsgd.collectives.executor import execute, sent_bytes
from syncsgd.collectives.schedules import Collective, owned_block
from syncsgd.comm.threads import run_threads

# The two halves of the ring allreduce, as syncsgd/training/sharded.py runs them.
REDUCE_SCATTER = Collective("reduce-scatter", "ring-allreduce")
ALLGATHER = Collective("allgather", "ring-allreduce")
LR = 1  # the learning rate: θ - lr·m stays an integer
MOMENTUM = "0.9"  # multiplies m, which starts at 0: the first step's m is g/B
ABSENT = "·"  # an element whose optimizer state another rank keeps


class ZeroDemo(NamedTuple):
    """A finished ZeRO-1 step: the two halves as demos, and each rank's update between them."""

    ranks: int
    length: int
    batch: int  # B: one sample per rank
    scattered: Demo  # the gradient sums' reduce-scatter
    mean: list[np.ndarray]  # per rank: g/B on its owned block (the optimizer's input)
    momentum: list[np.ndarray]  # per rank: m on its owned block, its optimizer state
    initial: np.ndarray  # θ before the step, the same on every rank
    gathered: Demo  # the parameters' allgather: starts with each rank's block updated

    def owned(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the block `rank` owns and updates."""
        bounds = chunk_bounds(self.length, self.ranks)
        block = owned_block(rank, self.ranks)
        return bounds[block], bounds[block + 1]

    @property
    def serial(self) -> np.ndarray:
        """The same step on one rank: θ - lr·(0.9·0 + the whole sum / B)."""
        return self.initial - LR * (np.stack(self.scattered.start).sum(axis=0) // self.batch)

    @property
    def correct(self) -> bool:
        """True if the reduce-scatter left every rank its block summed and every rank ends with
        the serial step's parameters."""
        return self.scattered.correct and all(np.array_equal(final, self.serial)
                                              for final in self.gathered.final)  # fmt: skip


def gradient_sums(rank: int, ranks: int, length: int) -> np.ndarray:
    """Rank `rank`'s local gradient sum: B·10**rank in every element (B·2**rank for P > 9)."""
    return ranks * starting_buffer(rank, ranks, length)


def initial_parameters(ranks: int, length: int) -> np.ndarray:
    """θ_i = (i + 1)·10**k, k the digits of the mean gradient (P for P <= 9): readable after."""
    mean = int(sum(starting_buffer(r, ranks, 1)[0] for r in range(ranks)))
    return (np.arange(length, dtype=np.int64) + 1) * 10 ** len(str(mean))


def _rank_step(comm: Any, length: int) -> tuple[Any, ...]:
    """One rank's step: reduce-scatter, divide and update its block, allgather; traced."""
    rank, ranks = comm.Get_rank(), comm.Get_size()
    grads = gradient_sums(rank, ranks, length)
    buf, scatter_steps = grads.copy(), []
    execute(REDUCE_SCATTER, buf, comm, lambda event: scatter_steps.append((event, buf.copy())))
    bounds = chunk_bounds(length, ranks)
    block = owned_block(rank, ranks)
    lo, hi = bounds[block], bounds[block + 1]
    mean = buf[lo:hi] // ranks  # exact: every rank's sum is a multiple of B
    state = np.zeros(hi - lo, np.int64)  # m: this block's alone
    state = state * 9 // 10 + mean  # m = 0.9·m + g/B, and m was 0
    params = initial_parameters(ranks, length)
    params[lo:hi] -= LR * state
    updated, gather_steps = params.copy(), []
    execute(ALLGATHER, params, comm, lambda event: gather_steps.append((event, params.copy())))
    return grads, scatter_steps, buf, mean, state, updated, gather_steps, params


def _half(key: Collective, ranks: int, length: int, start: list[np.ndarray],
          traced: Sequence[list[Any]], final: list[np.ndarray], expected: np.ndarray,
          results: Sequence[tuple[int, int]]) -> Demo:  # fmt: skip
    """One half of the step as a Demo: its steps grouped into rounds."""
    per_rank = [_annotate(key, length, ranks, rank, steps) for rank, steps in enumerate(traced)]
    rounds = schedule_rounds([schedule(key, length, ranks, r) for r in range(ranks)])
    return Demo(key.algorithm, ranks, length, start, _group_rounds(per_rank, rounds), final,
                expected, collective=key.name, results=tuple(results))  # fmt: skip


def run_zero_demo(ranks: int, length: int) -> ZeroDemo:
    """Run one ZeRO-1 step on `ranks` thread ranks and `length` parameters."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ring-demo shows 1 to {MAX_RANKS} ranks, got {ranks}")
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"ring-demo shows 0 to {MAX_LENGTH} elements, got {length}")
    results = run_threads(ranks, _rank_step, length)
    grads, scatter_steps, scattered, mean, state, updated, gather_steps, final = (
        [list(column) for column in zip(*results, strict=True)])  # fmt: skip
    bounds = chunk_bounds(length, ranks)
    owned = [(bounds[owned_block(r, ranks)], bounds[owned_block(r, ranks) + 1])
             for r in range(ranks)]  # fmt: skip
    total = np.stack(grads).sum(axis=0)
    initial = initial_parameters(ranks, length)
    reduce_scatter = _half(REDUCE_SCATTER, ranks, length, grads, scatter_steps, scattered, total,
                           owned)  # fmt: skip
    serial = initial - LR * (total // ranks)
    allgather = _half(ALLGATHER, ranks, length, updated, gather_steps, final, serial,
                      [(0, length)] * ranks)  # fmt: skip
    return ZeroDemo(ranks, length, ranks, reduce_scatter, mean, state, initial, allgather)


# -- text -----------------------------------------------------------------------------------------


def render_zero_text(zero: ZeroDemo, color: bool = False) -> str:
    """The step in five parts: gradient sums, reduce-scatter, update, allgather, the end."""
    scattered, gathered = zero.scattered, zero.gathered
    everything = [*scattered.start, zero.initial, *gathered.final]
    everything += [s.buffer for demo in (scattered, gathered) for _, group in demo.steps
                   for s in group]  # fmt: skip
    width = max([len(str(int(v))) for buf in everything for v in buf] or [1])
    label = len(f"rank {zero.ranks - 1} m")
    lines = _zero_header(zero, color)
    lines += ["", "1. local gradient sums: every rank the whole buffer, as at stage 0"]
    lines += _buffer_lines(scattered.start, width, label, color)
    lines += ["", _half_title(zero, 2, "reduce-scatter", "first", "the gradient sums")]
    lines += _step_lines(scattered, chunk_bounds(zero.length, zero.ranks), width, label, color)
    lines += _scattered_lines(zero)
    lines += ["", f"3. divide by B = {zero.batch} and update: each rank its own block, with that "
              "block's optimizer state"]  # fmt: skip
    lines += _update_lines(zero, width, label, color)
    lines += ["", _half_title(zero, 4, "allgather", "second", "the updated parameters")]
    lines.append("   (the step sends them in the communication buffer; shown here on θ)")
    lines += _step_lines(gathered, chunk_bounds(zero.length, zero.ranks), width, label, color)
    lines += ["", "5. result: every rank's parameters"]
    lines += _buffer_lines(gathered.final, width, label, color)
    lines.append(f"  {'serial':<{label}}: " + format_buffer(zero.serial, width))
    lines += _closing_lines(zero)
    return "\n".join(line.rstrip() for line in lines)


def _zero_header(zero: ZeroDemo, color: bool) -> list[str]:
    """What the numbers stand for, the blocks and who owns them."""
    p, n, b = zero.ranks, zero.length, zero.batch
    lines = [f"ZeRO stage 1: one training step of {_count(n, 'parameter')} on "
             f"{_count(p, 'thread rank')}, on small integers"]  # fmt: skip
    base = "10**r" if p <= DIGIT_RANKS else "2**r"
    lines.append(f"one sample per rank, so B = {p}; rank r's local gradient sum is {b}·{base} in "
                 "every element")  # fmt: skip
    if 1 < p <= DIGIT_RANKS:
        lines.append(f"  (digit r of a sum, from the right, is {b} if rank r's is in it: "
                     f"{str(b) * p} = all {p}; divided by B: {'1' * p})")  # fmt: skip
    scale = int(initial_parameters(p, 1)[0])
    lines.append(f"SGD with momentum {MOMENTUM} and lr = {LR}: m = {MOMENTUM}·m + g/B (m starts at "
                 "0), θ = θ - lr·m;")  # fmt: skip
    lines.append(f"  θ_i starts at {scale}·(i+1)")
    bounds = chunk_bounds(n, p)
    spans = "  ".join(f"{c} = [{bounds[c]}:{bounds[c + 1]})" for c in range(p))
    lines.append(f"blocks (as numpy.array_split): {spans}")
    lines.append("rank r owns block (r + 1) mod P, the one the ring's reduce-scatter completes on "
                 "it:")  # fmt: skip
    lines.append("  " + "; ".join(f"rank {r}: block {owned_block(r, p)}" for r in range(p)))
    if p == 1:
        lines.append("one rank has nobody to talk to: it owns the whole buffer")
    marked = "in colour" if color else "in [brackets]"
    lines.append(f"what each rank just received, and the block it owns in part 3, is {marked}")
    return lines


def _half_title(zero: ZeroDemo, number: int, name: str, half: str, what: str) -> str:
    """'2. reduce-scatter: the ring allreduce's first half, 2 rounds on the gradient sums'."""
    rounds = len((zero.scattered if name == "reduce-scatter" else zero.gathered).steps)
    rounds_text = _count(rounds, "round")
    return f"{number}. {name}: the ring allreduce's {half} half, {rounds_text} on {what}"


def _scattered_lines(zero: ZeroDemo) -> list[str]:
    """What each rank holds complete after the reduce-scatter."""
    total = np.stack(zero.scattered.start).sum(axis=0)
    whole = f"{int(total[0])}, the sum over all {zero.ranks}" if zero.length else "nothing"
    lines = [f"  each rank now holds its own block summed: {whole}"]
    if zero.ranks > 1:
        lines.append("  (its other blocks hold partial sums it will not use)")
    return lines


def _update_lines(zero: ZeroDemo, width: int, label: int, color: bool) -> list[str]:
    """Per rank: its optimizer state m (its block only) and its parameters, the block updated."""
    total = int(np.stack(zero.scattered.start).sum(axis=0)[0]) if zero.length else 0
    mean = total // zero.batch
    lines = [f"  on its block each rank: g/B = {total}/{zero.batch} = {mean}; m = {MOMENTUM}·0 + "
             f"{mean}; θ = θ - {LR}·{mean}",
             f"  m: the rank's optimizer state, on its block alone ({ABSENT}: another rank keeps "
             "it)"]  # fmt: skip
    for rank in range(zero.ranks):
        lo, hi = zero.owned(rank)
        state = np.array([ABSENT] * zero.length, dtype=object)
        state[lo:hi] = zero.momentum[rank]
        empty = "" if hi > lo else (f"   block {owned_block(rank, zero.ranks)} is empty: no "
                                    "parameters, no optimizer state")  # fmt: skip
        row = format_buffer(state, width, (lo, hi), ADDED, color)
        lines.append(f"  {f'rank {rank} m':<{label}}: {row}{empty}")
        row = format_buffer(zero.gathered.start[rank], width, (lo, hi), ADDED, color)
        lines.append(f"  {f'rank {rank} θ':<{label}}: {row}")
    return lines


def _closing_lines(zero: ZeroDemo) -> list[str]:
    """The verdict, what each rank sent, what each keeps of the optimizer state."""
    p, n = zero.ranks, zero.length
    same = zero.correct
    lines = ["every rank holds the same parameters, equal to the serial step" if same else
             "WRONG: the ranks' parameters are not the serial step's"]  # fmt: skip
    sent = [sum(int(s.event.nbytes) // 8 for demo in (zero.scattered, zero.gathered)
                for _, group in demo.steps for s in group if s.event.rank == rank)
            for rank in range(p)]  # fmt: skip
    ring = [sent_bytes("ring", n, 8, p, rank, stepped=True) // 8 for rank in range(p)]
    if p > 1:
        fraction = Fraction(2 * (p - 1), p)
        lines.append(f"sent: each rank about 2(P-1)/P = {fraction} times the buffer's {n} "
                     "elements, as in the ring allreduce:")  # fmt: skip
        lines.append(f"  {', '.join(map(str, sent))} elements (rank 0, 1, ...; the allreduce: "
                     f"{', '.join(map(str, ring))})")  # fmt: skip
    else:
        lines.append("sent: nothing, as the allreduce on one rank")
    kept = [zero.owned(r)[1] - zero.owned(r)[0] for r in range(p)]
    lines.append(f"saved: each rank keeps the optimizer state (m) of its block alone, 1/P: "
                 f"{', '.join(map(str, kept))} of {n} elements;")  # fmt: skip
    lines.append(f"  at stage 0 every rank keeps all {n} (with Adam: two arrays of them)")
    return lines
