"""The ring allreduce's checks under a real `mpiexec -n P`, with timeouts so a deadlock fails."""

from __future__ import annotations

import os

import pytest
from conftest import requires_mpi, run_mpiexec
from mpi_ring_check import MISMATCHES

WORKER = os.path.join(os.path.dirname(__file__), "mpi_ring_check.py")

pytestmark = [requires_mpi, pytest.mark.timeout(180)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_ring_checks_pass_under_mpiexec(ranks):
    # P > 2 is oversubscribed on 2 cores (MPICH busy-polls), hence the generous timeout.
    done = run_mpiexec(ranks, [WORKER], timeout=30 + 10 * ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {ranks} ranks" in done.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatched_buffers_raise_on_every_rank_under_mpiexec(ranks):
    done = run_mpiexec(ranks, [WORKER, "--mismatch"], timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "ValueError" in line]
    seen = sorted((line.split(": ")[1], int(line.split()[1].rstrip(":"))) for line in lines)
    assert seen == sorted((name, rank) for name in MISMATCHES for rank in range(ranks))
    words = {"longer": "different length", "float32": "dtype float", "int64": "dtype",
             "strided": "C-contiguous", "read-only": "read-only"}  # fmt: skip
    for name, word in words.items():
        assert any(f": {name}: " in line and word in line for line in lines), (name, done.stdout)


def test_an_uncaught_mismatch_fails_the_mpi_job_cleanly():
    done = run_mpiexec(3, [WORKER, "--mismatch-uncaught"], timeout=60)
    assert done.returncode != 0
    assert "failed: ValueError('ring_allreduce: " in done.stderr and "differ" in done.stderr
    assert "returned although" not in done.stderr + done.stdout


def test_a_failing_rank_ends_the_mpi_job_instead_of_hanging():
    done = run_mpiexec(2, [WORKER, "--fail-on-rank", "1"], timeout=60)
    assert done.returncode != 0
    assert "rank 1 of 2 failed: AssertionError('failing on purpose')" in done.stderr
    assert "ok:" not in done.stdout
