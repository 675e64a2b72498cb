"""Timelines: what every rank did when, as a Chrome trace (open in chrome://tracing or Perfetto).

One row per rank; spans for compute, for every step of every collective (from the collectives'
`trace` events: an allreduce's reduce-scatter and allgather steps, and a sharded step's own
reduce-scatters and allgathers) and for the update. With --overlap, a second row per rank holds
what its communication thread did: the allreduce steps inside the compute spans of the backward
pass.
Each rank records its own spans against its own clock, started right after a barrier, so the rows
line up to within the barrier's skew (thread ranks read one clock: they agree on one origin); rank
0 gathers them with point-to-point messages and writes one JSON file.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import numpy as np

from syncsgd.collectives import TraceEvent
from syncsgd.comm.threads import ThreadComm
from syncsgd.comm.world import constants
from syncsgd.util import jsonout

_TAG = 4321
COMM_ROW = 1 << 20  # a rank's communication row: tid COMM_ROW + rank, drawn below its own row


class Timeline:
    """The spans of one rank: (name, category, start, end, args), times in seconds."""

    def __init__(self, comm: Any) -> None:
        comm.Barrier()  # a common origin for every rank's clock
        self.origin = time.perf_counter()
        if isinstance(getattr(comm, "unwatched", comm), ThreadComm):
            # Thread ranks read one clock, but leave the barrier up to tens of ms apart on a busy
            # machine: their rows would be that far out of line. One origin for all of them.
            mpi = constants(comm)
            agreed = np.array([self.origin])
            comm.Allreduce(mpi.IN_PLACE, agreed, op=mpi.MIN)
            self.origin = float(agreed[0])
        self.rank = comm.Get_rank()
        self.spans: list[tuple[str, str, float, float, dict]] = []
        self.comm_spans: list[tuple[str, str, float, float, dict]] = []  # another thread's
        self.thread = threading.get_ident()  # the rank's own thread: its spans go on its row

    def span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record that this rank did `name` from `start` to `end` (time.perf_counter() values)."""
        spans = self.spans if threading.get_ident() == self.thread else self.comm_spans
        spans.append((name, category, start - self.origin, end - self.origin, args))

    def collective_step(self, event: TraceEvent) -> None:
        """A collective's `trace` callback: one span per step."""
        self.span(
            f"{event.phase} {event.step}", "allreduce", event.start, event.end,
            send_chunk=event.send_chunk, recv_chunk=event.recv_chunk, bytes=event.nbytes,
        )  # fmt: skip

    def chrome_events(self) -> list[dict]:
        """This rank's spans as Chrome trace 'complete' events (microseconds)."""
        rows = [(self.rank, f"rank {self.rank}", self.spans)]
        if self.comm_spans:
            rows.append((COMM_ROW + self.rank, f"rank {self.rank} communication", self.comm_spans))
        events = []
        for order, (tid, label, spans) in enumerate(rows):
            events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                        "args": {"name": label}},
                       {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                        "args": {"sort_index": 2 * self.rank + order}}]  # fmt: skip
            events += [{"name": name, "cat": category, "ph": "X", "pid": 0, "tid": tid,
                        "ts": start * 1e6, "dur": (end - start) * 1e6, "args": args}
                       for name, category, start, end, args in spans]  # fmt: skip
        return events


def write(comm: Any, timeline: Timeline, path: str) -> None:
    """Gather every rank's spans on rank 0 and write them to `path` (a collective call)."""
    payload = np.frombuffer(jsonout.dumps(timeline.chrome_events()).encode(), np.uint8)
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        comm.Send(np.array([payload.size], np.int64), dest=0, tag=_TAG)
        comm.Send(payload, dest=0, tag=_TAG)
        return
    events = timeline.chrome_events()
    for source in range(1, size):
        length = np.zeros(1, np.int64)
        comm.Recv(length, source=source, tag=_TAG)
        data = np.empty(int(length[0]), np.uint8)
        comm.Recv(data, source=source, tag=_TAG)
        events.extend(json.loads(data.tobytes()))
    jsonout.write(path, {"traceEvents": events, "displayTimeUnit": "ms"}, indent=None)


# -- a Gantt chart of the same spans, for slides -------------------------------------------------

COLOURS = {  # by category, then by the phase of an allreduce step: Okabe & Ito's palette
    "compute": "#0072B2", "update": "#009E73", "reduce-scatter": "#E69F00", "allgather": "#56B4E9",
    "exchange": "#D55E00", "reduce": "#CC79A7", "broadcast": "#F0E442", "fold": "#999999",
    "unfold": "#999999",
}  # fmt: skip
OTHER = "#000000"
SPANS = ("compute", "update")  # a step's own spans: the collectives' steps are drawn over them
TEXT = 14  # points, on a 16:9 slide (syncsgd.util.figures)
SHOWN_STEPS = 4  # steps drawn: more turn a slide's bars into a barcode


