"""Output files that are either complete or absent: write to a temporary file, then rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {target}: directory {directory} does not exist")
    suffix = os.path.splitext(target)[1]  # keep the extension: np.savez appends .npz otherwise
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Fail before any work, not after it, if an output file could not be written."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {target}: directory {directory} does not exist")
    if os.path.isdir(target):
        raise ValueError(f"cannot write {target}: it is a directory")
