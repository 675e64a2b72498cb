"""The α-β-γ (Hockney) cost model of allreduce algorithms: `syncsgd model`.

A message of n bytes between two ranks costs α + nβ (latency α in seconds, β seconds per byte),
and reducing n bytes locally costs nγ. Every algorithm's time is a·α + b·nβ + c·nγ, with
coefficients a, b, c that depend only on P: the longest chain of messages and additions, for the
algorithms as `syncsgd.collectives` implements them. The formulas are those of Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
International Journal of High Performance Computing Applications 19(1):49-66, 2005; the ring is
their ring reduce-scatter followed by their ring allgather (as in Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2),
2009):

    ring                2(P-1)α + 2(P-1)/P·nβ + (P-1)/P·nγ
    naive               2(P-1)α + 2(P-1)·nβ   + (P-1)·nγ        linear reduce to rank 0 + sends back
    recursive-doubling  L(α + nβ + nγ)                           + fold/unfold if P is not 2^L
    rabenseifner        2Lα     + 2(p'-1)/p'·nβ + (p'-1)/p'·nγ   + fold/unfold if P is not 2^L
    tree                R(α + nβ + nγ) + B(α + nβ)               binary-tree reduce + broadcast

where p' = 2^L is the largest power of two ≤ P, L = log2 p'. When P is not a power of two, MPICH
first folds the r = P - p' extra ranks into their neighbours (α + nβ + nγ) and sends them the
result at the end (α + nβ), so both pay 2α + 2nβ + nγ more. The tree is the binary tree of
`syncsgd.collectives` (the children of rank i are 2i+1 and 2i+2; a parent receives and adds its
children one after the other, then sends to each in turn): R and B are the rounds on its critical
paths, about 2 log2 P each (R = B = 2 for P = 3; R = 19, B = 18 for P = 1024), where Thakur et
al.'s binomial tree needs ⌈log2 P⌉ each. A round is what `ring-demo` shows as one: every rank sends
and receives at most one message in it, so the demo's rounds are every algorithm's α coefficient.

Every time is linear in n, so two algorithms cross at most once, at n = Δ(fixed) / Δ(per byte),
and the best algorithm by size is the lower envelope of the lines. `--fit bench.json` fits α, β, γ
to a measured sweep (`syncsgd bench allreduce --json`) by non-negative least squares on relative
errors. Defaults: α = 2 µs and β = 1/12.5e9 s/B (a 100 Gb/s network), γ = 1e-10 s/B (summing
float64 at 10 GB/s on one core; docs/measurements.md has the measurement behind it).

`--overlap SIZES` (an MLP) or `--model SPEC --input-shape C,H,W` (any network, conv layers too)
predicts a training step with and without `syncsgd train --overlap` per bucket size: forward +
max(backward, comm of all but the first bucket) + comm of the first + update (docs/overlap.md);
the compute is the layers' products' multiply-adds at --flops.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from syncsgd.util import jsonout
from syncsgd.util.argtypes import (
    comma_list,
    comma_separated,
    dimensions,
    hidden_sizes,
    positive_int,
)
from syncsgd.util.figures import figure_path
from syncsgd.util.files import check_writable
from syncsgd.util.options import JSON, RANK_COUNTS, reads, writes

if TYPE_CHECKING:
    from syncsgd.apps.costmodel_buckets import RingLine
    from syncsgd.nn.network import Network

ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")
DEFAULT_ALPHA = 2e-6  # seconds per message
DEFAULT_BETA = 1 / 12.5e9  # seconds per byte: 100 Gb/s
DEFAULT_GAMMA = 1e-10  # seconds per byte reduced: 10 GB/s
DEFAULT_RANKS = (2, 8, 1024)
DEFAULT_SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 64 << 20)
FIT_BAR_FROM = 64 << 10  # a fit should predict every size from 64 KiB up within 30%
POOR_FIT = 0.9  # below this R², the fitted α, β, γ explain too little to extrapolate from


class Params(NamedTuple):
    """The machine: α seconds per message, β seconds per byte sent, γ seconds per byte reduced."""

    alpha: float
    beta: float
    gamma: float


class Cost(NamedTuple):
    """An algorithm's time as a·α + b·nβ + c·nγ."""

    a: float
    b: float
    c: float

    def seconds(self, nbytes: float, params: Params) -> float:
        """The predicted time of one allreduce of `nbytes` bytes."""
        return self.a * params.alpha + nbytes * (self.b * params.beta + self.c * params.gamma)


def cost(algorithm: str, ranks: int) -> Cost:
    """The α, nβ, nγ coefficients of `algorithm` on `ranks` ranks (Thakur et al. 2005)."""
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {ranks!r}")
    p = int(ranks)
    levels = p.bit_length() - 1  # L = floor(log2 P)
    pow2 = 1 << levels  # p', the ranks left after folding in the extra ones
    fold = 0 if pow2 == p else 1  # pre step α + nβ + nγ, post step α + nβ
    if algorithm == "ring":
        return Cost(2 * (p - 1), 2 * (p - 1) / p, (p - 1) / p)
    if algorithm == "naive":
        return Cost(2 * (p - 1), 2 * (p - 1), p - 1)
    if algorithm == "recursive-doubling":
        return Cost(levels + 2 * fold, levels + 2 * fold, levels + fold)
    if algorithm == "rabenseifner":
        share = (pow2 - 1) / pow2
        return Cost(2 * levels + 2 * fold, 2 * share + 2 * fold, share + fold)
    if algorithm == "tree":
        reduce_rounds, broadcast_rounds = tree_rounds(p)
        rounds = reduce_rounds + broadcast_rounds
        return Cost(rounds, rounds, reduce_rounds)
    raise ValueError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")


@functools.lru_cache(maxsize=64)
def tree_rounds(ranks: int) -> tuple[int, int]:
    """Messages on the critical paths of the binary tree's reduce and of its broadcast."""
    # Rank i's children are 2i+1 and 2i+2. In the reduce a rank receives (and adds) its children's
    # sums one after the other, each only once that child has its own; in the broadcast a rank sends
    # to its children one after the other, once it has the sum. Both in O(log² P), for any P.
    return _reduce_rounds(0, ranks), _broadcast_rounds(ranks)


def _perfect_height(rank: int, ranks: int) -> int | None:
    """The height of rank's subtree if all its levels are full, else None."""
    first, width, height = rank, 1, 0
    while 2 * first + 1 < ranks:  # the leftmost node one level down exists
        first, width, height = 2 * first + 1, 2 * width, height + 1
    return height if first + width - 1 < ranks else None


def _reduce_rounds(rank: int, ranks: int) -> int:
    """The round in which `rank` holds its subtree's sum."""
    height = _perfect_height(rank, ranks)
    if height is not None:  # each level adds the left child's sum, then the right child's
        return 2 * height
    done = 0  # only the subtrees on the path to the last rank are not perfect: O(log P) of them
    for child in (2 * rank + 1, 2 * rank + 2):
        if child < ranks:
            done = max(done, _reduce_rounds(child, ranks)) + 1
    return done