def _kind(event: dict) -> str:
    """What a span is drawn as: compute, update, or the phase of an allreduce step."""
    if event.get("cat") == "allreduce":
        return str(event["name"]).rsplit(" ", 1)[0]
    return str(event.get("cat", "other"))


def draw_gantt(events: list[dict], path: str, title: str = "timeline") -> None:
    """Chrome trace events as a bar row per rank, on a slide: .png, .svg or .pdf by extension."""
    from syncsgd.util import figures

    figures.save(gantt_figure(events, title), path)


def gantt_figure(events: list[dict], title: str = "timeline") -> Any:
    """The slide: a row per rank, a bar per span coloured by what it is, the steps marked."""
    from syncsgd.util import figures

    spans = [e for e in events if e.get("ph") == "X"]
    rows = _rows(events)
    figure = figures.new_figure(layout="constrained")
    axes = figure.add_subplot()
    steps = _step_starts(spans)
    origin = _steady_start(spans)
    shown, last = _window(_shown(spans, origin))
    if origin is None:
        origin = min((e["ts"] for e in spans), default=0.0)
    else:  # the first step loads the kernels: it would squeeze the rest to a line
        first = origin - min(e["ts"] for e in spans)
        timed = min(s for s in steps if steps[s] >= origin)
        shown_steps = (f"steps {timed}-{last} of the timed {timed}-{max(steps)}"
                       if last < max(steps) else f"from step {timed}, the first timed")
        title += f"\n{shown_steps} (the first, start-up included, took {first / 1e6:.2f} s)"
        steps = {step: start for step, start in steps.items() if step <= last}
    end = max((e["ts"] + e["dur"] for e in shown), default=origin + 1.0)
    unit, scale = ("ms", 1e-3) if end - origin < 2e6 else ("s", 1e-6)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (row, kind): the spans
    for event in shown:
        bars.setdefault((rows[event["tid"]], _kind(event)), []).append(
            ((event["ts"] - origin) * scale, max(event["dur"] * scale, 0)))  # fmt: skip
    kinds: dict[str, str] = {}
    calls = False
    for (row, kind), xranges in bars.items():
        if kind == "call":  # a whole traced call (bench): an outline around its steps
            axes.broken_barh(xranges, (row - 0.45, 0.9), facecolors="none", edgecolors="black",
                             linewidth=1.0)  # fmt: skip
            calls = True
            continue
        kinds.setdefault(kind, COLOURS.get(kind, OTHER))
        # A collective's steps on top of the compute or update span they lie in: ZeRO-2's
        # reduce-scatters in the backward pass, ZeRO-3's allgathers in both passes, the
        # agreement and the parameters' allgather in the update.
        axes.broken_barh(xranges, (row - 0.35, 0.7), facecolors=kinds[kind],
                         zorder=1 if kind in SPANS else 2)  # fmt: skip
    marked = _mark_steps(axes, steps, origin, scale)
    axes.set_xlim(0, (end - origin) * 1.02 * scale)
    _rank_ticks(axes, rows)
    axes.invert_yaxis()
    axes.set_xlabel(f"time ({unit}) from the start of the first step shown", fontsize=TEXT)
    axes.tick_params(labelsize=TEXT)
    axes.set_title(title, fontsize=TEXT)
    axes.grid(True, axis="x", alpha=0.3)
    _legend(figure, kinds, marked, calls)
    return figure


