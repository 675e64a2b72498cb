"""syncsgd's training step against PyTorch DDP (gloo) and JAX pmap: same MLP, batch and cores.

    pip install -e '.[peers]'                 # PyTorch (CPU) and JAX; each is skipped if missing
    python benchmarks/peers.py                # P = 1, 2; float32, float64; 5 rounds of 20 steps
    python benchmarks/peers.py --ranks 2 --dtypes float32 --rounds 9 --json peers.json
    python benchmarks/peers.py --model simple-cnn --steps 3 --warmup 2   # the CNN, 1x28x28 inputs
    python benchmarks/peers.py --model "gpt(layers=2,d=128,heads=4)" --batch 32 --context 64
    python benchmarks/peers.py --model simple-cnn --before ../before   # and the code before

What is timed: one synchronous data-parallel SGD step of an MLP 784-256-256-10 (relu, softmax
cross-entropy, plain SGD at lr 0.01) on a global batch of 256 samples drawn from 2048 synthetic
ones, split over P ranks, each rank on its own core:
  syncsgd  `train_rank` on P thread ranks (the training loop a user runs; the steady state, its
           first step left out), one BLAS thread per rank;
  ddp      PyTorch DistributedDataParallel over gloo, P processes, torch.set_num_threads(1);
  jax      `jax.pmap` over P forced host devices (XLA_FLAGS=
           --xla_force_host_platform_device_count=P), the gradient averaged with `lax.pmean`,
           the update inside the pmapped step.
`--model SPEC` times any syncsgd --model network instead (conv, pooling, flatten, dense, relu,
tanh, batchnorm; `--input-shape`, default 1,28,28): the same synthetic samples read as images,
PyTorch's nn.Sequential of the same layers under DDP; JAX's contender is the MLP's only.
A --model that starts with embed (`gpt(...)`) reads token data instead: windows of `--context`
characters of numbers-to-words (2048 of them, syncsgd's token data), the loss the mean over the
B x T tokens; PyTorch's contender is `benchmarks/transformer.py`'s module (nn.Embedding,
nn.MultiheadAttention with a causal mask, nn.LayerNorm, nn.Linear, GELU) under DDP. `--batch`
sets the global batch (256; the issue's transformer figures take 32).
`--before TREE` adds syncsgd's step as another tree runs it (the code before a change: that
tree's own benchmarks/peers.py serves it, with PYTHONPATH at the tree), in the same rounds, and
the median of the rounds' ratios syncsgd / before.
Every contender gathers its shard from the sample array each step, and each runs in its own
process, pinned to the first P cores, kept alive across rounds. A round asks every contender in
turn for `--steps` steps (interleaved, so a noisy neighbour slows all alike); the median over
rounds of the ms per step is quoted, and the median over rounds of each round's ratio syncsgd /
peer (steadier on a busy machine than the ratio of the medians).

JAX on CPU with several devices was seen to hang in a collective rendezvous on the development
machine when steps were dispatched ahead without waiting for them: here every step is awaited
(`block_until_ready` on the new parameters) before the next is dispatched, which is also how
the other contenders run.

The GEMM floor (P = 1): the step's floating-point operations (2 x its layers' multiply-adds,
forward and backward, `Network.step_multiply_adds`) divided by the best single-core GEMM rate
measured in the same run: the better of the step's largest product (a 256 x 784 x 256 for the
MLP; a conv's im2col product, its rows capped at 8192; a block's fc1) and a 512^3 product,
through the kernels' BLAS (SciPy's OpenBLAS, from Numba, one thread); the share is floor /
syncsgd's step. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.*

SIZES = (784, 256, 256, 10)
BATCH, SAMPLES, LR, SEED = 256, 2048, 0.01, 0
PEERS = {"ddp": "torch", "jax": "jax"}
GEMM_SHAPE = (256, 784, 256)  # the MLP's largest product (m, k, n)
SQUARE = (512, 512, 512)  # the other product the floor's GEMM rate is measured on
MAX_ROWS = 8192  # a product's rows beyond these do not change its rate


class Workload(NamedTuple):
    """What every contender trains: the --model spec (None: the MLP), its input shape, the
    global batch, and token data's window."""

    model: str | None
    shape: tuple[int, ...]
    batch: int
    context: int


