"""The two-level allreduce: sums, sum order, agreement, steps and nodes, on thread ranks and under
mpiexec (mpi_hierarchical_check.py)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given
from hypothesis import strategies as st
from mpi_hierarchical_check import INTER, check_layouts, check_sums, two_level_reference

from syncsgd import TrainConfig, run_threads, train
from syncsgd.cli import main
from syncsgd.collectives import (
    Hierarchical,
    allreduce,
    allreducer,
    hierarchical_allreduce,
    hierarchy,
    schedule,
    set_hierarchy,
)
from syncsgd.collectives.schedules import SCHEDULES

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(os.path.dirname(__file__), "mpi_hierarchical_check.py")


@st.composite
def nodes_and_length(draw: st.DrawFn) -> tuple[int, int, int]:
    """(nodes, ranks per node, buffer length): P = N x R up to 16, nodes of 1 to 8 ranks."""
    per_node = draw(st.integers(1, 8))
    nodes = draw(st.integers(1, 16 // per_node))
    length = draw(st.integers(0, 3 * nodes * per_node + 5))
    return nodes, per_node, length


def rank_data(rank: int, length: int, dtype: str, seed: int) -> np.ndarray:
    """Rank `rank`'s buffer: small integers as int64 (exact sums), else random floats."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "int64":
        return rng.integers(-1000, 1000, length)
    return rng.uniform(-1.0, 1.0, length).astype(dtype)


@given(case=nodes_and_length(), dtype=st.sampled_from(["int64", "float64", "float32"]),
       inter=st.sampled_from(INTER), seed=st.integers(0, 2**31))  # fmt: skip
def test_sums_on_any_nodes_with_any_inter_node_algorithm(case, dtype, inter, seed):
    nodes, per_node, length = case

    def reduce(comm):
        buf = rank_data(comm.rank, length, dtype, seed)
        return hierarchical_allreduce(buf, comm, ranks_per_node=per_node, inter=inter)

    results = run_threads(nodes * per_node, reduce)
    assert len({result.tobytes() for result in results}) == 1  # the same bits on every rank
    data = [rank_data(rank, length, dtype, seed) for rank in range(nodes * per_node)]
    if dtype == "int64":
        assert np.array_equal(results[0], np.sum(data, axis=0))
    else:
        tolerance = 1e-12 if dtype == "float64" else 1e-5
        np.testing.assert_allclose(results[0], np.sum(np.array(data, np.float64), axis=0),
                                   rtol=0, atol=tolerance * nodes * per_node)  # fmt: skip
    if inter == "ring":  # float: bitwise the documented order
        assert results[0].tobytes() == two_level_reference(data, nodes, per_node).tobytes()


@pytest.mark.parametrize("size", [1, 2, 5])
def test_one_node_is_the_ring_bit_for_bit(size):
    def both(comm):
        buf = rank_data(comm.rank, 37, "float64", 7)
        flat = allreduce(buf.copy(), comm, "ring")
        return flat.tobytes() == allreduce(buf, comm, "hierarchical").tobytes()

    assert all(run_threads(size, both))
    assert schedule(Hierarchical((tuple(range(6)),)), 23, 6, 2) == schedule("ring", 23, 6, 2)


