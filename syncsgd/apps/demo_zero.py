"""`ring-demo --zero-stage K`: one training step of ZeRO stage 1, 2 or 3 on small integers.

The step of `training/sharded.py`, on P thread ranks and a buffer of n parameters in one bucket:

    (stage 3) allgather   each rank keeps its block of θ alone; the ring allreduce's second half
                          brings θ whole into the bucket's buffer before the forward pass (one
                          bucket: the backward pass finds it still there)
    local gradient sums   rank r's is B·10**r in every element (one sample per rank, B = P), so
                          digit r of a partial sum says whether rank r's is in it, as in the
                          allreduce demo, and the sum divided by B is 11...1
    reduce-scatter        the ring allreduce's first half (`Collective("reduce-scatter",
                          "ring-allreduce")`): rank r ends with block (r + 1) mod P summed
                          (stages 2 and 3 keep that block of the sums alone)
    divide, update        each rank its own block: SGD with momentum, m = 0.9·m + g/B (m starts at
                          0), θ = θ - lr·m with lr = 1; θ_i starts at (i + 1)·10**k, k the digits
                          of g/B, so θ - g/B keeps the digits readable
    allgather             (stages 1 and 2) the ring allreduce's second half, carrying the
                          parameters; stage 3 keeps its updated block alone instead

Each collective runs through the executor on the thread ranks, traced step by step, and is kept as
a `Demo`, so that the text reuses the allreduce demo's rounds. The sums are integers, and the
division by B exact: every rank's parameters (stage 3: its block of them) must equal the serial
step's, element for element.
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
STAGES = (1, 2, 3)
LR = 1  # the learning rate: θ - lr·m stays an integer
MOMENTUM = "0.9"  # multiplies m, which starts at 0: the first step's m is g/B
ABSENT = "·"  # an element this rank does not keep: another rank does (or nobody, now)


class ZeroDemo(NamedTuple):
    """A finished step: its collectives as demos, and each rank's update between them."""

    ranks: int
    length: int
    batch: int  # B: one sample per rank
    stage: int
    fetched: Demo | None  # stage 3: the parameters' allgather before the passes
    scattered: Demo  # the gradient sums' reduce-scatter
    mean: list[np.ndarray]  # per rank: g/B on its owned block (the optimizer's input)
    momentum: list[np.ndarray]  # per rank: m on its owned block, its optimizer state
    initial: np.ndarray  # θ before the step (stage 3: every rank keeps its block of it)
    updated: list[np.ndarray]  # per rank: θ with its own block updated
    gathered: Demo | None  # stages 1, 2: the parameters' allgather after the update

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
    def halves(self) -> list[Demo]:
        """The step's collectives in the order it runs them."""
        return [demo for demo in (self.fetched, self.scattered, self.gathered) if demo is not None]

    @property
    def correct(self) -> bool:
        """True if every collective did its part and every rank ends with the serial step's
        parameters (stage 3: its own block of them)."""
        serial = self.serial
        if self.gathered is not None:
            ends = all(np.array_equal(final, serial) for final in self.gathered.final)
        else:
            ends = all(np.array_equal(self.updated[r][slice(*self.owned(r))],
                                      serial[slice(*self.owned(r))]) for r in range(self.ranks))
        return all(demo.correct for demo in self.halves) and ends

    def kept(self, values: np.ndarray, rank: int) -> np.ndarray:
        """`values` on the rank's own block, ABSENT elsewhere: what a sharded array keeps."""
        lo, hi = self.owned(rank)
        shown = np.array([ABSENT] * self.length, dtype=object)
        shown[lo:hi] = values[lo:hi] if values.size == self.length else values
        return shown

    def parameters(self, rank: int) -> np.ndarray:
        """θ as the rank keeps it after its update: whole (stages 1, 2), its block (stage 3)."""
        if self.stage < 3:
            return self.updated[rank].astype(object)
        return self.kept(self.updated[rank], rank)


def gradient_sums(rank: int, ranks: int, length: int) -> np.ndarray:
    """Rank `rank`'s local gradient sum: B·10**rank in every element (B·2**rank for P > 9)."""
    return ranks * starting_buffer(rank, ranks, length)


