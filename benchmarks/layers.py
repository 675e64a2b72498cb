"""Where a --model network's local gradient spends its time, layer by layer and kernel by kernel.

    python benchmarks/layers.py                               # simple-cnn, float32, 64 samples
    python benchmarks/layers.py --batch 256 --repeats 3       # the issue's batch
    python benchmarks/layers.py --model "conv(16, 3, pad=1) batchnorm relu maxpool(2) flatten dense"
    python benchmarks/layers.py --model lenet5 --dtype float64 --batch 256 --exact
    python benchmarks/layers.py --model "gpt(layers=2,d=128,heads=4)" --context 64 --batch 32

One `nn.local.local_gradient` call (the step's forward and backward passes over one shard, one BLAS
thread) is timed `--repeats` times after one burn-in call, in this thread's CPU seconds
(`time.thread_time`: steadier than wall-clock on a shared machine; the passes run on the calling
thread). Each layer's `forward_`, `backward_sums_` and `backward_input_` are wrapped with a timer.
The shard: random samples of `--input-shape` and labels of `--classes`; for a token model (a
--model that starts with embed, as gpt(...)) the first `--batch` windows of `--context` characters
of numbers-to-words and their next characters, as `syncsgd train --data numbers-to-words` reads
them (the loss over the B x T tokens, as many outputs as the text's characters).

The first table has a row per layer: its forward and backward milliseconds (sums and input
gradient together), the GFLOP/s of its products (2 x `Layer.multiply_adds` per sample forward,
twice that backward, once for the first layer, which needs no input gradient), and its GEMM floor:
its floating-point operations at the best single-thread GEMM rate measured in the same process
(the better of the step's largest product and a 512^3 one, as benchmarks/peers.py's floor), and
floor / its time. A layer without products (relu, maxpool, batchnorm, flatten) has a floor of 0;
a relu applied in the passes of the layer before it (absorbed) shows no time of its own. The rows
are in the network's order. A transformer block's row is followed by a row per piece, in the
order its passes run them (ln1, in_proj, attention, out_proj, ln2, fc1, gelu, fc2; attention the
core between the projections, its q k^T and P v products `Block.attention_multiply_adds`), and
`rest`, the block's time outside them (the residual sums). embed's products: none forward, the
one-hot rows of its T tokens times the gradient at its output backward (T x V x d a sample). The
slowest layer against its floor (a block's slowest piece) is named at the end.

The second table takes the time apart by kernel: the numerics' products (`matmul_`,
`outer_sum_`), float mode's conv kernels (`conv_forward_`, `conv_forward_planes_`, `conv_sums_`,
`conv_input_grad_`, and the channels-last `conv_forward_last_`, `conv_sums_last_`,
`conv_input_grad_last_`), exact and narrow mode's conv gathers and scatters (`im2col_`, `col2im_`,
`rows_to_channels_`, `channels_to_rows_`) and max pooling's (`max_pool_`, `max_pool_backward_`),
and for a token model every Numba kernel of embed, block, layernorm and gelu that Python calls; a
kernel is counted in its layer's row too (a kernel another kernel calls, in its caller's). Nothing
is asserted.
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
# Token models' modules: every Numba kernel defined in them is timed (called from Python)
TOKEN_MODULES = ("embed", "block", "layernorm", "gelu")
# The pieces of a layer made of layers (the transformer block), in the order its passes run them;
# "attention" is the core between in_proj and out_proj (scores, softmax, values)
PIECES = {"block": ("ln1", "in_proj", "attention", "out_proj", "ln2", "fc1", "gelu", "fc2")}
ATTENTION_METHODS = {"_attention_": "forward_", "_attention_backward_": "backward_input_"}
SQUARE = 512  # the other product the GEMM rate is measured on
MAX_ROWS = 8192  # a product's rows beyond these do not change its rate
CONTEXT = 64  # a token model's window, characters


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
    """Time every layer's passes and its pieces', the kernels of KERNELS (and of TOKEN_MODULES for
    a token model) and the numerics' products."""
    import importlib

    for layer in net.layers:
        wrap_passes(layer, str(layer.position), parts)
        for piece in PIECES.get(layer.kind, ()):
            label = f"{layer.position}.{piece}"
            if piece != "attention":
                wrap_passes(getattr(layer, piece), label, parts)
                continue
            for method, pass_ in ATTENTION_METHODS.items():
                setattr(layer, method, timed(parts, f"{label} {pass_}", getattr(layer, method)))
    for method in ("matmul_", "outer_sum_"):
        setattr(nx, method, timed(parts, f"numerics {method}", getattr(nx, method)))
    for name, kernels in KERNELS.items():
        module = importlib.import_module(f"syncsgd.nn.layers.{name}")
        for kernel in kernels:
            setattr(module, kernel, timed(parts, f"{name} {kernel}", getattr(module, kernel)))
    if net.layers[0].kind == "embed":
        wrap_module_kernels(TOKEN_MODULES, parts)


