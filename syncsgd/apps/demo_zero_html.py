"""`ring-demo --zero-stage K --html`: the step of ZeRO stage 1, 2 or 3 as a page that steps
through it.

The allreduce page's template (`demo_html`), with the step's frames: (stage 3) each rank's block of
θ and each round of the allgather before the passes, the gradient sums, each reduce-scatter round,
(stages 2, 3) the block of the sums each rank keeps, the update (each rank's own block framed,
with its momentum in the row's note), (stages 1, 2) each allgather round. Gradient sums are
coloured by how many ranks' they hold, as on the allreduce page; parameters teal once updated,
grey while old; an element a rank does not keep is white. The bytes sent run on from the first
collective through the last, beside the ring allreduce's 2(P-1)/P·n.
"""

from __future__ import annotations

from typing import Any

from syncsgd.apps.demo_core import _count, count_colour, hex_colour
from syncsgd.apps.demo_html import filled, links, rounds_data
from syncsgd.apps.demo_zero import (
    ABSENT,
    LR,
    MOMENTUM,
    ZeroDemo,
    initial_parameters,
    shown_fetch,
)
from syncsgd.collectives import chunk_bounds
from syncsgd.collectives.schedules import owned_block
from syncsgd.util.files import write_text

OLD = "#e0e0e0"  # a parameter not yet updated (the slide's grey)


def zero_frames(zero: ZeroDemo) -> list[dict[str, Any]]:
    """(Stage 3: each rank's block of θ, the allgather's rounds,) the gradient sums, the
    reduce-scatter's rounds, (stages 2, 3: the block of the sums kept,) the update, (stages 1, 2:)
    the allgather's rounds."""
    p, total = zero.ranks, 2 * (zero.ranks - 1)
    frames = _fetch_frames(zero) if zero.stage == 3 else []
    done = frames[-1]["sent"] if frames else [0] * p  # what each rank sent before
    scattered = _carried(rounds_data(zero.scattered), done)
    scattered[0]["title"] = "start: every rank's local gradient sums" if zero.stage < 3 else \
        "the passes on θ whole: every rank's local gradient sums"
    scattered[0]["explain"] = (f"one sample per rank, B = {p}: rank r's gradient sum is "
                               f"{zero.batch}·10^r in every element")  # fmt: skip
    first = len(frames) - 1 if frames else 0  # the rounds before: stage 3's allgather
    for number, frame in enumerate(scattered[1:], start=1):
        frame["title"] = (f"round {first + number} of {total}: reduce-scatter {number} of "
                          f"{p - 1}")  # fmt: skip
    frames += scattered
    if zero.stage > 1:
        frames.append(_kept_frame(zero, frames[-1]["sent"]))
    update: dict[str, Any] = {"messages": []}
    _update_frame(zero, update, frames[-1]["sent"])
    frames.append(update)
    if zero.gathered is not None:
        gathered = _carried(rounds_data(zero.gathered), update["sent"])[1:]
        for number, frame in enumerate(gathered, start=p):
            frame["title"] = f"round {number} of {total}: allgather {number - p + 1} of {p - 1}"
            frame["explain"] = "each rank copies the updated block its left neighbour sends"
            _parameter_colours(zero, frame)
        frames += gathered
    return frames


def _carried(frames: list[dict[str, Any]], before: list[int]) -> list[dict[str, Any]]:
    """A collective's frames, their bytes sent counted on from `before`."""
    for frame in frames:
        frame["sent"] = [a + b for a, b in zip(frame["sent"], before, strict=True)]
    return frames


def _fetch_frames(zero: ZeroDemo) -> list[dict[str, Any]]:
    """Stage 3: each rank's block of θ, then the allgather's rounds before the forward pass."""
    p = zero.ranks
    frames, shown = rounds_data(zero.fetched), shown_fetch(zero)  # type: ignore[arg-type]
    frames[0]["title"] = "start: each rank keeps its own block of the parameters alone"
    frames[0]["explain"] = (f"θ_i = {int(initial_parameters(p, 1)[0])}·(i + 1); each rank "
                            "keeps its block alone, the other blocks are other ranks'")  # fmt: skip
    frames[0]["received"] = [[*zero.owned(r), True] if zero.owned(r)[1] > zero.owned(r)[0]
                             else None for r in range(p)]  # fmt: skip
    current = list(shown.start)
    frames[0]["buffers"] = [buffer.tolist() for buffer in current]
    for number, ((_, group), frame) in enumerate(zip(shown.steps, frames[1:], strict=True),
                                                 start=1):  # fmt: skip
        for snapshot in group:
            current[snapshot.event.rank] = snapshot.buffer
        frame["buffers"] = [buffer.tolist() for buffer in current]
        frame["title"] = f"round {number} of {2 * (p - 1)}: allgather {number} of {p - 1}"
        frame["explain"] = ("before the forward pass: each rank copies the block of θ its left "
                            "neighbour sends")  # fmt: skip
    for frame in frames:
        _parameter_colours(zero, frame)
    return frames


