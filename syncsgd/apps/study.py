"""The batch-size study: steps to a held-out target against the batch size, the gradient noise
scale beside the measured knee, and a time model that says how many ranks pay.

    syncsgd study batch-size --quick --png study.png --json study.json
    syncsgd study batch-size --batch-sizes 16,64,256 --lrs 0.05,0.1,0.2,0.4 --target-accuracy 0.8

Because syncsgd's result does not depend on the number of ranks, the number of steps to
reach a target is a property of the workload and the global batch size B alone (Shallue et al.
2019, "Measuring the effects of data parallelism on neural network training"), so the runs use one
rank by default. For every B, every (lr, momentum) of the grid trains for at most --max-steps steps
and is evaluated on the held-out samples once per as many training examples as are held out; the
settings that met the target at the earliest such evaluation train again with an evaluation after
every step, which gives the exact count. The fewest steps over the grid are the row's steps to
target.

Perfect scaling halves the steps when B doubles. The knee is B_crit of the fit
steps(B) = S_min (1 + B_crit / B) (McCandlish et al. 2018, "An empirical model of large-batch
training"), where the steps are twice their minimum. Their predictor of it, the gradient noise
scale B_simple = tr(Σ)/|G|², needs two batch sizes at once, which data parallelism gives for free
(each rank's shard and the allreduced batch): for every B, the best setting trains once more on
--noise-ranks thread ranks with `noise_scale=True` - the same trajectory, since the result does not
depend on P - so every row has its own estimate over its own way to the target. The estimate
depends on the lr (a large lr bounces across the valley, where |G|² is larger), so the summary
quotes the smallest batch size's, whose lr is the smallest, and the range over all of them.

The time model is a PREDICTION: time to target on P ranks = steps(B) x (compute of the largest
shard ceil(B/P) - fixed + per-sample seconds fitted to the runs' measured compute - + the α-β-γ
cost model's allreduce of the gradient's bytes on P ranks + the measured update).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from syncsgd.apps import costmodel
from syncsgd.training import noise
from syncsgd.training.config import add_train_options
from syncsgd.training.data import is_text
from syncsgd.training.result import NonFiniteError
from syncsgd.util import jsonout
from syncsgd.util.argtypes import (
    comma_list,
    finite_float,
    nonnegative_int,
    positive_int,
)
from syncsgd.util.figures import figure_path
from syncsgd.util.files import check_writable
from syncsgd.util.options import JSON, RANKS, reads, writes

STOPS_PAYING = 0.10  # adding ranks stops paying when a doubling gains less than 10%
QUICK: dict[str, Any] = {
    "data": "synthetic-classification-mlp",
    "samples": 16384,
    "features": 32,
    "hidden": (32,),
    "holdout": 0.25,
    "target_loss": 0.45,
    "batch_sizes": [8 << k for k in range(9)],  # 8 .. 2048
    "lrs": [0.025 * 2**k for k in range(9)],  # 0.025 .. 6.4
    "momentums": [0.0],
    "max_steps": 3000,
}
FULL: dict[str, Any] = {
    **QUICK,
    "batch_sizes": [4 << k for k in range(11)],  # 4 .. 4096
    "lrs": [0.0125 * 2 ** (k / 2) for k in range(19)],  # 0.0125 .. 6.4, by sqrt(2)
    "max_steps": 10000,
}

Trainer = Callable[..., Any]  # syncsgd.training.loop.train or a stand-in with its signature


# -- the gradient noise scale ---------------------------------------------------------------------


class NoiseEstimate(NamedTuple):
    """Unbiased one-step estimates of tr(Σ) (per-sample gradient covariance) and |G|²."""

    trace_sigma: float
    grad_norm_sq: float

    @property
    def b_simple(self) -> float:
        """The simple noise scale tr(Σ)/|G|² of these estimates (nan if |G|² is estimated 0)."""
        return self.trace_sigma / self.grad_norm_sq if self.grad_norm_sq else math.nan


def estimate_noise_scale(
    small_norms_sq: Sequence[float], small_sizes: Sequence[int], big_norm_sq: float, big_size: int
) -> NoiseEstimate | None:
    """tr(Σ) and |G|² from the ranks' |G_r|² (mean over b_r samples) and the batch's |G_B|²."""
    # With S = Σ_r |G_r|², K ranks with samples and H = Σ_r 1/b_r (ranks with b_r = 0 left out):
    # tr(Σ) = (S − K|G_B|²)/(H − K/B) and |G|² = |G_B|² − tr(Σ)/B, computed by the same
    # `syncsgd.training.noise.estimate` that training uses. None with one batch size only (K = 1).
    norms = np.asarray(small_norms_sq, dtype=np.float64)
    sizes = np.asarray(small_sizes, dtype=np.int64)
    if norms.ndim != 1 or norms.shape != sizes.shape:
        raise ValueError(f"need one |G_r|^2 per rank size, got {norms.shape} and {sizes.shape}")
    if np.any(sizes < 0) or int(sizes.sum()) != big_size or big_size < 1:
        raise ValueError(f"rank sizes {sizes.tolist()} must be >= 0 and add up to B = {big_size}")
    used = sizes > 0
    found = noise.estimate(
        float(norms[used].sum()),
        int(used.sum()),
        float(np.sum(1.0 / sizes[used])),
        big_norm_sq,
        big_size,
    )
    return None if found is None else NoiseEstimate(*found)


# -- one training run and the study ---------------------------------------------------------------


@dataclass
class Trial:
    """One training run of the grid: B, lr, momentum and how it went."""

    batch_size: int
    lr: float
    momentum: float
    eval_every: int
    steps_to_target: int | None  # None: not within the budget, or diverged
    steps_run: int
    diverged: bool
    held_out_loss: float | None  # at the last evaluation
    compute_seconds: float
    update_seconds: float
    seconds: float


@dataclass
class Row:
    """One batch size: its fewest steps to target over the grid, and its noise scale."""

    batch_size: int
    steps_to_target: int | None
    best_lr: float | None
    best_momentum: float | None
    lr_at_edge: bool = False  # the best lr is the smallest or the largest of the grid
    noise_scale: float | None = None
    noise_steps: int | None = None  # steps to target of the noise-scale run (the same, or close)
    trials: list[Trial] = field(default_factory=list)

    @property
    def examples_to_target(self) -> int | None:
        """B x steps to target."""
        return None if self.steps_to_target is None else self.batch_size * self.steps_to_target


@dataclass(frozen=True)
class StudySettings:
    """The grid and the budget of a batch-size study."""

    batch_sizes: tuple[int, ...]
    lrs: tuple[float, ...]
    momentums: tuple[float, ...] = (0.0,)
    max_steps: int = 3000
    ranks: int = 1
    noise_ranks: int = 4

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes}")
        if not self.lrs or not all(math.isfinite(lr) and lr > 0 for lr in self.lrs):
            raise ValueError(f"learning rates must be positive numbers, got {self.lrs}")
        if not self.momentums or not all(0 <= m < 1 for m in self.momentums):
            raise ValueError(f"momentums must be in [0, 1), got {self.momentums}")
        if self.max_steps < 1 or self.ranks < 1 or self.noise_ranks < 0:
            raise ValueError("--max-steps and --ranks must be >= 1 and --noise-ranks >= 0")


def run_trial(train: Trainer, base: Any, batch_size: int, lr: float, momentum: float,
              eval_every: int, steps: int, ranks: int) -> Trial:  # fmt: skip
    """Train once, stopping at the target; a run that diverges is an outcome, not an error."""
    started = time.perf_counter()
    try:
        result = train(base, ranks=ranks, batch_size=batch_size, lr=lr, momentum=momentum,
                       steps=steps, eval_every=eval_every)  # fmt: skip
    except NonFiniteError:
        seconds = time.perf_counter() - started
        return Trial(batch_size, lr, momentum, eval_every, None, 0, True, None, 0.0, 0.0, seconds)
    return Trial(
        batch_size,
        lr,
        momentum,
        eval_every,
        result.steps_to_target,
        len(result.losses),
        False,
        result.evals[-1][1] if result.evals else None,
        result.compute_seconds,
        result.update_seconds,
        time.perf_counter() - started,
    )


def coarse_eval_every(batch_size: int, held_out: int) -> int:
    """Steps between evaluations: one per `held_out` training examples."""
    # An evaluation is a forward pass over the held-out samples, so this costs about a third of the
    # training it interrupts.
    return max(1, math.ceil(held_out / batch_size))


def study_batch_size(base: Any, settings: StudySettings, *, train: Trainer | None = None,
                     report: Callable[[Row], None] | None = None) -> list[Row]:  # fmt: skip
    """Tune (lr, momentum) for every batch size; one Row per batch size, in increasing order."""
    # `base` is the workload's TrainConfig, with a holdout and a target; `train` defaults to
    # `syncsgd.training.loop.train`; `report` sees each row as soon as it is done.
    if train is None:
        from syncsgd.training.loop import train as default_train

        train = default_train
    held_out = check_study(base, settings)
    grid = [(lr, m) for m in settings.momentums for lr in settings.lrs]
    rows = []
    with warnings.catch_warnings():  # a diverging run overflows on its way to a non-finite loss
        warnings.simplefilter("ignore", RuntimeWarning)
        for batch_size in sorted(set(settings.batch_sizes)):
            every = coarse_eval_every(batch_size, held_out)
            trials = [
                run_trial(train, base, batch_size, lr, m, every, settings.max_steps, settings.ranks)
                for lr, m in grid
            ]
            row = best_of(batch_size, trials, settings.lrs)
            if row.steps_to_target is not None and every > 1:
                # The target was met up to `every` - 1 steps before the evaluation that saw it:
                # the settings tied there run again, evaluated after every step.
                stop = row.steps_to_target
                for tied in [t for t in trials if t.steps_to_target == stop]:
                    trials.append(
                        run_trial(
                            train, base, batch_size, tied.lr, tied.momentum, 1, stop, settings.ranks
                        )
                    )
                row = best_of(batch_size, trials, settings.lrs)
            measure_noise_scale(train, base, row, settings)
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def check_study(base: Any, settings: StudySettings) -> int:
    """Check the workload has a target and held-out samples; returns the held-out sample count."""
    # ValueError too unless every batch size fits in the training samples.
    from syncsgd.training.loop import prepare

    if base.target_loss is None and base.target_accuracy is None:
        raise ValueError("the study needs a target: --target-loss or --target-accuracy")
    if base.holdout <= 0:
        raise ValueError("the study evaluates on held-out data: give --holdout (e.g. 0.25)")
    problem = prepare(replace(base, batch_size=1, steps=1))  # the data as training splits it
    training, held_out = len(problem.X), 0 if problem.X_eval is None else len(problem.X_eval)
    if max(settings.batch_sizes) > training:
        raise ValueError(
            f"batch size {max(settings.batch_sizes)} is larger than the {training} training "
            f"samples: raise --samples or lower --batch-sizes"
        )
    return held_out


def best_of(batch_size: int, trials: list[Trial], lrs: Sequence[float]) -> Row:
    """The fewest steps to target among `trials` (ties: the smaller lr, then momentum)."""
    met = [t for t in trials if t.steps_to_target is not None]
    if not met:
        return Row(batch_size, None, None, None, trials=trials)
    best = min(met, key=lambda t: (t.steps_to_target, t.lr, t.momentum))
    edge = len(set(lrs)) > 1 and best.lr in (min(lrs), max(lrs))
    return Row(batch_size, best.steps_to_target, best.lr, best.momentum, edge, trials=trials)


def measure_noise_scale(train: Trainer, base: Any, row: Row, settings: StudySettings) -> None:
    """Train the row's best setting again on several ranks, estimating the noise scale."""
    ranks = min(settings.noise_ranks, row.batch_size)
    if row.steps_to_target is None or ranks < 2:
        return
    result = train(base, ranks=ranks, batch_size=row.batch_size, lr=row.best_lr,
                   momentum=row.best_momentum, steps=settings.max_steps, eval_every=1,
                   noise_scale=True)  # fmt: skip
    row.noise_scale = result.noise_scale
    row.noise_steps = result.steps_to_target


