"""Timing of the kernel benchmarks: calls run together on threads, rounds interleaved.

A round times every group of calls in turn, so a noisy neighbour slows all of them alike; the
benchmarks quote the median over rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

Key = TypeVar("Key")

# wall: elapsed time, what a user waits; cpu: CPU seconds of all the process's threads, steadier on
# a loaded machine but it also counts BLAS worker threads that spin while waiting.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def seconds_per_call(calls: list[Callable], iters: int, clock: str = "wall") -> float:
    """Seconds per call when every thread runs its call `iters` times at once (one call: no thread).

    wall: the slowest thread's elapsed time, after a barrier releases them together; cpu: the
    process's CPU seconds divided by the number of calls.
    """
    if clock == "cpu":
        started = time.process_time()
        seconds_per_call(calls, iters)
        return (time.process_time() - started) / iters / len(calls)
    if len(calls) == 1:
        started = time.perf_counter()
        for _ in range(iters):
            calls[0]()
        return (time.perf_counter() - started) / iters
    barrier = threading.Barrier(len(calls))
    seconds = [0.0] * len(calls)

    def work(index: int) -> None:
        barrier.wait()
        started = time.perf_counter()
        for _ in range(iters):
            calls[index]()
        seconds[index] = time.perf_counter() - started

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(seconds) / iters


def interleaved_rounds(
    groups: Mapping[Key, list[Callable]], warmup: int, rounds: int, iters: int, clock: str = "wall"
) -> dict[Key, list[float]]:
    """Per key, `rounds` samples of `seconds_per_call`, after `warmup` burn-in calls of each."""
    for calls in groups.values():
        if warmup:
            seconds_per_call(calls, warmup)
    samples: dict[Key, list[float]] = {key: [] for key in groups}
    for _ in range(rounds):
        for key, calls in groups.items():
            samples[key].append(seconds_per_call(calls, iters, clock))
    return samples
