"""Timelines: what every rank did when, as a Chrome trace (open in chrome://tracing or Perfetto).

One row per rank; spans for compute, for every step of every allreduce (from the collectives'
`trace` events) and for the update. Each rank records its own spans against its own clock, started
right after a barrier, so the rows line up to within the barrier's skew; rank 0 gathers them with
point-to-point messages and writes one JSON file.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from syncsgd.collectives import TraceEvent
from syncsgd.util.files import write_text

_TAG = 4321


class Timeline:
    """The spans of one rank: (name, category, start, end, args), times in seconds."""

    def __init__(self, comm: Any) -> None:
        comm.Barrier()  # a common origin for every rank's clock
        self.origin = time.perf_counter()
        self.rank = comm.Get_rank()
        self.spans: list[tuple[str, str, float, float, dict]] = []

    def span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record that this rank did `name` from `start` to `end` (time.perf_counter() values)."""
        self.spans.append((name, category, start - self.origin, end - self.origin, args))

    def collective_step(self, event: TraceEvent) -> None:
        """A collective's `trace` callback: one span per step."""
        self.span(
            f"{event.phase} {event.step}", "allreduce", event.start, event.end,
            send_chunk=event.send_chunk, recv_chunk=event.recv_chunk, bytes=event.nbytes,
        )  # fmt: skip

    def chrome_events(self) -> list[dict]:
        """This rank's spans as Chrome trace 'complete' events (microseconds)."""
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": self.rank,
                   "args": {"name": f"rank {self.rank}"}}]  # fmt: skip
        for name, category, start, end, args in self.spans:
            events.append({"name": name, "cat": category, "ph": "X", "pid": 0,
                           "tid": self.rank, "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "args": args})  # fmt: skip
        return events


def write(comm: Any, timeline: Timeline, path: str) -> None:
    """Gather every rank's spans on rank 0 and write them to `path` (a collective call)."""
    payload = np.frombuffer(json.dumps(timeline.chrome_events()).encode(), np.uint8)
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
    write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
