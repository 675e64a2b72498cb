"""`syncsgd model --memory`: the bytes one rank holds, per category, predicted from the shapes.

Any `syncsgd train` command line with `model --memory` in place of `train` predicts that run's
memory per rank: the network comes from the same options, its input and output sizes from the
data options. Each layer reports what it keeps for its backward pass and what scratch it needs
(`Layer.kept_bytes`, `Layer.scratch_bytes`); the rest follows the step's arrays (the gradient's
buffer, the optimizer's state and scratch, the collectives' scratch). The categories are those of
`train --json`'s memory_bytes (training/memory.py), which measures them; docs/memory.md compares.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from syncsgd.util import jsonout
from syncsgd.util.argtypes import rank_list
from syncsgd.util.figures import figure_path, require_matplotlib
from syncsgd.util.files import check_writable
from syncsgd.util.options import JSON, RANKS, writes

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "workspaces",
              "communication_buffers")  # fmt: skip
STAGES = (0, 1, 2, 3)
MIN_RIDER_SLOTS = 6  # training/step.py's: the buffer keeps at least this many rider slots
RIDERS = 3  # the loss sum, the non-finite flag and the stop flag ride with every step
SQUARE_LIMBS = 70  # nn/exact.py's: a sharded step's int64 limbs of exact squares
STATE_ARRAYS = {"sgd": 1, "adam": 2, "adamw": 2, "lamb": 2, "lars": 1}  # per element
SCRATCH_ARRAYS = {"sgd": 0, "adam": 1, "adamw": 1, "lamb": 1, "lars": 0}  # beside FlatOptimizer's
FIGURE_RANKS = (1, 2, 4, 8, 16, 32, 64)  # the figure's P
MEASURED_RANKS = (1, 2, 4)  # --measured alone: thread ranks, cheap for a small network
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
         "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def memory_limit(text: str) -> int:
    """'24GiB' -> 25769803776; a positive number of bytes with an optional unit."""
    match = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"--memory-limit {text!r}: give bytes, e.g. 24GiB, "
                                         "32GB or 1e9")  # fmt: skip
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"--memory-limit must be positive, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class Shapes:
    """What the prediction needs of a run: the network, the data's rows, the ranks."""

    network: Any
    x_row_bytes: int  # one sample of the data as the run holds it (X's row)
    y_row_bytes: int  # its target
    ranks: int


def shapes_of(config: Any, ranks: int) -> Shapes:
    """The network and data sizes of the run `config` describes, read as `train` reads them
    (its data loaded; no memory check: the prediction may be for a larger machine)."""
    from syncsgd.nn.losses import loss_entry
    from syncsgd.nn.mlp import mlp
    from syncsgd.nn.network import build
    from syncsgd.training import data

    X, y, sample_shape = data.load_dataset(
        config.data, labels=config.labels, samples=config.samples, features=config.features,
        classes=config.classes, loss=config.loss, seed=config.seed, dtype=config.dtype,
        context=config.context,
    )  # fmt: skip
    outputs = data.n_outputs(y, config.loss, X)
    if loss_entry(config.loss).labels and config.classes is not None:
        outputs = max(outputs, config.classes)
    if config.model is not None:
        in_shape = tuple(config.input_shape or sample_shape or X.shape[1:])
        network = build(config.model, in_shape, outputs, config.loss, config.dtype)
    else:
        sizes = (X.shape[1], *config.hidden, outputs)
        network = mlp(sizes, config.activation, config.batchnorm, config.loss,
                      np.dtype(config.dtype))  # fmt: skip
    return Shapes(network, X[:1].nbytes, y[:1].nbytes, ranks)


