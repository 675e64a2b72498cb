"""Pinned results: the final parameters of a fixed set of tiny runs, checked against a record.

    python benchmarks/pinned.py             # check the current code against the record
    python benchmarks/pinned.py --record    # write the record (only from the code to pin)

Purpose: a refactor of the optimizer or the network (the layers refactor) must not change what
training computes. The record, benchmarks/pinned-hashes.json, holds per configuration the SHA-256
of the final flat parameters (and of BatchNorm's running statistics where present); it was written
from the commit named in the JSON (`recorded_from`), on the machine kind named there
(`recorded_on`); it is re-recorded only where a change of bits is deliberate, and the commit says
why.

Exact-mode configurations (--exact) must reproduce their hashes bitwise on any machine. Float mode
goes through BLAS, whose order of additions may differ between machines (and BLAS builds), so a
float-mode configuration passes bitwise or within a relative max|Δθ| / max(1, max|θ|): 1e-12
where the passes are float64, else verify's float-mode tolerance (1e-4 for float32; u sqrt(T) / 4
for bf16 and fp16 passes, whose rounding turns a BLAS order's last bit into the format's). Its final
parameters are stored in benchmarks/pinned-params.npz for that comparison (140 KB).

Every run is tiny (256 samples, 8 features, hidden 16,16, batch 32, 10 steps, thread ranks), so
the whole check takes about a minute on two cores when Numba compiles the kernels, seconds when
they are cached. Check prints one line per configuration (bitwise / within 1e-12 relative /
DIFFERS; a run that raises is DIFFERS, and the others still run) and exits 1 if an exact-mode
configuration is not bitwise or a float-mode one differs by more than 1e-12 relative.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import syncsgd

HERE = Path(__file__).resolve().parent
HASHES = HERE / "pinned-hashes.json"
PARAMS = HERE / "pinned-params.npz"
BASE_COMMIT = "57613f2"  # the commit before the layers refactor: the code the record pins
TOLERANCE = 1e-12  # float mode: relative max|Δθ| / max(1, max|θ|)
MAX_NPZ_BYTES = 300_000

# Every configuration starts from these options (TrainConfig fields).
TINY: dict[str, Any] = {
    "samples": 256, "features": 8, "hidden": (16, 16), "batch_size": 32, "steps": 10,
    "seed": 0, "timeout": 120.0,
}  # fmt: skip

REGRESSION = {"data": "synthetic-regression", "loss": "mse"}
BN_SYNC = {"batchnorm": "sync"}

# (name, ranks, options on top of TINY); the name ends in /exact for exact mode.
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    ("plain", 1, {}),
    ("plain", 2, {}),
    ("plain", 3, {}),
    ("plain/exact", 1, {"exact": True}),
    ("plain/exact", 2, {"exact": True}),
    ("plain/exact", 3, {"exact": True}),
    ("bf16", 1, {"precision": "bf16"}),
    ("bf16", 3, {"precision": "bf16"}),
    ("bf16/exact", 2, {"precision": "bf16", "exact": True}),
    ("fp16", 1, {"precision": "fp16"}),
    ("fp16", 3, {"precision": "fp16"}),
    ("fp16-scale-none", 2, {"precision": "fp16", "loss_scale": "none"}),
    ("fp16/exact", 2, {"precision": "fp16", "exact": True}),
    ("bn-local", 2, {"batchnorm": "local"}),
    ("bn-local", 3, {"batchnorm": "local"}),
    ("bn-local/exact", 2, {"batchnorm": "local", "exact": True}),
    ("bn-sync", 2, BN_SYNC),
    ("bn-sync", 3, BN_SYNC),
    ("bn-sync/exact", 3, {**BN_SYNC, "exact": True}),
    ("overlap", 2, {"overlap": True}),
    ("overlap", 3, {"overlap": True}),
    ("overlap/exact", 2, {"overlap": True, "exact": True}),
    ("overlap/exact", 3, {"overlap": True, "exact": True}),
    ("overlap-bn-sync", 2, {**BN_SYNC, "overlap": True}),
    ("overlap-bn-sync", 3, {**BN_SYNC, "overlap": True}),
    ("bucket-0", 2, {"bucket_bytes": 0}),
    ("bucket-256", 3, {"bucket_bytes": 256}),
    ("bucket-256/exact", 3, {"bucket_bytes": 256, "exact": True}),
    ("recursive-doubling", 3, {"algorithm": "recursive-doubling"}),
    ("rabenseifner", 3, {"algorithm": "rabenseifner"}),
    ("tree", 3, {"algorithm": "tree"}),
    ("naive", 3, {"algorithm": "naive"}),
    ("rabenseifner/exact", 3, {"algorithm": "rabenseifner", "exact": True}),
    ("momentum", 2, {"momentum": 0.9}),
    ("nesterov", 3, {"momentum": 0.9, "nesterov": True}),
    ("weight-decay", 2, {"weight_decay": 1e-4}),
    ("clip-norm", 3, {"clip_norm": 1.0}),
    ("optimizer-all/exact", 3,
     {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "clip_norm": 1.0, "exact": True}),
    ("cosine", 2, {"schedule": "cosine", "warmup_steps": 3}),
    ("warmup", 2, {"schedule": "warmup", "warmup_steps": 3}),
    ("noam", 3, {"schedule": "noam", "warmup_steps": 3}),
    ("tanh", 2, {"activation": "tanh"}),
    ("tanh/exact", 3, {"activation": "tanh", "exact": True}),
    ("mse", 2, REGRESSION),
    ("mse/exact", 3, {**REGRESSION, "exact": True}),
    ("float32", 2, {"dtype": "float32"}),
    ("float32/exact", 3, {"dtype": "float32", "exact": True}),
    ("allreduce-bf16", 2, {"allreduce_dtype": "bfloat16"}),
    ("mean-of-means", 3, {"pitfall": "mean-of-means"}),
]  # fmt: skip


def key(name: str, ranks: int) -> str:
    """The configuration's key in the record: its name and P."""
    return f"{name}@P{ranks}"


