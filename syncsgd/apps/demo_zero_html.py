"""`ring-demo --zero-stage 1 --html`: the ZeRO-1 step as a page that steps through it.

The allreduce page's template (`demo_html`), with the step's frames: the gradient sums, each
reduce-scatter round, the update (each rank's own block framed, with its momentum in the row's
note), each allgather round. Gradient sums are coloured by how many ranks' they hold, as on the
allreduce page; parameters teal once updated, grey while old. The bytes sent run on from the
reduce-scatter through the allgather, beside the ring allreduce's 2(P-1)/P·n.
"""

from __future__ import annotations

from typing import Any

from syncsgd.apps.demo_core import _count, count_colour, hex_colour
from syncsgd.apps.demo_html import filled, links, rounds_data
from syncsgd.apps.demo_zero import LR, MOMENTUM, ZeroDemo
from syncsgd.collectives import chunk_bounds
from syncsgd.collectives.schedules import owned_block
from syncsgd.util.files import write_text

OLD = "#e0e0e0"  # a parameter not yet updated (the slide's grey)


def zero_frames(zero: ZeroDemo) -> list[dict[str, Any]]:
    """The start, the reduce-scatter's rounds, the update, the allgather's rounds."""
    p, total = zero.ranks, 2 * (zero.ranks - 1)
    scattered = rounds_data(zero.scattered)
    scattered[0]["title"] = "start: every rank's local gradient sums"
    scattered[0]["explain"] = (f"one sample per rank, B = {p}: rank r's gradient sum is "
                               f"{zero.batch}·10^r in every element")  # fmt: skip
    for number, frame in enumerate(scattered[1:], start=1):
        frame["title"] = f"round {number} of {total}: reduce-scatter {number} of {p - 1}"
    gathered = rounds_data(zero.gathered)
    update = gathered[0]
    for number, frame in enumerate(gathered[1:], start=p):
        frame["title"] = f"round {number} of {total}: allgather {number - p + 1} of {p - 1}"
        frame["explain"] = "each rank copies the updated block its left neighbour sends"
        frame["sent"] = [a + b for a, b in zip(frame["sent"], scattered[-1]["sent"], strict=True)]
    _update_frame(zero, update, scattered[-1]["sent"])
    for frame in [update, *gathered[1:]]:
        _parameter_colours(zero, frame)
    return [*scattered, update, *gathered[1:]]


def _update_frame(zero: ZeroDemo, frame: dict[str, Any], sent: list[int]) -> None:
    """The frame between the halves: each rank's block divided, its m, its parameters updated."""
    mean = int(zero.initial[0] - zero.serial[0]) if zero.length else 0  # lr·m = g/B
    frame["title"] = "update: each rank its own block, with the optimizer state of that block"
    frame["explain"] = (f"g/B = {mean * zero.batch}/{zero.batch} = {mean}; m = {MOMENTUM}·0 + "
                        f"{mean}; θ = θ − {LR}·m, on the rank's own block alone")  # fmt: skip
    frame["sent"] = list(sent)
    notes, received = [], []
    for rank in range(zero.ranks):
        lo, hi = zero.owned(rank)
        block = f"block {owned_block(rank, zero.ranks)} [{lo}:{hi})"
        notes.append(f"{block}: updated here, its m ({hi - lo} of {zero.length}) kept here alone"
                     if hi > lo else f"{block} is empty: no parameters, no optimizer state")
        received.append([lo, hi, True] if hi > lo else None)
    frame["notes"], frame["received"] = notes, received


def _parameter_colours(zero: ZeroDemo, frame: dict[str, Any]) -> None:
    """Parameters: teal (count P) once updated, grey (count P + 1) while old."""
    initial = zero.initial.tolist()
    counts = [[zero.ranks if value != initial[i] else zero.ranks + 1 for i, value in
               enumerate(buffer)] for buffer in frame["buffers"]]  # fmt: skip
    frame["counts"] = counts
    frame["tips"] = [["updated" if count == zero.ranks else "the old parameter" for count in row]
                     for row in counts]  # fmt: skip


def zero_page(zero: ZeroDemo) -> str:
    """The whole HTML document."""
    p, n = zero.ranks, zero.length * 8
    frames = zero_frames(zero)
    colours = [hex_colour(count_colour(c, p)) for c in range(p + 1)] + [OLD]
    model = (f"the ring allreduce sends about 2(P−1)/P·n = {2 * (p - 1) * n / p:.1f} bytes of "
             f"n = {n} bytes per rank: the two halves here send the same")  # fmt: skip
    halves = (zero.scattered, zero.gathered)
    pairs = sorted({tuple(pair) for half in halves for pair in links(half)})
    document = {
        "algorithm": "ring", "ranks": p, "length": zero.length, "topology": "circle",
        "links": [list(pair) for pair in pairs], "frames": frames, "model": model,
        "rounds": f"{_count(2 * (p - 1), 'round')}, the ring allreduce's: its reduce-scatter on "
                  "the gradient sums, its allgather on the parameters",
        "correct": zero.correct, "bounds": chunk_bounds(zero.length, p), "colours": colours,
        "legend": "; parameters: teal once updated, grey while old; frame: just received "
                  "(solid: added, dashed: copied), or the block a rank updates",
    }  # fmt: skip
    return filled(document, f"ZeRO stage 1, one step on {p} ranks")


def write_zero_html(zero: ZeroDemo, path: str) -> None:
    """Write the page to `path`, atomically."""
    write_text(path, zero_page(zero))
