"""The two-level allreduce's checks, on any communicator (thread ranks in test_hierarchical.py,
MPI.COMM_WORLD under `mpiexec -n P python tests/mpi_hierarchical_check.py`).

    (no option)            every layout of nodes that divides P, every inter-node algorithm: the
                           sums of mpi_collectives_check's cases, the float bits of the documented
                           order, and every rank's ValueError on buffers that differ
    --ranks-per-node R     R must not divide P: every rank prints `rank K: MESSAGE`
"""

from __future__ import annotations

import sys
from typing import Any

import mpi_worker
import numpy as np
from mpi_collectives_check import MISMATCHES, sum_cases

from syncsgd.collectives import allreduce, chunk_bounds, hierarchy_of, set_hierarchy

INTER = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")


def ring_order_sum(parts: list[np.ndarray], start: int) -> np.ndarray:
    """The ring's order for a chunk that starts at `start`: each next rank adds its own first."""
    total = parts[start].copy()
    for step in range(1, len(parts)):
        total = parts[(start + step) % len(parts)] + total
    return total


def two_level_reference(data: list[np.ndarray], nodes: int, per_node: int) -> np.ndarray:
    """The sum in the documented order, element by element: the ring's order over the local
    ranks of each node (from the intra-node chunk's number on), then the ring's over the nodes."""
    length, result = data[0].size, np.empty_like(data[0])
    bounds = chunk_bounds(length, per_node)
    for chunk in range(per_node):
        start, stop = bounds[chunk], bounds[chunk + 1]
        node_sums = [ring_order_sum([data[n * per_node + local][start:stop]
                                     for local in range(per_node)], chunk)
                     for n in range(nodes)]  # fmt: skip
        inner = chunk_bounds(stop - start, nodes)
        for part in range(nodes):
            piece = slice(inner[part], inner[part + 1])
            result[start + piece.start : start + piece.stop] = ring_order_sum(
                [node_sum[piece] for node_sum in node_sums], part)
    return result


def hierarchical(buf: np.ndarray, comm: Any) -> np.ndarray:
    """allreduce(buf, comm, "hierarchical") on the layout kept on comm."""
    return allreduce(buf, comm, "hierarchical")


def check_sums(comm: Any, per_node: int) -> None:
    """With nodes of `per_node` ranks and every inter-node algorithm: the standard sums, the float
    bits of the documented order (ring between nodes), and agreement on mismatched buffers."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for inter in INTER:
        set_hierarchy(comm, per_node, inter)
        label = f"hierarchical {size // per_node}x{per_node} {inter}"
        for index, (shape, dtype, integers) in enumerate(sum_cases(size)):
            mpi_worker.check_sum(comm, hierarchical, label, shape, dtype, integers, index)
        for make in MISMATCHES.values():
            if size > 1:
                mpi_worker.check_rejected_everywhere(comm, hierarchical, label, make)
    set_hierarchy(comm, per_node, "ring")
    for length in (1, size + 1, 1003):
        data = [mpi_worker.rank_data(r, (length,), "float64", False, length) for r in range(size)]
        result = hierarchical(data[rank].copy(), comm)
        expected = two_level_reference(data, size // per_node, per_node)
        assert result.tobytes() == expected.tobytes(), f"rank {rank}: {per_node} per node, {length}"


def check_layouts(comm: Any) -> None:
    """The shared-memory nodes (one, on one machine) give the ring's bits; then every R | P."""
    rank, size = comm.Get_rank(), comm.Get_size()
    nodes = hierarchy_of(comm).nodes
    data = mpi_worker.rank_data(rank, (101,), "float64", False, 5)
    if len(nodes) == 1:
        ring = allreduce(data.copy(), comm, "ring")
        assert hierarchical(data.copy(), comm).tobytes() == ring.tobytes(), f"rank {rank}"
    for per_node in range(1, size + 1):
        if size % per_node == 0:
            check_sums(comm, per_node)


def main(argv: list[str]) -> int:
    """Run the checks on MPI.COMM_WORLD; any failure aborts every rank with exit status 1."""

    def checks(comm: Any) -> None:
        if "--ranks-per-node" in argv:
            try:
                set_hierarchy(comm, int(argv[argv.index("--ranks-per-node") + 1]))
            except ValueError as exc:
                sys.stdout.write(f"rank {comm.Get_rank()}: {exc}\n")
                sys.stdout.flush()
                return
            raise AssertionError("set_hierarchy accepted nodes that do not divide the ranks")
        check_layouts(comm)

    return mpi_worker.run_on_world(checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