def reads_tokens(model: str | None) -> bool:
    """Whether the --model spec starts with embed: it trains on token data."""
    from syncsgd.nn.network import parse_spec

    return model is not None and parse_spec(model)[0].kind == "embed"


def network(model: str | None, shape: tuple[int, ...], dtype: str = "float64",
            context: int = 0) -> Any:  # fmt: skip
    """syncsgd's Network of the run: the --model spec on `shape` (token data: on `context`
    positions, as many outputs as the text's characters), or the MLP."""
    from syncsgd.nn.mlp import mlp
    from syncsgd.nn.network import build

    if model is None:
        return mlp(SIZES, "relu", loss="xent", dtype=np.dtype(dtype))
    if reads_tokens(model):
        from syncsgd.training.run import prepare

        return prepare(syncsgd_config(dtype, 1, model, (), 1, context)).model
    return build(model, shape, SIZES[-1], "xent", dtype)


def step_flops(net: Any = None, batch: int = BATCH) -> int:
    """Multiply-adds x 2 of one step (the MLP's by default): forward, weight gradients, deltas
    below the first layer."""
    return 2 * batch * sum((net or network(None, ())).step_multiply_adds())


def largest_product(net: Any, batch: int = BATCH) -> tuple[int, int, int]:
    """(m, k, n) of the step's largest product: a dense layer's, or a conv's im2col one."""
    shapes = []
    for layer in net.layers:
        if layer.kind == "dense":
            shapes.append((batch * layer.positions, layer.in_shape[-1], layer.out_shape[-1]))
        elif layer.kind == "block":  # its widest product: fc1, d to 4d at every position
            shapes.append((batch * layer.in_shape[0], layer.d, 4 * layer.d))
        elif layer.kind == "conv":
            positions = layer.out_shape[1] * layer.out_shape[2]
            shapes.append((batch * positions, layer.in_shape[0] * layer.kernel ** 2,
                           layer.out_channels))  # fmt: skip
    return max(shapes, key=lambda mkn: mkn[0] * mkn[1] * mkn[2])


def pin(ranks: int) -> None:
    """Run this process (and the processes it starts) on the first `ranks` cores, if there are."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= ranks:
        os.sched_setaffinity(0, cores[:ranks])


def shared_data(dtype: str, model: str | None = None,
                context: int = 0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The samples and labels every contender trains on (syncsgd's synthetic or token data)."""
    from syncsgd.training.run import prepare

    run = prepare(syncsgd_config(dtype, 1, model if reads_tokens(model) else None, (), 1,
                                 context))  # fmt: skip
    return np.ascontiguousarray(run.X), np.ascontiguousarray(run.y, dtype=np.int64)


def syncsgd_config(dtype: str, steps: int, model: str | None = None,
                   shape: tuple[int, ...] = (), batch: int = BATCH, context: int = 0) -> Any:
    """The TrainConfig of the benchmark's run: the MLP, or the --model spec on `shape`, or on
    windows of `context` characters of numbers-to-words for a spec that starts with embed."""
    from syncsgd.training.config import TrainConfig

    layers: dict[str, Any] = {"hidden": SIZES[1:-1], "activation": "relu"}
    if reads_tokens(model):
        layers = {"model": model, "data": "numbers-to-words", "context": context}
    elif model is not None:
        layers = {"model": model, "input_shape": shape}
    classes = None if reads_tokens(model) else SIZES[-1]  # token data: its vocabulary
    return TrainConfig(samples=SAMPLES, features=SIZES[0], classes=classes, batch_size=batch,
                       steps=steps, lr=LR, seed=SEED, dtype=dtype, loss="xent",
                       **layers)  # fmt: skip


