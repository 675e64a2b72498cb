"""Where syncsgd's training step spends its time, phase by phase, on the benchmark MLP of peers.py.

    python benchmarks/phases.py                          # P = 1, float32, CPU time of rank 0
    python benchmarks/phases.py --ranks 2 --dtype float64 --rounds 15 --clock wall

The step (`DataParallelStep.take_`) is taken apart into its phases, called in its order on thread
ranks, with the run's hooks after each step: the global batch's indices, the gather of the shard,
the local gradient's passes (`RankGradient`: the network's layers forward, the loss, the
layers backward: the matrix products and the Numba passes between them), the riders' fill, the
allreduce, the division by B with the finiteness check, the riders' read, the update, the hooks.
Beside them, on rank 0 alone, the passes' eight matrix products by themselves (the same shapes
and transposes as the dense layers' products, the weights those of the step's network, through
the same BLAS) and the GEMM floor: the FLOPs
of rank 0's shard at the best rate of the step's 256 x 784 x 256 product. A round times `--steps`
steps, then the products; the median over rounds is quoted. `--clock cpu` (the default) counts
rank 0's thread CPU seconds, steadier on a busy machine than elapsed time; with one BLAS thread per
rank it is the work done (but a rank waiting in the allreduce spins, and that counts too). Nothing
is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.peers import BATCH, GEMM_SHAPE, step_flops, syncsgd_config  # noqa: E402

PHASES = ("batch", "gather", "passes", "fill", "allreduce", "divide", "read", "update", "hooks")
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def products_kernel() -> Callable:
    """A Numba function running the step's eight matrix products `times` times."""
    from numba import njit

    @njit(nogil=True)
    def products(X, W0, W1, W2, a0, a1, a2, d2, d1, d0, g0, g1, g2, times):  # type: ignore[no-untyped-def]
        for _ in range(times):
            np.dot(X, W0, a0)  # forward
            np.dot(a0, W1, a1)
            np.dot(a1, W2, a2)
            np.dot(a1.T, d2, g2)  # backward: weight gradient, then the delta below
            np.dot(d2, W2.T, d1)
            np.dot(a0.T, d1, g1)
            np.dot(d1, W1.T, d0)
            np.dot(X.T, d0, g0)

    return products


def products_arguments(stepper: Any, X: np.ndarray) -> tuple:
    """Buffers of the products' shapes, the weights the dense layers' views of the stepper's
    parameters (the MLP's network stores each W as (in, out))."""
    network = stepper.local_gradient.network
    weights = [views["weight"] for views in network.layer_views(stepper.params)
               if "weight" in views]  # fmt: skip
    if len(weights) != 3 or X.shape[1] != weights[0].shape[0]:
        raise ValueError(f"the products are those of a 3-dense-layer MLP, not {network.spec!r}")
    dtype, m = network.dtype, X.shape[0]
    shapes = [W.shape for W in weights]
    (_, h1), (_, h2), (_, k) = shapes
    outputs = [np.ones(shape, dtype) for shape in [(m, h1), (m, h2), (m, k), (m, k), (m, h2),
                                                    (m, h1), *shapes]]  # fmt: skip
    a0, a1, a2, d2, d1, d0, g0, g1, g2 = outputs
    return (X, *weights, a0, a1, a2, d2, d1, d0, g0, g1, g2)


def timed_step(stepper: Any, hooks: list, step: int, clock: Callable[[], float],
               into: dict[str, float]) -> None:  # fmt: skip
    """One step, as `take_` takes it without --overlap, each phase's time added to `into`."""
    from syncsgd.training import data
    from syncsgd.training.step import StepRecord

    marks = [clock()]
    batch = stepper.variant.global_batch(stepper.order.batch(step), stepper.size)
    shard = data.contiguous_shard(batch, stepper.rank, stepper.size)
    marks.append(clock())
    X, y = stepper.gather_(shard)
    marks.append(clock())
    stepper.local_gradient(stepper.params, X, y, stepper.comm_buffer)
    marks.append(clock())
    stepper.variant.contribution_(stepper.grad_sum, len(shard), len(batch), stepper.size)
    for rider in stepper.riders:
        rider.fill_(rider.slots, stepper.grad_sum, len(shard))
    marks.append(clock())
    stepper.reduce_()
    marks.append(clock())
    loss, finite = stepper.divide_once_(len(batch))
    marks.append(clock())
    for rider in stepper.riders:
        rider.read_(rider.slots, stepper.grad_mean, len(batch), finite)
    marks.append(clock())
    lr, grad_norm = stepper.update_(step, finite)
    marks.append(clock())
    record = StepRecord(step, len(shard), len(batch), loss, finite, lr, grad_norm, marks[0],
                        marks[4], marks[5], marks[8])  # fmt: skip
    for hook in hooks:
        hook.after_step(record, False)
    marks.append(clock())
    for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
        into[phase] += end - start


