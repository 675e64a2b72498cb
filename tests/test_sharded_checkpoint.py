"""Sharded checkpoints (--zero-stage 1-3): every rank writes its shard file and rank 0 a manifest;
--resume reassembles them and continues at any P and any stage as the run that never stopped;
a shard missing, duplicated, corrupt or from another checkpoint is named, and nothing is
overwritten."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given, settings
from hypothesis import strategies as st

from syncsgd import train
from syncsgd.cli import main
from syncsgd.comm.threads import run_threads
from syncsgd.training import checkpoint
from syncsgd.training.loop import sees_the_lock

MLP = dict(samples=40, features=5, hidden=(6, 4), classes=3, seed=4, batch_size=10)  # 79 params
CONV = dict(model="conv(2, 3, pad=1) batchnorm relu maxpool(2) flatten dense", samples=24,
            features=16, input_shape=(1, 4, 4), classes=3, batchnorm="sync", seed=5,
            batch_size=8)  # fmt: skip
UPDATES = {"momentum": dict(momentum=0.9), "adamw": dict(optimizer="adamw", lr=0.01),
           "lamb": dict(optimizer="lamb", lr=0.01)}  # fmt: skip
STEPS = 4
ARGS = ["--samples", "40", "--features", "5", "--hidden", "6,4", "--classes", "3", "--seed",
        "4", "--batch-size", "10", "--optimizer", "adamw", "--lr", "0.01", "--quiet"]  # fmt: skip


def digest(result) -> str:
    """SHA-256 of a run's final parameters (and BatchNorm's running statistics)."""
    running = b"" if result.running is None else np.asarray(result.running).tobytes()
    return hashlib.sha256(np.asarray(result.params).tobytes() + running).hexdigest()


@functools.cache
def uninterrupted(update: str, exact: bool, ranks: int = 1) -> str:
    """The digest of the run that never stopped (exact mode: the same at every P and stage)."""
    return digest(train(ranks=ranks, **MLP, **UPDATES[update], exact=exact, steps=STEPS))


def shards_of(directory, step: int) -> str:
    return checkpoint.shards_path_for(str(directory), step)


def files_in(directory) -> dict[str, bytes]:
    """Every file below `directory` and its bytes."""
    found = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                found[os.path.relpath(os.path.join(folder, name), directory)] = handle.read()
    return found


# -- resumed at any P and stage --


@settings(max_examples=12)
@given(written=st.tuples(st.integers(1, 5), st.integers(1, 3)),
       resumed=st.tuples(st.integers(1, 5), st.integers(0, 3)), stop=st.integers(1, STEPS - 1),
       update=st.sampled_from(sorted(UPDATES)), buckets=st.sampled_from([None, 1]))  # fmt: skip
def test_exact_mode_resumes_a_sharded_checkpoint_at_any_p_and_stage_bitwise(
        tmp_path_factory, written, resumed, stop, update, buckets):  # fmt: skip
    # 1-byte buckets: a bucket per tensor, so a rank owns a block of each (several ranges)
    directory = tmp_path_factory.mktemp("ckpt")
    options = dict(MLP, **UPDATES[update], exact=True, bucket_bytes=buckets)
    train(ranks=written[0], zero_stage=written[1], checkpoint=str(directory), steps=stop,
          **options)  # fmt: skip
    assert os.listdir(directory) == [os.path.basename(shards_of(directory, stop))]
    again = train(ranks=resumed[0], zero_stage=resumed[1], resume=str(directory), steps=STEPS,
                  **options)  # fmt: skip
    assert digest(again) == uninterrupted(update, True)


@pytest.mark.parametrize(("written", "resumed"), [(1, 0), (3, 2), (2, 3)])
def test_float_mode_resumes_a_sharded_checkpoint_at_the_same_p_bitwise(tmp_path, written,
                                                                       resumed):  # fmt: skip
    # float sums depend on P, not on the stage: AdamW without a norm is stage 0's bits
    options = dict(MLP, **UPDATES["adamw"])
    train(ranks=3, zero_stage=written, checkpoint=str(tmp_path), steps=2, **options)
    again = train(ranks=3, zero_stage=resumed, resume=str(tmp_path), steps=STEPS, **options)
    assert digest(again) == uninterrupted("adamw", False, 3)


def test_the_loss_scaler_and_batchnorm_statistics_resume_from_rank_0s_shard(tmp_path):
    options = dict(CONV, optimizer="adamw", lr=0.01, exact=True, precision="fp16")
    whole = train(ranks=1, steps=3, **options)
    train(ranks=3, zero_stage=3, checkpoint=str(tmp_path), steps=2, **options)
    with np.load(os.path.join(shards_of(tmp_path, 2), "rank-00000-of-00003.npz")) as rank_0, \
            np.load(os.path.join(shards_of(tmp_path, 2), "rank-00001-of-00003.npz")) as rank_1:
        assert "running" in rank_0 and "scaler.scale" in rank_0  # fmt: skip
        assert "running" not in rank_1 and "scaler.scale" not in rank_1
    again = train(ranks=2, zero_stage=1, resume=str(tmp_path), steps=3, **options)
    assert digest(again) == digest(whole) and again.loss_scales == whole.loss_scales[2:]


def test_an_unsharded_checkpoint_resumes_sharded_and_a_step_keeps_one_kind(tmp_path):
    options = dict(MLP, **UPDATES["adamw"], exact=True)
    folder = str(tmp_path)
    train(ranks=2, checkpoint=folder, checkpoint_every=1, steps=2, **options)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.npz", "ckpt-00000002.npz"]
    train(ranks=3, zero_stage=1, checkpoint=folder, steps=2, **options)  # replaces step 2's
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.npz", "ckpt-00000002.shards"]
    train(ranks=2, zero_stage=2, resume=folder, checkpoint=folder, steps=3, **options)
    assert checkpoint.latest(folder) == shards_of(tmp_path, 3)  # the newest, of either kind
    train(ranks=3, zero_stage=2, checkpoint=folder, steps=3, **options)  # P = 2 -> 3
    assert sorted(os.listdir(shards_of(tmp_path, 3))) == [
        "manifest.json", *(f"rank-0000{r}-of-00003.npz" for r in range(3))]  # no P = 2 file
    train(ranks=2, checkpoint=folder, steps=3, **options)  # stage 0 replaces step 3's shards
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.npz", "ckpt-00000002.shards",
                                            "ckpt-00000003.npz"]  # fmt: skip
    again = train(ranks=5, zero_stage=3, resume=folder, steps=STEPS, **options)
    assert digest(again) == uninterrupted("adamw", True)


def test_a_rank_that_cannot_write_its_shard_stops_every_rank_and_no_manifest_is_written(
        tmp_path):  # fmt: skip
    os.makedirs(os.path.join(shards_of(tmp_path, 2), "rank-00001-of-00003.npz"))  # in the way
    with pytest.raises(ValueError, match=r"^rank 1: cannot write .*rank-00001-of-00003.npz"):
        train(ranks=3, zero_stage=1, checkpoint=str(tmp_path), steps=2, **MLP)
    assert "manifest.json" not in os.listdir(shards_of(tmp_path, 2))
    with pytest.raises(ValueError, match="no checkpoint"):
        checkpoint.latest(str(tmp_path))


def test_a_rank_that_does_not_see_the_directory_rank_0_locked_is_named(tmp_path):
    # as on a node whose --checkpoint path is a directory of its own, not the shared one
    for name, lock in (("shared", "node0 123 run\n"), ("own", None), ("stale", "node1 9 run\n")):
        os.makedirs(tmp_path / name)
        if lock is not None:
            (tmp_path / name / checkpoint.LOCK).write_text(lock)

    def seen(comm, folders):
        return sees_the_lock(comm, str(tmp_path / folders[comm.Get_rank()]), 2)

    assert run_threads(2, seen, ["shared", "shared"]) == [None, None]
    for other in ("own", "stale"):
        verdicts = run_threads(3, seen, ["shared", "shared", other])
        assert verdicts[:2] == [None, None] and "does not see the lock file" in verdicts[2]


# -- bad input: named, one line, nothing overwritten --


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Sharded checkpoints of one run at steps 1 and 2 (P = 3), and another run's at step 2."""
    root = tmp_path_factory.mktemp("written")
    for name, lr in (("ours", "0.01"), ("other", "0.02")):
        args = [*ARGS, "--lr", lr, "--ranks", "3", "--zero-stage", "2", "--steps", "2",
                "--checkpoint", str(root / name), "--checkpoint-every", "1"]  # fmt: skip
        assert main(["train", *args]) == 0
    return root


