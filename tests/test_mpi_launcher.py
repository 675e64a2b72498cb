"""Whichever MPI is installed: mpi4py loads the library of the mpiexec the tests drive, and that
library's name reaches bench's header and JSON clean (Open MPI's version string ends in a NUL).

`python -m pytest -m mpi` runs these and every other test that drives a real mpiexec; `.ci/run`
runs them once with the MPICH wheel and once more in a venv with the Open MPI wheel.
"""

from __future__ import annotations

import json

from conftest import mpi4py_library, mpiexec_flavour, mpiexec_path, requires_mpi, run_mpiexec

# Rank 0 prints every rank's MPI vendor: one line if the ranks form one world.
WHO = ("from mpi4py import MPI; w = MPI.COMM_WORLD; v = w.gather(MPI.get_vendor()[0]); "
       "w.rank or print(v)")


@requires_mpi
def test_mpi4py_loads_the_library_of_the_launcher():
    # A library that is not the launcher's sees no job: every rank a world of one.
    done = run_mpiexec(2, ["-c", WHO], timeout=60)
    assert done.returncode == 0, done.stderr
    vendor = mpiexec_flavour(str(mpiexec_path()))[0]
    assert done.stdout == f"{[vendor, vendor]}\n", done.stdout
    assert mpi4py_library().startswith(vendor), mpi4py_library()


@requires_mpi
def test_the_library_name_in_bench_output_has_no_nul_byte(tmp_path):
    report = tmp_path / "b.json"
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "bench", "allreduce", "--min-bytes", "1K",
                           "--max-bytes", "1K", "--batches", "1", "--warmup", "1",
                           "--json", str(report)], timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "\0" not in done.stdout and "\\u0000" not in report.read_text()
    baseline = json.loads(report.read_text())["baseline"]
    assert baseline == mpi4py_library() and f": {baseline}\n" in done.stdout
