"""`syncsgd verify`: train on P = 1, 2, 3, ... thread ranks and compare every run with serial SGD.

    syncsgd verify --ranks 1,2,3,4,8                       # float mode: within the tolerance
    syncsgd verify --ranks 1,2,3,5,8 --exact               # exact mode: every bit
    syncsgd verify --ranks 2,3 --pitfall mean-of-means     # watch a known pitfall break it
    syncsgd verify --pitfall all                           # every pitfall, one row each

The reference is the serial run: one rank, no pitfall, the same mode. A run matches when its final
parameters (and BatchNorm's running statistics) are bitwise equal to the reference's (exact mode),
or within the documented relative tolerance max|Δθ| / max(1, max|θ|) (float mode). Per-step
digests of the parameters give the first step after which a run differs.
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from syncsgd.comm.threads import run_threads
from syncsgd.training.config import TrainConfig, loss_scaling
from syncsgd.training.loop import TrainResult, prepare, train_rank
from syncsgd.training.result import sha256
from syncsgd.training.run import DEFAULT_STEPS
from syncsgd.training.variants import PITFALLS
from syncsgd.util import jsonout

# Float mode with the passes in the model's dtype (--precision fp32): the relative distance from
# serial SGD that a correct run stays within (the tolerance the README documents).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
# The passes emulated in a narrow format (--precision bf16|fp16) round each rank's sums with the
# format's unit roundoff u, differently for each split of the batch; over T steps those
# differences add up as a random walk: float mode allows u sqrt(T) / 4 (at least the dtype's
# tolerance); docs/verify.md gives what the default model's runs moved.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def float_tolerance(config: TrainConfig, steps: int) -> tuple[float, str]:
    """Float mode's tolerance for a run of `steps` steps, and how it was derived."""
    floor = TOLERANCE[config.dtype]
    unit = UNIT_ROUNDOFF.get(config.precision)
    if unit is None:
        return floor, config.dtype
    derived = unit * math.sqrt(max(steps, 1)) / 4
    how = (f"{config.precision}: u sqrt(T) / 4, u = 2^{math.log2(unit):.0f}, T = {steps} "
           "steps")  # fmt: skip
    return max(floor, derived), how if derived > floor else config.dtype


def planned_steps(config: TrainConfig) -> int:
    """The steps a run of `config` takes (--epochs: counted from the data)."""
    if config.steps is not None:
        return config.steps
    if config.epochs is None:
        return DEFAULT_STEPS
    return prepare(config).steps


def tolerance_of(config: TrainConfig, given: float | None) -> tuple[float, str]:
    """--tolerance if given, else float_tolerance's, and how it was chosen."""
    if given is not None:
        return given, "--tolerance"
    return float_tolerance(config, planned_steps(config))


def mode_text(config: TrainConfig, tolerance: tuple[float, str]) -> str:
    """'exact mode: bitwise' or 'float mode: tolerance 0.00977 (bf16: u sqrt(T) / 4, ...)'."""
    if config.exact:
        return "exact mode: bitwise"
    return f"float mode: tolerance {tolerance[0]:.3g} ({tolerance[1]})"


@dataclass
class Row:
    """How one run on `ranks` ranks compares with the serial run."""

    ranks: int
    max_abs_diff: float
    relative_diff: float
    max_ulps: int  # ULPs of max(|a|, |b|, 1), over the elements whose signs agree
    sign_flips: int
    bitwise_equal: bool
    sha256: str
    first_difference: int | None  # steps taken when the parameters first differed; None: never
    matches: bool
    first_parameter: str | None = None  # the first tensor, in buffer order, that differed then


ULP_FLOOR = 1.0  # ULPs are counted of max(|a|, |b|, 1), as relative divides by max(1, max |θ|)
ULP_MOST = 2.0**63  # the count where an element is not finite in one run only


