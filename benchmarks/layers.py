"""Where a --model network's local gradient spends its time, layer by layer and kernel by kernel.

    python benchmarks/layers.py                               # simple-cnn, float32, 64 samples
    python benchmarks/layers.py --batch 256 --repeats 3       # the issue's batch
    python benchmarks/layers.py --model "conv(16, 3, pad=1) batchnorm relu maxpool(2) flatten dense"
    python benchmarks/layers.py --model lenet5 --dtype float64 --batch 256 --exact

One `nn.local.local_gradient` call (the step's forward and backward passes over one shard, one BLAS
thread) is timed `--repeats` times after one burn-in call, in this thread's CPU seconds
(`time.thread_time`: steadier than wall-clock on a shared machine; the passes run on the calling
thread). Each layer's `forward_`, `backward_sums_` and `backward_input_` are wrapped with a timer.

The first table has a row per layer: its forward and backward milliseconds (sums and input
gradient together), the GFLOP/s of its products (2 x `Layer.multiply_adds` per sample forward,
twice that backward, once for the first layer, which needs no input gradient), and its GEMM floor:
its floating-point operations at the best single-thread GEMM rate measured in the same process
(the better of the step's largest product and a 512^3 one, as benchmarks/peers.py's floor), and
floor / its time. A layer without products (relu, maxpool, batchnorm, flatten) has a floor of 0;
a relu applied in the passes of the layer before it (absorbed) shows no time of its own. The rows
are in the network's order; the slowest layer against its floor is named at the end.

The second table takes the time apart by kernel: the numerics' products (`matmul_`,
`outer_sum_`), float mode's conv kernels (`conv_forward_`, `conv_forward_planes_`, `conv_sums_`,
`conv_input_grad_`, and the channels-last `conv_forward_last_`, `conv_sums_last_`,
`conv_input_grad_last_`), exact and narrow mode's conv gathers and scatters (`im2col_`, `col2im_`,
`rows_to_channels_`, `channels_to_rows_`) and max pooling's (`max_pool_`, `max_pool_backward_`); a
kernel is counted in its layer's row too. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.*

KERNELS = {
    "conv": ("conv_forward_", "conv_forward_planes_", "conv_sums_", "conv_input_grad_",
             "conv_forward_last_", "conv_sums_last_", "conv_input_grad_last_", "im2col_",
             "col2im_", "rows_to_channels_", "channels_to_rows_"),
    "maxpool": ("max_pool_", "max_pool_backward_"),
}  # fmt: skip
SQUARE = 512  # the other product the GEMM rate is measured on
MAX_ROWS = 8192  # a product's rows beyond these do not change its rate


def timed(counter: dict[str, float], label: str, function: Callable) -> Callable:
    """`function`, adding its CPU seconds to counter[label] at every call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            counter[label] += time.thread_time() - started

    return wrapper


