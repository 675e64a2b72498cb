"""A transformer's local gradient: syncsgd's float and exact mode against PyTorch, one core.

    python benchmarks/transformer.py                      # gpt(layers=2,d=128,heads=4), T=64, B=32
    python benchmarks/transformer.py --rounds 9 --json transformer.json
    python benchmarks/transformer.py --step-ranks 2 --steps 5   # and whole steps, exact / float

What is timed: the forward and backward pass of one batch of B sequences of T tokens (the loss
the mean cross-entropy over the B x T tokens, every parameter's gradient), on one process with
one BLAS thread:
  float   syncsgd's passes in float mode (`nn.local.local_gradient`), float64 and float32;
  exact   the same in exact mode (per-sample products in a fixed order, every sum extracted);
  torch   the same network as a torch.nn.Sequential (nn.Embedding, nn.MultiheadAttention with a
          causal mask, nn.LayerNorm, nn.Linear, GELU) from the same parameters, loss.backward(),
          torch.set_num_threads(1).
A round runs every contender in turn (interleaved: a noisy neighbour slows all alike); the median
over rounds of the ms per pass is quoted, and the median over rounds of each round's ratio.
With `--step-ranks P`, whole training steps too (`train_rank` on P thread ranks: windows of T
characters of numbers-to-words, AdamW, the global batch B), float and exact mode alternating
(ABBA) for `--rounds` runs of `--steps` steps after one run each; a run's time per step is its
slowest rank's, and the median over runs of each mode and of exact / float is printed.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy's and the kernels' BLAS load

import numpy as np  # noqa: E402

from syncsgd.nn.local import local_gradient  # noqa: E402
from syncsgd.nn.network import build  # noqa: E402

VOCABULARY, SEED = 64, 0


def torch_gpt(torch: Any, vocabulary: int, positions: int, d: int, heads: int, layers: int):
    """embed(d), layers x block(d, heads), layernorm, dense as a torch.nn.Sequential."""
    nn = torch.nn

    class Embed(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocabulary, d), nn.Embedding(positions, d)

        def forward(self, ids):
            return self.tok(ids) + self.pos.weight[None]

    class Block(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            future = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=future, need_weights=False)[0]
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    return nn.Sequential(Embed(), *[Block() for _ in range(layers)], nn.LayerNorm(d),
                         nn.Linear(d, vocabulary))  # fmt: skip


def contenders(layers: int, d: int, heads: int, positions: int, batch: int,
               dtype: str) -> dict[str, Callable[[], Any]]:  # fmt: skip
    """Each contender's one pass, ready to call."""
    network = build(f"gpt(layers={layers},d={d},heads={heads})", (positions,), VOCABULARY,
                    "xent", dtype)  # fmt: skip
    params = network.init_params(SEED)
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, VOCABULARY, (batch, positions))
    labels = rng.integers(0, VOCABULARY, (batch, positions))
    X = ids.astype(dtype)
    found: dict[str, Callable[[], Any]] = {}
    for mode in ("float", "exact"):  # exact mode's sums are float64 whatever the dtype
        grads = np.zeros(network.n_params, np.float64 if mode == "exact" else dtype)
        passes = local_gradient(network, batch, exact=mode == "exact")
        found[mode] = functools.partial(passes, params, X, labels, grads)
    try:
        import torch
    except ImportError:
        return found
    torch.set_num_threads(1)
    module = torch_gpt(torch, VOCABULARY, positions, d, heads, layers).to(getattr(torch, dtype))
    module.load_state_dict({k: torch.from_numpy(v) for k, v in network.to_arrays(params).items()})
    tokens, targets = torch.from_numpy(ids), torch.from_numpy(labels).reshape(-1)

    def torch_pass() -> None:
        module.zero_grad(set_to_none=False)
        logits = module(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), targets).backward()

    found["torch"] = torch_pass
    return found


def measure(passes: dict[str, Callable[[], Any]], rounds: int, repeats: int) -> dict[str, Any]:
    """Median ms per pass of each contender, and the median per-round ratio to torch and float."""
    for run in passes.values():
        run()  # compile, allocate
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, run in passes.items():
            started = time.perf_counter()
            for _ in range(repeats):
                run()
            times[name].append((time.perf_counter() - started) / repeats * 1e3)
    result: dict[str, Any] = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    for name, base in (("exact", "float"), ("float", "torch"), ("exact", "torch")):
        if name in times and base in times:
            result[f"{name}_over_{base}"] = statistics.median(
                a / b for a, b in zip(times[name], times[base], strict=True))
    return result


def whole_steps(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Median ms per training step in float and exact mode on --step-ranks thread ranks, and
    the median of the runs' ratios exact / float."""
    from syncsgd.comm.threads import run_threads
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.loop import prepare, train_rank

    model = f"gpt(layers={args.layers},d={args.d},heads={args.heads})"
    runs = {mode: prepare(TrainConfig(model=model, data="numbers-to-words", context=args.context,
                                      samples=max(2048, args.batch), batch_size=args.batch,
                                      steps=args.steps, dtype=dtype, optimizer="adamw",
                                      exact=mode == "exact", seed=SEED))
            for mode in ("float", "exact")}  # fmt: skip

    def per_step(mode: str) -> float:
        results = run_threads(args.step_ranks, train_rank, runs[mode])
        return max(result.seconds for result in results) / args.steps * 1e3

    for mode in runs:
        per_step(mode)  # compile or load the kernels
    times: dict[str, list[float]] = {"float": [], "exact": []}
    for index in range(args.rounds):
        for mode in ("float", "exact") if index % 2 == 0 else ("exact", "float"):
            times[mode].append(per_step(mode))
    ratios = [a / b for a, b in zip(times["exact"], times["float"], strict=True)]
    return {"step_ranks": args.step_ranks, "float_step_ms": statistics.median(times["float"]),
            "exact_step_ms": statistics.median(times["exact"]),
            "exact_step_over_float": statistics.median(ratios)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Measure and print one line per dtype (and --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-ranks", type=int, default=0,
                        help="also whole steps on this many thread ranks (0: none)")
    parser.add_argument("--steps", type=int, default=5, help="steps per whole-step run (5)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for dtype in args.dtypes.split(","):
        passes = contenders(args.layers, args.d, args.heads, args.context, args.batch, dtype)
        row = {"dtype": dtype, **measure(passes, args.rounds, args.repeats)}
        if args.step_ranks:
            row.update(whole_steps(args, dtype))
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()))  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
