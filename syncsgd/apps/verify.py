"""`syncsgd verify`: train on P = 1, 2, 3, ... thread ranks and compare every run with serial SGD.

    syncsgd verify --ranks 1,2,3,4,8                       # float mode: within the tolerance
    syncsgd verify --ranks 1,2,3,5,8 --exact               # exact mode: every bit
    syncsgd verify --ranks 2,3 --pitfall mean-of-means     # watch a known pitfall break it

The reference is the serial run: one rank, no pitfall, the same mode. A run matches when its final
parameters are bitwise equal to the reference's (exact mode), or within the documented relative
tolerance max|Δθ| / max(1, max|θ|) (float mode). Per-step digests of the parameters give the first
step after which a run differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from syncsgd.comm.threads import run_threads
from syncsgd.training.config import TrainConfig
from syncsgd.training.loop import TrainResult, prepare, train_rank
from syncsgd.util.files import write_text

# Float mode: the relative distance from serial SGD that a correct run stays within (the tolerance
# the README documents).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


@dataclass
class Row:
    """How one run on `ranks` ranks compares with the serial run."""

    ranks: int
    max_abs_diff: float
    relative_diff: float
    max_ulps: int
    bitwise_equal: bool
    sha256: str
    first_difference: int | None  # steps taken when the parameters first differed; None: never
    matches: bool


def ulp_distance(a: np.ndarray, b: np.ndarray) -> int:
    """The largest number of representable floats between a[i] and b[i] over all i."""
    if a.size == 0:
        return 0
    widths: dict[int, type[np.signedinteger[Any]]] = {4: np.int32, 8: np.int64}
    bits = widths[a.dtype.itemsize]
    lowest = np.iinfo(bits).min

    def ordered(x: np.ndarray) -> np.ndarray:
        raw = x.view(bits)  # negative floats count down from the sign bit: mirror them
        return np.where(raw < 0, lowest - raw, raw).astype(object)  # Python ints: no overflow

    return int(np.max(np.abs(ordered(a) - ordered(b))))


def sha256(params: np.ndarray) -> str:
    """SHA-256 of the parameters' bytes."""
    return hashlib.sha256(np.ascontiguousarray(params).tobytes()).hexdigest()


def run(config: TrainConfig, ranks: int) -> TrainResult:
    """Train `config` on `ranks` thread ranks, recording a digest of the parameters per step."""
    problem = prepare(config)
    return run_threads(ranks, train_rank, problem, record_digests=True)[0]


def compare(reference: TrainResult, result: TrainResult, ranks: int, exact: bool,
            tolerance: float) -> Row:  # fmt: skip
    """The row of the verify table for one run."""
    ours, theirs = result.params, reference.params
    max_abs = float(np.max(np.abs(ours - theirs), initial=0.0))
    relative = max_abs / max(1.0, float(np.max(np.abs(theirs), initial=0.0)))
    bitwise = ours.tobytes() == theirs.tobytes()
    pairs = zip(result.digests, reference.digests, strict=True)
    first = next((step + 1 for step, (a, b) in enumerate(pairs) if a != b), None)
    matches = bitwise if exact else relative <= tolerance
    return Row(ranks, max_abs, relative, ulp_distance(ours, theirs), bitwise, sha256(ours), first,
               matches)  # fmt: skip


def verify(config: TrainConfig, ranks_list: list[int], tolerance: float, report=None) -> list[Row]:
    """Compare a run on each P of `ranks_list` with the serial run; call `report` per row."""
    reference = run(replace(config, pitfall=None), 1)
    rows = []
    for ranks in ranks_list:
        row = compare(reference, run(config, ranks), ranks, config.exact, tolerance)
        rows.append(row)
        if report is not None:
            report(row)
    return rows


HEADER = (f"{'P':>4} {'max |Δθ|':>10} {'relative':>10} {'max ULPs':>18} {'bitwise':>8} "
          f"{'first diff':>10}  {'SHA-256':<16}  match")  # fmt: skip


def format_row(row: Row) -> str:
    first = "-" if row.first_difference is None else f"step {row.first_difference}"
    return (
        f"{row.ranks:>4} {row.max_abs_diff:>10.3g} {row.relative_diff:>10.3g} {row.max_ulps:>18} "
        f"{'yes' if row.bitwise_equal else 'no':>8} {first:>10}  {row.sha256[:16]}  "
        f"{'ok' if row.matches else 'MISMATCH'}"
    )


def main(config: TrainConfig, ranks_list: list[int], tolerance: float | None,
         json_path: str | None) -> int:  # fmt: skip
    """Print the verify table; exit status 1 if a run that should match does not."""
    tolerance = TOLERANCE[config.dtype] if tolerance is None else tolerance
    mode = (
        "exact mode: bitwise" if config.exact else f"float mode: relative tolerance {tolerance:g}"
    )
    pitfall = f", pitfall {config.pitfall}" if config.pitfall else ""
    print(f"# verify against serial SGD (1 rank, no pitfall); {mode}{pitfall}")
    print(HEADER, flush=True)
    rows = verify(config, ranks_list, tolerance, report=lambda r: print(format_row(r), flush=True))
    failed = [row.ranks for row in rows if not row.matches]
    if json_path:
        document = {"config": asdict(config), "rows": [asdict(row) for row in rows],
                    "matches": not failed}  # fmt: skip
        write_text(json_path, json.dumps(document, indent=1, default=str) + "\n")
    if failed:
        print(f"MISMATCH: P = {', '.join(map(str, failed))} differ from serial SGD")
        return 1
    print(f"all {len(rows)} runs match serial SGD")
    return 0