# -- the knee -------------------------------------------------------------------------------------


class Knee(NamedTuple):
    """steps(B) = S_min + E_min / B fitted to the rows; B_crit = E_min / S_min (None: no knee)."""

    s_min: float
    e_min: float
    b_crit: float | None


def nonnegative_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, c) >= 0 minimising the relative squared error of y ≈ a + c x (every y > 0)."""
    # Each equation is divided by its y, so that small and large values count alike; the optimum is
    # the unconstrained one if it is non-negative, else the better of the two one-parameter fits.
    design = np.column_stack([np.ones_like(x), x]) / y[:, None]
    target = np.ones_like(x)
    best, best_residual = np.zeros(2), math.inf
    for columns in ([0, 1], [0], [1]):
        coef = np.zeros(2)
        coef[columns] = np.linalg.lstsq(design[:, columns], target, rcond=None)[0]
        residual = float(np.sum((design @ coef - target) ** 2))
        if np.all(coef >= 0) and residual < best_residual:
            best, best_residual = coef, residual
    return float(best[0]), float(best[1])


def fit_knee(batch_sizes: Sequence[int], steps: Sequence[float]) -> Knee | None:
    """Fit steps = S_min + E_min/B (linear against 1/B) with S_min, E_min >= 0."""
    # B_crit = E_min/S_min is where the steps are twice S_min and the examples twice E_min. It is
    # None if S_min = 0 (perfect scaling all the way: no knee in range) or E_min = 0. The whole fit
    # is None for fewer than two batch sizes.
    if len(batch_sizes) < 2:
        return None
    inverse = 1.0 / np.asarray(batch_sizes, dtype=np.float64)
    s_min, e_min = nonnegative_line(inverse, np.asarray(steps, dtype=np.float64))
    return Knee(s_min, e_min, e_min / s_min if s_min > 0 and e_min > 0 else None)


def reached(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """(batch size, steps to target) of the rows that met the target."""
    return [
        (row.batch_size, row.steps_to_target) for row in rows if row.steps_to_target is not None
    ]


def perfect_scaling(rows: Sequence[Row], batch_size: int) -> float | None:
    """Steps at `batch_size` if steps ∝ 1/B held from the smallest B that met the target."""
    met = reached(rows)
    if not met:
        return None
    first_batch, first_steps = met[0]
    return first_steps * first_batch / batch_size


def quoted_noise_scale(rows: Sequence[Row]) -> tuple[int, float] | None:
    """(B, B_simple) of the smallest B with a noise scale: the run with the smallest lr."""
    # B_simple assumes the gradient is measured where a well-tuned optimizer would be; runs with a
    # large lr bounce across the valley, where |G|² is larger, and report smaller values. The
    # smallest batch size's run has the smallest lr and the most steps to average over.
    measured = [(row.batch_size, row.noise_scale) for row in rows if row.noise_scale is not None]
    return measured[0] if measured else None


def noise_scale_range(rows: Sequence[Row]) -> tuple[float, float] | None:
    """The smallest and largest B_simple over the batch sizes."""
    values = [row.noise_scale for row in rows if row.noise_scale is not None]
    return (min(values), max(values)) if values else None


# -- the time model -------------------------------------------------------------------------------


class StepCosts(NamedTuple):
    """Seconds of one step: compute (fixed + per sample of the largest shard) and update."""

    compute_fixed: float
    compute_per_sample: float
    update: float
    source: str


def measure_step_costs(trials: Sequence[Trial], ranks: int) -> StepCosts:
    """Fit compute = fixed + per_sample x ceil(B/ranks) to each batch size's median per step."""
    # The update's seconds per step are the median over the runs (it does not depend on B).
    ran = [t for t in trials if t.steps_run > 0]
    if not ran:
        raise ValueError("no run to measure the step time on")
    shards, seconds = [], []
    for batch_size in sorted({t.batch_size for t in ran}):
        mine = [t.compute_seconds / t.steps_run for t in ran if t.batch_size == batch_size]
        shards.append(math.ceil(batch_size / ranks))
        seconds.append(statistics.median(mine))
    update = statistics.median(t.update_seconds / t.steps_run for t in ran)
    if len(shards) == 1:
        return StepCosts(0.0, seconds[0] / shards[0], update, "measured")
    fixed, per_sample = nonnegative_line(np.array(shards, float), np.array(seconds))
    return StepCosts(fixed, per_sample, update, "measured")


