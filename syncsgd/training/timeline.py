"""Timelines: what every rank did when, as a Chrome trace (open in chrome://tracing or Perfetto).

One row per rank; spans for compute, for every step of every allreduce (from the collectives'
`trace` events) and for the update. With --overlap, a second row per rank holds what its
communication thread did: the allreduce steps inside the compute spans of the backward pass.
Each rank records its own spans against its own clock, started right after a barrier, so the rows
line up to within the barrier's skew; rank 0 gathers them with point-to-point messages and writes
one JSON file.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np

from syncsgd.collectives import TraceEvent
from syncsgd.util import jsonout

_TAG = 4321
COMM_ROW = 1 << 20  # a rank's communication row: tid COMM_ROW + rank, drawn below its own row


class Timeline:
    """The spans of one rank: (name, category, start, end, args), times in seconds."""

    def __init__(self, comm: Any) -> None:
        comm.Barrier()  # a common origin for every rank's clock
        self.origin = time.perf_counter()
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

COLOURS = {  # by category, then by the phase of an allreduce step
    "compute": "#4c72b0", "update": "#55a868", "reduce-scatter": "#dd8452", "allgather": "#8172b3",
    "exchange": "#c44e52", "reduce": "#ccb974", "broadcast": "#64b5cd", "fold": "#937860",
    "unfold": "#937860",
}  # fmt: skip
OTHER = "#8c8c8c"


def _kind(event: dict) -> str:
    """What a span is drawn as: compute, update, or the phase of an allreduce step."""
    if event.get("cat") == "allreduce":
        return str(event["name"]).rsplit(" ", 1)[0]
    return str(event.get("cat", "other"))


def draw_gantt(events: list[dict], path: str, title: str = "timeline") -> None:
    """Chrome trace events as one bar row per rank, coloured by what the rank did, as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError("--timeline-png needs matplotlib: pip install 'syncsgd[plot]'") from None
    from syncsgd.util.files import atomic_path

    spans = [e for e in events if e.get("ph") == "X"]
    rows = _rows(events)
    figure = Figure(figsize=(12, 1.2 + 0.45 * max(len(rows), 1)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    unit, scale = ("ms", 1e-3) if not spans or max(e["ts"] + e["dur"] for e in spans) < 2e6 else (
        "s", 1e-6)  # fmt: skip
    kinds: dict[str, str] = {}
    for event in spans:
        kind = _kind(event)
        colour = COLOURS.get(kind, OTHER)
        if event.get("cat") == "call":  # a whole traced call (bench): an outline around its steps
            axes.broken_barh([(event["ts"] * scale, event["dur"] * scale)],
                             (rows[event["tid"]] - 0.45, 0.9), facecolors="none",
                             edgecolors="black", linewidth=0.6)  # fmt: skip
            continue
        kinds.setdefault(kind, colour)
        axes.broken_barh([(event["ts"] * scale, max(event["dur"] * scale, 0))],
                         (rows[event["tid"]] - 0.35, 0.7), facecolors=colour)  # fmt: skip
    start = _steady_start(spans)
    if start is not None:  # the first step loads the kernels: it would squeeze the rest to a line
        first = start - min(e["ts"] for e in spans)
        end = max(e["ts"] + e["dur"] for e in spans)
        axes.set_xlim(start * scale, (end + 0.02 * (end - start)) * scale)
        title += f" (from the second step; the first, start-up included, took {first / 1e6:.2f} s)"
    axes.set_yticks(list(rows.values()), [_row_label(tid) for tid in rows])
    axes.invert_yaxis()
    axes.set_xlabel(f"time ({unit}) from the common start")
    axes.set_title(title)
    axes.grid(True, axis="x", alpha=0.3)
    handles = [Patch(facecolor=colour, label=kind) for kind, colour in kinds.items()]
    if handles:
        axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120)


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


def draw_gantt_file(trace_path: str, path: str, title: str = "timeline") -> None:
    """Draw the Chrome trace written to `trace_path` as a Gantt chart PNG at `path`."""
    with open(trace_path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    draw_gantt(events, path, title)