def rank_main(comm: Any, run: Any, options: argparse.Namespace) -> dict[str, list[float]]:
    """Build the rank's step as training does, then time rounds of steps (and, on rank 0, the
    products alone)."""
    from syncsgd.nn.kernels import limit_blas_threads
    from syncsgd.training import data, loop
    from syncsgd.training.result import TrainResult
    from syncsgd.training.step import DataParallelStep
    from syncsgd.training.variants import variant

    limit_blas_threads(1)
    params, sgd, _ = loop.starting_state(comm, run)
    result = TrainResult(params, run.model, run.steps)
    hooks = loop.make_hooks(comm, run, result, 0, log=None, timeline=None, progress=False,
                            digests=False)  # fmt: skip
    stepper = DataParallelStep(comm, run, params, sgd, variant(None, None),
                               [hook.rider for hook in hooks if hook.rider is not None])
    for hook in hooks:
        hook.attach(stepper)
    products, clock = products_kernel(), CLOCKS[options.clock]
    shard = data.contiguous_shard(stepper.order.batch(0), stepper.rank, stepper.size)
    arguments = products_arguments(stepper, stepper.gather_(shard)[0].copy())
    samples: dict[str, list[float]] = {name: [] for name in (*PHASES, "products")}
    for round_ in range(options.rounds + 1):  # the first round warms up: not kept
        totals = dict.fromkeys(PHASES, 0.0)
        for index in range(options.steps):
            timed_step(stepper, hooks, round_ * options.steps + index, clock, totals)
        started = clock()
        products(*arguments, options.steps if comm.Get_rank() == 0 else 0)
        totals["products"] = clock() - started
        for name, seconds in totals.items():
            if round_:
                samples[name].append(seconds / options.steps)
    return samples


def gemm_floor(dtype: str, ranks: int, clock: Callable[[], float], calls: int = 40) -> float:
    """Seconds of a rank's share of the step's FLOPs at the best rate of the 256 x 784 x 256
    product, one thread."""
    from numba import njit

    @njit(nogil=True)
    def product(a, b, out, times):  # type: ignore[no-untyped-def]
        for _ in range(times):
            np.dot(a, b, out)

    m, k, n = GEMM_SHAPE
    a, b, out = np.ones((m, k), dtype), np.ones((k, n), dtype), np.empty((m, n), dtype)
    product(a, b, out, 1)
    best = math.inf
    for _ in range(5):
        started = clock()
        product(a, b, out, calls)
        best = min(best, (clock() - started) / calls)
    return step_flops(batch=-(-BATCH // ranks)) / (2 * m * k * n) * best


def main(argv: list[str] | None = None) -> int:
    """Print the median time of every phase, their sum, the products alone and the floor."""
    from syncsgd.comm.threads import run_threads
    from syncsgd.training.run import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1, help="thread ranks (1)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--rounds", type=int, default=11, help="rounds kept (11)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round (20)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    options = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    run = prepare(syncsgd_config(options.dtype, steps=1 << 30))
    load = os.getloadavg()[0]
    samples = run_threads(options.ranks, rank_main, run, options)[0]
    print(f"# syncsgd's step, P = {options.ranks}, {options.dtype}, rank 0, {options.clock} "
          f"clock, medians of {options.rounds} rounds of {options.steps} steps; load "
          f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    median = {name: statistics.median(values) for name, values in samples.items()}
    step = sum(median[name] for name in PHASES)
    for name in PHASES:
        print(f"{name:>10} {median[name] * 1e3:8.3f} ms  {median[name] / step:6.1%}")
    print(f"{'step':>10} {step * 1e3:8.3f} ms  (sum of the medians)")
    floor = gemm_floor(options.dtype, options.ranks, CLOCKS[options.clock])
    print(f"{'products':>10} {median['products'] * 1e3:8.3f} ms  (the passes' eight alone)")
    print(f"{'floor':>10} {floor * 1e3:8.3f} ms  (GEMM floor; share {floor / step:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
