"""Allreduce algorithms, hand-written over point-to-point messages, and the library's own."""

from syncsgd.collectives.algorithms import (
    ALGORITHMS,
    AUTO_LIBRARY_BELOW,
    COPY,
    allreduce,
    allreducer,
    auto_choice,
    choose_algorithm,
    schedule,
)
from syncsgd.collectives.ring import TraceEvent, chunk_bounds, ring_allreduce

__all__ = [
    "ALGORITHMS", "AUTO_LIBRARY_BELOW", "COPY", "TraceEvent", "allreduce", "allreducer",
    "auto_choice", "choose_algorithm", "chunk_bounds", "ring_allreduce", "schedule",
]
