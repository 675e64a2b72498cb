"""A prepared run: the data, the model and the optimizer settings a configuration describes."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from syncsgd.collectives import set_hierarchy
from syncsgd.comm.watchdog import Watched, watching
from syncsgd.comm.world import constants
from syncsgd.nn.arrays import shape_size
from syncsgd.nn.losses import loss_entry
from syncsgd.nn.mlp import mlp
from syncsgd.nn.network import Network, build
from syncsgd.nn.optim import OptimConfig
from syncsgd.training import checkpoint, data
from syncsgd.training.checkpoint import Checkpoint
from syncsgd.training.config import TrainConfig, _require, fingerprint
from syncsgd.training.data import check_npz, is_data_file
from syncsgd.training.variants import variant
from syncsgd.util.files import check_paths
from syncsgd.util.machine import check_memory

DEFAULT_STEPS = 100  # the steps of a run given neither --steps nor --epochs


class AgreedError(ValueError):
    """An error every rank knows of, agreed on by a collective: rank 0 reports it, once."""

    uniform = True  # how the command line tells it from an error of this rank alone


MESSAGE_BYTES = 1024  # the longest error message the ranks pass on


def agree(comm: Any, error: str | None, what: str = "the start-up agreement") -> None:
    """Raise the same AgreedError on every rank if any rank has an `error`, naming the rank.

    A collective every rank reaches: a rank that failed alone (a file on its node only) must
    not leave the others waiting in their next collective. An error every rank has alike is
    told once as it is; otherwise the first failing rank's, with its number.
    """
    comm = Watched(comm, what)  # what a collective timeout names
    rank, size, mpi = comm.Get_rank(), comm.Get_size(), constants(comm)
    mine = None if error is None else _clip(error)
    first = np.array([size if mine is None else rank], np.int64)
    failed = np.array([mine is not None], np.int64)
    comm.Allreduce(mpi.IN_PLACE, first, op=mpi.MIN)
    comm.Allreduce(mpi.IN_PLACE, failed, op=mpi.SUM)
    if failed[0] == 0:
        return
    text = np.zeros(MESSAGE_BYTES, np.uint8)
    if mine is not None and rank == first[0]:
        encoded = mine.encode()
        text[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    comm.Bcast(text, root=int(first[0]))
    message = bytes(text).rstrip(b"\0").decode()
    alike = np.array([mine == message], np.int64)
    comm.Allreduce(mpi.IN_PLACE, alike, op=mpi.MIN)
    if alike[0]:
        raise AgreedError(message)
    others = int(failed[0]) - 1
    more = f" (and {others} other rank{'s' * (others != 1)})" if others else ""
    raise AgreedError(f"rank {first[0]}: {message}{more}")


def _clip(message: str) -> str:
    """`message` cut to at most MESSAGE_BYTES bytes of UTF-8, on a character boundary."""
    return message.encode()[:MESSAGE_BYTES].decode(errors="ignore")


@dataclass
class Run:
    """What every rank needs before the first step: the model, the data and the step count."""

    config: TrainConfig
    model: Network
    X: np.ndarray
    y: np.ndarray
    steps: int
    optim: OptimConfig
    fingerprint: str  # SHA-256 of everything that determines the trajectory (not P, not steps)
    start: Checkpoint | None = None  # the state to resume from
    init: np.ndarray | None = None  # parameters from --init
    init_running: np.ndarray | None = None  # BatchNorm's running statistics from --init
    X_eval: np.ndarray | None = None  # the held-out samples (--holdout)
    y_eval: np.ndarray | None = None
    read: str = ""  # what was read: samples, features or input shape, classes or outputs, loss


def prepare(config: TrainConfig, ranks: int = 1) -> Run:
    """Load the data and build the model and optimizer settings that `config` describes.

    `ranks`: the thread ranks this process will hold, for the estimate of the memory needed.
    """
    X, y, sample_shape = data.load_dataset(
        config.data, labels=config.labels, samples=config.samples, features=config.features,
        classes=config.classes, loss=config.loss, seed=config.seed, dtype=config.dtype,
        context=config.context,
    )  # fmt: skip
    labels = loss_entry(config.loss).labels
    if labels and config.classes is None:
        data.check_class_labels(y, config.data)
    read = describe_data(config, X, y, sample_shape)
    X, y, X_eval, y_eval = split_holdout(X, y, config.holdout, config.seed)
    n_samples = X.shape[0]
    per_epoch = data.steps_per_epoch(n_samples, config.batch_size)
    if config.steps is not None:
        steps = config.steps
    elif config.epochs is not None:
        steps = config.epochs * per_epoch
    else:
        steps = DEFAULT_STEPS
    # class labels: max label + 1, which --classes may raise; token data: the vocabulary's size
    outputs = data.n_outputs(y, config.loss, X)
    if labels and config.classes is not None:
        outputs = max(outputs, config.classes)
    model = make_model(config, X, outputs, ranks, sample_shape, y)
    optim = OptimConfig(
        lr=config.lr, schedule=config.schedule,
        warmup_steps=config.warmup_steps, total_steps=max(steps, 1),  # 0 steps: no lr is used
        lr_scaling=config.lr_scaling,
        base_batch=config.base_batch, batch_size=config.batch_size,
        noam_dim=widest(model),
        clip_norm=variant(config.pitfall, config.clip_norm, config.optimizer).global_clip_norm(),
        exact_norm=config.exact,
    )  # fmt: skip
    run = Run(config, model, X, y, steps, optim,
              fingerprint(config, X, y, steps, sample_shape),
              X_eval=X_eval, y_eval=y_eval, read=f"{read}, {model_outputs(outputs, config)}")
    if config.init is not None:
        arrays = without_batch_counts(load_npz(config.init), model)
        run.init, run.init_running = model.from_arrays(arrays), model.running_from_arrays(arrays)
        refuse_strays(arrays, model, config.init)
    if config.resume is not None:
        run.start = checkpoint.load_latest(config.resume, run.fingerprint, model.n_params,
                                           model.dtype, model.n_running)  # fmt: skip
        _require(
            run.start.step <= steps,
            f"--resume {config.resume} is at step {run.start.step}, beyond --steps {steps}",
        )
    return run


def without_batch_counts(arrays: dict[str, np.ndarray], model: Network) -> dict[str, np.ndarray]:
    """`arrays` without the "<position>.num_batches_tracked" of the model's batchnorm layers: a
    PyTorch state_dict holds them, syncsgd's BatchNorm never reads them (its momentum is fixed)."""
    if model.name_map is not None:
        return arrays
    counts = {f"{layer.position}.num_batches_tracked" for layer in model.layers
              if layer.kind == "batchnorm"}  # fmt: skip
    return {name: array for name, array in arrays.items() if name not in counts}


