"""Shared test settings: hypothesis profiles and helpers to run syncsgd under a real mpiexec."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings

# deadline=None: the first call of a Numba kernel compiles it, which takes seconds. CI draws the
# same examples on every run (derandomize), so that a red CI names a change, not a lucky draw; the
# dev and thorough profiles draw afresh.
settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    """The markers of this suite."""
    config.addinivalue_line("markers", "cluster: runs MPI across emulated nodes (root; seconds)")
    config.addinivalue_line("markers", "mpi: runs a real mpiexec (`-m mpi`: the MPI tests alone)")
    config.addinivalue_line(
        "markers", "mpi_once: an MPI case whose siblings prove the same under each MPI library "
        "(CI runs it under MPICH only: `-m \"mpi and not mpi_once\"` under Open MPI)"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The mpiexec the MPI tests drive and the MPI library mpi4py loads, in pytest's header."""
    path = mpiexec_path()
    if path is None:
        return ["mpiexec: none (the MPI tests are skipped)"]
    flavour, version = mpiexec_flavour(path)
    return [f"mpiexec: {path} ({flavour} {version})", f"mpi4py loads: {mpi4py_library()}"]


def mpiexec_path() -> str | None:
    """$SYNCSGD_MPIEXEC, else the mpiexec next to this Python (the mpich wheel's), else PATH's."""
    chosen = os.environ.get("SYNCSGD_MPIEXEC")
    if chosen:
        return shutil.which(chosen)
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


@functools.cache
def mpiexec_flavour(path: str) -> tuple[str, str]:
    """("MPICH"|"Open MPI", version) of the launcher at `path`, from its --version."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    text = done.stdout + done.stderr
    if re.search(r"open mpi|openrte|open-mpi", text, re.IGNORECASE):
        found = re.search(r"\(Open(?: MPI|RTE)\) ([\d.]+)", text)
        return "Open MPI", found.group(1) if found else "?"
    found = re.search(r"Version:\s+([\d.]+)", text)
    return "MPICH", found.group(1) if found else "?"


@functools.cache
def mpi4py_library() -> str:
    """The first line of MPI.Get_library_version() in a fresh process of this Python."""
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    if done.returncode != 0:
        return "none (mpi4py does not load: " + done.stderr.strip()[-200:] + ")"
    return done.stdout.replace("\0", "").strip()


@functools.cache
def mpiexec_flags(path: str) -> tuple[str, ...]:
    """What this launcher needs to run P ranks on a small machine, as root if we are root."""
    if mpiexec_flavour(path)[0] != "Open MPI":
        return ()  # MPICH's hydra runs any number of ranks anywhere as anyone
    # Open MPI refuses more ranks than cores without --oversubscribe, and root without consent.
    flags = ("--oversubscribe",)
    return (*flags, "--allow-run-as-root") if os.geteuid() == 0 else flags


def mpiexec_command(ranks: int) -> list[str]:
    """`mpiexec [flags] -n ranks`, for the launcher the MPI tests drive."""
    path = str(mpiexec_path())
    return [path, *mpiexec_flags(path), "-n", str(ranks)]


_skip_without_mpiexec = pytest.mark.skipif(
    mpiexec_path() is None, reason="needs mpiexec (pip install 'syncsgd[mpi]')"
)


def requires_mpi(test: Callable) -> Callable:
    """Mark a test that runs a real mpiexec: marked `mpi`, skipped when there is none."""
    return pytest.mark.mpi(_skip_without_mpiexec(test))


def run_in_process(arguments: list[str], cwd: object = ".") -> subprocess.CompletedProcess:
    """`syncsgd arguments` run by the console script's main in this process, in `cwd`: its exit
    status and output as a fresh process gives them, without a fresh interpreter's start-up and
    its loading of the compiled kernels (a second or more a command)."""
    from syncsgd.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(str(cwd))
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main(arguments)
            except SystemExit as done:  # argparse's; a text is printed with status 1, as sys.exit
                status = done.code if isinstance(done.code, int) or done.code is None else 1
                if isinstance(done.code, str):
                    print(done.code, file=sys.stderr)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(
        ["syncsgd", *arguments], status or 0, stdout.getvalue(), stderr.getvalue()
    )


def run_mpiexec(ranks: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `mpiexec -n ranks python args...`; a hang fails the test after `timeout` seconds."""
    path = str(mpiexec_path())
    flags = mpiexec_flags(path)
    if flags:  # Open MPI forwards output in chunks that split lines: tag them to reassemble
        flags = (*flags, "--tag-output")
    command = [path, *flags, "-n", str(ranks), sys.executable, *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s (deadlock?): {exc}")
    done.stdout, done.stderr = _untagged(done.stdout), _untagged(done.stderr)
    return done


def _untagged(text: str) -> str:
    """Each rank's output whole, rank after rank, from Open MPI's tagged chunks (a no-op else)."""
    pieces = re.split(_tag_pattern(), text)
    by_rank: dict[int, list[str]] = {}
    for rank, chunk in zip(pieces[1::2], pieces[2::2], strict=True):
        by_rank.setdefault(int(rank), []).append(chunk)
    return pieces[0] + "".join("".join(by_rank[rank]) for rank in sorted(by_rank))


def _tag_pattern() -> str:
    """What --tag-output puts before every chunk, even mid-line: `[1,0]<stdout>:` (5.x: `: `)."""
    major = mpiexec_flavour(str(mpiexec_path()))[1].split(".")[0]
    space = " " if major.isdigit() and int(major) >= 5 else ""
    return r"\[\d+,(\d+)\]<std(?:out|err)>:" + space
