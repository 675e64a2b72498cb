"""Gradient benchmark: the layered passes' gradient of an MLP against the same gradient in NumPy.

    python benchmarks/kernels.py                     # MLP 784-256-256-10, relu, xent, batch 64
    python benchmarks/kernels.py --features 32 --hidden 64 --classes 4 --batch 16 --json k.json
    OPENBLAS_NUM_THREADS=1 python benchmarks/kernels.py --clock cpu --thread-ranks 2

The "numba" side is `syncsgd.nn.local.local_gradient`: the training step's local gradient (the
network's layers over the float numerics: BLAS products, Numba loops between them) called directly,
without ranks. Its network is the --hidden MLP's (`mlp`), W0, b0, ... in one flat buffer, so both
sides share `params`.

Method: both implementations are checked to give the same loss and gradient, warmed up (the first
Numba call, compile or on-disk cache load, is timed and reported apart), then timed in `--batches`
rounds; each round times every (dtype, implementation) pair for `--iters` calls, interleaved, so a
noisy neighbour slows all of them alike. The median over rounds of the per-call time is quoted, and
the ratio numpy / numba (> 1: Numba is faster). `--clock cpu` times CPU seconds instead of elapsed
time: steadier on a busy machine, and with OPENBLAS_NUM_THREADS=1 it is the work done.

Both sides use BLAS with its default threads, as a user would run them (NumPy's own OpenBLAS;
Numba's np.dot calls SciPy's); OPENBLAS_NUM_THREADS=1 compares them single-threaded.
`--thread-ranks T` also times the batch split over T concurrent thread ranks (each with its own
`local_gradient`), as the threads backend runs them: a multi-threaded OpenBLAS serializes
concurrent callers, so compare with and without OPENBLAS_NUM_THREADS=1
(`syncsgd.nn.kernels.limit_blas_threads`).
Nothing is asserted: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd.apps.bench.timing import CLOCKS, interleaved_rounds
from syncsgd.nn.mlp import mlp, parse_hidden, sizes_of
from syncsgd.nn.network import Network
from syncsgd.util.argtypes import dtype_list

IMPLEMENTATIONS = ("numpy", "numba")
WIDTHS = (8, 6, 10, 10, 12)  # table columns


def numpy_gradient(model: Network, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                   grad: np.ndarray):  # fmt: skip
    """Plain NumPy: sum of cross-entropy losses of the batch, grad = sum of per-sample gradients."""
    weights = model.views(params)
    grads = model.views(grad)
    activations = [X]
    n_layers = len(sizes_of(model)) - 1  # dense layers
    for layer in range(n_layers):
        z = activations[-1] @ weights[f"W{layer}"] + weights[f"b{layer}"]
        is_last = layer == n_layers - 1
        activations.append(z if is_last else np.maximum(z, 0, out=z))
    logits = activations[-1]
    rows = np.arange(len(y))
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    loss_sum = float(np.sum(np.log(total[:, 0]) - shifted[rows, y]))
    delta = exp / total
    delta[rows, y] -= 1
    for layer in range(n_layers - 1, -1, -1):
        # out= writes straight into the flat gradient: no temporary copy on the NumPy side either.
        np.matmul(activations[layer].T, delta, out=grads[f"W{layer}"])
        np.sum(delta, axis=0, out=grads[f"b{layer}"])
        if layer:
            delta = (delta @ weights[f"W{layer}"].T) * (activations[layer] > 0)
    return loss_sum


def setup(model: Network, batch: int, seed: int):
    """Parameters, a batch of data and labels, and a gradient buffer for `model`."""
    rng = np.random.default_rng(seed)
    params = model.init_params(seed)
    X = rng.standard_normal((batch, model.in_shape[0])).astype(model.dtype)
    y = rng.integers(0, model.outputs, batch)
    return params, X, y, np.zeros(model.n_params, dtype=model.dtype)


def run(options: argparse.Namespace) -> list[dict]:
    """Times both implementations for every dtype; prints and returns one row per (dtype, impl)."""
    started = time.perf_counter()
    from syncsgd.nn import local  # imports Numba and the layers' kernels

    import_seconds = time.perf_counter() - started
    from syncsgd.apps.bench.step import cache_counts, step_kernels

    dispatchers = step_kernels()
    sizes = (options.features, *parse_hidden(options.hidden), options.classes)
    calls = {}
    first_call = {}
    for dtype in options.dtypes:
        model = mlp(sizes, "relu", loss="xent", dtype=np.dtype(dtype))
        params, X, y, grad = setup(model, options.batch, options.seed)
        gradient = local.local_gradient(model, options.batch)
        numba_grad = np.zeros_like(grad)
        _, misses_before = cache_counts(dispatchers)
        started = time.perf_counter()
        numba_loss, _ = gradient(params, X, y, numba_grad)
        # cached: no kernel compiled (every one was loaded from Numba's cache, or already loaded)
        first_call[dtype] = (
            time.perf_counter() - started,
            cache_counts(dispatchers)[1] == misses_before,
        )
        numpy_loss = numpy_gradient(model, params, X, y, grad)
        tolerance = 1e-10 if model.dtype == np.float64 else 1e-4
        scale = max(1.0, float(np.abs(grad).max()))
        if abs(numba_loss - numpy_loss) > tolerance * max(1.0, abs(numpy_loss)) or not np.allclose(
            numba_grad, grad, rtol=tolerance, atol=tolerance * scale
        ):
            raise ValueError(f"numba and numpy gradients disagree ({dtype})")
        calls[dtype, "numpy"] = lambda m=model, p=params, x=X, t=y, g=grad: numpy_gradient(
            m, p, x, t, g
        )
        calls[dtype, "numba"] = lambda f=gradient, p=params, x=X, t=y, g=numba_grad: f(p, x, t, g)

    samples = interleaved_rounds(
        {key: [call] for key, call in calls.items()},
        options.warmup, options.batches, options.iters, options.clock,
    )  # fmt: skip

    print(
        f"MLP {'-'.join(map(str, sizes))} relu xent, micro-batch {options.batch}; "
        f"import of syncsgd.nn.local (numba) {import_seconds:.2f} s; median of "
        f"{options.batches} rounds x {options.iters} calls, {options.clock} clock; cores "
        f"{os.cpu_count()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    header = ("dtype", "impl", "time (us)", "min (us)", "numpy/numba")
    print(
        " ".join(f"{name:>{width}}" for name, width in zip(header, WIDTHS, strict=True)),
        " first call",
    )
    rows = []
    for dtype in options.dtypes:
        numba_median = statistics.median(samples[dtype, "numba"])
        for impl in IMPLEMENTATIONS:
            median = statistics.median(samples[dtype, impl])
            row = {
                "dtype": dtype,
                "implementation": impl,
                "sizes": list(sizes),
                "batch": options.batch,
                "median_us": median * 1e6,
                "min_us": min(samples[dtype, impl]) * 1e6,
                "ratio_numpy_over_numba": statistics.median(samples[dtype, "numpy"]) / numba_median,
            }
            note = ""
            if impl == "numba":
                seconds, cached = first_call[dtype]
                row["first_call_s"] = seconds
                row["first_call_cached"] = cached
                note = f"{seconds:.3f} s ({'cache load' if cached else 'JIT compile'})"
            rows.append(row)
            print(
                f"{dtype:>8} {impl:>6} {row['median_us']:>10.1f} {row['min_us']:>10.1f} "
                f"{row['ratio_numpy_over_numba'] if impl == 'numba' else 1.0:>12.2f}  {note}"
            )
    if options.thread_ranks > 1:
        rows += thread_rank_rows(options, sizes, local)
    return rows


def thread_rank_rows(options: argparse.Namespace, sizes: tuple[int, ...],
                     local: Any) -> list[dict]:  # fmt: skip
    """Strong scaling: the batch split over T thread ranks, each with its own local gradient.

    A step is every rank's call, released together; it takes as long as the slowest rank.
    """
    counts = (1, options.thread_ranks)
    groups: dict[tuple[str, int], list[Callable[..., Any]]] = {}
    for dtype in options.dtypes:
        model = mlp(sizes, "relu", loss="xent", dtype=np.dtype(dtype))
        params, X, y, _ = setup(model, options.batch, options.seed)
        for count in counts:
            shards = np.array_split(np.arange(options.batch), count)
            groups[dtype, count] = [
                functools.partial(
                    local.local_gradient(model, len(shard)), params, X[shard], y[shard],
                    np.empty_like(params),
                )
                for shard in shards
            ]  # fmt: skip
    samples = interleaved_rounds(groups, options.iters, options.batches, options.iters)
    print(
        f"thread ranks, micro-batch {options.batch} split over T threads, numba only "
        f"(median wall-clock time per step, us)"
    )
    rows = []
    for dtype in options.dtypes:
        one = statistics.median(samples[dtype, 1])
        for count in counts:
            median = statistics.median(samples[dtype, count])
            rows.append(
                {"dtype": dtype, "implementation": "numba", "thread_ranks": count,
                 "batch": options.batch, "median_us": median * 1e6, "speedup": one / median}
            )  # fmt: skip
            print(f"{dtype:>8} T={count:<3} {median * 1e6:>10.1f}   speed-up {one / median:.2f}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--features", type=int, default=784, help="input size (784)")
    parser.add_argument("--hidden", default="256,256", help="hidden sizes (256,256)")
    parser.add_argument("--classes", type=int, default=10, help="output size (10)")
    parser.add_argument("--batch", type=int, default=64, help="micro-batch size (64)")
    parser.add_argument("--dtypes", type=dtype_list, default=["float64", "float32"])
    parser.add_argument("--batches", type=int, default=15, help="timed rounds (15)")
    parser.add_argument("--iters", type=int, default=20, help="calls per round (20)")
    parser.add_argument("--warmup", type=int, default=10, help="burn-in calls (10)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="(wall)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--thread-ranks", type=int, default=0, metavar="T",
        help="also time the batch split over T concurrent thread ranks (off)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def main(argv: list[str] | None = None) -> int:
    """Parse options, run, and write the JSON file if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    options = parser.parse_args(argv)
    for name in ("features", "classes", "batch", "batches", "iters"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be >= 1")
    rows = run(options)
    if options.json:
        from syncsgd.util.files import write_text

        write_text(options.json, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
