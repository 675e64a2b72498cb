"""Training-step benchmark: compute, allreduce and update time of one SGD step, P = 1..N ranks.

    syncsgd bench step                              # threads, P = 1,2,3,4, weak and strong scaling
    python benchmarks/step.py --ranks 1,2 --json step.json --csv step.csv
    mpiexec -n 2 python benchmarks/step.py          # MPI: P is the world size

Method: for every scaling mode and P, `train_rank` (the real training loop, `quiet=True`) first runs
`--warmup` burn-in steps, then `--repeats` runs of `--steps` steps each. `train_rank` times every
step's compute (global batch, shard gather, the network's passes), allreduce and update; a run's
per-step times are the slowest rank's over the steps after the run's first (the steady state:
the first pays the first touch of fresh buffers), and the median over runs is quoted. Weak scaling
fixes the per-rank batch (global batch = P x per-rank), strong scaling fixes the global batch. The
very first step of the process, which compiles the kernels or loads them from Numba's cache, is
reported apart. The burn-in of each (scaling, P) also measures the memory per rank, as
`train --json` does (training/memory.py: on an untimed copy of the step, before the burn-in's own
steps), never inside the timed runs.

Overhead check (P = 1): `train_rank`'s step against a bare loop calling the same passes directly,
without ranks (gather the batch, `syncsgd.nn.local.local_gradient(...)(...)`, `grad /= B`, plain
SGD in NumPy), the two interleaved run by run (ABBA) and checked to end with bitwise the same
parameters; the bar is 5%. Last, the wall time of `syncsgd --help` and of
`syncsgd train --ranks 4` (warm JIT cache) in subprocesses. Nothing is asserted: the machines are
shared and noisy, so repeat a run before believing a difference (the load average is printed).
OpenBLAS's own threads make the kernels' time swing on a busy machine (docs/measurements.md);
`OPENBLAS_NUM_THREADS=1 syncsgd bench step` gives steadier figures.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from syncsgd.apps.bench.buckets import bucket_list, bucket_section, draw_png
from syncsgd.comm.threads import run_threads
from syncsgd.comm.watchdog import within_timeout
from syncsgd.comm.world import constants, launched_by_mpi, mpi_world, resolve_backend
from syncsgd.training import data
from syncsgd.training.config import TrainConfig, add_train_options, config_of
from syncsgd.training.loop import train_rank
from syncsgd.training.run import Run, prepare
from syncsgd.util import jsonout
from syncsgd.util.argtypes import (
    comma_separated,
    nonnegative_int,
    positive_int,
    rank_list,
)
from syncsgd.util.figures import figure_path
from syncsgd.util.files import check_writable, write_text
from syncsgd.util.options import BACKEND, JSON, RANK_COUNTS, Change, options_of, writes

DEFAULT_RANKS = (1, 2, 3, 4)
SYNTHETIC = "synthetic-classification"
SCALINGS = ("weak", "strong")
OVERHEAD_BAR = 0.05  # the distributed machinery may add at most 5% at P = 1
# --overlap: at most 0.8x the plain step where communication waits on a network, and at most
# 1.15x max(compute, communication); at most 5% more where there is nothing to hide.
OVERLAP_GAIN_BAR, OVERLAP_BOUND_BAR, OVERLAP_COST_BAR = 0.8, 1.15, 1.05
HELP_BAR_S, TRAIN_BAR_S = 0.5, 10.0  # `syncsgd --help` and `syncsgd train --ranks 4` wall times
PARTS = ("compute", "allreduce", "update", "step")
PIECE_BATCHES, PIECE_CALLS = 9, 100  # timing of the pieces of the step that the bare loop lacks


def scaling_list(text: str) -> list[str]:
    """'weak,strong' -> ['weak', 'strong']."""
    values = comma_separated(text)
    unknown = [value for value in values if value not in SCALINGS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"scaling must be weak, strong or weak,strong: {text!r}")
    return values


def train_config(options: argparse.Namespace, batch_size: int) -> TrainConfig:
    """The benchmark's training run (train's options as given) at one global batch size."""
    # With --model, the spec is the whole network: --hidden and --activation do not apply.
    network = ("hidden", "activation") if options.model else ()
    # token data: the outputs are the vocabulary, and the benchmark's --classes default is no
    # choice of the user's (train refuses a --classes given on token data)
    untaken = data.is_text(options.data) and options.classes == CHANGES["classes"]["default"]
    return config_of(options, exclude={*NOT_TAKEN, *network}, batch_size=batch_size,
                     **({"classes": None} if untaken else {}))  # fmt: skip


# The train options that the overhead check's bare loop follows (plain SGD, as train_rank at
# P = 1; BatchNorm is checked apart); any other one away from train's default skips the check.
BARE_LOOP_FOLLOWS = {"data", "labels", "samples", "context", "features", "classes", "hidden",
                     "model", "input_shape", "activation", "batch_size", "steps", "lr", "seed",
                     "shuffle", "dtype", "timeout", "algorithm", "batchnorm"}  # fmt: skip


def unlike_bare_loop(config: TrainConfig) -> list[str]:
    """The flags of the train options, given away from their defaults, that the bare loop of
    the overhead check does not follow (e.g. --optimizer adam, --momentum 0.9)."""
    return [declared.flag for name, declared in options_of(type(config))
            if name not in BARE_LOOP_FOLLOWS
            and getattr(config, name) != getattr(type(config), name)]  # fmt: skip


def has_batchnorm(options: argparse.Namespace) -> bool:
    """Whether the --model spec has batchnorm layers."""
    from syncsgd.nn.network import parse_spec

    return bool(options.model) and any(t.kind == "batchnorm" for t in parse_spec(options.model))


def network_name(options: argparse.Namespace) -> str:
    """The network as the header and the JSON name it: the --model spec or the MLP's sizes."""
    if options.model:
        return options.model
    return "-".join(map(str, (options.features, *options.hidden, options.classes)))


