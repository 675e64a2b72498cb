"""The MLP, CNN and GPT steps of this tree against another tree's (the code before a change).

    git worktree add ../before b2bdac4          # the code before the local gradient's refactor
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        python benchmarks/against_before.py --before ../before
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        python benchmarks/against_before.py --before ../before --ranks 1,2 --dtypes float32 \
        --rounds 9 --nets mlp,cnn,gpt

The project's bar for a refactor of the step: the MLP, CNN and GPT steps are not slower, each at
most 1.03 times the code before (the median of interleaved rounds' ratios, P = 1 and 2,
float32). What is timed (`--nets`, all three by default):

- mlp: the MLP of benchmarks/peers.py, 784-256-256-10 relu xent, plain SGD at lr 0.01, global
  batch 256 of 2048 synthetic samples;
- cnn: a conv net in the spirit of Shallue et al.'s Simple CNN, shrunk to take tens of
  milliseconds a step on two cores (the simple-cnn preset is too big for a benchmark round):
  conv(8, 5, pad=2) relu maxpool(2) conv(16, 5, pad=2) relu maxpool(2) flatten dense(64) relu
  dense, on 2048 synthetic samples of shape 1x28x28 (784 features), 10 classes, xent, plain SGD
  at lr 0.01, global batch 64;
- gpt: gpt(layers=2,d=64,heads=4) on numbers-to-words, windows of 32 characters (2048 of them),
  AdamW at lr 0.003 (its default weight decay 0.01), global batch 32;

each split over P thread ranks: `syncsgd.training.loop.train_rank` (the training loop a user runs,
`quiet=True`), its steady state (each run's first step left out), the slowest rank's seconds per
step. Only configuration fields that both trees have are used (the TrainConfig of b2bdac4).

Each tree runs in its own process for each (net, P, dtype) (PYTHONPATH pointing at the tree, which
the process checks it imported syncsgd from), pinned to the first P cores, one BLAS thread per
rank, kept alive across rounds. After `--warmup` steps each (which also compiles or loads the Numba
kernels), a round asks every process in turn for `--steps` steps, the two trees of a (net, P,
dtype) back to back, their order alternating round by round; one process runs at a time. Quoted:
the median over rounds of each tree's ms per step, and the median over rounds of each round's ratio
new / before (a busy neighbour slows both of a round's pair alike). Beside them, the same for CPU
seconds: the process's CPU time over the whole `train_rank` call (its set-up and first step
included, and at P = 2 a rank's spinning in the allreduce) per step, which a busy machine disturbs
less than elapsed time. Both trees take the same steps from the same seed: the line says whether
their parameters ended bitwise equal in every round. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SIZES = (784, 256, 256, 10)
BATCH, SAMPLES, LR, SEED = 256, 2048, 0.01, 0
CNN = ("conv(8, 5, pad=2) relu maxpool(2) conv(16, 5, pad=2) relu maxpool(2) flatten dense(64) "
       "relu dense")  # fmt: skip
GPT = "gpt(layers=2,d=64,heads=4)"
# Each net's TrainConfig fields beside steps, seed and dtype: fields both trees have.
NETS: dict[str, dict[str, Any]] = {
    "mlp": {"samples": SAMPLES, "features": SIZES[0], "hidden": SIZES[1:-1],
            "classes": SIZES[-1], "batch_size": BATCH, "lr": LR, "activation": "relu",
            "loss": "xent"},
    "cnn": {"samples": SAMPLES, "features": 784, "input_shape": (1, 28, 28), "classes": 10,
            "model": CNN, "batch_size": 64, "lr": LR, "loss": "xent"},
    "gpt": {"data": "numbers-to-words", "model": GPT, "context": 32, "samples": SAMPLES,
            "batch_size": 32, "optimizer": "adamw", "lr": 0.003},
}  # fmt: skip
ABOUT = {
    "mlp": f"MLP {'-'.join(map(str, SIZES))} relu xent, SGD lr {LR}, global batch {BATCH} of "
           f"{SAMPLES} synthetic samples",
    "cnn": f"CNN {CNN}, xent, on {SAMPLES} synthetic 1x28x28 samples of 10 classes, SGD lr {LR}, "
           "global batch 64",
    "gpt": f"GPT {GPT} on numbers-to-words, context 32 ({SAMPLES} windows), AdamW lr 0.003, "
           "global batch 32",
}  # fmt: skip
BAR = 1.03  # new / before, median of the rounds' ratios
TREES = ("before", "new")


def pin(ranks: int) -> None:
    """Run this process on the first `ranks` cores, if there are."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= ranks:
        os.sched_setaffinity(0, cores[:ranks])


