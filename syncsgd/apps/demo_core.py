"""ring-demo's rounds: an allreduce run on small integers, grouped into rounds, and as text.

P thread ranks run the allreduce on int64 buffers. Rank r starts with 10**r in every element
(for P <= 9), so each decimal digit of a partial sum says which ranks it already contains: 101 is
ranks 0 and 2, and the final 111 is everyone; a 2 would be a rank counted twice. (For P > 9 rank
r starts with 2**r: the binary digits say the same.) The trace callback runs on each rank's
thread right after each step, and copies the rank's buffer there. The steps are grouped into
rounds from the algorithm's schedules (in a round each rank sends and receives at most one
message, as the cost model counts them) and printed round by round: each rank's buffer with the
range it just received in [brackets] (in colour on a terminal), and which chunks, as element
ranges, it sent and received, and with whom.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from syncsgd import collectives
from syncsgd.collectives import chunk_bounds, ring_allreduce
from syncsgd.collectives.executor import execute
from syncsgd.comm.threads import run_threads

MAX_RANKS = 16  # a demo: 2(P-1) steps of P lines each
MAX_LENGTH = 64
DIGIT_RANKS = 9  # up to here rank r starts with 10**r, one decimal digit per rank
NO_ALGORITHM_STEPS = ("mpi",)  # the library's own Allreduce: no steps to show
ROOT_WORD = {"broadcast": "from", "reduce": "to"}

ADDED = "\x1b[1;30;43m"  # bold black on yellow: the chunk just reduced
COPIED = "\x1b[1;30;42m"  # bold black on green: a finished chunk just received
DIM = "\x1b[2m"
SENT = "\x1b[4m"  # underlined: the chunk just sent
RESET = "\x1b[0m"


class Snapshot(NamedTuple):
    """One step of one rank: its trace event, its buffer right after, and whom it talked to."""

    event: Any  # a syncsgd.collectives.TraceEvent (the collectives emit the same)
    buffer: np.ndarray
    send_to: int  # -1: sent nothing
    recv_from: int  # -1: received nothing
    added: bool  # the data received was added to the rank's own (else copied in)


class Demo(NamedTuple):
    """A finished demo run: the buffers before, after each step, and at the end."""

    algorithm: str
    ranks: int
    length: int
    start: list[np.ndarray]  # per rank
    steps: list[tuple[str, list[Snapshot]]]  # per round: its title, and each rank's step in it
    final: list[np.ndarray]  # per rank
    expected: np.ndarray  # the NumPy sum of the starting buffers (or what the collective makes)
    note: str = ""  # e.g. which algorithm "auto" chose
    collective: str = "allreduce"  # or one of syncsgd.collectives.COLLECTIVES
    root: int = 0  # of broadcast and reduce
    results: tuple[tuple[int, int], ...] = ()  # per rank, the range that must equal `expected`
    explanation: tuple[str, ...] = ()  # how to read the rounds (else EXPLANATIONS)

    @property
    def correct(self) -> bool:
        """True if every rank ends with exactly the NumPy sum (or its part of the result)."""
        if not self.results:
            return all(np.array_equal(buf, self.expected) for buf in self.final)
        pairs = zip(self.final, self.results, strict=True)
        return all(np.array_equal(buf[a:b], self.expected[a:b]) for buf, (a, b) in pairs)

    @property
    def key(self) -> Any:
        """What `collectives.schedule` takes: the algorithm, or the Collective."""
        if self.collective == "allreduce":
            return self.algorithm
        return collectives.Collective(self.collective, self.algorithm, self.root)

    @property
    def what(self) -> str:
        """'ring allreduce', 'binomial broadcast from rank 2'."""
        rooted = self.collective in ("broadcast", "reduce")
        return f"{self.algorithm} {self.collective}" + (f" {ROOT_WORD[self.collective]} rank "
                                                        f"{self.root}" if rooted else "")


def starting_buffer(rank: int, ranks: int, length: int) -> np.ndarray:
    """Rank `rank`'s buffer: 10**rank everywhere (one decimal digit per rank), 2**rank for P > 9."""
    value = 10**rank if ranks <= DIGIT_RANKS else 1 << rank
    return np.full(length, value, dtype=np.int64)