def test_one_rank_per_node_is_the_inter_node_algorithm():
    for inter in INTER:
        steps = schedule(Hierarchical(tuple((r,) for r in range(6)), inter), 23, 6, 4)
        flat = schedule(inter, 23, 6, 4)
        assert [s._replace(phase="") for s in steps] == [s._replace(phase="") for s in flat]
        assert all(s.phase.startswith("inter-node ") for s in steps)


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_only_one_rank_per_node_and_chunk_crosses_between_nodes(nodes, per_node):
    # Within a node: the ring's 2(R-1) messages of n/R; between nodes: the inter-node ring's
    # 2(N-1) messages of n/(RN), from the rank to the same local index on the neighbour nodes.
    size, length = nodes * per_node, 55440  # divisible by 1..12 and 16
    spec = Hierarchical(tuple(tuple(range(n * per_node, (n + 1) * per_node))
                              for n in range(nodes)))  # fmt: skip
    for rank in range(size):
        node, local = divmod(rank, per_node)
        steps = schedule(spec, length, size, rank)
        inside = [s for s in steps if s.send_to // per_node == node]
        across = [s for s in steps if s.send_to // per_node != node]
        assert len(inside) == 2 * (per_node - 1) and len(across) == 2 * (nodes - 1)
        assert {s.send_to % per_node for s in across} <= {local}
        assert sum(s.send.stop - s.send.start for s in inside) == 2 * (per_node - 1) * (
            length // per_node)
        assert sum(s.send.stop - s.send.start for s in across) == 2 * (nodes - 1) * (
            length // size)


def test_trace_events_pair_up_across_ranks():
    def traced(comm):
        events = []
        hierarchical_allreduce(np.ones(29), comm, ranks_per_node=3, inter="rabenseifner",
                               trace=events.append)  # fmt: skip
        return events

    every = [event for events in run_threads(9, traced) for event in events]
    sent = Counter((e.phase, e.step, e.send_range) for e in every if e.send_chunk >= 0)
    received = Counter((e.phase, e.step, e.recv_range) for e in every if e.recv_chunk >= 0)
    assert sent == received
    assert {e.phase for e in every} == {"reduce-scatter", "allgather", "inter-node fold",
                                        "inter-node reduce-scatter", "inter-node allgather",
                                        "inter-node unfold"}  # fmt: skip


@pytest.mark.parametrize(("size", "per_node"), [(4, 2), (6, 3), (8, 2), (6, 1)])
def test_buffers_that_differ_raise_on_every_rank(size, per_node):
    for bad in range(size):
        for inter in INTER:

            def reduce(comm, bad=bad, inter=inter):
                buf = np.ones(6 if comm.rank == bad else 5)
                with pytest.raises(ValueError, match="^hierarchical_allreduce: ") as info:
                    hierarchical_allreduce(buf, comm, ranks_per_node=per_node, inter=inter)
                return str(info.value)

            messages = run_threads(size, reduce)
            assert "\n" not in "".join(messages)


def test_bad_nodes_are_one_line_on_every_rank():
    def refused(comm, *args):
        with pytest.raises(ValueError) as info:
            set_hierarchy(comm, *args)
        return str(info.value)

    assert set(run_threads(6, refused, 4)) == {
        "--ranks-per-node 4 does not divide the 6 ranks into nodes of equal size"}
    assert "no inter-node algorithm 'mpi'" in run_threads(4, refused, 2, "mpi")[0]
    uneven = Hierarchical(((0, 1), (2, 3, 4)))
    with pytest.raises(ValueError, match="the nodes hold 2, 3 ranks"):
        schedule(uneven, 10, 5, 0)


def test_the_layout_kept_on_the_communicator_serves_allreduce_and_its_duplicates():
    def layouts(comm):
        kept = set_hierarchy(comm, 2, "tree")
        buf = np.full(11, float(comm.rank))
        allreducer(comm, "hierarchical")(buf)
        twin = comm.Dup()
        allreduce(buf, twin, "hierarchical")
        return kept, hierarchy(comm, 2, "tree"), buf[0]

    for kept, again, first in run_threads(4, layouts):
        assert kept == again == Hierarchical(((0, 1), (2, 3)), "tree")
        assert first == 4 * 6.0


def test_the_checks_shared_with_mpi_pass_on_threads():
    run_threads(6, check_layouts)
    run_threads(4, check_sums, 2)


def test_every_flat_algorithm_can_run_between_nodes():
    assert set(INTER) == set(SCHEDULES)


@requires_mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [4, pytest.param(6, marks=pytest.mark.mpi_once)])
def test_the_two_level_allreduce_under_mpiexec(ranks):
    done = run_mpiexec(ranks, [WORKER], timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {ranks} ranks" in done.stdout


@requires_mpi
@pytest.mark.timeout(120)
def test_nodes_that_do_not_divide_the_ranks_fail_on_every_rank_under_mpiexec():
    done = run_mpiexec(3, [WORKER, "--ranks-per-node", "2"], timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "does not divide" in line]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1", "rank 2"]


# -- on the command line ---------------------------------------------------------------------------


def test_train_with_two_levels_is_bitwise_the_ring_in_exact_mode():
    quick = {"exact": True, "steps": 3, "features": 8, "hidden": (6,), "samples": 64,
             "batch_size": 16}  # fmt: skip
    ring = train(ranks=4, algorithm="ring", **quick).params
    for per_node, inter in ((2, "ring"), (1, "tree"), (4, "ring"), (2, "rabenseifner")):
        mine = train(ranks=4, algorithm="hierarchical", ranks_per_node=per_node,
                     inter_algorithm=inter, **quick).params  # fmt: skip
        assert all(a.tobytes() == b.tobytes() for a, b in zip(mine, ring, strict=True))


def test_train_refuses_nodes_that_do_not_divide_the_ranks(capsys):
    assert main(["train", "--ranks", "3", "--algorithm", "hierarchical", "--ranks-per-node",
                 "2", "--steps", "1"]) != 0  # fmt: skip
    assert "--ranks-per-node 2 does not divide the 3 ranks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shape --algorithm hierarchical"):
        TrainConfig(ranks_per_node=2)


def test_bench_names_the_nodes(capsys):
    argv = ["bench", "allreduce", "--ranks", "4", "--max-bytes", "64", "--algorithms",
            "ring,hierarchical", "--ranks-per-node", "2", "--inter-algorithm", "tree",
            "--batches", "2", "--batch-seconds", "0.001", "--warmup", "1", "--max-iters", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# hierarchical: 2 node(s) x 2 rank(s) (--ranks-per-node), tree between the nodes" in out
    assert sum(" hierarchical " in line for line in out.splitlines()) == 4  # 8 .. 64 B


def test_ring_demo_shows_the_three_phases(capsys):
    argv = ["ring-demo", "--ranks", "6", "--length", "12", "--algorithm", "hierarchical",
            "--ranks-per-node", "3", "--color", "never"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 3 ranks, ring between the nodes" in out
    assert "round 3 of 6: inter-node reduce-scatter" in out
    assert "equal to the NumPy sum on every rank" in out
    assert main(["ring-demo", "--ranks", "4", "--ranks-per-node", "2"]) != 0
    assert "give it too" in capsys.readouterr().err