def torch_sequential(net: Any) -> Any:
    """PyTorch's nn.Sequential of the same layers as a syncsgd Network (PyTorch's own init)."""
    import torch
    from torch import nn

    if net.layers[0].kind == "embed":  # the gpt preset: embed, blocks, layernorm, dense
        from benchmarks.transformer import torch_gpt

        blocks = [layer for layer in net.layers if layer.kind == "block"]
        positions, d = net.layers[0].out_shape
        heads = blocks[0].heads if blocks else 1
        return torch_gpt(torch, net.layers[-1].out_shape[-1], positions, d, heads, len(blocks))

    modules: list[nn.Module] = []
    for layer in net.layers:
        if layer.kind == "conv":
            modules.append(nn.Conv2d(layer.in_shape[0], layer.out_channels, layer.kernel,
                                     layer.stride, layer.pad))  # fmt: skip
        elif layer.kind in ("maxpool", "avgpool"):
            pool = nn.MaxPool2d if layer.kind == "maxpool" else nn.AvgPool2d
            modules.append(pool(layer.k, layer.stride))
        elif layer.kind == "batchnorm":
            norm = nn.BatchNorm2d if len(layer.in_shape) == 3 else nn.BatchNorm1d
            modules.append(norm(layer.in_shape[0] if len(layer.in_shape) == 3 else
                                layer.in_shape[-1]))  # fmt: skip
        elif layer.kind == "dense":
            modules.append(nn.Linear(layer.in_shape[-1], layer.out_shape[-1]))
        else:
            modules.append({"relu": nn.ReLU, "tanh": nn.Tanh, "flatten": nn.Flatten}[layer.kind]())
    return nn.Sequential(*modules)


def batches(seed: int, steps: int, batch: int = BATCH) -> list[np.ndarray]:
    """The global batches of `steps` steps: sample indices, the same on every rank."""
    rng = np.random.default_rng(seed)
    return [rng.choice(SAMPLES, batch, replace=False) for _ in range(steps)]


# --- contenders: each serves "N" on stdin with seconds per step on stdout ----------------------


def serve(measure: Any) -> None:
    """Answer 'N' lines with seconds per step over N steps until stdin closes."""
    print("ready", flush=True)
    for line in sys.stdin:
        print(repr(measure(int(line))), flush=True)


def serve_syncsgd(ranks: int, dtype: str, work: Workload) -> None:
    """syncsgd's training loop on `ranks` thread ranks; the steady state of each run."""
    from dataclasses import replace

    from syncsgd.comm.threads import run_threads
    from syncsgd.training.loop import train_rank
    from syncsgd.training.run import prepare

    run = prepare(syncsgd_config(dtype, 2, *work))

    def measure(steps: int) -> float:
        results = run_threads(ranks, train_rank, replace(run, steps=steps + 1), quiet=True)
        return max(r.steady_seconds for r in results) / results[0].steady_steps

    serve(measure)


def serve_gemm(dtype: str, work: Workload) -> None:
    """Seconds per step's worth of GEMM at the best rate of two products, one thread."""
    from numba import njit

    import syncsgd.nn.kernels  # noqa: F401  (chooses the BLAS kernels, as training does)

    @njit(nogil=True)
    def product(a, b, out, times):  # type: ignore[no-untyped-def]
        for _ in range(times):
            np.dot(a, b, out)

    net = network(work.model, work.shape, dtype, work.context)
    flops = step_flops(net, work.batch)
    m, k, n = largest_product(net, work.batch)
    rng = np.random.default_rng(SEED)
    operands = []
    for rows, inner, cols in ((min(m, MAX_ROWS), k, n), SQUARE):
        a, b = rng.random((rows, inner)).astype(dtype), rng.random((inner, cols)).astype(dtype)
        operands.append((a, b, np.empty((rows, cols), dtype)))
        product(*operands[-1], 3)

    def measure(steps: int) -> float:
        rates = []
        for a, b, out in operands:
            work = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            repeats = max(1, round(steps * flops / work / 2))  # half the step's time each
            started = time.perf_counter()
            product(a, b, out, repeats)
            rates.append(work * repeats / (time.perf_counter() - started))
        return flops / max(rates)

    serve(measure)


