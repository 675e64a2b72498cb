"""Shared test settings: hypothesis profiles and helpers to run syncsgd under a real mpiexec."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

# deadline=None: the first call of a Numba kernel compiles it, which takes seconds. CI draws the
# same examples on every run (derandomize), so that a red CI names a change, not a lucky draw; the
# dev and thorough profiles draw afresh.
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
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


def mpiexec_path() -> str | None:
    """$SYNCSGD_MPIEXEC, else the mpiexec next to this Python (the mpich wheel's), else PATH's."""
    chosen = os.environ.get("SYNCSGD_MPIEXEC")
    if chosen:
        return shutil.which(chosen)
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


@functools.cache
def mpiexec_flags(path: str) -> tuple[str, ...]:
    """What this launcher needs to run P ranks on a small machine, as root if we are root."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    text = (done.stdout + done.stderr).lower()
    if not any(name in text for name in ("open mpi", "openrte", "open-mpi")):
        return ()  # MPICH's hydra runs any number of ranks anywhere as anyone
    # Open MPI refuses more ranks than cores without --oversubscribe, and root without consent.
    flags = ("--oversubscribe",)
    return (*flags, "--allow-run-as-root") if os.geteuid() == 0 else flags


requires_mpi = pytest.mark.skipif(
    mpiexec_path() is None, reason="needs mpiexec (pip install 'syncsgd[mpi]')"
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
    # --tag-output puts `[job,rank]<stdout>:` before every chunk it forwards, even mid-line.
    pieces = re.split(r"\[\d+,(\d+)\]<std(?:out|err)>:", text)
    by_rank: dict[int, list[str]] = {}
    for rank, chunk in zip(pieces[1::2], pieces[2::2], strict=True):
        by_rank.setdefault(int(rank), []).append(chunk)
    return pieces[0] + "".join("".join(by_rank[rank]) for rank in sorted(by_rank))
