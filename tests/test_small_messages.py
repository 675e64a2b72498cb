"""The short ring: a buffer of at most SMALL_MESSAGE_BYTES is passed round whole and added up on
every rank, in the ring's order; the bits are the stepping ring's, and ranks on the two paths
never hang each other. The cut is P = 2; `wider` lets up to 8 ranks gather, as the code allows,
to test the P-1 gather steps and the adds of more ranks."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import run_threads
from syncsgd.collectives import ring_allreduce, small
from syncsgd.collectives.executor import execute, sent_bytes
from syncsgd.collectives.schedules import SCHEDULES
from syncsgd.collectives.small import (
    SMALL_MESSAGE_BYTES,
    SMALL_MESSAGE_RANKS,
    gathers,
    sum_expressions,
)
from syncsgd.comm.threads import ThreadComm

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling CI
WIDER = 8  # ranks the tests let gather


def wider():
    """Let up to WIDER ranks gather (the plans are per thread: run_threads' ranks start afresh)."""
    return mock.patch.object(small, "SMALL_MESSAGE_RANKS", WIDER)


def spread_values(rank: int, length: int, dtype: str) -> np.ndarray:
    """Values whose sum depends on the order of the adds (floats of many magnitudes)."""
    rng = np.random.default_rng(1000 + rank)
    if dtype == "int64":
        return rng.integers(-(1 << 40), 1 << 40, length)
    return (rng.standard_normal(length) * 10.0 ** rng.integers(-8, 9, length)).astype(dtype)


@given(size=st.integers(2, WIDER), data=st.data(),
       dtype=st.sampled_from(["float64", "float32", "int64"]))  # fmt: skip
def test_the_short_ring_gives_the_stepping_rings_bits(size, data, dtype):
    itemsize = np.dtype(dtype).itemsize
    length = data.draw(st.integers(0, SMALL_MESSAGE_BYTES // itemsize))
    with wider():
        assert gathers("ring", length * itemsize, size)
        results = run_threads(size, lambda comm: both_rings(comm, length, dtype))
    assert all(gathered == stepped == results[0][0] for gathered, stepped in results)


def both_rings(comm, length: int, dtype: str) -> tuple[bytes, bytes]:
    """The ring's sum gathered (untraced) and stepped (traced), as bytes."""
    gathered = spread_values(comm.rank, length, dtype)
    stepped = gathered.copy()
    ring_allreduce(gathered, comm)
    ring_allreduce(stepped, comm, trace=lambda event: None)  # traced: the ring's own steps
    return gathered.tobytes(), stepped.tobytes()


def evaluate(expression, inputs: list[np.ndarray], element: int):
    """An expression of `sum_expressions` on element `element` of each rank's input."""
    if isinstance(expression, tuple):
        first, second = expression
        return evaluate(first, inputs, element) + evaluate(second, inputs, element)
    return inputs[expression][element]


@pytest.mark.parametrize("algorithm", sorted(SCHEDULES))
@pytest.mark.parametrize("size", [2, 3, 5, 6])
def test_the_replayed_sums_are_each_schedules_own(algorithm, size):
    # The replay is generic: on every algorithm it must say what the executor's steps compute.
    length = 2 * size + 1
    inputs = [spread_values(rank, length, "float64") for rank in range(size)]

    def stepped(comm):
        buf = inputs[comm.rank].copy()
        execute(algorithm, buf, comm, trace=lambda event: None)
        return buf

    for rank, result in enumerate(run_threads(size, stepped)):
        expressions = sum_expressions(algorithm, length, size, rank)
        replayed = [evaluate(expressions[i], inputs, i) for i in range(length)]
        assert np.array(replayed).tobytes() == result.tobytes()


def test_every_element_is_summed_over_every_rank_once():
    def leaves(expression):
        if isinstance(expression, tuple):
            return leaves(expression[0]) + leaves(expression[1])
        return [expression]

    for size in range(2, 9):
        for expression in sum_expressions("ring", 11, size, 0):
            assert sorted(leaves(expression)) == list(range(size))


class RecordingComm(ThreadComm):
    """A thread rank that records the size of every message it sends."""

    def __init__(self, comm: ThreadComm) -> None:
        super().__init__(comm._world, comm.rank)
        self.sent: list[int] = []

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):
        self.sent.append(np.asarray(sendbuf).nbytes)
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_short_ring_passes_p_minus_1_buffers_and_sent_bytes_says_so(size):
    length = 9

    def traffic(comm):
        recording = RecordingComm(comm)
        ring_allreduce(np.ones(length), recording)
        return recording.sent

    with wider():
        sent_by_rank = run_threads(size, traffic)
        for rank, sent in enumerate(sent_by_rank):
            assert sent == [8 * length + 1] * (size - 1)  # each buffer, and a byte that marks it
            assert sum(sent) == sent_bytes("ring", length, 8, size, rank)
    # Without the wider cut, 3 ranks step through the ring: 2(P-1) messages.
    if size > SMALL_MESSAGE_RANKS:
        assert all(len(sent) == 2 * (size - 1) for sent in run_threads(size, traffic))


def test_the_cut():
    assert SMALL_MESSAGE_RANKS == 2  # more ranks would send (P-1)n, not the ring's 2(P-1)/P n
    assert gathers("ring", SMALL_MESSAGE_BYTES, 2)
    assert not gathers("ring", SMALL_MESSAGE_BYTES + 1, 2)
    assert not gathers("ring", 8, 3) and not gathers("ring", 8, 1)
    assert not gathers("recursive-doubling", 8, 2)


LONG = SMALL_MESSAGE_BYTES // 8 + 1  # float64 elements the ring steps through


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("lengths", [
    lambda rank: LONG if rank == 0 else 5,  # one rank steps, the others gather
    lambda rank: 5 if rank == 0 else LONG,  # one rank gathers, the others step
    lambda rank: LONG if rank % 2 else 5,  # every other rank
    lambda rank: 5 + 4096 * (rank == 1),  # the same tag signature (length mod 4096)
    lambda rank: 5 + rank % 2,  # both short
], ids=["one-long", "one-short", "alternate", "same-signature", "both-short"])  # fmt: skip
def test_ranks_whose_lengths_differ_all_raise_on_either_path(size, lengths):
    def run(comm):
        buf = np.ones(lengths(comm.rank))
        differ = "the ranks' buffers differ|the ranks' calls differ|a different or unusable"
        with pytest.raises(ValueError, match=differ):
            ring_allreduce(buf, comm)
        ring_allreduce(np.ones(3), comm)  # and the next call works: no message was left over
        return True

    with wider():
        assert all(run_threads(size, run))


def test_an_unusable_buffer_on_one_short_ring_rank_is_reported_everywhere():
    def run(comm):
        buf = np.ones(6)
        buf.flags.writeable = comm.rank != 1
        with pytest.raises(ValueError, match="read-only|unusable"):
            ring_allreduce(buf, comm)
        return True

    for size in (2, 4):
        with wider():
            assert all(run_threads(size, run))


SHORT_RING_UNDER_MPI = """
import numpy as np
from mpi4py import MPI
from syncsgd.collectives import ring_allreduce, small

small.SMALL_MESSAGE_RANKS = 8  # more ranks gather too: the gather's P-1 steps under MPI

world = MPI.COMM_WORLD
rank = world.Get_rank()
for comm in (world, world.Dup(), world, world.Split(0, world.Get_size() - 1 - rank)):
    for length in (0, 1, 7, 200, 257):  # 257 float64: longer than a short ring
        values = np.random.default_rng(rank).standard_normal(length) * 10.0 ** rank
        gathered, stepped = values.copy(), values.copy()
        for _ in range(3):  # the plan (and its persistent requests) made once, used again
            ring_allreduce(gathered, comm)
            gathered[...] = values
        ring_allreduce(gathered, comm)
        ring_allreduce(stepped, comm, trace=lambda event: None)
        assert gathered.tobytes() == stepped.tobytes(), (comm, length)
    if comm is not world:
        comm.Free()  # its plans' requests are freed at exit, before MPI finalizes
ok = np.zeros(world.Get_size(), np.int64)
ok[rank] = 1
world.Allreduce(MPI.IN_PLACE, ok)  # every rank got here
if rank == 0:
    print("ok", int(ok.sum()))
"""


@requires_mpi
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.mpi_once), 3])  # P = 3: odd
def test_a_short_ring_under_mpi_gives_the_rings_bits_on_every_communicator(ranks, tmp_path):
    script = tmp_path / "short.py"
    script.write_text(SHORT_RING_UNDER_MPI)
    done = run_mpiexec(ranks, [str(script)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", str(ranks)]
    assert "persistent request" not in done.stderr  # every request freed before MPI finalizes


def test_a_stalled_short_ring_times_out_naming_its_gather_step():
    import time

    from syncsgd.comm.threads import CollectiveTimeout
    from syncsgd.comm.watchdog import collective_timeout

    def stalled(comm):
        with collective_timeout(comm, 0.5):
            if comm.rank == 1:
                time.sleep(3)  # in no collective: rank 0 waits for it in the gather
            ring_allreduce(np.ones(4), comm)

    with pytest.raises(CollectiveTimeout, match=r"rank 0 in ring_allreduce \(gather step 0\), "
                                                r"waiting for rank 1"):  # fmt: skip
        run_threads(2, stalled)