def step_seconds(costs: StepCosts, batch_size: int, ranks: int, gradient_bytes: int,
                 params: costmodel.Params, algorithm: str = "ring") -> float:  # fmt: skip
    """Predicted seconds of one step of global batch `batch_size` on `ranks` ranks."""
    shard = math.ceil(batch_size / ranks)  # the slowest rank holds the largest shard
    allreduce = costmodel.predict(algorithm, ranks, gradient_bytes, params)
    return costs.compute_fixed + costs.compute_per_sample * shard + allreduce + costs.update


@dataclass
class TimeRow:
    """Predicted time to target on `ranks` ranks for every batch size, and the best of them."""

    ranks: int
    seconds: dict[int, float]  # batch size -> predicted seconds to target (only P <= B)
    best_batch_size: int | None
    best_seconds: float | None
    speedup: float | None  # the best time on one rank (the first row) / this row's
    gain: float | None  # the previous row's best time / this row's


def time_model(rows: Sequence[Row], costs: StepCosts, rank_counts: Sequence[int],
               gradient_bytes: int, params: costmodel.Params,
               algorithm: str = "ring") -> list[TimeRow]:  # fmt: skip
    """Predicted time to target for every P and every batch size that met the target (P <= B)."""

    def best_on(ranks: int) -> tuple[dict[int, float], int | None, float | None]:
        seconds = {
            batch: steps * step_seconds(costs, batch, ranks, gradient_bytes, params, algorithm)
            for batch, steps in reached(rows)
            if ranks <= batch
        }
        best = min(seconds, key=lambda b: (seconds[b], b)) if seconds else None
        return seconds, best, None if best is None else seconds[best]

    single = best_on(1)[2]  # the speedup is over one rank, whichever P the table starts at
    table: list[TimeRow] = []
    for ranks in rank_counts:
        seconds, best, best_seconds = best_on(ranks)
        previous = table[-1].best_seconds if table else None
        gain = previous / best_seconds if previous and best_seconds else None
        speedup = single / best_seconds if single and best_seconds else None
        table.append(TimeRow(ranks, seconds, best, best_seconds, speedup, gain))
    return table