def _broadcast_rounds(ranks: int) -> int:
    """The round in which the sum reaches the last rank to get it."""
    # Rank k is reached along the bits of k + 1 after its leading one: 0 is a left child (one
    # round after its parent), 1 a right child (two rounds): depth + ones. The most ones on the
    # deepest level: n itself, or n with a set bit cleared and every bit below it set.
    deepest = ranks.bit_length() - 1
    candidates = [ranks] + [(ranks & ~(1 << j)) | ((1 << j) - 1)
                            for j in range(deepest) if ranks >> j & 1]  # fmt: skip
    ones = max(bin(x).count("1") for x in candidates if x.bit_length() - 1 == deepest)
    one_level_up = 2 * (deepest - 1) if deepest >= 1 else 0  # its all-right path
    return max(one_level_up, deepest + ones - 1)


def predict(algorithm: str, ranks: int, nbytes: float, params: Params) -> float:
    """Predicted seconds of one allreduce of `nbytes` bytes on `ranks` ranks."""
    return cost(algorithm, ranks).seconds(nbytes, params)


# -- where one algorithm overtakes another --------------------------------------------------------


class Crossover(NamedTuple):
    """Above `nbytes` bytes, `faster` beats `slower` (below, the other way round)."""

    ranks: int
    nbytes: float
    faster: str
    slower: str


class Region(NamedTuple):
    """From `start` to `stop` bytes (stop None: no end) the fastest are `algorithms` (tied)."""

    start: float
    stop: float | None
    algorithms: tuple[str, ...]


def _line(algorithm: str, ranks: int, params: Params) -> tuple[float, float]:
    """(seconds at n = 0, seconds per byte) of `algorithm`."""
    c = cost(algorithm, ranks)
    return c.a * params.alpha, c.b * params.beta + c.c * params.gamma


def _same(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-300)


def crossovers(ranks: int, params: Params, algorithms: Sequence[str] = ALGORITHMS
               ) -> list[Crossover]:  # fmt: skip
    """Every size at which one of `algorithms` overtakes another on `ranks` ranks, by size."""
    found = []
    for first, second in itertools.combinations(algorithms, 2):
        fixed1, slope1 = _line(first, ranks, params)
        fixed2, slope2 = _line(second, ranks, params)
        if _same(slope1, slope2) or _same(fixed1, fixed2):
            continue  # parallel lines never cross; lines that meet at n = 0 cross nowhere after
        # fixed1 + n slope1 = fixed2 + n slope2
        nbytes = (fixed2 - fixed1) / (slope1 - slope2)
        if nbytes > 0:
            faster, slower = (first, second) if slope1 < slope2 else (second, first)
            found.append(Crossover(ranks, nbytes, faster, slower))
    return sorted(found, key=lambda c: c.nbytes)


def best_by_size(ranks: int, params: Params, algorithms: Sequence[str] = ALGORITHMS
                 ) -> list[Region]:  # fmt: skip
    """The fastest of `algorithms` from 0 bytes upwards: the lower envelope of the cost lines."""
    if not algorithms:
        raise ValueError("no algorithms to compare")
    lines = {name: _line(name, ranks, params) for name in algorithms}
    # Lines with the same (fixed, slope) are one line shared by several algorithms.
    groups: list[tuple[float, float, tuple[str, ...]]] = []
    for name, (fixed, slope) in lines.items():
        for i, (f, s, names) in enumerate(groups):
            if _same(f, fixed) and _same(s, slope):
                groups[i] = (f, s, (*names, name))
                break
        else:
            groups.append((fixed, slope, (name,)))
    # At n = 0+ the smallest fixed cost wins, ties broken by the smaller slope.
    current = min(groups, key=lambda g: (g[0], g[1]))
    start, regions = 0.0, []
    while True:
        fixed, slope, names = current
        # Lines with a smaller slope cut below the current one at n >= start (it is lowest there);
        # the first to cut takes over, and of lines cutting at the same n the flattest.
        cuts = [
            (max((f - fixed) / (slope - s), start), s, group)
            for group in groups
            for f, s in [group[:2]]
            if s < slope and not _same(s, slope)
        ]
        if not cuts:
            regions.append(Region(start, None, names))
            return regions
        nbytes, _, current = min(cuts, key=lambda cut: (cut[0], cut[1]))
        if nbytes > start:
            regions.append(Region(start, nbytes, names))
        start = nbytes


# -- fitting α, β, γ to a measured sweep ----------------------------------------------------------

PARAM_NAMES = ("alpha", "beta", "gamma")


class Sample(NamedTuple):
    """One measured allreduce: `algorithm` took `seconds` for `nbytes` bytes."""

    algorithm: str
    nbytes: int
    seconds: float


class FitRow(NamedTuple):
    """A measurement next to the fitted model's prediction."""

    algorithm: str
    nbytes: int
    measured: float  # seconds
    predicted: float
    relative_error: float  # (predicted - measured) / measured


class Fit(NamedTuple):
    """The outcome of `fit`: the parameters, which were fitted, and how well they predict."""

    params: Params
    fitted: tuple[str, ...]  # names from PARAM_NAMES
    held: tuple[str, ...]
    note: str  # why a parameter was held although not given, or ""
    r_squared: float  # of the predicted against the measured times
    rows: list[FitRow]


def fit(samples: Sequence[Sample], ranks: int, held: dict[str, float] | None = None) -> Fit:
    """Fit the parameters not in `held` to `samples` by non-negative least relative squares."""
    # Each sample gives one equation a·α + b·nβ + c·nγ = t, divided by t so that an 8-byte message
    # counts as much as a 64 MiB one. The ring, naive, tree and (power-of-two) Rabenseifner costs
    # all scale β and γ as 2:1, so their samples alone fix only 2β + γ: then γ is held at the
    # default (or the --gamma given) and the note says so; recursive-doubling samples separate the
    # two.
    held = dict(held or {})
    unknown = set(held) - set(PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} (known: {PARAM_NAMES})")
    if not samples:
        raise ValueError("no measurements to fit")
    if ranks < 2:
        raise ValueError(
            "a sweep on 1 rank cannot be fitted: a one-rank allreduce sends and adds nothing"
        )
    measured = np.array([s.seconds for s in samples], dtype=float)
    if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
        raise ValueError("measured times must be positive and finite")
    design = np.array(
        [[c.a, c.b * s.nbytes, c.c * s.nbytes] for s in samples for c in [cost(s.algorithm, ranks)]]
    )
    weighted = design / measured[:, None]  # relative errors: every equation divided by its t
    note = ""
    free = [i for i, name in enumerate(PARAM_NAMES) if name not in held]
    if not _independent(weighted[:, free]) and 2 in free:
        held["gamma"] = DEFAULT_GAMMA
        free.remove(2)
        note = (
            f"gamma held at {DEFAULT_GAMMA:g} s/B: these rows scale beta and gamma alike and fix "
            "only 2*beta + gamma (give --gamma, or fit recursive-doubling rows too)"
        )
    if not _independent(weighted[:, free]):
        names = ", ".join(PARAM_NAMES[i] for i in free)
        raise ValueError(f"cannot fit {names}: the sweep needs at least two different sizes")
    fixed = np.array([held.get(name, 0.0) for name in PARAM_NAMES])
    rest = np.ones(len(samples)) - weighted @ fixed  # what the free parameters must explain
    values = fixed.copy()
    values[free] = _nnls(weighted[:, free], rest)
    params = Params(*map(float, values))
    predicted = design @ values
    residual = float(np.sum((predicted - measured) ** 2))
    spread = float(np.sum((measured - measured.mean()) ** 2))
    rows = [
        FitRow(s.algorithm, s.nbytes, s.seconds, float(p), float((p - s.seconds) / s.seconds))
        for s, p in zip(samples, predicted, strict=True)
    ]
    return Fit(
        params,
        tuple(PARAM_NAMES[i] for i in free),
        tuple(name for name in PARAM_NAMES if name in held),
        note,
        1 - residual / spread if spread > 0 else math.nan,
        rows,
    )


