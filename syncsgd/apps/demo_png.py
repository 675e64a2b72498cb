"""`ring-demo --png` and `--frames`: the rounds of an allreduce as slides.

Each figure is one 16:9 slide (`syncsgd.util.figures`), laid out in points, with every text at
14 points or more. A cell's colour says how many ranks an element holds a contribution of: a hue
from blue (all) to yellow (one), dark and light in turn so that neighbouring counts stay 3:1 apart
at P = 16, and black text above 4.5:1 on each. A figure writes one kind of number in
its cells, named in its legend: the value itself (rank r starts with 10**r, so digit r says
whether rank r is in it) where every value fits at 14 points, else the count of ranks summed in
where that fits, else none - the colour alone says it. `--png` draws every round of every rank
where that fits on the slide, else the compact grid of ranks x rounds.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from syncsgd.apps.demo_core import (
    Demo,
    Snapshot,
    chunk_name,
    demo_chunks,
    explain_round,
    ranks_summed,
)
from syncsgd.util import figures
from syncsgd.util.figures import require_matplotlib

WIDTH, HEIGHT = 72 * figures.SLIDE[0], 72 * figures.SLIDE[1]  # the slide in points: 960 x 540
TEXT, TITLE = 14.0, 18.0  # points
LINE = 1.3 * TEXT  # the height of a line of text
MONO = "DejaVu Sans Mono"  # matplotlib's own: every character the same width
MONO_EM = 0.6021  # a DejaVu Sans Mono character's advance, in ems
LEGEND = 2 * LINE + 14  # the legend's two lines at the bottom
FRAME = "black"  # the range just received; never a cell colour
MAX_PEER_LINES = 4  # who sends to whom, under the compact grid: at most this many lines


def count_colour(count: int, ranks: int) -> tuple[float, float, float]:
    """The RGB of an element summed over `count` of `ranks` ranks (white for none)."""
    return figures.stepped_colour(count, ranks)


def text_width(text: str, size: float, mono: bool = False) -> float:
    """How wide `text` is in points at `size` points (the glyphs' advances, 2% to spare)."""
    return 1.02 * size * sum(_advance(char, mono) for char in text)


@functools.lru_cache(maxsize=1024)
def _advance(char: str, mono: bool) -> float:
    """A character's advance in ems, in DejaVu Sans (Mono)."""
    from matplotlib.font_manager import FontProperties, findfont, get_font

    font = get_font(findfont(FontProperties(family=MONO if mono else "DejaVu Sans")))
    font.set_size(100, 72)
    return float(font.load_char(ord(char)).linearHoriAdvance) / 65536 / 100


def _rows(demo: Demo) -> list[tuple[str, list[np.ndarray], list[Snapshot | None]]]:
    """(title, every rank's buffer, every rank's step or None) for the start and each round."""
    rows: list[tuple[str, list[np.ndarray], list[Snapshot | None]]] = [
        ("start", list(demo.start), [None] * demo.ranks)
    ]
    current = list(demo.start)
    for title, group in demo.steps:
        taken: list[Snapshot | None] = [None] * demo.ranks
        for snapshot in group:
            taken[snapshot.event.rank] = snapshot
            current[snapshot.event.rank] = snapshot.buffer
        rows.append((title, list(current), taken))
    return rows


class Canvas:
    """A slide whose unit is the point, y growing downwards; cells go into one collection."""

    def __init__(self, title: str) -> None:
        self.figure = figures.new_figure()
        self.axes = self.figure.add_axes((0, 0, 1, 1))
        self.axes.set_xlim(0, WIDTH)
        self.axes.set_ylim(HEIGHT, 0)
        self.axes.axis("off")
        self.boxes: list[tuple[Any, tuple[float, float, float, float]]] = []  # text, its room
        self.cells: list[list[tuple[float, float]]] = []
        self.colours: list[tuple[float, float, float]] = []
        self.frames: dict[bool, list[list[tuple[float, float]]]] = {False: [], True: []}
        self.frame_width = 2.5  # points; thinner where the cells are narrow
        self.text(WIDTH / 2, 6, title, TITLE, (0, 0, WIDTH, 6 + 1.3 * TITLE), ha="center",
                  va="top", weight="bold")  # fmt: skip

    def text(self, x: float, y: float, text: str, size: float,
             room: tuple[float, float, float, float], **style: Any) -> Any:  # fmt: skip
        """Write `text` at (x, y), `size` points, and remember the room it must stay within."""
        artist = self.axes.text(x, y, text, fontsize=size, color="black", **style)
        self.boxes.append((artist, room))
        return artist

    def cell(self, x: float, y: float, width: float, height: float,
             colour: tuple[float, float, float]) -> None:  # fmt: skip
        """A filled box with its top left at (x, y)."""
        self.cells.append([(x, y), (x + width, y), (x + width, y + height), (x, y + height)])
        self.colours.append(colour)

    def outline(self, x: float, y: float, width: float, height: float, dashed: bool) -> None:
        """The frame around a range just received: solid if added, dashed if copied."""
        self.frames[dashed].append([(x, y), (x + width, y), (x + width, y + height),
                                    (x, y + height)])  # fmt: skip

    def finish(self) -> Any:
        """Put the cells on the figure (once) and return it."""
        from matplotlib.collections import PolyCollection

        if self.cells:
            self.axes.add_collection(PolyCollection(self.cells, facecolors=self.colours,
                                                    edgecolors="none", zorder=1))  # fmt: skip
            self.cells, self.colours = [], []
        for dashed, boxes in self.frames.items():
            if boxes:
                self.axes.add_collection(PolyCollection(
                    boxes, facecolors="none", edgecolors=FRAME, linewidths=self.frame_width,
                    zorder=3, linestyles=(0, (3, 2)) if dashed else "solid"))  # fmt: skip
        self.frames = {False: [], True: []}
        return self.figure

    def save(self, path: str) -> None:
        """Write the slide to `path` in the format its extension names, atomically."""
        figures.save(self.finish(), path)


def overflows(canvas: Canvas) -> list[str]:
    """The texts that reach outside the room they were given (empty: every label fits)."""
    canvas.finish()
    renderer = canvas.figure.canvas.get_renderer()
    to_data = canvas.axes.transData.inverted()
    found = []
    for artist, (x0, y0, x1, y1) in canvas.boxes:
        extent = artist.get_window_extent(renderer)
        corners = to_data.transform([[extent.x0, extent.y0], [extent.x1, extent.y1]])
        left, right = sorted(corners[:, 0])
        top, bottom = sorted(corners[:, 1])
        slack = 0.5
        if left < x0 - slack or right > x1 + slack or top < y0 - slack or bottom > y1 + slack:
            found.append(artist.get_text())
    return found


# -- what the cells say ---------------------------------------------------------------------------


def numbers_for(demo: Demo, cell_width: float, cell_height: float) -> str | None:
    """'value', 'count' or None: the one kind of number every cell of a figure can show."""
    if cell_height < LINE:
        return None
    everything = [*demo.start] + [s.buffer for _, group in demo.steps for s in group]
    widest = max((len(str(int(v))) for buf in everything for v in buf), default=1)
    for kind, chars in (("value", widest), ("count", len(str(demo.ranks)))):
        if kind == "value" and demo.ranks > 9:
            continue  # the values are binary codes there: their decimal digits say nothing
        if cell_width >= (chars + 1) * MONO_EM * TEXT:
            return kind
    return None


def draw_buffer(canvas: Canvas, demo: Demo, x: float, y: float, cell: tuple[float, float],
                values: np.ndarray, numbers: str | None,
                snapshot: Snapshot | None) -> None:  # fmt: skip
    """One rank's buffer, top left at (x, y), cells of `cell` points, the range received framed."""
    width, height = cell
    counts = ranks_summed(values, demo.ranks)
    gap = 1.0 if width >= 6 else 0.0
    for i, count in enumerate(counts.tolist()):
        canvas.cell(x + i * width, y, width - gap, height, count_colour(count, demo.ranks))
    if numbers is not None and len(values):
        shown = values.tolist() if numbers == "value" else counts.tolist()
        number_row(canvas, x, y, cell, shown)
    if snapshot is not None:
        lo, hi = snapshot.event.recv_range
        if hi > lo and snapshot.recv_from >= 0:
            canvas.outline(x + lo * width, y, (hi - lo) * width - gap, height, not snapshot.added)


def number_row(canvas: Canvas, x: float, y: float, cell: tuple[float, float],
               shown: Sequence[int]) -> None:  # fmt: skip
    """Numbers centred in a row of cells, as one text in a font whose every character is as wide."""
    # One text, not one per cell: a slide with hundreds of texts takes seconds to draw.
    width, height = cell
    chars = max(len(str(v)) for v in shown) + 1
    largest = max(TEXT, min(TEXT + 4, 0.75 * height))
    per_cell = max(chars, min(math.ceil(width / (MONO_EM * largest)),
                              math.floor(width / (MONO_EM * TEXT))))  # fmt: skip
    size = width / (per_cell * MONO_EM)  # >= 14 points where the caller checked the room
    line = "".join(f"{v:^{per_cell}}" for v in shown)
    room = (x, y, x + width * len(shown) + size, y + height)  # + a trailing space's bearing
    canvas.text(x, y + height / 2, line, size, room, ha="left", va="center", family=MONO)


def draw_legend(canvas: Canvas, demo: Demo, numbers: str | None) -> None:
    """Two lines at the bottom: the colour of each count, and what numbers and frames mean."""
    y = HEIGHT - LEGEND + 4
    label = "colour: how many ranks an element holds the sum of"
    canvas.text(8, y + LINE / 2, label, TEXT, (0, y, WIDTH, y + LINE), va="center")
    x = 16 + text_width(label, TEXT)
    swatch = min(30.0, (WIDTH - x - 8) / max(demo.ranks, 1))
    for count in range(1, demo.ranks + 1):
        canvas.cell(x + (count - 1) * swatch, y, swatch - 1, LINE, count_colour(count, demo.ranks))
    if swatch >= (len(str(demo.ranks)) + 1) * MONO_EM * TEXT:
        number_row(canvas, x, y, (swatch, LINE), list(range(1, demo.ranks + 1)))
    meaning = {
        "value": "number: the sum (rank r starts with 10**r: digit r is 1 if rank r is in it)",
        "count": "number: how many ranks the element holds the sum of",
        None: "no numbers: the colour alone",
    }[numbers]
    y += LINE + 4
    text = f"{meaning};  frame: just received (solid: added, dashed: copied)"
    canvas.text(8, y + LINE / 2, text, TEXT, (0, y, WIDTH, y + LINE), va="center")


def peers_text(snapshot: Snapshot | None) -> str:
    """'→1 ←3': whom a rank sent to and received from in a round ('' if idle)."""
    if snapshot is None:
        return ""
    parts = []
    if snapshot.send_to >= 0:
        parts.append(f"→{snapshot.send_to}")
    if snapshot.recv_from >= 0:
        parts.append(f"←{snapshot.recv_from}")
    return " ".join(parts)


def _title(demo: Demo) -> str:
    """'ring allreduce: 4 ranks, 10 elements'."""
    return f"{demo.what}: {demo.ranks} ranks, {demo.length} elements"


# -- --png: every round of every rank, or the compact grid ----------------------------------------


def grid_canvas(demo: Demo) -> Canvas:
    """The whole allreduce on one slide: rounds x ranks with numbers if they fit, else compact."""
    detailed = _detailed_layout(demo)
    return _detailed(demo, *detailed) if detailed is not None else compact_canvas(demo)


def _detailed_layout(demo: Demo) -> tuple[float, float, float, str] | None:
    """(names' width, row pitch, cell width, numbers) if every round fits with numbers."""
    rows = _rows(demo)
    names = max(text_width(_row_name(k, title), TEXT) for k, (title, _, _) in enumerate(rows))
    names += 12
    pitch = (HEIGHT - 40 - LINE - LEGEND) / len(rows)
    cell_height = pitch - LINE - 8
    buffer_width = (WIDTH - names - 8) / demo.ranks - 12
    if cell_height < LINE or demo.length == 0:
        return None
    peers = max(text_width(peers_text(s), TEXT) for _, _, taken in rows for s in taken)
    if peers > buffer_width:
        return None
    cell_width = buffer_width / demo.length
    numbers = numbers_for(demo, cell_width, min(cell_height, 2 * LINE))
    if numbers is None:
        return None
    return names, pitch, cell_width, numbers


def _row_name(number: int, title: str) -> str:
    """'start' or 'round 3: reduce-scatter 3 of 3'."""
    return "start" if number == 0 else f"round {number}: {title}"


def _detailed(demo: Demo, names: float, pitch: float, cell_width: float,
              numbers: str) -> Canvas:  # fmt: skip
    """Every round as a row of every rank's buffer, whom it sent to and received from below."""
    canvas = Canvas(_title(demo))
    rows = _rows(demo)
    cell_height = min(pitch - LINE - 8, 2 * LINE)
    span = cell_width * demo.length
    across = (WIDTH - names - 8) / demo.ranks
    top = 40 + LINE
    for rank in range(demo.ranks):
        x = names + rank * across
        canvas.text(x + span / 2, top - LINE / 2, f"rank {rank}", TEXT,
                    (x - 6, top - LINE, x + across - 6, top), ha="center", va="center")  # fmt: skip
    for number, (title, buffers, taken) in enumerate(rows):
        y = top + number * pitch
        canvas.text(names - 8, y + cell_height / 2, _row_name(number, title), TEXT,
                    (0, y, names, y + cell_height), ha="right", va="center")  # fmt: skip
        for rank in range(demo.ranks):
            x = names + rank * across
            draw_buffer(canvas, demo, x, y, (cell_width, cell_height), buffers[rank], numbers,
                        taken[rank])  # fmt: skip
            text = peers_text(taken[rank])
            if text:
                canvas.text(x, y + cell_height + 2, text, TEXT,
                            (x, y + cell_height, x + across - 8, y + cell_height + LINE + 4),
                            ha="left", va="top")  # fmt: skip
    draw_legend(canvas, demo, numbers)
    return canvas


def compact_canvas(demo: Demo) -> Canvas:
    """Ranks x rounds: each rank's buffer after each round as a strip of colours, no numbers."""
    canvas = Canvas(_title(demo) + ": each rank's buffer after each round")
    rows = _rows(demo)
    names = text_width(f"rank {demo.ranks - 1}", TEXT) + 16
    phases = _phase_lines(rows, WIDTH - 16)
    peers = _peer_lines(rows, demo.ranks, WIDTH - 16)
    phases += peers if len(peers) <= MAX_PEER_LINES else [
        "sends: too many pairs for this slide; --frames shows each round's"]
    top = 40 + LINE
    bottom = HEIGHT - LEGEND - len(phases) * LINE - 6
    pitch = (bottom - top) / max(demo.ranks, 1)
    column = (WIDTH - names - 8) / len(rows)
    canvas.text(names - 8, top - LINE / 2, "round", TEXT, (0, top - LINE, names, top),
                ha="right", va="center")  # fmt: skip
    for number in range(len(rows)):
        x = names + number * column
        canvas.text(x + (column - 3) / 2, top - LINE / 2, str(number), TEXT,
                    (x - 2, top - LINE, x + column + 2, top), ha="center", va="center")  # fmt: skip
    cell = ((column - 4) / max(demo.length, 1), pitch - 4)
    canvas.frame_width = min(2.5, max(1.0, cell[0] / 2))
    for rank in range(demo.ranks):
        y = top + rank * pitch
        canvas.text(names - 8, y + cell[1] / 2, f"rank {rank}", TEXT, (0, y, names, y + pitch),
                    ha="right", va="center")  # fmt: skip
        for number, (_, buffers, taken) in enumerate(rows):
            draw_buffer(canvas, demo, names + number * column, y, cell, buffers[rank], None,
                        taken[rank])  # fmt: skip
    for line, text in enumerate(phases):
        y = bottom + line * LINE
        canvas.text(8, y + LINE / 2, text, TEXT, (0, y, WIDTH, y + LINE), va="center")
    draw_legend(canvas, demo, None)
    return canvas


def _phase_lines(rows: Sequence[tuple[str, Any, Any]], width: float) -> list[str]:
    """'round 0: start; 1-3: reduce-scatter; 4-6: allgather', wrapped to `width` points."""
    spans: list[list[Any]] = []  # [first, last, what]
    for number, (title, _, _) in enumerate(rows):
        what = " + ".join(dict.fromkeys(part.split(" ")[0] if part[-1:].isdigit() else part
                                        for part in title.split("; ")))  # fmt: skip
        if spans and spans[-1][2] == what:
            spans[-1][1] = number
        else:
            spans.append([number, number, what])
    parts = [f"{first}: {what}" if first == last else f"{first}-{last}: {what}"
             for first, last, what in spans]  # fmt: skip
    parts[0] = "round " + parts[0]
    return _fill(parts, "; ", width)


def peer_rule(taken: Sequence[Snapshot | None], ranks: int) -> str:
    """Who sends to whom in one round: 'r → r+1 mod P', 'r ↔ r xor 2', else the pairs '1→0, 3→2'."""
    pairs = [(s.event.rank, s.send_to) for s in taken if s is not None and s.send_to >= 0]
    if not pairs:
        return "no messages"
    senders = {sender for sender, _ in pairs}
    if len(senders) == ranks:
        masks = {sender ^ to for sender, to in pairs}
        if len(masks) == 1:
            return f"r ↔ r xor {masks.pop()}"
        shifts = {(to - sender) % ranks for sender, to in pairs}
        if len(shifts) == 1:
            shift = shifts.pop()
            step = f"+{shift}" if shift <= ranks // 2 else f"-{ranks - shift}"
            return f"r → r{step} mod {ranks}"
    return ", ".join(f"{sender}→{to}" for sender, to in sorted(pairs))


def _peer_lines(rows: Sequence[tuple[str, Any, Any]], ranks: int, width: float) -> list[str]:
    """'sends, round 1-14: r → r+1 mod P', consecutive rounds of one rule together, wrapped."""
    spans: list[list[Any]] = []  # [first, last, rule]
    for number, (_, _, taken) in enumerate(rows[1:], start=1):
        rule = peer_rule(taken, ranks)
        if spans and spans[-1][2] == rule:
            spans[-1][1] = number
        else:
            spans.append([number, number, rule])
    parts = [f"{first}: {rule}" if first == last else f"{first}-{last}: {rule}"
             for first, last, rule in spans]  # fmt: skip
    if not parts:
        return []
    parts[0] = "sends, round " + parts[0]
    return _fill(parts, "; ", width)


# -- --frames: one slide per round ----------------------------------------------------------------


def exchange_labels(demo: Demo, snapshot: Snapshot) -> list[str]:
    """'to 3: c0-1 [0:6)' and 'from 3: c2-3 [6:10) added', short enough for a slide."""
    event, labels = snapshot.event, []
    for peer, chunk, span, verb in (
        (snapshot.send_to, event.send_chunk, event.send_range, "to"),
        (snapshot.recv_from, event.recv_chunk, event.recv_range, "from"),
    ):
        if peer < 0:
            continue
        text = f"{verb} {peer}: {_short(demo, event, chunk, tuple(span))}"
        if verb == "from" and span[1] > span[0]:
            text += " added" if snapshot.added else " copied"
        labels.append(text)
    return labels


def _short(demo: Demo, event: Any, chunk: int, span: tuple[int, int]) -> str:
    """'c2 [6:8)', 'c0-1 [0:6)' or 'all'."""
    name = chunk_name(demo, event, chunk, span)
    return name if name == "all" else f"{name} [{span[0]}:{span[1]})"


class FrameLayout:
    """Where a frame puts things, the same for every round of a demo."""

    def __init__(self, demo: Demo) -> None:
        rows = _rows(demo)
        self.names = text_width(f"rank {demo.ranks - 1}", TEXT) + 16
        notes = [_wrap(explain_round(demo, title), WIDTH - 16) for title, _, _ in rows]
        self.top = 10 + 1.3 * TITLE + max(len(n) for n in notes) * LINE + 6
        self.chunks = demo_chunks(demo)
        if self.chunks is not None:
            self.top += LINE  # the chunks' names
        labels = ["; ".join(exchange_labels(demo, s)) for _, _, taken in rows for s in taken
                  if s is not None]  # fmt: skip
        self.labels = max([text_width(text, TEXT) for text in labels] or [0.0]) + 12
        room = WIDTH - self.names - self.labels - 8
        self.pitch = (HEIGHT - LEGEND - 8 - self.top) / max(demo.ranks, 1)
        self.cell = (min(60.0, max(room, 0) / max(demo.length, 1)), min(self.pitch - 4, 2 * LINE))
        self.numbers = numbers_for(demo, *self.cell) if demo.length else None


def _wrap(text: str, width: float) -> list[str]:
    """`text` in lines of at most `width` points at 14 points, broken at spaces."""
    return _fill(text.split(" "), " ", width)


def _fill(pieces: Sequence[str], separator: str, width: float) -> list[str]:
    """The pieces joined by `separator` into lines of at most `width` points (a piece wider than
    a line gets a line of its own)."""
    lines = [""]
    for piece in pieces:
        joined = f"{lines[-1]}{separator}{piece}" if lines[-1] else piece
        if text_width(joined, TEXT) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append(piece)
    return lines


def frame_canvas(demo: Demo, row: int, layout: FrameLayout | None = None) -> Canvas:
    """One round as a slide: its name and what happens in it, every rank's buffer in a row."""
    layout = layout or FrameLayout(demo)
    rows = _rows(demo)
    title, buffers, taken = rows[row]
    name = _row_name(row, title) + f"  ({row} of {len(rows) - 1})"
    canvas = Canvas(f"{demo.what}, {name}")
    y = 10 + 1.3 * TITLE
    for line in _wrap(explain_round(demo, title), WIDTH - 16) if row else []:
        canvas.text(WIDTH / 2, y + LINE / 2, line, TEXT, (0, y, WIDTH, y + LINE), ha="center",
                    va="center")  # fmt: skip
        y += LINE
    width, height = layout.cell
    if layout.chunks is not None:
        _chunk_names(canvas, layout, width)
    for rank in range(demo.ranks):
        y = layout.top + rank * layout.pitch
        canvas.text(layout.names - 8, y + height / 2, f"rank {rank}", TEXT,
                    (0, y, layout.names, y + layout.pitch), ha="right", va="center")  # fmt: skip
        draw_buffer(canvas, demo, layout.names, y, layout.cell, buffers[rank], layout.numbers,
                    taken[rank])  # fmt: skip
        snapshot = taken[rank]
        if snapshot is not None:
            x = layout.names + width * demo.length + 12
            canvas.text(x, y + height / 2, "; ".join(exchange_labels(demo, snapshot)), TEXT,
                        (x - 4, y, WIDTH, y + layout.pitch), ha="left", va="center")  # fmt: skip
    draw_legend(canvas, demo, layout.numbers)
    return canvas


def _chunk_names(canvas: Canvas, layout: FrameLayout, width: float) -> None:
    """'c0', 'c1', ... over the chunks wide enough for their name."""
    assert layout.chunks is not None
    y = layout.top - LINE
    for chunk, (lo, hi) in enumerate(zip(layout.chunks, layout.chunks[1:], strict=False)):
        name = f"c{chunk}"
        if (hi - lo) * width >= text_width(name, TEXT) + 2:
            x = layout.names + (lo + hi) / 2 * width
            canvas.text(x, y + LINE / 2, name, TEXT,
                        (layout.names + lo * width - 1, y, layout.names + hi * width + 1, y + LINE),
                        ha="center", va="center")  # fmt: skip


def draw_png(demo: Demo, path: str) -> None:
    """Draw every round of `demo` on one slide into `path` (.png, .svg or .pdf)."""
    grid_canvas(demo).save(path)


FRAME_NAME = re.compile(r"step-(\d{3,})\.png")  # what write_frames names its slides


def write_frames(demo: Demo, directory: str) -> list[str]:
    """One PNG slide per round (and the start) in `directory`: step-000.png, step-001.png, ...;
    the slides of an earlier, longer demo there are removed (no other file is touched)."""
    require_matplotlib("--frames")
    if not os.path.isdir(directory):
        os.mkdir(directory)  # its parent must exist, as a file's must: no tree of directories
    paths = [os.path.join(directory, f"step-{row:03d}.png") for row in range(len(demo.steps) + 1)]
    _write_all(demo, paths)
    for name in os.listdir(directory):
        match = FRAME_NAME.fullmatch(name)
        stale = os.path.join(directory, name)
        if match and int(match[1]) >= len(paths) and _is_png(stale):
            os.remove(stale)  # a frame of ours, past the last round of this demo
    return paths


def _is_png(path: str) -> bool:
    """Whether `path` is a regular file that starts as a PNG does (not a link, not a folder)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    with open(path, "rb") as handle:
        return handle.read(8) == b"\x89PNG\r\n\x1a\n"


def _write_all(demo: Demo, paths: list[str]) -> None:
    """Write the slides, one process per core where that is allowed."""
    workers = min(len(os.sched_getaffinity(0)), len(paths))
    if workers > 1 and not _under_mpi():  # the slides are independent: one process per core
        import multiprocessing

        context = multiprocessing.get_context("fork")
        pool = context.Pool(workers, _start_worker, (demo,))
        try:
            pool.map(_write_frame, list(enumerate(paths)), chunksize=1)
            pool.close()  # the workers end on their own: no SIGTERM to them after success
        finally:
            pool.terminate()
            pool.join()
    else:
        _start_worker(demo)
        for job in enumerate(paths):
            _write_frame(job)


_WORKER: dict[str, Any] = {}  # a frame-writing process's demo and layout


def _start_worker(demo: Demo) -> None:
    """Keep the demo and its layout for `_write_frame`; a signal ends the worker quietly (the
    command's process reports it). An error is kept for `_write_frame` to raise: a pool whose
    initializer fails starts new workers for ever."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        require_matplotlib("--frames")
        _WORKER.update(demo=demo, layout=FrameLayout(demo), error=None)
    except Exception as exc:  # reported once, by the first frame, to the command
        _WORKER.update(error=exc)


def _write_frame(job: tuple[int, str]) -> None:
    """Write the slide of round `row` (0: the start) to `path`."""
    if _WORKER.get("error") is not None:
        raise _WORKER["error"]
    row, path = job
    frame_canvas(_WORKER["demo"], row, _WORKER["layout"]).save(path)


def _under_mpi() -> bool:
    """Whether an MPI launcher started this process (no forking there)."""
    from syncsgd.comm.world import launched_by_mpi

    return launched_by_mpi()