def serve(net: str, ranks: int, dtype: str, extra: dict[str, Any]) -> None:
    """Answer 'N' lines with 'seconds CPU-seconds digest' per step of `net` over N steps until
    stdin closes (the digest: of rank 0's final parameters)."""
    pin(ranks)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from dataclasses import replace

    import syncsgd
    from syncsgd.comm.threads import run_threads
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.loop import train_rank
    from syncsgd.training.run import prepare

    config = TrainConfig(steps=2, seed=SEED, dtype=dtype, **{**NETS[net], **extra})
    run = prepare(config)
    print("ready", os.path.dirname(os.path.dirname(os.path.abspath(syncsgd.__file__))),
          flush=True)  # fmt: skip
    for line in sys.stdin:
        steps = int(line)
        started = time.process_time()
        results = run_threads(ranks, train_rank, replace(run, steps=steps + 1), quiet=True)
        cpu = (time.process_time() - started) / (steps + 1)
        seconds = max(r.steady_seconds for r in results) / results[0].steady_steps
        digest = hashlib.sha256(results[0].params.tobytes()).hexdigest()[:16]
        print(repr(seconds), repr(cpu), digest, flush=True)


class Tree:
    """One tree's server process for one (net, P, dtype)."""

    def __init__(self, root: str, net: str, ranks: int, dtype: str,
                 extra: dict[str, Any]) -> None:  # fmt: skip
        env = dict(os.environ, PYTHONPATH=root)
        command = [sys.executable, os.path.abspath(__file__), "--serve", "--nets", net,
                   "--ranks", str(ranks), "--dtypes", dtype, "--new-options",
                   json.dumps(extra)]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env, cwd=root)  # fmt: skip
        word, _, imported = self.read().partition(" ")
        if word != "ready" or os.path.realpath(imported) != os.path.realpath(root):
            self.close()
            raise RuntimeError(f"the server for {root} imported syncsgd from {imported!r}")

    def read(self) -> str:
        """The next line the server prints; RuntimeError if it died."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"server {self.process.args!r} exited: {self.process.wait()}")
        return line.strip()

    def ask(self, steps: int) -> tuple[float, float, str]:
        """(seconds, CPU seconds per step over `steps` steps, digest of the final parameters)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        seconds, cpu, digest = self.read().split()
        return float(seconds), float(cpu), digest

    def close(self) -> None:
        """Close stdin: the server finishes and exits."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


Key = tuple[str, int, str]  # (net, P, dtype)


def measure(options: argparse.Namespace) -> dict[Key, dict[str, Any]]:
    """Per (net, P, dtype): each tree's seconds per step per round, and whether the digests
    agreed."""
    roots = {"before": os.path.abspath(options.before), "new": os.path.abspath(options.new)}
    keys = [(net, ranks, dtype) for net in options.nets for dtype in options.dtypes
            for ranks in options.ranks]  # fmt: skip
    servers: dict[tuple[str, int, str, str], Tree] = {}
    try:
        for net, ranks, dtype in keys:
            for tree in TREES:
                extra = options.new_options if tree == "new" else options.before_options
                servers[net, ranks, dtype, tree] = Tree(roots[tree], net, ranks, dtype, extra)
        for server in servers.values():
            server.ask(options.warmup)
        out: dict[Key, dict[str, Any]] = {
            key: {"before": [], "new": [], "cpu before": [], "cpu new": [], "equal": True}
            for key in keys
        }
        for round_ in range(options.rounds):
            for net, ranks, dtype in keys:
                row = out[net, ranks, dtype]
                digests = {}
                for tree in TREES if round_ % 2 == 0 else TREES[::-1]:
                    server = servers[net, ranks, dtype, tree]
                    seconds, cpu, digests[tree] = server.ask(options.steps)
                    row[tree].append(seconds)
                    row[f"cpu {tree}"].append(cpu)
                row["equal"] = row["equal"] and digests["before"] == digests["new"]
    finally:
        for server in servers.values():
            server.close()
    return out


def report(options: argparse.Namespace, out: dict[Key, dict[str, Any]]) -> None:
    """ms per step of both trees and the median of the rounds' ratios new / before."""
    print(f"{'net':>3} {'P':>2} {'dtype':>8} {'before':>8} {'new':>8} {'new/before':>10} "
          f"{'range':>13} {'bar':>6} {'fastest n/b':>11} {'cpu bef.':>8} {'cpu new':>8} "
          f"{'cpu n/b':>7}  params   (ms per step, medians of {options.rounds} "
          "rounds)")  # fmt: skip
    for (net, ranks, dtype), row in out.items():
        before, new = statistics.median(row["before"]), statistics.median(row["new"])
        ratios = [n / b for n, b in zip(row["new"], row["before"], strict=True)]
        ratio = statistics.median(ratios)
        cpu = [n / b for n, b in zip(row["cpu new"], row["cpu before"], strict=True)]
        verdict = "within" if ratio <= options.bar else "ABOVE"
        same = "equal" if row["equal"] else "differ"
        print(f"{net:>3} {ranks:>2} {dtype:>8} {before * 1e3:>8.3f} {new * 1e3:>8.3f} "
              f"{ratio:>10.3f} {min(ratios):>6.3f}-{max(ratios):<6.3f} {verdict:>6} "
              f"{min(row['new']) / min(row['before']):>11.3f} "
              f"{statistics.median(row['cpu before']) * 1e3:>8.3f} "
              f"{statistics.median(row['cpu new']) * 1e3:>8.3f} {statistics.median(cpu):>7.3f}  "
              f"{same}", flush=True)  # fmt: skip
        if options.verbose:
            for name in ("before", "new", "cpu before", "cpu new"):
                print(f"# {name:>10} ms:", " ".join(f"{s * 1e3:.2f}" for s in row[name]))