class Line(NamedTuple):
    """t = fixed + per_byte * n, and its worst relative error on the samples it was fitted to."""

    fixed: float  # seconds
    per_byte: float  # seconds per byte
    worst: float  # max |predicted - measured| / measured


def best_line(nbytes: Sequence[float], seconds: Sequence[float]) -> Line:
    """The line t = a + b*n (a, b >= 0) with the smallest worst relative error on these times."""
    # For one algorithm at one P every α-β-γ cost is such a line (a counts the α's, b the β's and
    # γ's per byte), so no fit can predict these times better than `worst`, however it is made: a
    # floor well above the fit's own error says the machine is not linear in n over this range
    # (caches, protocol switches), not that the fit went wrong. A linear program: minimise e subject
    # to |a + b*n - t| <= e*t for every sample.
    from scipy.optimize import linprog  # a dependency anyway (Numba's np.dot needs it)

    n, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    n_scale, t_scale = n.max(), t.max()  # solve for a / t_scale and b * n_scale / t_scale
    line = np.stack([np.ones_like(n), n / n_scale], axis=1) * t_scale / t[:, None]
    ones = np.ones(len(n))
    # variables (a, b, e), row by row divided by t: line - e <= 1 and -line - e <= -1
    bound = np.block([[line, -ones[:, None]], [-line, -ones[:, None]]])
    result = linprog([0, 0, 1], A_ub=bound, b_ub=np.concatenate([ones, -ones]),
                     bounds=[(0, None)] * 3, method="highs")  # fmt: skip
    if not result.success:
        raise ValueError(f"no best line: {result.message}")
    # (the solver may return -1e-17 for a bound of 0)
    a, b = max(result.x[0], 0.0) * t_scale, max(result.x[1], 0.0) * t_scale / n_scale
    return Line(float(a), float(b), float(np.max(np.abs((a + b * n - t) / t))))


def _independent(matrix: np.ndarray) -> bool:
    """True if the columns of `matrix` are linearly independent (after scaling each to norm 1)."""
    if matrix.shape[1] == 0:
        return True
    norms = np.linalg.norm(matrix, axis=0)
    if np.any(norms == 0):
        return False
    return int(np.linalg.matrix_rank(matrix / norms, tol=1e-9)) == matrix.shape[1]