# viridis from 0.5 to 1 (teal to yellow) in 11 steps: black text on any of them is >= 5.4:1
LIGHT_VIRIDIS = ("#21918c", "#1e9c89", "#22a884", "#2fb47c", "#44bf70", "#5ec962", "#7ad151",
                 "#9bd93c", "#bddf26", "#dfe318", "#fde725")  # fmt: skip


def count_colour(count: int, ranks: int) -> tuple[float, float, float]:
    """The RGB of an element summed over `count` of `ranks` ranks: light for 1, teal for all."""
    if count <= 0:
        return (1.0, 1.0, 1.0)
    at = 0.0 if ranks <= 1 else (count - 1) / (ranks - 1)  # 0: one rank, 1: all
    position = (1 - at) * (len(LIGHT_VIRIDIS) - 1)
    low = min(int(position), len(LIGHT_VIRIDIS) - 2)
    mix = position - low
    rgb = [[int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)] for c in LIGHT_VIRIDIS[low : low + 2]]
    return tuple((1 - mix) * a + mix * b for a, b in zip(*rgb, strict=True))  # type: ignore[return-value]


def hex_colour(rgb: Sequence[float]) -> str:
    """'#rrggbb'."""
    return "#" + "".join(f"{round(255 * c):02x}" for c in rgb)


