"""`ring-demo --zero-stage K --png`: the step of ZeRO stage 1, 2 or 3 on one slide.

One row per stage of the step, one column per rank, as the allreduce's detailed slide
(`demo_png`): (stage 3) each rank's block of θ and each round of the allgather that brings θ whole
before the passes, the gradient sums, each reduce-scatter round, (stages 2, 3) the block of the
sums a rank keeps, each rank's momentum m (on its block alone), its parameters with its block
updated, (stages 1, 2) each allgather round. A gradient cell's colour is how many ranks' sums it
holds (the allreduce slides' colours); a parameter cell is teal once updated, grey while it is the
old value; an m cell is teal where the rank keeps m; a cell is white where the rank keeps nothing.
The numbers are written where every value fits at 14 points, else the colours alone say it; the
range just received is framed (solid: added, dashed: copied), and so is the block a rank keeps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from syncsgd.apps.demo_core import count_colour, ranks_summed
from syncsgd.apps.demo_png import (
    HEIGHT,
    LEGEND,
    LINE,
    MONO_EM,
    TEXT,
    WIDTH,
    Canvas,
    number_row,
    peers_text,
    text_width,
)
from syncsgd.apps.demo_zero import ABSENT, ZeroDemo, shown_fetch
from syncsgd.collectives.schedules import owned_block

MAX_RANKS = 8  # 2P + 1 rows (stage 1) to 2P + 3 (stage 3), each at least a 14-point line high
OLD = (0.88, 0.88, 0.88)  # a parameter not yet updated: black text on it is 15:1
NONE = (1.0, 1.0, 1.0)  # no optimizer state here


class Row(NamedTuple):
    """One stage of the step: its name, what kind of numbers, every rank's cells and frames."""

    name: str
    kind: str  # "sum", "state" or "param"
    values: list[list[Any]]  # per rank: the numbers (ABSENT where a rank keeps no state)
    frames: list[tuple[int, int, bool] | None]  # per rank: (start, stop, dashed) to frame
    peers: list[str]  # per rank: '→1 ←2', or ''


def zero_rows(zero: ZeroDemo) -> list[Row]:
    """The slide's rows, top to bottom."""
    p = zero.ranks
    owned = [zero.owned(rank) for rank in range(p)]
    frames = [(lo, hi, False) if hi > lo else None for lo, hi in owned]
    rows = []
    if zero.stage == 3:
        rows.append(Row("θ, own block", "param", [zero.kept(zero.initial, rank).tolist()
                                                  for rank in range(p)], frames, [""] * p))
        rows += _rounds(shown_fetch(zero), "param", "allgather")
    rows.append(Row("gradient sums", "sum", [b.tolist() for b in zero.scattered.start], [None] * p,
                    [""] * p))  # fmt: skip
    rows += _rounds(zero.scattered, "sum", "reduce-scatter")
    if zero.stage > 1:
        rows.append(Row("g, own block", "sum", [zero.kept(zero.scattered.final[rank], rank).tolist()
                                                for rank in range(p)], frames, [""] * p))
    state = [zero.kept(zero.momentum[rank], rank).tolist() for rank in range(p)]
    rows.append(Row("m, own block", "state", state, frames, [""] * p))
    rows.append(Row("θ - lr·m", "param", [zero.parameters(rank).tolist() for rank in range(p)],
                    frames, [""] * p))  # fmt: skip
    if zero.gathered is not None:
        rows += _rounds(zero.gathered, "param", "allgather")
    return rows


def _rounds(demo: Any, kind: str, phase: str) -> list[Row]:
    """A half's rounds as rows: every rank's buffer after the round, what it just received."""
    rows, current = [], [b.tolist() for b in demo.start]
    for number, (_, group) in enumerate(demo.steps, start=1):
        frames: list[tuple[int, int, bool] | None] = [None] * demo.ranks
        peers = [""] * demo.ranks
        for snapshot in group:
            rank = snapshot.event.rank
            current[rank] = snapshot.buffer.tolist()
            lo, hi = snapshot.event.recv_range
            if hi > lo and snapshot.recv_from >= 0:
                frames[rank] = (lo, hi, not snapshot.added)
            peers[rank] = peers_text(snapshot)
        rows.append(Row(f"{phase} {number}", kind, [list(c) for c in current], frames, peers))
    return rows


def cell_colour(zero: ZeroDemo, row: Row, rank: int, index: int) -> tuple[float, float, float]:
    """A sum's count of ranks; a parameter updated (teal) or old (grey); m kept or not."""
    value = row.values[rank][index]
    if value == ABSENT:
        return NONE
    if row.kind == "sum":
        return count_colour(int(ranks_summed(np.array([value]), zero.ranks)[0]), zero.ranks)
    if row.kind == "state":
        return count_colour(zero.ranks, zero.ranks)
    updated = value != int(zero.initial[index])
    return count_colour(zero.ranks, zero.ranks) if updated else OLD