def global_batch_size(options: argparse.Namespace, scaling: str, ranks: int) -> int:
    """Weak scaling: P x the per-rank batch; strong scaling: the fixed global batch."""
    return ranks * options.per_rank_batch if scaling == "weak" else options.global_batch


def slowest(comm: Any, values: list[float]) -> list[float]:
    """Element-wise maximum of `values` over all ranks."""
    mpi = constants(comm)
    buffer = np.array(values, dtype=np.float64)
    comm.Allreduce(mpi.IN_PLACE, buffer, op=mpi.MAX)
    return buffer.tolist()


def per_step_seconds(comm: Any, run: Run) -> list[float]:
    """One run of `train_rank`: compute, allreduce, update and whole-step seconds per step."""
    return timed_run(comm, run)[: len(PARTS)]


def timed_run(comm: Any, run: Run) -> list[float]:
    """`per_step_seconds`, then the seconds in BatchNorm's allreduces per step, then the bytes a
    rank sends per step (the most over the ranks; nan for the library's own allreduce).

    The steady state: the steps after the run's first, which pays the first touch of the run's
    fresh buffers (and, first in a process, the kernels' loading: `first_step` reports that).
    """
    comm.Barrier()
    result = train_rank(comm, run, quiet=True)
    sent = result.bytes_sent_per_step  # the same every step (the slowest rank: the most sent)
    sent_per_step = math.nan if sent is None else float(sent)
    # BatchNorm's allreduces run inside the compute span: moved to the allreduce column.
    if result.steady_steps == 0:  # --steps 1: no steady state to take apart
        batchnorm = result.batchnorm_comm_seconds
        totals = [result.compute_seconds - batchnorm, result.comm_seconds + batchnorm,
                  result.update_seconds, result.seconds, batchnorm]  # fmt: skip
        return slowest(comm, [*(total / result.steps for total in totals), sent_per_step])
    batchnorm = result.steady_batchnorm_comm_seconds
    totals = [result.steady_compute_seconds - batchnorm, result.steady_comm_seconds + batchnorm,
              result.steady_update_seconds, result.steady_seconds, batchnorm]  # fmt: skip
    return slowest(comm, [*(total / result.steady_steps for total in totals), sent_per_step])


# --- phases, each run on every rank of a communicator -----------------------------------------


def step_kernels() -> list[Any]:
    """The Numba kernels a step may call: the numerics', the layers', the losses', the update's.

    Imports Numba and the kernels' modules (the import `first_step` times)."""
    from numba.core.dispatcher import Dispatcher

    from syncsgd.nn import backprop, kernels, numerics  # noqa: F401  (backprop: the passes)
    from syncsgd.nn.layers import (
        avgpool,
        batchnorm,
        block,
        conv,
        dense,
        embed,
        flatten,
        gelu,
        layernorm,
        maxpool,
        mse,
        relu,
        tanh,
        xent,
    )

    modules = (kernels, numerics, dense, relu, tanh, batchnorm, xent, mse, conv, maxpool,
               avgpool, flatten, embed, layernorm, gelu, block)  # fmt: skip
    return [value for module in modules for value in vars(module).values()
            if isinstance(value, Dispatcher)]  # fmt: skip


def cache_counts(dispatchers: list[Any]) -> tuple[int, int]:
    """(Numba cache hits, cache misses) summed over the dispatchers' signatures."""
    hits = sum(sum(kernel.stats.cache_hits.values()) for kernel in dispatchers)
    return hits, sum(sum(kernel.stats.cache_misses.values()) for kernel in dispatchers)


def first_step(comm: Any, options: argparse.Namespace, run: Run) -> dict:
    """Seconds of the process's first training step (kernel compile or cache load) and import."""
    started = time.perf_counter()
    dispatchers = step_kernels()  # imports Numba
    import_seconds = time.perf_counter() - started
    hits, misses = cache_counts(dispatchers)
    started = time.perf_counter()
    result = train_rank(comm, replace(run, steps=1), quiet=True)
    call_seconds = time.perf_counter() - started  # also evaluate()'s first call on rank 0
    hits_after, misses_after = cache_counts(dispatchers)
    if misses_after > misses:
        source = "JIT compile"
    elif hits_after > hits:
        source = "Numba cache load"
    else:
        source = "already loaded"
    import_s, step_s, call_s = slowest(comm, [import_seconds, result.seconds, call_seconds])
    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")  # train_rank may set it
    from syncsgd.nn.blas import describe  # after the first step: SciPy's OpenBLAS is loaded

    return {
        "import_s": import_s, "first_step_s": step_s, "first_call_s": call_s, "source": source,
        "blas_threads": blas_threads, "blas": describe(),
    }  # fmt: skip


