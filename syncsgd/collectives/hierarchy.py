"""The nodes of a communicator, for the two-level ("hierarchical") allreduce.

Under MPI a node is the ranks that share memory (`Split_type(COMM_TYPE_SHARED)`); on thread ranks,
all of them (one process); `ranks_per_node=R` instead groups ranks 0..R-1, R..2R-1, ... into nodes.
How the algorithm works and in what order it sums: docs/collectives.md.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from syncsgd.collectives.executor import Trace, execute
from syncsgd.collectives.schedules import SCHEDULES, Hierarchical, hierarchy_defect

_keyval: list[int] = []  # MPI's attribute key for the layout, made on first use


def blocks(size: int, ranks_per_node: int) -> tuple[tuple[int, ...], ...]:
    """Ranks 0..R-1, R..2R-1, ... as nodes of R ranks; ValueError if R does not divide `size`."""
    if ranks_per_node < 1 or size % ranks_per_node:
        raise ValueError(f"--ranks-per-node {ranks_per_node} does not divide the {size} ranks "
                         "into nodes of equal size")  # fmt: skip
    return tuple(tuple(range(first, first + ranks_per_node))
                 for first in range(0, size, ranks_per_node))  # fmt: skip


def shared_memory_nodes(comm: Any) -> tuple[tuple[int, ...], ...]:
    """The ranks of `comm` that share memory, node by node in the order of their lowest rank (a
    collective call under MPI; thread ranks share one process: one node)."""
    size = comm.Get_size()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not hasattr(comm, "Split_type"):  # thread ranks (maybe wrapped)
        return (tuple(range(size)),)
    shared = comm.Split_type(mpi.COMM_TYPE_SHARED)
    leader = np.array([comm.Get_rank()], np.int64)
    shared.Allreduce(mpi.IN_PLACE, leader, op=mpi.MIN)  # the node's lowest rank names it
    shared.Free()
    leaders = np.empty(size, np.int64)
    comm.Allgather(leader, leaders)
    return tuple(tuple(int(rank) for rank in np.flatnonzero(leaders == first))
                 for first in sorted(set(leaders.tolist())))  # fmt: skip


def hierarchy(comm: Any, ranks_per_node: int | None = None, inter: str = "ring") -> Hierarchical:
    """The two-level allreduce on `comm`'s nodes: its shared-memory split (a collective call
    under MPI), or nodes of `ranks_per_node` consecutive ranks. ValueError, on every rank, if
    the nodes differ in size."""
    if inter not in SCHEDULES:
        raise ValueError(f"no inter-node algorithm {inter!r} (choose {', '.join(SCHEDULES)})")
    size = comm.Get_size()
    if ranks_per_node is not None:
        return Hierarchical(blocks(size, ranks_per_node), inter)
    spec = Hierarchical(shared_memory_nodes(comm), inter)
    defect = hierarchy_defect(spec, size)
    if defect:
        raise ValueError(f"{defect} (MPI's shared-memory split); give --ranks-per-node to group "
                         "the ranks into nodes yourself")  # fmt: skip
    return spec


def set_hierarchy(
    comm: Any, ranks_per_node: int | None = None, inter: str = "ring"
) -> Hierarchical:
    """Find `comm`'s nodes (as `hierarchy`) and keep them on `comm` and its later `Dup`s: the
    layout `allreduce(..., "hierarchical")` uses there. A collective call."""
    spec = hierarchy(comm, ranks_per_node, inter)
    attributes = getattr(comm, "attributes", None)  # thread ranks' (through any wrapper)
    if attributes is not None:
        attributes["hierarchy"] = spec
    else:
        comm.Set_attr(_layout_key(), spec)
    return spec


def hierarchy_of(comm: Any) -> Hierarchical:
    """The layout kept on `comm` by `set_hierarchy`, or (found now, collectively, and kept) the
    shared-memory nodes with the ring between them."""
    attributes = getattr(comm, "attributes", None)
    spec = attributes.get("hierarchy") if attributes is not None else comm.Get_attr(_layout_key())
    if spec is None:
        spec = set_hierarchy(comm)
    return spec


def _layout_key() -> int:
    """MPI's attribute key under which a communicator keeps its layout (copied by Dup)."""
    if not _keyval:
        mpi = sys.modules["mpi4py.MPI"]
        _keyval.append(mpi.Comm.Create_keyval(copy_fn=lambda comm, key, value: value))
    return _keyval[0]


def hierarchical_allreduce(
    buf: np.ndarray, comm: Any, *, ranks_per_node: int | None = None, inter: str | None = None,
    trace: Trace | None = None,
) -> np.ndarray:  # fmt: skip
    """Sum `buf` over all ranks in place: ring reduce-scatter inside each node, `inter` (ring by
    default) among the ranks of the same local index on every node, ring allgather inside.

    Nodes: `comm`'s layout (`set_hierarchy`; by default MPI's shared-memory split, on thread
    ranks one node), or nodes of `ranks_per_node` consecutive ranks.
    """
    if ranks_per_node is None:
        spec = hierarchy_of(comm)
    else:
        spec = Hierarchical(blocks(comm.Get_size(), ranks_per_node))
    if inter is not None:  # a name the schedules do not know: ValueError on every rank
        spec = spec._replace(inter=inter)
    return execute(spec, buf, comm, trace)