def ddp_rank(rank: int, ranks: int, dtype: str, port: int, commands: Any,
             work: Workload) -> None:  # fmt: skip
    """One PyTorch DDP rank: N from rank 0 by broadcast, N steps, the slowest rank's seconds."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks)  # fmt: skip
    torch_dtype = getattr(torch, dtype)
    tokens = reads_tokens(work.model)
    X, y = (torch.from_numpy(array) for array in shared_data(dtype, work.model, work.context))
    if tokens:  # token ids: syncsgd holds them as floats
        X = X.long()
    elif work.model is not None:
        X = X.reshape(len(X), *work.shape)
    torch.manual_seed(SEED)
    layers = torch_sequential(network(work.model, work.shape, context=work.context))
    ddp = nn.parallel.DistributedDataParallel(layers.to(torch_dtype))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    shard = slice(rank * work.batch // ranks, (rank + 1) * work.batch // ranks)
    request, elapsed = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.float64)
    for round_ in range(1 << 30):
        request[0] = int(commands.get()) if rank == 0 else 0
        dist.broadcast(request, 0)
        if request[0] == 0:
            break
        indices = [torch.from_numpy(b[shard])
                   for b in batches(round_, int(request[0]), work.batch)]  # fmt: skip
        dist.barrier()
        started = time.perf_counter()
        for index in indices:
            logits = ddp(X[index])
            if tokens:  # the mean over the shard's tokens: a sequence's T positions, each a term
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       y[index].reshape(-1))  # fmt: skip
            else:
                loss = F.cross_entropy(logits, y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        elapsed[0] = (time.perf_counter() - started) / len(indices)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(repr(float(elapsed[0])), flush=True)
    dist.destroy_process_group()


def serve_ddp(ranks: int, dtype: str, work: Workload) -> None:
    """PyTorch DDP: this process is rank 0, the others are spawned processes."""
    import queue
    import socket
    import threading

    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free port for gloo's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    others = [context.Process(target=ddp_rank, args=(r, ranks, dtype, port, None, work))
              for r in range(1, ranks)]  # fmt: skip
    for process in others:
        process.start()
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=relay_stdin, args=(commands,), daemon=True).start()
    ddp_rank(0, ranks, dtype, port, commands, work)
    for process in others:
        process.join()


def relay_stdin(commands: Any) -> None:
    """Pass the coordinator's step counts to rank 0; 0 when stdin closes."""
    print("ready", flush=True)
    for line in sys.stdin:
        commands.put(int(line))
    commands.put(0)


def serve_jax(ranks: int, dtype: str, batch: int = BATCH) -> None:
    """JAX pmap over `ranks` forced host devices; every step awaited."""
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from syncsgd.nn.mlp import mlp

    model = mlp(SIZES, "relu", loss="xent", dtype=np.dtype(dtype))
    views = model.views(model.init_params(SEED))
    params = [(np.stack([views[f"W{i}"]] * ranks), np.stack([views[f"b{i}"]] * ranks))
              for i in range(len(SIZES) - 1)]  # fmt: skip
    X, y = shared_data(dtype)

    def loss(params: Any, x: Any, labels: Any) -> Any:
        for W, b in params[:-1]:
            x = jax.nn.relu(x @ W + b)
        logits = x @ params[-1][0] + params[-1][1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    def step(params: Any, x: Any, labels: Any) -> Any:
        grads = jax.lax.pmean(jax.grad(loss)(params, x, labels), "ranks")
        return jax.tree.map(lambda p, g: p - LR * g, params, grads)

    pmapped = jax.pmap(step, axis_name="ranks")
    state = {"params": pmapped(params, X[:batch].reshape(ranks, -1, SIZES[0]),
                               y[:batch].reshape(ranks, -1))}  # fmt: skip

    def measure(steps: int) -> float:
        indices = batches(steps, steps, batch)
        started = time.perf_counter()
        for index in indices:
            x, labels = X[index].reshape(ranks, -1, SIZES[0]), y[index].reshape(ranks, -1)
            state["params"] = pmapped(state["params"], x, labels)
            jax.block_until_ready(state["params"])  # never dispatch ahead: it can deadlock
        return (time.perf_counter() - started) / steps

    serve(measure)


# --- the coordinator ------------------------------------------------------------------------------


class Contender:
    """A contender's process, asked for seconds per step over N steps."""

    def __init__(self, kind: str, ranks: int, dtype: str, workload: list[str],
                 before: str | None = None) -> None:  # fmt: skip
        env, script, cwd = dict(os.environ), __file__, None
        if kind == "jax":  # read when JAX loads: set in the child only
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ranks}"
        if kind == "before":  # syncsgd as the other tree runs it, served by its own script
            assert before is not None
            cwd = os.path.abspath(before)
            env["PYTHONPATH"], script = cwd, os.path.join(cwd, "benchmarks", "peers.py")
            kind = "syncsgd"
        command = [sys.executable, script, "--serve", kind, "--ranks", str(ranks),
                   "--dtypes", dtype, *workload]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env, cwd=cwd)  # fmt: skip
        self.read()  # "ready"

    def read(self) -> str:
        """The next line the contender prints; RuntimeError if it died."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"contender {self.process.args!r} exited: {self.process.wait()}")
        return line.strip()

    def ask(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        return float(self.read())

    def close(self) -> None:
        """Close stdin: the contender finishes and exits."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def contenders_to_run(options: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(kind, P, dtype) of every contender, peers only where installed (a line says if not)."""
    kinds = ["syncsgd"] + (["before"] if options.before else [])
    for kind, module in PEERS.items():
        if importlib.util.find_spec(module) is None:
            print(f"# {kind} skipped: {module} is not installed (pip install -e '.[peers]')")
        elif kind == "jax" and options.model is not None:
            print("# jax skipped: its contender is the MLP's only (no pmapped CNN or transformer "
                  "written)")  # fmt: skip
        else:
            kinds.append(kind)
    keys = [(kind, p, d) for d in options.dtypes for p in options.ranks for kind in kinds]
    if 1 in options.ranks:
        keys += [("gemm", 1, d) for d in options.dtypes]
    return keys


