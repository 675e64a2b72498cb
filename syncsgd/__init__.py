"""syncsgd: synchronous data-parallel SGD with a hand-written ring allreduce."""

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
