"""Choosing a backend and running a function on every rank: thread ranks or MPI's COMM_WORLD."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from syncsgd.comm.threads import (
    ANY_SOURCE,
    ANY_TAG,
    IN_PLACE,
    MAX,
    MIN,
    SUM,
    Status,
    ThreadComm,
    run_threads,
)
from syncsgd.comm.threads import (
    check_capacity as check_capacity,  # re-exported: callers that know their per-rank bytes
)

_CONSTANTS: dict[type, SimpleNamespace] = {}  # per communicator type: built once, then looked up


def constants(comm: Any) -> SimpleNamespace:
    """The constants (SUM, MAX, MIN, IN_PLACE, ANY_SOURCE, ANY_TAG, Status) that fit `comm`."""
    try:
        return _CONSTANTS[type(comm)]  # the collectives call this on every call: keep it cheap
    except KeyError:
        pass
    unwatched = getattr(comm, "unwatched", None)  # a watchdog.Watched: those of the comm within
    if unwatched is not None:
        return constants(unwatched)
    if isinstance(comm, ThreadComm):
        found = SimpleNamespace(
            SUM=SUM, MAX=MAX, MIN=MIN, IN_PLACE=IN_PLACE,
            ANY_SOURCE=ANY_SOURCE, ANY_TAG=ANY_TAG, Status=Status,
        )  # fmt: skip
    else:
        from mpi4py import MPI

        found = SimpleNamespace(
            SUM=MPI.SUM, MAX=MPI.MAX, MIN=MPI.MIN, IN_PLACE=MPI.IN_PLACE,
            ANY_SOURCE=MPI.ANY_SOURCE, ANY_TAG=MPI.ANY_TAG, Status=MPI.Status,
        )  # fmt: skip
    _CONSTANTS[type(comm)] = found
    return found


# -- choosing a backend --------------------------------------------------------------------------

# Environment variables that MPI launchers set in every process they start.
_LAUNCHER_VARIABLES = (
    "PMI_RANK",  # MPICH / Intel MPI (hydra)
    "PMI_SIZE",
    "PMIX_RANK",  # PMIx (Open MPI 5, srun --mpi=pmix)
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
    "SLURM_STEP_NUM_TASKS",  # srun
)


def launched_by_mpi() -> bool:
    """True when this process was started by an MPI launcher (mpiexec, mpirun, srun)."""
    return any(name in os.environ for name in _LAUNCHER_VARIABLES)


def resolve_backend(backend: str) -> str:
    """Turn `auto` into `mpi` under an MPI launcher and `threads` otherwise."""
    if backend not in ("auto", "threads", "mpi"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, threads or mpi)")
    if backend == "auto":
        return "mpi" if launched_by_mpi() else "threads"
    return backend


def mpi_world() -> Any:
    """`MPI.COMM_WORLD`, importing mpi4py only now; a clear error if it is not installed."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'syncsgd[mpi]'"
        ) from exc
    return MPI.COMM_WORLD


def launch(fn: Callable[..., Any], *args: Any, backend: str = "auto", ranks: int | None = None,
           **kwargs: Any) -> list[Any]:  # fmt: skip
    """Run `fn(comm, *args, **kwargs)` on every rank of the chosen backend.

    Threads: `ranks` thread ranks (default 1); returns every rank's result. MPI: this process is one
    rank of `MPI.COMM_WORLD`, and `ranks`, if given, must equal the world size; returns
    `[this rank's result]`. Thread ranks beyond what the machine holds are refused up front with
    a ValueError; a caller that knows its per-rank memory calls `check_capacity` first.
    """
    if resolve_backend(backend) == "threads":
        return run_threads(1 if ranks is None else ranks, fn, *args, **kwargs)  # checks capacity
    comm = mpi_world()
    if ranks is not None and ranks != comm.Get_size():
        raise ValueError(
            f"--ranks {ranks} disagrees with the MPI world size {comm.Get_size()}: "
            f"under mpiexec, leave --ranks out or make it equal to -n"
        )
    return [fn(comm, *args, **kwargs)]