def rank_file(directory, step: int, rank: int) -> str:
    return os.path.join(shards_of(directory, step), f"rank-0000{rank}-of-00003.npz")


def forge_manifest(directory, change) -> None:
    """Rewrite step 2's manifest with `change` applied and a checksum that matches it."""
    path = os.path.join(shards_of(directory, 2), "manifest.json")
    manifest = json.load(open(path))
    del manifest["checksum"]
    change(manifest)
    manifest["checksum"] = checkpoint.manifest_checksum(manifest)
    json.dump(manifest, open(path, "w"))


def flip_a_byte(path: str) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(path, "wb").write(raw)


def one_range(manifest, rank: int, ranges) -> None:
    manifest["shards"][rank]["ranges"] = ranges


BROKEN = {  # how the newest checkpoint is broken: (what is done, the file named, what is said)
    "deleted": (lambda d: os.unlink(rank_file(d, 2, 1)), "rank-00001-of-00003.npz",
                "is missing"),
    "duplicated": (lambda d: shutil.copy(rank_file(d, 2, 0), rank_file(d, 2, 1)),
                   "rank-00001-of-00003.npz", "a duplicated or misplaced shard"),
    "copied beside": (lambda d: shutil.copy(rank_file(d, 2, 0), os.path.join(
        shards_of(d, 2), "rank-00000-of-00002.npz")), "rank-00000-of-00002.npz",
        "is not listed in its manifest"),
    "covered twice": (lambda d: forge_manifest(d, lambda m: one_range(
        m, 1, m["shards"][0]["ranges"])), "rank-00001-of-00003.npz", "both cover parameters"),
    "uncovered": (lambda d: forge_manifest(d, lambda m: one_range(m, 1, [])), "ckpt-00000002",
                  "no shard file covers parameters"),
    "corrupt": (lambda d: flip_a_byte(rank_file(d, 2, 2)), "rank-00002-of-00003.npz",
                "is corrupt"),
    "corrupt manifest": (lambda d: flip_a_byte(os.path.join(shards_of(d, 2), "manifest.json")),
                         "manifest.json", "corrupt"),
    "another run's": (lambda d: shutil.copy(rank_file(d.parent / "other", 2, 1),
                                            rank_file(d, 2, 1)),
                      "rank-00001-of-00003.npz", "belongs to a different run than its manifest"),
    "another step's": (lambda d: shutil.copy(rank_file(d, 1, 1), rank_file(d, 2, 1)),
                       "rank-00001-of-00003.npz", "is of step 1, its manifest of step 2"),
}  # fmt: skip


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_broken_sharded_checkpoint_is_named_and_nothing_is_overwritten(written, tmp_path,
                                                                         capsys, how):  # fmt: skip
    directory = tmp_path / "ours"
    shutil.copytree(written / "ours", directory)
    (tmp_path / "other").symlink_to(written / "other")
    change, name, said = BROKEN[how]
    change(directory)
    before = files_in(directory)
    code = main(["train", *ARGS, "--ranks", "2", "--zero-stage", "1", "--steps", "3",
                 "--resume", str(directory), "--checkpoint", str(directory)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    named = [word for word in err.split() if name in word]
    assert named and said in err, err
    assert str(directory) in named[0], err  # by its path
    # never silently from an older one: the newest valid one is named, to move the broken away
    assert f"the newest valid checkpoint of this run is {shards_of(directory, 1)}" in err, err
    assert files_in(directory) == before


def test_another_runs_sharded_checkpoint_is_passed_over_and_named_if_it_is_the_only_one(
        written, capsys):  # fmt: skip
    code = main(["train", *ARGS, "--ranks", "2", "--steps", "3", "--resume",
                 str(written / "other")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert f"checkpoint {shards_of(written / 'other', 2)} belongs to a different run" in err


# -- under a real mpiexec --


@requires_mpi
def test_a_checkpoint_sharded_on_3_mpi_ranks_resumes_on_2_thread_ranks_bitwise(tmp_path):
    directory = tmp_path / "ckpt"
    done = run_mpiexec(3, ["-m", "syncsgd.cli", "train", *ARGS, "--exact", "--zero-stage", "3",
                           "--steps", "2", "--checkpoint", str(directory)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(shards_of(directory, 2))) == [
        "manifest.json", *(f"rank-0000{r}-of-00003.npz" for r in range(3))]
    again = train(ranks=2, backend="threads", zero_stage=1, resume=str(directory), steps=STEPS,
                  **MLP, **UPDATES["adamw"], exact=True)  # fmt: skip
    assert digest(again) == uninterrupted("adamw", True)
    os.unlink(rank_file(directory, 2, 2))  # every rank refuses alike, in one line
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "train", *ARGS, "--exact", "--steps", "3",
                           "--resume", str(directory)])  # fmt: skip
    errors = [text for text in done.stderr.splitlines() if "error" in text]  # (Open MPI's own
    assert done.returncode != 0 and len(errors) == 1, done.stderr  # lines beside ours)
    assert f"{rank_file(directory, 2, 2)} is missing" in errors[0]
