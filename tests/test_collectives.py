"""The allreduce algorithms of syncsgd.collectives on thread ranks and under mpiexec."""

from __future__ import annotations

import os
import tracemalloc
from collections import Counter
from unittest import mock

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given
from hypothesis import strategies as st
from mpi_collectives_check import (
    HAND_WRITTEN,
    MISMATCHES,
    check_rejected_everywhere,
    check_sum,
    check_trace,
    folding,
)
from mpi_worker import DTYPES
from mpi_worker import check_sum as check_reduce
from strategies import world_and_shape

from syncsgd import RankAborted, run_threads
from syncsgd.collectives import algorithms as collectives
from syncsgd.collectives.algorithms import (
    ALGORITHMS,
    AUTO_LIBRARY_BELOW,
    LATENCY_BYTES,
    SHORT_MESSAGE_BYTES,
    allreduce,
    allreducer,
    auto_choice,
    choose_algorithm,
    schedule,
)
from syncsgd.comm.threads import ThreadComm

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling CI

WORKER = os.path.join(os.path.dirname(__file__), "mpi_collectives_check.py")


@given(
    algorithm=st.sampled_from(ALGORITHMS),
    case=world_and_shape(),
    dtype=st.sampled_from(DTYPES),
    integers=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_algorithm_sums_like_a_naive_sum(algorithm, case, dtype, integers, seed):
    size, shape = case
    results = run_threads(size, check_sum, algorithm, shape, dtype, integers, seed)
    # check_sum compared the bits across ranks with Bcast; compare them here independently too
    assert len({result.tobytes() for result in results}) == 1
    assert all(result.shape == shape for result in results)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", [2, 3, 6, 8])
def test_long_float_buffers_are_summed_alike_on_every_rank(algorithm, size):
    # Long enough that Rabenseifner's and the ring's chunks are ragged, float data: every rank must
    # still hold the same bits, and the sum must be close to a float64 reference.
    for dtype in ("float32", "float64"):
        results = run_threads(size, check_sum, algorithm, (10_007,), dtype, False, 3)
        assert len({result.tobytes() for result in results}) == 1


@given(
    algorithm=st.sampled_from(HAND_WRITTEN),
    size=st.integers(1, 12),
    length=st.integers(0, 40),
)
def test_trace_events_pair_up_across_ranks(algorithm, size, length):
    traces = run_threads(size, check_trace, algorithm, length)
    # What is sent in a (phase, step) is received in the same (phase, step) by some rank, with
    # the same range of elements: the multisets of sends and receives are equal.
    sent = Counter(
        (event.phase, event.step, event.send_range)
        for events in traces
        for event in events
        if event.send_chunk >= 0
    )
    received = Counter(
        (event.phase, event.step, event.recv_range)
        for events in traces
        for event in events
        if event.recv_chunk >= 0
    )
    assert sent == received
    if algorithm == "rabenseifner" and size > 1:
        # Each element is reduced at exactly one rank: the ranges kept at the end of the
        # reduce-scatter by the p' ranks that take part partition the buffer.
        owned = np.zeros(length, np.int64)
        for events in traces:
            halving = [event for event in events if event.phase == "reduce-scatter"]
            if halving:
                start, stop = halving[-1].recv_range
                owned[start:stop] += 1
        assert np.all(owned == 1)


class RecordingComm(ThreadComm):
    """A thread rank that records every point-to-point message it sends: (peer, bytes)."""

    def __init__(self, comm: ThreadComm) -> None:
        super().__init__(comm._world, comm.rank)  # the same rank of the same world
        self.sent: list[tuple[int, int]] = []
        self.received_from: list[int] = []

    def Send(self, buf, dest, tag=0):
        self.sent.append((dest, np.asarray(buf).nbytes))
        super().Send(buf, dest, tag)

    def Recv(self, buf, source=-1, tag=-1, status=None):
        self.received_from.append(source)
        super().Recv(buf, source, tag, status)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):
        self.sent.append((dest, np.asarray(sendbuf).nbytes))
        self.received_from.append(source)
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


