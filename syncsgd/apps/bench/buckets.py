"""`bench step --bucket-bytes LIST`: the overlapped step at several bucket sizes, measured in
interleaved rounds, beside what the bucket model (`syncsgd.apps.costmodel_buckets`) predicts from
this run's own compute, update and ring allreduce times.

Per P > 1 the rounds run the plain step (one bucket, no overlap) and the overlapped step at each
size, in an order rotated by one each round; medians over the rounds of the slowest rank's steady
per-step times. The prediction takes the plain step's compute (split into forward and backward by
the layers' multiply-adds) and update, and an allreduce of b bytes as a + s·b: a timed on the
same ranks at one element, s from the plain step's allreduce of the whole buffer (a + s·n);
docs/overlap.md derives it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from syncsgd.apps.costmodel_buckets import (
    RingLine,
    optimal_bucket_bytes,
    queued_step,
    ready_seconds,
)
from syncsgd.training.run import Run, prepare
from syncsgd.training.step import MIN_RIDER_SLOTS, bucket_slices

RING_BATCHES, RING_CALLS = 9, 20  # timing of the ring line: medians of batches of calls
ONE = "one"  # --bucket-bytes: one bucket for the whole gradient


def bucket_list(text: str) -> list[int | None]:
    """'0,16K,1M,one' -> [0, 16384, 1048576, None]: 0 one per layer, 'one' a single bucket."""
    from syncsgd.apps.bench.allreduce import parse_bytes

    sizes: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part.lower() == ONE:
            sizes.append(None)
        elif part == "0":
            sizes.append(0)
        else:
            sizes.append(parse_bytes(part))
    if not sizes or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(
            f"bucket sizes must be distinct sizes in bytes, 0 (one per layer) or 'one': {text!r}")
    return sizes


def shown(bucket_bytes: int | None) -> str:
    """A bucket size as the table shows it."""
    if bucket_bytes is None:
        return ONE
    return "per layer" if bucket_bytes == 0 else f"{bucket_bytes:,} B"


def ring_latency(comm: Any, algorithm: str, dtype: Any) -> float:
    """Seconds of one allreduce of one element on these ranks: the a of a + s·b (the slowest
    rank's median over batches of calls)."""
    from syncsgd.collectives import allreduce
    from syncsgd.comm.world import constants

    buffer = np.zeros(1, dtype)
    allreduce(buffer, comm, algorithm)  # warm
    batches = []
    for _ in range(RING_BATCHES):
        comm.Barrier()
        started = time.perf_counter()
        for _ in range(RING_CALLS):
            allreduce(buffer, comm, algorithm)
        batches.append((time.perf_counter() - started) / RING_CALLS)
    slowest = np.array([statistics.median(batches)])
    comm.Allreduce(constants(comm).IN_PLACE, slowest, op=constants(comm).MAX)
    return float(slowest[0])


def sweep(comm: Any, options: argparse.Namespace, plain: Run, runs: list[Run],
          per_step_seconds: Callable[[Any, Run], list[float]]) -> dict:  # fmt: skip
    """Interleaved rounds of the plain step and the overlapped step at each bucket size; each
    run timed by `per_step_seconds` (compute, allreduce, update, step; the slowest rank's)."""
    from syncsgd.training.loop import train_rank

    everything = [plain, *runs]
    for run in everything:
        train_rank(comm, replace(run, steps=options.warmup), quiet=True)
    timed: list[list[list[float]]] = [[] for _ in everything]
    for round_ in range(options.repeats):
        for index in np.roll(np.arange(len(everything)), -round_):
            timed[int(index)].append(per_step_seconds(comm, everything[int(index)]))
    latency = ring_latency(comm, plain.config.algorithm, plain.model.dtype)
    return {"ranks": comm.Get_size(), "medians": [medians(t) for t in timed],
            "ring_latency_s": latency}  # fmt: skip


def medians(runs: list[list[float]]) -> dict[str, float]:
    """Median compute, allreduce, update and step seconds, and the step's range."""
    steps = [times[3] for times in runs]
    return {"compute_s": statistics.median(t[0] for t in runs),
            "allreduce_s": statistics.median(t[1] for t in runs),
            "update_s": statistics.median(t[2] for t in runs),
            "step_s": statistics.median(steps), "step_min_s": min(steps),
            "step_max_s": max(steps)}  # fmt: skip


def predicted_step(run: Run, compute: float, update: float, line: RingLine) -> float:
    """The bucket model's overlapped step for `run`'s buckets, from measured compute and update."""
    model = run.model
    forward_madds, backward_madds = model.step_multiply_adds()
    backward = compute * backward_madds / max(forward_madds + backward_madds, 1)
    buffer = np.empty(model.n_params + MIN_RIDER_SLOTS, model.dtype)
    slices = bucket_slices(model, buffer, run.config.bucket_bytes)
    comms = [line.seconds((piece.stop - piece.start) * buffer.itemsize) for piece in slices]
    ready = ready_seconds(model, slices, backward)
    return queued_step(compute - backward, backward, comms, ready, update)


def sweep_rows(result: dict, plain: Run, runs: list[Run]) -> dict:
    """The sweep's rows: measured beside predicted, and the derived bucket size."""
    # The plain step's one allreduce, as the step sees it (waits for the slowest rank included),
    # is a + s·n: s from it, a from the one-element allreduce.
    base = result["medians"][0]
    compute, update = base["compute_s"], base["update_s"]
    model = plain.model
    nbytes = (model.n_params + MIN_RIDER_SLOTS) * model.dtype.itemsize
    latency = result["ring_latency_s"]
    line = RingLine(latency, max(base["allreduce_s"] - latency, 0.0) / nbytes)
    rows = []
    for run, measured in zip(runs, result["medians"][1:], strict=True):
        predicted = predicted_step(run, compute, update, line)
        buffer = np.empty(model.n_params + MIN_RIDER_SLOTS, model.dtype)
        rows.append({"ranks": result["ranks"], "bucket_bytes": run.config.bucket_bytes,
                     "buckets": len(bucket_slices(model, buffer, run.config.bucket_bytes)),
                     **{key: value * 1e3 for key, value in _ms(measured).items()},
                     "predicted_step_ms": predicted * 1e3,
                     "predicted_over_measured": predicted / measured["step_s"]})  # fmt: skip
    forward_madds, backward_madds = model.step_multiply_adds()
    backward = compute * backward_madds / max(forward_madds + backward_madds, 1)
    derived = optimal_bucket_bytes(model.n_params * model.dtype.itemsize, backward, line)
    return {"ranks": result["ranks"], "buffer_bytes": nbytes,
            "plain": {k: v * 1e3 for k, v in _ms(base).items()},
            "ring_latency_us": line.latency * 1e6, "ring_per_byte_ns": line.per_byte * 1e9,
            "derived_bucket_bytes": round(derived), "rows": rows}  # fmt: skip


def _ms(times: dict[str, float]) -> dict[str, float]:
    """'step_s' -> 'step_ms' (the values still in seconds)."""
    return {key.removesuffix("_s") + "_ms": value for key, value in times.items()}


HEADER = (f"{'P':>3} {'--bucket-bytes':>16} {'buckets':>7} {'step':>9} {'min':>9} {'max':>9} "
          f"{'ovl wait':>9} {'predicted':>9} {'pred/meas':>9}")  # fmt: skip


def describe(section: dict) -> list[str]:
    """The sweep's table for one P, the plain step and the derived bucket size."""
    p, plain = section["ranks"], section["plain"]
    lines = [f"# P = {p}: plain step (one bucket, no overlap) {plain['step_ms']:.3f} ms: compute "
             f"{plain['compute_ms']:.3f}, allreduce {plain['allreduce_ms']:.3f}, update "
             f"{plain['update_ms']:.3f}; ring a + s·b with a = {section['ring_latency_us']:.1f} "
             f"µs, s = {section['ring_per_byte_ns']:.3f} ns/B; derived b* = "
             f"{section['derived_bucket_bytes']:,} B", HEADER]  # fmt: skip
    for row in section["rows"]:
        lines.append(f"{p:>3} {shown(row['bucket_bytes']):>16} {row['buckets']:>7} "
                     f"{row['step_ms']:>9.3f} "
                     f"{row['step_min_ms']:>9.3f} {row['step_max_ms']:>9.3f} "
                     f"{row['allreduce_ms']:>9.3f} {row['predicted_step_ms']:>9.3f} "
                     f"{row['predicted_over_measured']:>9.3f}")  # fmt: skip
    return lines


def bucket_section(options: argparse.Namespace, call: Callable, rank_counts: list[int],
                   say: Callable, config_at: Callable[[int], Any],
                   per_step_seconds: Callable) -> list[dict]:  # fmt: skip
    """Per P > 1: the sweep over --bucket-bytes, measured and predicted."""
    sizes = options.bucket_bytes
    if len(sizes) < 2:
        return []
    say(f"# --bucket-bytes sweep of the --overlap step (weak scaling, {options.per_rank_batch} "
        f"per rank): ms per step, medians of {options.repeats} interleaved rounds (each the "
        "plain step and every size, rotated); 'ovl wait': the allreduce left exposed; "
        "predicted: the bucket model (docs/overlap.md) from this run's compute, update and "
        "allreduce", flush=True)  # fmt: skip
    sections = []
    for ranks in rank_counts:
        if ranks < 2:
            say(f"# P = {ranks}: skipped, nothing to overlap on one rank")
            continue
        config = config_at(ranks)
        plain = prepare(replace(config, bucket_bytes=None, overlap=False))
        runs = [replace(plain, config=replace(plain.config, bucket_bytes=size, overlap=True))
                for size in sizes]  # fmt: skip
        measured = call(sweep, ranks, plain, runs, per_step_seconds)
        sections.append(sweep_rows(measured, plain, runs))
        for line in describe(sections[-1]):
            say(line, flush=True)
    return sections


def sweep_figure(sections: list[dict], title: str) -> Any:
    """The slide: each P's measured step (median, min-max bar) and the model's prediction at each
    --bucket-bytes in the order given, the plain step as a line; the legend names b*."""
    from syncsgd.util import figures

    figure = figures.new_figure(layout="constrained")
    axes = figure.subplots()
    for index, section in enumerate(sections):
        colour = figures.LINE_COLOURS[index % len(figures.LINE_COLOURS)]
        rows, p = section["rows"], section["ranks"]
        places = list(range(len(rows)))
        steps = [row["step_ms"] for row in rows]
        low = [step - row["step_min_ms"] for step, row in zip(steps, rows, strict=True)]
        high = [row["step_max_ms"] - step for step, row in zip(steps, rows, strict=True)]
        axes.errorbar(places, steps, yerr=[low, high], color=colour, marker="o", markersize=9,
                      linestyle="-", linewidth=2.2, capsize=5,
                      label=f"P = {p}: measured (median, min-max)")  # fmt: skip
        axes.plot(places, [row["predicted_step_ms"] for row in rows], color=colour, marker="s",
                  markersize=9, markerfacecolor="white", linestyle="--", linewidth=2.2,
                  label=f"P = {p}: predicted; derived b* = {section['derived_bucket_bytes']:,} B")
        axes.axhline(section["plain"]["step_ms"], color=colour, linestyle=":", linewidth=2,
                     label=f"P = {p}: plain step (one bucket, no overlap)")  # fmt: skip
    rows = sections[0]["rows"] if sections else []
    axes.set_xticks(range(len(rows)), [
        f"{shown(row['bucket_bytes'])}\n{row['buckets']} bucket{'s' * (row['buckets'] != 1)}"
        for row in rows])  # fmt: skip
    axes.set(xlabel="--bucket-bytes (and the buckets it makes)", ylabel="time per step (ms)")
    axes.set_ylim(bottom=0)
    axes.margins(x=0.08)
    handles, labels = axes.get_legend_handles_labels()
    by_rank = sorted(zip(labels, handles, strict=True), key=lambda pair: pair[0])  # P's together
    labels, handles = [label for label, _ in by_rank], [handle for _, handle in by_rank]
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(sections), 3) or 1,
                  fontsize=figures.TEXT_POINTS - 2, frameon=False)  # fmt: skip
    figures.slide_axes(axes)
    figure.suptitle(title, fontsize=figures.TEXT_POINTS + 2)
    return figure


def draw_png(sections: list[dict], path: str, title: str) -> None:
    """The sweep's slide, written to `path` (.png, .svg or .pdf)."""
    from syncsgd.util import figures

    figures.save(sweep_figure(sections, title), path)
