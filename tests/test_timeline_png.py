"""`--timeline-png` on train and bench allreduce: a Gantt chart per rank, beside the trace."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_in_process

from syncsgd.training import timeline

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.timeout(240)

PNG = b"\x89PNG\r\n\x1a\n"


def syncsgd(*args: str, cwd) -> subprocess.CompletedProcess:
    """`syncsgd args` by its main in this process, in `cwd` (tests/test_tutorial.py runs train
    and bench allreduce in fresh ones)."""
    return run_in_process(list(args), cwd)


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


def where_collectives_lie(events: list[dict], step: int) -> dict[tuple[str, str], int]:
    """Rank 0's collective steps of training step `step`, counted by where they lie (in the
    compute span, between compute and update, in the update span) and by phase."""
    mine = [e for e in events if e.get("ph") == "X" and e["tid"] == 0]
    (compute,) = [e for e in mine if e["cat"] == "compute" and e["args"]["step"] == step]
    (update,) = [e for e in mine if e["cat"] == "update" and e["args"]["step"] == step]
    regions = {"compute": (compute["ts"], compute["ts"] + compute["dur"]),
               "between": (compute["ts"] + compute["dur"], update["ts"]),
               "update": (update["ts"], update["ts"] + update["dur"])}  # fmt: skip
    found: dict[tuple[str, str], int] = {}
    for e in mine:
        if e["cat"] != "allreduce":
            continue
        for region, (low, high) in regions.items():
            if low <= e["ts"] and e["ts"] + e["dur"] <= high:
                key = (region, timeline._kind(e))
                found[key] = found.get(key, 0) + 1
    return found


def test_the_sharded_steps_collectives_lie_where_each_stage_runs_them(tmp_path):
    # 3 dense layers, a bucket each (--bucket-bytes 0), on 2 ranks: every collective of a bucket
    # takes one step. Stage 0 allreduces each bucket after the passes; stages 1-3 reduce-scatter
    # (2, 3: the last two buckets as the backward pass writes them), agree in one small allreduce
    # (one reduce-scatter and one allgather step) in the update, and allgather the 3 buckets'
    # parameters there (1, 2) or before each layer's passes (3: forward 3, backward 2; the last
    # layer's bucket is still in its buffer).
    from syncsgd import train

    mlp = dict(samples=40, features=5, hidden=(6, 4), classes=3, steps=2, seed=4, batch_size=8)
    expected = {
        0: {("between", "reduce-scatter"): 3, ("between", "allgather"): 3},
        1: {("between", "reduce-scatter"): 3, ("update", "reduce-scatter"): 1,
            ("update", "allgather"): 1 + 3},
        2: {("compute", "reduce-scatter"): 2, ("between", "reduce-scatter"): 1,
            ("update", "reduce-scatter"): 1, ("update", "allgather"): 1 + 3},
        3: {("compute", "allgather"): 3 + 2, ("compute", "reduce-scatter"): 2,
            ("between", "reduce-scatter"): 1, ("update", "reduce-scatter"): 1,
            ("update", "allgather"): 1},
    }  # fmt: skip
    for stage, where in expected.items():
        trace = tmp_path / f"stage{stage}.json"
        train(ranks=2, backend="threads", zero_stage=stage, bucket_bytes=0, timeline=str(trace),
              **mlp)  # fmt: skip
        events = json.loads(trace.read_text())["traceEvents"]
        assert where_collectives_lie(events, 1) == where, stage
    # On the chart the collectives' steps are drawn over the spans they lie in, and named.
    figure = timeline.gantt_figure(events, "t")
    (axes,) = [a for a in figure.axes if a.get_xlabel()]
    colours = {kind: matplotlib_rgba(colour) for kind, colour in timeline.COLOURS.items()}
    order = {kind: c.get_zorder() for c in axes.collections for kind, rgba in colours.items()
             if len(c.get_facecolor()) and tuple(c.get_facecolor()[0]) == rgba}  # fmt: skip
    assert order["compute"] < order["allgather"] and order["update"] < order["reduce-scatter"]
    labels = [t.get_text() for legend in figure.legends for t in legend.get_texts()]
    assert labels[:4] == ["compute", "update", "reduce-scatter", "allgather"]


def matplotlib_rgba(colour: str) -> tuple[float, ...]:
    from matplotlib.colors import to_rgba

    return tuple(to_rgba(colour))