def stops_paying(table: Sequence[TimeRow], threshold: float = STOPS_PAYING) -> int | None:
    """The last P after which the table's next P gains less than `threshold` (None: never)."""
    for previous, row in zip(table[:-1], table[1:], strict=True):
        if row.gain is None or row.gain < 1 + threshold:
            return previous.ranks
    return None


# -- output ---------------------------------------------------------------------------------------

ROW_HEADER = (
    f"{'batch':>6} {'steps':>7} {'best lr':>8} {'momentum':>8} {'examples':>9} {'ideal':>8} "
    f"{'steps/ideal':>11} {'noise scale':>11}"
)


def format_row(row: Row, ideal: float | None) -> str:
    """One line of the study's table; `ideal` is the perfect-scaling steps at this B."""
    if row.steps_to_target is None:
        diverged = sum(t.diverged for t in row.trials)
        return (
            f"{row.batch_size:>6} {'-':>7}  target not met by any of the {len(row.trials)} "
            f"settings ({diverged} diverged)"
        )
    ratio = "-" if ideal is None else f"{row.steps_to_target / ideal:.2f}"
    noise_scale = "-" if row.noise_scale is None else f"{row.noise_scale:.4g}"
    lr = f"{row.best_lr:.4g}" + ("*" if row.lr_at_edge else " ")
    return (
        f"{row.batch_size:>6} {row.steps_to_target:>7} {lr:>9}{row.best_momentum:>8g} "
        f"{row.examples_to_target:>9} {'-' if ideal is None else f'{ideal:.1f}':>8} "
        f"{ratio:>11} {noise_scale:>11}"
    )