def ranks_summed(values: np.ndarray, ranks: int) -> np.ndarray:
    """How many ranks each element holds a contribution of: its nonzero digits (base 10 or 2)."""
    base = 10 if ranks <= DIGIT_RANKS else 2
    digits = (np.asarray(values, dtype=np.int64)[:, None] // base ** np.arange(ranks)) % base
    return np.count_nonzero(digits, axis=1)


def resolve_allreduce(algorithm: str) -> Callable[..., Any]:
    """The function `f(buf, comm, *, trace)` that runs `algorithm`."""
    if algorithm == "ring":
        return ring_allreduce
    if algorithm in NO_ALGORITHM_STEPS:
        raise ValueError(f"{algorithm} is the library's own Allreduce: it has no steps to show")
    known = [name for name in collectives.ALGORITHMS if name not in NO_ALGORITHM_STEPS]
    if algorithm not in known:
        raise ValueError(f"unknown algorithm {algorithm!r} (choose from {', '.join(known)})")
    return functools.partial(collectives.allreduce, algorithm=algorithm)


def _rank_run(comm: Any, allreduce: Callable[..., Any], length: int
              ) -> tuple[np.ndarray, list[tuple[Any, np.ndarray]], np.ndarray]:  # fmt: skip
    """One rank: the starting buffer, (event, buffer copy) after every step, and the result."""
    buf = starting_buffer(comm.Get_rank(), comm.Get_size(), length)
    start = buf.copy()
    steps: list[tuple[Any, np.ndarray]] = []

    def trace(event: Any) -> None:
        steps.append((event, buf.copy()))  # runs on this rank's thread, right after the step

    allreduce(buf, comm, trace=trace)
    return start, steps, buf


def run_demo(ranks: int, length: int, algorithm: str = "ring",
             allreduce: Callable[..., Any] | None = None,
             layout: collectives.Hierarchical | None = None) -> Demo:  # fmt: skip
    """Run `algorithm` (or the given `allreduce(buf, comm, *, trace)`) on thread ranks;
    "hierarchical" on the nodes of `layout` (default: one node)."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ring-demo shows 1 to {MAX_RANKS} ranks, got {ranks}")
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"ring-demo shows 0 to {MAX_LENGTH} elements, got {length}")
    note = ""
    if algorithm == "auto" and allreduce is None:
        chosen = collectives.choose_algorithm(length * 8, length, ranks)
        note = f"auto chooses {chosen} for {length * 8} bytes on {_count(ranks, 'rank')}"
        if collectives.auto_choice(length * 8, length, ranks) == "mpi":
            note = (
                f"auto hands {length * 8} bytes to the library's Allreduce (below "
                f"{collectives.AUTO_LIBRARY_BELOW >> 20} MiB); among the hand-written algorithms "
                f"it chooses {chosen} for them on {_count(ranks, 'rank')}, shown here"
            )
        algorithm = chosen
    scheduled: Any = algorithm
    if algorithm == "hierarchical" and allreduce is None:
        scheduled = layout or collectives.Hierarchical((tuple(range(ranks)),))
        allreduce = functools.partial(execute, scheduled)
        nodes, per_node = len(scheduled.nodes), len(scheduled.nodes[0])
        note = (f"{_count(nodes, 'node')} x {_count(per_node, 'rank')}, {scheduled.inter} "
                "between the nodes" + ("; one node: the ring" if nodes == 1 else ""))  # fmt: skip
    function = allreduce if allreduce is not None else resolve_allreduce(algorithm)
    results = run_threads(ranks, _rank_run, function, length)
    start = [result[0] for result in results]
    per_rank = [
        _annotate(scheduled, length, ranks, rank, result[1]) for rank, result in enumerate(results)
    ]
    final = [result[2] for result in results]
    expected = np.stack(start).sum(axis=0, dtype=np.int64)
    try:
        rounds = schedule_rounds([collectives.schedule(scheduled, length, ranks, r)
                                  for r in range(ranks)])  # fmt: skip
    except ValueError:  # an allreduce without a schedule: one group per (phase, step)
        rounds = None
    grouped = _group_steps(per_rank) if rounds is None else _group_rounds(per_rank, rounds)
    return Demo(algorithm, ranks, length, start, grouped, final, expected, note)


def schedule_rounds(schedules: Sequence[Sequence[Any]]) -> list[list[int]]:
    """The round of each rank's every step: sender and receiver of a message meet in one round.

    A rank takes its steps in order, one per round; a step happens in the first round in which
    the partner of its send and of its receive are both at the matching step. The number of
    rounds is the longest chain of messages, which is what the cost model's α term counts.
    """
    partners = _partners(schedules)
    position = [0] * len(schedules)
    rounds: list[list[int]] = [[] for _ in schedules]
    number = 0
    while any(position[r] < len(steps) for r, steps in enumerate(schedules)):
        ready = {r for r, steps in enumerate(schedules) if position[r] < len(steps)}
        changed = True
        while changed:  # the largest set of ranks whose partners all take their step too
            blocked = {r for r in ready for peer, index in partners[r][position[r]]
                       if peer not in ready or position[peer] != index}  # fmt: skip
            ready -= blocked
            changed = bool(blocked)
        if not ready:
            raise RuntimeError("the schedules deadlock: no step can be taken")
        for rank in sorted(ready):
            rounds[rank].append(number)
            position[rank] += 1
        number += 1
    return rounds


def _partners(schedules: Sequence[Sequence[Any]]) -> list[list[list[tuple[int, int]]]]:
    """For each rank's each step: (peer, the peer's step) of its send and of its receive."""
    # The k-th message from a to b is the k-th send to b on a and the k-th receive from a on b.
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, steps in enumerate(schedules):
        for index, step in enumerate(steps):
            if step.send_to >= 0:
                sends.setdefault((rank, step.send_to), []).append(index)
            if step.recv_from >= 0:
                recvs.setdefault((step.recv_from, rank), []).append(index)
    partners: list[list[list[tuple[int, int]]]] = []
    for rank, steps in enumerate(schedules):
        mine: list[list[tuple[int, int]]] = []
        for index, step in enumerate(steps):
            pair = []
            if step.send_to >= 0:
                k = sends[rank, step.send_to].index(index)
                pair.append((step.send_to, recvs[rank, step.send_to][k]))
            if step.recv_from >= 0:
                k = recvs[step.recv_from, rank].index(index)
                pair.append((step.recv_from, sends[step.recv_from, rank][k]))
            mine.append(pair)
        partners.append(mine)
    return partners


def _group_rounds(per_rank: Sequence[list[Snapshot]],
                  rounds: list[list[int]]) -> list[tuple[str, list[Snapshot]]]:  # fmt: skip
    """The snapshots by round, each round titled by the phases its steps belong to."""
    count = max((r[-1] + 1 for r in rounds if r), default=0)
    groups: list[list[Snapshot]] = [[] for _ in range(count)]
    for snapshots, numbers in zip(per_rank, rounds, strict=True):
        for snapshot, number in zip(snapshots, numbers, strict=True):
            groups[number].append(snapshot)
    phases = [list(dict.fromkeys(snapshot.event.phase for snapshot in group)) for group in groups]
    return list(zip(_round_titles(phases), groups, strict=True))


def _round_titles(phases: list[list[str]]) -> list[str]:
    """'reduce-scatter 1 of 2', or 'fold; reduce-scatter 1 of 3' where ranks are at both: each
    phase numbered by the rounds it takes (a tree's level takes two, one per child)."""
    total: dict[str, int] = {}
    for names in phases:
        for name in names:
            total[name] = total.get(name, 0) + 1
    seen: dict[str, int] = {}
    titles = []
    for names in phases:
        parts = []
        for name in names:
            seen[name] = seen.get(name, 0) + 1
            parts.append(name if total[name] == 1 else f"{name} {seen[name]} of {total[name]}")
        titles.append("; ".join(parts))
    return titles


def _annotate(algorithm: Any, length: int, ranks: int, rank: int,
              steps: list[tuple[Any, np.ndarray]]) -> list[Snapshot]:  # fmt: skip
    """Each step with its peers and whether it added: from the algorithm's schedule if known."""
    try:
        schedule = collectives.schedule(algorithm, length, ranks, rank)
    except ValueError:  # an algorithm without a schedule
        schedule = None
    if schedule is not None and len(schedule) == len(steps):
        return [
            Snapshot(event, buf, plan.send_to, plan.recv_from, plan.combine != collectives.COPY)
            for (event, buf), plan in zip(steps, schedule, strict=True)
        ]
    # Without a schedule: the ring's neighbours; a reduce-something phase adds.
    right, left = ((rank + 1) % ranks, (rank - 1) % ranks) if algorithm == "ring" else (-1, -1)
    return [Snapshot(event, buf, right, left, "reduce" in event.phase) for event, buf in steps]


def _group_steps(
    per_rank: Sequence[list[Snapshot]],
) -> list[tuple[str, list[Snapshot]]]:
    """The (phase, step) groups in an order that agrees with every rank's own order of steps."""
    order: list[tuple[str, int]] = []
    for snapshots in per_rank:
        position = 0
        for snapshot in snapshots:
            key = (snapshot.event.phase, snapshot.event.step)
            if key in order:
                position = order.index(key) + 1
            else:
                order.insert(position, key)
                position += 1
    return [
        (f"{key[0]} {key[1] + 1}", [s for snapshots in per_rank for s in snapshots
                                    if (s.event.phase, s.event.step) == key])
        for key in order
    ]  # fmt: skip


def chunk_layout(algorithm: str, length: int, ranks: int) -> list[int] | None:
    """The chunk bounds the algorithm cuts the buffer into, or None if it moves whole buffers."""
    if algorithm == "ring":
        return chunk_bounds(length, ranks)
    if algorithm == "rabenseifner":
        return chunk_bounds(length, 1 << (ranks.bit_length() - 1))
    return None


def demo_chunks(demo: Demo) -> list[int] | None:
    """The chunk (or block) bounds of the buffer `demo` shows, or None for whole buffers."""
    if demo.collective == "alltoall":  # the P blocks sent, then the P received
        return chunk_bounds(demo.length, 2 * demo.ranks)
    if demo.collective != "allreduce":
        return chunk_bounds(demo.length, demo.ranks)
    return chunk_layout(demo.algorithm, demo.length, demo.ranks)


# -- text -----------------------------------------------------------------------------------------

EXPLANATIONS = {
    "ring": (
        "reduce-scatter: P-1 steps, each rank adds the chunk from its left neighbour",
        "allgather: P-1 steps, the finished chunks travel around the ring",
    ),
    "naive": (
        "reduce: rank 0 receives every other rank's buffer in rank order and adds it",
        "broadcast: rank 0 sends the sum to each rank in turn",
    ),
    "recursive-doubling": (
        "exchange k: ranks whose numbers differ in bit k swap whole buffers and both add",
    ),
    "rabenseifner": (
        "reduce-scatter k: partners in bit k swap halves of their window of chunks and add",
        "allgather: the same partners, backwards, swap the finished chunks",
    ),
    "tree": (
        "reduce: each rank adds its children's sums (the children of i are 2i+1 and 2i+2)",
        "and sends the total to its parent; broadcast: the sum goes back down the tree",
    ),
}
PHASE_EXPLANATIONS = {  # (algorithm, phase) or (None, phase): one line for a round of that phase
    ("ring", "reduce-scatter"): "each rank adds the chunk its left neighbour sends to its own copy",
    ("ring", "allgather"): "each rank copies the finished chunk its left neighbour sends",
    ("naive", "reduce"): "rank 0 adds one more rank's whole buffer to its own",
    ("naive", "broadcast"): "rank 0 sends the finished sum to one more rank",
    ("recursive-doubling", "exchange"): "partners whose numbers differ in one bit swap whole "
    "buffers; both add",
    ("rabenseifner", "reduce-scatter"): "partners swap half of their window of chunks; each adds "
    "the half it keeps",
    ("rabenseifner", "allgather"): "partners swap their finished chunks: each holds twice as many",
    ("tree", "reduce"): "a child sends the sum of its subtree to its parent, which adds it",
    ("tree", "broadcast"): "a parent sends the finished sum to its children, one at a time",
    (None, "fold"): "P is not a power of two: an even rank hands its buffer to the odd rank above",
    (None, "unfold"): "the ranks that sat out get the finished sum back",
    (None, "reduce-scatter"): "chunks travel and are added: each rank ends with its part of the "
    "sum",
    (None, "allgather"): "finished chunks travel and are copied",
    (None, "reduce"): "partial sums travel towards the root and are added",
    (None, "broadcast"): "the root's data travels and is copied",
    (None, "alltoall"): "every rank sends one block to the rank s further on and receives one "
    "from the rank s back",
}


def explain_round(demo: Demo, title: str) -> str:
    """One line on what happens in a round titled `title` ('fold; reduce-scatter 1 of 2')."""
    parts = []
    for part in title.split("; "):
        phase = part.split(" ")[0] if part.split(" ")[-1].isdigit() else part
        line = PHASE_EXPLANATIONS.get((demo.algorithm, phase),
                                      PHASE_EXPLANATIONS.get((None, phase)))  # fmt: skip
        if line and line not in parts:
            parts.append(line)
    return "; ".join(parts)


FOLDING = (
    "fold: P is not a power of two, so the first even ranks hand their buffer to the odd rank",
    "above and sit out; unfold: at the end they get the sum back",
)


def format_buffer(values: np.ndarray, width: int, mark: tuple[int, int] | None = None,
                  style: str = "", color: bool = False,
                  sent: tuple[int, int] | None = None) -> str:  # fmt: skip
    """The elements in columns of `width`; the range `mark` in [brackets], or in colour `style`."""
    # In colour the range `sent` is underlined too; in plain text only `mark` is shown.
    start, stop = mark if mark and mark[0] < mark[1] else (-1, -1)
    sent_start, sent_stop = sent if sent else (-1, -1)
    cells = []
    for i, value in enumerate(values.tolist()):
        text = f"{value:>{width}}"
        if color:
            if start <= i < stop:
                text = f"{style}{text}{RESET}"
            elif sent_start <= i < sent_stop:
                text = f"{SENT}{text}{RESET}"
            cells.append(" " + text)
        else:
            cells.append(("[" if i == start else "]" if i == stop else " ") + text)
    if not color:  # the closing bracket after the last element, or a space to keep columns
        cells.append("]" if stop == len(values) and start >= 0 else " ")
    return "".join(cells)


def _count(number: int, noun: str) -> str:
    """'1 rank', '3 ranks'."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def chunk_count(algorithm: str, ranks: int, phase: str, step: int) -> int:
    """How many consecutive chunks one message of this step carries."""
    # Rabenseifner's halving gives away half of a window of p' >> k chunks at step k; its
    # doubling allgather sends 1, 2, 4, ... finished chunks.
    if algorithm == "rabenseifner" and phase == "reduce-scatter":
        return (1 << (ranks.bit_length() - 1)) >> (step + 1)
    if algorithm == "rabenseifner" and phase == "allgather":
        return 1 << step
    return 1


def chunk_name(demo: Demo, event: Any, chunk: int, span: tuple[int, int] | None = None) -> str:
    """'c2', 'c0-1', or 'all' where the whole buffer moves: what a message carries, for a label.

    Another collective's message is named by the blocks its range `span` holds (the sent range
    if None): recursive doubling's and halving's carry 1, 2, 4, ... blocks, their fold or unfold
    one block or the whole buffer."""
    bounds = demo_chunks(demo)
    if demo.collective != "allreduce" and bounds is not None:
        first, count = _blocks(demo, bounds, chunk, tuple(span or event.send_range))
        if count == 0:
            return "all"
        return f"c{first}" if count == 1 else f"c{first}-{first + count - 1}"
    if bounds is None or event.phase in ("fold", "unfold"):
        return "all"
    count = chunk_count(demo.algorithm, demo.ranks, event.phase, event.step)
    return f"c{chunk}" if count == 1 else f"c{chunk}-{chunk + count - 1}"


def _blocks(demo: Demo, bounds: list[int], chunk: int, span: tuple[int, ...]) -> tuple[int, int]:
    """(first block, how many) of the blocks the range `span` holds; (chunk, 0) for the whole
    buffer. An empty range holds block `chunk`."""
    if tuple(span) == (0, demo.length) and demo.length:
        return chunk, 0
    inside = [c for c in range(len(bounds) - 1) if span[0] <= bounds[c] and bounds[c + 1] <= span[1]
              and bounds[c] < bounds[c + 1]]  # fmt: skip
    if not inside or span[1] <= span[0]:
        return chunk, 1
    return inside[0], len(inside)


def what_moves(demo: Demo, event: Any, chunk: int, span: tuple[int, int]) -> str:
    """'chunk 2 [6:8)', 'chunks 0-1 [0:6)', or 'the buffer' where whole buffers move."""
    empty = " (empty)" if span[1] <= span[0] else ""
    bounds = demo_chunks(demo)
    if demo.collective != "allreduce" and bounds is not None:  # blocks: as many as the span holds
        first, count = _blocks(demo, bounds, chunk, span)
        if count == 0:
            return "the buffer" + empty
        name = f"block {first}" if count == 1 else f"blocks {first}-{first + count - 1}"
        return f"{name} [{span[0]}:{span[1]}){empty}"
    if demo.algorithm == "hierarchical":  # chunks of the node's chunk: by their elements
        return f"elements [{span[0]}:{span[1]}){empty}"
    if bounds is None or event.phase in ("fold", "unfold"):
        return "the buffer" + empty
    count = chunk_count(demo.algorithm, demo.ranks, event.phase, event.step)
    name = f"chunk {chunk}" if count == 1 else f"chunks {chunk}-{chunk + count - 1}"
    return f"{name} [{span[0]}:{span[1]}){empty}"


def render_text(demo: Demo, color: bool = False) -> str:
    """Every round of `demo`: each rank's buffer, the range received marked, what moved."""
    everything = [*demo.start, *demo.final] + [s.buffer for _, group in demo.steps for s in group]
    width = max([len(str(int(v))) for buf in everything for v in buf] or [1])
    label = max(len(f"rank {demo.ranks - 1}"), 6)  # the width of the row names
    bounds = demo_chunks(demo)
    lines = _header_lines(demo, bounds, color)
    lines += ["", "start"]
    lines += _buffer_lines(demo.start, width, label, color)
    lines += _step_lines(demo, bounds, width, label, color)
    lines += ["", "result"]
    lines += _buffer_lines(demo.final, width, label, color)
    lines.append(f"  {'NumPy':<{label}}: " + format_buffer(demo.expected, width, color=color))
    verdict = "equal to the NumPy sum on every rank" if demo.correct else "WRONG: not the NumPy sum"
    if demo.collective != "allreduce":
        verdict = "as expected on every rank" if demo.correct else "WRONG: not as expected"
    lines.append(f"{demo.algorithm} {demo.collective} result: {verdict}")
    return "\n".join(line.rstrip() for line in lines)