def main(argv: list[str] | None = None) -> int:
    """Coordinate the two trees' servers, or (--serve) be one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="../before", help="the tree before (../before)")
    default_new = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--new", default=default_new, help="the tree after (this script's)")
    parser.add_argument("--ranks", default="1,2", help="rank counts (1,2)")
    parser.add_argument("--dtypes", default="float32,float64", help="(float32,float64)")
    parser.add_argument("--nets", default=",".join(NETS), help=f"({','.join(NETS)})")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round (20)")
    parser.add_argument("--warmup", type=int, default=10, help="burn-in steps (10)")
    parser.add_argument("--verbose", action="store_true", help="print every round's times")
    parser.add_argument("--new-options", type=json.loads, default={}, metavar="JSON",
                        help='TrainConfig fields of the new side only, e.g. \'{"zero_stage": 1}\' '
                        "with --before . (this tree): a sharded step against the replicated one")
    parser.add_argument("--before-options", type=json.loads, default={}, metavar="JSON",
                        help="TrainConfig fields of the before side only (none)")
    parser.add_argument("--bar", type=float, default=BAR, help=f"the bar of new/before ({BAR})")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.ranks = [int(text) for text in options.ranks.split(",")]
    options.dtypes = options.dtypes.split(",")
    options.nets = options.nets.split(",")
    unknown = [net for net in options.nets if net not in NETS]
    if unknown:
        parser.error(f"--nets {','.join(unknown)}: use some of {','.join(NETS)}")
    if options.serve:
        serve(options.nets[0], options.ranks[0], options.dtypes[0], options.new_options)
        return 0
    if not os.path.isdir(os.path.join(options.before, "syncsgd")):
        parser.error(f"--before {options.before!r} holds no syncsgd package")
    for net in options.nets:
        print(f"# {net}: {ABOUT[net]}")
    print(f"# train_rank on thread ranks; before: {os.path.abspath(options.before)}, new: "
          f"{os.path.abspath(options.new)}; {options.steps} steps x {options.rounds} rounds "
          f"after {options.warmup}; each process pinned to the first P cores, one BLAS thread "
          f"per rank; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    out = measure(options)
    report(options, out)
    print(f"# new/before: the median of the rounds' ratios (bar {options.bar}); fastest n/b: the "
          f"fastest round of each tree, the cost without a neighbour's interference; params: "
          f"whether both trees' final parameters were bitwise equal in every round; load at the "
          f"end {os.getloadavg()[0]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