def sha256(array: np.ndarray | None) -> str | None:
    """SHA-256 of the array's bytes (as syncsgd verify computes it); None for no array."""
    if array is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def run(ranks: int, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """Train one configuration on thread ranks: (final flat parameters, running statistics)."""
    result = syncsgd.train(ranks=ranks, backend="threads", **{**TINY, **options})
    return np.array(result.params), None if result.running is None else np.array(result.running)


def state(params: np.ndarray, running: np.ndarray | None) -> np.ndarray:
    """The parameters, then BatchNorm's running statistics if any (what verify compares)."""
    return params if running is None else np.concatenate([params, running])


def machine() -> dict[str, str]:
    """The kind of machine the record was written on (float mode's bits may depend on it)."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"machine": platform.machine(), "cpu": cpu, "system": platform.system(),
            "python": platform.python_version(), "numpy": np.__version__}  # fmt: skip


def source_commit() -> str:
    """The commit of the tree `syncsgd` was imported from ('unknown' outside git)."""
    tree = Path(syncsgd.__file__).resolve().parent.parent
    try:
        done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def record() -> int:
    """Run every configuration and write the hashes (and float mode's parameters)."""
    entries: list[dict[str, Any]] = []
    arrays: dict[str, Any] = {}  # Any: savez's keyword arguments are typed as its options
    for name, ranks, options in CONFIGS:
        params, running = run(ranks, options)
        exact = bool(options.get("exact", False))
        entries.append({"key": key(name, ranks), "ranks": ranks, "exact": exact,
                        "options": {**TINY, **options}, "params_sha256": sha256(params),
                        "running_sha256": sha256(running)})  # fmt: skip
        if not exact:
            arrays[key(name, ranks)] = state(params, running)
        print(f"{key(name, ranks):<28} {sha256(state(params, running))}", flush=True)
    document = {"recorded_from": source_commit(), "recorded_on": machine(),
                "tolerance": TOLERANCE, "configs": entries}  # fmt: skip
    HASHES.write_text(json.dumps(document, indent=1) + "\n")
    np.savez_compressed(PARAMS, **arrays)
    if PARAMS.stat().st_size > MAX_NPZ_BYTES:
        PARAMS.unlink()
        print(f"{PARAMS.name} would exceed {MAX_NPZ_BYTES} bytes: hashes only")
    print(f"recorded {len(entries)} configurations from {document['recorded_from']}")
    return 0


def check() -> int:
    """Run every configuration and compare it with the record: exit status 1 on a difference."""
    document = json.loads(HASHES.read_text())
    recorded = {entry["key"]: entry for entry in document["configs"]}
    stored = dict(np.load(PARAMS, allow_pickle=False)) if PARAMS.exists() else {}
    counts = {"bitwise": 0, "within": 0, "DIFFERS": 0}
    for name, ranks, options in CONFIGS:
        entry = recorded.get(key(name, ranks))
        if entry is None or entry["options"] != json.loads(json.dumps({**TINY, **options})):
            print(f"{key(name, ranks):<28} DIFFERS (not in the record, or recorded otherwise)")
            counts["DIFFERS"] += 1
            continue
        try:
            params, running = run(ranks, options)
        except Exception as error:  # a run that fails is a difference; the others still run
            verdict = f"DIFFERS (raised {type(error).__name__}: {error})"
        else:
            verdict = compare(entry, params, running, stored.get(key(name, ranks)))
        counts[verdict.split()[0]] += 1
        mode = "exact" if entry["exact"] else "float"
        print(f"{key(name, ranks):<28} {mode:<5} {verdict}", flush=True)
    print(f"{len(CONFIGS)} configurations: {counts['bitwise']} bitwise, {counts['within']} "
          f"within tolerance, {counts['DIFFERS']} DIFFERS (recorded from "
          f"{document['recorded_from'][:12]})")  # fmt: skip
    return 1 if counts["DIFFERS"] else 0


def compare(entry: dict[str, Any], params: np.ndarray, running: np.ndarray | None,
            reference: np.ndarray | None) -> str:  # fmt: skip
    """'bitwise', 'within 1e-12 relative (...)' (float mode only) or 'DIFFERS (...)'."""
    if sha256(params) == entry["params_sha256"] and sha256(running) == entry["running_sha256"]:
        return "bitwise"
    if entry["exact"]:
        return "DIFFERS (exact mode: not bitwise)"
    if reference is None:
        return "DIFFERS (hash; no stored parameters to compare within tolerance)"
    ours = state(params, running)
    if ours.shape != reference.shape:
        return f"DIFFERS (shape {ours.shape} against {reference.shape})"
    max_abs = float(np.max(np.abs(ours.astype(np.float64) - reference), initial=0.0))
    relative = max_abs / max(1.0, float(np.max(np.abs(reference), initial=0.0)))
    allowed = tolerance(entry["options"])
    if relative <= allowed:
        return f"within {allowed:g} relative ({relative:.3g})"
    return f"DIFFERS (relative {relative:.3g} > {allowed:g})"


def tolerance(options: dict[str, Any]) -> float:
    """Float mode's allowance: TOLERANCE for float64 passes, else verify's for the format."""
    from syncsgd.apps.verify import float_tolerance
    from syncsgd.training.config import TrainConfig

    config = TrainConfig(**{**options, "hidden": tuple(options["hidden"])})
    if config.dtype == "float64" and config.precision == "fp32":
        return TOLERANCE
    return float_tolerance(config, options["steps"])[0]


def main() -> int:
    """Check the current code against the record, or write the record with --record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {HASHES.name}")
    options = parser.parse_args()
    print(f"# syncsgd from {Path(syncsgd.__file__).resolve().parent}", flush=True)
    start = time.perf_counter()
    status = record() if options.record else check()
    print(f"# {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
