"""`ring-demo --collective NAME`: the rounds of a broadcast, reduce, allgather, reduce-scatter or
alltoall.

Rank r's data is 10**r (one decimal digit per rank; r + 1 for P > 9), as in the allreduce demo:
broadcast starts with it on the root only (zeros elsewhere), allgather with it in rank r's block
only, reduce and reduce-scatter with it everywhere. Alltoall works on 2P blocks, as the executor
does: rank r's P blocks to send (each its data), then the P it receives (its own copied in). The
schedules run on thread ranks through the executor, on the one buffer they work in: so the partial
sums a reduce leaves off the root, and the other blocks of a reduce-scatter, are shown too; each
rank's result is the range `results` names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from syncsgd.apps.demo_core import (
    DIGIT_RANKS,
    MAX_LENGTH,
    MAX_RANKS,
    Demo,
    _annotate,
    _group_rounds,
    schedule_rounds,
    starting_buffer,
)
from syncsgd.collectives import COLLECTIVES, Collective, chunk_bounds, schedule
from syncsgd.collectives.executor import execute
from syncsgd.collectives.schedules import ROOTED
from syncsgd.comm.threads import run_threads

SHOWN = ("broadcast", "reduce", "allgather", "reduce-scatter", "alltoall")
STARTS = {
    "broadcast": "the root starts with its data, every other rank with zeros",
    "reduce": "every rank starts with its data in every element",
    "allgather": "rank r starts with its data in block r, zeros elsewhere",
    "reduce-scatter": "every rank starts with its data in every element",
    "alltoall": "blocks 0..P-1: what rank r sends, block j to rank j; blocks P..2P-1: what it "
                "receives, block P+i from rank i (its own block copied in at the start)",
}  # fmt: skip
EXPLAINED = {
    "broadcast": "every rank ends with the root's buffer",
    "reduce": "the root ends with the sum; the others keep partial sums (a copy of their data)",
    "allgather": "every rank ends with every block",
    "reduce-scatter": "every rank ends with the sum of its own block r (the rest: partial sums)",
    "alltoall": "every rank ends with block P+i from rank i: digit i of block P+i",
}
HOW = {
    ("broadcast", "ring"): "the root sends its P blocks to the right, one a round; each rank "
                           "passes on the block it got the round before",
    ("broadcast", "binomial"): "in round k each rank that has the data sends it 2^(K-1-k) ranks on",
    ("reduce", "ring"): "the blocks travel left to the root, one a round, each rank adding its own",
    ("reduce", "binomial"): "in round k ranks with bit k set send their sum to rank - 2^k, "
                            "which adds it",
    ("allgather", "ring"): "each round every rank passes the block it got last to the right",
    ("allgather", "recursive-doubling"): "in round k partners 2^k apart swap all the blocks they "
                                         "have (fold/unfold where P is not a power of two)",
    ("reduce-scatter", "ring"): "each round every rank adds the block from its left to its own and "
                                "passes it right; block r ends complete on rank r",
    ("reduce-scatter", "recursive-halving"): "partners p'/2, p'/4, ... apart swap half of their "
                                             "window and add (fold/unfold where P is not 2^L)",
    ("alltoall", "pairwise"): "in round s every rank r sends its block r+s to rank r+s and "
                              "receives rank r-s's block into block P+(r-s)",
}  # fmt: skip


def starting_data(collective: str, rank: int, ranks: int, root: int, length: int) -> np.ndarray:
    """Rank `rank`'s buffer before `collective`: its 10**rank where the collective reads it."""
    data = starting_buffer(rank, ranks, length)
    if collective == "alltoall":  # the blocks sent, then those received: the own one copied in
        half = length // 2
        block = half // ranks
        data[half:] = 0
        data[half + rank * block : half + (rank + 1) * block] = starting_buffer(rank, ranks, 1)[0]
    if collective == "broadcast" and rank != root:
        data[:] = 0
    if collective == "allgather":
        bounds = chunk_bounds(length, ranks)
        mine = data[bounds[rank] : bounds[rank + 1]].copy()
        data[:] = 0
        data[bounds[rank] : bounds[rank + 1]] = mine
    return data


def _rank_run(comm: Any, key: Collective, length: int) -> tuple[Any, ...]:
    """One rank: the starting buffer, (event, buffer copy) after every step, and the result."""
    buf = starting_data(key.name, comm.Get_rank(), comm.Get_size(), key.root, length)
    start, steps = buf.copy(), []

    def trace(event: Any) -> None:
        steps.append((event, buf.copy()))

    execute(key, buf, comm, trace)
    return start, steps, buf


def run_collective_demo(collective: str, ranks: int, length: int, algorithm: str = "ring",
                        root: int = 0) -> Demo:  # fmt: skip
    """Run `collective` by `algorithm` on thread ranks and group its steps into rounds."""
    if collective not in SHOWN:
        raise ValueError(f"ring-demo shows the collectives {', '.join(SHOWN)} (and allreduce), "
                         f"not {collective!r}")  # fmt: skip
    if algorithm not in COLLECTIVES[collective]:
        raise ValueError(f"no {collective} algorithm {algorithm!r} (choose from "
                         f"{', '.join(COLLECTIVES[collective])})")  # fmt: skip
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ring-demo shows 1 to {MAX_RANKS} ranks, got {ranks}")
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"ring-demo shows 0 to {MAX_LENGTH} elements, got {length}")
    if not 0 <= root < ranks:
        raise ValueError(f"--root {root} is not one of the {ranks} ranks")
    if collective == "alltoall":
        if length % ranks:
            raise ValueError(f"alltoall splits each rank's {length} elements into {ranks} equal "
                             f"blocks: give a --length that is a multiple of {ranks}")  # fmt: skip
        length *= 2  # the blocks sent, then those received
    root = root if collective in ROOTED else 0
    key = Collective(collective, algorithm, root)
    results = run_threads(ranks, _rank_run, key, length)
    start = [result[0] for result in results]
    per_rank = [_annotate(key, length, ranks, rank, steps) for rank, (_, steps, _) in
                enumerate(results)]  # fmt: skip
    rounds = schedule_rounds([schedule(key, length, ranks, r) for r in range(ranks)])
    bounds = chunk_bounds(length, ranks)
    # allgather: each block from its rank alone, so the sum of the starts is the gathered buffer
    expected = start[root].copy() if collective == "broadcast" else np.stack(start).sum(axis=0)
    whole, half = (0, length), length // 2
    if collective == "alltoall":  # block P+i from rank i, on every rank; what was sent is left
        expected[:half] = 0
        for source in range(ranks):
            block = slice(half + source * half // ranks, half + (source + 1) * half // ranks)
            expected[block] = starting_buffer(source, ranks, 1)[0]
    spans = {
        "broadcast": [whole] * ranks,
        "allgather": [whole] * ranks,
        "reduce": [whole if r == root else (0, 0) for r in range(ranks)],
        "reduce-scatter": [(bounds[r], bounds[r + 1]) for r in range(ranks)],
        "alltoall": [(half, length)] * ranks,
    }[collective]
    digits = ("rank r's data is 10**r: digit r of a value (from the right) says whether rank r "
              "is in it" if ranks <= DIGIT_RANKS else "rank r's data is r + 1")  # fmt: skip
    explanation = (digits, STARTS[collective], EXPLAINED[collective], HOW[collective, algorithm])
    return Demo(algorithm, ranks, length, start, _group_rounds(per_rank, rounds),
                [result[2] for result in results], expected, collective=collective, root=root,
                results=tuple(spans), explanation=explanation)  # fmt: skip