def describe_findings(rows: Sequence[Row], knee: Knee | None) -> list[str]:
    """Lines on the knee, the noise scale and anything the reader should distrust."""
    if not reached(rows):
        return ["# no batch size met the target: loosen the target or raise --max-steps"]
    if knee is None:
        lines = ["# knee: needs two batch sizes that met the target"]
    elif knee.b_crit is None:
        why = "S_min = 0: perfect scaling throughout" if knee.s_min == 0 else "E_min = 0"
        lines = [f"# knee: none in range (the fit steps = S_min + E_min/B has {why})"]
    else:
        lines = [
            f"# knee: B_crit = {knee.b_crit:.4g} from the fit steps = S_min (1 + B_crit/B), "
            f"S_min = {knee.s_min:.4g} steps, E_min = {knee.e_min:.4g} examples"
        ]
    quoted, spread = quoted_noise_scale(rows), noise_scale_range(rows)
    if quoted is not None and spread is not None:
        lines.append(
            f"# gradient noise scale B_simple = {quoted[1]:.4g} (the run at B = {quoted[0]}, the "
            f"smallest lr; {spread[0]:.4g} .. {spread[1]:.4g} over the batch sizes: a larger lr "
            f"measures less); McCandlish et al. expect B_crit ~ B_noise, which B_simple "
            f"approximates"
        )
    if any(row.lr_at_edge for row in rows):
        lines.append("# *: the best lr is at the edge of the grid; widen --lrs to be sure")
    moved = [
        f"B = {row.batch_size}: {row.noise_steps}"
        for row in rows
        if row.noise_scale is not None and row.noise_steps != row.steps_to_target
    ]
    if moved:
        lines.append(
            "# note: on several ranks the noise-scale runs met the target at other steps ("
            + ", ".join(moved)
            + "): the float sums differ with P, and a held-out loss this close to the target "
            "can tip"
        )
    return lines


def time_model_lines(table: Sequence[TimeRow], costs: StepCosts, gradient_bytes: int,
                     params: costmodel.Params, params_source: str,
                     algorithm: str) -> list[str]:  # fmt: skip
    """The predicted times to target, one line per P, and where adding ranks stops paying."""
    fmt = costmodel.format_seconds
    sizes = sorted({b for row in table for b in row.seconds})
    lines = [
        "# PREDICTED time to target (a model, not a measurement): steps(B) x [compute "
        f"{fmt(costs.compute_fixed)} + {fmt(costs.compute_per_sample)}/sample x ceil(B/P) "
        f"({costs.source}) + {algorithm} allreduce of {costmodel.format_bytes(gradient_bytes)} "
        f"({params_source}) + update {fmt(costs.update)}]",
        costmodel.describe_params(params),
        f"{'P':>6} "
        + " ".join(f"{'B=' + str(b):>9}" for b in sizes)
        + f" {'best B':>7} {'time':>9} {'speedup':>8} {'vs prev':>8}",
    ]
    for row in table:
        cells = " ".join(f"{fmt(row.seconds[b]) if b in row.seconds else '-':>9}" for b in sizes)
        best = "-" if row.best_batch_size is None else str(row.best_batch_size)
        best_time = "-" if row.best_seconds is None else fmt(row.best_seconds)
        speedup = "-" if row.speedup is None else f"{row.speedup:.3g}x"
        gain = "-" if row.gain is None else f"{row.gain:.3g}x"
        lines.append(f"{row.ranks:>6} {cells} {best:>7} {best_time:>9} {speedup:>8} {gain:>8}")
    last = stops_paying(table)
    if last is None:
        lines.append(
            f"# predicted: every step up to P = {table[-1].ranks} gains at least "
            f"{STOPS_PAYING:.0%} (with the best batch size for each P)"
        )
    else:
        lines.append(
            f"# predicted: adding ranks stops paying beyond P = {last}: the next P gains less "
            f"than {STOPS_PAYING:.0%} (with the best batch size for each P)"
        )
    return lines


def draw_png(rows: Sequence[Row], knee: Knee | None, path: str, title: str) -> None:
    """Log-log steps to target against B, perfect scaling, the fitted knee and B_simple."""
    from syncsgd.util import figures

    figures.save(study_figure(rows, knee, title), path)


def study_figure(rows: Sequence[Row], knee: Knee | None, title: str) -> Any:
    """The slide: steps to target against B, each series in its colour, marker and dashes."""
    from syncsgd.util import figures
    from syncsgd.util.figures import OKABE_ITO

    figure = figures.new_figure(layout="constrained")
    axes = figure.subplots()
    met = reached(rows)
    if met:
        sizes = np.array([batch for batch, _ in met], dtype=float)
        axes.plot(sizes, [steps for _, steps in met], linewidth=2.5, markersize=10,
                  label="measured (best lr per B)", **figures.series_style(0))  # fmt: skip
        span = np.geomspace(sizes[0], sizes[-1], 100)
        ideal = met[0][1] * met[0][0] / span
        axes.plot(span, ideal, ":", color="black", linewidth=2,
                  label="perfect scaling (steps ∝ 1/B)")  # fmt: skip
        if knee is not None and knee.b_crit is not None:
            fitted = knee.s_min + knee.e_min / span
            axes.plot(span, fitted, "--", color=OKABE_ITO["bluish green"], linewidth=2.5,
                      label="fit S_min (1 + B_crit/B)")  # fmt: skip
            outside = not sizes[0] <= knee.b_crit <= sizes[-1]
            label = f"knee B_crit = {knee.b_crit:.3g}" + (" (extrapolated)" if outside else "")
            axes.axvline(knee.b_crit, color=OKABE_ITO["bluish green"], linewidth=2, label=label)
    quoted, spread = quoted_noise_scale(rows), noise_scale_range(rows)
    if quoted is not None and spread is not None and spread[0] > 0:
        label = f"noise scale B_simple = {quoted[1]:.3g} (run at B = {quoted[0]})"
        axes.axvline(quoted[1], color=OKABE_ITO["vermillion"], linestyle="-.", linewidth=2,
                     label=label)  # fmt: skip
        label = f"B_simple over all B: {spread[0]:.3g} .. {spread[1]:.3g}"
        axes.axvspan(*spread, color=OKABE_ITO["vermillion"], alpha=0.1, label=label)
    axes.set(xscale="log", yscale="log", xlabel="global batch size B", ylabel="steps to target")
    axes.set_title(title)
    axes.legend(loc="upper right")
    figures.slide_axes(axes)
    return figure


