"""Checkpoints: the whole training state in one `.npz`, written atomically, verified when read;
or, sharded (`--zero-stage` 1-3), in one `.npz` per rank and a manifest, read back whole.

A checkpoint holds the parameters, the optimizer state (the momentum buffer, if any), BatchNorm's
running statistics (if any), the number of steps taken, a fingerprint of everything else that
determines the run (model, data, optimizer, seed, exact mode, ...), and a SHA-256 checksum of all
of it. No random-generator state is needed:
the sample order of every epoch is a pure function of (seed, epoch), so the step number alone says
where the run is. A run resumed from step k therefore repeats the uninterrupted run exactly - and in
exact mode also on a different number of ranks, since nothing in the state depends on P.

    ckpt-00000004.npz              the whole state (stage 0)
    ckpt-00000004.shards/          the same state in shards (checkpoint_shards.py writes it):
        rank-00000-of-00003.npz    each rank's blocks of the parameters and of every array of the
        ...                        optimizer state, their [start, stop) ranges, the optimizer's
        manifest.json              scalars; the manifest (written last: without it, no checkpoint)
                                   lists every file with its SHA-256 and ranges
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from syncsgd.util.files import atomic_file, check_regular_file, create_new

_NAME = re.compile(r"ckpt-(\d{8,})\.npz$")
FORMAT = "syncsgd-checkpoint-1"
_SHARDS = re.compile(r"ckpt-(\d{8,})\.shards$")
SHARD_NAME = re.compile(r"rank-\d{5,}-of-\d{5,}\.npz$")
SHARD_FORMAT = "syncsgd-checkpoint-shard-1"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "syncsgd-sharded-checkpoint-1"


@dataclass
class Checkpoint:
    """The training state after `step` steps."""

    step: int
    params: np.ndarray
    optimizer: dict[str, np.ndarray]
    scaler: dict[str, np.ndarray] = field(default_factory=dict)  # the loss scale, if any
    running: np.ndarray | None = None  # BatchNorm's running statistics (rank 0's), if any


def path_for(directory: str, step: int) -> str:
    """Where the checkpoint after `step` steps lives."""
    return os.path.join(directory, f"ckpt-{step:08d}.npz")


def shards_path_for(directory: str, step: int) -> str:
    """Where the sharded checkpoint after `step` steps lives: a directory."""
    return os.path.join(directory, f"ckpt-{step:08d}.shards")


def shard_name(rank: int, ranks: int) -> str:
    """The file of rank `rank`'s shard of `ranks`, in a sharded checkpoint's directory."""
    return f"rank-{rank:05d}-of-{ranks:05d}.npz"


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of `arrays`, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save(directory: str, state: Checkpoint, fingerprint: str) -> str:
    """Write `state` to `directory` atomically (temp file + rename); return the path."""
    arrays = {
        "format": np.array(FORMAT),
        "step": np.array(state.step, dtype=np.int64),
        "params": state.params,
        "fingerprint": np.array(fingerprint),
        **{f"optimizer.{name}": value for name, value in state.optimizer.items()},
        **{f"scaler.{name}": value for name, value in state.scaler.items()},
        **({} if state.running is None else {"running": state.running}),
    }
    arrays["checksum"] = np.array(checksum(arrays))
    path = path_for(directory, state.step)
    with atomic_file(path) as handle:
        np.savez(handle, **arrays)  # type: ignore[arg-type]  # stub: **arrays might fill allow_pickle
    remove_shards(shards_path_for(directory, state.step))  # this step's, replaced
    return path


def remove_shards(path: str) -> None:
    """Remove the sharded checkpoint at `path`, if any: its manifest first (then it no longer
    counts), its shard files, the directory if nothing else is left in it."""
    if not os.path.isdir(path):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, MANIFEST))
    for name in os.listdir(path):
        if SHARD_NAME.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def latest(directory: str) -> str:
    """The path of the checkpoint with the most steps in `directory`."""
    return candidates(directory)[0]


def candidates(directory: str) -> list[str]:
    """The checkpoints in `directory`, newest first: regular files named ckpt-NNNNNNNN.npz and
    directories named ckpt-NNNNNNNN.shards that hold a manifest (at one step, the sharded first)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--resume {directory}: no such directory")
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "ckpt-*"))
             if (m := _NAME.search(p) or _SHARDS.search(p)) and is_checkpoint(p)]  # fmt: skip
    if not found:
        raise ValueError(f"--resume {directory}: no checkpoint (ckpt-NNNNNNNN.npz, or "
                         f"ckpt-NNNNNNNN.shards/ with its {MANIFEST}) in it")  # fmt: skip
    return [path for _, path in sorted(found, reverse=True)]