def gemm_rate(net: Any, batch: int, dtype: str) -> float:
    """The best FLOP/s of a few calls of the step's largest product and a 512^3 one, through the
    kernels' BLAS (from Numba, one thread)."""
    from numba import njit

    from benchmarks.peers import largest_product

    @njit(nogil=True)
    def product(a, b, out, times):  # type: ignore[no-untyped-def]
        for _ in range(times):
            np.dot(a, b, out)

    m, k, n = largest_product(net, batch)
    rng = np.random.default_rng(0)
    best = 0.0
    for rows, inner, cols in ((min(m, MAX_ROWS), k, n), (SQUARE, SQUARE, SQUARE)):
        a, b = rng.random((rows, inner)).astype(dtype), rng.random((inner, cols)).astype(dtype)
        out = np.empty((rows, cols), dtype)
        product(a, b, out, 1)
        repeats = max(1, int(2e9 // (2 * rows * inner * cols)))  # about 2 GFLOP a measurement
        for _ in range(3):
            started = time.thread_time()
            product(a, b, out, repeats)
            best = max(best, 2 * rows * inner * cols * repeats / (time.thread_time() - started))
    return best


def wrap(net: Any, nx: Any, parts: dict[str, float]) -> None:
    """Time every layer's passes and the kernels of KERNELS and the numerics' products."""
    import importlib

    for layer in net.layers:
        for method in ("forward_", "backward_sums_", "backward_input_"):
            label = f"{layer.position} {method}"
            setattr(layer, method, timed(parts, label, getattr(layer, method)))
    for method in ("matmul_", "outer_sum_"):
        setattr(nx, method, timed(parts, f"numerics {method}", getattr(nx, method)))
    for name, kernels in KERNELS.items():
        module = importlib.import_module(f"syncsgd.nn.layers.{name}")
        for kernel in kernels:
            setattr(module, kernel, timed(parts, f"{name} {kernel}", getattr(module, kernel)))


def layer_rows(net: Any, parts: dict[str, float], repeats: int, batch: int,
               rate: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per layer: its name, forward and backward ms per call, flops each way, floor ms."""
    out = []
    for layer in net.layers:
        forward = parts.get(f"{layer.position} forward_", 0.0) / repeats
        backward = (parts.get(f"{layer.position} backward_sums_", 0.0)
                    + parts.get(f"{layer.position} backward_input_", 0.0)) / repeats  # fmt: skip
        flops_forward = 2 * batch * layer.multiply_adds()
        flops_backward = flops_forward * (1 if layer.position == 0 else 2)
        name = f"{layer.position} {layer.describe()}"
        if layer.position in net.absorbed:
            name += " (absorbed)"
        out.append({"layer": name, "forward": forward, "backward": backward,
                    "flops_forward": flops_forward, "flops_backward": flops_backward,
                    "floor": (flops_forward + flops_backward) / rate})  # fmt: skip
    return out


def print_layers(rows: list[dict[str, Any]], seconds: float) -> None:
    """The per-layer table and the slowest layer against its floor."""
    print(f"{'layer':>36} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} {'fwd GF/s':>8} "
          f"{'bwd GF/s':>8} {'floor ms':>8} {'floor/t':>7}")  # fmt: skip
    for row in rows:
        total = row["forward"] + row["backward"]
        rates = [f"{flops / t / 1e9:8.1f}" if flops and t else f"{'-':>8}" for flops, t in
                 ((row["flops_forward"], row["forward"]),
                  (row["flops_backward"], row["backward"]))]  # fmt: skip
        share = f"{row['floor'] / total:7.2f}" if row["floor"] and total else f"{'-':>7}"
        print(f"{row['layer']:>36} {row['forward'] * 1e3:8.1f} {row['backward'] * 1e3:8.1f} "
              f"{100 * total / seconds:5.1f}% {rates[0]} {rates[1]} {row['floor'] * 1e3:8.1f} "
              f"{share}")  # fmt: skip
    outside = seconds - sum(row["forward"] + row["backward"] for row in rows)
    print(f"{'outside the layers':>36} {outside * 1e3:8.1f} ms {100 * outside / seconds:5.1f}% "
          "(the loss, the sums exact mode extracts after the passes)")  # fmt: skip
    beyond = max(rows, key=lambda row: row["forward"] + row["backward"] - row["floor"])
    print(f"# the most time beyond its floor: {beyond['layer']}, "
          f"{(beyond['forward'] + beyond['backward'] - beyond['floor']) * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    """Time the passes and print the layers' table and the kernels', largest first."""
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
    from syncsgd.nn.local import local_gradient
    from syncsgd.nn.network import build

    limit_blas_threads(1)
    net = build(options.model, options.input_shape, options.classes, "xent", options.dtype)
    gradient = local_gradient(net, options.batch, exact=options.exact)
    rng = np.random.default_rng(0)
    X = rng.random((options.batch, int(np.prod(options.input_shape)))).astype(options.dtype)
    y = rng.integers(0, options.classes, options.batch)
    params, grad = net.init_params(0), np.zeros(net.n_params, options.dtype)
    running = net.init_running() if net.n_running else None  # batchnorm's statistics
    gradient(params, X, y, grad, running=running)  # burn-in: kernels loaded, workspaces touched
    # Wrapped after the burn-in: a kernel that calls another (conv_forward_ calls im2col_) is
    # compiled by then, with the kernel itself rather than the Python wrapper.
    parts: dict[str, float] = collections.defaultdict(float)
    wrap(net, gradient.nx, parts)
    started = time.thread_time()
    for _ in range(options.repeats):
        gradient(params, X, y, grad, running=running)
    seconds = (time.thread_time() - started) / options.repeats
    rate = gemm_rate(net, options.batch, options.dtype)
    flops = 2 * options.batch * sum(net.step_multiply_adds())
    mode = "exact" if options.exact else "float"
    print(f"# {net.summary()} on {','.join(map(str, options.input_shape))}, {options.dtype}, "
          f"{mode} mode, {options.batch} samples: {seconds * 1e3:.1f} CPU ms per call, "
          f"{flops / seconds / 1e9:.1f} GFLOP/s of its products; mean of {options.repeats}; "
          f"GEMM rate {rate / 1e9:.1f} GFLOP/s, floor {flops / rate * 1e3:.1f} ms, "
          f"floor / call {flops / rate / seconds:.2f}")  # fmt: skip
    print_layers(layer_rows(net, parts, options.repeats, options.batch, rate), seconds)
    print(f"{'kernel':>36} {'ms':>8} {'share':>6}")
    kernels = {label: total for label, total in parts.items() if not label[0].isdigit()}
    for label, total in sorted(kernels.items(), key=lambda item: -item[1]):
        share = total / options.repeats / seconds
        if share >= 0.005:
            print(f"{label:>36} {total / options.repeats * 1e3:8.1f} {100 * share:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
