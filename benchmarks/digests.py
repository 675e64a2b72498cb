"""Digests of a set of tiny runs over every kind of network, checked against a record.

    python benchmarks/digests.py             # check the current code against the record
    python benchmarks/digests.py --record    # write the record (only from the code to pin)

Purpose: a refactor of the passes around the layers must not change a bit of what training
computes, in float mode or exact mode. Where benchmarks/pinned.py pins the MLP against the code
before the layers (float mode within 1e-12, BLAS may differ between machines), this record pins
an MLP, a conv net with BatchNorm and a GPT with AdamW in float and exact mode, fp32/bf16/fp16,
with --overlap and --accumulate, at P = 1 and 3: the SHA-256 of the final parameters (and of
BatchNorm's running statistics), every one bitwise on the machine it was recorded on. The
record names the commit and the machine (benchmarks/digests.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from pinned import HERE, machine, sha256, source_commit  # type: ignore[import-not-found]

import syncsgd

RECORD = HERE / "digests.json"

MLP: dict[str, Any] = {"samples": 96, "features": 8, "hidden": (16, 16), "batch_size": 24,
                       "steps": 4, "seed": 1, "timeout": 120.0}  # fmt: skip
CONV: dict[str, Any] = {
    "samples": 48, "features": 64, "input_shape": (1, 8, 8), "batch_size": 12, "steps": 3,
    "model": "conv(4, 3, pad=1) batchnorm relu maxpool(2) flatten dense", "seed": 2,
    "timeout": 120.0, "momentum": 0.9,
}  # fmt: skip
GPT: dict[str, Any] = {
    "data": "numbers-to-words", "model": "gpt(layers=1,d=16,heads=2)", "context": 8,
    "samples": 48, "batch_size": 6, "steps": 3, "optimizer": "adamw", "lr": 0.01,
    "schedule": "noam", "warmup_steps": 2, "clip_norm": 1.0, "seed": 3, "timeout": 120.0,
}  # fmt: skip

# (name, ranks, options): every network in float and exact mode at P = 1 and 3, then the
# precisions, --overlap and --accumulate on each.
CONFIGS: list[tuple[str, int, dict[str, Any]]] = []
for _net, _base in (("mlp", MLP), ("conv-bn", {**CONV, "batchnorm": "sync"}), ("gpt", GPT)):
    for _ranks in (1, 3):
        for _mode, _exact in (("float", {}), ("exact", {"exact": True})):
            CONFIGS.append((f"{_net}/{_mode}", _ranks, {**_base, **_exact}))
            for _precision in ("bf16", "fp16"):
                CONFIGS.append((f"{_net}/{_mode}/{_precision}", _ranks,
                                {**_base, **_exact, "precision": _precision}))  # fmt: skip
            CONFIGS.append((f"{_net}/{_mode}/accumulate", _ranks,
                            {**_base, **_exact, "accumulate": 2}))  # fmt: skip
            if _ranks > 1:
                CONFIGS.append((f"{_net}/{_mode}/overlap", _ranks,
                                {**_base, **_exact, "overlap": True, "bucket_bytes": 512}))
CONFIGS.append(("conv-bn-local/float", 3, {**CONV, "batchnorm": "local"}))
CONFIGS.append(("mlp/float/float32", 3, {**MLP, "dtype": "float32"}))
CONFIGS.append(("mlp/exact/float32", 3, {**MLP, "dtype": "float32", "exact": True}))


def run(ranks: int, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """Train one configuration on thread ranks: (final flat parameters, running statistics)."""
    result = syncsgd.train(ranks=ranks, backend="threads", **options)
    return np.array(result.params), None if result.running is None else np.array(result.running)


def key(name: str, ranks: int) -> str:
    """The configuration's key in the record."""
    return f"{name}@P{ranks}"


def digests() -> dict[str, list[str | None]]:
    """Run every configuration: key -> [params SHA-256, running statistics SHA-256]."""
    out: dict[str, list[str | None]] = {}
    for name, ranks, options in CONFIGS:
        try:
            params, running = run(ranks, options)
            out[key(name, ranks)] = [sha256(params), sha256(running)]
        except Exception as error:  # a run that fails differs; the others still run
            out[key(name, ranks)] = [f"raised {type(error).__name__}: {error}", None]
        print(f"{key(name, ranks):<34} {out[key(name, ranks)][0]}", flush=True)
    return out


def main() -> int:
    """Check the current code against the record, or write it with --record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    options = parser.parse_args()
    start = time.perf_counter()
    ours = digests()
    if options.record:
        document = {"recorded_from": source_commit(), "recorded_on": machine(), "digests": ours}
        RECORD.write_text(json.dumps(document, indent=1) + "\n")
        print(f"recorded {len(ours)} configurations ({time.perf_counter() - start:.0f} s)")
        return 0
    recorded = json.loads(RECORD.read_text())
    differ = [name for name in ours if ours[name] != recorded["digests"].get(name)]
    for name in differ:
        print(f"DIFFERS {name}")
    print(f"{len(ours)} configurations, {len(ours) - len(differ)} bitwise, {len(differ)} differ "
          f"(recorded from {recorded['recorded_from'][:12]}; {time.perf_counter() - start:.0f} s)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
