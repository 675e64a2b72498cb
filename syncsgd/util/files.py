"""Output files that are either complete or absent: write to a temporary file, then rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from typing import IO, Any

_MODE = 0o666  # the umask takes its bits away, as for any file a program creates with open()
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000  # linkat(2)'s flags, for the nameless files below


def target_of(path: str | os.PathLike[str]) -> str:
    """Where writing `path` lands: a symlink is written through, to the file it points to."""
    target = os.fspath(path)
    if target == "" or target.endswith(os.sep):
        raise ValueError(f"cannot write {target!r}: not a file name")
    return os.path.realpath(target) if os.path.islink(target) else target


def check_writable(path: str | os.PathLike[str]) -> None:
    """Fail before any work, not after it, if an output file could not be written."""
    shown = os.fspath(path)
    target = target_of(path)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {shown}: directory {directory} does not exist")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"cannot write {shown}: {exc.strerror}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"cannot write {shown}: it is a directory")
    if mode is not None and not stat.S_ISREG(mode):  # a device or a FIFO is never replaced
        raise ValueError(f"cannot write {shown}: not a regular file (a device, FIFO or socket)")
    try:  # the real test: root passes os.access on read-only directories, not on read-only mounts
        _probe(directory)
    except OSError as exc:
        raise ValueError(f"cannot write {shown}: {exc.strerror} ({directory})") from None


def check_paths(
    reads: Mapping[str, str | None] = {},  # noqa: B006 (read only)
    writes: Mapping[str, str | None] = {},  # noqa: B006
    writes_into: Mapping[str, str | None] = {},  # noqa: B006
    checkpoints: Mapping[str, str | None] = {},  # noqa: B006
) -> None:
    """Before any work: every output can be written, and none lands on an input, on another
    output, or inside a directory that another option writes into or checkpoints into.

    Each mapping goes from an option's flag to its path (None: not given). `writes`: files
    replaced atomically; `writes_into`: directories whose files are written (their parent must
    exist, as a file's must); `checkpoints`: directories read and written, with their lock.
    Paths are compared after resolving symlinks and `..`, and by inode where both exist.
    """
    given = [
        (role, flag, os.fspath(path))
        for role, paths in (("reads", reads), ("writes", writes), ("writes_into", writes_into),
                            ("checkpoints", checkpoints))
        for flag, path in paths.items()
        if path is not None
    ]  # fmt: skip
    for _, flag, path in given:
        if path == "":
            raise ValueError(f"{flag} '': an empty path names no file or directory")
    seen: list[tuple[str, str, str]] = []
    for role, flag, path in given:
        for other_role, other_flag, other in seen:
            if role != "reads" or other_role != "reads":
                _check_apart((other_role, other_flag, other), (role, flag, path))
        seen.append((role, flag, path))
    for role, _, path in given:
        if role == "writes":
            check_writable(path)
        elif role == "writes_into":
            check_directory_writable(path)


def check_suffix(flag: str, path: str | None, suffixes: tuple[str, ...], what: str) -> None:
    """Refuse an output named `path` whose extension is not one of `suffixes` (its format's):
    e.g. a PNG written as x.svg would be read as what its name says."""
    if path is None or path == "" or path.lower().endswith(tuple(suffixes)):
        return
    named = " or ".join(suffixes)
    raise ValueError(f"{flag} {path}: {what} is written to a name ending in {named}")


def _check_apart(first: tuple[str, str, str], second: tuple[str, str, str]) -> None:
    """Refuse two declared paths of which one would write over, or into, the other."""
    if {first[0], second[0]} == {"reads", "checkpoints"}:
        return  # reading a checkpoint (--resume) is what a checkpoint directory is for
    for (role, flag, path), (other_role, other_flag, other) in ((first, second), (second, first)):
        if _same(path, other):
            raise ValueError(f"{other_flag} {other} is the same file as {flag} {path}: "
                                 f"refusing to overwrite it")  # fmt: skip
        if role in ("writes", "writes_into", "checkpoints") and other_role in (
            "writes_into", "checkpoints"
        ) and _inside(path, other):
            what = "checkpoint directory" if other_role == "checkpoints" else "directory"
            raise ValueError(f"{flag} {path} lies inside the {what} of {other_flag} {other}: "
                             f"write it elsewhere")  # fmt: skip


def _same(first: str, second: str) -> bool:
    """Whether two paths name the same file: the same resolved path, or the same inode."""
    if os.path.realpath(first) == os.path.realpath(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # one does not exist (yet): the resolved paths decided
        return False


def _inside(path: str, directory: str) -> bool:
    """Whether `path` resolves to a place strictly below `directory`."""
    below, above = os.path.realpath(path), os.path.realpath(directory)
    return below != above and os.path.commonpath([below, above]) == above


def check_directory_writable(path: str | os.PathLike[str]) -> None:
    """A directory whose files will be written: an existing writable one, or a new one whose
    parent exists and is writable (a missing parent is refused, as for a file)."""
    shown = os.fspath(path)
    if shown == "":
        raise ValueError("cannot write into '': not a directory name")
    real = os.path.realpath(shown)
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"cannot write into {shown}: it is not a directory")
    directory = real if os.path.isdir(real) else os.path.dirname(real)
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write into {shown}: directory {directory} does not exist")
    try:
        _probe(directory)
    except OSError as exc:
        raise ValueError(f"cannot write into {shown}: {exc.strerror} ({directory})") from None


def check_regular_file(path: str, what: str = "file") -> None:
    """ValueError unless `path` is an existing regular file (a FIFO would block the reader)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise ValueError(f"{what} {path} is not a regular file ({kind})")


def _probe(directory: str) -> None:
    """Create a file in `directory` and drop it; nameless with O_TMPFILE, so a kill leaves none."""
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_RDWR, _MODE))
        return
    except (OSError, AttributeError):  # no O_TMPFILE here: a named file tells the same
        pass
    with _temporary(directory, ""):
        pass