def refuse_strays(arrays: dict[str, np.ndarray], model: Network, path: str) -> None:
    """A ValueError naming a key of an --init file that is no array of the model."""
    known = {*model.param_names(), *(name for name, _, _ in model.running_layout())}
    strays = sorted(name for name in arrays if name not in known)
    if strays:
        names = sorted(known)
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        raise ValueError(f"--init {path}: {strays[0]!r} belongs to no layer of the model "
                         f"({model.summary()}; its arrays: {shown})")


def describe_data(config: TrainConfig, X: np.ndarray, y: np.ndarray,
                  sample_shape: tuple[int, ...] | None) -> str:  # fmt: skip
    """'data digits: 1797 samples of 64 features' (or 'of shape 1x28x28'), with the held out."""
    of = ("of shape " + "x".join(map(str, sample_shape)) if sample_shape
          else f"of {X.shape[1]} feature{'s' * (X.shape[1] != 1)}")  # fmt: skip
    held = round(len(X) * config.holdout)
    kept = f" ({held} held out)" if held else ""
    return f"data {config.data}: {len(X)} samples{kept} {of}"


def model_outputs(outputs: int, config: TrainConfig) -> str:
    """'10 classes, loss xent' or '1 output, loss mse'."""
    noun = loss_entry(config.loss).noun
    plural = ("es" if noun == "class" else "s") * (outputs != 1)
    return f"{outputs} {noun}{plural}, loss {config.loss}"