def _kept_frame(zero: ZeroDemo, sent: list[int]) -> dict[str, Any]:
    """Stages 2, 3: each rank keeps its own block of the gradient sums, drops the rest."""
    p, notes, received = zero.ranks, [], []
    for rank in range(p):
        lo, hi = zero.owned(rank)
        block = f"block {owned_block(rank, p)} [{lo}:{hi})"
        notes.append(f"{block}: its sums kept, the other blocks dropped" if hi > lo
                     else f"{block} is empty: it keeps no gradient")  # fmt: skip
        received.append([lo, hi, True] if hi > lo else None)
    buffers = [zero.kept(zero.scattered.final[rank], rank).tolist() for rank in range(p)]
    counts = [[0 if value == ABSENT else p for value in row] for row in buffers]
    return {"title": "kept: each rank its own block of the gradient sums, alone",
            "explain": "the bucket's buffer then serves the next bucket: the other blocks' "
                       "partial sums are dropped", "buffers": buffers, "messages": [],
            "received": received, "notes": notes, "sent": list(sent), "counts": counts,
            "tips": [["dropped" if count == 0 else f"{p} of {p} ranks summed in" for count in row]
                     for row in counts]}  # fmt: skip


def _update_frame(zero: ZeroDemo, frame: dict[str, Any], sent: list[int]) -> None:
    """The frame of the update: each rank's block divided, its m, its parameters updated."""
    mean = int(zero.initial[0] - zero.serial[0]) if zero.length else 0  # lr·m = g/B
    kept = "optimizer state" if zero.stage == 1 else "gradient sums and optimizer state"
    frame["title"] = f"update: each rank its own block, with the {kept} of that block"
    frame["explain"] = (f"g/B = {mean * zero.batch}/{zero.batch} = {mean}; m = {MOMENTUM}·0 + "
                        f"{mean}; θ = θ − {LR}·m, on the rank's own block alone")  # fmt: skip
    if zero.stage == 3:
        frame["explain"] += "; it forgets the θ it gathered"
    frame["sent"] = list(sent)
    notes, received = [], []
    for rank in range(zero.ranks):
        lo, hi = zero.owned(rank)
        block = f"block {owned_block(rank, zero.ranks)} [{lo}:{hi})"
        notes.append(f"{block}: updated here, its m ({hi - lo} of {zero.length}) kept here alone"
                     if hi > lo else f"{block} is empty: no parameters, no optimizer state")
        received.append([lo, hi, True] if hi > lo else None)
    frame["notes"], frame["received"] = notes, received
    frame["buffers"] = [zero.parameters(rank).tolist() for rank in range(zero.ranks)]
    _parameter_colours(zero, frame)


def _parameter_colours(zero: ZeroDemo, frame: dict[str, Any]) -> None:
    """Parameters: teal (count P) once updated, grey (count P + 1) while old, white (0) where
    the rank keeps none."""
    initial = zero.initial.tolist()
    names = {0: "not kept here", zero.ranks: "updated", zero.ranks + 1: "the old parameter"}
    counts = [[0 if value == ABSENT else zero.ranks if value != initial[i] else zero.ranks + 1
               for i, value in enumerate(buffer)] for buffer in frame["buffers"]]  # fmt: skip
    frame["counts"] = counts
    frame["tips"] = [[names[count] for count in row] for row in counts]


def zero_page(zero: ZeroDemo) -> str:
    """The whole HTML document."""
    p, n = zero.ranks, zero.length * 8
    frames = zero_frames(zero)
    colours = [hex_colour(count_colour(c, p)) for c in range(p + 1)] + [OLD]
    model = (f"the ring allreduce sends about 2(P−1)/P·n = {2 * (p - 1) * n / p:.1f} bytes of "
             f"n = {n} bytes per rank: the two halves here send the same")  # fmt: skip
    pairs = sorted({tuple(pair) for half in zero.halves for pair in links(half)})
    rounds = ("its reduce-scatter on the gradient sums, its allgather on the parameters"
              if zero.stage < 3 else "its allgather on the parameters before the passes, its "
              "reduce-scatter on the gradient sums; none after the update")  # fmt: skip
    document = {
        "algorithm": "ring", "ranks": p, "length": zero.length, "topology": "circle",
        "links": [list(pair) for pair in pairs], "frames": frames, "model": model,
        "rounds": f"{_count(2 * (p - 1), 'round')}, the ring allreduce's: {rounds}",
        "correct": zero.correct, "bounds": chunk_bounds(zero.length, p), "colours": colours,
        "legend": "; parameters: teal once updated, grey while old" + (
            "" if zero.stage == 1 else "; white: not kept on this rank") + "; frame: just "
            "received (solid: added, dashed: copied), or the block a rank updates",
    }  # fmt: skip
    return filled(document, f"ZeRO stage {zero.stage}, one step on {p} ranks")


def write_zero_html(zero: ZeroDemo, path: str) -> None:
    """Write the page to `path`, atomically."""
    write_text(path, zero_page(zero))