def predict(config: Any, shapes: Shapes, stage: int | None = None,
            batch_size: int | None = None) -> dict[str, int]:  # fmt: skip
    """Bytes per category on the rank that holds the most, at `stage` (default the config's)
    and global batch `batch_size` (default the config's)."""
    stage = config.zero_stage if stage is None else stage
    config = replace(config, batch_size=batch_size or config.batch_size)
    network, ranks = shapes.network, shapes.ranks
    sums = 8 if config.exact else network.dtype.itemsize
    buffer = network.n_params + MIN_RIDER_SLOTS
    cuts = bucket_cuts(network, config.bucket_bytes, sums)
    blocks = owned_blocks(network, cuts, ranks) if stage else []
    widths = [sum(part.stop - part.start for part in owned) for owned in blocks]
    width = max(widths, default=network.n_params)
    state = network.n_params + network.n_running  # BatchNorm's running statistics too
    predicted = {"parameters": state * network.dtype.itemsize,
                 "gradients": buffer * sums + separate_mean(config, network),
                 "optimizer_state": optimizer_state(config, width, network.dtype.itemsize),
                 "activations": activations(config, shapes),
                 "workspaces": workspaces(config, shapes, width),
                 "communication_buffers": communication(config, network, buffer, ranks, stage)}
    if stage:
        for category, change in sharded(config, network, stage, blocks).items():
            predicted[category] += change
    return predicted


def sharded(config: Any, network: Any, stage: int, blocks: list[list[slice]]) -> dict[str, int]:
    """What a sharded stage keeps in place of the replicated step's whole arrays, or beside them
    (training/sharded.py, windows.py): its blocks of the parameters (stage 3; or LAMB's and
    LARS's contiguous copy of several blocks) and of the gradient sums (stages 2 and 3, placed
    in the buffers of the buckets under way: k buffers of the longest bucket but the last, and
    the last bucket's own), and stage 3's buffers of the parameters' buckets under way."""
    from syncsgd.training.windows import params_buffers, sums_buffers

    sums, item = 8 if config.exact else network.dtype.itemsize, network.dtype.itemsize
    cuts = bucket_cuts(network, config.bucket_bytes, sums)
    width = max((sum(p.stop - p.start for p in owned) for owned in blocks), default=0)
    copies = config.optimizer in ("lamb", "lars") and any(len(owned) > 1 for owned in blocks)
    whole = network.n_params * item
    change = {"parameters": width * item if stage == 3 or copies else 0,
              "gradients": width * item if copies and not placed(config, stage, cuts) else 0}
    if placed(config, stage, cuts):  # the whole gradient's buffer gives way to the buckets' buffers
        lengths = [cut.stop - cut.start for cut in cuts]
        shared = (sums_buffers(network, cuts) + int(config.overlap)) * max(lengths[:-1])
        change["gradients"] += (width + shared + lengths[-1] - cuts[-1].stop) * sums + (
            EMPTY - separate_mean(config, network))  # the empty buffer of the whole gradient
    if stage == 3:
        passes = pass_itemsize(config, network)
        longest = max(cut.stop - cut.start for cut in cuts)
        # (under mpiexec, --overlap gathers the next layer's ahead: up to twice the buffers)
        count = params_buffers(network, cuts, prefetch=False)
        change["parameters"] += count * longest * passes - whole
        change["communication_buffers"] = longest * item if passes != item else 0
        if config.precision != "fp32":  # the passes read the gathered buffers, rounded there
            change["workspaces"] = -network.n_params * 4
    return change


EMPTY = 1  # NumPy's allocation of an empty array: one byte


def placed(config: Any, stage: int, cuts: list[slice]) -> bool:
    """Whether the run's gradient sums go into the buckets' buffers at `stage`
    (training/sharded.py's places_sums, for the hooks a config asks for)."""
    from syncsgd.training.config import loss_scaling
    from syncsgd.training.sharded import places_sums

    # the loss scaler's rider, the noise scale's and a pitfall read the whole local gradient
    reads = loss_scaling(config) is not None or config.noise_scale or config.pitfall is not None
    return places_sums(replace(config, zero_stage=stage), len(cuts), reads)


def bucket_cuts(network: Any, bucket_bytes: int | None, sums: int) -> list[slice]:
    """The buckets of the communication buffer (the gradient and the riders' slots), cut as the
    step cuts them from a buffer of its length and dtype."""
    from syncsgd.training.step import CommBuffer, bucket_slices

    buffer = CommBuffer(network.n_params, np.dtype(f"f{sums}"))
    return bucket_slices(network, buffer.stand_in(), bucket_bytes)