@contextlib.contextmanager
def _temporary(directory: str, suffix: str) -> Iterator[str]:
    """A new empty file in `directory` (mode 0666 less the umask), removed unless renamed."""
    while True:
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(6)}{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _MODE))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Within: an OSError that names no file (a full disk while writing) names `path`."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.

    For writers that take a file name (savefig). The temporary name keeps the suffix, so a
    writer that appends one does not miss it; writers that take a handle use `atomic_file`.
    """
    check_writable(path)
    target = target_of(path)
    directory = os.path.dirname(os.path.abspath(target))
    with naming(path), _temporary(directory, os.path.splitext(target)[1]) as tmp:
        yield tmp
        os.replace(tmp, target)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb", **kwargs: Any) -> Iterator[IO]:
    """An open file that appears, complete, at `path` when the block succeeds, else nowhere.

    On Linux the file has no name until then (O_TMPFILE): a process killed mid-write leaves
    nothing behind. Elsewhere a hidden temporary file is renamed.
    """
    check_writable(path)
    target = target_of(path)
    directory = os.path.dirname(os.path.abspath(target))
    try:
        fd = os.open(directory, getattr(os, "O_TMPFILE", 0) | os.O_RDWR, _MODE)
    except (OSError, AttributeError):  # no O_TMPFILE (macOS, some file systems): a named file
        fd = None
    if fd is None:
        with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as handle:
            yield handle
        return
    with naming(path), open(fd, mode, **kwargs) as handle:
        yield handle
        handle.flush()
        _name(fd, directory, target)


def _name(fd: int, directory: str, target: str) -> None:
    """Give the nameless file `fd` the name `target`: link it, or copy it where links fail."""
    try:  # a new name: one link, and no moment at which a kill leaves a stray file
        _link(fd, target)
        return
    except FileExistsError:
        pass
    except OSError:  # e.g. EXDEV on overlay file systems: copy the bytes instead
        _copy(fd, directory, target)
        return
    while True:  # replacing a file: link under a free hidden name, then rename over it
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(6)}")
        try:
            _link(fd, tmp)
            break
        except FileExistsError:
            continue
        except OSError:
            _copy(fd, directory, target)
            return
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _link(fd: int, path: str) -> None:
    """Give the nameless file `fd` the new name `path` (FileExistsError if that name is taken)."""
    try:
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    # Some kernels refuse the /proc link (EXDEV) yet let root link the descriptor itself.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)


def _copy(fd: int, directory: str, target: str) -> None:
    """Write the bytes of `fd` to a hidden file next to `target`, then rename it onto `target`."""
    with _temporary(directory, "") as tmp:
        with open(tmp, "wb") as out:
            offset = 0
            while chunk := os.pread(fd, 1 << 20, offset):
                out.write(chunk)
                offset += len(chunk)
        os.replace(tmp, target)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_file(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def create_new(path: str | os.PathLike[str], text: str) -> None:
    """Create the file `path` holding `text`, whole or not at all; FileExistsError if it exists.

    The text is written to a hidden file first, then linked to `path` (a link never replaces a
    file): no process ever sees `path` empty or half-written, even on a full disk.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    with naming(target), _temporary(directory, "") as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, target) from None