def _header_lines(demo: Demo, bounds: list[int] | None, color: bool) -> list[str]:
    """What is summed over how many ranks, how to read the buffers, and the chunks."""
    p = demo.ranks
    elements, ranks = _count(demo.length, "int64 element"), _count(p, "thread rank")
    lines = [f"{demo.what} of {elements} over {ranks}"]
    if demo.note:
        lines.append(demo.note)
    if p == 1:
        lines.append("one rank has nobody to talk to: its buffer is already the sum")
        return lines
    if demo.explanation:  # another collective: what it starts from and what it does
        lines += demo.explanation
    elif p <= DIGIT_RANKS:
        lines.append("rank r starts with 10**r in every element: digit r of a sum (from the right)")
        lines.append(f"says whether rank r is in it, and {'1' * p} means all {p} ranks")
    else:
        lines.append("rank r starts with 2**r in every element: binary digit r of a sum says")
        lines.append(f"whether rank r is in it, and {(1 << p) - 1} = 2**{p} - 1 means all ranks")
    if bounds is not None:
        spans = "  ".join(f"{c} = [{bounds[c]}:{bounds[c + 1]})" for c in range(len(bounds) - 1))
        lines.append(f"chunks (as numpy.array_split): {spans}")
    if not demo.explanation:
        if p & (p - 1) and demo.algorithm in ("recursive-doubling", "rabenseifner"):
            lines += FOLDING
        lines += EXPLANATIONS.get(demo.algorithm, ())
    lines.append(rounds_line(demo))
    marked = "in colour" if color else "in [brackets]"
    lines.append(f"what each rank just received is {marked}")
    return lines


