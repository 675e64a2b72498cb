"""`syncsgd ring-demo`: every step of an allreduce on small integers, printed or drawn.

    syncsgd ring-demo --ranks 3 --length 7
    syncsgd ring-demo --ranks 4 --length 10 --png ring.png

P thread ranks run the allreduce on int64 buffers. Rank r starts with 10**r in every element
(for P <= 9), so each decimal digit of a partial sum says which ranks it already contains: 101 is
ranks 0 and 2, and the final 111 is everyone; a 2 would be a rank counted twice. (For P > 9 rank
r starts with r + 1.) The trace callback runs on each rank's thread right after each step, and
copies the rank's buffer there; the steps are then printed in order, each rank's buffer with the
chunk it just received in [brackets] (in colour on a terminal), with the chunk sent and to whom.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from syncsgd import collectives
from syncsgd.collectives import chunk_bounds, ring_allreduce
from syncsgd.comm.threads import run_threads
from syncsgd.util.argtypes import nonnegative_int
from syncsgd.util.options import RANKS

MAX_RANKS = 16  # a demo: 2(P-1) steps of P lines each
MAX_LENGTH = 64
DIGIT_RANKS = 9  # up to here rank r starts with 10**r, one decimal digit per rank
NO_ALGORITHM_STEPS = ("mpi",)  # the library's own Allreduce: no steps to show

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
    steps: list[tuple[tuple[str, int], list[Snapshot]]]  # ((phase, step), events) in order
    final: list[np.ndarray]  # per rank
    expected: np.ndarray  # the NumPy sum of the starting buffers
    note: str = ""  # e.g. which algorithm "auto" chose

    @property
    def correct(self) -> bool:
        """True if every rank ends with exactly the NumPy sum."""
        return all(np.array_equal(buf, self.expected) for buf in self.final)


def starting_buffer(rank: int, ranks: int, length: int) -> np.ndarray:
    """Rank `rank`'s buffer: 10**rank everywhere (one digit per rank), or rank + 1 for P > 9."""
    value = 10**rank if ranks <= DIGIT_RANKS else rank + 1
    return np.full(length, value, dtype=np.int64)


