"""`--timeline-png` on train and bench allreduce: a Gantt chart per rank, beside the trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from syncsgd.training import timeline

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.timeout(240)

PNG = b"\x89PNG\r\n\x1a\n"


def syncsgd(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "syncsgd.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=cwd,
                          env={**os.environ, "MPLBACKEND": "Agg"})  # fmt: skip


def test_train_draws_the_gantt_chart_with_or_without_the_trace(tmp_path):
    done = syncsgd("train", "--ranks", "3", "--steps", "4", "--timeline-png", "gantt.png",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gantt.png").read_bytes()[:8] == PNG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt.png"]  # no trace left behind
    done = syncsgd("train", "--ranks", "2", "--steps", "3", "--timeline", "trace.json",
                   "--timeline-png", "both.png", "--quiet", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_bench_allreduce_draws_its_traced_calls(tmp_path):
    done = syncsgd("bench", "allreduce", "--ranks", "3", "--max-bytes", "64", "--batches", "1",
                   "--warmup", "1", "--algorithms", "ring,tree", "--timeline-png", "calls.png",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "calls.png").read_bytes()[:8] == PNG


def span(name: str, category: str, rank: int, start: float, length: float, **args) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": 0, "tid": rank, "ts": start,
            "dur": length, "args": args}  # fmt: skip


def test_the_chart_starts_at_the_second_step(tmp_path):
    # A first step of 0.5 s and two of 2 ms: the chart shows the steady state and says so.
    events = [span("compute", "compute", 0, 0, 500_000, step=0),
              span("compute", "compute", 0, 500_000, 1_000, step=1),
              span("reduce-scatter 0", "allreduce", 0, 501_000, 500),
              span("allgather 0", "allreduce", 0, 501_500, 500),
              span("compute", "compute", 0, 502_000, 2_000, step=2)]  # fmt: skip
    assert timeline._steady_start(events) == 500_000
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    timeline.draw_gantt_file(str(trace), str(tmp_path / "g.png"), "t")
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG
    assert timeline._steady_start(events[:1]) is None  # one step: nothing to leave out


def test_the_untimed_first_step_of_a_slower_rank_is_left_out():
    # Rank 1's first step (its update) ends after rank 0's second step began: it is still the
    # untimed first step, and no bar of it may reach into the chart from the left.
    events = [span("compute", "compute", 0, 0, 400_000, step=0),
              span("update", "update", 0, 400_000, 1_000, step=0),
              span("compute", "compute", 0, 401_000, 1_000, step=1),
              span("update", "update", 0, 402_000, 500, step=1),
              span("compute", "compute", 1, 0, 380_000, step=0),
              span("reduce-scatter 0", "allreduce", 1, 380_000, 10_000),
              span("update", "update", 1, 390_000, 12_000, step=0),
              span("compute", "compute", 1, 402_000, 1_000, step=1),
              span("update", "update", 1, 403_000, 500, step=1)]  # fmt: skip
    shown = timeline._shown(events, timeline._steady_start(events))
    assert all(e["args"].get("step", 1) == 1 for e in shown) and len(shown) == 4
    figure = timeline.gantt_figure(events, "t")
    (axes,) = [a for a in figure.axes if a.get_xlabel()]
    starts = [path.vertices[:, 0].min() for c in axes.collections for path in c.get_paths()]
    assert starts and min(starts) >= 0  # nothing begins before the first step shown
    assert timeline._shown(events[:1], None) == events[:1]


def test_thread_ranks_share_one_origin(monkeypatch):
    # Threads leave the barrier at different times on a busy machine (here: rank r reads the clock
    # r * 20 ms late); their rows must still line up.
    import threading
    import time

    from syncsgd.comm.threads import run_threads

    late: dict[int, float] = {}

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + late.get(threading.get_ident(), 0.0)

    monkeypatch.setattr(timeline, "time", Clock)

    def origin(comm):
        late[threading.get_ident()] = 0.02 * comm.Get_rank()
        return timeline.Timeline(comm).origin

    origins = run_threads(3, origin)
    assert origins[0] == origins[1] == origins[2]