def owned_blocks(network: Any, cuts: list[slice], ranks: int) -> list[list[slice]]:
    """Every rank's owned parameters at a sharded stage: its blocks of the buckets."""
    from syncsgd.training.sharded import owned_slices

    return [owned_slices(cuts, network.n_params, rank, ranks) for rank in range(ranks)]


def separate_mean(config: Any, network: Any) -> int:
    """The mean gradient apart from the sums: exact mode's float64 sums, a float32 model."""
    return network.n_params * 4 if config.exact and network.dtype.itemsize == 4 else 0


def optimizer_state(config: Any, width: int, itemsize: int) -> int:
    """Momentum, or Adam's two moments, of the elements the rank updates."""
    arrays = STATE_ARRAYS[config.optimizer]
    if config.optimizer in ("sgd", "lars") and not (config.momentum or 0) > 0:
        arrays = 0
    return arrays * width * itemsize


def pass_itemsize(config: Any, network: Any) -> int:
    """Bytes of one value of the passes: float32 in a narrow precision, else the model's."""
    return 4 if config.precision != "fp32" else network.dtype.itemsize


def micro_batch(config: Any, ranks: int) -> tuple[int, int]:
    """(the largest shard, the largest micro-batch of it)."""
    shard = -(-config.batch_size // ranks)
    return shard, -(-shard // config.accumulate)


def activations(config: Any, shapes: Shapes) -> int:
    """The shard's samples, the passes' inputs and losses, every layer's output (but those
    written over their input) and what each keeps for the backward pass."""
    network = shapes.network
    shard, m = micro_batch(config, shapes.ranks)
    item = pass_itemsize(config, network)
    size = shard * (shapes.x_row_bytes + shapes.y_row_bytes) + 8
    positions = math.prod(network.layers[-1].out_shape[:-1])
    size += m * math.prod(network.in_shape) * item + m * positions * 8
    size += output_bytes(network, m, item)
    free = free_order(config)
    size += sum(layer.free_kept_bytes(m, item) if free and hasattr(layer, "free_kept_bytes")
                else layer.kept_bytes(m, item) for layer in network.layers)  # fmt: skip
    return size + batchnorm_bytes(network, m, item)


def free_order(config: Any) -> bool:
    """Whether the passes' layers may run kernels of their own (float mode, fp32: nn/numerics.py's
    free_order), which keep and use other arrays."""
    return not config.exact and config.precision == "fp32"


def output_bytes(network: Any, m: int, itemsize: int) -> int:
    """Every layer's output buffer for m samples (an element-wise layer after one that does
    not read its own output shares its input's); also the bytes of the gradients at them."""
    layers, total = network.layers, 0
    for position, layer in enumerate(layers):
        if position > 0 and layer.in_place and not layers[position - 1].reads_output:
            continue
        total += m * math.prod(layer.out_shape) * itemsize
    return total


def batchnorm_bytes(network: Any, m: int, itemsize: int) -> int:
    """BatchNorm's normalised values and its float64 statistics per channel."""
    total = 0
    for layer in network.layers:
        if layer.kind == "batchnorm":
            channels = layer.in_shape[0]
            total += m * math.prod(layer.in_shape) * itemsize + (5 * channels + 1) * 8
    return total


def workspaces(config: Any, shapes: Shapes, width: int) -> int:
    """The gradients at the layers' outputs, the layers' scratch, the numerics' and the
    optimizer's scratch."""
    network = shapes.network
    _, m = micro_batch(config, shapes.ranks)
    item = pass_itemsize(config, network)
    size = output_bytes(network, m, item)
    free = free_order(config)
    size += sum(layer.free_scratch_bytes(m, item) if free and hasattr(layer, "free_scratch_bytes")
                else layer.scratch_bytes(m, item) for layer in network.layers)  # fmt: skip
    size += network.largest_weight() * item  # one weight's gradient before it is added
    if config.precision != "fp32":
        size += network.n_params * 4  # the weights rounded to the format, in float32
    itemsize = network.dtype.itemsize
    size += width * (itemsize + 8)  # FlatOptimizer's scratch and float64 squares
    size += SCRATCH_ARRAYS[config.optimizer] * width * itemsize
    return size


def communication(config: Any, network: Any, buffer: int, ranks: int, stage: int) -> int:
    """The collectives' scratch (per dtype, the largest block a rank adds into), and a sharded
    step's agreement and limbs."""
    from syncsgd.collectives.schedules import chunk_bounds

    sums = 8 if config.exact else network.dtype.itemsize
    size = 0
    if stage:
        size += (MIN_RIDER_SLOTS + 2) * sums + SQUARE_LIMBS * 8
    if ranks == 1:
        return size
    cuts = bucket_cuts(network, config.bucket_bytes, sums)

    def block(length: int) -> int:
        bounds = chunk_bounds(length, ranks)
        return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))

    return size + max(block(cut.stop - cut.start) for cut in cuts) * sums