def scaling_row(comm: Any, options: argparse.Namespace, scaling: str, run: Run) -> dict:
    """Burn in, then the median over `--repeats` runs of the slowest rank's per-step times."""
    size = comm.Get_size()
    # the burn-in also measures the memory per rank, on its own untimed copy of the step
    burn_in = train_rank(comm, replace(run, steps=options.warmup), quiet=True,
                         measure_memory=True)  # fmt: skip
    runs = [timed_run(comm, run) for _ in range(options.repeats)]
    medians = [statistics.median(times[part] for times in runs) for part in range(len(PARTS))]
    steps = [times[len(PARTS) - 1] for times in runs]
    batch = run.config.batch_size
    row = {"scaling": scaling, "ranks": size, "global_batch": batch, "shard": -(-batch // size)}
    row.update({f"{part}_ms": seconds * 1e3 for part, seconds in zip(PARTS, medians, strict=True)})
    row["batchnorm_allreduce_ms"] = statistics.median(times[len(PARTS)] for times in runs) * 1e3
    sent = runs[0][len(PARTS) + 1]
    row["bytes_sent_per_step"] = None if math.isnan(sent) else int(sent)
    row["step_min_ms"] = min(steps) * 1e3
    row["step_max_ms"] = max(steps) * 1e3
    row["samples_per_s"] = batch / medians[-1]
    row["steps"], row["repeats"] = run.steps, options.repeats
    row["memory_bytes"] = burn_in.memory_bytes
    return row


def bare_loop(run: Run) -> tuple[np.ndarray, list[float]]:
    """The same SGD steps with the passes called directly (`syncsgd.nn.local.local_gradient`, no
    ranks, no communication buffer): final parameters, per-step seconds.

    Like `train_rank`, it allocates its buffers before the loop, so both pay the first touch of
    fresh memory in their first step; like `per_step_seconds`, the times are those of the steps
    after the first. Returns (compute, 0, update, whole step) seconds per step.
    """
    from syncsgd.nn.local import local_gradient  # the passes, without the ranks

    config, model, X, y = run.config, run.model, run.X, run.y
    batch, n_samples, lr = config.batch_size, X.shape[0], config.lr
    per_epoch = n_samples // batch
    gradient = local_gradient(model, batch)
    terms = batch * gradient.passes.positions  # B, or B x T for sequences: as the step divides
    X_batch = np.empty((batch, X.shape[1]), X.dtype)
    y_batch = np.empty((batch, *y.shape[1:]), y.dtype)
    grad = np.zeros(model.n_params, model.dtype)
    scratch = np.empty(model.n_params, model.dtype)
    params = model.init_params(config.seed)
    order, order_epoch = np.empty(0, np.int64), -1
    compute = update = 0.0
    started = time.perf_counter()
    for step in range(run.steps):
        if step == 1 and run.steps > 1:  # the steady state starts with the second step
            compute = update = 0.0
            started = time.perf_counter()
        t0 = time.perf_counter()
        epoch, position = divmod(step, per_epoch)
        if epoch != order_epoch:  # one permutation per epoch, as the sample order defines it
            order = data.epoch_order(n_samples, epoch, config.seed, config.shuffle)
            order_epoch = epoch
        indices = order[position * batch : (position + 1) * batch]
        np.take(X, indices, axis=0, out=X_batch)
        np.take(y, indices, axis=0, out=y_batch)
        loss_sum, _ = gradient(params, X_batch, y_batch, grad)
        t1 = time.perf_counter()
        _loss = loss_sum / terms
        grad /= terms
        np.multiply(grad, lr, out=scratch)  # lr * grad rounded first, as the SGD step does
        params -= scratch
        t2 = time.perf_counter()
        compute += t1 - t0
        update += t2 - t1
    seconds = time.perf_counter() - started
    timed = max(run.steps - 1, 1)
    return params, [total / timed for total in (compute, 0.0, update, seconds)]


def _nothing(i: int) -> None:
    """The bare loop's counterpart of a line it does not need."""


def overhead(comm: Any, options: argparse.Namespace, run: Run) -> dict:
    """`train_rank` against the bare loop (the passes called directly) at P = 1, interleaved
    ABBA run by run."""
    if comm.Get_size() != 1:
        raise ValueError("the overhead check runs on one rank")
    trained = train_rank(comm, run, quiet=True)  # also the burn-in of both loops
    bare_params, _ = bare_loop(run)
    if not np.array_equal(trained.params, bare_params):
        raise RuntimeError("the bare loop does not reproduce train_rank's parameters bitwise")
    runs: dict[str, list[list[float]]] = {"train": [], "bare": []}
    for repeat in range(options.overhead_repeats):
        order = ("train", "bare") if repeat % 2 == 0 else ("bare", "train")
        for name in order:
            timed = per_step_seconds(comm, run) if name == "train" else bare_loop(run)[1]
            runs[name].append(timed)
    ratios = [t[-1] / b[-1] for t, b in zip(runs["train"], runs["bare"], strict=True)]
    row: dict[str, Any] = {"batch": run.config.batch_size, "steps": run.steps}
    for name, samples in runs.items():
        for index, part in enumerate(PARTS):
            row[f"{name}_{part}_ms"] = statistics.median(times[index] for times in samples) * 1e3
        row[f"{name}_step_min_ms"] = min(times[-1] for times in samples) * 1e3
    row["ratio"] = statistics.median(ratios)  # median of the paired (interleaved) ratios
    row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
    row["ratio_of_minima"] = row["train_step_min_ms"] / row["bare_step_min_ms"]
    row["overhead_pct"] = (row["ratio"] - 1) * 100
    row["within_bar"] = row["ratio"] <= 1 + OVERHEAD_BAR
    row["bitwise_equal"] = True
    row["pieces"] = machinery_pieces(comm, run, row["bare_step_min_ms"] / 1e3)
    return row


def machinery_pieces(comm: Any, run: Run, bare_step_seconds: float) -> list[dict]:
    """Each piece of the step that the bare loop does differently, timed on its own.

    The pieces mirror `syncsgd.training.step`: the batch indices, the allreduce (a no-op at
    P = 1), the division by B fused with the finiteness check, and the update (without the
    gradient norm, which a quiet run does not compute). Best of interleaved batches, in
    microseconds per call.
    """
    rows = []
    for name, (train_piece, bare_piece) in step_pieces(comm, run).items():
        best = {"train": np.inf, "bare": np.inf}
        for repeat in range(PIECE_BATCHES):
            for side in ("train", "bare") if repeat % 2 == 0 else ("bare", "train"):
                call = train_piece if side == "train" else bare_piece
                started = time.perf_counter()
                for i in range(PIECE_CALLS):
                    call(i)
                best[side] = min(best[side], (time.perf_counter() - started) / PIECE_CALLS)
        extra = best["train"] - best["bare"]
        rows.append({
            "piece": name, "train_us": best["train"] * 1e6, "bare_us": best["bare"] * 1e6,
            "extra_us": extra * 1e6, "extra_pct": 100 * extra / bare_step_seconds,
        })  # fmt: skip
    return rows


def step_pieces(comm: Any, run: Run) -> dict[str, tuple[Callable, Callable]]:
    """{piece: (as the step does it, as the bare loop does it)}, each a call of one argument."""
    from syncsgd.collectives import allreduce
    from syncsgd.nn.kernels import divide_finite_
    from syncsgd.nn.optim import make_optimizer

    config, model = run.config, run.model
    n_samples, batch, lr = run.X.shape[0], config.batch_size, config.lr
    per_epoch = n_samples // batch
    order = data.epoch_order(n_samples, 0, config.seed, config.shuffle)
    sample_order = data.SampleOrder(n_samples, batch, config.seed, config.shuffle)
    comm_buffer = np.zeros(model.n_params + 2, model.dtype)
    grad = comm_buffer[: model.n_params]
    grad[:] = np.random.default_rng(config.seed).normal(0, 1e-3, model.n_params)
    params = model.init_params(config.seed)
    scratch = np.empty_like(params)
    sgd = make_optimizer(config.optimizer, run.optim, model.n_params, model.dtype, config)
    one = grad.dtype.type(1)

    def bare_update(i: int) -> None:
        np.multiply(grad, lr, out=scratch)
        np.subtract(params, scratch, out=params)

    # Steady state inside one epoch (both sides permute once per epoch); / 1 leaves grad as is.
    return {
        "batch indices": (
            lambda i: data.contiguous_shard(sample_order.batch(i % per_epoch), 0, 1),
            lambda i: order[i % per_epoch * batch : (i % per_epoch + 1) * batch],
        ),
        "allreduce (P=1)": (lambda i: allreduce(comm_buffer, comm, config.algorithm), _nothing),
        "mean, finite check": (
            lambda i: math.isfinite(1.0) and divide_finite_(grad, one, grad),
            lambda i: np.divide(grad, 1, out=grad),
        ),
        "update": (lambda i: sgd.step_(params, grad, i, want_norm=False), bare_update),
    }


# --- the command-line timings ------------------------------------------------------------------


def syncsgd_command() -> list[str]:
    """The `syncsgd` console script next to this Python, else `python -m syncsgd.cli`."""
    script = os.path.join(os.path.dirname(sys.executable), "syncsgd")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "syncsgd.cli"]


def time_command(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of `runs` runs of `argv`; RuntimeError naming the command if one fails."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        finished = subprocess.run(argv, capture_output=True, text=True)
        seconds.append(time.perf_counter() - started)
        if finished.returncode != 0:
            last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{' '.join(argv)} exited with {finished.returncode}: {last}")
    return seconds


def cli_timings(runs: int) -> list[dict]:
    """Wall times of `syncsgd --help` and `syncsgd train --ranks 4`, each after a warm-up run."""
    command = syncsgd_command()
    rows: list[dict[str, Any]] = []
    for args, bar in ((["--help"], HELP_BAR_S), (["train", "--ranks", "4"], TRAIN_BAR_S)):
        try:
            time_command(command + args, 1)  # warm: Numba's on-disk cache, the OS's file cache
            seconds = time_command(command + args, runs)
        except RuntimeError as exc:
            rows.append({"command": " ".join(["syncsgd", *args]), "error": str(exc)})
            continue
        rows.append({
            "command": " ".join(["syncsgd", *args]), "median_s": statistics.median(seconds),
            "min_s": min(seconds), "max_s": max(seconds), "runs": runs, "bar_s": bar,
            "within_bar": statistics.median(seconds) < bar,
        })  # fmt: skip
    return rows


# --- output -------------------------------------------------------------------------------------

SCALING_HEADER = (
    f"{'scaling':>7} {'P':>3} {'batch':>6} {'shard':>6} {'compute':>9} {'allreduce':>9} "
    f"{'update':>9} {'step':>9} {'min':>8} {'max':>8} {'samples/s':>10} {'speedup':>8} "
    f"{'effic.':>7}"
)


def format_scaling(row: dict) -> str:
    def optional(value: float | None, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"

    return (
        f"{row['scaling']:>7} {row['ranks']:>3} {row['global_batch']:>6} {row['shard']:>6} "
        f"{row['compute_ms']:>9.3f} {row['allreduce_ms']:>9.3f} {row['update_ms']:>9.3f} "
        f"{row['step_ms']:>9.3f} {row['step_min_ms']:>8.3f} {row['step_max_ms']:>8.3f} "
        f"{row['samples_per_s']:>10.0f} {optional(row['speedup'], 8)} "
        f"{optional(row['efficiency'], 7)}"
    )


def add_speedups(rows: list[dict]) -> None:
    """Throughput relative to P = 1 of the same scaling mode, and that divided by P (efficiency)."""
    for row in rows:
        single = [r for r in rows if r["scaling"] == row["scaling"] and r["ranks"] == 1]
        if single:
            row["speedup"] = row["samples_per_s"] / single[0]["samples_per_s"]
            row["efficiency"] = row["speedup"] / row["ranks"]
        else:
            row["speedup"] = row["efficiency"] = None


OVERHEAD_HEADER = (
    f"{'batch':>6} {'bare cmp':>9} {'train cmp':>9} {'trainallr':>9} {'bare upd':>9} "
    f"{'train upd':>9} {'bare step':>9} {'trainstep':>9} {'ratio':>7} {'range':>13} "
    f"{'best/best':>9}"
)


def print_overhead(row: dict) -> None:
    verdict = "within" if row["within_bar"] else "ABOVE"
    print(
        f"{row['batch']:>6} {row['bare_compute_ms']:>9.3f} {row['train_compute_ms']:>9.3f} "
        f"{row['train_allreduce_ms']:>9.3f} {row['bare_update_ms']:>9.3f} "
        f"{row['train_update_ms']:>9.3f} {row['bare_step_ms']:>9.3f} "
        f"{row['train_step_ms']:>9.3f} {row['ratio']:>7.3f} "
        f"{row['ratio_min']:>6.3f}-{row['ratio_max']:<6.3f} {row['ratio_of_minima']:>9.3f}  "
        f"{verdict} the 5% bar",
        flush=True,
    )
    for piece in row["pieces"]:
        print(
            f"#   {piece['piece']:>16}: train {piece['train_us']:8.1f} us, bare "
            f"{piece['bare_us']:8.1f} us, extra {piece['extra_us']:8.1f} us = "
            f"{piece['extra_pct']:5.2f}% of the bare step",
            flush=True,
        )


def load_average() -> float | None:
    """The 1-minute load average (None where the OS does not tell)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def write_outputs(options: argparse.Namespace, result: dict) -> None:
    """The --json and --csv files (the CSV holds the scaling rows)."""
    if options.json:
        jsonout.write(options.json, result)
    if options.csv:
        rows = [csv_row(row) for row in result["scaling"]]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["scaling"])
        writer.writeheader()
        writer.writerows(rows)
        write_text(options.csv, text.getvalue())
    if options.png:
        title = f"bench step: {result['model']}, --bucket-bytes sweep, {result['backend']} backend"
        draw_png(result["bucket_sweep"], options.png, title)


def csv_row(row: dict) -> dict:
    """A scaling row with its memory per category in columns of their own (memory_<name>)."""
    flat = {key: value for key, value in row.items() if key != "memory_bytes"}
    flat.update({f"memory_{name}": count for name, count in row.get("memory_bytes", {}).items()})
    return flat


# --- the driver -----------------------------------------------------------------------------------


# The train options that `bench step` does not take, and why; every other TrainConfig field is
# an option here too, declared as `syncsgd train` declares it (add_train_options).
NOT_TAKEN = {
    "batch_size": "--per-rank-batch and --global-batch: one per scaling mode",
    "epochs": "a timed run is --steps steps",
    "loss": "xent: the overhead check's bare loop is softmax cross-entropy's",
    "overlap": "bench step's own --overlap times the step with it against the step without",
    "bucket_bytes": "bench step's own --bucket-bytes: the --overlap section's buckets, or a sweep",
    "checkpoint": "a benchmark writes no checkpoints",
    "checkpoint_every": "a benchmark writes no checkpoints",
    "resume": "a benchmark writes no checkpoints",
    "skip_nonfinite": "a step that is not finite ends the benchmark",
    "holdout": "the benchmark does not evaluate",
    "eval_every": "the benchmark does not evaluate",
    "target_loss": "a timed run takes every one of its --steps",
    "target_accuracy": "a timed run takes every one of its --steps",
    "noise_scale": "its estimate would be timed as part of the step",
}
# Where the benchmark's default differs from train's: an MNIST-sized MLP, a short timed run.
CHANGES: dict[str, Change] = {
    "samples": {"default": 2048},
    "features": {"default": 784},
    "hidden": {"default": (256, 256)},
    "classes": {"default": 10},
    "lr": {"default": 0.01},
    "steps": {"default": 20, "type": positive_int, "help": "steps per timed run (default 20)"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd bench step`: its own, then train's (but NOT_TAKEN)."""
    RANK_COUNTS.add(parser, help="thread rank counts to run (default 1,2,3,4); under mpiexec, -n")
    BACKEND.add(parser)
    add = parser.add_argument
    add("--scaling", type=scaling_list, default=list(SCALINGS),
        help="weak, strong or weak,strong (default both)")  # fmt: skip
    add("--per-rank-batch", type=positive_int, default=64,
        help="weak scaling: samples per rank (64)")  # fmt: skip
    add("--global-batch", type=positive_int, default=256,
        help="strong scaling: the global batch (256)")  # fmt: skip
    add("--repeats", type=positive_int, default=7,
        help="timed runs per configuration; the median is quoted (7)")  # fmt: skip
    add("--warmup", type=positive_int, default=5, help="burn-in steps per configuration (5)")
    add("--overhead-batch", type=rank_list, default=[64, 256],
        help="batch sizes of the P = 1 overhead check (64,256)")  # fmt: skip
    add("--overhead-repeats", type=positive_int, default=15,
        help="interleaved runs of each side of the overhead check (15)")  # fmt: skip
    add("--overlap", action="store_true",
        help="also time the step with --overlap against the step without, interleaved, per P")
    add("--bucket-bytes", type=bucket_list, default=[0], metavar="LIST",
        help="the --overlap section's buckets; 0: one per layer (0); several (e.g. "
        "0,16K,256K,one): a sweep of the --overlap step over them, measured beside the bucket "
        "model's prediction")  # fmt: skip
    add("--no-overhead", dest="overhead", action="store_false",
        help="skip the P = 1 overhead check")  # fmt: skip
    add("--cli-runs", type=nonnegative_int, default=5,
        help="runs of each command-line timing; 0 skips them (5)")  # fmt: skip
    JSON.add(parser, help="write all results as JSON")
    writes(add("--csv", metavar="PATH", help="write the scaling rows as CSV"))
    writes(add("--png", metavar="PATH", type=figure_path,
               help="the --bucket-bytes sweep as a slide: measured step time against bucket "
               "size beside the bucket model's (.png, .svg or .pdf)"))  # fmt: skip
    add_train_options(parser, exclude=NOT_TAKEN, changes=CHANGES)


def main(options: argparse.Namespace) -> int:
    """Run every phase on the chosen backend; the first rank prints and writes the files."""
    backend = resolve_backend(options.backend)
    call, rank_counts, master_process = phase_runner(options, backend)
    check_batch_sizes(options, rank_counts)
    if options.png and (len(options.bucket_bytes) < 2 or max(rank_counts) < 2):
        raise ValueError("--png draws the --bucket-bytes sweep: give two or more sizes and "
                         "a rank count of 2 or more")  # fmt: skip
    for path in (options.json, options.csv, options.png) if master_process else ():
        if path:
            check_writable(path)  # before the work, not after it
    say = print if master_process else (lambda *args, **kwargs: None)
    model = network_name(options)
    shown = (f"{model} on {','.join(map(str, options.input_shape or (options.features,)))}"
             if options.model else f"MLP {model} {options.activation}")  # fmt: skip
    samples = f"{options.samples} synthetic samples"
    if data.is_text(options.data):
        shown = f"{model} on {options.context} tokens"
        samples = f"windows of {options.context} characters of {options.data}"
    elif options.data != SYNTHETIC:
        samples = f"samples of {options.data}"
    say(
        f"# training step: {shown} xent {options.dtype}, {backend} "
        f"backend, {samples}; {options.steps} steps x {options.repeats} "
        f"runs after {options.warmup} burn-in steps; medians, slowest rank; "
        f"cores {os.cpu_count()}, load average {load_average()}",
        flush=True,
    )
    load_before = load_average()
    jit, rows = scaling_section(options, call, rank_counts, say)
    overlap_rows = overlap_section(options, call, rank_counts, say)
    bucket_rows = bucket_section(options, call, rank_counts, say,
                                 lambda p: train_config(options, p * options.per_rank_batch),
                                 per_step_seconds)  # fmt: skip
    overhead_rows = overhead_section(options, call, rank_counts, say, master_process)
    cli_rows = cli_section(options, backend) if options.cli_runs and master_process else []
    if master_process:
        print(f"# load average at the end: {load_average()} (other work skews every time)")
        write_outputs(options, {
            "benchmark": "step", "backend": backend, "model": model,
            "activation": None if options.model else options.activation, "loss": "xent",
            "dtype": options.dtype, "input_shape": options.input_shape, "data": options.data,
            "context": options.context if data.is_text(options.data) else None,
            "samples": options.samples, "cores": os.cpu_count(),
            "load_average": {"start": load_before, "end": load_average()},
            "command": sys.argv, "first_step": jit, "scaling": rows, "overhead": overhead_rows,
            "cli": cli_rows, "overlap": overlap_rows, "bucket_sweep": bucket_rows,
        })  # fmt: skip
    return 0


def phase_runner(options: argparse.Namespace, backend: str) -> tuple[Callable, list[int], bool]:
    """(call(phase, ranks, *args), the rank counts to measure, whether this rank prints)."""
    if backend == "threads":

        def call_threads(phase: Callable[..., Any], ranks: int, *args: Any) -> Any:
            return run_threads(ranks, within_timeout(phase, options.timeout), options, *args)[0]

        return call_threads, list(options.ranks or DEFAULT_RANKS), True
    comm = mpi_world()
    world = comm.Get_size()
    if options.ranks is not None and options.ranks != [world]:
        raise ValueError(
            f"--ranks {','.join(map(str, options.ranks))} disagrees with the MPI world size "
            f"{world}: under mpiexec, leave --ranks out or make it equal to -n"
        )

    def call_mpi(phase: Callable[..., Any], ranks: int, *args: Any) -> Any:
        return within_timeout(phase, options.timeout)(comm, options, *args)

    return call_mpi, [world], comm.Get_rank() == 0


def check_batch_sizes(options: argparse.Namespace, rank_counts: list[int]) -> None:
    """Fail before any work if the network is malformed or a global batch exceeds the samples."""
    samples = len(prepare(train_config(options, 1)).X)  # a text file decides its own windows
    largest = max(
        [global_batch_size(options, s, p) for s in options.scaling for p in rank_counts]
        + (options.overhead_batch if options.overhead else [])
    )
    if largest > samples:
        given = (f"--data {options.data} holds {samples} windows of --context {options.context}, "
                 "fewer" if data.is_text(options.data) else f"--samples {options.samples} is "
                 "smaller")  # fmt: skip
        raise ValueError(
            f"{given} than the largest global batch {largest}: "
            f"raise --samples or lower the batch sizes"
        )


def scaling_section(options: argparse.Namespace, call: Callable, rank_counts: list[int],
                    say: Callable) -> tuple[dict, list[dict]]:  # fmt: skip
    """The first step's time, then a row per (scaling, P): (first-step figures, rows)."""
    runs = {}
    for scaling in options.scaling:
        for ranks in rank_counts:
            config = train_config(options, global_batch_size(options, scaling, ranks))
            runs[scaling, ranks] = prepare(config)
    first_key = (options.scaling[0], rank_counts[0])
    jit = call(first_step, first_key[1], runs[first_key])
    say(
        f"# first step ({first_key[0]}, P={first_key[1]}): {jit['first_step_s']:.3f} s "
        f"({jit['source']}; the first train_rank call {jit['first_call_s']:.3f} s); "
        f"import of Numba and the kernels {jit['import_s']:.3f} s; kernels' BLAS: "
        f"OPENBLAS_NUM_THREADS={jit['blas_threads']}",
        flush=True,
    )
    say(f"# kernels' BLAS: {jit['blas']}", flush=True)
    say("# times in ms per step, steady state: each run's first step left out", flush=True)
    if options.batchnorm == "sync":
        say("# --batchnorm sync: the allreduce column holds BatchNorm's allreduces too (three "
            "per hidden layer), moved out of compute", flush=True)  # fmt: skip
    say(SCALING_HEADER, flush=True)
    rows: list[dict] = []
    for scaling, ranks in runs:
        rows.append(call(scaling_row, ranks, scaling, runs[scaling, ranks]))
        add_speedups(rows)
        say(format_scaling(rows[-1]), flush=True)
    sent = ", ".join(f"{row['scaling']} P={row['ranks']}: {row['bytes_sent_per_step']:,}"
                     for row in rows if row["bytes_sent_per_step"] is not None)  # fmt: skip
    if sent:  # (the executor's messages: the library's own allreduce's are not seen)
        say(f"# bytes a rank sends per step (the most over the ranks): {sent}", flush=True)
    say(memory_line(rows), flush=True)
    return jit, rows


def memory_line(rows: list[dict]) -> str:
    """The measured memory per rank of every row, on one line (--json: per category)."""
    from syncsgd.apps.costmodel_memory import format_bytes

    held = ", ".join(f"{row['scaling']} P={row['ranks']}: "
                     f"{format_bytes(row['memory_bytes']['total'])}" for row in rows)
    resident = max(row["memory_bytes"]["peak_resident"] for row in rows)
    return (f"# memory per rank, measured on the burn-in's untimed copy of the step (the most "
            f"over the ranks; --json: memory_bytes per category): {held}; the process's peak "
            f"resident memory {format_bytes(resident)}")


def overlap_pair(comm: Any, options: argparse.Namespace, plain: Run, overlapped: Run) -> dict:
    """The step without --overlap against the step with it, interleaved ABBA run by run."""
    train_rank(comm, replace(plain, steps=options.warmup), quiet=True)
    train_rank(comm, replace(overlapped, steps=options.warmup), quiet=True)
    runs: dict[str, list[list[float]]] = {"plain": [], "overlap": []}
    for repeat in range(options.repeats):
        order = ("plain", "overlap") if repeat % 2 == 0 else ("overlap", "plain")
        for name in order:
            runs[name].append(per_step_seconds(comm, plain if name == "plain" else overlapped))
    return overlap_row(comm.Get_size(), runs)


def overlap_row(ranks: int, runs: dict[str, list[list[float]]]) -> dict:
    """Medians of both sides, the paired step ratio, the share of communication hidden."""
    row: dict[str, Any] = {"ranks": ranks}
    for name, samples in runs.items():
        for index, part in enumerate(PARTS):
            row[f"{name}_{part}_ms"] = statistics.median(times[index] for times in samples) * 1e3
    ratios = [o[-1] / p[-1] for p, o in zip(runs["plain"], runs["overlap"], strict=True)]
    row["ratio"], row["ratio_min"], row["ratio_max"] = (statistics.median(ratios), min(ratios),
                                                       max(ratios))  # fmt: skip
    # Communication: the plain step's allreduce; the rest of its step is compute and update.
    comm_ms = row["plain_allreduce_ms"]
    compute_ms = row["plain_step_ms"] - comm_ms
    row["hidden_share"] = 1 - row["overlap_allreduce_ms"] / comm_ms if comm_ms > 0 else 0.0
    row["bound_ratio"] = row["overlap_step_ms"] / max(compute_ms, comm_ms)
    return row


OVERLAP_HEADER = (f"{'P':>3} {'compute':>9} {'allreduce':>9} {'step':>9} {'ovl step':>9} "
                  f"{'ovl wait':>9} {'ratio':>7} {'range':>13} {'hidden':>7} {'/max(c,a)':>9}")


def format_overlap(row: dict) -> str:
    return (
        f"{row['ranks']:>3} {row['plain_step_ms'] - row['plain_allreduce_ms']:>9.3f} "
        f"{row['plain_allreduce_ms']:>9.3f} {row['plain_step_ms']:>9.3f} "
        f"{row['overlap_step_ms']:>9.3f} {row['overlap_allreduce_ms']:>9.3f} "
        f"{row['ratio']:>7.3f} {row['ratio_min']:>6.3f}-{row['ratio_max']:<6.3f} "
        f"{100 * row['hidden_share']:>6.1f}% {row['bound_ratio']:>9.3f}"
    )


def overlap_section(options: argparse.Namespace, call: Callable, rank_counts: list[int],
                    say: Callable) -> list[dict]:  # fmt: skip
    """Per P: the step with --overlap against the step without, weak scaling, interleaved."""
    if not options.overlap or len(options.bucket_bytes) > 1:  # several: the sweep instead
        return []
    say(f"# --overlap, --bucket-bytes {options.bucket_bytes[0]} (weak scaling, "
        f"{options.per_rank_batch} per rank): ms per step, medians of {options.repeats} "
        "interleaved runs each; 'ovl wait': the allreduce time left exposed; ratio: paired "
        f"overlap/plain steps (bars: <= {OVERLAP_GAIN_BAR} where the network is slow, <= "
        f"{OVERLAP_COST_BAR} where nothing can be hidden); hidden: 1 - ovl wait / allreduce; "
        f"/max(c,a): overlap step / max(compute, allreduce) (bar {OVERLAP_BOUND_BAR})")
    say(OVERLAP_HEADER, flush=True)
    rows = []
    for ranks in rank_counts:
        config = train_config(options, ranks * options.per_rank_batch)
        plain = prepare(replace(config, bucket_bytes=options.bucket_bytes[0]))
        overlapped = replace(plain, config=replace(plain.config, overlap=True))
        rows.append(call(overlap_pair, ranks, plain, overlapped))
        say(format_overlap(rows[-1]), flush=True)
    return rows


def overhead_section(options: argparse.Namespace, call: Callable, rank_counts: list[int],
                     say: Callable, master_process: bool) -> list[dict]:  # fmt: skip
    """At P = 1: train_rank's step against the passes called directly, per --overhead-batch."""
    if not options.overhead:
        return []
    if options.batchnorm != "none" or has_batchnorm(options):
        say("# overhead check skipped: the bare loop has no BatchNorm")
        return []
    if 1 not in rank_counts:
        say("# overhead check skipped: it needs P = 1 (threads, or mpiexec -n 1)")
        return []
    unlike = unlike_bare_loop(train_config(options, 1))
    if unlike:
        say(f"# overhead check skipped: the bare loop is plain SGD, without {', '.join(unlike)}")
        return []
    say(
        "# overhead at P = 1, ms per step: 'train' is train_rank's step, 'bare' the passes "
        "called directly (nn.local.local_gradient); cmp = compute, allr = allreduce, upd = update; "
        "interleaved runs"
    )
    say(
        "# ratio: median of the paired train/bare step ratios (range: all pairs); best/best: "
        "fastest train run over fastest bare run; under each batch, the pieces of the step "
        f"that differ, timed alone (best of {PIECE_BATCHES} x {PIECE_CALLS} calls; a lower "
        "bound: inside the loop, extra memory traffic also evicts the kernels' data)"
    )
    say(OVERHEAD_HEADER, flush=True)
    rows = []
    for batch in options.overhead_batch:
        rows.append(call(overhead, 1, prepare(train_config(options, batch))))
        if master_process:
            print_overhead(rows[-1])
    return rows


def cli_section(options: argparse.Namespace, backend: str) -> list[dict]:
    """Wall times of `syncsgd --help` and a default train, on the threads backend only."""
    if backend != "threads" or launched_by_mpi():
        print("# command-line timings skipped under MPI (run them on the threads backend)")
        return []
    print(f"# command line: median of {options.cli_runs} runs after one warm-up run")
    rows = cli_timings(options.cli_runs)
    for row in rows:
        if "error" in row:
            print(f"{row['command']:>28}: FAILED: {row['error']}", flush=True)
            continue
        verdict = "within" if row["within_bar"] else "ABOVE"
        print(
            f"{row['command']:>28}: {row['median_s']:.3f} s (min {row['min_s']:.3f}, "
            f"max {row['max_s']:.3f}); {verdict} the {row['bar_s']:g} s bar",
            flush=True,
        )
    return rows