def _mark_steps(axes: Any, steps: dict[int, float], origin: float, scale: float) -> bool:
    """A dashed line where each step shown starts, its number on top; False if there are none."""
    boundaries = sorted((t, step) for step, t in steps.items() if t >= origin)
    for start, _ in boundaries:
        axes.axvline((start - origin) * scale, color="black", linestyle="--", linewidth=1.0)
    if boundaries:  # the steps' numbers along the top, at most 10 of them
        every = -(-len(boundaries) // 10)
        top = axes.secondary_xaxis("top")
        top.set_xticks([(t - origin) * scale for t, _ in boundaries[::every]],
                       [f"step {step}" for _, step in boundaries[::every]])  # fmt: skip
        top.tick_params(labelsize=TEXT)
    return bool(boundaries)


def _legend(figure: Any, kinds: dict[str, str], steps: bool, calls: bool) -> None:
    """A legend entry for every mark the chart uses: the colours, the steps' lines, the calls."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    order = list(COLOURS)  # compute, update, then the collectives' phases, the rest after
    ranked = sorted(kinds.items(), key=lambda item: order.index(item[0]) if item[0] in order
                    else len(order))  # fmt: skip
    handles: list[Any] = [Patch(facecolor=colour, label=kind) for kind, colour in ranked]
    if steps:
        handles.append(Line2D([], [], color="black", linestyle="--",
                              label="a step starts\n(on its first rank)"))  # fmt: skip
    if calls:
        handles.append(Patch(facecolor="none", edgecolor="black", label="one traced call"))
    if handles:
        figure.legend(handles=handles, loc="outside right upper", fontsize=TEXT, frameon=False)


def _rank_ticks(axes: Any, rows: dict[int, int]) -> None:
    """A label per row, or per few rows where 14-point labels would touch."""
    every = max(1, -(-len(rows) // 18))  # at most 18 labels down the slide
    shown = [(row, _row_label(tid)) for tid, row in rows.items() if row % every == 0]
    axes.set_yticks([row for row, _ in shown], [label for _, label in shown])


def _step_starts(spans: list[dict]) -> dict[int, float]:
    """When each training step started on its first rank (µs), by step number."""
    starts: dict[int, float] = {}
    for e in spans:
        if e.get("cat") == "compute" and "step" in e.get("args", {}):
            step = int(e["args"]["step"])
            starts[step] = min(starts.get(step, math.inf), float(e["ts"]))
    return starts


def _rows(events: list[dict]) -> dict[int, int]:
    """Each tid's row from the top: every rank's own row, its communication row under it."""
    tids = sorted({int(e["tid"]) for e in events if "tid" in e},
                  key=lambda tid: (tid % COMM_ROW, tid >= COMM_ROW))  # fmt: skip
    return {tid: row for row, tid in enumerate(tids)}


def _row_label(tid: int) -> str:
    """"rank r", or "rank r comm" for its communication row."""
    return f"rank {tid}" if tid < COMM_ROW else f"rank {tid - COMM_ROW} comm"


def _steady_start(spans: list[dict]) -> float | None:
    """When the second training step started (µs), or None for a trace of fewer steps."""
    steps = sorted({e["args"]["step"] for e in spans
                    if e.get("cat") == "compute" and "step" in e.get("args", {})})  # fmt: skip
    if len(steps) < 2:
        return None
    return min(e["ts"] for e in spans
               if e.get("cat") == "compute" and e["args"].get("step") == steps[1])  # fmt: skip


def _shown(spans: list[dict], origin: float | None) -> list[dict]:
    """The spans the chart draws: on each rank's rows, those from the start of that rank's own
    second step on (the untimed first step of a slower rank may end after another rank's second
    step began); every span of a trace without steps."""
    if origin is None:
        return spans
    second = min(e["args"]["step"] for e in spans if e.get("cat") == "compute"
                 and "step" in e.get("args", {}) and e["ts"] >= origin)  # fmt: skip
    starts: dict[int, float] = {}  # by rank: when its second step began
    for e in spans:
        if e.get("cat") == "compute" and e.get("args", {}).get("step") == second:
            rank = int(e["tid"]) % COMM_ROW
            starts[rank] = min(starts.get(rank, math.inf), float(e["ts"]))
    return [e for e in spans if e["ts"] >= starts.get(int(e["tid"]) % COMM_ROW, origin)]


def _window(spans: list[dict]) -> tuple[list[dict], int]:
    """The spans of the first SHOWN_STEPS steps among `spans` (a bar per span stays wide enough
    to see on a slide), and the last step shown; all of them for a trace without steps."""
    steps = sorted({int(e["args"]["step"]) for e in spans
                    if e.get("cat") == "compute" and "step" in e.get("args", {})})  # fmt: skip
    if len(steps) <= SHOWN_STEPS:
        return spans, steps[-1] if steps else 0
    beyond = steps[SHOWN_STEPS]
    ends: dict[int, float] = {}  # by rank: when its first step beyond the window began
    for e in spans:
        if e.get("cat") == "compute" and e.get("args", {}).get("step") == beyond:
            rank = int(e["tid"]) % COMM_ROW
            ends[rank] = min(ends.get(rank, math.inf), float(e["ts"]))
    return ([e for e in spans if e["ts"] < ends.get(int(e["tid"]) % COMM_ROW, math.inf)],
            steps[SHOWN_STEPS - 1])  # fmt: skip


def draw_gantt_file(trace_path: str, path: str, title: str = "timeline") -> None:
    """Draw the Chrome trace written to `trace_path` as a Gantt chart at `path`."""
    with open(trace_path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    draw_gantt(events, path, title)