def make_model(
    config: TrainConfig,
    X: np.ndarray,
    outputs: int,
    ranks: int,
    sample_shape: tuple[int, ...] | None = None,
    y: np.ndarray | None = None,
) -> Network:
    """The --model network, or the MLP of --hidden; refused if the memory cannot hold it.

    The network's input: --input-shape, else the data's `sample_shape` (images), else X's rows.
    """
    itemsize = np.dtype(config.dtype).itemsize
    if config.model is not None:
        given = None if config.input_shape is None else tuple(config.input_shape)
        _require(given is None or sample_shape is None or given == tuple(sample_shape),
                 f"--input-shape {_shape(given)} disagrees with the data: {config.data}'s samples "
                 f"are {_shape(sample_shape)} (leave --input-shape out)")  # fmt: skip
        in_shape = given or sample_shape or X.shape[1:]
        _require(config.input_shape is None or math.prod(in_shape) == math.prod(X.shape[1:]),
                 f"--input-shape {','.join(map(str, in_shape))} holds {math.prod(in_shape)} "
                 f"values, the data's samples {math.prod(X.shape[1:])}")  # fmt: skip
        network = build(config.model, in_shape, outputs, config.loss, config.dtype)
        check_flattened(network, config, y)
        per_rank = (5 * network.n_params + 3 * config.batch_size * network.activation_size())
        check_memory((ranks * per_rank + network.n_params) * itemsize,
                     f"--model {network.summary()!r} on {ranks} rank(s)")  # fmt: skip
        return network
    sizes = (X.shape[1], *config.hidden, outputs)
    needed = model_bytes(sizes, config.batch_size, itemsize, ranks)
    check_memory(needed, f"a model of layer sizes {','.join(map(str, sizes))} on {ranks} rank(s)")
    return mlp(sizes, config.activation, config.batchnorm, config.loss, np.dtype(config.dtype))


def check_flattened(network: Network, config: TrainConfig, y: np.ndarray | None) -> None:
    """A ValueError if the network gives each sample more dimensions than its targets have: a
    dense layer on images acts on their last axis until a flatten makes a sample one row."""
    if y is None:
        return
    labels = loss_entry(config.loss).labels
    wanted = y.ndim if labels else y.ndim - 1  # token data: a label per position
    shape = network.layers[-1].out_shape
    if len(shape) > wanted:
        targets = ("one class label" if labels and y.ndim == 1
                   else f"targets of shape {tuple(y.shape[1:])}")  # fmt: skip
        raise ValueError(f"--model {config.model!r} gives each sample an output of shape "
                         f"{shape}, for {targets} per sample: put a flatten "
                         "before the dense layers that should see the whole sample (e.g. "
                         "\"conv(8,3) relu flatten dense\")")  # fmt: skip


def _shape(shape: tuple[int, ...] | None) -> str:
    """(1, 28, 28) -> '1,28,28', as --input-shape is written."""
    return ",".join(map(str, shape or ()))


def widest(model: Network) -> int:
    """d of the noam schedule: the model width, that of its widest hidden layer (a dense layer's
    features, a conv's channels); the inputs' width without one."""
    hidden = [layer.model_width() for layer in model.layers[:-1]]
    return max(hidden, default=0) or shape_size(model.in_shape)


