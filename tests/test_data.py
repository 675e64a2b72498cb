"""Data sources, the exact sample order (one permutation per epoch) and array_split sharding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd.training.data import (
    SOURCES,
    epoch_order,
    global_batch,
    load_data,
    n_outputs,
    shard,
    steps_per_epoch,
)

CLASSIFICATION = [s for s in SOURCES if "classification" in s]
REGRESSION = [s for s in SOURCES if "regression" in s]


def one_line_error(call, match):
    """Assert that call() raises a one-line ValueError matching `match`; return its message."""
    with pytest.raises(ValueError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


# --- synthetic sources --------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_synthetic_sources_are_deterministic_per_seed(source):
    loss = "xent" if source in CLASSIFICATION else "mse"
    X, y = load_data(source, samples=50, features=3, loss=loss, seed=7)
    X_again, y_again = load_data(source, samples=50, features=3, loss=loss, seed=7)
    X_other, _ = load_data(source, samples=50, features=3, loss=loss, seed=8)
    np.testing.assert_array_equal(X, X_again)
    np.testing.assert_array_equal(y, y_again)
    assert not np.array_equal(X, X_other)


@pytest.mark.parametrize("source", CLASSIFICATION)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_classification_shapes_and_dtypes(source, dtype):
    X, y = load_data(source, samples=300, features=5, classes=3, seed=1, dtype=dtype)
    assert X.shape == (300, 5) and X.dtype == np.dtype(dtype) and X.flags.c_contiguous
    assert y.shape == (300,) and y.dtype == np.int64
    assert set(np.unique(y)) == {0, 1, 2}
    assert n_outputs(y, "xent") == 3
    X64, _ = load_data(source, samples=300, features=5, classes=3, seed=1)
    np.testing.assert_array_equal(X, X64.astype(dtype))  # float32 is float64 rounded


@pytest.mark.parametrize("source", CLASSIFICATION)
def test_classification_with_mse_gives_one_hot_targets(source):
    _, labels = load_data(source, samples=100, features=4, classes=5, seed=2)
    X, y = load_data(
        source, samples=100, features=4, classes=5, loss="mse", seed=2, dtype="float32"
    )
    assert y.shape == (100, 5) and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.eye(5, dtype=np.float32)[labels])
    assert n_outputs(y, "mse") == 5


@pytest.mark.parametrize("source", REGRESSION)
def test_regression_shapes_and_xent_refused(source):
    X, y = load_data(source, samples=40, features=6, classes=2, loss="mse", seed=3)
    assert X.shape == (40, 6) and y.shape == (40, 2) and y.dtype == np.float64
    X, y = load_data(source, samples=40, features=6, loss="mse", seed=3)
    assert y.shape == (40, 1)
    one_line_error(lambda: load_data(source, loss="xent"), "real-valued targets.*mse")


def test_default_source_is_learnable_blobs():
    X, y = load_data("synthetic-classification")
    assert X.shape == (2048, 32) and n_outputs(y, "xent") == 4
    # a linear least-squares fit to one-hot targets already classifies most samples
    design = np.hstack([X, np.ones((len(X), 1))])
    weights, *_ = np.linalg.lstsq(design, np.eye(4)[y], rcond=None)
    accuracy = np.mean(np.argmax(design @ weights, axis=1) == y)
    assert 0.75 < accuracy < 1.0


def test_linear_teacher_is_recoverable():
    X, y = load_data("synthetic-regression", samples=500, features=8, loss="mse", seed=4)
    design = np.hstack([X, np.ones((len(X), 1))])
    weights, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ weights
    assert 0.05 < residual.std() < 0.15  # the noise level 0.1 is all that is left


# --- files --------------------------------------------------------------------------------------


def test_npz_round_trip_labels_and_targets(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3))
    labels = rng.integers(0, 4, size=20)
    np.savez(tmp_path / "labels.npz", X=X, y=labels)
    X_loaded, y_loaded = load_data(str(tmp_path / "labels.npz"))
    np.testing.assert_array_equal(X_loaded, X)
    np.testing.assert_array_equal(y_loaded, labels)
    assert y_loaded.dtype == np.int64
    _, one_hot = load_data(str(tmp_path / "labels.npz"), loss="mse", classes=6, dtype="float32")
    np.testing.assert_array_equal(one_hot, np.eye(6, dtype=np.float32)[labels])
    targets = rng.normal(size=(20, 2))
    np.savez(tmp_path / "targets.npz", X=X.astype(np.float32), y=targets)
    X_loaded, y_loaded = load_data(tmp_path / "targets.npz", loss="mse")
    assert X_loaded.dtype == np.float64
    np.testing.assert_array_equal(y_loaded, targets)
    _, column = load_data(tmp_path / "targets.npz", loss="mse", dtype="float32")
    assert column.shape == (20, 2) and column.dtype == np.float32


def test_npz_float_labels_that_are_integers_are_accepted(tmp_path):
    np.savez(tmp_path / "d.npz", X=np.ones((3, 2)), y=np.array([[0.0], [2.0], [1.0]]))
    _, y = load_data(str(tmp_path / "d.npz"))
    np.testing.assert_array_equal(y, [0, 2, 1])
    _, y = load_data(str(tmp_path / "d.npz"), loss="mse")
    np.testing.assert_array_equal(y, [[0.0], [2.0], [1.0]])  # float targets: regression


@pytest.mark.parametrize("header", [None, "x1, x2 ,label"])
def test_csv_round_trip_with_and_without_header(tmp_path, header):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(15, 2))
    labels = rng.integers(0, 3, size=15)
    lines = [] if header is None else [header]
    lines += [f"{a:.17g},{b:.17g},{c}" for (a, b), c in zip(X, labels, strict=True)]
    path = tmp_path / "data.csv"
    path.write_text("\n".join(lines) + "\n\n")
    X_loaded, y_loaded = load_data(str(path))
    np.testing.assert_array_equal(X_loaded, X)
    np.testing.assert_array_equal(y_loaded, labels)
    _, targets = load_data(str(path), loss="mse")
    np.testing.assert_array_equal(targets, labels[:, None].astype(np.float64))


def test_csv_numeric_first_line_is_data(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("1,2,0\n3,4,1\n")
    X, y = load_data(str(path))
    np.testing.assert_array_equal(X, [[1, 2], [3, 4]])
    np.testing.assert_array_equal(y, [0, 1])


_file_numbers = itertools.count()


def write_csv(tmp_path, text, suffix=".csv"):
    """Write `text` to a new file in tmp_path; return its path."""
    path = tmp_path / f"bad{next(_file_numbers)}{suffix}"
    path.write_text(text)
    return str(path)


def write_npz(tmp_path, **arrays):
    """Save `arrays` to a new .npz file in tmp_path; return its path."""
    path = tmp_path / f"bad{next(_file_numbers)}.npz"
    np.savez(path, **arrays)
    return str(path)


def test_bad_files_raise_one_clear_line(tmp_path):
    ones = np.ones((4, 2))
    cases = [
        (str(tmp_path / "missing.npz"), "missing.npz does not exist"),
        (str(tmp_path / "missing.csv"), "missing.csv does not exist"),
        (write_npz(tmp_path, X=np.array([[1.0, np.nan]]), y=np.array([0])), "NaN"),
        (write_npz(tmp_path, X=np.array([[1.0, np.inf]]), y=np.array([0])), "infinite"),
        (write_npz(tmp_path, X=ones, y=np.array([0, 1, 0])), "4 samples but y has 3"),
        (write_npz(tmp_path, X=np.ones(4), y=np.zeros(4, int)), "X must be 2-D"),
        # (N, H, W) and (N, C, H, W) are images (tests/test_image_data.py); 5-D is not data
        (write_npz(tmp_path, X=np.ones((4, 1, 2, 2, 1)), y=np.zeros(4, int)), "X must be 2-D"),
        (write_npz(tmp_path, X=ones, y=np.zeros((4, 1, 1), int)), "y must be 1-D or 2-D"),
        (write_npz(tmp_path, X=ones, y=np.array([0, 1, 0.5, 1])), "label 0.5 .* not an integer"),
        (write_npz(tmp_path, X=ones, y=np.array([0, -1, 0, 1])), "label -1 .* negative"),
        (write_npz(tmp_path, X=ones, y=np.ones((4, 3))), "one integer label per sample"),
        (write_npz(tmp_path, X=np.ones((0, 2)), y=np.zeros(0, int)), "has no samples"),
        (write_npz(tmp_path, X=np.ones((4, 0)), y=np.zeros(4, int)), "has no features"),
        (write_npz(tmp_path, X=ones), "has no array 'y' .found: X"),
        (write_npz(tmp_path, X=ones.astype(str), y=np.zeros(4, int)), "'X' holds <U32"),
        (write_csv(tmp_path, "garbage", ".npz"), "is not an .npz file .not a zip archive.$"),
        (write_csv(tmp_path, "1,2,0\n3,4\n"), "line 2: 2 columns, but the first data line has 3"),
        (write_csv(tmp_path, "a,b,y\n1,2,0\n3,x,1\n"), "line 3: 'x' is not a number"),
        (write_csv(tmp_path, "1,2,0\n3,,1\n"), "line 2: '' is not a number"),
        (write_csv(tmp_path, "1,nan,0\n"), "NaN"),
        (write_csv(tmp_path, ""), "has no samples"),
        (write_csv(tmp_path, "a,b,label\n"), "has no samples"),
        (write_csv(tmp_path, "1\n2\n"), "at least two columns"),
        (write_csv(tmp_path, "1,2,0.5\n"), "label 0.5 .* not an integer"),
        (str(tmp_path), "is not a regular file"),
    ]
    for path, match in cases:
        if path == str(tmp_path):
            path = str(tmp_path / "dir.npz")
            (tmp_path / "dir.npz").mkdir()
        message = one_line_error(lambda path=path: load_data(path), match)
        assert path in message  # names the file


def test_bad_arguments_raise_one_clear_line(tmp_path):
    path = write_npz(tmp_path, X=np.ones((3, 1)), y=np.array([0, 3, 1]))
    cases = [
        (lambda: load_data("mnist"), "unknown data source 'mnist'.*npz or .csv"),
        (lambda: load_data("data.json"), "unknown data source"),
        (lambda: load_data(path, classes=3), "label 3 of sample 1 is out of range for 3 classes"),
        (lambda: load_data(path, loss="mse", classes=2), "out of range for 2 classes"),
        (lambda: load_data(path, loss="hinge"), "unknown loss 'hinge'"),
        (lambda: load_data(path, dtype="float16"), "dtype must be float64 or float32"),
        (lambda: load_data(path, dtype="nonsense"), "dtype must be float64 or float32"),
        (lambda: load_data("synthetic-classification", samples=0), "samples must be positive"),
        (lambda: load_data("synthetic-classification", features=-1), "features must be positive"),
        (lambda: load_data("synthetic-classification", classes=0), "classes must be positive"),
        (lambda: load_data("synthetic-classification", seed=-1), "seed must not be negative"),
        (lambda: load_data("synthetic-classification", samples=2.5), "must be an integer"),
    ]
    for call, match in cases:
        one_line_error(call, match)
    regression = write_npz(tmp_path, X=np.ones((3, 1)), y=np.ones(3) * 0.5)
    one_line_error(lambda: load_data(regression, loss="mse", classes=2), "1 regression output")


# --- sample order ---------------------------------------------------------------------------


def test_steps_per_epoch_drops_the_tail():
    assert steps_per_epoch(10, 3) == 3
    assert steps_per_epoch(9, 3) == 3
    assert steps_per_epoch(5, 5) == 1
    one_line_error(lambda: steps_per_epoch(10, 0), "batch size must be positive, got 0")
    one_line_error(lambda: steps_per_epoch(10, -2), "batch size must be positive")
    one_line_error(lambda: steps_per_epoch(10, 11), "batch size 11 is larger than .*10 samples")
    one_line_error(lambda: steps_per_epoch(10, 2.0), "batch size must be an integer")


def test_epoch_order_identity_without_shuffle_and_seeded_permutation_with():
    np.testing.assert_array_equal(epoch_order(6, 3, seed=5, shuffle=False), np.arange(6))
    for epoch in range(3):
        order = epoch_order(50, epoch, seed=9, shuffle=True)
        assert order.dtype == np.int64
        np.testing.assert_array_equal(order, np.random.default_rng([9, epoch]).permutation(50))
    assert not np.array_equal(epoch_order(50, 0, 9, True), epoch_order(50, 1, 9, True))
    assert not np.array_equal(epoch_order(50, 0, 9, True), epoch_order(50, 0, 10, True))
    mine = epoch_order(50, 0, 9, True)
    mine[:] = 0  # a caller's copy: the next call is unaffected
    assert len(set(epoch_order(50, 0, 9, True))) == 50


def test_global_batch_by_hand():
    # no shuffle, N = 7, B = 3: steps per epoch 2, sample 6 never used
    batches = [global_batch(t, 7, 3, seed=0, shuffle=False).tolist() for t in range(5)]
    assert batches == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]
    perm1 = np.random.default_rng([4, 1]).permutation(7)
    np.testing.assert_array_equal(global_batch(3, 7, 3, seed=4, shuffle=True), perm1[3:6])
    one_line_error(lambda: global_batch(-1, 7, 3, 0, False), "step must not be negative")


@given(
    n_samples=st.integers(1, 80),
    batch_size=st.integers(1, 80),
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**63),
    shuffle=st.booleans(),
)
def test_batches_of_an_epoch_are_disjoint_slices_of_a_permutation(
    n_samples, batch_size, epoch, seed, shuffle
):
    batch_size = min(batch_size, n_samples)
    per_epoch = n_samples // batch_size
    order = epoch_order(n_samples, epoch, seed, shuffle)
    assert sorted(order.tolist()) == list(range(n_samples))
    batches = [
        global_batch(epoch * per_epoch + j, n_samples, batch_size, seed, shuffle)
        for j in range(per_epoch)
    ]
    assert all(len(batch) == batch_size for batch in batches)
    visited = np.concatenate(batches)
    assert len(set(visited.tolist())) == per_epoch * batch_size  # disjoint
    np.testing.assert_array_equal(
        visited, order[: per_epoch * batch_size]
    )  # in order, tail dropped


# --- sharding -------------------------------------------------------------------------------


@given(batch_size=st.integers(0, 60), size=st.integers(1, 70))
def test_shards_partition_the_batch_in_order_like_array_split(batch_size, size):
    batch = np.random.default_rng(batch_size).permutation(batch_size * 2)[:batch_size]
    shards = [shard(batch, rank, size) for rank in range(size)]
    for mine, expected in zip(shards, np.array_split(batch, size), strict=True):
        np.testing.assert_array_equal(mine, expected)
    np.testing.assert_array_equal(np.concatenate(shards), batch)
    lengths = [len(s) for s in shards]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the first B % P ranks get one more


def test_more_ranks_than_samples_gives_empty_shards():
    batch = np.array([7, 3, 5])
    assert [shard(batch, r, 5).tolist() for r in range(5)] == [[7], [3], [5], [], []]


def test_shard_rejects_bad_ranks():
    batch = np.arange(4)
    one_line_error(lambda: shard(batch, 4, 4), "rank 4 is out of range for 4 ranks")
    one_line_error(lambda: shard(batch, -1, 4), "rank -1 is out of range")
    one_line_error(lambda: shard(batch, 0, 0), "number of ranks must be positive")