def is_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint: a regular file, or a directory of shards with a manifest."""
    if path.endswith(".npz"):
        return os.path.isfile(path)
    return os.path.isfile(os.path.join(path, MANIFEST))


def load_latest(directory: str, fingerprint: str, n_params: int, dtype: np.dtype,
                n_running: int = 0) -> Checkpoint:  # fmt: skip
    """The newest checkpoint in `directory` that belongs to this run (others' are passed over)."""
    paths = candidates(directory)
    for index, path in enumerate(paths):
        try:
            return load(path, fingerprint, n_params, dtype, n_running)
        except OtherRunError:
            continue
        except ValueError as exc:  # a broken newest one: never resume silently from an older
            older = _newest_valid(paths[index + 1 :], fingerprint, n_params, dtype, n_running)
            hint = (f"; the newest valid checkpoint of this run is {older}: move {path} away "
                    f"to resume from it" if older else "; no older checkpoint of this run is "
                    "valid")  # fmt: skip
            raise ValueError(f"{exc}{hint}") from None
    return load(paths[0], fingerprint, n_params, dtype, n_running)  # none is ours: say why


def check_scaler(path: str, scaler: dict[str, np.ndarray]) -> None:
    """The loss scaler's state must be numbers: a scale >= 0 and a count of good steps."""
    for name, kinds in (("scale", "fiu"), ("good_steps", "iu")):
        value = scaler.get(name)
        if value is not None and (value.shape != () or value.dtype.kind not in kinds
                                  or not np.isfinite(value) or value < 0):  # fmt: skip
            raise ValueError(f"checkpoint {path} is not a syncsgd checkpoint: its loss scaler's "
                             f"{name} is {value!r}")  # fmt: skip


def _newest_valid(paths: list[str], fingerprint: str, n_params: int, dtype: np.dtype,
                  n_running: int) -> str | None:  # fmt: skip
    """The first of `paths` that loads as a checkpoint of this run, or None."""
    for path in paths:
        try:
            load(path, fingerprint, n_params, dtype, n_running)
        except ValueError:
            continue
        return path
    return None


class OtherRunError(ValueError):
    """A valid checkpoint, of a run with other options or data."""


LOCK = "lock"


@contextlib.contextmanager
def locked(directory: str, fingerprint: str) -> Iterator[None]:
    """Hold `directory` for this run: a second run writing there would overwrite its checkpoints.

    The lock file names its owner (host, process, run); a lock left by a process of this host
    that no longer exists is taken over.
    """
    path = os.path.join(directory, LOCK)
    me = f"{socket.gethostname()} {os.getpid()} {fingerprint}\n"
    for _ in range(2):
        try:
            create_new(path, me)  # whole or not at all: a full disk leaves no empty lock
        except FileExistsError:
            _take_over_if_stale(path, directory)
            continue
        break
    else:
        raise ValueError(f"cannot take {path}")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            with open(path) as handle:
                mine = handle.read() == me
            if mine:
                os.unlink(path)


def _take_over_if_stale(path: str, directory: str) -> None:
    """Remove the lock at `path` if its owner is a dead process of this host; else refuse."""
    try:
        with open(path, encoding="utf-8") as handle:
            owner = handle.read()
    except FileNotFoundError:  # released meanwhile
        return
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not text"
        raise ValueError(f"checkpoint directory {directory} has a lock file {path} that cannot "
                         f"be read ({reason}); remove it if no run uses the directory") from None
    host, pid, *_ = owner.split() + ["", ""]
    if not pid.isdigit():
        what = "an empty" if not owner.strip() else "a malformed"
        raise ValueError(f"checkpoint directory {directory} has {what} lock file {path} (not "
                         f"written by a syncsgd run); remove it if no run uses the directory")
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    raise ValueError(
        f"checkpoint directory {directory} is in use by process {pid or '?'} on {host or '?'}; "
        f"use another directory, or remove {path} if that run has ended"
    )


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def load(path: str, fingerprint: str, n_params: int, dtype: np.dtype,
         n_running: int = 0) -> Checkpoint:  # fmt: skip
    """Read and verify a checkpoint, a file or a directory of shards; ValueError if it is corrupt
    or belongs to another run."""
    if _SHARDS.search(path) and os.path.isdir(path):
        return load_shards(path, fingerprint, n_params, dtype, n_running)
    return load_file(path, fingerprint, n_params, dtype, n_running)


def load_file(path: str, fingerprint: str, n_params: int, dtype: np.dtype,
              n_running: int = 0) -> Checkpoint:  # fmt: skip
    """Read and verify a checkpoint file; ValueError if it is corrupt or belongs to another run."""
    check_regular_file(path, "checkpoint")  # a FIFO would block np.load forever
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as exc:  # noqa: BLE001 - OSError, BadZipFile, EOFError, ValueError, ...
        raise ValueError(f"checkpoint {path} is corrupt or unreadable: {exc}") from None
    missing = {"format", "step", "params", "fingerprint", "checksum"} - set(arrays)
    if missing or str(arrays["format"]) != FORMAT:
        raise ValueError(f"{path} is not a syncsgd checkpoint (missing {sorted(missing)})")
    stored = str(arrays.pop("checksum"))
    if checksum(arrays) != stored:
        raise ValueError(f"checkpoint {path} is corrupt: its checksum does not match its contents")
    step = arrays["step"]
    if step.shape != () or step.dtype.kind not in "iu" or step < 0:
        raise ValueError(f"{path} is not a syncsgd checkpoint: step {step} is not a step count")
    return state_of(path, arrays, fingerprint, n_params, dtype, n_running)


def state_of(path: str, arrays: dict[str, np.ndarray], fingerprint: str, n_params: int,
             dtype: np.dtype, n_running: int) -> Checkpoint:  # fmt: skip
    """The training state in a checkpoint's verified `arrays`, checked against this run."""
    if str(arrays["fingerprint"]) != fingerprint:
        raise OtherRunError(
            f"checkpoint {path} belongs to a different run (model, data or training options "
            f"differ); resume with the options it was written with"
        )
    params = arrays["params"]
    if params.shape != (n_params,) or params.dtype != dtype:
        raise ValueError(f"checkpoint {path} holds {params.shape} {params.dtype} parameters, "
                         f"expected ({n_params},) {dtype}")  # fmt: skip
    optimizer = {k.removeprefix("optimizer."): v for k, v in arrays.items()
                 if k.startswith("optimizer.")}  # fmt: skip
    scaler = {k.removeprefix("scaler."): v for k, v in arrays.items() if k.startswith("scaler.")}
    check_scaler(path, scaler)
    running = arrays.get("running")
    if n_running and (running is None or running.shape != (n_running,) or running.dtype != dtype):
        raise ValueError(f"checkpoint {path} holds no {n_running} {dtype} BatchNorm running "
                         f"statistics")  # fmt: skip
    return Checkpoint(int(arrays["step"]), params, optimizer, scaler, running)


def manifest_checksum(manifest: dict) -> str:
    """SHA-256 of a manifest's fields (without its checksum), as sorted, compact JSON."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def load_shards(path: str, fingerprint: str, n_params: int, dtype: np.dtype,
                n_running: int = 0) -> Checkpoint:  # fmt: skip
    """Read and verify a sharded checkpoint - its manifest, then every shard file it lists - and
    reassemble the whole run's state; ValueError naming the file that is missing, duplicated,
    corrupt or from another checkpoint."""
    manifest = read_manifest(path)
    if manifest["fingerprint"] != fingerprint:
        raise OtherRunError(
            f"checkpoint {path} belongs to a different run (model, data or training options "
            f"differ); resume with the options it was written with"
        )
    if manifest["n_params"] != n_params or manifest["dtype"] != np.dtype(dtype).name:
        raise ValueError(f"checkpoint {path} holds ({manifest['n_params']},) "
                         f"{manifest['dtype']} parameters, expected ({n_params},) {dtype}")
    check_coverage(path, manifest["shards"], n_params)
    check_strays(path, manifest["shards"])
    shards = [read_shard(path, manifest, entry) for entry in manifest["shards"]]
    arrays = assembled(path, manifest, shards, n_params)
    return state_of(path, arrays, fingerprint, n_params, dtype, n_running)


def read_manifest(path: str) -> dict:
    """The manifest of the sharded checkpoint at `path`, its checksum and fields checked."""
    where = os.path.join(path, MANIFEST)
    check_regular_file(where, "checkpoint manifest")
    try:
        with open(where, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"checkpoint manifest {where} is corrupt or unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{where} is not a syncsgd checkpoint manifest")
    if manifest.pop("checksum", None) != manifest_checksum(manifest):
        raise ValueError(f"checkpoint manifest {where} is corrupt: its checksum does not match "
                         "its contents")  # fmt: skip
    problem = manifest_problem(manifest)
    if problem:
        raise ValueError(f"{where} is not a syncsgd checkpoint manifest: {problem}")
    return manifest


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's fields (a forged one: its checksum matched), or None."""
    counts = ("step", "ranks", "zero_stage", "n_params")
    if not all(type(manifest.get(name)) is int and manifest[name] >= 0 for name in counts):
        return f"its {', '.join(counts)} must be counts"
    if not isinstance(manifest.get("fingerprint"), str) or not isinstance(
            manifest.get("dtype"), str):  # fmt: skip
        return "its fingerprint and dtype must be text"
    shards = manifest.get("shards")
    if not isinstance(shards, list) or len(shards) != manifest["ranks"]:
        return f"it must list one shard file for each of its {manifest['ranks']} ranks"
    for rank, entry in enumerate(shards):
        if not (isinstance(entry, dict) and entry.get("rank") == rank
                and entry.get("file") == shard_name(rank, len(shards))
                and isinstance(entry.get("sha256"), str) and is_ranges(entry.get("ranges"))):
            return f"its entry of rank {rank} is malformed"  # fmt: skip
    return None


def is_ranges(value: object) -> bool:
    """Whether `value` is a list of [start, stop) pairs of counts, each start below its stop."""
    return isinstance(value, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(type(end) is int for end in pair)
        and 0 <= pair[0] < pair[1] for pair in value)  # fmt: skip


def check_coverage(path: str, shards: list[dict], n_params: int) -> None:
    """The ranges the manifest lists cover every parameter exactly once."""
    pieces = sorted((start, stop, os.path.join(path, entry["file"])) for entry in shards
                    for start, stop in entry["ranges"])  # fmt: skip
    covered, previous = 0, ""
    for start, stop, name in pieces:
        if start < covered:
            raise ValueError(f"checkpoint shards {previous} and {name} both cover parameters "
                             f"[{start}, {min(stop, covered)}): a duplicated shard")  # fmt: skip
        if start > covered:
            break
        covered, previous = stop, name
    if covered > n_params:
        raise ValueError(f"checkpoint shard {previous} covers parameters up to {covered}, of "
                         f"{n_params}")  # fmt: skip
    gap_end = next((start for start, _, _ in pieces if start > covered), n_params)
    if covered < n_params:
        raise ValueError(f"checkpoint {path}: no shard file covers parameters [{covered}, "
                         f"{gap_end}): a shard missing from its manifest")  # fmt: skip


def check_strays(path: str, shards: list[dict]) -> None:
    """No shard file in the directory that the manifest does not list (another checkpoint's,
    or a copy): a checkpoint is what its manifest says, whole."""
    listed = {entry["file"] for entry in shards}
    for name in sorted(os.listdir(path)):
        if SHARD_NAME.match(name) and name not in listed:
            raise ValueError(f"checkpoint shard {os.path.join(path, name)} is not listed in its "
                             f"manifest {os.path.join(path, MANIFEST)} (a shard of another "
                             "checkpoint, or a duplicate): move it away")  # fmt: skip


def read_shard(path: str, manifest: dict, entry: dict) -> dict[str, np.ndarray]:
    """The arrays of one shard file the manifest lists, checked against the manifest."""
    where = os.path.join(path, entry["file"])
    if not os.path.lexists(where):
        raise ValueError(f"checkpoint shard {where} is missing (its manifest "
                         f"{os.path.join(path, MANIFEST)} lists it)")  # fmt: skip
    check_regular_file(where, "checkpoint shard")
    try:
        with open(where, "rb") as handle:
            raw = handle.read()
        with np.load(io.BytesIO(raw), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as exc:  # noqa: BLE001 - OSError, BadZipFile, EOFError, ValueError, ...
        raise ValueError(f"checkpoint shard {where} is corrupt or unreadable: {exc}") from None
    fields = {"format", "step", "fingerprint", "rank", "ranks", "ranges", "params", "checksum"}
    if fields - set(arrays) or str(arrays["format"]) != SHARD_FORMAT:
        raise ValueError(f"{where} is not a syncsgd checkpoint shard")
    if checksum({k: v for k, v in arrays.items() if k != "checksum"}) != str(arrays["checksum"]):
        raise ValueError(f"checkpoint shard {where} is corrupt: its checksum does not match its "
                         "contents")  # fmt: skip
    check_shard_is_listed(where, arrays, manifest, entry)
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise ValueError(f"checkpoint shard {where} is corrupt: its SHA-256 is not the one its "
                         "manifest lists")  # fmt: skip
    return arrays


def check_shard_is_listed(where: str, arrays: dict[str, np.ndarray], manifest: dict,
                          entry: dict) -> None:  # fmt: skip
    """A shard file is the one the manifest lists under its name: of the same run, step, rank and
    ranges (else it was copied from another checkpoint, or from another rank's file)."""
    if str(arrays["fingerprint"]) != manifest["fingerprint"]:
        raise ValueError(f"checkpoint shard {where} belongs to a different run than its manifest "
                         "(model, data or training options differ): a shard of another run")
    step = arrays["step"]
    if step.shape != () or step.dtype.kind not in "iu" or int(step) != manifest["step"]:
        raise ValueError(f"checkpoint shard {where} is of step {step}, its manifest of step "
                         f"{manifest['step']}: a shard of another checkpoint")  # fmt: skip
    ranges = arrays["ranges"]
    same = (ranges.ndim == 2 and ranges.dtype.kind in "iu"
            and ranges.tolist() == entry["ranges"])  # fmt: skip
    if not same or str(arrays["rank"]) != str(entry["rank"]) or str(arrays["ranks"]) != str(
            manifest["ranks"]):  # fmt: skip
        raise ValueError(f"checkpoint shard {where} holds rank {arrays['rank']} of "
                         f"{arrays['ranks']}'s parameters, not the ones its manifest lists "
                         "under its name: a duplicated or misplaced shard")  # fmt: skip


def assembled(path: str, manifest: dict, shards: list[dict[str, np.ndarray]],
              n_params: int) -> dict[str, np.ndarray]:  # fmt: skip
    """The whole run's state from the shards, as an unsharded checkpoint holds it: the blocks
    put where their ranges say; the optimizer's scalars (the same on every rank) and rank 0's
    loss scaler and BatchNorm statistics as they are."""
    first = shards[0]  # rank 0's
    arrays = {"step": np.array(manifest["step"], np.int64),
              "fingerprint": np.array(manifest["fingerprint"]),
              **{k: v for k, v in first.items() if k.startswith(("scaler.", "running",
                                                                  "optimizer_scalar."))}}
    blocks = ["params", *(k for k in first if k.startswith("optimizer."))]
    for name in blocks:
        arrays[name] = np.empty(n_params, first[name].dtype)
    for entry, shard in zip(manifest["shards"], shards, strict=True):
        where = os.path.join(path, entry["file"])
        check_alike(where, shard, first, blocks)
        offset = 0
        for start, stop in entry["ranges"]:
            for name in blocks:
                arrays[name][start:stop] = shard[name][offset : offset + stop - start]
            offset += stop - start
    return {k.replace("optimizer_scalar.", "optimizer."): v for k, v in arrays.items()}


def check_alike(where: str, shard: dict[str, np.ndarray], first: dict[str, np.ndarray],
                blocks: list[str]) -> None:  # fmt: skip
    """A shard holds the arrays rank 0's does, its blocks as long as its ranges, the same
    optimizer scalars."""
    width = int(sum(stop - start for start, stop in shard["ranges"].tolist()))
    names = {k for k in shard if k.startswith(("optimizer.", "optimizer_scalar."))}
    if names != {k for k in first if k.startswith(("optimizer.", "optimizer_scalar."))}:
        raise ValueError(f"checkpoint shard {where} holds other optimizer state than rank 0's")
    for name in blocks:
        if shard[name].shape != (width,) or shard[name].dtype != first[name].dtype:
            raise ValueError(f"checkpoint shard {where} holds {shard[name].shape} "
                             f"{shard[name].dtype} {name}, expected ({width},) "
                             f"{first[name].dtype}")  # fmt: skip
    for name in names - set(blocks):
        if shard[name].tobytes() != first[name].tobytes() or shard[name].dtype != first[
                name].dtype:  # fmt: skip
            raise ValueError(f"checkpoint shard {where}'s {name} is {shard[name]}, rank 0's "
                             f"{first[name]}")  # fmt: skip
