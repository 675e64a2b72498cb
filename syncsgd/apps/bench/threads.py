"""The thread backend at scale: cost per message of a ring of 8 float64, and memory per rank.

    python benchmarks/threads.py                       # P = 2, 16, 64, 256, 1024
    python benchmarks/threads.py --ranks 2,16,64 --rounds 5
    python benchmarks/threads.py --memory 1024         # resident bytes per idle thread rank
    python benchmarks/threads.py --against OLD/syncsgd/comm/threads.py   # old vs new, interleaved

A ring allreduce on P ranks sends 2P(P-1) messages (every rank does 2(P-1) `Sendrecv`s), so the
cost per message is the time of one allreduce divided by 2P(P-1). Rounds are interleaved over the
sizes, so a noisy neighbour slows all sizes alike; the median round is quoted, with its ratio to
the smallest size of the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

import numpy as np

LENGTH = 8  # float64 elements: the messages are tiny, so the communicator's own cost is measured
DEFAULT_RANKS = (2, 16, 64, 256, 1024)


def messages(size: int) -> int:
    """Messages of one ring allreduce on `size` ranks."""
    return 2 * size * (size - 1)


def _ring_rank(comm: Any, reps: int, length: int = LENGTH) -> float:
    """Time `reps` ring allreduces of `length` float64 on this rank, between barriers."""
    from syncsgd import ring_allreduce

    buf = np.zeros(length)  # zeros: repeated in-place sums never overflow
    ring_allreduce(buf, comm)  # builds this thread's plan
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(reps):
        ring_allreduce(buf, comm)
    comm.Barrier()
    return time.perf_counter() - started


def seconds_per_message(size: int, min_messages: int, run: Any = None,
                        length: int = LENGTH) -> float:  # fmt: skip
    """Seconds per message of a ring allreduce of `length` float64 on `size` thread ranks."""
    from syncsgd import run_threads

    reps = max(1, math.ceil(min_messages / messages(size)))
    elapsed = (run or run_threads)(size, _ring_rank, reps, length)[0]
    return elapsed / reps / messages(size)


def other_run_threads(path: str) -> Any:
    """`run_threads` of another copy of the thread communicator's module (e.g. an older one)."""
    import importlib.util
    import sys

    from syncsgd.comm import world
    from syncsgd.comm.threads import ThreadComm

    spec = importlib.util.spec_from_file_location("syncsgd_other_threads", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # The collectives look their constants up by communicator type: the same values serve both.
    world._CONSTANTS[module.ThreadComm] = world.constants(ThreadComm.__new__(ThreadComm))
    return module.run_threads


def resident_bytes() -> int:
    """This process's resident set size (Linux), or 0 where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bytes_per_rank(size: int) -> float:
    """Resident bytes each of `size` idle thread ranks adds (all blocked in a Barrier)."""
    from syncsgd import run_threads

    seen: list[int] = []

    def idle(comm: Any) -> None:
        comm.Barrier()  # every thread is started and has communicated once
        if comm.Get_rank() == 0:
            seen.append(resident_bytes())
        comm.Barrier()

    run_threads(2, idle)  # warm up: imports, the first thread's arenas
    before = resident_bytes()
    run_threads(size, idle)
    return (seen[-1] - before) / size


def main(argv: list[str] | None = None) -> int:
    """Print the cost per message for every size, and its ratio to the first size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                        help="comma-separated numbers of thread ranks")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median quoted)")
    parser.add_argument("--messages", type=int, default=20000,
                        help="at least this many messages per measurement")  # fmt: skip
    parser.add_argument("--length", type=int, default=LENGTH,
                        help="float64 elements reduced (8: the communicator's cost)")  # fmt: skip
    parser.add_argument("--against", metavar="FILE",
                        help="also time the run_threads of this threads.py")  # fmt: skip
    parser.add_argument("--memory", type=int, default=0, metavar="P",
                        help="measure resident bytes per rank of P idle ranks instead")  # fmt: skip
    args = parser.parse_args(argv)
    import syncsgd

    print(f"# syncsgd from {os.path.dirname(syncsgd.__file__)}")
    if args.memory:
        print(f"{args.memory} idle thread ranks: {bytes_per_rank(args.memory) / 1024:.1f} KiB each")
        return 0
    sizes = [int(p) for p in args.ranks.split(",")]
    runs = {"this": None}
    if args.against:
        runs["other"] = other_run_threads(args.against)
        print(f"# other: {args.against}")
    rounds: dict[tuple[str, int], list[float]] = {(k, p): [] for k in runs for p in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            for name, run in runs.items():
                rounds[name, size].append(seconds_per_message(size, args.messages, run,
                                                              args.length))  # fmt: skip
    print(f"{'':>5} {'P':>6} {'messages':>10} {'us/message':>11} {'ratio':>7}  rounds (us)")
    for name in runs:
        base = statistics.median(rounds[name, sizes[0]])
        for size in sizes:
            median = statistics.median(rounds[name, size])
            every = " ".join(f"{s * 1e6:.1f}" for s in rounds[name, size])
            figures = f"{messages(size):>10} {median * 1e6:>11.2f} {median / base:>7.2f}"
            print(f"{name:>5} {size:>6} {figures}  {every}")
    if args.against:
        print_paired(rounds, sizes)
    return 0


def print_paired(rounds: dict[tuple[str, int], list[float]], sizes: list[int]) -> None:
    """The median over rounds of other/this, each ratio taken within one round."""
    for size in sizes:
        ratios = [o / t for o, t in zip(rounds["other", size], rounds["this", size], strict=True)]
        every = " ".join(f"{r:.2f}" for r in ratios)
        print(f"other/this {size:>6}: median {statistics.median(ratios):.2f}  rounds {every}")
