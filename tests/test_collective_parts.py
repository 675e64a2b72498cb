"""broadcast, reduce, allgather, reduce_scatter, alltoall: closed-form results on thread ranks and
under mpiexec (there also against the MPI library's own), bad input refused on every rank."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_parts_check import (
    check_allgather,
    check_alltoall,
    check_broadcast,
    check_every_part,
    check_reduce,
    check_reduce_scatter,
)

import syncsgd
from syncsgd import run_threads
from syncsgd.apps.demo_core import schedule_rounds
from syncsgd.collectives import COLLECTIVES, Collective, allreduce, schedule

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(os.path.dirname(__file__), "mpi_parts_check.py")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7])
def test_every_collective_on_thread_ranks(size):
    run_threads(size, check_every_part, "int64")


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 9), st.integers(0, 40), st.data())
def test_any_size_root_and_length(size, length, data):
    root = data.draw(st.integers(0, size - 1))
    name = data.draw(st.sampled_from(sorted(COLLECTIVES)))
    algorithm = data.draw(st.sampled_from(COLLECTIVES[name]))
    block = length // size

    def one(comm):
        if name == "broadcast":
            check_broadcast(comm, algorithm, root, (length,), "float64", seed=length)
        elif name == "reduce":
            check_reduce(comm, algorithm, root, length, "float64")
        elif name == "allgather":
            check_allgather(comm, algorithm, block, "float64")
        elif name == "reduce-scatter":
            check_reduce_scatter(comm, algorithm, block, "float64")
        else:
            check_alltoall(comm, block, "float64")

    run_threads(size, one)


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_allreduce_is_reduce_scatter_then_allgather(size):
    def both(comm):
        data = np.random.default_rng(comm.Get_rank()).integers(-99, 99, 4 * size)
        whole = allreduce(data.copy(), comm)
        pairs = zip(COLLECTIVES["reduce-scatter"], COLLECTIVES["allgather"], strict=True)
        for first, then in pairs:
            part = syncsgd.reduce_scatter(data, comm, algorithm=first)
            assert np.array_equal(syncsgd.allgather(part, comm, algorithm=then), whole)

    run_threads(size, both)


def rounds(name: str, algorithm: str, size: int, root: int = 0) -> int:
    """How many rounds the schedules of every rank take together."""
    per_rank = schedule_rounds(
        [schedule(Collective(name, algorithm, root), 4 * size, size, r) for r in range(size)]
    )
    return max((numbers[-1] + 1 for numbers in per_rank if numbers), default=0)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 8, 9])
def test_rounds_are_the_textbook_counts(size):
    log = (size - 1).bit_length()  # ceil(log2 P)
    floor_log = size.bit_length() - 1
    folded = 2 * (size != 1 << floor_log)  # fold and unfold where P is not a power of two
    expected = {
        ("broadcast", "ring"): 2 * (size - 1),  # P blocks along P - 1 links
        ("broadcast", "binomial"): log,
        ("reduce", "ring"): 2 * (size - 1),
        ("reduce", "binomial"): log,
        ("allgather", "ring"): size - 1,
        ("allgather", "recursive-doubling"): floor_log + folded,
        ("reduce-scatter", "ring"): size - 1,
        ("reduce-scatter", "recursive-halving"): floor_log + folded,
        ("alltoall", "pairwise"): size - 1,
    }
    for (name, algorithm), count in expected.items():
        for root in {0, size - 1}:
            assert rounds(name, algorithm, size, root) == count, (name, algorithm, root)


def test_the_ring_talks_only_to_neighbours():
    size = 6
    for name, algorithms in COLLECTIVES.items():
        if "ring" not in algorithms:
            continue
        for rank in range(size):
            for step in schedule(Collective(name, "ring", 2), 30, size, rank):
                peers = {step.send_to, step.recv_from} - {-1}
                assert peers <= {(rank + 1) % size, (rank - 1) % size}, (name, step)


def rejected_everywhere(size, call):
    """The ValueError message every rank raised for `call(comm)`."""

    def one(comm):
        with pytest.raises(ValueError) as caught:
            call(comm)
        return str(caught.value)

    return run_threads(size, one)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda comm: syncsgd.broadcast(np.zeros(4), comm, comm.Get_rank()),
         "different roots: 0 on rank 0, 2 on another; every rank must pass the same root"),
        (lambda comm: syncsgd.reduce(np.zeros(4), comm, 3), "root 3 is not a rank"),
        (lambda comm: syncsgd.broadcast(np.zeros(4), comm, None), "not None"),  # not rank 0
        (lambda comm: syncsgd.broadcast(np.zeros(4), comm, 1.0), "integer from 0 to 2, not 1.0"),
        (lambda comm: syncsgd.reduce(np.zeros(4), comm, "1"), "integer from 0 to 2, not '1'"),
        (lambda comm: syncsgd.broadcast(np.zeros(4), comm, 10**30),
         f"root {10**30} is not a rank"),
        (lambda comm: syncsgd.reduce(np.zeros(4), comm, algorithm="tree"), "unknown algorithm"),
        (lambda comm: syncsgd.reduce_scatter(np.zeros(4), comm), "equal blocks"),
        (lambda comm: syncsgd.allgather(np.zeros(2), comm, np.zeros(5)), "recvbuf holds"),
        (lambda comm: syncsgd.allgather(np.zeros(comm.Get_rank() + 1), comm), "lengths from"),
        (lambda comm: syncsgd.reduce_scatter(np.zeros(3, np.int8), comm), "dtype int8"),
        (lambda comm: syncsgd.broadcast(np.zeros(3), comm, algorithm=
                                        ("ring", "binomial")[comm.Get_rank() % 2]),
         "different algorithms: ring on rank 0, binomial on another"),  # names, not positions
        (lambda comm: syncsgd.reduce(np.zeros(4), comm, algorithm=("ring", "tree")[comm.rank % 2]),
         "reduce: another rank passed an unusable buffer, algorithm or root (rank 0 has"),
    ],
)  # fmt: skip
def test_bad_input_raises_on_every_rank(call, words):
    messages = rejected_everywhere(3, call)
    assert any(words in message for message in messages), messages
    assert all("\n" not in message for message in messages)


def test_allreduces_of_two_algorithms_are_told_by_their_message_sizes():
    # The hand-written allreduces take no agreement round: the sizes of their messages differ.
    # (The ring's rank 0 may be left waiting for its second message: a deadlock on threads.)
    # 4 KiB: longer than a short ring's, which would send the whole buffer at once.
    def one(comm):
        with pytest.raises(Exception) as caught:
            syncsgd.allreduce(np.zeros(512), comm, ("ring", "tree")[comm.rank])
        return str(caught.value)

    tree = run_threads(2, one)[1]  # rank 1 sends 4096 bytes, then receives the ring's first 2048
    assert tree == ("tree_allreduce: the ranks' calls differ: rank 1 has float64 of length 512, "
                    "rank 0 has a different length or called another algorithm (it sent 2048 "
                    "bytes, not the 4096 bytes this rank's schedule expects); every rank must "
                    "call the same algorithm with the same length and dtype")  # fmt: skip


@requires_mpi
@pytest.mark.timeout(240)
# Under the second MPI library (mpi_once): P = 3, the odd P; P = 4 the ring in other tests.
@pytest.mark.parametrize("ranks", [3, pytest.param(4, marks=pytest.mark.mpi_once)])
def test_every_collective_matches_the_library_under_mpiexec(ranks):
    done = run_mpiexec(ranks, [WORKER], timeout=60 + 20 * ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {ranks} ranks" in done.stdout


def test_bench_collective_times_every_algorithm(tmp_path, capsys):
    import json

    from syncsgd.cli import main

    path = tmp_path / "parts.json"
    assert main(["bench", "collective", "--ranks", "3", "--min-bytes", "64", "--max-bytes", "64",
                 "--batches", "1", "--warmup", "1", "--max-iters", "2",
                 "--json", str(path)]) == 0  # fmt: skip
    rows = json.loads(path.read_text())["rows"]
    timed = {(row["collective"], row["algorithm"]) for row in rows}
    assert timed == {(name, a) for name, algorithms in COLLECTIVES.items() for a in algorithms}
    assert all(row["count"] == 6 and row["time_us"] > 0 for row in rows)  # 8 float64, cut to 3k
    assert "no library to compare with" in capsys.readouterr().out