def rounds_line(demo: Demo) -> str:
    """How the rounds shown relate to the α term of the cost model."""
    from syncsgd.apps.costmodel import ALGORITHMS, cost

    rounds = len(demo.steps)
    line = f"{_count(rounds, 'round')}, each rank sending and receiving at most one message in each"
    if demo.collective != "allreduce":
        from syncsgd.apps.costmodel_parts import part_cost

        line += f": `syncsgd model`'s {part_cost(demo.collective, demo.algorithm, demo.ranks).a:g}α"
    elif demo.algorithm in ALGORITHMS:
        line += f": `syncsgd model`'s {cost(demo.algorithm, demo.ranks).a:g}α"
    return line


def _buffer_lines(buffers: Sequence[Any], width: int, label: int, color: bool) -> list[str]:
    """One line per rank: its name and its buffer."""
    return [
        f"  {f'rank {rank}':<{label}}: " + format_buffer(buf, width, color=color)
        for rank, buf in enumerate(buffers)
    ]


def _step_lines(
    demo: Demo, bounds: list[int] | None, width: int, label: int, color: bool
) -> list[str]:
    """Every round: a title, then each rank's buffer and what it sent and received, or idle."""
    current = list(demo.start)
    lines: list[str] = []
    for number, (title, group) in enumerate(demo.steps, start=1):
        lines += ["", f"round {number} of {len(demo.steps)}: {title}"]
        by_rank = {snapshot.event.rank: snapshot for snapshot in group}
        for rank in range(demo.ranks):
            name = f"  {f'rank {rank}':<{label}}: "
            if rank not in by_rank:
                idle = format_buffer(current[rank], width)
                lines.append(
                    name + (f"{DIM}{idle}   (idle){RESET}" if color else idle + "   (idle)")
                )
                continue
            lines.append(name + _step_text(demo, by_rank[rank], width, color))
            current[rank] = by_rank[rank].buffer
    return lines


def _step_text(demo: Demo, snapshot: Snapshot, width: int, color: bool) -> str:
    """One rank's line in one round: its buffer, then what it sent and received."""
    event = snapshot.event
    received, sent = tuple(event.recv_range), tuple(event.send_range)
    style = ADDED if snapshot.added else COPIED
    buffer = format_buffer(snapshot.buffer, width, received, style, color, sent)
    return buffer + "   " + exchange_text(demo, snapshot)


def exchange_text(demo: Demo, snapshot: Snapshot) -> str:
    """'-> rank 1: chunk 0 [0:3); <- rank 2: chunk 2 [6:8) (added)'."""
    event = snapshot.event
    received, sent = tuple(event.recv_range), tuple(event.send_range)
    parts = []
    if snapshot.send_to >= 0:
        parts.append(f"-> rank {snapshot.send_to}: " + what_moves(demo, event, event.send_chunk,
                                                                  sent))  # fmt: skip
    if snapshot.recv_from >= 0:
        how = "" if received[1] <= received[0] else " (added)" if snapshot.added else " (copied)"
        what = what_moves(demo, event, event.recv_chunk, received)
        parts.append(f"<- rank {snapshot.recv_from}: {what}{how}")
    return "; ".join(parts)
