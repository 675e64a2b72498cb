"""`ring-demo --png` and `--frames`: the rounds of an allreduce drawn for slides.

Each buffer is a row of boxes, one per element, coloured by its chunk and darker the more ranks
its value holds; the range a rank just received is framed in black (solid: added, dashed:
copied), a colour no chunk takes. Font sizes follow the size of a box, and a value that would not
fit its box at a legible size is replaced by the number of ranks summed into it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from syncsgd.apps.demo_core import (
    Demo,
    Snapshot,
    chunk_count,
    chunk_layout,
    contributors,
)

ROW_HEIGHT = 2.6  # in element boxes: a row of boxes, two lines of labels, a gap
MIN_POINTS = 5.0  # the smallest font a value is written in; below it, the ranks summed
FRAME = "black"  # never a chunk colour: tab10 and tab20 have no black


def _figure_modules() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas, or a RuntimeError saying how to install them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install 'syncsgd[plot]'") from None
    return Figure, FigureCanvasAgg


def chunk_colour(chunk: int, chunks: int) -> np.ndarray:
    """The RGB of a chunk: tab10 for up to 10 chunks, tab20 without its greys for more."""
    from matplotlib import colormaps

    if chunks <= 10:
        return np.array(colormaps["tab10"](chunk % 10)[:3])
    usable = [i for i in range(20) if i not in (14, 15)]  # 14 and 15 are tab20's greys
    return np.array(colormaps["tab20"](usable[chunk % len(usable)])[:3])


def _rows(demo: Demo) -> list[tuple[str, list[np.ndarray], list[Snapshot | None]]]:
    """(name, every rank's buffer, every rank's step or None) for the start and each round."""
    rows: list[tuple[str, list[np.ndarray], list[Snapshot | None]]] = [
        ("start", list(demo.start), [None] * demo.ranks)
    ]
    current = list(demo.start)
    for number, (title, group) in enumerate(demo.steps, start=1):
        taken: list[Snapshot | None] = [None] * demo.ranks
        for snapshot in group:
            taken[snapshot.event.rank] = snapshot
            current[snapshot.event.rank] = snapshot.buffer
        rows.append((f"round {number}: {title}", list(current), taken))
    return rows


class Canvas:
    """A figure whose unit is one element box, `box` points wide."""

    def __init__(self, width: float, height: float, box_inches: float, title: str) -> None:
        Figure, FigureCanvasAgg = _figure_modules()
        self.box = box_inches * 72  # points per element box
        self.figure = Figure(figsize=(width * box_inches, height * box_inches))
        FigureCanvasAgg(self.figure)
        self.axes = self.figure.add_axes((0, 0, 1, 1))
        self.axes.set_xlim(0, width)
        self.axes.set_ylim(-height, 0)
        self.axes.axis("off")
        self.boxes: list[tuple[Any, tuple[float, float, float, float]]] = []  # text, its box
        self.axes.text(width / 2, -0.4, title, ha="center", va="top",
                       fontsize=self.points(0.55))  # fmt: skip

    def points(self, boxes: float) -> float:
        """A font size of `boxes` element boxes."""
        return boxes * self.box

    def text(self, x: float, y: float, text: str, size: float,
             room: tuple[float, float, float, float], **style: Any) -> None:  # fmt: skip
        """Write `text` at (x, y) in `size` boxes, and remember the room it must stay within."""
        artist = self.axes.text(x, y, text, fontsize=self.points(size), **style)
        self.boxes.append((artist, room))

    def save(self, path: str) -> None:
        """Write the figure as a PNG, atomically."""
        from syncsgd.util.files import atomic_path

        with atomic_path(path) as tmp:
            self.figure.savefig(tmp, format="png", dpi=120)


def overflows(canvas: Canvas) -> list[str]:
    """The texts that reach outside the room they were given (empty: every label fits)."""
    renderer = canvas.figure.canvas.get_renderer()
    to_data = canvas.axes.transData.inverted()
    found = []
    for artist, (x0, y0, x1, y1) in canvas.boxes:
        extent = artist.get_window_extent(renderer)
        (left, bottom), (right, top) = to_data.transform([[extent.x0, extent.y0],
                                                          [extent.x1, extent.y1]])  # fmt: skip
        slack = 1e-6
        if left < x0 - slack or right > x1 + slack or bottom < y0 - slack or top > y1 + slack:
            found.append(artist.get_text())
    return found


def _value_text(value: int, share: float, ranks: int, box_points: float) -> tuple[str, float]:
    """The value and its font size in boxes, or the ranks summed in if the value cannot fit."""
    digits = len(str(value))
    size = min(0.5, 0.85 / (0.62 * digits))  # a digit is about 0.6 em wide
    if size * box_points >= MIN_POINTS:
        return str(value), size
    count = str(round(share * ranks))
    return count, min(0.5, 0.85 / (0.62 * len(count)))


def draw_buffer(canvas: Canvas, demo: Demo, x0: float, y: float, values: np.ndarray,
                snapshot: Snapshot | None, room: float) -> None:  # fmt: skip
    """One rank's buffer with its top left at (x0, y), and what it sent and received below it."""
    from matplotlib.patches import Rectangle

    bounds = chunk_layout(demo.algorithm, demo.length, demo.ranks)
    chunks = 1 if bounds is None else len(bounds) - 1
    share = contributors(values, demo.ranks)
    for i, value in enumerate(values.tolist()):
        chunk = 0 if bounds is None else int(np.searchsorted(bounds, i, side="right")) - 1
        strength = 0.15 + 0.85 * min(float(share[i]), 1.0)
        face = (1 - strength) * np.ones(3) + strength * chunk_colour(chunk, chunks)
        canvas.axes.add_patch(Rectangle((x0 + i, y - 1), 1, 1, facecolor=face, edgecolor="white"))
        text, size = _value_text(value, float(share[i]), demo.ranks, canvas.box)
        ink = "white" if strength > 0.6 else "black"
        canvas.text(x0 + i + 0.5, y - 0.5, text, size, (x0 + i, y - 1, x0 + i + 1, y),
                    ha="center", va="center", color=ink)  # fmt: skip
    if snapshot is None:
        return
    lo, hi = snapshot.event.recv_range
    if hi > lo:
        style = "solid" if snapshot.added else (0, (2, 1.5))
        canvas.axes.add_patch(Rectangle((x0 + lo, y - 1), hi - lo, 1, fill=False, linewidth=2.5,
                                        edgecolor=FRAME, linestyle=style))  # fmt: skip
    for line, text in enumerate(exchange_labels(demo, snapshot)):
        size = min(0.42, room / (0.6 * max(len(text), 1)))
        top = y - 1.15 - line * 0.6
        canvas.text(x0, top, text, size, (x0, top - 0.6, x0 + room, top), ha="left", va="top")


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
    if chunk_layout(demo.algorithm, demo.length, demo.ranks) is None or event.phase in (
        "fold", "unfold"
    ):
        return "all"
    count = chunk_count(demo.algorithm, demo.ranks, event.phase, event.step)
    name = f"c{chunk}" if count == 1 else f"c{chunk}-{chunk + count - 1}"
    return f"{name} [{span[0]}:{span[1]})"


