"""--overlap under MPI: the step without it, and with it waiting by yields (default), sleeps, spins.

    syncsgd cluster --nodes 2 --link 1gbit -- python benchmarks/overlap.py
    mpiexec -n 2 python benchmarks/overlap.py --hidden 2048,1024 --per-rank-batch 32

The four run interleaved, round by round (rotated), each `--steps` steps of `train_rank` after a
burn-in; per round the slowest rank's steady-state step, allreduce (with --overlap: the part left
exposed) and compute; medians over `--repeats` rounds and the median of the paired ratios to the
plain step. Nothing is asserted: docs/overlap.md quotes the figures with their load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

from syncsgd.apps.bench.step import per_step_seconds
from syncsgd.comm.world import mpi_world
from syncsgd.nn.mlp import parse_hidden
from syncsgd.training import overlap
from syncsgd.training.config import TrainConfig
from syncsgd.training.loop import train_rank
from syncsgd.training.run import prepare

VARIANTS = ("plain", "overlap", "overlap-sleep", "overlap-spin")
WAITS = {"overlap": "yield", "overlap-sleep": "sleep", "overlap-spin": "spin", "plain": "yield"}


def arguments(argv: list[str]) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--features", type=int, default=64)
    add("--hidden", default="2048,1024")
    add("--per-rank-batch", type=int, default=256)
    add("--bucket-bytes", type=int, default=0, help="0: one bucket per layer")
    add("--algorithm", default="ring")
    add("--exact", action="store_true", help="exact mode: the extraction overlaps the sums")
    add("--steps", type=int, default=5)
    add("--repeats", type=int, default=7)
    add("--samples", type=int, default=2048)
    return parser.parse_args(argv)


def run_variant(comm: object, runs: dict, name: str) -> list[float]:
    """One timed run of a variant: compute, allreduce, update, step seconds per step."""
    overlap.WAITS = WAITS[name]
    return per_step_seconds(comm, runs[name])


def main(argv: list[str]) -> int:
    options = arguments(argv)
    comm = mpi_world()
    size = comm.Get_size()
    config = TrainConfig(samples=options.samples, features=options.features, classes=10,
                         hidden=parse_hidden(options.hidden), batch_size=size *
                         options.per_rank_batch, steps=options.steps, lr=0.01,
                         bucket_bytes=options.bucket_bytes, algorithm=options.algorithm,
                         exact=options.exact)
    plain = prepare(config)
    with_overlap = replace(plain, config=replace(config, overlap=True))
    runs = {"plain": plain, **{name: with_overlap for name in VARIANTS[1:]}}
    for name in VARIANTS:  # burn-in
        overlap.WAITS = WAITS[name]
        train_rank(comm, replace(runs[name], steps=2), quiet=True)
    times: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    for repeat in range(options.repeats):
        for k in range(len(VARIANTS)):
            name = VARIANTS[(repeat + k) % len(VARIANTS)]
            times[name].append(run_variant(comm, runs, name))
    if comm.Get_rank() == 0:
        report(options, size, times)
    return 0


def report(options: argparse.Namespace, size: int, times: dict[str, list[list[float]]]) -> None:
    """Medians per variant, paired ratios to the plain step, the share hidden."""
    print(f"# MLP {options.features}-{options.hidden}-10 float64{' exact' * options.exact}, "
          f"P = {size}, "
          f"{options.per_rank_batch} per rank, --bucket-bytes {options.bucket_bytes}, "
          f"{options.algorithm}; {options.repeats} rounds of {options.steps} steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    plain = times["plain"]
    comm_ms = statistics.median(t[1] for t in plain) * 1e3
    rest_ms = statistics.median(t[3] - t[1] for t in plain) * 1e3
    print(f"# plain: compute+update {rest_ms:.1f} ms, allreduce {comm_ms:.1f} ms")
    print(f"{'variant':>13} {'step ms':>9} {'wait ms':>9} {'ratio':>7} {'range':>13} "
          f"{'hidden':>7} {'/max(c,a)':>9}")
    for name, samples in times.items():
        step_ms = statistics.median(t[3] for t in samples) * 1e3
        wait_ms = statistics.median(t[1] for t in samples) * 1e3
        ratios = [s[3] / p[3] for s, p in zip(samples, plain, strict=True)]
        print(f"{name:>13} {step_ms:>9.1f} {wait_ms:>9.1f} {statistics.median(ratios):>7.3f} "
              f"{min(ratios):>6.3f}-{max(ratios):<6.3f} {100 * (1 - wait_ms / comm_ms):>6.1f}% "
              f"{step_ms / max(comm_ms, rest_ms):>9.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