def ulp_distance(a: np.ndarray, b: np.ndarray) -> int:
    """The most units in the last place of max(|a[i]|, |b[i]|, ULP_FLOOR) that a[i] and b[i]
    differ by, rounded up: an element near zero counts the ULPs of 1, not its own tiny ones."""
    if a.size == 0:
        return 0
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # an inf or a NaN: as far as can be
        larger = np.maximum(np.maximum(np.abs(wide_a), np.abs(wide_b)), ULP_FLOOR)
        units = np.spacing(larger.astype(a.dtype)).astype(np.float64)
        ratio = np.where(wide_a == wide_b, 0.0, np.abs(wide_a - wide_b) / units)
    return int(np.ceil(np.max(np.nan_to_num(ratio, nan=ULP_MOST, posinf=ULP_MOST))))


def same_sign_ulps(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(the ULP distance over the elements whose signs agree, how many elements flipped sign)."""
    flipped = (np.sign(a) * np.sign(b)) < 0  # zero agrees with either sign
    kept = ~flipped
    return ulp_distance(a[kept], b[kept]), int(np.count_nonzero(flipped))


COMPRESSED_AT_ONE_RANK = (
    "P = 1 differs too: the gradient sums are rounded to the narrow format around the allreduce "
    "on one rank as well; how the batch is split then changes what is rounded"
)


# The optimizers whose step divides each element by its own gradient's size (Adam's v).
ADAPTIVE = {"adam": "Adam", "adamw": "AdamW", "lamb": "LAMB"}


LOCAL_BATCHNORM = (
    "P > 1 differs: --batchnorm local normalises each rank's samples with the statistics of its "
    "own shard, not of the global batch (--batchnorm sync allreduces them)"
)


def serial(config: TrainConfig) -> TrainConfig:
    """The reference's options: serial SGD, no pitfall, the gradient sums in the model's dtype."""
    return replace(config, pitfall=None, allreduce_dtype=None)


def run(config: TrainConfig, ranks: int) -> TrainResult:
    """Train `config` on `ranks` thread ranks, recording a digest of the parameters per step."""
    problem = prepare(config)
    return run_threads(ranks, train_rank, problem, record_digests=True)[0]


def trained_state(result: TrainResult) -> np.ndarray:
    """The parameters, then BatchNorm's running statistics if any: what a run must reproduce."""
    if result.running is None:
        return result.params
    return np.concatenate([result.params, result.running])


def compare(reference: TrainResult, result: TrainResult, ranks: int, exact: bool,
            tolerance: float) -> Row:  # fmt: skip
    """The row of the verify table for one run."""
    ours, theirs = trained_state(result), trained_state(reference)
    max_abs = float(np.max(np.abs(ours - theirs), initial=0.0))
    relative = max_abs / max(1.0, float(np.max(np.abs(theirs), initial=0.0)))
    bitwise = ours.tobytes() == theirs.tobytes()
    pairs = zip(result.digests, reference.digests, strict=True)
    first = next((step + 1 for step, (a, b) in enumerate(pairs) if a != b), None)
    matches = bitwise if exact else relative <= tolerance
    ulps, flips = same_sign_ulps(ours, theirs)
    parameter = None if first is None else first_tensor(
        result.digests[first - 1], reference.digests[first - 1], result.model.layout())
    return Row(ranks, max_abs, relative, ulps, flips, bitwise, sha256(ours), first,
               matches, parameter)  # fmt: skip


def first_tensor(ours: bytes, theirs: bytes, layout: list) -> str | None:
    """The name of the first parameter tensor whose digest differs (Digests: one per tensor)."""
    from syncsgd.training.hooks import DIGEST_BYTES

    for index, (name, _, _) in enumerate(layout):
        part = slice(index * DIGEST_BYTES, (index + 1) * DIGEST_BYTES)
        if ours[part] != theirs[part]:
            return name
    return None


def verify(config: TrainConfig, ranks_list: list[int], tolerance: float, report=None,
           reference: TrainResult | None = None) -> list[Row]:  # fmt: skip
    """Compare a run on each P of `ranks_list` with the serial run; call `report` per row."""
    if reference is None:
        reference = run(serial(config), 1)
    rows = []
    for ranks in ranks_list:
        row = compare(reference, run(config, ranks), ranks, config.exact, tolerance)
        rows.append(row)
        if report is not None:
            report(row)
    return rows


HEADER = (f"{'P':>3} {'max |Δθ|':>9} {'relative':>9} {'max ULPs':>8} {'flips':>5} {'bitwise':>7} "
          f"{'first diff':>10} {'SHA-256':<12} match")  # fmt: skip


def format_row(row: Row, scale: float) -> str:
    """One line of at most 80 columns; `relative` is '=' where it equals max |Δθ| (scale <= 1)."""
    first = "-" if row.first_difference is None else f"step {row.first_difference}"
    relative = "=" if scale <= 1 else f"{row.relative_diff:.3g}"
    return (
        f"{row.ranks:>3} {row.max_abs_diff:>9.3g} {relative:>9} {_compact(row.max_ulps):>8} "
        f"{row.sign_flips:>5} {'yes' if row.bitwise_equal else 'no':>7} {first:>10} "
        f"{row.sha256[:12]:<12} {'ok' if row.matches else 'MISMATCH':<8}"
    ).rstrip()


def _compact(count: int) -> str:
    """3072, or 1.96e+10 where an integer would not fit the column."""
    return str(count) if count < 10**7 else f"{count:.2e}"


# Why a pitfall's run on one rank differs from serial SGD, where it does: it is not distributed.
AT_ONE_RANK = {
    "fp32-allreduce": "P = 1 differs too: the gradient is rounded to float32 around the "
    "allreduce on one rank as well; that loss of precision is there at every P, and how the "
    "batch is split then changes the rounding",
    "local-trust-ratio": "P = 1 differs only where the gradient's sums are float32: the "
    "agreed trust ratios travel with them and are rounded to float32",
    "accumulate-means": "P = 1 differs too: one rank's K micro-batches are uneven as well "
    "where K does not divide B, and adding their means weighs the samples of a smaller one "
    "more; it is accumulation's pitfall, not data parallelism's",
    "local-clip": "P = 1 differs only in exact mode: one rank's clipping is the global "
    "clipping, but it scales the sum before the division by B instead of the mean after it, "
    "so the last bits round differently (far inside the float tolerance)",
}
NARROW_ADAPTIVE = (
    "P > 1 differs: {optimizer} divides each element's step by that element's own gradient "
    "size, so where the batch's gradient cancels to within {precision}'s rounding, one split "
    "of the batch steps by lr where another steps by -lr or not at all; the tolerance (u sqrt(T) "
    "/ 4) is SGD's. Exact mode checks this bitwise"
)


SKIPPED_STEPS = (
    "P > 1 differs: fp16's dynamic loss scale skips a step whose gradient sums overflow, and "
    "the serial run's whole-batch sums overflow at scales at which a rank's shard does not: the "
    "runs skip different steps (--loss-scale none, or exact mode, compares them)"
)


def reasons(config: TrainConfig, failed: list[int]) -> list[str]:
    """Why the failed runs differ where the difference is expected, one text per cause."""
    distributed = any(ranks > 1 for ranks in failed)
    texts = []
    if 1 in failed and config.pitfall in AT_ONE_RANK:
        texts.append(AT_ONE_RANK[config.pitfall])
    if 1 in failed and config.allreduce_dtype is not None:
        texts.append(COMPRESSED_AT_ONE_RANK)
    if distributed and config.batchnorm == "local":
        texts.append(LOCAL_BATCHNORM)
    if distributed and not config.exact and config.precision != "fp32":
        if config.optimizer in ADAPTIVE:
            texts.append(NARROW_ADAPTIVE.format(optimizer=ADAPTIVE[config.optimizer],
                                                precision=config.precision))  # fmt: skip
        if loss_scaling(config) == 0.0:
            texts.append(SKIPPED_STEPS)
    return texts


def main(config: TrainConfig, ranks_list: list[int], tolerance: float | None,
         json_path: str | None) -> int:  # fmt: skip
    """Print the verify table; exit status 1 if a run that should match does not."""
    check_shards([config], ranks_list)
    chosen = tolerance_of(config, tolerance)
    tolerance, mode = chosen[0], mode_text(config, chosen)
    pitfall = f", pitfall {config.pitfall}" if config.pitfall else ""
    if config.allreduce_dtype is not None:
        pitfall += f", allreduce in {config.allreduce_dtype} (the serial run's in {config.dtype})"
    print(comment(f"against serial SGD (1 rank, no pitfall); {mode}{pitfall}"))
    print(HEADER, flush=True)
    reference = run(serial(config), 1)
    scale = max(1.0, float(np.max(np.abs(trained_state(reference)), initial=0.0)))
    rows = verify(config, ranks_list, tolerance, reference=reference,
                  report=lambda row: print(format_row(row, scale), flush=True))  # fmt: skip
    if scale <= 1:
        print("# relative = max |Δθ| / max(1, max |θ|), the same here ('='): max |θ| <= 1")
    print(comment("ULPs: units in the last place of max(|θ|, |serial θ|, 1), as relative divides "
                  "by max(1, max |θ|), over the elements whose signs agree; flips: elements that "
                  "changed sign"))  # fmt: skip
    failed = [row.ranks for row in rows if not row.matches]
    for why in reasons(config, failed):
        print(comment(why))
    if json_path:
        from syncsgd.apps.verify_grid import record

        document = {"config": asdict(config), "rows": [asdict(row) for row in rows],
                    "runs": [record(config, row, tolerance) for row in rows],
                    "matches": not failed}  # fmt: skip
        jsonout.write(json_path, document, default=str)
    if failed:
        print(f"MISMATCH: P = {', '.join(map(str, failed))} differ from serial SGD")
        return 1
    print(f"all {len(rows)} runs match serial SGD")
    return 0


def check_shards(configs: list[TrainConfig], ranks_list: list[int]) -> None:
    """Before any run: every configuration's --accumulate fits its shards on every P."""
    from syncsgd.training.run import check_accumulate

    for each in configs:
        for ranks in ranks_list:
            check_accumulate(each, ranks)


def main_grid(config: TrainConfig, options: argparse.Namespace) -> int:
    """Every configuration against its serial run on every P: the table, the outputs; exit
    status 1 if a run that should match does not."""
    from syncsgd.apps import verify_grid as grid

    configs = grid.configurations(config, options)
    check_shards(configs, options.ranks)
    grid.check_outputs(options)
    if options.png or options.svg or options.pdf:
        from syncsgd.apps.verify_report import check_matplotlib

        check_matplotlib()
    ranks_list = options.ranks
    print(comment(f"{len(configs)} configurations x P = {', '.join(map(str, ranks_list))}: "
                  f"{len(configs) * len(ranks_list)} runs, each against the serial run of its "
                  "configuration (1 rank, no pitfall); exact mode: bitwise, float mode: within "
                  "the tolerance"))  # fmt: skip
    print(HEADER, flush=True)
    runs, started = [], time.perf_counter()
    for index, each in enumerate(configs):
        chosen = tolerance_of(each, options.tolerance)
        tolerance = chosen[0]
        print(comment(f"{grid.label(each)}: {mode_text(each, chosen)}"), flush=True)
        rows = grid_rows(each, ranks_list, tolerance)
        for why in reasons(each, [row.ranks for row in rows if not row.matches]):
            print(comment(why), flush=True)
        runs += [grid.record(each, row, tolerance) for row in rows]
        if index == 0 and len(configs) > 1:
            print(comment(time_left(time.perf_counter() - started, len(configs) - 1)), flush=True)
    document = {"runs": runs, "configurations": [grid.label(each) for each in configs],
                "ranks": ranks_list, "command": grid.command_line(options),
                "versions": grid.versions(), "machine": grid.machine(), "config": asdict(config),
                "matches": all(record["matches"] for record in runs)}  # fmt: skip
    write_grid(document, options)
    failed = sum(not record["matches"] for record in runs)
    if failed:
        print(f"MISMATCH: {failed} of {len(runs)} runs differ from serial SGD")
        return 1
    print(f"all {len(runs)} runs match serial SGD")
    return 0


def time_left(first: float, others: int) -> str:
    """The grid's time still to come, from the first configuration's wall-clock time."""
    def seconds(value: float) -> str:
        return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"

    return (f"about {seconds(first * others)} left: {others} more configuration(s), if each takes "
            f"as long as the first did ({seconds(first)} with its serial run)")


def grid_rows(config: TrainConfig, ranks_list: list[int], tolerance: float) -> list[Row]:
    """One configuration on every P against its serial run, each row printed as it comes."""
    reference = run(serial(config), 1)
    scale = max(1.0, float(np.max(np.abs(trained_state(reference)), initial=0.0)))
    rows = []
    for ranks in ranks_list:
        # P = 1 of a configuration without a pitfall is its serial run: not run twice
        same = ranks == 1 and config == serial(config)
        result = reference if same else run(config, ranks)
        rows.append(compare(reference, result, ranks, config.exact, tolerance))
        print(format_row(rows[-1], scale), flush=True)
    return rows


def write_grid(document: dict[str, Any], options: argparse.Namespace) -> None:
    """The grid's outputs that were asked for: --json, --report, --png, --svg, --pdf."""
    from syncsgd.apps import verify_report
    from syncsgd.apps.verify_grid import FIGURES

    if options.json:
        jsonout.write(options.json, document, default=str)
    if options.report:
        verify_report.write_html(document, options.report)
    for kind in FIGURES:
        if getattr(options, kind):
            verify_report.write_figure(document, getattr(options, kind), kind)


def comment(text: str) -> str:
    """`text` as '# ' lines of at most 80 columns."""
    return textwrap.fill(text, 80, initial_indent="# ", subsequent_indent="# ")


ALL = "all"  # --pitfall all: every pitfall, one row each

PITFALL_WIDTH = max(len(name) for name in PITFALLS)  # shard-local-trust-ratio: 23 columns
ALL_HEADER = (f"{'pitfall':<{PITFALL_WIDTH}} {'P':>2} {'loss':>7} {'serial':>7} {'acc':>6} "
              f"{'serial':>6} {'relative':>8} {'1st diff':>8} {'shows':>5}")  # fmt: skip


@dataclass
class PitfallRow:
    """One pitfall at the P it shows at, beside serial SGD run with the same options."""

    pitfall: str
    ranks: int
    options: dict[str, Any]  # what the pitfall needs to show (its shows_with)
    loss: float
    serial_loss: float
    accuracy: float | None
    serial_accuracy: float | None
    row: Row
    why: str

    @property
    def shows(self) -> bool:
        """The pitfall broke the equality with serial SGD, as it should."""
        return not self.row.matches


def pitfall_row(config: TrainConfig, name: str, tolerance: float) -> PitfallRow:
    """Run pitfall `name` at its P with its options, and the serial run it should equal."""
    from syncsgd.training.variants import VARIANTS

    kind = VARIANTS[name]
    base = replace(config, pitfall=None, **kind.shows_with)
    reference = run(base, 1)
    result = run(replace(base, pitfall=name), kind.shows_at)
    row = compare(reference, result, kind.shows_at, config.exact, tolerance)
    assert result.final_loss is not None and reference.final_loss is not None  # rank 0's results
    return PitfallRow(name, kind.shows_at, dict(kind.shows_with), result.final_loss,
                      reference.final_loss, result.accuracy, reference.accuracy, row,
                      kind.why)  # fmt: skip


def format_pitfall(line: PitfallRow) -> str:
    """One row of the pitfall table, at most 80 columns."""
    def accuracy(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    first = "-" if line.row.first_difference is None else f"step {line.row.first_difference}"
    return (
        f"{line.pitfall:<{PITFALL_WIDTH}} {line.ranks:>2} {line.loss:>7.5g} "
        f"{line.serial_loss:>7.5g} {accuracy(line.accuracy):>6} "
        f"{accuracy(line.serial_accuracy):>6} {line.row.relative_diff:>8.3g} {first:>8} "
        f"{'yes' if line.shows else 'NO':>5}"
    )


def main_all(config: TrainConfig, tolerance: float | None, json_path: str | None) -> int:
    """Every pitfall at the P it shows at: exit status 1 if one does not show."""
    from syncsgd.training.variants import VARIANTS

    chosen = tolerance_of(config, tolerance)
    tolerance, mode = chosen[0], mode_text(config, chosen)
    print(comment(f"every pitfall on the P and with the options it shows with, against serial "
                  f"SGD (1 rank, no pitfall, the same options); {mode}; relative = max |Δθ| / "
                  f"max(1, max |θ|)"))  # fmt: skip
    print(ALL_HEADER, flush=True)
    lines = []
    for name in VARIANTS:
        lines.append(pitfall_row(config, name, tolerance))
        print(format_pitfall(lines[-1]), flush=True)
    for line in lines:
        options = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in line.options.items())
        print(comment(f"{line.pitfall}: {line.why}" + (f" ({options})" if options else "")))
    if json_path:
        document = {"config": asdict(config), "pitfalls": [asdict(line) for line in lines]}
        jsonout.write(json_path, document, default=str)
    hidden = [line.pitfall for line in lines if not line.shows]
    if hidden:
        print(f"NOT SHOWN: {', '.join(hidden)} matched serial SGD")
        return 1
    print(f"all {len(lines)} pitfalls differ from serial SGD, as they should")
    return 0


def allow_all(parser: Any) -> None:
    """Let verify's --pitfall take 'all' as well as a pitfall's name."""
    for action in parser._actions:
        if action.dest == "pitfall" and action.choices is not None:
            action.choices = (*action.choices, ALL)


def first_of_grid(options: argparse.Namespace) -> argparse.Namespace:
    """The options with each grid list's first entry as its one option's value: the grid's
    first configuration, checked as a whole (--pitfall local-trust-ratio with --optimizers
    lamb,lars needs no --optimizer)."""
    from syncsgd.apps.verify_grid import AXES, dest

    first = argparse.Namespace(**vars(options))
    for flag, field, _, _ in AXES:
        values = getattr(options, dest(flag), None)
        if values:
            setattr(first, field, values[0] == "exact" if field == "exact" else values[0])
    return first


def run_options(options: Any, config_from_options: Any) -> int:
    """`syncsgd verify` from its parsed options: one pitfall's table, or every pitfall's."""
    from syncsgd.apps import verify_grid

    if verify_grid.wants_grid(options):
        if options.pitfall == ALL:
            raise ValueError("--pitfall all is a table of its own: leave out the grid's lists "
                             "and --report, --png, --svg, --pdf")  # fmt: skip
        first = first_of_grid(options)
        try:
            config = config_from_options(first)
        except ValueError as exc:  # named as configurations() names a refused combination
            from syncsgd.apps.verify_grid import label

            raise ValueError(f"{label(vars(first))}: {exc}") from None
        return main_grid(config, options)
    if options.pitfall == ALL:
        options.pitfall = None
        return main_all(config_from_options(options), options.tolerance, options.json)
    return main(config_from_options(options), options.ranks, options.tolerance, options.json)