def study_json(rows: Sequence[Row], knee: Knee | None, base: Any, settings: StudySettings,
               extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Everything the study found, JSON-ready."""
    return {
        "study": "batch-size",
        "workload": asdict(base),
        "settings": asdict(settings),
        "rows": [
            {
                "batch_size": row.batch_size,
                "steps_to_target": row.steps_to_target,
                "best_lr": row.best_lr,
                "best_momentum": row.best_momentum,
                "noise_scale": row.noise_scale,
                "examples_to_target": row.examples_to_target,
                "perfect_scaling_steps": perfect_scaling(rows, row.batch_size),
                "lr_at_edge": row.lr_at_edge,
                "noise_run_steps_to_target": row.noise_steps,
            }
            for row in rows
        ],
        "knee": None if knee is None else knee._asdict(),
        "noise_scale": quoted_noise_scale(rows),
        "trials": [asdict(trial) for row in rows for trial in row.trials],
        **extra,
    }


# -- the command line -----------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. 8,16,32 (sorted, duplicates dropped)."""
    return sorted(set(comma_list(text, positive_int, "8,16,32")))


def float_list(text: str) -> list[float]:
    """Comma-separated finite numbers, e.g. 0.05,0.1,0.2 (sorted, duplicates dropped)."""
    return sorted(set(comma_list(text, finite_float, "0.1,0.2", what="numbers")))


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def preset_help(name: str) -> str:
    """The default of option `name` (and the --quick one if it differs), for --help."""
    full, quick = FULL[name], QUICK[name]
    if name == "lrs":
        return f"default {len(full)} from {full[0]:g} to {full[-1]:g} by sqrt(2), --quick " + (
            f"{len(quick)} from {quick[0]:g} to {quick[-1]:g} by 2"
        )
    show = (lambda v: ",".join(f"{x:g}" for x in v)) if isinstance(full, (list, tuple)) else str
    if show(full) == show(quick):
        return f"default {show(full)}"
    return f"default {show(full)}, --quick {show(quick)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd study batch-size`; unset ones come from the preset."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small grid that runs in a few minutes on two cores",
    )
    grid = parser.add_argument_group("the grid")
    add_grid_arguments(grid)
    add_workload_arguments(parser, grid.add_mutually_exclusive_group())
    add_time_model_arguments(parser.add_argument_group("the time model (a prediction)"))
    out = parser.add_argument_group("output")
    JSON.add(out, help="write rows, trials, knee and time model")
    writes(out.add_argument("--png", metavar="PATH", type=figure_path,
                            help="log-log plot of steps against batch size (.png, .svg or "
                            ".pdf)"))  # fmt: skip


def add_grid_arguments(grid: argparse._ArgumentGroup) -> None:
    """The batch sizes, the tuning grid, the budget and the ranks of every run."""
    # lists of the values the study varies: train's --batch-size, --lr, --momentum take one each
    for flag, kind, text in (
        ("--batch-sizes", int_list, "global batch sizes"),
        ("--lrs", float_list, "learning rates to tune over"),
        ("--momentums", float_list, "momentums to tune over"),
        ("--max-steps", positive_int, "step budget of every run"),
    ):
        grid.add_argument(
            flag, type=kind, help=f"{text} ({preset_help(flag[2:].replace('-', '_'))})"
        )
    RANKS.add(
        grid,
        default=1,
        help="thread ranks of every run (default 1: the result does not depend on it)",
    )
    grid.add_argument(
        "--noise-ranks",
        type=nonnegative_int,
        default=4,
        help="thread ranks of each batch size's noise-scale run; 0 skips them (default 4)",
    )


# The train options that the study does not take, and why; every other TrainConfig field is an
# option here too, declared as `syncsgd train` declares it, for every run of the study.
NOT_TAKEN = {
    "batch_size": "--batch-sizes: the study's runs vary it",
    "lr": "--lrs: the study's runs vary it",
    "momentum": "--momentums: the study's runs vary it",
    "steps": "--max-steps: each run's budget",
    "epochs": "--max-steps: each run's budget",
    "eval_every": "the study evaluates once per held-out set's worth of samples, then every step",
    "noise_scale": "the study estimates it in runs of its own (--noise-ranks)",
    "skip_nonfinite": "a run that diverges is an outcome of the study, not skipped over",
    "checkpoint": "the study's runs write no checkpoints",
    "checkpoint_every": "the study's runs write no checkpoints",
    "resume": "the study's runs write no checkpoints",
}
PRESET = ("data", "samples", "features", "hidden", "holdout", "target_loss")  # FULL's, QUICK's


