"""Exact-mode gradient benchmark: the exact numerics' two phases against float mode's gradient.

    python benchmarks/exact.py                  # MLP 784-256-256-10 relu xent, micro-batch 128,
                                                # then whole steps at P = 2 (target: <= 4x)
    python benchmarks/exact.py --ranks 2        # two thread ranks computing at the same time
    OPENBLAS_NUM_THREADS=1 python benchmarks/exact.py --clock cpu --json exact.json
    python benchmarks/exact.py --model simple-cnn --input-shape 1,28,28 --batches 3 --iters 1
    python benchmarks/exact.py --model "gpt(layers=2,d=128,heads=4)" --batch 16 --global-batch 32

`--model SPEC --input-shape C,H,W` benchmarks any --model network instead of the --hidden MLP. A
--model that starts with embed (gpt(...)) is a token model: each rank's micro-batch is its own
`--batch` windows of `--context` characters of numbers-to-words (the whole steps: the global batch
of them), as `syncsgd train --data numbers-to-words` reads them, the loss over the B x T tokens
(--context 64 by default).
The default setting is global batch 256 on P = 2 ranks, so each rank's micro-batch is 128. Exact
mode is `passes` (Backprop with the Exact numerics: the batch-invariant forward and backward
passes, every sum registered with its peaks) then `extract` (`Exact.scales` and the extraction of
every registered sum at its agreed fixed point); the MAX-allreduce between the two is a
collective, timed by the step benchmark, not here (the peaks of this rank stand in for the agreed
ones: the cost does not depend on their values). Float mode is one `local_gradient` call (BLAS).

Method: both modes are first checked against each other (exact mean within the stated bound plus
float rounding of float mode), their first calls timed apart (JIT compile or cache load), then
`--warmup` burn-in calls each; then `--batches` rounds, each timing every (dtype, mode) for
`--iters` calls, interleaved, so a noisy neighbour slows all of them alike. With `--ranks P`, P
threads call their own instances at the same time, released together by a barrier, and a call takes
as long as the slowest thread. `--clock cpu` counts CPU seconds of the whole process instead (per
rank: divided by P), steadier on a busy machine; with OPENBLAS_NUM_THREADS=1 that is the work done.
The median over rounds is quoted, and exact / float. Then whole training steps (`--steps`; the
target: an exact step at most 4x a float step at P = 2). BLAS gets one thread per rank, as in
training, unless OPENBLAS_NUM_THREADS is set. Nothing is asserted: the machines are shared and
noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.*

from benchmarks.layers import CONTEXT
from syncsgd.apps.bench.timing import CLOCKS, interleaved_rounds
from syncsgd.nn.mlp import mlp, parse_hidden
from syncsgd.nn.network import Network, build
from syncsgd.util.argtypes import dimensions, dtype_list

MODES = ("float", "exact", "passes", "extract")  # the last two: exact's phases alone
Windows = tuple[np.ndarray, np.ndarray] | None  # token data's ids and next ids, every rank's


def reads_tokens(options: argparse.Namespace) -> bool:
    """Whether --model starts with embed: a token model, on token data (as peers.py reads it)."""
    from benchmarks.peers import reads_tokens as spec_reads_tokens

    return spec_reads_tokens(options.model)


def token_config(options: argparse.Namespace) -> dict:
    """The TrainConfig fields of token data: windows of --context characters of
    numbers-to-words, as many outputs as its characters."""
    return {"model": options.model, "data": "numbers-to-words",
            "context": options.context or CONTEXT, "classes": None}  # fmt: skip


def make_network(options: argparse.Namespace, dtype: str) -> tuple[Network, Windows]:
    """The --model network on --input-shape, or the --hidden MLP; a token model on the first
    windows of numbers-to-words (--batch of them for each of --ranks), as train reads them."""
    if reads_tokens(options):
        from syncsgd.training.config import TrainConfig
        from syncsgd.training.run import prepare

        run = prepare(TrainConfig(**token_config(options), samples=options.batch * options.ranks,
                                  batch_size=options.batch, steps=1, dtype=dtype,
                                  seed=options.seed))  # fmt: skip
        return run.model, (run.X, run.y)
    if options.model is not None:
        return build(options.model, options.input_shape, options.classes, "xent", dtype), None
    sizes = (options.features, *parse_hidden(options.hidden), options.classes)
    return mlp(sizes, "relu", loss="xent", dtype=np.dtype(dtype)), None


def describe(options: argparse.Namespace) -> str:
    """The network as the output names it."""
    if reads_tokens(options):
        return (f"{options.model} on windows of {options.context or CONTEXT} characters of "
                "numbers-to-words")  # fmt: skip
    if options.model is not None:
        return f"{options.model} on {','.join(map(str, options.input_shape))}"
    return f"MLP {options.features}-{options.hidden.replace(',', '-')}-{options.classes} relu"


def setup(model: Network, batch: int, seed: int, rank: int,
          windows: Windows = None) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Parameters and one rank's micro-batch of inputs and labels (token data: its windows)."""
    if windows is not None:
        ids, next_ids = windows
        return model.init_params(seed), *(part[rank * batch : (rank + 1) * batch]
                                          for part in (ids, next_ids))  # fmt: skip
    rng = np.random.default_rng([seed, rank])
    X = rng.standard_normal((batch, int(np.prod(model.in_shape)))).astype(model.dtype)
    y = rng.integers(0, model.outputs, batch)
    return model.init_params(seed), X, y