SEARCH_END = 2**40  # the largest batch the search tries


def largest_batch(config: Any, shapes: Shapes, stage: int, limit: int) -> int:
    """The largest global batch whose prediction at `stage` fits in `limit` bytes (0: none)."""
    def fits(batch: int) -> bool:
        return sum(predict(config, shapes, stage, batch).values()) <= limit

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < SEARCH_END:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def format_bytes(count: float) -> str:
    """'1.23 GiB' (binary units) beside the exact count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.4g} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return ""


def table(config: Any, shapes: Shapes, predicted: dict[str, int]) -> list[str]:
    """The lines `model --memory` prints."""
    network = shapes.network
    shard, m = micro_batch(config, shapes.ranks)
    lines = [f"memory per rank, predicted: {network.summary()} ({network.n_params:,} parameters, "
             f"{network.dtype}), {config.optimizer}, --precision {config.precision}, ZeRO stage "
             f"{config.zero_stage}, P = {shapes.ranks}, batch {config.batch_size} ({shard} per "
             f"rank, micro-batch {m})"]  # fmt: skip
    for name in CATEGORIES:
        lines.append(f"  {name:<22}{predicted[name]:>18,}  {format_bytes(predicted[name])}")
    total = sum(predicted.values())
    lines.append(f"  {'total':<22}{total:>18,}  {format_bytes(total)}")
    return lines


def limit_lines(config: Any, shapes: Shapes, limit: int) -> tuple[list[str], list[dict]]:
    """The largest batch that fits in `limit` at every stage, printed and as JSON rows."""
    lines = [f"largest global batch in {format_bytes(limit)} per rank on P = {shapes.ranks}:"]
    rows = []
    for stage in STAGES:
        batch = largest_batch(config, shapes, stage, limit)
        per_rank = micro_batch(replace(config, batch_size=max(batch, 1)), shapes.ranks)[1]
        shown = (f"{batch:,} (micro-batch {per_rank} per rank)" if batch
                 else "none: batch 1 does not fit")  # fmt: skip
        if batch >= SEARCH_END - 1:  # the limit is beyond any batch the search tries
            shown = f"every batch up to {SEARCH_END:,} (the search ends there)"
        lines.append(f"  stage {stage}: {shown}")
        rows.append({"zero_stage": stage, "batch_size": batch, "micro_batch": per_rank if batch
                     else 0})  # fmt: skip
    return lines, rows


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line and exits with status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with '-' and a digit (--memory-limit -1G) is a value, not an
        # unknown option: its type then says what is wrong with it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# train's outputs but --json: taken, so that a train command line runs as it is, and ignored
IGNORED_OUTPUTS = {"--save": "PATH", "--log": "PATH", "--timeline": "PATH",
                   "--timeline-png": "PATH", "--quiet": None, "--digest": None}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The options of `model --memory`: train's, from their declarations, and its own."""
    from syncsgd.training.config import add_train_options

    memory = OneLineParser(
        prog="syncsgd model --memory",
        description="Predict the bytes per rank of the `syncsgd train` run these options "
        "describe (every train option is taken; its outputs but --json are ignored).")
    RANKS.add(memory)
    add_train_options(memory)
    JSON.add(memory, help="write the prediction as JSON (memory_bytes: train --json's keys)")
    for flag, metavar in IGNORED_OUTPUTS.items():
        if metavar is None:
            memory.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            memory.add_argument(flag, metavar=metavar, help=argparse.SUPPRESS)
    memory.add_argument("--memory-limit", type=memory_limit, metavar="BYTES",
                        help="also the largest global batch (and micro-batch) that fits in "
                        "BYTES per rank on --ranks ranks at each ZeRO stage, e.g. 24GiB")
    writes(memory.add_argument(
        "--png", "--svg", "--pdf", dest="figure", metavar="PATH", type=figure_path,
        help="draw the bytes per rank against P (1 to 64) at stages 0-3, the per-rank batch "
        "held: a slide, .png, .svg or .pdf by the extension"))  # fmt: skip
    memory.add_argument("--measured", nargs="?", type=rank_list, const=list(MEASURED_RANKS),
                        metavar="LIST",
                        help="the figure: also measure each stage at these P on thread ranks "
                        "(a one-step run each, as train --json measures; default "
                        f"{','.join(map(str, MEASURED_RANKS))}) and draw the points")  # fmt: skip
    memory.add_argument("--backend", help=argparse.SUPPRESS)
    return memory


