"""syncsgd: synchronous data-parallel SGD with a hand-written ring allreduce."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncsgd.collectives import (
        ALGORITHMS,
        COLLECTIVES,
        TraceEvent,
        allgather,
        allreduce,
        allreducer,
        alltoall,
        broadcast,
        reduce,
        reduce_scatter,
        ring_allreduce,
    )
    from syncsgd.comm.threads import (
        CollectiveTimeout,
        CommClosed,
        DeadlockError,
        RankAborted,
        ThreadComm,
        run_threads,
    )
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.loop import TrainResult, train

__version__ = "0.1.0"

# Where each public name lives; imported on first use, so that `syncsgd` on the command line
# starts (and installs its signal handlers) before NumPy and Numba are loaded.
_HOMES = {
    "syncsgd.collectives": ("ALGORITHMS", "COLLECTIVES", "TraceEvent", "allgather", "allreduce",
                            "allreducer", "alltoall", "broadcast", "reduce", "reduce_scatter",
                            "ring_allreduce"),
    "syncsgd.comm.threads": ("CollectiveTimeout", "CommClosed", "DeadlockError", "RankAborted",
                             "ThreadComm", "run_threads"),
    "syncsgd.training.config": ("TrainConfig",),
    "syncsgd.training.loop": ("TrainResult", "train"),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "CollectiveTimeout",
    "CommClosed",
    "DeadlockError",
    "RankAborted",
    "ThreadComm",
    "TraceEvent",
    "TrainConfig",
    "TrainResult",
    "allgather",
    "allreduce",
    "allreducer",
    "alltoall",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "ring_allreduce",
    "run_threads",
    "train",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _HOME_OF:
        raise AttributeError(f"module 'syncsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME_OF])