class ExactPhases:
    """One rank's exact-mode gradient sum in the step's two phases, around the MAX of the peaks."""

    def __init__(self, network: Network, max_batch: int) -> None:
        from syncsgd.nn.backprop import Backprop
        from syncsgd.nn.numerics import Exact, numerics

        nx = numerics(True, "fp32", network.dtype, network.largest_weight(),
                      max_batch * network.largest_block(), network.n_params)  # fmt: skip
        assert isinstance(nx, Exact)
        self.nx, self.passes = nx, Backprop(network, max_batch, nx)
        self.top = network.n_layers - 1
        self.grads = np.zeros(network.n_params)  # float64: the registered sums are extracted here
        self.bounds = np.zeros(0)

    def pass_(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> None:
        """The per-sample passes: every sum registered with its peaks, the peaks in `bounds`."""
        self.nx.begin_step_(self.grads, max(len(X), 1))
        self.passes.forward_loss_(params, X, y)
        self.passes.backward_(self.grads, self.top, 0)
        if self.bounds.size != len(self.nx.peaks):
            self.bounds = np.zeros(len(self.nx.peaks))
        self.nx.bounds(self.bounds)

    def extract(self, global_batch: int) -> float:
        """The gradient sum into `grads` and the loss sum, at the fixed points of `bounds`."""
        self.grads[:] = 0
        scales = self.nx.scales(self.bounds, global_batch)
        loss_sum = self.nx.extract_loss(scales)
        self.nx.accumulate_(scales, self.top, 0)
        return loss_sum


def rank_calls(model: Network, options: argparse.Namespace, rank: int,
               windows: Windows = None) -> dict[str, Callable]:  # fmt: skip
    """One rank's calls of every mode, after checking that exact and float mode agree."""
    from syncsgd.nn.local import local_gradient

    params, X, y = setup(model, options.batch, options.seed, rank, windows)
    gradient, exact = local_gradient(model, options.batch), ExactPhases(model, options.batch)
    grad = np.empty(model.n_params, model.dtype)
    exact.pass_(params, X, y)
    exact_loss = exact.extract(options.global_batch)
    loss_sum, _ = gradient(params, X, y, grad)
    # float mode's own rounding: in float32 the Simple CNN's float-mode gradient is 3.5e-4 *
    # (1 + max |g|) / B from exact mode's at worst (deep products over 3136 inputs)
    tolerance = 1e-10 if model.dtype == np.float64 else 1e-3
    # the stated bound per element of the gradient, then the loss (docs/exact-mode.md), on the
    # means over the loss's terms: B, or B x T tokens
    terms = options.global_batch * exact.passes.positions
    allowed = exact.nx.error_bound(exact.bounds, options.global_batch, exact.grads)
    allowed += tolerance * (1 + np.abs(grad).max()) / terms
    if np.any(np.abs(exact.grads - grad) / terms > allowed[:-1]) or (
            abs(exact_loss - loss_sum) / terms > allowed[-1]):  # fmt: skip
        raise ValueError(f"exact and float mode disagree beyond the bound ({model.dtype})")

    def both() -> None:
        exact.pass_(params, X, y)
        exact.extract(options.global_batch)

    return {
        "float": lambda: gradient(params, X, y, grad),
        "exact": both,
        "passes": lambda: exact.pass_(params, X, y),
        "extract": lambda: exact.extract(options.global_batch),
    }


def run(options: argparse.Namespace) -> list[dict]:
    """Times every mode for every dtype; prints and returns one row per (dtype, mode)."""
    calls: dict[tuple[str, str], list[Callable]] = {}
    first_call = {}
    for dtype in options.dtypes:
        model, windows = make_network(options, dtype)
        started = time.perf_counter()
        per_rank = [rank_calls(model, options, rank, windows) for rank in range(options.ranks)]
        first_call[dtype] = time.perf_counter() - started  # compile or cache load, and checks
        for mode in MODES:
            calls[dtype, mode] = [rank[mode] for rank in per_rank]

    samples = interleaved_rounds(
        calls, options.warmup, options.batches, options.iters, options.clock
    )

    print(
        f"{describe(options)} xent, micro-batch {options.batch} of global "
        f"batch {options.global_batch}, {options.ranks} thread rank(s) at once; median of "
        f"{options.batches} rounds x {options.iters} calls, {options.clock} clock; "
        f"cores {os.cpu_count()}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    print(f"{'dtype':>8} {'mode':>11} {'time (us)':>10} {'min (us)':>10} {'exact/float':>12}")
    rows = []
    for dtype in options.dtypes:
        float_median = statistics.median(samples[dtype, "float"])
        for mode in MODES:
            median = statistics.median(samples[dtype, mode])
            row = {
                "dtype": dtype,
                "mode": mode,
                "network": describe(options),
                "batch": options.batch,
                "global_batch": options.global_batch,
                "ranks": options.ranks,
                "median_us": median * 1e6,
                "min_us": min(samples[dtype, mode]) * 1e6,
                "ratio_to_float": median / float_median,
                "setup_s": first_call[dtype],
                "clock": options.clock,
            }
            rows.append(row)
            print(
                f"{dtype:>8} {mode:>11} {row['median_us']:>10.1f} {row['min_us']:>10.1f} "
                f"{row['ratio_to_float']:>12.2f}"
            )
    setup_seconds = ", ".join(f"{dtype} {seconds:.2f} s" for dtype, seconds in first_call.items())
    print(f"first calls with checks (JIT compile or cache load): {setup_seconds}")
    return rows


def whole_steps(options: argparse.Namespace) -> list[dict]:
    """Whole training steps, exact vs float mode (target: at most 4x) on `--step-ranks` ranks.

    `train_rank` runs `--steps` steps (the real loop: shard, kernels, MAX-allreduce of the bounds
    in exact mode, ring, update); a run's per-step time is the slowest rank's; float and exact runs
    alternate (ABBA) after one burn-in run each, and the medians are compared.
    """
    from syncsgd.comm.threads import run_threads
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.loop import prepare, train_rank

    layers: dict = (
        token_config(options) if reads_tokens(options) else
        {"model": options.model, "input_shape": options.input_shape,
         "classes": options.classes} if options.model else
        {"hidden": parse_hidden(options.hidden), "classes": options.classes}
    )  # fmt: skip
    features = int(np.prod(options.input_shape)) if options.model else options.features
    rows = []
    print(f"whole steps: {describe(options)}, global batch {options.global_batch}, "
          f"{options.step_ranks} thread ranks, {options.steps} steps per run, median of "
          f"{options.batches} runs")  # fmt: skip
    print(f"{'dtype':>8} {'mode':>6} {'step (ms)':>10} {'exact/float':>12}")
    for dtype in options.dtypes:
        problems = {
            mode: prepare(TrainConfig(
                samples=max(2048, options.global_batch), features=features, **layers,
                batch_size=options.global_batch, steps=options.steps,
                dtype=dtype, exact=mode == "exact", seed=options.seed,
            ))
            for mode in ("float", "exact")
        }  # fmt: skip

        def per_step(mode: str, problems: dict = problems) -> float:
            results = run_threads(options.step_ranks, train_rank, problems[mode])
            return max(r.seconds for r in results) / options.steps

        for mode in problems:  # burn-in: compile or load the kernels
            per_step(mode)
        times: dict[str, list[float]] = {"float": [], "exact": []}
        for run_index in range(options.batches):
            order = ("float", "exact") if run_index % 2 == 0 else ("exact", "float")
            for mode in order:
                times[mode].append(per_step(mode))
        float_median = statistics.median(times["float"])
        for mode, samples in times.items():
            median = statistics.median(samples)
            row = {"dtype": dtype, "mode": mode, "what": "step", "ranks": options.step_ranks,
                   "step_ms": median * 1e3, "ratio_to_float": median / float_median}  # fmt: skip
            rows.append(row)
            print(f"{dtype:>8} {mode:>6} {row['step_ms']:>10.2f} {row['ratio_to_float']:>12.2f}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--features", type=int, default=784, help="input size (784)")
    parser.add_argument("--hidden", default="256,256", help="hidden sizes (256,256)")
    parser.add_argument("--model", metavar="SPEC",
                        help="a --model network (e.g. simple-cnn) instead of the --hidden MLP")
    parser.add_argument("--input-shape", type=dimensions, default=(1, 28, 28),
                        help="--model: one sample's shape (1,28,28)")
    parser.add_argument("--classes", type=int, default=10, help="output size (10)")
    parser.add_argument("--context", type=int, help="a --model that starts with embed (gpt): "
                        f"its windows of token data, characters ({CONTEXT})")  # fmt: skip
    parser.add_argument("--batch", type=int, default=128, help="micro-batch per rank (128)")
    parser.add_argument("--global-batch", type=int, default=256, help="global batch B (256)")
    parser.add_argument("--ranks", type=int, default=1, help="threads computing at once (1)")
    parser.add_argument("--dtypes", type=dtype_list, default=["float64", "float32"])
    parser.add_argument("--batches", type=int, default=15, help="timed rounds (15)")
    parser.add_argument("--iters", type=int, default=10, help="calls per round (10)")
    parser.add_argument("--warmup", type=int, default=5, help="burn-in calls (5)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="(wall)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help="whole training steps per run for the step comparison; 0: skip (10)",
    )
    parser.add_argument("--step-ranks", type=int, default=2,
                        help="thread ranks of the step comparison (2)")  # fmt: skip


def main(options: argparse.Namespace) -> int:
    """Check the options, run, and write the JSON file if asked."""
    for name in ("features", "classes", "batch", "global_batch", "ranks", "batches", "iters"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if options.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if options.batch > options.global_batch:
        raise ValueError("--batch (one rank's share) cannot exceed --global-batch")
    parse_hidden(options.hidden)
    if options.context is not None and not reads_tokens(options):
        raise ValueError("--context is the window of a token model (a --model that starts with "
                         "embed, e.g. gpt(layers=2,d=128,heads=4))")  # fmt: skip
    if options.context is not None and options.context < 1:
        raise ValueError("--context must be >= 1")
    from syncsgd.nn.kernels import limit_blas_threads

    limit_blas_threads(1)  # as training does; before the first kernel call loads the BLAS
    rows = run(options)
    if options.steps > 0:
        rows += whole_steps(options)
    if options.json:
        from syncsgd.util.files import write_text

        write_text(options.json, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    argument_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(argument_parser)
    try:
        sys.exit(main(argument_parser.parse_args()))
    except ValueError as exc:
        sys.exit(f"error: {exc}")
