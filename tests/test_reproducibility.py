"""Exact mode bitwise for any P, verify, the pitfalls, checkpoints and resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import TrainConfig, train
from syncsgd.apps.verify import TOLERANCE, tolerance_of, ulp_distance, verify
from syncsgd.training.checkpoint import latest
from syncsgd.training.variants import VARIANTS, MeanOfMeans, PadDuplicate

SMALL = TrainConfig(samples=150, features=5, hidden=(7,), batch_size=30, steps=8, seed=1)


def bits(result) -> bytes:
    return result.params.tobytes()


# -- exact mode --

optimizers = st.sampled_from([
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    {"clip_norm": 0.1, "schedule": "cosine", "warmup_steps": 2},
])  # fmt: skip


@given(
    ranks=st.integers(2, 12),
    batch_size=st.integers(1, 24),
    hidden=st.lists(st.integers(1, 8), max_size=2).map(tuple),
    loss=st.sampled_from(["xent", "mse"]),
    activation=st.sampled_from(["relu", "tanh"]),
    dtype=st.sampled_from(["float64", "float32"]),
    optimizer=optimizers,
)
def test_exact_mode_is_bitwise_the_serial_run_for_any_p(
    ranks, batch_size, hidden, loss, activation, dtype, optimizer
):
    config = TrainConfig(
        samples=60, features=4, hidden=hidden, loss=loss, activation=activation,
        batch_size=batch_size, steps=5, dtype=dtype, exact=True, seed=2, **optimizer,
    )  # fmt: skip
    serial = train(config, ranks=1)
    distributed = train(config, ranks=ranks)  # includes P > B: ranks with empty shards
    assert bits(distributed) == bits(serial)
    assert distributed.losses == serial.losses  # the loss sums are exact too


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exact_mode_stays_close_to_float_mode(dtype):
    """The documented bound: exact and float mode agree to the float tolerance after 100 steps."""
    config = TrainConfig(steps=100, momentum=0.9, samples=2048, dtype=dtype)
    exact = train(config, ranks=3, exact=True)
    floating = train(config, ranks=3)
    scale = max(1.0, float(np.abs(floating.params).max()))
    assert np.abs(exact.params - floating.params).max() / scale <= TOLERANCE[dtype]


# -- verify and the pitfalls --

@pytest.mark.parametrize("pitfall", VARIANTS.values(), ids=list(VARIANTS))
@pytest.mark.parametrize("exact", [False, True])
def test_each_pitfall_makes_verify_fail_and_its_absence_pass(pitfall, exact):
    if exact and pitfall.float_only:  # refused, saying why
        with pytest.raises(ValueError, match="shows in float mode only"):
            TrainConfig(**{**SMALL.__dict__, **pitfall.shows_with, "exact": exact,
                           "pitfall": pitfall.name})  # fmt: skip
        return
    config = TrainConfig(**{**SMALL.__dict__, **pitfall.shows_with, "exact": exact})
    tolerance, _ = tolerance_of(config, None)  # the dtype's; a narrow format's rounding over T
    [clean] = verify(config, [pitfall.shows_at], tolerance)
    assert clean.matches and (clean.bitwise_equal or not exact)
    [broken] = verify(replace(config, pitfall=pitfall.name), [pitfall.shows_at], tolerance)
    assert not broken.matches
    assert broken.first_difference is not None and broken.first_difference >= 1


def test_mean_of_means_is_harmless_when_shards_are_even():
    config = replace(SMALL, pitfall=MeanOfMeans.name)
    [row] = verify(config, [3], TOLERANCE["float64"])  # 30 over 3: shards of 10
    assert row.matches


def test_ulp_distance_counts_representable_floats():
    a = np.array([1.0, -2.0, 0.0, -0.0])
    b = a.copy()
    for _ in range(3):
        b[0] = np.nextafter(b[0], 2.0)
    b[1] = np.nextafter(b[1], 0.0)
    assert ulp_distance(a, b) == 3
    assert ulp_distance(np.array([-0.0]), np.array([0.0])) == 0  # -0 and +0 are the same number
    tiny = np.array([np.nextafter(0.0, 1.0)], np.float64)
    assert ulp_distance(-tiny, tiny) == 1  # near zero, in ULPs of 1: less than one, rounded up
    assert ulp_distance(np.float32([1.0]), np.float32([np.nextafter(np.float32(1), 2)])) == 1


def syncsgd_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "syncsgd.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


SMALL_ARGS = ["--samples", "150", "--features", "5", "--hidden", "7", "--batch-size", "30",
              "--steps", "8", "--seed", "1"]  # fmt: skip


def test_verify_command_prints_the_table_and_sets_the_exit_status(tmp_path):
    report = tmp_path / "verify.json"
    done = syncsgd_cli("verify", "--ranks", "1,2,3,4", "--exact", *SMALL_ARGS,
                       "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "bitwise" in lines[1] and "SHA-256" in lines[1]
    assert len([line for line in lines if line.rstrip().endswith(" ok")]) == 4
    document = json.loads(report.read_text())
    assert [row["ranks"] for row in document["rows"]] == [1, 2, 3, 4]
    assert len({row["sha256"] for row in document["rows"]}) == 1

    pitfall = PadDuplicate
    broken = syncsgd_cli("verify", "--ranks", str(pitfall.shows_at), "--pitfall", pitfall.name,
                         *SMALL_ARGS)  # fmt: skip
    assert broken.returncode == 1
    assert "MISMATCH" in broken.stdout

    bad = syncsgd_cli("verify", "--ranks", "1,x", *SMALL_ARGS)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


# -- checkpoints --


def only_checkpoint(source_dir, step, target_dir) -> str:
    os.makedirs(target_dir)
    name = f"ckpt-{step:08d}.npz"
    shutil.copy(os.path.join(source_dir, name), os.path.join(target_dir, name))
    return str(target_dir)


@pytest.mark.parametrize("exact", [False, True])
def test_resumed_run_is_bitwise_the_uninterrupted_run(tmp_path, exact):
    config = TrainConfig(**{**SMALL.__dict__, "momentum": 0.9, "exact": exact, "steps": 10})
    whole = train(config, ranks=3, checkpoint=str(tmp_path / "a"), checkpoint_every=4)
    assert sorted(os.listdir(tmp_path / "a")) == [f"ckpt-{s:08d}.npz" for s in (4, 8, 10)]
    resume_dir = only_checkpoint(tmp_path / "a", 4, tmp_path / "b")
    # Exact mode: resume on other numbers of ranks too; float mode: on the same P.
    for ranks in [2, 5, 1] if exact else [3]:
        resumed = train(config, ranks=ranks, resume=resume_dir)
        assert bits(resumed) == bits(whole)
        assert resumed.losses == whole.losses[4:]


@given(first=st.integers(1, 6), second=st.integers(1, 6), stop=st.integers(1, 9))
def test_exact_resume_on_any_p_is_bitwise(tmp_path_factory, first, second, stop):
    directory = tmp_path_factory.mktemp("ckpt")
    config = TrainConfig(**{**SMALL.__dict__, "exact": True, "steps": 10, "momentum": 0.5})
    interrupted = TrainConfig(**{**config.__dict__, "steps": stop, "checkpoint": str(directory)})
    train(interrupted, ranks=first)
    resumed = train(config, ranks=second, resume=str(directory))
    assert bits(resumed) == bits(train(config, ranks=1))


def test_corrupt_and_foreign_checkpoints_are_clear_errors(tmp_path):
    train(SMALL, ranks=2, checkpoint=str(tmp_path / "good"))
    path = latest(str(tmp_path / "good"))
    with pytest.raises(ValueError, match="different run"):
        train(SMALL, ranks=2, resume=str(tmp_path / "good"), lr=0.2)
    with pytest.raises(ValueError, match="no checkpoint"):
        os.makedirs(tmp_path / "empty")
        train(SMALL, ranks=2, resume=str(tmp_path / "empty"))

    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    os.makedirs(tmp_path / "bad")
    with open(tmp_path / "bad" / os.path.basename(path), "wb") as handle:
        handle.write(raw)
    with pytest.raises(ValueError, match="corrupt"):
        train(SMALL, ranks=2, resume=str(tmp_path / "bad"))

    done = syncsgd_cli("train", *SMALL_ARGS, "--resume", str(tmp_path / "bad"), "--quiet")
    assert done.returncode == 1 and "corrupt" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


# -- the same under a real mpiexec --
# (mpi_once: P = 3 under each library; P = 2's ring is tests/test_collectives.py's there. P = 4
# under mpiexec: float mode's, tests/test_cli_train.py; exact mode's bits for any P on threads.)


@requires_mpi
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.mpi_once),
                                   pytest.param(2, marks=pytest.mark.mpi_once), 3])  # fmt: skip
def test_exact_mode_under_mpiexec_is_bitwise_the_serial_run(tmp_path, ranks):
    saved = tmp_path / "mpi.npz"
    done = run_mpiexec(ranks, ["-m", "syncsgd.cli", "train", "--exact", *SMALL_ARGS,
                               "--save", str(saved), "--quiet"], timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    serial = train(SMALL, ranks=1, exact=True).arrays()
    with np.load(saved, allow_pickle=False) as got:
        for name, value in serial.items():
            assert got[name].tobytes() == value.tobytes()
