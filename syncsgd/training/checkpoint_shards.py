"""Sharded checkpoints written (`--zero-stage` 1-3): every rank its shard file, rank 0 the
manifest, last. No rank gathers the whole state; checkpoint.py reads it back whole.

    rank 0       removes this step's manifest, if any (the old checkpoint stops counting)
    every rank   writes its shard file atomically: its blocks of the parameters and of every
                 array of the optimizer state, their [start, stop) ranges, the optimizer's scalars
                 (rank 0's also the loss scaler's state and BatchNorm's running statistics)
    allreduce    the files' SHA-256, one row a rank
    rank 0       removes shard files of this step no longer listed, then writes the manifest
Each stage ends with an agreement: a rank that could not write stops every rank, in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from syncsgd.comm.watchdog import Watched
from syncsgd.comm.world import constants
from syncsgd.training import checkpoint
from syncsgd.training.run import agree
from syncsgd.training.sharded import owned_parts
from syncsgd.util.files import atomic_file


@dataclass
class Shard:
    """One rank's part of the training state after `step` steps."""

    step: int
    ranges: list[tuple[int, int]]  # the [start, stop) of each block, in the shard's order
    params: np.ndarray  # the blocks, one after the other
    optimizer: dict[str, np.ndarray]  # per parameter: the blocks, one after the other
    scalars: dict[str, np.ndarray]  # the optimizer's other state (Adam's step count)
    scaler: dict[str, np.ndarray] = field(default_factory=dict)  # rank 0's only
    running: np.ndarray | None = None  # rank 0's only


def shard_of(stepper: Any, step: int, scaler: dict[str, np.ndarray],
             running: np.ndarray | None) -> Shard:  # fmt: skip
    """This rank's shard of a sharded step's state (not a collective)."""
    sharded = stepper.sharded
    ranges = [(start, stop) for _, start, stop, _ in sharded.owned_at]
    params = sharded.params_shard if sharded.stage == 3 else sharded.taken(stepper.params)
    own, spans = sharded.optimizer.own_state(), sharded.optimizer.spans
    length = spans[0][1] - spans[0][0]  # an array of this length is one per parameter
    blocks = {name: np.concatenate([state[name] for state in own])
              for name, value in own[0].items() if value.shape == (length,)}  # fmt: skip
    scalars = {name: value for name, value in own[0].items() if name not in blocks}
    master = stepper.rank == 0
    return Shard(step, ranges, params.copy(), blocks, scalars, scaler if master else {},
                 running if master else None)  # fmt: skip


def save(stepper: Any, directory: str, shard: Shard, fingerprint: str) -> str:
    """Write the sharded checkpoint of `shard.step` (a collective: every rank calls it with its
    shard); returns its directory. AgreedError on every rank if a rank could not write."""
    comm = Watched(stepper.comm, "the sharded checkpoint")
    rank, size, what = comm.Get_rank(), comm.Get_size(), "the sharded checkpoint's agreement"
    path = checkpoint.shards_path_for(directory, shard.step)
    agree(comm, attempt(begin, path) if rank == 0 else None, what)
    digests = np.zeros((size, hashlib.sha256().digest_size), np.int64)
    written: list[bytes] = []
    agree(comm, attempt(lambda: written.append(write_shard(path, rank, size, shard,
                                                           fingerprint))), what)  # fmt: skip
    digests[rank] = np.frombuffer(written[0], np.uint8)
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, digests, op=mpi.SUM)
    error = None
    if rank == 0:
        sharded = stepper.sharded
        manifest = manifest_of(shard.step, fingerprint, size, sharded, digests)
        error = attempt(finish, path, manifest)
    agree(comm, error, what)
    return path


def attempt(action: Any, *args: Any) -> str | None:
    """Run `action(*args)`; the reason it could not write, or None."""
    try:
        action(*args)
    except ValueError as exc:  # atomic_file's checks: a directory in the way, a full disk, ...
        return str(exc)
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot write the sharded checkpoint{where}: {exc.strerror or exc}"
    return None


def begin(path: str) -> None:
    """Rank 0, before any shard is written: the directory exists, and a checkpoint of this step
    written before no longer counts."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, checkpoint.MANIFEST))
    os.makedirs(path, exist_ok=True)


def write_shard(path: str, rank: int, size: int, shard: Shard, fingerprint: str) -> bytes:
    """Write this rank's shard file atomically; the SHA-256 of its bytes."""
    arrays = {
        "format": np.array(checkpoint.SHARD_FORMAT),
        "step": np.array(shard.step, np.int64),
        "fingerprint": np.array(fingerprint),
        "rank": np.array(rank, np.int64),
        "ranks": np.array(size, np.int64),
        "ranges": np.array(shard.ranges, np.int64).reshape(-1, 2),
        "params": shard.params,
        **{f"optimizer.{name}": value for name, value in shard.optimizer.items()},
        **{f"optimizer_scalar.{name}": value for name, value in shard.scalars.items()},
        **{f"scaler.{name}": value for name, value in shard.scaler.items()},
        **({} if shard.running is None else {"running": shard.running}),
    }  # fmt: skip
    arrays["checksum"] = np.array(checkpoint.checksum(arrays))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # stub: **arrays might fill allow_pickle
    raw = buffer.getvalue()
    with atomic_file(os.path.join(path, checkpoint.shard_name(rank, size))) as handle:
        handle.write(raw)
    return hashlib.sha256(raw).digest()


def manifest_of(step: int, fingerprint: str, size: int, sharded: Any,
                digests: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """The manifest: the checkpoint's step, run, P, stage and size, and every rank's shard file
    with its SHA-256 and ranges (the blocks each rank owns, as the step cut them)."""
    shards = [{"rank": rank, "file": checkpoint.shard_name(rank, size),
               "sha256": bytes(digests[rank].astype(np.uint8)).hex(),
               "ranges": [[start, stop] for _, start, stop, _ in
                          owned_parts(sharded.bucket_slices, sharded.n_params, rank, size)]}
              for rank in range(size)]  # fmt: skip
    manifest = {"format": checkpoint.MANIFEST_FORMAT, "step": step, "fingerprint": fingerprint,
                "ranks": size, "zero_stage": sharded.stage, "n_params": sharded.n_params,
                "dtype": sharded.params_shard.dtype.name, "shards": shards}  # fmt: skip
    manifest["checksum"] = checkpoint.manifest_checksum(manifest)
    return manifest


def finish(path: str, manifest: dict[str, Any]) -> None:
    """Rank 0, once every shard is written: shard files not listed removed (another P's, of a
    checkpoint of this step written before), the manifest written, this step's unsharded
    checkpoint, if any, removed (replaced)."""
    listed = {entry["file"] for entry in manifest["shards"]}
    for name in os.listdir(path):
        if checkpoint.SHARD_NAME.match(name) and name not in listed:
            os.unlink(os.path.join(path, name))
    with atomic_file(os.path.join(path, checkpoint.MANIFEST), "w", encoding="utf-8") as handle:
        handle.write(json.dumps(manifest, indent=1) + "\n")
    unsharded = checkpoint.path_for(os.path.dirname(path), manifest["step"])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(unsharded)