def initial_parameters(ranks: int, length: int) -> np.ndarray:
    """θ_i = (i + 1)·10**k, k the digits of the mean gradient (P for P <= 9): readable after."""
    mean = int(sum(starting_buffer(r, ranks, 1)[0] for r in range(ranks)))
    return (np.arange(length, dtype=np.int64) + 1) * 10 ** len(str(mean))


def _traced(key: Collective, buf: np.ndarray, comm: Any) -> list[tuple[Any, np.ndarray]]:
    """Run one collective on `buf` in place; every step's event and the buffer right after."""
    steps: list[tuple[Any, np.ndarray]] = []
    execute(key, buf, comm, lambda event: steps.append((event, buf.copy())))
    return steps


def _rank_step(comm: Any, length: int, stage: int) -> tuple[Any, ...]:
    """One rank's step: (stage 3) allgather θ, reduce-scatter, divide and update its block,
    (stages 1, 2) allgather; traced."""
    rank, ranks = comm.Get_rank(), comm.Get_size()
    bounds = chunk_bounds(length, ranks)
    block = owned_block(rank, ranks)
    lo, hi = bounds[block], bounds[block + 1]
    params = initial_parameters(ranks, length)
    fetch = None
    if stage == 3:  # the bucket's buffer (zeros), this rank's block of θ copied in, gathered
        start, params = params, np.zeros(length, np.int64)
        params[lo:hi] = start[lo:hi]
        fetch = (params.copy(), _traced(ALLGATHER, params, comm), params.copy())
    grads = gradient_sums(rank, ranks, length)
    buf = grads.copy()
    scatter = (grads, _traced(REDUCE_SCATTER, buf, comm), buf)
    mean = buf[lo:hi] // ranks  # exact: every rank's sum is a multiple of B
    state = np.zeros(hi - lo, np.int64)  # m: this block's alone
    state = state * 9 // 10 + mean  # m = 0.9·m + g/B, and m was 0
    params[lo:hi] -= LR * state
    updated = params.copy()
    gather = (updated, _traced(ALLGATHER, params, comm), params) if stage < 3 else None
    return fetch, scatter, mean, state, updated, gather


def _half(key: Collective, ranks: int, length: int, traced: Sequence[Any], expected: np.ndarray,
          results: Sequence[tuple[int, int]]) -> Demo:  # fmt: skip
    """One collective of the step as a Demo: per rank (start, steps, final), its steps grouped
    into rounds."""
    start, steps, final = ([list(column) for column in zip(*traced, strict=True)]
                           if traced else ([], [], []))  # fmt: skip
    per_rank = [_annotate(key, length, ranks, rank, taken) for rank, taken in enumerate(steps)]
    rounds = schedule_rounds([schedule(key, length, ranks, r) for r in range(ranks)])
    return Demo(key.algorithm, ranks, length, start, _group_rounds(per_rank, rounds), final,
                expected, collective=key.name, results=tuple(results))  # fmt: skip