def main(arguments: list[str]) -> int:
    """`syncsgd model --memory ...`: print the table; --json writes it."""
    from syncsgd.training.config import config_of

    options = parser().parse_args(arguments)
    config = config_of(options)
    if config.exact:
        raise ValueError("model --memory predicts float mode; exact mode also keeps every "
                         "product's factors for its sums (docs/exact-mode.md): measure it with "
                         "train --exact --json")  # fmt: skip
    for path in (options.json, options.figure):
        if path:
            check_writable(path)
    if options.measured is not None and not options.figure:
        raise ValueError("--measured draws its points on the figure: give --png, --svg or "
                         "--pdf too")  # fmt: skip
    if options.figure:
        try:
            require_matplotlib("--png/--svg/--pdf")
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    ranks = options.ranks or 2
    shapes = shapes_of(config, ranks)
    predicted = predict(config, shapes)
    lines = table(config, shapes, predicted)
    result: dict[str, Any] = {"memory_bytes": {**predicted, "total": sum(predicted.values())},
                              "ranks": ranks, "zero_stage": config.zero_stage,
                              "batch_size": config.batch_size}  # fmt: skip
    if options.memory_limit is not None:
        more, rows = limit_lines(config, shapes, options.memory_limit)
        if not any(row["batch_size"] for row in rows):
            raise ValueError(f"--memory-limit {format_bytes(options.memory_limit)}: "
                             f"{shapes.network.summary()} on {ranks} rank(s) does not fit even "
                             "at batch 1 at any ZeRO stage")  # fmt: skip
        lines += more
        result["memory_limit"], result["largest_batch"] = options.memory_limit, rows
    print("\n".join(lines))
    if options.figure:
        curves = figure_rows(config, shapes, options.measured or [])
        result["figure"] = curves
        draw(config, shapes, curves, options.figure)
    if options.json:
        jsonout.write(options.json, result)
    if options.figure:
        print(f"wrote {options.figure}")
    return 0


# -- the figure: bytes per rank against P at every stage, the per-rank batch held ---------------