class Layout(NamedTuple):
    """Where the slide puts things."""

    names: float  # the row names' width
    across: float  # one rank's column
    pitch: float  # one row
    cell: tuple[float, float]
    peers: bool  # room for '→1 ←2' under each buffer
    numbers: bool


def layout(zero: ZeroDemo, rows: list[Row]) -> Layout:
    """Cells as large as the slide allows; numbers and peers where they fit at 14 points."""
    names = max(text_width(row.name, TEXT) for row in rows) + 16
    across = (WIDTH - names - 8) / zero.ranks
    pitch = (HEIGHT - 40 - LINE - LEGEND - 4) / len(rows)
    peers = pitch - LINE - 8 >= LINE
    height = min(pitch - LINE - 8 if peers else pitch - 6, 2 * LINE)
    width = (across - 12) / max(zero.length, 1)
    widest = max((len(str(v)) for row in rows for cells in row.values for v in cells), default=1)
    numbers = height >= LINE and width >= (widest + 1) * MONO_EM * TEXT and zero.length > 0
    return Layout(names, across, pitch, (width, height), peers, numbers)


def zero_canvas(zero: ZeroDemo) -> Canvas:
    """The whole step on one slide."""
    canvas = Canvas(f"ZeRO stage {zero.stage}, one step: {zero.ranks} ranks, {zero.length} "
                    "parameters")  # fmt: skip
    rows = zero_rows(zero)
    place = layout(zero, rows)
    height = place.cell[1]
    top = 40 + LINE
    for rank in range(zero.ranks):
        x = place.names + rank * place.across
        names = (f"rank {rank}: block {owned_block(rank, zero.ranks)}", f"rank {rank}")
        heading = next((text for text in names if text_width(text, TEXT) <= place.across - 12),
                       str(rank))  # fmt: skip
        canvas.text(x + (place.across - 12) / 2, top - LINE / 2, heading, TEXT,
                    (x - 6, top - LINE, x + place.across - 6, top), ha="center",
                    va="center")  # fmt: skip
    for number, row in enumerate(rows):
        y = top + number * place.pitch
        canvas.text(place.names - 8, y + height / 2, row.name, TEXT,
                    (0, y, place.names, y + height), ha="right", va="center")  # fmt: skip
        for rank in range(zero.ranks):
            _draw_cells(canvas, zero, row, rank, (place.names + rank * place.across, y), place)
    _legend(canvas, place.numbers, zero.stage)
    return canvas


def _draw_cells(canvas: Canvas, zero: ZeroDemo, row: Row, rank: int, at: tuple[float, float],
                place: Layout) -> None:  # fmt: skip
    """One rank's cells in one row, its frame, its numbers and its peers."""
    (x, y), (width, height) = at, place.cell
    gap = 1.0 if width >= 6 else 0.0
    for index in range(zero.length):
        canvas.cell(x + index * width, y, width - gap, height, cell_colour(zero, row, rank, index))
    if place.numbers:
        number_row(canvas, x, y, place.cell, row.values[rank])
    frame = row.frames[rank]
    if frame is not None:
        lo, hi, dashed = frame
        canvas.outline(x + lo * width, y, (hi - lo) * width - gap, height, dashed)
    if place.peers and row.peers[rank]:
        canvas.text(x, y + height + 2, row.peers[rank], TEXT,
                    (x, y + height, x + place.across - 8, y + height + LINE + 4), ha="left",
                    va="top")  # fmt: skip


def _legend(canvas: Canvas, numbers: bool, stage: int) -> None:
    """Two lines at the bottom: what the colours of each kind of row say, and the frames."""
    y = HEIGHT - LEGEND + 4
    kept = "of m: teal kept here" if stage == 1 else "white: not kept here"
    lines = ("colour of a sum: how many ranks' it holds (teal: all); of θ: teal updated, grey old;"
             f" {kept}",
             ("numbers: the values; " if numbers else "no numbers: the colours alone; ")
             + "frame: just received (solid: added, dashed: copied), or the block "
             + ("updated" if stage == 1 else "kept"),
             )  # fmt: skip
    for line in lines:
        canvas.text(8, y + LINE / 2, line, TEXT, (0, y, WIDTH, y + LINE), va="center")
        y += LINE + 4


def draw_zero_png(zero: ZeroDemo, path: str) -> None:
    """Draw the step on one slide into `path` (.png, .svg or .pdf)."""
    zero_canvas(zero).save(path)
