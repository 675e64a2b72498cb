"""Allreduce algorithms as schedules run by one executor over point-to-point messages, and the
library's own; broadcast, reduce, allgather, reduce-scatter and alltoall by the same executor."""

from syncsgd.collectives.api import (
    ALGORITHMS,
    AUTO_LIBRARY_BELOW,
    INTER_ALGORITHMS,
    LATENCY_BYTES,
    SHORT_MESSAGE_BYTES,
    allreduce,
    allreducer,
    auto_choice,
    choose_algorithm,
)
from syncsgd.collectives.executor import (
    Trace,
    TraceEvent,
    buffer_defect,
    naive_allreduce,
    rabenseifner_allreduce,
    recursive_doubling_allreduce,
    ring_allreduce,
    tree_allreduce,
)
from syncsgd.collectives.hierarchy import (
    hierarchical_allreduce,
    hierarchy,
    hierarchy_of,
    set_hierarchy,
)
from syncsgd.collectives.parts import (
    COLLECTIVES,
    allgather,
    alltoall,
    broadcast,
    reduce,
    reduce_scatter,
)
from syncsgd.collectives.schedules import (
    COPY,
    Collective,
    CollectiveStep,
    Hierarchical,
    chunk_bounds,
    schedule,
)

__all__ = [
    "ALGORITHMS",
    "AUTO_LIBRARY_BELOW",
    "COLLECTIVES",
    "COPY",
    "INTER_ALGORITHMS",
    "LATENCY_BYTES",
    "SHORT_MESSAGE_BYTES",
    "Collective",
    "CollectiveStep",
    "Hierarchical",
    "Trace",
    "TraceEvent",
    "allgather",
    "allreduce",
    "allreducer",
    "alltoall",
    "auto_choice",
    "broadcast",
    "buffer_defect",
    "choose_algorithm",
    "chunk_bounds",
    "hierarchical_allreduce",
    "hierarchy",
    "hierarchy_of",
    "naive_allreduce",
    "rabenseifner_allreduce",
    "recursive_doubling_allreduce",
    "reduce",
    "reduce_scatter",
    "ring_allreduce",
    "schedule",
    "set_hierarchy",
    "tree_allreduce",
]
