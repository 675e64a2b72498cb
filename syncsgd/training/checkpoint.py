"""Checkpoints: the whole training state in one `.npz`, written atomically, verified when read.

A checkpoint holds the parameters, the optimizer state (the momentum buffer, if any), BatchNorm's
running statistics (if any), the number of steps taken, a fingerprint of everything else that
determines the run (model, data, optimizer, seed, exact mode, ...), and a SHA-256 checksum of all
of it. No random-generator state is needed:
the sample order of every epoch is a pure function of (seed, epoch), so the step number alone says
where the run is. A run resumed from step k therefore repeats the uninterrupted run exactly - and in
exact mode also on a different number of ranks, since nothing in the state depends on P.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from syncsgd.util.files import atomic_file, check_regular_file, create_new

_NAME = re.compile(r"ckpt-(\d{8,})\.npz$")
FORMAT = "syncsgd-checkpoint-1"


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
    return path


def latest(directory: str) -> str:
    """The path of the checkpoint with the most steps in `directory`."""
    return candidates(directory)[0]


def candidates(directory: str) -> list[str]:
    """The checkpoints (regular files named ckpt-NNNNNNNN.npz) in `directory`, newest first."""
    if not os.path.isdir(directory):
        raise ValueError(f"--resume {directory}: no such directory")
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "ckpt-*.npz"))
             if (m := _NAME.search(p)) and os.path.isfile(p)]  # fmt: skip
    if not found:
        raise ValueError(f"--resume {directory}: no checkpoint (ckpt-NNNNNNNN.npz) in it")
    return [path for _, path in sorted(found, reverse=True)]


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
    """Read and verify a checkpoint; ValueError if it is corrupt or belongs to another run."""
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