def measure_all(options: argparse.Namespace, keys: list[tuple[str, int, str]]) -> dict:
    """Median seconds per step of every contender over interleaved rounds."""
    workload = ["--batch", str(options.batch), "--context", str(options.context)]
    if options.model is not None:
        workload += ["--model", options.model,
                     "--input-shape", ",".join(map(str, options.input_shape))]  # fmt: skip
    contenders = {key: Contender(*key, workload, options.before) for key in keys}
    try:
        for contender in contenders.values():
            contender.ask(options.warmup)
        samples: dict = {key: [] for key in keys}
        for _ in range(options.rounds):
            for key, contender in contenders.items():
                samples[key].append(contender.ask(options.steps))
    finally:
        for contender in contenders.values():
            contender.close()
    return samples


def round_ratio(samples: dict, ranks: int, dtype: str, peer: str) -> float:
    """The median over rounds of syncsgd's time / the peer's, each pair measured side by side."""
    # Per round, not medians divided: a neighbour's burst slows both of a round's neighbours
    # alike, while the medians of two contenders may come from different rounds.
    ours, theirs = samples.get(("syncsgd", ranks, dtype)), samples.get((peer, ranks, dtype))
    if not ours or not theirs:
        return float("nan")
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def report(options: argparse.Namespace, samples: dict) -> list[dict]:
    """Print ms per step and the ratios; return one row per (P, dtype)."""
    median = {key: statistics.median(values) for key, values in samples.items()}
    for key in median:  # the floor is taken at the best GEMM rate of the run, not its median
        if key[0] == "gemm":
            median[key] = min(samples[key])
    rows = []
    print(f"{'P':>2} {'dtype':>8} {'syncsgd':>8} {'ddp':>8} {'jax':>8} {'/ddp':>6} {'/jax':>6} "
          f"{'floor':>7} {'share':>6} {'before':>8} {'/before':>7}   medians of {options.rounds} "
          "rounds")  # fmt: skip
    for dtype in options.dtypes:
        for ranks in options.ranks:
            ms = {kind: median.get((kind, ranks, dtype), float("nan")) * 1e3
                  for kind in ("syncsgd", "ddp", "jax", "gemm", "before")}  # fmt: skip
            row = {"ranks": ranks, "dtype": dtype, **{f"{k}_ms": v for k, v in ms.items()}}
            for peer in ("ddp", "jax", "before"):
                row[f"ratio_{peer}"] = round_ratio(samples, ranks, dtype, peer)
            row["floor_share"] = ms["gemm"] / ms["syncsgd"]
            rows.append(row)
            print(f"{ranks:>2} {dtype:>8} {ms['syncsgd']:>8.3f} {ms['ddp']:>8.3f} "
                  f"{ms['jax']:>8.3f} {row['ratio_ddp']:>6.2f} {row['ratio_jax']:>6.2f} "
                  f"{ms['gemm']:>7.3f} {row['floor_share']:>6.2f} {ms['before']:>8.3f} "
                  f"{row['ratio_before']:>7.2f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """Coordinate the contenders, or (--serve) be one."""
    from syncsgd.util.argtypes import dimensions, dtype_list, positive_int, rank_list

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=rank_list, default=[1, 2], help="rank counts (1,2)")
    parser.add_argument("--dtypes", type=dtype_list, default=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round (20)")
    parser.add_argument("--warmup", type=int, default=10, help="burn-in steps (10)")
    parser.add_argument("--model", metavar="SPEC",
                        help="time this syncsgd --model network (e.g. simple-cnn) instead of the "
                        "MLP")  # fmt: skip
    parser.add_argument("--input-shape", type=dimensions, default=(1, 28, 28),
                        help="--model: one sample's shape (1,28,28); it must hold 784 values")
    parser.add_argument("--batch", type=positive_int, default=BATCH,
                        help=f"the global batch ({BATCH})")  # fmt: skip
    parser.add_argument("--context", type=positive_int, default=64,
                        help="a --model that starts with embed: T, the window's tokens (64)")
    parser.add_argument("--before", metavar="TREE",
                        help="also time syncsgd's step as this tree (the code before) runs it")
    parser.add_argument("--json", metavar="PATH", help="write the rows and samples as JSON")
    parser.add_argument(
        "--serve", choices=("syncsgd", "gemm", "ddp", "jax"), help=argparse.SUPPRESS
    )
    options = parser.parse_args(argv)
    if options.serve:
        main_worker(options)
        return 0
    from syncsgd.nn.blas import describe

    net = network(options.model, options.input_shape, context=options.context)
    shown = (f"MLP {'-'.join(map(str, SIZES))} relu" if options.model is None else
             f"{net.summary()} on {','.join(map(str, options.input_shape))}")  # fmt: skip
    if reads_tokens(options.model):
        shown = (f"{options.model} = {net.summary()} on windows of {options.context} characters "
                 f"of numbers-to-words")  # fmt: skip
    print(
        f"# {shown} xent, global batch {options.batch}, SGD lr {LR}; "
        f"{options.steps} steps x {options.rounds} rounds after {options.warmup}; "
        f"each rank pinned to a core; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )
    m, k, n = largest_product(net, options.batch)
    flops = step_flops(net, options.batch)
    print(f"# GEMM floor (P = 1): {flops / 1e6:.1f} MFLOP per step at the best rate of "
          f"a {min(m, MAX_ROWS)}x{k}x{n} and a {'x'.join(map(str, SQUARE))} product; share = "
          "floor / syncsgd")  # fmt: skip
    samples = measure_all(options, contenders_to_run(options))
    rows = report(options, samples)
    print(f"# syncsgd's BLAS: {describe()}; load at the end {os.getloadavg()[0]:.2f}")
    if options.json:
        from syncsgd.util.files import write_text

        text = json.dumps(
            {"rows": rows, "samples": {"/".join(map(str, k)): v for k, v in samples.items()}},
            indent=1,
        )
        write_text(options.json, text + "\n")
    return 0


def main_worker(options: argparse.Namespace) -> None:
    """The contender process: pin to its cores, then serve."""
    pin(options.ranks[0])
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    dtype, ranks = options.dtypes[0], options.ranks[0]
    work = Workload(options.model, tuple(options.input_shape), options.batch, options.context)
    if options.serve == "syncsgd":
        serve_syncsgd(ranks, dtype, work)
    elif options.serve == "gemm":
        serve_gemm(dtype, work)
    elif options.serve == "ddp":
        serve_ddp(ranks, dtype, work)
    else:
        serve_jax(ranks, dtype, options.batch)


if __name__ == "__main__":
    sys.exit(main())