def contributors(values: np.ndarray, ranks: int) -> np.ndarray:
    """The share of the final sum in each element: ranks counted / P (P <= 9), else value / sum."""
    if ranks > DIGIT_RANKS:
        return values / (ranks * (ranks + 1) // 2)
    digits = (values[:, None] // 10 ** np.arange(ranks)) % 10
    return np.count_nonzero(digits, axis=1) / ranks


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
             allreduce: Callable[..., Any] | None = None) -> Demo:  # fmt: skip
    """Run `algorithm` (or the given `allreduce(buf, comm, *, trace)`) on thread ranks."""
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
    function = allreduce if allreduce is not None else resolve_allreduce(algorithm)
    results = run_threads(ranks, _rank_run, function, length)
    start = [result[0] for result in results]
    per_rank = [
        _annotate(algorithm, length, ranks, rank, result[1]) for rank, result in enumerate(results)
    ]
    final = [result[2] for result in results]
    expected = np.stack(start).sum(axis=0, dtype=np.int64)
    return Demo(algorithm, ranks, length, start, _group_steps(per_rank), final, expected, note)


def _annotate(algorithm: str, length: int, ranks: int, rank: int,
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
) -> list[tuple[tuple[str, int], list[Snapshot]]]:
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
        (key, [s for snapshots in per_rank for s in snapshots
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


def _what(chunk: int, span: tuple[int, int], chunked: bool) -> str:
    """'chunk 2', 'the buffer' where whole buffers move, with '(empty)' for an empty range."""
    name = f"chunk {chunk}" if chunked else "the buffer"
    return name + (" (empty)" if span[1] <= span[0] else "")


def render_text(demo: Demo, color: bool = False) -> str:
    """Every step of `demo`: each rank's buffer, the chunk received marked, the chunk sent."""
    everything = [*demo.start, *demo.final] + [s.buffer for _, group in demo.steps for s in group]
    width = max([len(str(int(v))) for buf in everything for v in buf] or [1])
    label = max(len(f"rank {demo.ranks - 1}"), 6)  # the width of the row names
    bounds = chunk_layout(demo.algorithm, demo.length, demo.ranks)
    lines = _header_lines(demo, bounds, color)
    lines += ["", "start"]
    lines += _buffer_lines(demo.start, width, label, color)
    lines += _step_lines(demo, bounds, width, label, color)
    lines += ["", "result"]
    lines += _buffer_lines(demo.final, width, label, color)
    lines.append(f"  {'NumPy':<{label}}: " + format_buffer(demo.expected, width, color=color))
    verdict = "equal to the NumPy sum on every rank" if demo.correct else "WRONG: not the NumPy sum"
    lines.append(f"{demo.algorithm} allreduce result: {verdict}")
    return "\n".join(line.rstrip() for line in lines)


def _header_lines(demo: Demo, bounds: list[int] | None, color: bool) -> list[str]:
    """What is summed over how many ranks, how to read the buffers, and the chunks."""
    p = demo.ranks
    elements, ranks = _count(demo.length, "int64 element"), _count(p, "thread rank")
    lines = [f"{demo.algorithm} allreduce of {elements} over {ranks}"]
    if demo.note:
        lines.append(demo.note)
    if p == 1:
        lines.append("one rank has nobody to talk to: its buffer is already the sum")
        return lines
    if p <= DIGIT_RANKS:
        lines.append("rank r starts with 10**r in every element: digit r of a sum (from the right)")
        lines.append(f"says whether rank r is in it, and {'1' * p} means all {p} ranks")
    else:
        lines.append(f"rank r starts with r + 1 in every element; the sum is {p * (p + 1) // 2}")
    if bounds is not None:
        spans = "  ".join(f"{c} = [{bounds[c]}:{bounds[c + 1]})" for c in range(len(bounds) - 1))
        lines.append(f"chunks (as numpy.array_split): {spans}")
    if p & (p - 1) and demo.algorithm in ("recursive-doubling", "rabenseifner"):
        lines += FOLDING
    lines += EXPLANATIONS.get(demo.algorithm, ())
    marked = "in colour" if color else "in [brackets]"
    lines.append(f"what each rank just received is {marked}")
    return lines


def _buffer_lines(buffers: Sequence[Any], width: int, label: int, color: bool) -> list[str]:
    """One line per rank: its name and its buffer."""
    return [
        f"  {f'rank {rank}':<{label}}: " + format_buffer(buf, width, color=color)
        for rank, buf in enumerate(buffers)
    ]


def _step_lines(
    demo: Demo, bounds: list[int] | None, width: int, label: int, color: bool
) -> list[str]:
    """Every step: a title, then each rank's buffer and what it sent and received, or idle."""
    current = list(demo.start)
    phase_steps: dict[str, int] = {}
    for (phase, _), _group in demo.steps:
        phase_steps[phase] = phase_steps.get(phase, 0) + 1
    lines: list[str] = []
    for (phase, step), group in demo.steps:
        lines += ["", f"{phase} step {step + 1} of {phase_steps[phase]}"]
        by_rank: dict[int, list[Snapshot]] = {}
        for snapshot in group:
            by_rank.setdefault(snapshot.event.rank, []).append(snapshot)
        chunked = bounds is not None and phase not in ("fold", "unfold")
        for rank in range(demo.ranks):
            name = f"  {f'rank {rank}':<{label}}: "
            if rank not in by_rank:
                idle = format_buffer(current[rank], width)
                lines.append(
                    name + (f"{DIM}{idle}   (idle){RESET}" if color else idle + "   (idle)")
                )
            for snapshot in by_rank.get(rank, ()):
                lines.append(name + _step_text(snapshot, width, color, chunked))
                current[rank] = snapshot.buffer
    return lines


def _step_text(snapshot: Snapshot, width: int, color: bool, chunked: bool) -> str:
    """One rank's line in one step: its buffer, then what it sent and received."""
    event = snapshot.event
    received, sent = tuple(event.recv_range), tuple(event.send_range)
    style = ADDED if snapshot.added else COPIED
    buffer = format_buffer(snapshot.buffer, width, received, style, color, sent)
    parts = []
    if snapshot.send_to >= 0:
        parts.append(f"-> rank {snapshot.send_to}: " + _what(event.send_chunk, sent, chunked))
    if snapshot.recv_from >= 0:
        how = "" if received[1] <= received[0] else " (added)" if snapshot.added else " (copied)"
        what = _what(event.recv_chunk, received, chunked)
        parts.append(f"<- rank {snapshot.recv_from}: {what}{how}")
    return buffer + "   " + "; ".join(parts)


# -- figure ---------------------------------------------------------------------------------------


def draw_png(demo: Demo, path: str) -> None:
    """Draw the steps of `demo` as a grid of steps x ranks and write it to `path` as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install 'syncsgd[plot]'") from None
    from syncsgd.util.files import atomic_path

    p, n = demo.ranks, demo.length
    rows = _figure_rows(demo)
    pitch = max(n, 6) + 1.5  # x distance of two ranks' buffers: room for the labels
    width, height = p * pitch + 12, len(rows) * ROW_HEIGHT + 3  # in element boxes
    inches = min(0.3, 40 / width)  # per element box; at most 40 inches wide
    figure = Figure(figsize=(width * inches, height * inches + 0.8))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for row, (name, buffers, events) in enumerate(rows):
        y = -row * ROW_HEIGHT
        axes.text(-0.6, y + 0.5, name, ha="right", va="center", fontsize=8)
        for rank in range(p):
            _draw_cell(axes, demo, rank * pitch, y, buffers[rank], events[rank])
    for rank in range(p):
        axes.text(rank * pitch + n / 2, 1.4, f"rank {rank}", ha="center", fontsize=9)
    axes.set_xlim(-12, p * pitch)
    axes.set_ylim(-(len(rows) - 1) * ROW_HEIGHT - 1.2, 2.2)
    axes.set_aspect("equal")
    axes.axis("off")
    axes.set_title(
        f"{demo.algorithm} allreduce, {_count(p, 'rank')}, {_count(n, 'element')}\n"
        "darker = more ranks summed in; framed = just received (red: added, green: copied)",
        fontsize=9,
    )
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120, bbox_inches="tight")


ROW_HEIGHT = 2.2  # in element boxes: one row of boxes, a line of labels, a gap


def _figure_rows(demo: Demo) -> list[tuple[str, list[np.ndarray], list[list[Snapshot]]]]:
    """(name, every rank's buffer, every rank's steps) for the start and each step."""
    rows: list[tuple[str, list[np.ndarray], list[list[Snapshot]]]] = [
        ("start", list(demo.start), [[] for _ in range(demo.ranks)])
    ]
    current = list(demo.start)
    for (phase, step), group in demo.steps:
        events: list[list[Snapshot]] = [[] for _ in range(demo.ranks)]
        for snapshot in group:
            events[snapshot.event.rank].append(snapshot)
            current[snapshot.event.rank] = snapshot.buffer
        rows.append((f"{phase} {step + 1}", list(current), events))
    return rows


def _draw_cell(axes: Any, demo: Demo, x0: float, y: float, values: np.ndarray,
               snapshots: list[Snapshot]) -> None:  # fmt: skip
    """One rank's buffer at (x0, y): boxes shaded by share of the sum, the received range framed."""
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    palette = colormaps["tab10"]
    bounds = chunk_layout(demo.algorithm, demo.length, demo.ranks)
    share = contributors(values, demo.ranks)
    for i, value in enumerate(values.tolist()):
        chunk = 0 if bounds is None else int(np.searchsorted(bounds, i, side="right")) - 1
        hue = np.array(palette(chunk % 10)[:3])
        strength = 0.12 + 0.88 * min(float(share[i]), 1.0)
        face = (1 - strength) * np.ones(3) + strength * hue
        axes.add_patch(Rectangle((x0 + i, y), 1, 1, facecolor=face, edgecolor="white"))
        if demo.ranks * demo.length <= 160:
            axes.text(x0 + i + 0.5, y + 0.5, str(value), ha="center", va="center", fontsize=5)
    labels = []
    for snapshot in snapshots:
        event = snapshot.event
        lo, hi = event.recv_range
        if hi > lo:
            edge = "crimson" if snapshot.added else "darkgreen"
            frame = Rectangle((x0 + lo, y), hi - lo, 1, fill=False, linewidth=2, edgecolor=edge)
            axes.add_patch(frame)
        chunked = bounds is not None and event.phase not in ("fold", "unfold")
        what = "c{}" if chunked else "all"
        if snapshot.send_to >= 0 and event.send_range[1] > event.send_range[0]:
            labels.append(f"sent {what.format(event.send_chunk)} to {snapshot.send_to}")
        if snapshot.recv_from >= 0 and hi > lo:
            verb = "added" if snapshot.added else "got"
            labels.append(f"{verb} {what.format(event.recv_chunk)} from {snapshot.recv_from}")
    if labels:
        text = ", ".join(labels)
        axes.text(x0 + demo.length / 2, y - 0.15, text, ha="center", va="top", fontsize=6)


# -- the command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd ring-demo`."""
    RANKS.add(parser, default=4, help=f"thread ranks, 1..{MAX_RANKS} (default 4)")
    parser.add_argument(
        "--length",
        type=nonnegative_int,
        default=10,
        help=f"elements per buffer, 0..{MAX_LENGTH} (default 10)",
    )
    parser.add_argument(
        "--algorithm",
        default="ring",
        help="the allreduce to show (default ring; others from syncsgd.collectives)",
    )
    parser.add_argument("--png", metavar="PATH", help="also draw the steps into this PNG file")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="highlight in colour: auto = on a terminal unless NO_COLOR is set (default auto)",
    )


def use_color(choice: str, stream: Any = None) -> bool:
    """Whether to print ANSI colours for --color `choice` on `stream` (default stdout)."""
    if choice in ("always", "never"):
        return choice == "always"
    stream = sys.stdout if stream is None else stream
    terminal = hasattr(stream, "isatty") and stream.isatty()
    return terminal and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def main(options: argparse.Namespace) -> int:
    """`syncsgd ring-demo`: print every step; 1 if the result is not the NumPy sum."""
    if options.png:
        from syncsgd.util.files import check_writable

        check_writable(options.png)
    demo = run_demo(options.ranks, options.length, options.algorithm)
    print(render_text(demo, use_color(options.color)))
    if options.png:
        draw_png(demo, options.png)
        print(f"wrote {options.png}")
    if not demo.correct:
        print(f"syncsgd: ring-demo: the {demo.algorithm} result is not the sum", file=sys.stderr)
        return 1
    return 0