def _title(demo: Demo) -> str:
    """The algorithm, the sizes, and how to read the colours."""
    return (f"{demo.algorithm} allreduce, {demo.ranks} ranks, {demo.length} elements: darker = "
            f"more ranks summed in; black frame = just received (solid: added, dashed: copied)")


def grid_canvas(demo: Demo) -> Canvas:
    """Every round as a row of every rank's buffer: the whole allreduce in one figure."""
    p, n = demo.ranks, demo.length
    rows = _rows(demo)
    pitch = max(n, 8) + 1.5  # x distance of two ranks' buffers: room for the labels
    margin = 11.0  # the rounds' names
    width, height = margin + p * pitch, 2.2 + len(rows) * ROW_HEIGHT
    canvas = Canvas(width, height, min(0.3, 40 / width), _title(demo))
    for rank in range(p):
        canvas.text(margin + rank * pitch + n / 2, -1.6, f"rank {rank}", 0.5,
                    (margin + rank * pitch - 0.5, -2.2, margin + (rank + 1) * pitch - 1, -1.0),
                    ha="center", va="center")  # fmt: skip
    for row, (name, buffers, taken) in enumerate(rows):
        y = -2.2 - row * ROW_HEIGHT
        size = min(0.45, (margin - 0.6) / (0.6 * len(name)))
        canvas.text(margin - 0.4, y - 0.5, name, size, (0, y - 1.3, margin - 0.2, y + 0.3),
                    ha="right", va="center")  # fmt: skip
        for rank in range(p):
            draw_buffer(canvas, demo, margin + rank * pitch, y, buffers[rank], taken[rank],
                        pitch - 1.0)  # fmt: skip
    return canvas


def frame_canvas(demo: Demo, row: int) -> Canvas:
    """One round as a slide: every rank's buffer in a row of its own, the round's name on top."""
    rows = _rows(demo)
    name, buffers, taken = rows[row]
    n = max(demo.length, 8)
    label = 5.0  # the ranks' names
    width, height = label + n + 14, 2.2 + demo.ranks * 1.9
    canvas = Canvas(width, height, min(0.4, 13.3 / width, 7.5 / height),
                    f"{name}  ({row} of {len(rows) - 1})")  # fmt: skip
    for rank in range(demo.ranks):
        y = -2.0 - rank * 1.9
        canvas.text(label - 0.4, y - 0.5, f"rank {rank}", 0.5, (0, y - 1, label - 0.2, y),
                    ha="right", va="center")  # fmt: skip
        draw_buffer(canvas, demo, label, y, buffers[rank], None, n)
        snapshot = taken[rank]
        if snapshot is not None:
            _frame_received(canvas, label, y, snapshot)
            text = "; ".join(exchange_labels(demo, snapshot))
            size = min(0.45, 13.5 / (0.6 * max(len(text), 1)))
            canvas.text(label + demo.length + 0.5, y - 0.5, text, size,
                        (label + demo.length + 0.3, y - 1, width, y), ha="left",
                        va="center")  # fmt: skip
    return canvas


def _frame_received(canvas: Canvas, x0: float, y: float, snapshot: Snapshot) -> None:
    """The black frame around the range a rank just received."""
    from matplotlib.patches import Rectangle

    lo, hi = snapshot.event.recv_range
    if hi > lo:
        style = "solid" if snapshot.added else (0, (2, 1.5))
        canvas.axes.add_patch(Rectangle((x0 + lo, y - 1), hi - lo, 1, fill=False, linewidth=3,
                                        edgecolor=FRAME, linestyle=style))  # fmt: skip


def draw_png(demo: Demo, path: str) -> None:
    """Draw every round of `demo` as a grid of rounds x ranks into the PNG file `path`."""
    grid_canvas(demo).save(path)


def write_frames(demo: Demo, directory: str) -> list[str]:
    """One PNG per round (and the start) in `directory`: step-000.png, step-001.png, ..."""
    if not os.path.isdir(directory):
        os.mkdir(directory)  # its parent must exist, as a file's must: no tree of directories
    paths = []
    for row in range(len(demo.steps) + 1):
        path = os.path.join(directory, f"step-{row:03d}.png")
        frame_canvas(demo, row).save(path)
        paths.append(path)
    return paths