def add_workload_arguments(parser: argparse.ArgumentParser, target: argparse._ActionsContainer,
                           ) -> None:  # fmt: skip
    """The model, the data, the target and the rest of train's options, as `syncsgd train` takes
    them; unset, those of PRESET come from the preset (`resolve`), and `target`, a mutually
    exclusive group, takes --target-loss and --target-accuracy."""
    changes: dict[str, dict[str, Any]] = {
        name: {"default": None, "shown": preset_help(name)[len("default "):]} for name in PRESET
    }
    for name in ("target_loss", "target_accuracy"):
        changes.setdefault(name, {})["group"] = target
    add_train_options(parser, exclude=NOT_TAKEN, changes=changes)


def add_time_model_arguments(model: argparse._ArgumentGroup) -> None:
    """The machine and step costs the time model predicts with."""
    model.add_argument(
        "--model-ranks",
        type=int_list,
        help="numbers of ranks to predict for (default 1,2,4,... up to the largest batch size)",
    )
    model.add_argument(
        "--allreduce",
        choices=costmodel.ALGORITHMS,
        default="ring",
        help="the cost model's allreduce algorithm (default ring)",
    )
    reads(model.add_argument(
        "--fit",
        metavar="BENCH_JSON",
        help="fit alpha, beta, gamma to a `syncsgd bench allreduce --json` sweep",
    ))  # fmt: skip
    for name, default in (("alpha", "2e-6 s"), ("beta", "1/12.5e9 s/B"), ("gamma", "1e-10 s/B")):
        model.add_argument(f"--{name}", type=costmodel.parse_quantity, help=f"(default {default})")
    model.add_argument(
        "--compute-per-sample",
        type=costmodel.parse_quantity,
        metavar="SECONDS",
        help="compute seconds per sample instead of the measured fit (then no fixed part)",
    )
    model.add_argument(
        "--update-seconds",
        type=costmodel.parse_quantity,
        metavar="SECONDS",
        help="update seconds per step instead of the measured time",
    )


def resolve(options: argparse.Namespace) -> argparse.Namespace:
    """The options with every unset value taken from the preset (--quick, or the full study)."""
    chosen = QUICK if options.quick else FULL
    values = vars(options).copy()
    own_target = options.target_loss is not None or options.target_accuracy is not None
    for name, default in chosen.items():
        if name == "hidden" and options.model is not None:
            continue
        if values.get(name) is None and not (name == "target_loss" and own_target):
            values[name] = default
    if values.get("hidden") is None:  # --model without --hidden: train's default, unused
        values.pop("hidden", None)
    return argparse.Namespace(**values)


def workload(options: argparse.Namespace) -> Any:
    """The TrainConfig of the study's runs (batch size, lr, momentum and steps vary per run)."""
    from syncsgd.training.config import config_of

    return config_of(options, exclude=NOT_TAKEN, batch_size=min(options.batch_sizes))


def machine(options: argparse.Namespace) -> tuple[costmodel.Params, str, dict[str, Any] | None]:
    """α, β, γ of the time model (fitted to --fit, given, or the cost model's defaults)."""
    given = {
        name: getattr(options, name)
        for name in costmodel.PARAM_NAMES
        if getattr(options, name) is not None
    }
    if options.fit:
        sweep_ranks, samples = costmodel.load_sweep(options.fit, [options.allreduce])
        fitted = costmodel.fit(samples, sweep_ranks, given)
        document = costmodel.fit_json(fitted, options.fit, sweep_ranks)
        return fitted.params, f"alpha, beta, gamma fitted to {options.fit}", document
    defaults = {
        "alpha": costmodel.DEFAULT_ALPHA,
        "beta": costmodel.DEFAULT_BETA,
        "gamma": costmodel.DEFAULT_GAMMA,
    }
    source = "given alpha, beta, gamma" if given else "the cost model's default alpha, beta, gamma"
    return costmodel.Params(**{**defaults, **given}), source, None


def step_costs(options: argparse.Namespace, trials: Sequence[Trial], ranks: int) -> StepCosts:
    """The measured step costs, with --compute-per-sample and --update-seconds taking over."""
    measured = measure_step_costs(trials, ranks)
    where = f"measured at P = {ranks}, one BLAS thread"
    if options.compute_per_sample is not None:
        measured = StepCosts(0.0, options.compute_per_sample, measured.update, "given")
        where = "compute given, update measured"
    if options.update_seconds is not None:
        measured = measured._replace(update=options.update_seconds)
        where = "given" if options.compute_per_sample is not None else f"{where}; update given"
    return measured._replace(source=where)


def describe_workload(base: Any, problem: Any, settings: StudySettings) -> str:
    """The first line of the output: the model, the data, the target and the grid."""
    from syncsgd.nn.mlp import sizes_of

    lrs = settings.lrs
    momentums = ",".join(f"{m:g}" for m in settings.momentums)
    ranks = f"{settings.ranks} rank{'s' * (settings.ranks > 1)} per run"
    noise_runs = (
        f"noise scale on {settings.noise_ranks} thread ranks"
        if settings.noise_ranks >= 2
        else "no noise-scale runs"
    )
    if is_text(base.data):  # the estimate takes per-sample means; token data's mean is per token
        noise_runs += " (token data: train --noise-scale does not estimate it)"
    network = (
        problem.model.summary()
        if base.model is not None
        else f"MLP {'-'.join(map(str, sizes_of(problem.model)))} {base.activation}"
    )
    return (
        f"# batch-size study: {network} {base.loss} {base.dtype} on {base.data} "
        f"({len(problem.X)} training, "
        f"{len(problem.X_eval)} held-out samples); target {describe_target(base)}; "
        f"{len(lrs)} lrs {min(lrs):.4g}..{max(lrs):.4g}, momentum {momentums}; budget "
        f"{settings.max_steps} steps; {ranks}; {noise_runs}"
    )


