"""Where a --model network's local gradient spends its time, layer by layer and kernel by kernel.

    python benchmarks/layers.py                               # simple-cnn, float32, 64 samples
    python benchmarks/layers.py --model lenet5 --dtype float64 --batch 256 --exact

One `nn.local.local_gradient` call (the step's forward and backward passes over one shard, one BLAS
thread) is timed `--repeats` times after one burn-in call, in this thread's CPU seconds
(`time.thread_time`: steadier than wall-clock on a shared machine; the passes run on the calling
thread). Each layer's `forward_`, `backward_sums_` and `backward_input_`, the numerics' products
(`matmul_`, `outer_sum_`) and the conv layer's gather and scatter kernels (`im2col_`, `col2im_`,
`rows_to_channels_`, `channels_to_rows_`) are wrapped with a timer; a product is counted both in
its layer's row and in the numerics' row. The GFLOP/s are the layers' products' 2 x multiply-adds
(`Network.step_multiply_adds`) over the whole call. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def timed(counter: dict[str, float], label: str, function: Callable) -> Callable:
    """`function`, adding its CPU seconds to counter[label] at every call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            counter[label] += time.thread_time() - started

    return wrapper


def main(argv: list[str] | None = None) -> int:
    """Time the passes and print the parts, largest first."""
    from syncsgd.util.argtypes import dimensions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="simple-cnn", help="a --model spec (simple-cnn)")
    parser.add_argument("--input-shape", type=dimensions, default=(1, 28, 28), help="(1,28,28)")
    parser.add_argument("--classes", type=int, default=10, help="(10)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--batch", type=int, default=64, help="samples in the shard (64)")
    parser.add_argument("--exact", action="store_true", help="exact mode's passes")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (3)")
    options = parser.parse_args(argv)

    from syncsgd.nn.kernels import limit_blas_threads
    from syncsgd.nn.layers import conv
    from syncsgd.nn.local import local_gradient
    from syncsgd.nn.network import build

    limit_blas_threads(1)
    net = build(options.model, options.input_shape, options.classes, "xent", options.dtype)
    gradient = local_gradient(net, options.batch, exact=options.exact)
    parts: dict[str, float] = collections.defaultdict(float)
    for layer in net.layers:
        for method in ("forward_", "backward_sums_", "backward_input_"):
            label = f"{layer.position} {layer.describe()} {method}"
            setattr(layer, method, timed(parts, label, getattr(layer, method)))
    for method in ("matmul_", "outer_sum_"):
        product = getattr(gradient.nx, method)
        setattr(gradient.nx, method, timed(parts, f"numerics {method}", product))
    for kernel in ("im2col_", "col2im_", "rows_to_channels_", "channels_to_rows_"):
        setattr(conv, kernel, timed(parts, f"conv {kernel}", getattr(conv, kernel)))

    rng = np.random.default_rng(0)
    X = rng.random((options.batch, int(np.prod(options.input_shape)))).astype(options.dtype)
    y = rng.integers(0, options.classes, options.batch)
    params, grad = net.init_params(0), np.zeros(net.n_params, options.dtype)
    gradient(params, X, y, grad)  # burn-in: kernels loaded, workspaces touched
    parts.clear()
    started = time.thread_time()
    for _ in range(options.repeats):
        gradient(params, X, y, grad)
    seconds = (time.thread_time() - started) / options.repeats
    flops = 2 * options.batch * sum(net.step_multiply_adds())
    mode = "exact" if options.exact else "float"
    print(f"# {net.summary()} on {','.join(map(str, options.input_shape))}, {options.dtype}, "
          f"{mode} mode, {options.batch} samples: {seconds * 1e3:.1f} CPU ms per call, "
          f"{flops / seconds / 1e9:.1f} GFLOP/s of its products; mean of {options.repeats}")
    for label, total in sorted(parts.items(), key=lambda item: -item[1]):
        share = total / options.repeats / seconds
        if share >= 0.005:
            print(f"{label:>48} {total / options.repeats * 1e3:9.1f} ms {100 * share:6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