def expected_traffic(algorithm: str, rank: int, size: int, nbytes: int) -> tuple[int, int, set]:
    """(messages sent, bytes sent, the peers allowed) of `rank`, from each algorithm's definition.

    The buffer's length is divisible by P and by p', so every chunk is the same size.
    """
    levels, folded, sits_out = folding(rank, size)
    pof2 = 1 << levels
    extra = size - pof2
    if algorithm == "ring":
        neighbours = {(rank - 1) % size, (rank + 1) % size}
        return 2 * (size - 1), 2 * (size - 1) * nbytes // size, neighbours
    if algorithm == "naive":
        sends = size - 1 if rank == 0 else 1
        return sends, sends * nbytes, set(range(1, size)) if rank == 0 else {0}
    if algorithm == "tree":
        children = {c for c in (2 * rank + 1, 2 * rank + 2) if c < size}
        family = children | ({(rank - 1) // 2} if rank else set())
        return len(family), len(family) * nbytes, family
    if sits_out:  # sends its buffer to rank + 1 and gets the result back from it
        return 1, nbytes, {rank + 1}
    newrank = rank // 2 if folded else rank - extra
    partners = {newrank ^ (1 << k) for k in range(levels)}
    peers = {2 * p + 1 if p < extra else p + extra for p in partners}
    peers |= {rank - 1} if folded else set()
    if algorithm == "recursive-doubling":
        return levels + folded, (levels + folded) * nbytes, peers
    assert algorithm == "rabenseifner"
    return 2 * levels + folded, 2 * (pof2 - 1) * nbytes // pof2 + folded * nbytes, peers


@pytest.mark.parametrize("algorithm", HAND_WRITTEN)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_messages_and_bytes_follow_the_cost_model(algorithm, size):
    length = 27720  # divisible by 1..12: equal chunks, so the byte counts are exact
    nbytes = 8 * length

    def traffic(comm):
        recording = RecordingComm(comm)
        buf = np.full(length, comm.rank + 1, np.int64)
        allreduce(buf, recording, algorithm)
        assert np.all(buf == size * (size + 1) // 2)
        return recording.sent, recording.received_from

    for rank, (sent, received_from) in enumerate(run_threads(size, traffic)):
        messages, total, peers = expected_traffic(algorithm, rank, size, nbytes)
        assert len(sent) == messages, (rank, sent)
        assert sum(count for _, count in sent) == total, (rank, sent)
        assert {peer for peer, _ in sent} | set(received_from) <= peers, (rank, sent)


def test_recursive_doubling_partners_are_mpichs():
    # P = 6: p' = 4, r = 2. Ranks 0 and 2 fold into 1 and 3; ranks 1, 3, 4, 5 are 0..3 of p'.
    # Exchange k pairs those whose new numbers differ in bit k (MPICH's newdst = newrank ^ mask).
    partners = {
        rank: [step.send_to for step in schedule("recursive-doubling", 12, 6, rank)]
        for rank in range(6)
    }
    assert partners == {
        0: [1, -1],  # fold into 1, unfold: receive only
        1: [-1, 3, 4, 0],
        2: [3, -1],
        3: [-1, 1, 5, 2],
        4: [5, 1],
        5: [4, 3],
    }


def test_rabenseifner_halves_then_doubles_like_mpich():
    # P = 4, 8 elements, chunks of 2. Rank 0 keeps chunk 0: sends chunks 2-3 to rank 1, then
    # chunk 1 to rank 2; the allgather then receives chunk 1 from rank 2 and chunks 2-3 from 1.
    steps = schedule("rabenseifner", 8, 4, 0)
    assert [(s.phase, s.send_to, s.send, s.recv) for s in steps] == [
        ("reduce-scatter", 1, slice(4, 8), slice(0, 4)),
        ("reduce-scatter", 2, slice(2, 4), slice(0, 2)),
        ("allgather", 2, slice(0, 2), slice(2, 4)),
        ("allgather", 1, slice(0, 4), slice(4, 8)),
    ]
    # Rank 3 = 0b11 keeps the upper half, then its upper half again: chunk 3.
    assert schedule("rabenseifner", 8, 4, 3)[1].recv == slice(6, 8)


@pytest.mark.parametrize("algorithm", HAND_WRITTEN)
def test_schedule_is_what_the_trace_reports(algorithm):
    size, length = 6, 23

    def both(comm):
        events = []
        allreduce(np.ones(length), comm, algorithm, trace=events.append)
        return events, schedule(algorithm, length, size, comm.rank)

    for events, steps in run_threads(size, both):
        assert [(e.phase, e.step, e.send_chunk, e.recv_chunk) for e in events] == [
            (s.phase, s.step, s.send_chunk, s.recv_chunk) for s in steps
        ]
        assert [(e.send_range, e.recv_range) for e in events] == [
            ((s.send.start, s.send.stop), (s.recv.start, s.recv.stop)) for s in steps
        ]


def test_schedule_rejects_what_it_cannot_schedule():
    with pytest.raises(ValueError, match="no schedule for allreduce algorithm 'mpi'"):
        schedule("mpi", 10, 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a communicator of size 2"):
        schedule("tree", 10, 2, 2)


@pytest.mark.parametrize(
    "nbytes, count, size, expected",
    [
        (8, 1, 2, "recursive-doubling"),
        (SHORT_MESSAGE_BYTES, SHORT_MESSAGE_BYTES // 8, 8, "recursive-doubling"),
        (SHORT_MESSAGE_BYTES + 8, SHORT_MESSAGE_BYTES // 8 + 1, 8, "rabenseifner"),
        (1 << 20, 1 << 17, 2, "rabenseifner"),
        (1 << 20, 1 << 17, 1024, "rabenseifner"),
        (1 << 20, 4, 8, "recursive-doubling"),  # fewer elements than p' = 8
        (1 << 20, 1 << 17, 3, "ring"),  # P = 3: the ring sends no more messages than the fold
        (4096, 512, 6, "rabenseifner"),  # 4 more messages than Rabenseifner outweigh 8 KB saved
        (16 << 20, 2 << 20, 6, "ring"),
        (1 << 20, 1 << 17, 1000, "rabenseifner"),  # 1978 more messages: ring only from ~65 MB
        (1 << 30, 1 << 27, 1000, "ring"),
    ],
)
def test_auto_follows_mpich_with_the_ring_for_long_messages_on_other_p(
    nbytes, count, size, expected
):
    assert choose_algorithm(nbytes, count, size) == expected
    assert LATENCY_BYTES == 64 * 1024  # the cases above assume it


def test_auto_hands_short_messages_to_the_library_and_long_ones_to_choose_algorithm():
    assert auto_choice(8, 1, 2) == "mpi"
    assert auto_choice(AUTO_LIBRARY_BELOW - 8, AUTO_LIBRARY_BELOW // 8 - 1, 6) == "mpi"
    assert auto_choice(AUTO_LIBRARY_BELOW, AUTO_LIBRARY_BELOW // 8, 2) == "rabenseifner"
    assert auto_choice(AUTO_LIBRARY_BELOW, AUTO_LIBRARY_BELOW // 8, 3) == "ring"


def traced_phases(comm, reduce_, length):
    """Sum ones with `reduce_(buf, trace=...)`; the (phase, step, send range) of every event."""
    events = []
    buf = np.full(length, 1.0)
    reduce_(buf, trace=events.append)
    assert np.all(buf == comm.Get_size())
    return [(event.phase, event.step, event.send_range) for event in events]


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    "length, size, chosen",
    [(16, 4, "recursive-doubling"), (4096, 4, "rabenseifner"), (4096, 3, "ring")],
)
def test_auto_runs_the_algorithm_it_chooses(length, size, chosen, check):
    def phases(comm, algorithm):
        reduce_ = allreducer(comm, algorithm, check=check)
        return traced_phases(comm, reduce_, length)

    library = [[("allreduce", 0, (0, length))]] * size
    assert run_threads(size, phases, "auto") == library  # 8 * length bytes: short
    with mock.patch.object(collectives, "AUTO_LIBRARY_BELOW", 8 * length):
        assert auto_choice(8 * length, length, size) == chosen
        assert run_threads(size, phases, "auto") == run_threads(size, phases, chosen)


@given(
    case=world_and_shape(),
    dtype=st.sampled_from(DTYPES),
    integers=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    cut=st.sampled_from([0, 16, 1 << 40]),  # all to the hand-written side, split, all library
)
def test_unchecked_auto_sums_like_a_naive_sum_on_either_side_of_its_cut(
    case, dtype, integers, seed, cut
):
    size, shape = case

    def check(comm):
        reduce_ = allreducer(comm, "auto", check=False)
        return check_reduce(comm, lambda buf, _: reduce_(buf), "auto", shape, dtype, integers, seed)

    with mock.patch.object(collectives, "AUTO_LIBRARY_BELOW", cut):
        results = run_threads(size, check)
    assert len({result.tobytes() for result in results}) == 1


@pytest.mark.parametrize("algorithm", ["mpi", "auto"])
def test_check_false_skips_the_agreement_round(algorithm, monkeypatch):
    calls = []
    library_sum = ThreadComm.Allreduce

    def counted(self, *args, **kwargs):
        calls.append(self.Get_rank())
        library_sum(self, *args, **kwargs)

    monkeypatch.setattr(ThreadComm, "Allreduce", counted)
    def reduce_ones(comm, check):
        return allreduce(np.ones(5), comm, algorithm, check=check)

    for check, collectives_per_rank in ((True, 2), (False, 1)):
        calls.clear()
        run_threads(3, reduce_ones, check)
        assert sorted(calls) == sorted(list(range(3)) * collectives_per_rank)


def test_allreducer_refuses_an_unknown_algorithm_at_once():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'butterfly'"):
        allreducer(ThreadComm.__new__(ThreadComm), "butterfly")


def test_mpi_is_the_communicators_own_allreduce_in_one_event():
    def traced(comm):
        events = []
        buf = np.arange(5, dtype=np.int64)
        allreduce(buf, comm, "mpi", trace=events.append)
        return buf, events

    for rank, (buf, events) in enumerate(run_threads(3, traced)):
        assert np.array_equal(buf, 3 * np.arange(5))
        assert [(e.phase, e.rank, e.send_range, e.nbytes) for e in events] == [
            ("allreduce", rank, (0, 5), 40)
        ]


@pytest.mark.parametrize("size", [1, 3])
def test_an_unknown_algorithm_is_refused_on_every_rank(size):
    def ask(comm):
        with pytest.raises(ValueError) as info:
            allreduce(np.ones(4), comm, "butterfly")
        return str(info.value)

    for message in run_threads(size, ask):
        assert "unknown allreduce algorithm 'butterfly'" in message
        assert all(name in message for name in ALGORITHMS)


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


BAD_BUFFERS = [
    (lambda: np.zeros((6, 2))[:, 0], "C-contiguous"),
    (lambda: np.zeros(6, np.int32), "dtype int32"),
    (lambda: [0.0] * 6, "NumPy array"),
    (lambda: read_only(np.zeros((2, 3))), "read-only"),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_a_bad_buffer_raises_on_every_rank(algorithm, size):
    for bad_buffer, words in BAD_BUFFERS:
        for everywhere in (False, True):
            bad_rank = size // 2

            def make_buffer(rank, size, bad_buffer=bad_buffer, everywhere=everywhere,
                            bad_rank=bad_rank):  # fmt: skip
                return bad_buffer() if everywhere or rank == bad_rank else np.zeros(6)

            messages = run_threads(size, check_rejected_everywhere, algorithm, make_buffer)
            assert words in messages[bad_rank], messages
            name = algorithm.replace("-", "_") + "_allreduce"
            expected_name = "allreduce" if algorithm in ("mpi", "auto") else name
            for rank, message in enumerate(messages):
                assert message.startswith(expected_name), message
                if everywhere:
                    assert words in message
                elif rank != bad_rank:
                    assert "differ" in message or "another rank" in message, message


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", [2, 3, 5, 6])
def test_buffers_that_differ_across_ranks_raise_on_every_rank(algorithm, size):
    for make_buffer in MISMATCHES:
        messages = run_threads(size, check_rejected_everywhere, algorithm, make_buffer)
        assert all(
            "differ" in message or "another rank" in message or "read-only" in message
            for message in messages
        ), messages
    # Different lengths somewhere in the middle, and every rank its own length.
    for make_buffer in (lambda rank, size: np.ones(3 + (rank == 1)), lambda r, s: np.ones(r)):
        messages = run_threads(size, check_rejected_everywhere, algorithm, make_buffer)
        assert all("differ" in message or "another rank" in message for message in messages)
    # The same number of elements in other shapes is a legal allreduce.
    sums = run_threads(
        size, lambda comm: allreduce(np.ones((2, 4) if comm.rank else (8, 1)), comm, algorithm)
    )
    assert all(np.array_equal(result.ravel(), np.full(8, size)) for result in sums)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ndarray_subclasses_are_reduced_in_their_shape(algorithm):
    def reduce_matrix(comm):
        matrix = np.asmatrix(np.arange(6.0).reshape(2, 3))  # ravel() of a matrix stays 2-D
        assert allreduce(matrix, comm, algorithm) is matrix
        return matrix

    for matrix in run_threads(3, reduce_matrix):
        assert isinstance(matrix, np.matrix)
        assert np.array_equal(np.asarray(matrix), 3 * np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("algorithm", HAND_WRITTEN[1:])
@pytest.mark.parametrize("size", [3, 4])
def test_repeated_calls_reuse_scratch_without_allocating(algorithm, size):
    length = 1 << 17  # float64: 1 MiB; every algorithm receives at least 1/8 of it into scratch

    def second_call_peak(comm):
        buf = np.ones(length)
        allreduce(buf, comm, algorithm)  # fills this rank's scratch cache and plan cache
        comm.Barrier()
        if comm.rank == 0:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
        comm.Barrier()
        allreduce(buf, comm, algorithm)
        comm.Barrier()
        extra = tracemalloc.get_traced_memory()[1] - before if comm.rank == 0 else 0
        return extra, buf[0]

    tracemalloc.start()
    try:
        results = run_threads(size, second_call_peak)
    finally:
        tracemalloc.stop()
    extra, first = results[0]
    assert first == size**2  # the second call summed the first call's sums
    assert extra < length // 4, f"{extra} bytes allocated by a call with a warm cache"


@pytest.mark.parametrize("algorithm", HAND_WRITTEN[1:])
def test_a_rank_that_raises_is_named_and_nobody_hangs(algorithm):
    bad_rank = 2

    def fail_in_the_middle(comm):
        calls = []

        def trace(event):
            calls.append(event)
            if comm.rank == bad_rank and len(calls) == 2:
                raise RuntimeError("trace callback failed")

        return allreduce(np.ones(100), comm, algorithm, trace=trace)

    with pytest.raises(RuntimeError, match="trace callback failed") as info:
        run_threads(5, fail_in_the_middle)
    assert not isinstance(info.value, RankAborted)
    assert f"raised on rank {bad_rank} of 5" in " ".join(info.value.__notes__)


# -- the same under a real mpiexec ----------------------------------------------------------------


@requires_mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_every_algorithm_passes_its_checks_under_mpiexec(ranks):
    # P > 2 is oversubscribed on 2 cores (MPICH busy-polls): P = 5 took 6 s here.
    done = run_mpiexec(ranks, [WORKER], timeout=30 + 10 * ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {ranks} ranks" in done.stdout


@requires_mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatched_buffers_raise_on_every_rank_under_mpiexec(ranks):
    done = run_mpiexec(ranks, [WORKER, "--mismatch"], timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "ValueError" in line]
    raised = Counter((line.split()[1].rstrip(":"), line.split()[2].rstrip(":")) for line in lines)
    for algorithm in ALGORITHMS:
        assert all(raised[str(rank), algorithm] == len(MISMATCHES) for rank in range(ranks)), raised
    assert any("different length" in line for line in lines), done.stdout
    assert any("dtypes float32 and float64" in line for line in lines), done.stdout
