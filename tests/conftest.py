"""Shared test settings: hypothesis profiles and helpers to run syncsgd under a real mpiexec."""

from __future__ import annotations

import os
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


def mpiexec_path() -> str | None:
    """The mpiexec next to this Python (the mpich wheel's), or the first one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


requires_mpi = pytest.mark.skipif(
    mpiexec_path() is None, reason="needs mpiexec (pip install 'syncsgd[mpi]')"
)


def run_mpiexec(ranks: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `mpiexec -n ranks python args...`; a hang fails the test after `timeout` seconds."""
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s (deadlock?): {exc}")