def _nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |matrix x - target| over x >= 0, by trying every set of zero components (k <= 3)."""
    k = matrix.shape[1]
    best, best_residual = np.zeros(k), float(np.sum(target**2))
    for size in range(1, k + 1):
        for active in itertools.combinations(range(k), size):
            cols = list(active)
            x, *_ = np.linalg.lstsq(matrix[:, cols], target, rcond=None)
            if np.any(x < 0):
                continue  # the optimum with these components free lies outside x >= 0
            candidate = np.zeros(k)
            candidate[cols] = x
            residual = float(np.sum((matrix @ candidate - target) ** 2))
            if residual < best_residual:
                best, best_residual = candidate, residual
    return best


def load_sweep(path: str, algorithms: Iterable[str] = ("ring",)) -> tuple[int, list[Sample]]:
    """P and the samples of `algorithms` in a `syncsgd bench allreduce --json` file."""
    document = _read_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise ValueError(f"{path} is not the output of `syncsgd bench allreduce --json` (no rows)")
    ranks = document.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 2**31:
        raise ValueError(f"{path}: 'ranks' must be an integer from 1 to 2**31, got {ranks!r}")
    wanted = tuple(algorithms)
    samples = [
        _row_sample(path, number, row)
        for number, row in enumerate(document["rows"])
        if _row_algorithm(path, number, row) in wanted
    ]
    if not samples:
        present = sorted({str(row.get("algorithm")) for row in document["rows"]})
        raise ValueError(
            f"{path} has no rows of {', '.join(wanted)} (it has: {', '.join(present) or 'none'})"
        )
    return ranks, samples


def _read_json(path: str) -> Any:
    """The parsed JSON of `path`; a missing, unreadable or malformed file is a ValueError."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the reader
        raise ValueError(f"cannot read {path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"cannot read {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: its arrays or objects nest deeper than the "
                         f"{sys.getrecursionlimit()} levels Python's JSON reader takes; a sweep "
                         "of bench allreduce nests 3") from None  # fmt: skip


def _row_algorithm(path: str, number: int, row: Any) -> Any:
    """The algorithm of row `number`, once the row is known to have every field a sample needs."""
    if not isinstance(row, dict) or not {"size_bytes", "algorithm", "time_us"} <= row.keys():
        raise ValueError(f"{path}: row {number} lacks size_bytes, algorithm or time_us")
    return row["algorithm"]


def _row_sample(path: str, number: int, row: dict[str, Any]) -> Sample:
    """The sample of row `number`: its algorithm, a positive byte count and a positive time."""
    nbytes, micros = row["size_bytes"], row["time_us"]
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{path}: row {number} has size_bytes {nbytes!r}")
    if not isinstance(micros, (int, float)) or not math.isfinite(micros) or micros <= 0:
        raise ValueError(f"{path}: row {number} has time_us {micros!r}")
    return Sample(row["algorithm"], nbytes, micros * 1e-6)


# -- the command line -----------------------------------------------------------------------------


def parse_quantity(text: str) -> float:
    """A number >= 0 such as 2e-6, or a quotient such as 1/12.5e9 or 1/(12.5e9)."""
    parts = text.replace(" ", "").split("/")
    try:
        if len(parts) > 2:
            raise ValueError
        numbers = [float(part.removeprefix("(").removesuffix(")")) for part in parts]
        value = numbers[0] / numbers[1] if len(numbers) == 2 else numbers[0]
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"not a number: {text!r} (e.g. 2e-6 or 1/12.5e9)"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_quantity(text: str) -> float:
    """A number > 0 as `parse_quantity` reads it (a rate that divides)."""
    value = parse_quantity(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """Comma-separated byte sizes such as 8,1K,1M,64M."""
    from syncsgd.apps.bench.allreduce import parse_bytes

    return comma_list(text, parse_bytes, "8,1K,1M", what="sizes")


def algorithm_list(text: str) -> list[str]:
    """Comma-separated names from ALGORITHMS."""
    names = comma_separated(text)
    unknown = [name for name in names if name not in ALGORITHMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {', '.join(unknown) or repr(text)} (choose from "
            f"{', '.join(ALGORITHMS)})"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd model`."""
    RANK_COUNTS.add(
        parser,
        default=list(DEFAULT_RANKS),
        help="numbers of ranks to predict for (default 2,8,1024)",
    )
    parser.add_argument(
        "--sizes",
        type=size_list,
        default=list(DEFAULT_SIZES),
        help="message sizes in bytes (default 8,1K,64K,1M,64M)",
    )
    parser.add_argument(
        "--algorithms",
        type=algorithm_list,
        default=list(ALGORITHMS),
        help=f"algorithms to compare (default {','.join(ALGORITHMS)})",
    )
    parser.add_argument(
        "--alpha",
        type=parse_quantity,
        default=None,
        help=f"seconds per message (default {DEFAULT_ALPHA:g})",
    )
    parser.add_argument(
        "--beta",
        type=parse_quantity,
        default=None,
        help="seconds per byte sent (default 1/12.5e9: a 100 Gb/s network)",
    )
    parser.add_argument(
        "--gamma",
        type=parse_quantity,
        default=None,
        help=f"seconds per byte reduced (default {DEFAULT_GAMMA:g}: summing at 10 GB/s)",
    )
    reads(parser.add_argument(
        "--fit",
        metavar="BENCH_JSON",
        help="fit alpha, beta, gamma to a `syncsgd bench allreduce --json` sweep; "
        "the ones given on the command line are held fixed",
    ))  # fmt: skip
    parser.add_argument(
        "--fit-algorithms",
        type=algorithm_list,
        default=["ring"],
        help="the rows of the sweep to fit (default ring)",
    )
    add_step_arguments(parser)
    parser.add_argument(
        "--memory", nargs=argparse.REMAINDER, metavar="TRAIN_OPTIONS",
        help="predict the memory per rank of the `syncsgd train` run these options describe "
        "(every option after --memory is train's; --memory-limit BYTES: the largest batch "
        "that fits per stage); `syncsgd model --memory --help` lists them (docs/memory.md)",
    )  # fmt: skip


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd model` that predict a training step: BatchNorm, --overlap."""
    parser.add_argument(
        "--batchnorm",
        metavar="WIDTHS",
        type=hidden_sizes,
        help="also predict --batchnorm sync's allreduces per step for hidden layers of these "
        "widths (e.g. 256,256): per layer, the sum and the centred squares ((n + 1) x 8 B each) "
        "and the backward pair (2n x 8 B)",
    )
    parser.add_argument(
        "--overlap", metavar="SIZES", type=layer_sizes,
        help="predict the step of an MLP of these layer sizes (e.g. 784,256,256,10) with and "
        "without --overlap for each bucket size (ring allreduce), and the bucket size that "
        "minimises it",
    )  # fmt: skip
    parser.add_argument("--model", metavar="SPEC", type=model_spec,
                        help="predict the step of this --model network (as `syncsgd train` "
                        "takes it, presets too, e.g. simple-cnn) as --overlap does an MLP's: "
                        "its compute from its layers' products, conv included")  # fmt: skip
    parser.add_argument("--input-shape", metavar="C,H,W", type=dimensions,
                        help="--model: one sample's shape, e.g. 1,28,28 (required)")
    parser.add_argument("--classes", type=positive_int, default=10,
                        help="--model: the outputs of its last dense layer (default 10)")
    parser.add_argument("--shard", type=positive_int, default=64,
                        help="--overlap, --model: samples per rank (default 64)")  # fmt: skip
    parser.add_argument("--flops", type=positive_quantity, default=DEFAULT_FLOPS,
                        help="--overlap, --model: multiply-adds per second of one rank's "
                        f"kernels (default {DEFAULT_FLOPS:g})")  # fmt: skip
    parser.add_argument("--itemsize", type=positive_int, default=8,
                        help="--overlap, --model: bytes per parameter (8: float64, 4: float32)")
    JSON.add(parser, help="write the predictions as JSON")
    writes(parser.add_argument("--png", metavar="PATH", type=figure_path,
                               help="draw time against size per algorithm (log-log), the "
                               "fastest shaded and where it changes marked; with --fit, the "
                               "measurements and their residuals: a slide, .png, .svg or "
                               ".pdf"))  # fmt: skip


Extra = Callable[[argparse.Namespace, Params, dict[str, Any]], list[str]]


def main(options: argparse.Namespace, extra: Extra | None = None) -> int:
    """`syncsgd model`: the prediction table, the crossovers and, with --fit, the fit; `extra`
    adds lines (and JSON to its dict) for the parameters used."""
    if getattr(options, "memory", None) is not None:  # train's options: another parser's
        from syncsgd.apps import costmodel_memory

        return costmodel_memory.main(options.memory)
    step_network(options)  # a bad --model fails before anything is printed
    for path in (options.json, options.png):
        if path:
            check_writable(path)
    given = {
        name: getattr(options, name)
        for name in PARAM_NAMES
        if getattr(options, name, None) is not None
    }
    result: dict[str, Any] = {}
    lines: list[str] = []
    if options.fit:
        sweep_ranks, samples = load_sweep(options.fit, options.fit_algorithms)
        fitted = fit(samples, sweep_ranks, given)
        params = fitted.params
        lines += describe_fit(fitted, options.fit, sweep_ranks)
        lines += fit_warning(fitted, sweep_ranks, options.ranks)
        result["fit"] = fit_json(fitted, options.fit, sweep_ranks)
        result["fit"]["warning"] = " ".join(fit_warning(fitted, sweep_ranks, options.ranks))
    else:
        defaults = {"alpha": DEFAULT_ALPHA, "beta": DEFAULT_BETA, "gamma": DEFAULT_GAMMA}
        params = Params(**{**defaults, **given})
    lines.append(describe_params(params))
    lines += prediction_table(options.ranks, options.sizes, options.algorithms, params)
    for ranks in options.ranks:
        lines += describe_crossovers(ranks, params, options.algorithms)
    if options.batchnorm:
        lines += describe_batchnorm(options.batchnorm, options.ranks, options.algorithms, params)
        result["batchnorm"] = batchnorm_json(options.batchnorm, options.ranks,
                                             options.algorithms, params)  # fmt: skip
    network = step_network(options)
    if network is not None:
        table = overlap_table(network, options.shard, options.flops, options.itemsize,
                              options.ranks, params)  # fmt: skip
        lines += describe_overlap(table, network, options.shard, options.flops)
        lines += describe_derivation(table, network, options.shard, options.flops,
                                     options.itemsize, params)  # fmt: skip
        result["overlap"] = table
    if extra is not None:
        lines += extra(options, params, result)
    print("\n".join(lines))
    if options.png:
        fit_result, fit_ranks = (fitted, sweep_ranks) if options.fit else (None, None)
        draw_png(options.png, options.ranks, options.sizes, options.algorithms, params,
                 fit_result, fit_ranks)  # fmt: skip
        print(f"wrote {options.png}")
    if options.json:
        result.update(predictions_json(options.ranks, options.sizes, options.algorithms, params))
        jsonout.write(options.json, result)
    return 0


# -- output ---------------------------------------------------------------------------------------


def format_seconds(seconds: float) -> str:
    """3 significant digits in s, ms, us or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds > 0 else "0 s"


def format_bytes(nbytes: float) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB, 3 significant digits."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def describe_params(params: Params) -> str:
    """One line with α, β, γ and the bandwidths they mean."""

    def rate(per_byte: float) -> str:
        return f" ({1 / per_byte / 1e9:.3g} GB/s)" if per_byte > 0 else ""

    return (
        f"# alpha = {format_seconds(params.alpha)} per message, beta = {params.beta:.3g} s/B"
        f"{rate(params.beta)}, gamma = {params.gamma:.3g} s/B{rate(params.gamma)}"
    )


def prediction_table(ranks: Sequence[int], sizes: Sequence[int], algorithms: Sequence[str],
                     params: Params) -> list[str]:  # fmt: skip
    """Predicted time of every algorithm for every (P, size); '*' marks the fastest."""
    widths = [max(len(name), 10) for name in algorithms]
    header = f"{'ranks':>7} {'size':>9}  " + "  ".join(
        f"{name:>{w}}" for name, w in zip(algorithms, widths, strict=True)
    )
    lines = [header + "  best"]
    for p in ranks:
        for nbytes in sizes:
            times = [predict(name, p, nbytes, params) for name in algorithms]
            fastest = min(times)
            marks = ["*" if _same(t, fastest) else " " for t in times]
            cells = "  ".join(
                f"{format_seconds(t) + mark:>{w + 1}}"
                for t, mark, w in zip(times, marks, widths, strict=True)
            )
            best = " = ".join(n for n, m in zip(algorithms, marks, strict=True) if m == "*")
            lines.append(f"{p:>7} {format_bytes(nbytes):>9} {cells}  {best}")
    return lines


def batchnorm_messages(widths: Sequence[int], exact: bool = False) -> list[int]:
    """The bytes of each allreduce --batchnorm sync adds per step, for these hidden widths."""
    # Float64 sums: per layer the sum with the count, the centred squares with a spare slot, and
    # the backward pair; exact mode first agrees on per-feature bounds (MAX) before each.
    sizes = []
    for n in widths:
        sizes += [8 * (n + 1), 8 * (n + 1), 16 * n]
        if exact:
            sizes += [8 * n, 8 * n, 16 * n]
    return sizes


def batchnorm_seconds(widths: Sequence[int], algorithm: str, ranks: int, params: Params,
                      exact: bool = False) -> float:  # fmt: skip
    """Predicted seconds per step of --batchnorm sync's allreduces (latency-bound: small)."""
    return sum(predict(algorithm, ranks, nbytes, params)
               for nbytes in batchnorm_messages(widths, exact))  # fmt: skip


def describe_batchnorm(widths: Sequence[int], ranks: Sequence[int], algorithms: Sequence[str],
                       params: Params) -> list[str]:  # fmt: skip
    """One line per P: what --batchnorm sync's allreduces cost per step, float and exact mode."""
    shown = ",".join(map(str, widths))
    lines = [f"# --batchnorm sync, hidden {shown}: {3 * len(widths)} more allreduces per step "
             f"({6 * len(widths)} in exact mode), {sum(batchnorm_messages(widths))} B in all"]
    for p in ranks:
        cells = ", ".join(
            f"{name} {format_seconds(batchnorm_seconds(widths, name, p, params))} "
            f"(exact {format_seconds(batchnorm_seconds(widths, name, p, params, True))})"
            for name in algorithms
        )
        lines.append(f"#   P = {p}: {cells}")
    return lines


def batchnorm_json(widths: Sequence[int], ranks: Sequence[int], algorithms: Sequence[str],
                   params: Params) -> dict[str, Any]:  # fmt: skip
    """--batchnorm sync's predicted seconds per step, per P and algorithm, float and exact."""
    return {
        "widths": list(widths), "messages": batchnorm_messages(widths),
        "seconds": {str(p): {name: batchnorm_seconds(widths, name, p, params)
                             for name in algorithms} for p in ranks},
        "exact_seconds": {str(p): {name: batchnorm_seconds(widths, name, p, params, True)
                                   for name in algorithms} for p in ranks},
    }  # fmt: skip


# -- the training step with --overlap ------------------------------------------------------------

DEFAULT_FLOPS = 1e10  # multiply-adds per second: BLAS on one core, roughly


def layer_sizes(text: str) -> tuple[int, ...]:
    """'784,256,10' -> (784, 256, 10): an MLP's input, hidden and output sizes."""
    try:
        sizes = tuple(int(part) for part in comma_separated(text))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"layer sizes must be 2 or more integers >= 1: {text!r}")
    return sizes


class StepParts(NamedTuple):
    """Predicted seconds of a step's parts; comms per bucket in parameter order."""

    forward: float
    backward: float
    comms: tuple[float, ...]  # comms[0]: the first layer's bucket, the last one complete
    update: float


def plain_step(parts: StepParts) -> float:
    """Without --overlap: every allreduce after the whole backward pass."""
    return parts.forward + parts.backward + sum(parts.comms) + parts.update


def overlapped_step(parts: StepParts) -> float:
    """forward + max(backward, comm of all but the first bucket) + comm of the first + update."""
    # The buckets complete from the last layer back; all but the first layer's can travel while
    # the backward pass goes on, the first layer's only after it.
    return (parts.forward + max(parts.backward, sum(parts.comms[1:])) + parts.comms[0]
            + parts.update)  # fmt: skip


def model_spec(text: str) -> str:
    """A --model spec, checked against the layers' catalogue (presets expanded)."""
    from syncsgd.nn.network import check_spec

    problem = check_spec("--model", text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def step_network(options: argparse.Namespace) -> Network | None:
    """The network whose step to predict: --model's, --overlap's MLP, or None for neither."""
    from syncsgd.nn.mlp import mlp
    from syncsgd.nn.network import build

    dtype = np.dtype(np.float64 if options.itemsize == 8 else np.float32)
    if options.model is None:
        if options.input_shape is not None:
            raise ValueError("--input-shape is the shape of --model's input: give a --model SPEC")
        if options.overlap is None:
            return None
        return mlp(tuple(options.overlap), dtype=dtype)
    if options.overlap is not None:
        raise ValueError("--overlap SIZES and --model SPEC both name the network: give one")
    if options.input_shape is None:
        raise ValueError("--model needs --input-shape, one sample's shape (e.g. 1,28,28)")
    return build(options.model, options.input_shape, options.classes, "xent", dtype)


def step_parts(network: Network, shard: int, flops: float, itemsize: int, ranks: int,
               bucket_bytes: int | None, params: Params) -> StepParts:  # fmt: skip
    """The parts of one step of this network, cut into --bucket-bytes buckets."""
    from syncsgd.training.step import MIN_RIDER_SLOTS, bucket_slices

    forward, backward = (shard * madds / flops for madds in network.step_multiply_adds())
    buffer = np.empty(network.n_params + MIN_RIDER_SLOTS, network.dtype)
    comms = tuple(predict("ring", ranks, (b.stop - b.start) * itemsize, params)
                  for b in bucket_slices(network, buffer, bucket_bytes))  # fmt: skip
    update = 2 * network.n_params * itemsize * params.gamma  # read and write, like a reduction
    return StepParts(forward, backward, comms, update)


def bucket_choices(network: Network, itemsize: int) -> list[int | None]:
    """--bucket-bytes worth comparing: one per layer, powers of 4 up to the model, one for all."""
    total = network.n_params * itemsize
    choices: list[int | None] = [0]
    size = 1024
    while size < total:
        choices.append(size)
        size *= 4
    return [*choices, None]


def overlap_table(network: Network, shard: int, flops: float, itemsize: int,
                  ranks: Sequence[int], params: Params) -> list[dict[str, Any]]:  # fmt: skip
    """Per P and bucket size: the buckets, the predicted plain and overlapped steps."""
    rows = []
    for p in ranks:
        seen = set()
        derived = derived_bucket_bytes(network, shard, flops, itemsize, p, params)
        for choice in with_derived(bucket_choices(network, itemsize), derived):
            parts = step_parts(network, shard, flops, itemsize, p, choice, params)
            if parts.comms in seen and choice != derived:  # the same cut as a smaller choice
                continue
            seen.add(parts.comms)
            rows.append({"ranks": p, "bucket_bytes": choice, "buckets": len(parts.comms),
                         "compute_s": parts.forward + parts.backward + parts.update,
                         "comm_s": sum(parts.comms), "plain_s": plain_step(parts),
                         "overlap_s": queued_overlap_step(network, parts, choice),
                         "derived": choice == derived})  # fmt: skip
    return rows


def with_derived(choices: list[int | None], derived: int) -> list[int | None]:
    """The bucket sizes to compare with the derived optimum among them, in increasing order."""
    sizes = sorted({*(c for c in choices if c is not None), derived})
    return [*sizes, None] if None in choices else [*sizes]


def ring_line(ranks: int, params: Params) -> RingLine:
    """One ring allreduce as a + s·b: a = 2(P-1)α per bucket, s per byte."""
    from syncsgd.apps.costmodel_buckets import RingLine

    ring = cost("ring", ranks)
    return RingLine(ring.a * params.alpha, ring.b * params.beta + ring.c * params.gamma)


def derived_bucket_bytes(network: Network, shard: int, flops: float, itemsize: int, ranks: int,
                         params: Params) -> int:  # fmt: skip
    """The bucket size that minimises the exposed tail (docs/overlap.md derives it)."""
    from syncsgd.apps.costmodel_buckets import optimal_bucket_bytes

    backward = shard * network.step_multiply_adds()[1] / flops
    best = optimal_bucket_bytes(network.n_params * itemsize, backward, ring_line(ranks, params))
    return max(1, round(best))


def queued_overlap_step(network: Network, parts: StepParts, bucket_bytes: int | None) -> float:
    """The overlapped step, each bucket sent once the backward pass has completed it."""
    from syncsgd.apps.costmodel_buckets import queued_step, ready_seconds
    from syncsgd.training.step import MIN_RIDER_SLOTS, bucket_slices

    buffer = np.empty(network.n_params + MIN_RIDER_SLOTS, network.dtype)
    ready = ready_seconds(network, bucket_slices(network, buffer, bucket_bytes), parts.backward)
    return queued_step(parts.forward, parts.backward, parts.comms, ready, parts.update)


def describe_derivation(table: list[dict[str, Any]], network: Network, shard: int, flops: float,
                        itemsize: int, params: Params) -> list[str]:  # fmt: skip
    """Per P, the derived bucket size with the terms it comes from, and its predicted step."""
    backward = shard * network.step_multiply_adds()[1] / flops
    nbytes = network.n_params * itemsize
    lines = [f"# the derived bucket size b* = min(n·sqrt(a/T_b), a/(T_b/n - s)) (docs/overlap.md): "
             f"n = {format_bytes(nbytes)} of gradient, backward T_b = {format_seconds(backward)}, "
             "a = 2(P-1)α per bucket, s = 2(P-1)/P·β + (P-1)/P·γ per byte"]  # fmt: skip
    for p in sorted({row["ranks"] for row in table}):
        line = ring_line(p, params)
        rows = [row for row in table if row["ranks"] == p]
        derived = next(row for row in rows if row["derived"])
        best = min(rows, key=lambda row: row["overlap_s"])
        agrees = ("the best of the table" if derived is best else
                  f"the table's best is {_bucket_shown(best['bucket_bytes'])}, "
                  f"{format_seconds(best['overlap_s'])}: b* takes equal buckets of a gradient "
                  "produced evenly; the table, whole tensors complete layer by layer")  # fmt: skip
        size = derived_bucket_bytes(network, shard, flops, itemsize, p, params)
        lines.append(f"#   P = {p}: a = {format_seconds(line.latency)}, s = {line.per_byte:.3g} "
                     f"s/B: b* = {format_bytes(size)}, step {format_seconds(derived['overlap_s'])}"
                     f" ({agrees})")  # fmt: skip
    return lines


def _bucket_shown(bucket_bytes: int | None) -> str:
    """--bucket-bytes as the table shows it."""
    if bucket_bytes is None:
        return "one"
    return "per layer" if bucket_bytes == 0 else format_bytes(bucket_bytes)


def describe_overlap(table: list[dict[str, Any]], network: Network, shard: int,
                     flops: float) -> list[str]:  # fmt: skip
    """The table of `overlap_table`, the best bucket size per P marked."""
    forward, backward = network.step_multiply_adds()
    lines = [f"# the step of {network.summary()} on {','.join(map(str, network.in_shape))} "
             f"inputs: {network.n_params} parameters, {forward:,} multiply-adds per sample "
             f"forward, {backward:,} backward",
             f"# {shard} samples per rank at "
             f"{flops:g} multiply-adds/s, ring allreduce; overlapped: each bucket sent once the "
             "backward pass has completed it, one at a time, the first layer's last",
             f"{'P':>6} {'--bucket-bytes':>14} {'buckets':>7} {'compute':>10} {'comm':>10} "
             f"{'plain':>10} {'overlap':>10}"]  # fmt: skip
    for p in sorted({row["ranks"] for row in table}):
        rows = [row for row in table if row["ranks"] == p]
        best = min(rows, key=lambda row: row["overlap_s"])
        for row in rows:
            shown = ("b* " if row.get("derived") else "") + _bucket_shown(row["bucket_bytes"])
            lines.append(
                f"{p:>6} {shown:>14} {row['buckets']:>7} {format_seconds(row['compute_s']):>10} "
                f"{format_seconds(row['comm_s']):>10} {format_seconds(row['plain_s']):>10} "
                f"{format_seconds(row['overlap_s']):>10}{'  <- best' if row is best else ''}")
    return lines


def describe_crossovers(ranks: int, params: Params, algorithms: Sequence[str]) -> list[str]:
    """The fastest algorithm by size on `ranks` ranks, and every pairwise crossover."""
    regions = best_by_size(ranks, params, algorithms)
    envelope = " | ".join(
        " = ".join(r.algorithms) + (f" up to {format_bytes(r.stop)}" if r.stop else " beyond")
        for r in regions
    )
    if len(regions) == 1:
        envelope = " = ".join(regions[0].algorithms) + " at every size"
    lines = [f"# P = {ranks}: fastest: {envelope}"]
    for c in crossovers(ranks, params, algorithms):
        lines.append(f"#   {c.faster} overtakes {c.slower} above {format_bytes(c.nbytes)}")
    return lines


def describe_fit(result: Fit, path: str, ranks: int) -> list[str]:
    """The fitted parameters, R², and each measurement next to its prediction."""
    algorithms = ", ".join(dict.fromkeys(row.algorithm for row in result.rows))
    fitted = ", ".join(result.fitted) or "nothing"
    held = f"; held: {', '.join(result.held)}" if result.held else ""
    lines = [
        f"# fit to {len(result.rows)} {algorithms} rows of {path} (P = {ranks}): "
        f"fitted {fitted}{held}"
    ]
    if result.note:
        lines += textwrap.wrap(result.note, 98, initial_indent="# note: ", subsequent_indent="#   ")
    lines.append(f"{'algorithm':>18} {'size':>9} {'measured':>10} {'predicted':>10} {'error':>7}")
    for row in result.rows:
        lines.append(
            f"{row.algorithm:>18} {format_bytes(row.nbytes):>9} {format_seconds(row.measured):>10} "
            f"{format_seconds(row.predicted):>10} {row.relative_error:>+7.1%}"
        )
    errors = [abs(row.relative_error) for row in result.rows]
    large = [abs(row.relative_error) for row in result.rows if row.nbytes >= FIT_BAR_FROM]
    summary = f"# R^2 = {result.r_squared:.4f}; |error| median {np.median(errors):.1%}, max "
    summary += f"{max(errors):.1%}"
    if large:
        summary += f"; from {format_bytes(FIT_BAR_FROM)}: max {max(large):.1%}"
    lines.append(summary)
    for algorithm, floor in linear_floors(result).items():
        lines.append(
            f"# {algorithm} from {format_bytes(FIT_BAR_FROM)}: no alpha-beta-gamma fit can do "
            f"better than a max error of {floor:.1%} on these times (the best line a + b*n)"
        )
    return lines


def fit_warning(result: Fit, sweep_ranks: int, ranks: Sequence[int]) -> list[str]:
    """A warning when a poor fit (low R²) is about to predict other numbers of ranks."""
    poor = math.isnan(result.r_squared) or result.r_squared < POOR_FIT
    elsewhere = [p for p in ranks if p != sweep_ranks]
    if not poor:
        return []
    where = f" for P = {', '.join(map(str, elsewhere))}" if elsewhere else ""
    return textwrap.wrap(
        f"WARNING: R^2 = {result.r_squared:.2f} < {POOR_FIT}: these α, β, γ explain little of "
        f"the measured times, so the predictions below{where} (measured at P = {sweep_ranks}) "
        f"are not to be trusted; measure more sizes or batches, or under less load",
        98, initial_indent="# ", subsequent_indent="# ",
    )  # fmt: skip


def linear_floors(result: Fit) -> dict[str, float]:
    """The worst error of each algorithm's `best_line` through its rows from FIT_BAR_FROM bytes."""
    floors = {}
    for algorithm in dict.fromkeys(row.algorithm for row in result.rows):
        rows = [r for r in result.rows if r.algorithm == algorithm and r.nbytes >= FIT_BAR_FROM]
        if len(rows) >= 3:
            best = best_line([r.nbytes for r in rows], [r.measured for r in rows])
            floors[algorithm] = best.worst
    return floors


def fit_json(result: Fit, path: str, ranks: int) -> dict[str, Any]:
    """The fit as a JSON-ready dict."""
    large = [abs(row.relative_error) for row in result.rows if row.nbytes >= FIT_BAR_FROM]
    return {
        "source": path,
        "ranks": ranks,
        "params": result.params._asdict(),
        "fitted": list(result.fitted),
        "held": list(result.held),
        "note": result.note,
        "r_squared": None if math.isnan(result.r_squared) else result.r_squared,
        "max_relative_error_from_64KiB": max(large) if large else None,
        "best_possible_max_error_from_64KiB": linear_floors(result),
        "rows": [
            {
                "algorithm": row.algorithm,
                "size_bytes": row.nbytes,
                "measured_s": row.measured,
                "predicted_s": row.predicted,
                "relative_error": row.relative_error,
            }
            for row in result.rows
        ],  # fmt: skip
    }


def predictions_json(ranks: Sequence[int], sizes: Sequence[int], algorithms: Sequence[str],
                     params: Params) -> dict[str, Any]:  # fmt: skip
    """Predictions, the fastest algorithm by size, and crossovers, as a JSON-ready dict."""
    rows = []
    for p in ranks:
        for nbytes in sizes:
            times = {name: predict(name, p, nbytes, params) for name in algorithms}
            fastest = min(times.values())
            rows += [
                {"ranks": p, "size_bytes": nbytes, "algorithm": name, "seconds": t,
                 "best": _same(t, fastest)}
                for name, t in times.items()
            ]  # fmt: skip
    return {
        "params": params._asdict(),
        "predictions": rows,
        "fastest": [
            {
                "ranks": p,
                "from_bytes": r.start,
                "to_bytes": r.stop,
                "algorithms": list(r.algorithms),
            }
            for p in ranks
            for r in best_by_size(p, params, algorithms)
        ],
        "crossovers": [c._asdict() for p in ranks for c in crossovers(p, params, algorithms)],
    }


# -- the figure (--png): time against size per algorithm, the fastest shaded ----------------------

LOWEST, HIGHEST = 8, 1 << 30  # the sizes drawn, in bytes, widened to the ones asked about
TEXT = 14  # points, on a 16:9 slide (syncsgd.util.figures)


def draw_png(path: str, ranks: Sequence[int], sizes: Sequence[int], algorithms: Sequence[str],
             params: Params, fitted: Fit | None = None,
             fit_ranks: int | None = None) -> None:  # fmt: skip
    """Write the figure to `path` (.png, .svg or .pdf): a panel per P, the residuals of a fit."""
    from syncsgd.util import figures

    figures.save(model_figure(ranks, sizes, algorithms, params, fitted, fit_ranks), path)


def model_figure(ranks: Sequence[int], sizes: Sequence[int], algorithms: Sequence[str],
                 params: Params, fitted: Fit | None = None,
                 fit_ranks: int | None = None) -> Any:  # fmt: skip
    """The slide: time against size per algorithm, a panel per P (at most three), one legend."""
    from syncsgd.util import figures

    shown = list(ranks)[:3]  # more panels than three leave no room for 14-point labels
    residuals = fitted is not None and fit_ranks in shown
    figure = figures.new_figure(layout="constrained")
    grid = figure.add_gridspec(2 if residuals else 1, len(shown),
                               height_ratios=[3, 1] if residuals else [1])  # fmt: skip
    styles = _styles(algorithms)
    n = np.geomspace(min(LOWEST, *sizes), max(HIGHEST, *sizes), 400)
    for column, p in enumerate(shown):
        axes = figure.add_subplot(grid[0, column])
        _panel(axes, p, n, algorithms, params, styles)
        if column > 0:
            axes.set_ylabel("")
        if fitted is not None and p == fit_ranks:
            _measured(axes, fitted, styles)
            _residuals(figure.add_subplot(grid[1, column], sharex=axes), fitted, styles)
    handles, labels = _legend_entries(figure)
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4),
                  fontsize=TEXT, frameon=False)  # fmt: skip
    figure.suptitle("α-β-γ model: " + _params_text(params), fontsize=TEXT + 2)
    return figure


def _styles(algorithms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """An Okabe-Ito colour, a dash pattern and a marker per algorithm: told apart without colour."""
    from syncsgd.util.figures import algorithm_style

    return {name: algorithm_style(name, i) for i, name in enumerate(algorithms)}


def _legend_entries(figure: Any) -> tuple[list[Any], list[str]]:
    """Every labelled line and patch of the figure, once each."""
    entries: dict[str, Any] = {}
    for axes in figure.axes:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)


def _params_text(params: Params) -> str:
    """'α = 2 µs, β = 80 ps/B (12.5 GB/s), γ = 100 ps/B'."""
    def rate(per_byte: float) -> str:
        return f" ({1 / per_byte / 1e9:.3g} GB/s)" if per_byte > 0 else ""

    return (f"α = {params.alpha * 1e6:.3g} µs, β = {params.beta:.3g} s/B{rate(params.beta)}, "
            f"γ = {params.gamma:.3g} s/B{rate(params.gamma)}")  # fmt: skip


def _panel(axes: Any, ranks: int, n: np.ndarray, algorithms: Sequence[str], params: Params,
           styles: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    """One P: a line per algorithm, the fastest one's region shaded, its changes marked."""
    from matplotlib.ticker import LogLocator

    times = {name: np.array([predict(name, ranks, x, params) for x in n]) for name in algorithms}
    for index, name in enumerate(algorithms):
        axes.plot(n, times[name], label=name, linewidth=2.2, markersize=8,
                  markevery=(5 * index, 40), **styles[name])  # fmt: skip
    fastest = np.min(np.stack(list(times.values())), axis=0)
    bottom = fastest.min() / 3
    for region in best_by_size(ranks, params, algorithms):
        inside = (n >= region.start) & (n <= (region.stop or np.inf))
        axes.fill_between(n[inside], bottom, fastest[inside], alpha=0.18, linewidth=0,
                          color=styles[region.algorithms[0]]["color"])  # fmt: skip
        if region.start > 0 and n[0] <= region.start <= n[-1]:
            axes.axvline(region.start, color="black", linestyle=":", linewidth=1.2,
                         label="the fastest changes")  # fmt: skip
    _ring_crossovers(axes, ranks, n, times, params, algorithms)
    axes.set(xscale="log", yscale="log", ylim=(bottom, None), xlabel="message size (bytes)",
             ylabel="predicted time (s)")  # fmt: skip
    axes.set_title(f"P = {ranks}: shaded = the fastest", fontsize=TEXT)
    axes.xaxis.label.set_size(TEXT)
    axes.yaxis.label.set_size(TEXT)
    axes.xaxis.set_major_locator(LogLocator(numticks=4))
    axes.yaxis.set_major_locator(LogLocator(numticks=5))
    axes.tick_params(labelsize=TEXT)
    axes.grid(True, which="major", alpha=0.3)


def _ring_crossovers(axes: Any, ranks: int, n: np.ndarray, times: dict[str, np.ndarray],
                     params: Params, algorithms: Sequence[str]) -> None:  # fmt: skip
    """Hollow circles where the ring overtakes another algorithm (the text lists them)."""
    if "ring" not in times:
        return
    for crossing in crossovers(ranks, params, algorithms):
        if "ring" not in (crossing.faster, crossing.slower) or not n[0] <= crossing.nbytes <= n[-1]:
            continue
        at = float(np.interp(crossing.nbytes, n, times["ring"]))
        axes.plot([crossing.nbytes], [at], "o", markerfacecolor="white", markeredgecolor="black",
                  markersize=10, markeredgewidth=1.8, linestyle="none",
                  label="the ring crosses another")  # fmt: skip


def _measured(axes: Any, fitted: Fit, styles: dict[str, dict[str, Any]]) -> None:
    """The sweep's measured times as crosses on the panel of its P."""
    for name in dict.fromkeys(row.algorithm for row in fitted.rows):
        rows = [row for row in fitted.rows if row.algorithm == name]
        colour = styles.get(name, {}).get("color", "black")
        axes.plot([r.nbytes for r in rows], [r.measured for r in rows], "x", color=colour,
                  markersize=9, markeredgewidth=2, label=f"{name} measured")  # fmt: skip


def _residuals(axes: Any, fitted: Fit, styles: dict[str, dict[str, Any]]) -> None:
    """(predicted - measured) / measured of every fitted row, against the size."""
    for name in dict.fromkeys(row.algorithm for row in fitted.rows):
        rows = [row for row in fitted.rows if row.algorithm == name]
        style = styles.get(name, {"color": "black", "linestyle": "-", "marker": "x"})
        axes.plot([r.nbytes for r in rows], [100 * r.relative_error for r in rows],
                  linewidth=1.2, markersize=7, **style)  # fmt: skip
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set(xscale="log", xlabel="message size (bytes)", ylabel="fit error (%)")
    axes.set_title(f"residuals, R² = {fitted.r_squared:.3f}", fontsize=TEXT)
    axes.xaxis.label.set_size(TEXT)
    axes.yaxis.label.set_size(TEXT)
    axes.tick_params(labelsize=TEXT)
    axes.grid(True, alpha=0.3)