def figure_rows(config: Any, shapes: Shapes, measured_ranks: list[int]) -> list[dict]:
    """Per stage and P: the predicted bytes per rank (the six categories) and, at the measured
    P, what a one-step run on thread ranks holds; the per-rank batch is the config's at its
    ranks, so the global batch grows with P."""
    per_rank = micro_batch(config, shapes.ranks)[0]
    rows = []
    for stage in STAGES:
        staged = replace(config, zero_stage=stage)
        # the kernels load (or compile) outside tracemalloc first: traced, that is slow
        for ranks in sorted({min(measured_ranks), max(measured_ranks)} if measured_ranks else ()):
            one_step(staged, ranks, per_rank * ranks, measure=False)
        for ranks in sorted({*FIGURE_RANKS, *measured_ranks}):
            batch = per_rank * ranks
            predicted = predict(replace(staged, batch_size=batch), replace(shapes, ranks=ranks))
            row: dict[str, Any] = {"zero_stage": stage, "ranks": ranks, "batch_size": batch,
                                   "predicted": sum(predicted.values()), "measured": None}
            if ranks in measured_ranks:
                held = one_step(staged, ranks, batch, measure=True)
                row["measured"] = sum(held[name] for name in CATEGORIES)
            rows.append(row)
    return rows


def one_step(config: Any, ranks: int, batch: int, measure: bool) -> dict[str, int]:
    """memory_bytes of a one-step run at global batch `batch` on `ranks` thread ranks ({}
    unmeasured)."""
    from syncsgd.training.loop import train

    result = train(config, ranks=ranks, steps=1, epochs=None, batch_size=batch,
                   samples=max(config.samples, batch), measure_memory=measure)  # fmt: skip
    return result.memory_bytes or {}


TITLE_CHARACTERS = 80  # a longer network is cut short in the title


def draw(config: Any, shapes: Shapes, rows: list[dict], path: str) -> None:
    """The slide: a predicted line per stage, the measured points over them, a caption."""
    from syncsgd.util.figures import TEXT_POINTS, new_figure, save, series_style, slide_axes

    figure = new_figure()
    axes = figure.add_axes((0.08, 0.2, 0.62, 0.66))
    largest = max(max(row["predicted"], row["measured"] or 0) for row in rows)
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while power + 1 < len(units) and largest >= 1024 ** (power + 1):
        power += 1
    unit, scale = units[power], 1024**power
    for stage in STAGES:
        style = series_style(stage)
        ours = [row for row in rows if row["zero_stage"] == stage]
        axes.plot([row["ranks"] for row in ours], [row["predicted"] / scale for row in ours],
                  color=style["color"], linestyle=style["linestyle"], linewidth=3,
                  label=f"stage {stage}, predicted")  # fmt: skip
        seen = [row for row in ours if row["measured"] is not None]
        if seen:
            axes.plot([row["ranks"] for row in seen], [row["measured"] / scale for row in seen],
                      color=style["color"], marker=style["marker"], markersize=13,
                      linestyle="none", markeredgecolor="black",
                      label=f"stage {stage}, measured")  # fmt: skip
    axes.set_xscale("log", base=2)
    ranks = sorted({row["ranks"] for row in rows})
    axes.set_xticks(ranks, [str(p) for p in ranks])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("ranks P")
    axes.set_ylabel(f"bytes per rank ({unit})")
    network = shapes.network
    per_rank = micro_batch(config, shapes.ranks)[0]
    summary = network.summary()
    summary = summary if len(summary) <= TITLE_CHARACTERS else (
        summary[: TITLE_CHARACTERS - 1] + "…")  # fmt: skip
    axes.set_title(f"Memory per rank: {summary}\n{network.n_params:,} parameters, "
                   f"{network.dtype}, {config.optimizer}, --precision {config.precision}, "
                   f"{per_rank} samples per rank at every P", loc="left",
                   fontsize=TEXT_POINTS)  # fmt: skip
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    slide_axes(axes)
    measured = sorted({row["ranks"] for row in rows if row["measured"] is not None})
    caption = ("Lines: predicted by syncsgd model --memory, the six categories summed. "
               + (f"Points: measured at P = {', '.join(map(str, measured))} on thread ranks "
                  "(train --json's memory_bytes, one-step runs)." if measured
                  else "Nothing measured (--measured draws measured points)."))  # fmt: skip
    figure.text(0.02, 0.03, caption, fontsize=TEXT_POINTS, wrap=True)
    save(figure, path)