def run_zero_demo(ranks: int, length: int, stage: int = 1) -> ZeroDemo:
    """Run one step of ZeRO stage `stage` on `ranks` thread ranks and `length` parameters."""
    if stage not in STAGES:
        raise ValueError(f"ring-demo shows ZeRO stages 1 to 3, got {stage}")
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ring-demo shows 1 to {MAX_RANKS} ranks, got {ranks}")
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"ring-demo shows 0 to {MAX_LENGTH} elements, got {length}")
    results = run_threads(ranks, _rank_step, length, stage)
    fetch, scatter, mean, state, updated, gather = [list(c) for c in zip(*results, strict=True)]
    bounds = chunk_bounds(length, ranks)
    owned = [(bounds[owned_block(r, ranks)], bounds[owned_block(r, ranks) + 1])
             for r in range(ranks)]  # fmt: skip
    total = np.stack([grads for grads, _, _ in scatter]).sum(axis=0)
    initial = initial_parameters(ranks, length)
    whole = [(0, length)] * ranks
    fetched = _half(ALLGATHER, ranks, length, fetch, initial, whole) if stage == 3 else None
    reduce_scatter = _half(REDUCE_SCATTER, ranks, length, scatter, total, owned)
    serial = initial - LR * (total // ranks)
    allgather = _half(ALLGATHER, ranks, length, gather, serial, whole) if stage < 3 else None
    return ZeroDemo(ranks, length, ranks, stage, fetched, reduce_scatter, mean, state, initial,
                    updated, allgather)  # fmt: skip


def shown_fetch(zero: ZeroDemo) -> Demo:
    """Stage 3's allgather as each rank holds it: ABSENT where no block has arrived yet."""
    assert zero.fetched is not None
    held = [[zero.owned(rank)] for rank in range(zero.ranks)]

    def shown(buffer: np.ndarray, rank: int) -> np.ndarray:
        cells = np.array([ABSENT] * zero.length, dtype=object)
        for lo, hi in held[rank]:
            cells[lo:hi] = buffer[lo:hi]
        return cells

    start = [shown(buffer, rank) for rank, buffer in enumerate(zero.fetched.start)]
    steps = []
    for title, group in zero.fetched.steps:
        for snapshot in group:
            held[snapshot.event.rank].append(tuple(snapshot.event.recv_range))
        steps.append((title, [s._replace(buffer=shown(s.buffer, s.event.rank)) for s in group]))
    final = [shown(buffer, rank) for rank, buffer in enumerate(zero.fetched.final)]
    return zero.fetched._replace(start=start, steps=steps, final=final)


# -- text -----------------------------------------------------------------------------------------


def render_zero_text(zero: ZeroDemo, color: bool = False) -> str:
    """The step part by part: stage 3's allgather, the gradient sums, the reduce-scatter, the
    update, stages 1 and 2's allgather, the end."""
    everything = [*zero.scattered.start, zero.initial, *zero.updated]
    everything += [s.buffer for demo in zero.halves for _, group in demo.steps for s in group]
    everything += [demo.final[rank] for demo in zero.halves for rank in range(zero.ranks)]
    width = max([len(str(int(v))) for buf in everything for v in buf] or [1])
    label = len(f"rank {zero.ranks - 1} m")
    lines = _zero_header(zero, color)
    number = 1
    if zero.stage == 3:
        lines += _fetch_lines(zero, width, label, color)
        number = 3
    lines += ["", f"{number}. local gradient sums: " + (
        "every rank the whole buffer, as at stage 0" if zero.stage == 1 else
        "every rank the whole bucket (one here), as the backward pass writes it")]  # fmt: skip
    lines += _buffer_lines(zero.scattered.start, width, label, color)
    lines += ["", _half_title(zero, number + 1, "reduce-scatter", "first", "the gradient sums")]
    lines += _step_lines(zero.scattered, chunk_bounds(zero.length, zero.ranks), width, label, color)
    lines += _scattered_lines(zero, width, label, color)
    lines += ["", f"{number + 2}. divide by B = {zero.batch} and update: each rank its own block, "
              f"with that block's {_state_words(zero)}"]  # fmt: skip
    lines += _update_lines(zero, width, label, color)
    if zero.gathered is not None:
        lines += ["", _half_title(zero, 4, "allgather", "second", "the updated parameters")]
        lines.append("   (the step sends them in the communication buffer; shown here on θ)"
                     if zero.stage == 1 else "   (the step sends them in θ itself or in a spent "
                     "buffer; shown here on θ)")  # fmt: skip
        lines += _step_lines(zero.gathered, chunk_bounds(zero.length, zero.ranks), width, label,
                             color)  # fmt: skip
        lines += ["", "5. result: every rank's parameters"]
        lines += _buffer_lines(zero.gathered.final, width, label, color)
    else:
        lines += ["", "6. result: each rank's block of the parameters (the next step's passes "
                  "gather them again)"]  # fmt: skip
        lines += [f"  {f'rank {r} θ':<{label}}: " + format_buffer(zero.parameters(r), width)
                  for r in range(zero.ranks)]  # fmt: skip
        together = np.array([zero.updated[owner_of(zero, i)][i] for i in range(zero.length)])
        lines.append(f"  {'blocks':<{label}}: " + format_buffer(together, width))
    lines.append(f"  {'serial':<{label}}: " + format_buffer(zero.serial, width))
    lines += _closing_lines(zero)
    return "\n".join(line.rstrip() for line in lines)


def owner_of(zero: ZeroDemo, index: int) -> int:
    """The rank whose block holds element `index`."""
    return next(r for r in range(zero.ranks) if zero.owned(r)[0] <= index < zero.owned(r)[1])


def _state_words(zero: ZeroDemo) -> str:
    """What a rank keeps of its block besides θ, for the update's title."""
    return "optimizer state" if zero.stage == 1 else "g and optimizer state"


def _zero_header(zero: ZeroDemo, color: bool) -> list[str]:
    """What the numbers stand for, the blocks and who owns them."""
    p, n, b = zero.ranks, zero.length, zero.batch
    lines = [f"ZeRO stage {zero.stage}: one training step of {_count(n, 'parameter')} on "
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
    owns = "the block it owns in part 3" if zero.stage == 1 else "the block it keeps alone"
    lines.append(f"what each rank just received, and {owns}, is {marked}")
    return lines


def _fetch_lines(zero: ZeroDemo, width: int, label: int, color: bool) -> list[str]:
    """Stage 3's first two parts: each rank's block of θ, and the allgather before the passes."""
    lines = ["", f"1. parameters: each rank keeps its own block of θ alone ({ABSENT}: another rank "
             "keeps it)"]  # fmt: skip
    for rank in range(zero.ranks):
        row = format_buffer(zero.kept(zero.initial, rank), width, zero.owned(rank), ADDED, color)
        lines.append(f"  {f'rank {rank} θ':<{label}}: {row}{_empty_note(zero, rank)}")
    lines += ["", _half_title(zero, 2, "allgather", "second", "the parameters, before the forward "
                              "pass")]  # fmt: skip
    lines.append("   (into the bucket's buffer; one bucket here, so the backward pass finds θ "
                 "still there)")  # fmt: skip
    lines += _step_lines(shown_fetch(zero), chunk_bounds(zero.length, zero.ranks), width, label,
                         color)  # fmt: skip
    lines.append("  every rank now holds θ whole, for the forward and the backward pass")
    return lines


def _half_title(zero: ZeroDemo, number: int, name: str, half: str, what: str) -> str:
    """'2. reduce-scatter: the ring allreduce's first half, 2 rounds on the gradient sums'."""
    demo = zero.scattered if name == "reduce-scatter" else (zero.fetched or zero.gathered)
    assert demo is not None
    rounds_text = _count(len(demo.steps), "round")
    return f"{number}. {name}: the ring allreduce's {half} half, {rounds_text} on {what}"


def _scattered_lines(zero: ZeroDemo, width: int, label: int, color: bool) -> list[str]:
    """What each rank holds complete after the reduce-scatter (stages 2, 3: all it keeps)."""
    total = np.stack(zero.scattered.start).sum(axis=0)
    whole = f"{int(total[0])}, the sum over all {zero.ranks}" if zero.length else "nothing"
    lines = [f"  each rank now holds its own block summed: {whole}"]
    if zero.stage == 1:
        if zero.ranks > 1:
            lines.append("  (its other blocks hold partial sums it will not use)")
        return lines
    lines.append(f"  g: the gradient sums a rank keeps, its own block's alone ({ABSENT}: dropped,")
    lines.append("  the bucket's buffer then serves the next bucket)")
    for rank in range(zero.ranks):
        row = format_buffer(zero.kept(zero.scattered.final[rank], rank), width, zero.owned(rank),
                            ADDED, color)  # fmt: skip
        lines.append(f"  {f'rank {rank} g':<{label}}: {row}{_empty_note(zero, rank)}")
    return lines


def _empty_note(zero: ZeroDemo, rank: int) -> str:
    """'   block 2 is empty: ...' for a rank that owns no parameter, else ''."""
    lo, hi = zero.owned(rank)
    if hi > lo:
        return ""
    keeps = "no optimizer state" if zero.stage == 1 else "no gradient, no optimizer state"
    return f"   block {owned_block(rank, zero.ranks)} is empty: no parameters, {keeps}"


def _update_lines(zero: ZeroDemo, width: int, label: int, color: bool) -> list[str]:
    """Per rank: its optimizer state m (its block only) and its parameters, the block updated."""
    total = int(np.stack(zero.scattered.start).sum(axis=0)[0]) if zero.length else 0
    mean = total // zero.batch
    lines = [f"  on its block each rank: g/B = {total}/{zero.batch} = {mean}; m = {MOMENTUM}·0 + "
             f"{mean}; θ = θ - {LR}·{mean}",
             f"  m: the rank's optimizer state, on its block alone ({ABSENT}: another rank keeps "
             "it)"]  # fmt: skip
    if zero.stage == 3:
        lines.append("  θ: its block updated; it forgets the θ it gathered, and keeps its block "
                     "alone")  # fmt: skip
    for rank in range(zero.ranks):
        lo, hi = zero.owned(rank)
        row = format_buffer(zero.kept(zero.momentum[rank], rank), width, (lo, hi), ADDED, color)
        lines.append(f"  {f'rank {rank} m':<{label}}: {row}{_empty_note(zero, rank)}")
        row = format_buffer(zero.parameters(rank), width, (lo, hi), ADDED, color)
        lines.append(f"  {f'rank {rank} θ':<{label}}: {row}")
    return lines


def _closing_lines(zero: ZeroDemo) -> list[str]:
    """The verdict, what each rank sent, what each keeps."""
    p, n = zero.ranks, zero.length
    if zero.stage < 3:
        lines = ["every rank holds the same parameters, equal to the serial step" if zero.correct
                 else "WRONG: the ranks' parameters are not the serial step's"]  # fmt: skip
    else:
        lines = ["every rank's block equals the serial step's: together they are its parameters"
                 if zero.correct else "WRONG: the ranks' blocks are not the serial step's"]
    sent = [sum(int(s.event.nbytes) // 8 for demo in zero.halves for _, group in demo.steps
                for s in group if s.event.rank == rank)
            for rank in range(p)]  # fmt: skip
    ring = [sent_bytes("ring", n, 8, p, rank, stepped=True) // 8 for rank in range(p)]
    if p > 1:
        fraction = Fraction(2 * (p - 1), p)
        lines.append(f"sent: each rank about 2(P-1)/P = {fraction} times the buffer's {n} "
                     "elements, as in the ring allreduce:")  # fmt: skip
        lines.append(f"  {', '.join(map(str, sent))} elements (rank 0, 1, ...; the allreduce: "
                     f"{', '.join(map(str, ring))})")  # fmt: skip
        if zero.stage == 3:
            lines.append("  the passes' allgather and the reduce-scatter, none after the update; "
                         "with a bucket")  # fmt: skip
            lines.append("  per layer (--bucket-bytes 0) the backward pass gathers again, all but "
                         "the last layer's")  # fmt: skip
    else:
        lines.append("sent: nothing, as the allreduce on one rank")
    return lines + _saved_lines(zero)


def _saved_lines(zero: ZeroDemo) -> list[str]:
    """What each rank keeps of θ, g and m: its block's alone, as the stage shards them."""
    n = zero.length
    kept = ", ".join(str(zero.owned(r)[1] - zero.owned(r)[0]) for r in range(zero.ranks))
    if zero.stage == 1:
        return [f"saved: each rank keeps the optimizer state (m) of its block alone, 1/P: "
                f"{kept} of {n} elements;",
                f"  at stage 0 every rank keeps all {n} (with Adam: two arrays of them)"]
    arrays, whole = ("g and m", ", and θ whole") if zero.stage == 2 else ("θ, g and m", "")
    held = ("the backward pass writes a bucket, its buffer holds its sums" if zero.stage == 2
            else "a pass reads a bucket, its buffer holds its parameters")
    return [f"saved: each rank keeps {arrays} of its block alone, 1/P: {kept} of {n} elements "
            f"each{whole};",
            f"  at stage 0 every rank keeps all {n} of each",
            f"  (while {held} whole: here, one bucket, all {n})"]