def describe_target(base: Any) -> str:
    """'held-out loss <= x' or 'held-out accuracy >= x'."""
    if base.target_loss is not None:
        return f"held-out loss <= {base.target_loss:g}"
    return f"held-out accuracy >= {base.target_accuracy:g}"


def check_outputs(options: argparse.Namespace) -> None:
    """Fail before any run when the study cannot start or cannot write what it was asked to."""
    from syncsgd.comm.world import launched_by_mpi

    if launched_by_mpi():
        raise ValueError("syncsgd study trains on thread ranks: start it without mpiexec")
    for path in (options.json, options.png):
        if path is not None:
            check_writable(path)
    if options.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RuntimeError("--png needs matplotlib: pip install 'syncsgd[plot]'") from None


def study_settings(options: argparse.Namespace) -> StudySettings:
    """The grid and budget of the resolved options (no noise-scale runs on token data)."""
    return StudySettings(
        tuple(options.batch_sizes),
        tuple(options.lrs),
        tuple(options.momentums),
        options.max_steps,
        options.ranks,
        0 if is_text(options.data) else options.noise_ranks,
    )


def run_and_print_rows(base: Any, settings: StudySettings, train: Trainer) -> list[Row]:
    """Run the study, printing each row of the table as soon as it is done."""
    print(ROW_HEADER, flush=True)
    done: list[Row] = []

    def report(row: Row) -> None:
        done.append(row)
        print(format_row(row, perfect_scaling(done, row.batch_size)), flush=True)

    return study_batch_size(base, settings, train=train, report=report)


def print_time_model(
    options: argparse.Namespace,
    rows: list[Row],
    settings: StudySettings,
    gradient_bytes: int,
    machine_model: tuple[costmodel.Params, str, dict[str, Any] | None],
) -> dict[str, Any]:
    """Print the predicted time to target per number of ranks; return it for the JSON."""
    params, params_source, fit_document = machine_model
    trials = [trial for row in rows for trial in row.trials]
    costs = step_costs(options, trials, settings.ranks)
    largest = max(settings.batch_sizes)
    rank_counts = options.model_ranks or [1 << k for k in range(largest.bit_length())]
    table = time_model(rows, costs, rank_counts, gradient_bytes, params, options.allreduce)
    lines = time_model_lines(table, costs, gradient_bytes, params, params_source, options.allreduce)
    print("\n".join(lines), flush=True)
    return {
        "prediction": True,
        "algorithm": options.allreduce,
        "params": params._asdict(),
        "params_source": params_source,
        "fit": fit_document,
        "gradient_bytes": gradient_bytes,
        "costs": costs._asdict(),
        "rows": [asdict(row) for row in table],
        "stops_paying_after": stops_paying(table),
    }


def main(options: argparse.Namespace) -> int:
    """`syncsgd study batch-size`: the table, the knee, the noise scale and the time model."""
    check_outputs(options)
    options = resolve(options)
    base = workload(options)
    settings = study_settings(options)
    machine_model = machine(options)  # a bad --fit fails before the runs

    from syncsgd.nn.kernels import limit_blas_threads
    from syncsgd.training.loop import prepare, train

    # One BLAS thread: every run's compute is one core's, whatever P; a multi-threaded BLAS on a
    # busy machine is many times slower, not faster.
    limit_blas_threads(1)
    check_study(base, settings)  # loads the data: a bad --data fails here, before any run
    problem = prepare(base)
    gradient_bytes = problem.model.n_params * problem.model.dtype.itemsize
    train(base, steps=1)  # loads (or compiles) the kernels before anything is timed
    print(describe_workload(base, problem, settings), flush=True)
    started = time.perf_counter()
    rows = run_and_print_rows(base, settings, train)
    study_seconds = time.perf_counter() - started
    met = reached(rows)
    knee = fit_knee([batch for batch, _ in met], [steps for _, steps in met])
    runs = sum(len(row.trials) for row in rows)
    noise_runs = sum(row.noise_scale is not None for row in rows)
    lines = describe_findings(rows, knee)
    lines.append(f"# {runs} runs + {noise_runs} noise-scale runs in {study_seconds:.1f} s")
    print("\n".join(lines), flush=True)

    extra: dict[str, Any] = {"seconds": study_seconds, "command": sys.argv, "cores": os.cpu_count()}
    if met:
        extra["time_model"] = print_time_model(
            options, rows, settings, gradient_bytes, machine_model
        )
    if options.json:
        document = study_json(rows, knee, base, settings, extra)
        jsonout.write(options.json, document)
    if options.png:
        draw_png(rows, knee, options.png, f"{base.data}: target {describe_target(base)}")
        print(f"wrote {options.png}")
    return 0