def wrap_passes(layer: Any, label: str, parts: dict[str, float]) -> None:
    """Time a layer's three passes under `label`."""
    for method in ("forward_", "backward_sums_", "backward_input_"):
        setattr(layer, method, timed(parts, f"{label} {method}", getattr(layer, method)))


def wrap_module_kernels(names: tuple[str, ...], parts: dict[str, float]) -> None:
    """Time every Numba kernel each module of syncsgd.nn.layers defines, when Python calls it (a
    kernel that another kernel calls counts in its caller's time)."""
    import importlib

    from numba.core.registry import CPUDispatcher

    for name in names:
        module = importlib.import_module(f"syncsgd.nn.layers.{name}")
        for kernel, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                setattr(module, kernel, timed(parts, f"{name} {kernel}", value))


def layer_flops(layer: Any, batch: int) -> tuple[int, int]:
    """(forward, backward) floating-point operations of a layer's products for `batch` samples:
    2 x its multiply-adds forward; backward each product twice (the parameters' sums, the gradient
    at its input), once for the first layer; embed's backward is its one product, the one-hot
    rows of the T tokens times the gradient at its output (T x V x d a sample)."""
    if layer.kind == "embed":
        positions, d = layer.out_shape
        return 0, 2 * batch * positions * layer.vocabulary * d
    forward = 2 * batch * layer.multiply_adds()
    return forward, forward * (1 if layer.position == 0 else 2)


def piece_flops(layer: Any, piece: str, batch: int) -> tuple[int, int]:
    """(forward, backward) floating-point operations of a piece of a layer (never its first)."""
    madds = layer.attention_multiply_adds() if piece == "attention" else (
        getattr(layer, piece).multiply_adds())  # fmt: skip
    return 2 * batch * madds, 4 * batch * madds


def row(name: str, label: str, parts: dict[str, float], repeats: int,
        flops: tuple[int, int], rate: float) -> dict[str, Any]:  # fmt: skip
    """A table row: the passes timed under `label`, per call, and the flops and floor."""
    forward = parts.get(f"{label} forward_", 0.0) / repeats
    backward = (parts.get(f"{label} backward_sums_", 0.0)
                + parts.get(f"{label} backward_input_", 0.0)) / repeats  # fmt: skip
    return {"layer": name, "forward": forward, "backward": backward, "flops_forward": flops[0],
            "flops_backward": flops[1], "floor": sum(flops) / rate, "pieces": []}  # fmt: skip