def model_bytes(sizes: tuple[int, ...], batch_size: int, itemsize: int, ranks: int) -> int:
    """About the memory a model needs: per rank the parameters, the gradient, the
    communication buffer, momentum and the update's workspace, and the batch's activations."""
    params = sum((a + 1) * b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    per_rank = 5 * params * itemsize + 3 * batch_size * sum(sizes) * itemsize
    return ranks * per_rank + params * itemsize  # and rank 0's first draw


def check_outputs(config: TrainConfig, **outputs: str | None) -> None:
    """Before any work: each output (save=..., log=...) can be written, and none is an input."""
    data = config.data if is_data_file(config.data) or config.data.endswith(".txt") else None
    reads = {"--data": data, "--labels": config.labels, "--init": config.init,
             "--resume": config.resume}  # fmt: skip
    writes = {"--" + name.replace("_", "-"): path for name, path in outputs.items()}
    check_paths(reads, writes, checkpoints={"--checkpoint": config.checkpoint})


def split_holdout(X: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    """(X, y, X_eval, y_eval): the last round(N * fraction) samples of a seeded permutation are
    held out (in their original order); with fraction 0, nothing is."""
    held = round(len(X) * fraction)
    if held == 0:
        _require(fraction == 0, f"--holdout {fraction} holds out no sample of {len(X)}")
        return X, y, None, None
    _require(held < len(X), f"--holdout {fraction} leaves no sample to train on")
    order = np.random.default_rng([seed, 2**31]).permutation(len(X))
    train_rows, eval_rows = np.sort(order[: len(X) - held]), np.sort(order[len(X) - held :])
    return X[train_rows], y[train_rows], X[eval_rows], y[eval_rows]


def check_agreement(comm: Any, run: Run) -> None:
    """Stop every rank with one message if the ranks were started with different options or data.

    Beside the fingerprint, the ranks must agree on how they communicate - the algorithm and the
    buckets - which the fingerprint leaves out (a checkpoint may be resumed with others): each
    step's allreduce trusts that every rank passes the same buffers (check=False).
    """
    config, world = run.config, comm
    comm = Watched(world, "the start-up agreement")
    agreed = (f"{run.fingerprint} {config.algorithm} {config.bucket_bytes} "
              f"{config.ranks_per_node} {config.inter_algorithm}")  # fmt: skip
    mine = np.frombuffer(hashlib.sha256(agreed.encode()).digest(), np.uint8).copy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    differs = np.array([0 if np.array_equal(mine, root) else 1], np.int64)
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, differs, op=mpi.MAX)
    if differs[0]:
        raise AgreedError(
            "the ranks were started with different options or data (their configuration "
            "fingerprints differ from rank 0's); start every rank with the same command and files"
        )
    check_micro_batches(config, run.model, comm.Get_size())
    if config.algorithm == "hierarchical":  # the nodes, kept on the communicator for every step
        with watching("the hierarchical allreduce's split into nodes"):
            try:
                set_hierarchy(world, config.ranks_per_node, config.inter_algorithm)
            except ValueError as exc:  # the same layout, so the same error, on every rank
                raise AgreedError(str(exc)) from None


def check_micro_batches(config: TrainConfig, model: Network, ranks: int) -> None:
    """On every rank alike: --accumulate K cuts no shard into more micro-batches than the largest
    shard has samples, and no BatchNorm layer in training normalises one value per channel
    (PyTorch refuses that: its output would be all zeros)."""
    shards = check_accumulate(config, ranks)
    spatial = [shape_size(layer.in_shape[1:]) for layer in model.layers
               if layer.kind == "batchnorm"]  # fmt: skip
    if min(spatial, default=2) > 1:
        return  # no batchnorm, or each sample gives it more than one value per channel
    count, local = config.accumulate, config.batchnorm == "local"
    if local:  # the micro-batches' sizes of every shard size
        groups = {size for shard in shards for size in split_counts(shard, count)}
    else:  # the k-th micro-batches of every rank together
        groups = {sum(ranks_of * (shard // count + (k < shard % count))
                      for shard, ranks_of in shards.items()) for k in range(count)}  # fmt: skip
    if 1 in groups:
        whose = ("each rank's (micro-)batch alone (--batchnorm local)" if local
                 else "every rank's k-th micro-batch together")  # fmt: skip
        cut = f" in --accumulate {count} micro-batches" if count > 1 else ""
        raise AgreedError(f"BatchNorm in training needs more than 1 value per channel (as in "
                          f"PyTorch): it normalises {whose}, and --batch-size "
                          f"{config.batch_size} on {ranks} rank(s){cut} leaves one of 1 "
                          "sample")  # fmt: skip


def check_accumulate(config: TrainConfig, ranks: int) -> dict[int, int]:
    """The shards' sizes on `ranks` ranks (split_counts); AgreedError if --accumulate K is above
    the largest."""
    shards = split_counts(config.batch_size, ranks)
    largest = max(shards)
    if config.accumulate > largest:
        raise AgreedError(f"--accumulate {config.accumulate} cuts each rank's shard into more "
                          f"micro-batches than it has samples: --batch-size {config.batch_size} "
                          f"on {ranks} rank(s) gives shards of at most {largest}; give "
                          f"--accumulate at most {largest}")  # fmt: skip
    return shards


def split_counts(total: int, parts: int) -> dict[int, int]:
    """{size: how many}: the sizes numpy.array_split cuts `total` items into `parts` with (at
    most two, the larger first), counted rather than listed (`parts` may be large)."""
    size, larger = divmod(total, parts)
    counts = {size + 1: larger, size: parts - larger}
    return {each: many for each, many in counts.items() if many}


def first_params(run: Run) -> np.ndarray:
    """Where training starts: the checkpoint resumed, the --init file, or the seeded draw."""
    if run.start is not None:
        return run.start.params
    if run.init is not None:
        return run.init
    return run.model.init_params(run.config.seed)


def load_npz(path: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz file, loaded without pickle; ValueError for a missing or bad file."""
    check_npz(path, "file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read {path} as .npz: {exc}") from None


