"""--accumulate K: micro-batch sums in one buffer equal serial SGD; the accumulate-means pitfall."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle import serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.cli import main
from syncsgd.nn.local import micro_batch_bounds
from syncsgd.training.run import prepare

SPECS = ["dense(4) relu dense", "dense(5) tanh dense(3) relu dense",
         "conv(2, 3, pad=1) relu flatten dense"]  # fmt: skip
BN_SPEC = "dense(5) batchnorm relu dense"


def digest(params: np.ndarray) -> str:
    """SHA-256 of a flat parameter buffer."""
    return hashlib.sha256(params.tobytes()).hexdigest()


def small(spec: str, **options) -> TrainConfig:
    """A few steps of a tiny --model run (conv: 1x4x4 images)."""
    image = spec.startswith("conv")
    defaults = dict(model=spec, samples=30, features=16 if image else 4, classes=3,
                    batch_size=9, steps=3, lr=0.2, seed=2,
                    input_shape=(1, 4, 4) if image else None)  # fmt: skip
    return TrainConfig(**{**defaults, **options})


def oracle(config: TrainConfig, **options) -> dict:
    """The plain-NumPy serial run of the same start (BatchNorm: of the same micro-batches)."""
    run = prepare(config)
    start = run.model.to_arrays(run.model.init_params(config.seed))
    expected, _ = serial_sgd(run.X, run.y, start, spec=config.model, steps=config.steps,
                             batch_size=config.batch_size, lr=config.lr, seed=config.seed,
                             momentum=config.momentum, in_shape=config.input_shape,
                             optimizer=config.optimizer, **options)  # fmt: skip
    return expected


def largest_shard(batch_size: int, ranks: int) -> int:
    """The samples of the largest of `ranks` shards: the most micro-batches --accumulate may cut."""
    return -(-batch_size // ranks)


def relative(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| / max(1, max |theirs|) over every array."""
    scale = max(1.0, max(float(np.abs(v).max()) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) / scale


@given(shard=st.integers(0, 20), count=st.integers(1, 25))
def test_micro_batches_are_array_splits_sizes(shard, count):
    bounds = micro_batch_bounds(shard, count)
    sizes = [len(part) for part in np.array_split(np.arange(shard), count)]
    assert np.diff(bounds).tolist() == sizes and bounds[0] == 0 and bounds[-1] == shard


@given(spec=st.sampled_from(SPECS), ranks=st.integers(1, 4), accumulate=st.integers(1, 12),
       batch_size=st.integers(1, 11), optimizer=st.sampled_from(["sgd", "adam"]))  # fmt: skip
@settings(max_examples=8)
def test_accumulation_trains_as_the_serial_oracle(spec, ranks, accumulate, batch_size, optimizer):
    accumulate = min(accumulate, largest_shard(batch_size, ranks))  # more are refused
    config = small(spec, batch_size=batch_size, accumulate=accumulate, optimizer=optimizer)
    result = train(config, ranks=ranks)  # a smaller shard than K samples: empty micro-batches
    ours = prepare(config).model.to_arrays(result.params)
    assert relative(ours, oracle(config)) < 1e-9


@given(spec=st.sampled_from(SPECS), ranks=st.integers(1, 4), accumulate=st.integers(2, 12),
       batch_size=st.integers(1, 11), precision=st.sampled_from(["fp32", "bf16", "fp16"]))
@settings(max_examples=8)
def test_exact_mode_is_bitwise_for_every_ranks_and_micro_batches(
        spec, ranks, accumulate, batch_size, precision):  # fmt: skip
    config = small(spec, batch_size=batch_size, exact=True, precision=precision)
    serial = train(config, ranks=1)
    accumulate = min(accumulate, largest_shard(batch_size, ranks))
    accumulated = train(config, ranks=ranks, accumulate=accumulate)
    assert digest(accumulated.params) == digest(serial.params)


@given(ranks=st.integers(1, 3), accumulate=st.integers(2, 3), extra=st.integers(0, 5),
       exact=st.booleans())  # fmt: skip
@settings(max_examples=5)
def test_sync_batchnorm_normalises_each_micro_batch_over_the_ranks(ranks, accumulate, extra,
                                                                   exact):  # fmt: skip
    # At least two samples in every micro-batch: one sample's variance is 0, and exact mode's
    # mean of it is not the sample to the last bit, which the normalisation then magnifies.
    config = small(BN_SPEC, batch_size=2 * ranks * accumulate + extra, accumulate=accumulate,
                   exact=exact, batchnorm="sync")  # fmt: skip
    result = train(config, ranks=ranks)
    model = prepare(config).model
    ours = {**model.to_arrays(result.params), **model.running_views(result.running)}
    assert relative(ours, oracle(config, ranks=ranks, accumulate=accumulate)) < 1e-9


def test_overlap_and_loss_scaling_accumulate_as_without():
    config = small(SPECS[1], batch_size=11, accumulate=3, bucket_bytes=0, precision="fp16")
    plain = train(config, ranks=3)
    assert digest(train(config, ranks=3, overlap=True).params) == digest(plain.params)
    exact = small(BN_SPEC, batch_size=11, accumulate=4, exact=True, batchnorm="sync",
                  bucket_bytes=0)  # fmt: skip
    assert digest(train(exact, ranks=2, overlap=True).params) == digest(
        train(exact, ranks=2).params)


def test_one_micro_batch_is_one_pass_over_each_shard():
    from syncsgd.nn.local import local_gradient
    from syncsgd.training import data
    from syncsgd.training.run import first_params

    config = small(SPECS[0], batch_size=7, steps=1, accumulate=1)
    run = prepare(config)
    params = first_params(run)
    batch = data.SampleOrder(len(run.X), 7, config.seed, config.shuffle).batch(0)
    total = np.zeros(run.model.n_params)
    for rank in range(2):  # two ranks: the ring's one addition per element is this one
        shard = data.contiguous_shard(batch, rank, 2)
        local = np.empty(run.model.n_params)
        local_gradient(run.model, len(shard))(params, run.X[shard], run.y[shard], local)
        total += local
    by_hand = params - config.lr * (total / config.batch_size)
    assert digest(train(config, ranks=2).params) == digest(by_hand)


@given(ranks=st.integers(1, 3), accumulate=st.integers(2, 5), batch_size=st.integers(2, 10))
@settings(max_examples=10)
def test_accumulate_means_differs_exactly_when_micro_batches_are_uneven(ranks, accumulate,
                                                                         batch_size):  # fmt: skip
    accumulate = min(accumulate, largest_shard(batch_size, ranks))
    assume(accumulate > 1)  # the pitfall is refused on one micro-batch: it changes nothing
    config = small(SPECS[0], batch_size=batch_size, accumulate=accumulate, exact=True,
                   samples=30, shuffle=False)  # fmt: skip
    shards = [len(shard) for shard in np.array_split(np.arange(batch_size), ranks)]
    uneven = any(shard % accumulate for shard in shards)
    serial = train(config, ranks=1, accumulate=1)
    means = train(config, ranks=ranks, pitfall="accumulate-means")
    assert (digest(means.params) != digest(serial.params)) == uneven


@requires_mpi
@pytest.mark.mpi_once  # micro-batches are each rank's own: the library sees the one allreduce
def test_accumulation_under_mpiexec_is_bitwise_the_serial_run(tmp_path):
    config = small(SPECS[0], batch_size=10, exact=True)
    serial = train(config, ranks=1).arrays()
    ours = tmp_path / "ours.npz"
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "train", "--model", config.model, "--samples",
                           "30", "--features", "4", "--classes", "3", "--batch-size", "10",
                           "--steps", "3", "--lr", "0.2", "--seed", "2", "--exact",
                           "--accumulate", "4", "--save", str(ours)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    with np.load(ours) as saved:
        assert sorted(saved.files) == sorted(serial)
        assert all(saved[name].tobytes() == serial[name].tobytes() for name in serial)


def test_the_summary_says_what_micro_batches_do_to_batchnorm(capsys):
    assert main(["train", "--model", BN_SPEC, "--samples", "30", "--features", "4",
                 "--batch-size", "12", "--steps", "1", "--accumulate", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "statistics over each micro-batch (sync: every rank's k-th micro-batch" in out


def test_a_bad_accumulate_is_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["train", "--accumulate", "0"])
    err = capsys.readouterr().err
    assert refused.value.code != 0 and "Traceback" not in err
    assert "--accumulate" in err and len(err.strip().splitlines()) == 1