def layer_rows(net: Any, parts: dict[str, float], repeats: int, batch: int,
               rate: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per layer: its name, forward and backward ms per call, flops each way, floor ms; and its
    pieces' rows, with the time of the layer outside them (`rest`)."""
    out = []
    for layer in net.layers:
        name = f"{layer.position} {layer.describe()}"
        if layer.position in net.absorbed:
            name += " (absorbed)"
        whole = row(name, str(layer.position), parts, repeats, layer_flops(layer, batch), rate)
        for piece in PIECES.get(layer.kind, ()):
            inner = "" if piece == "attention" else f" {getattr(layer, piece).describe()}"
            whole["pieces"].append(row(f"{layer.position}.{piece}{inner}",
                                       f"{layer.position}.{piece}", parts, repeats,
                                       piece_flops(layer, piece, batch), rate))  # fmt: skip
        if whole["pieces"]:
            rest = row(f"{layer.position}.rest", "", parts, repeats, (0, 0), rate)
            rest["forward"] = whole["forward"] - sum(p["forward"] for p in whole["pieces"])
            rest["backward"] = whole["backward"] - sum(p["backward"] for p in whole["pieces"])
            whole["pieces"].append(rest)
        out.append(whole)
    return out


def print_row(row: dict[str, Any], seconds: float) -> None:
    """One row of the layers' table."""
    total = row["forward"] + row["backward"]
    # three significant digits: a tiny layer's rate is not printed as 0.0
    rates = [f"{flops / t / 1e9:8.3g}" if flops and t else f"{'-':>8}" for flops, t in
             ((row["flops_forward"], row["forward"]),
              (row["flops_backward"], row["backward"]))]  # fmt: skip
    share = f"{row['floor'] / total:7.2f}" if row["floor"] and total else f"{'-':>7}"
    print(f"{row['layer']:>36} {row['forward'] * 1e3:8.1f} {row['backward'] * 1e3:8.1f} "
          f"{100 * total / seconds:5.1f}% {rates[0]} {rates[1]} {row['floor'] * 1e3:8.1f} "
          f"{share}")  # fmt: skip


def print_layers(rows: list[dict[str, Any]], seconds: float) -> None:
    """The per-layer table and the slowest layer against its floor."""
    print(f"{'layer':>36} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} {'fwd GF/s':>8} "
          f"{'bwd GF/s':>8} {'floor ms':>8} {'floor/t':>7}")  # fmt: skip
    for each in (one for row in rows for one in (row, *row["pieces"])):
        print_row(each, seconds)
    outside = seconds - sum(row["forward"] + row["backward"] for row in rows)
    print(f"{'outside the layers':>36} {outside * 1e3:8.1f} ms {100 * outside / seconds:5.1f}% "
          "(the loss, the sums exact mode extracts after the passes)")  # fmt: skip
    finest = [one for row in rows for one in (row["pieces"] or [row])]  # a block: its pieces
    beyond = max(finest, key=lambda row: row["forward"] + row["backward"] - row["floor"])
    print(f"# the most time beyond its floor: {beyond['layer']}, "
          f"{(beyond['forward'] + beyond['backward'] - beyond['floor']) * 1e3:.1f} ms")


def problem(options: argparse.Namespace) -> tuple[Any, np.ndarray, np.ndarray]:
    """The network and one shard of samples and labels: a token model (a --model that starts
    with embed) on the first windows of numbers-to-words as train reads them, else random
    samples of --input-shape."""
    from benchmarks.peers import reads_tokens
    from syncsgd.nn.network import build

    if reads_tokens(options.model):
        from syncsgd.training.config import TrainConfig
        from syncsgd.training.run import prepare

        run = prepare(TrainConfig(model=options.model, data="numbers-to-words",
                                  context=options.context or CONTEXT, samples=options.batch,
                                  batch_size=options.batch, steps=1, dtype=options.dtype,
                                  seed=0))  # fmt: skip
        return run.model, run.X[: options.batch], run.y[: options.batch]
    if options.context is not None:
        raise ValueError(f"--context is the window of a token model (a --model that starts "
                         f"with embed, e.g. gpt(layers=2,d=128,heads=4)), not of "
                         f"{options.model}")  # fmt: skip
    net = build(options.model, options.input_shape, options.classes, "xent", options.dtype)
    rng = np.random.default_rng(0)
    X = rng.random((options.batch, int(np.prod(options.input_shape)))).astype(options.dtype)
    return net, X, rng.integers(0, options.classes, options.batch)


def main(argv: list[str] | None = None) -> int:
    """Time the passes and print the layers' table and the kernels', largest first."""
    from syncsgd.util.argtypes import dimensions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="simple-cnn", help="a --model spec (simple-cnn)")
    parser.add_argument("--input-shape", type=dimensions, default=(1, 28, 28), help="(1,28,28)")
    parser.add_argument("--classes", type=int, default=10, help="(10)")
    parser.add_argument("--context", type=int, help=f"a token model's window T ({CONTEXT})")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--batch", type=int, default=64, help="samples in the shard (64)")
    parser.add_argument("--exact", action="store_true", help="exact mode's passes")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (3)")
    options = parser.parse_args(argv)

    from syncsgd.nn.kernels import limit_blas_threads
    from syncsgd.nn.local import local_gradient

    limit_blas_threads(1)
    try:
        net, X, y = problem(options)
    except ValueError as exc:
        parser.error(str(exc))
    gradient = local_gradient(net, options.batch, exact=options.exact)
    params = net.init_params(0)
    grad = np.zeros(net.n_params, options.dtype)
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
    rows = layer_rows(net, parts, options.repeats, options.batch, rate)
    flops = sum(row["flops_forward"] + row["flops_backward"] for row in rows)
    mode = "exact" if options.exact else "float"
    print(f"# {net.summary()} on {','.join(map(str, net.in_shape))}, {options.dtype}, "
          f"{mode} mode, {options.batch} samples: {seconds * 1e3:.1f} CPU ms per call, "
          f"{flops / seconds / 1e9:.1f} GFLOP/s of its products; mean of {options.repeats}; "
          f"GEMM rate {rate / 1e9:.1f} GFLOP/s, floor {flops / rate * 1e3:.1f} ms, "
          f"floor / call {flops / rate / seconds:.2f}")  # fmt: skip
    print_layers(rows, seconds)
    print(f"{'kernel':>36} {'ms':>8} {'share':>6}")
    kernels = {label: total for label, total in parts.items() if not label[0].isdigit()}
    for label, total in sorted(kernels.items(), key=lambda item: -item[1]):
        share = total / options.repeats / seconds
        if share >= 0.005:
            print(f"{label:>36} {total / options.repeats * 1e3:8.1f} {100 * share:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
