"""The allreduce contract, one mixin per part, run on every algorithm on thread ranks and under
mpiexec; then what is particular to each algorithm's schedule and to the library side."""

from __future__ import annotations

import os
import tracemalloc
from collections import Counter
from unittest import mock

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi_collectives_check import (
    HAND_WRITTEN,
    MISMATCHES,
    check_rejected_everywhere,
    check_sum,
    check_trace,
    folding,
    sum_cases,
)
from mpi_worker import DTYPES
from mpi_worker import check_sum as check_reduce

from syncsgd import RankAborted, run_threads
from syncsgd.collectives import (
    ALGORITHMS,
    AUTO_LIBRARY_BELOW,
    LATENCY_BYTES,
    SHORT_MESSAGE_BYTES,
    allreduce,
    allreducer,
    api,
    auto_choice,
    choose_algorithm,
    schedule,
)
from syncsgd.collectives.small import SMALL_MESSAGE_BYTES
from syncsgd.comm.threads import ThreadComm

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling CI

WORKER = os.path.join(os.path.dirname(__file__), "mpi_collectives_check.py")


@st.composite
def world_and_shape(draw: st.DrawFn) -> tuple[int, tuple[int, ...]]:
    """A number of thread ranks and a buffer shape, with lengths around multiples of P."""
    size = draw(st.integers(1, 12))
    length = st.integers(0, 3 * size + 2)  # 0, 1, < P, = P, not divisible by P, ...
    shape = draw(
        st.one_of(
            length.map(lambda n: (n,)),
            st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),  # multi-dim, 0-d
        )
    )
    return size, shape


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def function_name(algorithm: str) -> str:
    """The name an algorithm's errors carry: the function the user called."""
    return (
        "allreduce" if algorithm in ("mpi", "auto") else algorithm.replace("-", "_") + "_allreduce"
    )


# The contract's property tests run once per class: the same method from several classes is
# not a flaky test (ALGORITHM is a class constant).
per_class = settings(suppress_health_check=[HealthCheck.differing_executors, HealthCheck.too_slow])


# -- the contract, one mixin per part; ALGORITHM is set by the classes at the end of this part ----


class SumContract:
    """SUM in place of any shape and length on any P, alike on every rank."""

    ALGORITHM = "ring"

    @per_class
    @given(
        case=world_and_shape(),
        dtype=st.sampled_from(DTYPES),
        integers=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_sums_like_a_naive_sum(self, case, dtype, integers, seed):
        size, shape = case
        results = run_threads(size, check_sum, self.ALGORITHM, shape, dtype, integers, seed)
        # check_sum compared the bits across ranks with Bcast; compare them here independently too
        assert len({result.tobytes() for result in results}) == 1
        assert all(result.shape == shape for result in results)

    @pytest.mark.parametrize("size", [1, 2, 3, 5])
    def test_standard_cases(self, size):
        def every_case(comm):
            for index, (shape, dtype, integers) in enumerate(sum_cases(size)):
                check_sum(comm, self.ALGORITHM, shape, dtype, integers, index)

        run_threads(size, every_case)

    @pytest.mark.parametrize("size", [2, 3, 6, 8])
    def test_long_float_buffers_are_summed_alike_on_every_rank(self, size):
        # Ragged chunks for Rabenseifner and the ring, float data: every rank holds the same bits.
        for dtype in ("float32", "float64"):
            results = run_threads(size, check_sum, self.ALGORITHM, (10_007,), dtype, False, 3)
            assert len({result.tobytes() for result in results}) == 1

    @pytest.mark.parametrize("size", [2, 3, 5, 6])
    def test_nan_payloads_end_alike_on_every_rank(self, size):
        # Which NaN survives an add depends on the order of its operands: partners that both add
        # must add in one order.
        def payloads(comm):
            buf = np.full(5, np.nan)
            buf.view(np.uint64)[:] |= np.uint64(comm.rank + 1)
            return allreduce(buf, comm, self.ALGORITHM).tobytes()

        assert len(set(run_threads(size, payloads))) == 1

    def test_the_sum_of_the_ranks_is_the_closed_form(self):
        def ranks_summed(comm):
            return allreduce(np.full(9, comm.rank, np.int64), comm, self.ALGORITHM)

        for result in run_threads(7, ranks_summed):
            assert np.array_equal(result, np.full(9, sum(range(7))))

    @pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
    def test_ndarray_subclasses_are_reduced_in_place(self, tmp_path):
        def reduce_subclasses(comm):
            matrix = np.asmatrix(np.arange(6.0).reshape(2, 3) * (comm.rank + 1))  # 2-D on ravel
            path = tmp_path / f"rank{comm.rank}.bin"
            mapped = np.memmap(path, np.int64, "w+", shape=(7,))
            mapped[:] = np.arange(7) - comm.rank
            assert allreduce(matrix, comm, self.ALGORITHM) is matrix
            assert allreduce(mapped, comm, self.ALGORITHM) is mapped
            return matrix, np.asarray(mapped).copy()

        for matrix, mapped in run_threads(3, reduce_subclasses):
            assert isinstance(matrix, np.matrix)
            assert np.array_equal(np.asarray(matrix), np.arange(6.0).reshape(2, 3) * 6)
            assert np.array_equal(mapped, 3 * np.arange(7) - 3)

    def test_unaligned_buffers_are_reduced(self):
        def reduce_unaligned(comm):
            buf = np.frombuffer(bytearray(8 * 9 + 1), np.float64, count=9, offset=1)
            assert not buf.flags.aligned and buf.flags.c_contiguous and buf.flags.writeable
            buf[:] = np.arange(9) * (comm.rank + 1)
            return allreduce(buf, comm, self.ALGORITHM).copy()

        for result in run_threads(3, reduce_unaligned):
            assert np.array_equal(result, np.arange(9) * 6.0)


BAD_BUFFERS = [
    (lambda: np.zeros((6, 2))[:, 0], "C-contiguous"),
    (lambda: np.zeros(6)[::2], "C-contiguous"),
    (lambda: np.zeros(6).T.reshape(3, 2).T, "C-contiguous"),
    (lambda: np.zeros(6, np.int32), "dtype int32"),
    (lambda: np.zeros(6, np.complex128), "dtype complex128"),
    (lambda: np.zeros(6, np.float16), "dtype float16"),
    (lambda: np.array([1, "a"], dtype=object), "dtype object"),
    (lambda: [0.0] * 6, "NumPy array"),
    (lambda: read_only(np.zeros((2, 3))), "read-only"),
    (lambda: np.frombuffer(bytes(48)), "read-only"),
]


class AgreementContract:
    """A bad or mismatched buffer anywhere: the same kind of ValueError on every rank, no hang."""

    ALGORITHM = "ring"

    @pytest.mark.parametrize("size", [1, 2, 3, 6])
    def test_a_bad_buffer_raises_on_every_rank(self, size):
        bad_rank, name = size // 2, function_name(self.ALGORITHM)
        for (bad_buffer, words), everywhere in [(bad, e) for bad in BAD_BUFFERS for e in (0, 1)]:

            def make_buffer(rank, size, bad_buffer=bad_buffer, everywhere=everywhere):
                return bad_buffer() if everywhere or rank == bad_rank else np.zeros(6)

            messages = run_threads(size, check_rejected_everywhere, self.ALGORITHM, make_buffer)
            assert words in messages[bad_rank], messages
            for rank, message in enumerate(messages):
                assert message.startswith(name), message
                if everywhere:
                    assert words in message
                elif rank != bad_rank:
                    assert "differ" in message or "another rank" in message, message

    @pytest.mark.parametrize("size", [2, 3, 5, 6])
    def test_buffers_that_differ_across_ranks_raise_on_every_rank(self, size):
        differing = [
            *MISMATCHES.values(),
            lambda rank, size: np.ones(3 + (rank == 1)),  # one rank in the middle
            lambda rank, size: np.ones(3 + rank),  # every rank its own length
            lambda rank, size: np.ones(size - rank),
            lambda rank, size: np.ones(rank),
        ]
        for make_buffer in differing:
            messages = run_threads(size, check_rejected_everywhere, self.ALGORITHM, make_buffer)
            expected = ("differ", "another rank", "read-only", "C-contiguous")
            assert all(any(word in m for word in expected) for m in messages), messages
        for make_buffer, words in [
            (MISMATCHES["longer"], ("different length", "lengths from")),
            (MISMATCHES["float32"], ("dtype float32", "dtypes float32")),
            (MISMATCHES["int64"], ("dtype", "dtypes")),
        ]:
            messages = run_threads(size, check_rejected_everywhere, self.ALGORITHM, make_buffer)
            assert any(word in message for message in messages for word in words), messages

    @pytest.mark.parametrize("size", [2, 3])
    def test_the_same_length_in_another_shape_is_summed(self, size):
        def other_shapes(comm):
            return allreduce(np.ones((2, 4) if comm.rank else (8, 1)), comm, self.ALGORITHM)

        for result in run_threads(size, other_shapes):
            assert np.array_equal(result.ravel(), np.full(8, size))

    def test_lengths_that_differ_by_a_multiple_of_4096_are_caught_by_the_byte_counts(self):
        # Same tag signature (length mod 4096) on every rank: only the message sizes can tell.
        make_buffer = lambda rank, size: np.ones(9 + 8192 * rank)  # noqa: E731
        messages = run_threads(4, check_rejected_everywhere, self.ALGORITHM, make_buffer)
        assert all(
            "different length" in m or "another rank" in m or "lengths" in m for m in messages
        )

    @pytest.mark.parametrize("size", [2, 5])
    def test_a_rank_that_raises_is_named_and_nobody_hangs(self, size):
        bad_rank = size - 1

        def fail_in_the_middle(comm):
            def trace(event):
                if comm.rank == bad_rank:
                    raise RuntimeError("trace callback failed")

            return allreduce(np.ones(100), comm, self.ALGORITHM, trace=trace)

        with pytest.raises(RuntimeError, match="trace callback failed") as info:
            run_threads(size, fail_in_the_middle)
        assert not isinstance(info.value, RankAborted)
        assert f"raised on rank {bad_rank} of {size}" in " ".join(info.value.__notes__)

    def test_a_rank_that_fails_before_the_call_releases_the_others(self):
        def skip_on_rank_0(comm):
            if comm.rank == 0:
                raise KeyError("rank 0 never calls the allreduce")
            return allreduce(np.ones(10), comm, self.ALGORITHM)

        with pytest.raises(KeyError) as info:
            run_threads(3, skip_on_rank_0)
        assert "raised on rank 0" in " ".join(info.value.__notes__)


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


class ScheduleContract:
    """A hand-written algorithm takes its schedule's steps, traces them, and reuses its scratch."""

    ALGORITHM = "ring"

    @per_class
    @given(size=st.integers(1, 12), length=st.integers(0, 40))
    def test_trace_events_pair_up_across_ranks(self, size, length):
        traces = run_threads(size, check_trace, self.ALGORITHM, length)
        # What is sent in a (phase, step) is received in the same (phase, step) by some rank, as
        # the same chunk and range of elements: the multisets of sends and receives are equal.
        every = [event for events in traces for event in events]
        sent = Counter(
            (e.phase, e.step, e.send_chunk, e.send_range) for e in every if e.send_chunk >= 0
        )
        received = Counter(
            (e.phase, e.step, e.recv_chunk, e.recv_range) for e in every if e.recv_chunk >= 0
        )
        assert sent == received

    @pytest.mark.parametrize("size", [1, 2, 3, 5])
    def test_trace_checks(self, size):
        for length in sorted({0, 1, size - 1, size + 2, 37}):
            run_threads(size, check_trace, self.ALGORITHM, length)

    def test_schedule_is_what_the_trace_reports(self):
        size, length = 6, 23

        def both(comm):
            events = []
            allreduce(np.ones(length), comm, self.ALGORITHM, trace=events.append)
            return events, schedule(self.ALGORITHM, length, size, comm.rank)

        for events, steps in run_threads(size, both):
            assert [(e.phase, e.step, e.send_chunk, e.recv_chunk) for e in events] == [
                (s.phase, s.step, s.send_chunk, s.recv_chunk) for s in steps
            ]
            assert [(e.send_range, e.recv_range) for e in events] == [
                ((s.send.start, s.send.stop), (s.recv.start, s.recv.stop)) for s in steps
            ]

    def test_one_rank_takes_no_steps(self):
        assert schedule(self.ALGORITHM, 5, 1, 0) == ()

    def test_trace_does_not_change_the_result(self):
        def both(comm):
            plain = np.arange(23, dtype=np.float32) / (comm.rank + 3)
            traced = plain.copy()
            allreduce(plain, comm, self.ALGORITHM)
            allreduce(traced, comm, self.ALGORITHM, trace=lambda event: None)
            return plain.tobytes() == traced.tobytes()

        assert all(run_threads(5, both))

    @pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8, 12])
    def test_messages_and_bytes_follow_the_cost_model(self, size):
        length = 27720  # divisible by 1..12: equal chunks, so the byte counts are exact

        def traffic(comm):
            recording = RecordingComm(comm)
            buf = np.full(length, comm.rank + 1, np.int64)
            allreduce(buf, recording, self.ALGORITHM)
            assert np.all(buf == size * (size + 1) // 2)
            return recording.sent, recording.received_from

        for rank, (sent, received_from) in enumerate(run_threads(size, traffic)):
            messages, total, peers = expected_traffic(self.ALGORITHM, rank, size, 8 * length)
            assert len(sent) == messages, (rank, sent)
            assert sum(count for _, count in sent) == total, (rank, sent)
            assert {peer for peer, _ in sent} | set(received_from) <= peers, (rank, sent)

    @pytest.mark.parametrize("size", [2, 3, 4, 5])
    def test_repeated_calls_reuse_scratch_without_allocating(self, size):
        length = 1 << 18  # float64: 2 MiB; every algorithm receives at least 1/8 of it into scratch

        def second_call_peak(comm):
            buf = np.ones(length)
            allreduce(buf, comm, self.ALGORITHM)  # fills this rank's scratch and plan caches
            comm.Barrier()
            if comm.rank == 0:
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
            comm.Barrier()
            allreduce(buf, comm, self.ALGORITHM)
            comm.Barrier()
            extra = tracemalloc.get_traced_memory()[1] - before if comm.rank == 0 else 0
            return extra, buf[0]

        tracemalloc.start()
        try:
            extra, first = run_threads(size, second_call_peak)[0]
        finally:
            tracemalloc.stop()
        assert first == size**2  # the second call summed the first call's sums
        # Scratch allocated per step (or per call) would show up as at least one chunk.
        assert extra < length // 4, f"{extra} bytes allocated by a call with a warm cache"

    def test_many_sizes_in_one_thread_grow_and_evict_the_cached_plans(self):
        lengths = [*range(0, 80), 5000, 3, 70000, 2, 5000]  # more than the cache holds, up and down

        def sums(comm):
            for length in lengths:
                for dtype in ("float64", "int64"):
                    buf = np.arange(length, dtype=dtype) + comm.rank
                    allreduce(buf, comm, self.ALGORITHM)
                    expected = 3 * np.arange(length, dtype=dtype) + 3  # ranks 0 + 1 + 2
                    assert np.array_equal(buf, expected), (length, dtype)
            return True

        assert run_threads(3, sums) == [True] * 3


# -- the contract on every algorithm ------------------------------------------------------------


class TestRing(SumContract, AgreementContract, ScheduleContract):
    ALGORITHM = "ring"


class TestNaive(SumContract, AgreementContract, ScheduleContract):
    ALGORITHM = "naive"


class TestRecursiveDoubling(SumContract, AgreementContract, ScheduleContract):
    ALGORITHM = "recursive-doubling"


class TestRabenseifner(SumContract, AgreementContract, ScheduleContract):
    ALGORITHM = "rabenseifner"


class TestTree(SumContract, AgreementContract, ScheduleContract):
    ALGORITHM = "tree"


class TestHierarchical(SumContract, AgreementContract):
    # Thread ranks are one node: the ring inside it (other nodes: test_hierarchical.py).
    ALGORITHM = "hierarchical"


class TestLibrary(SumContract, AgreementContract):
    ALGORITHM = "mpi"


class TestAuto(SumContract, AgreementContract):
    ALGORITHM = "auto"


def test_every_algorithm_is_under_contract():
    tested = {
        cls.ALGORITHM for cls in SumContract.__subclasses__() if cls.__name__.startswith("Test")
    }
    scheduled = {c.ALGORITHM for c in ScheduleContract.__subclasses__()}
    assert tested == set(ALGORITHMS) and scheduled == set(HAND_WRITTEN)


# -- what is particular to one algorithm --------------------------------------------------------


class LateTrouble(ThreadComm):
    """Rank 0 flags every message from its `first`-th Sendrecv on: a problem seen late."""

    def __init__(self, comm: ThreadComm, first: int) -> None:
        super().__init__(comm._world, comm.rank)
        self.calls, self.first = 0, first

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):
        self.calls += 1
        if self.rank == 0 and self.calls >= self.first:
            sendtag |= 1  # the "something is wrong" bit
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


@pytest.mark.parametrize("size", [3, 4, 5])
def test_a_problem_the_ring_sees_in_a_later_step_still_reaches_every_rank(size):
    # Flagged from reduce-scatter step 1 on, the flag needs allgather steps to go round the ring.
    # (A buffer too long to gather: a short ring's problems are all seen in step 0.)
    def late(comm):
        make_buffer = lambda rank, size: np.ones(SMALL_MESSAGE_BYTES // 8 + 1)  # noqa: E731
        return check_rejected_everywhere(LateTrouble(comm, first=2), "ring", make_buffer)

    messages = run_threads(size, late)
    assert all("another rank passed a different or unusable buffer" in m for m in messages)


@given(size=st.integers(2, 12), length=st.integers(0, 40))
def test_rabenseifner_reduces_each_element_at_exactly_one_rank(size, length):
    traces = run_threads(size, check_trace, "rabenseifner", length)
    # The ranges kept at the end of the reduce-scatter by the p' ranks partition the buffer.
    owned = np.zeros(length, np.int64)
    for events in traces:
        halving = [event for event in events if event.phase == "reduce-scatter"]
        if halving:
            start, stop = halving[-1].recv_range
            owned[start:stop] += 1
    assert np.all(owned == 1)


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


def test_schedule_rejects_what_it_cannot_schedule():
    with pytest.raises(ValueError, match="no schedule for allreduce algorithm 'mpi'"):
        schedule("mpi", 10, 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a communicator of size 2"):
        schedule("tree", 10, 2, 2)


# -- the library side: "mpi", "auto", allreducer ------------------------------------------------


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
    with mock.patch.object(api, "AUTO_LIBRARY_BELOW", 8 * length):
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

    with mock.patch.object(api, "AUTO_LIBRARY_BELOW", cut):
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


# Buffers thread ranks share: each rank's array is made from its rank by one of these.
_SHARED = np.ones(12)
_RAW = bytearray(12 * 8)
SHARED_MEMORY = {
    "the same array": lambda rank: _SHARED,
    "overlapping views": lambda rank: _SHARED[2 * rank : 2 * rank + 6],
    "views of one bytearray": lambda rank: np.frombuffer(_RAW, np.float64)[rank : rank + 4],
    "through two memoryviews": lambda rank: np.frombuffer(memoryview(_RAW), np.float64)[:4],
}


@pytest.mark.parametrize("algorithm", HAND_WRITTEN)
@pytest.mark.parametrize("sharing", SHARED_MEMORY)
@pytest.mark.parametrize("size", [2, 3])
def test_buffers_that_share_memory_across_thread_ranks_raise_on_every_rank(
    algorithm, sharing, size
):
    # Summed in place into one array, the ranks would add each other's partial sums (all 4s
    # instead of 3s): refused before anything is added.
    def reduce(comm):
        buf = SHARED_MEMORY[sharing](comm.Get_rank())
        before = buf.copy()
        with pytest.raises(ValueError) as info:
            allreduce(buf, comm, algorithm)
        return str(info.value), np.array_equal(buf, before)

    for message, unchanged in run_threads(size, reduce):
        assert "array shares memory with rank" in message, message
        assert "give each its own array" in message
        assert unchanged


@pytest.mark.parametrize("algorithm", HAND_WRITTEN)
def test_disjoint_views_of_one_array_are_summed(algorithm):
    base = np.zeros(12)

    def reduce(comm):
        mine = base[4 * comm.Get_rank() : 4 * comm.Get_rank() + 4]
        mine[:] = comm.Get_rank() + 1
        return allreduce(mine, comm, algorithm).copy()

    for result in run_threads(3, reduce):
        assert np.array_equal(result, np.full(4, 6.0))


def test_shared_memory_is_refused_call_by_call():
    # A refused call leaves nothing behind: the same ranks then sum their own arrays.
    def reduce(comm):
        refused = 0
        for _ in range(20):
            try:
                allreduce(_SHARED, comm, "ring")
            except ValueError:
                refused += 1
            own = np.full(3, float(comm.Get_rank()))
            allreduce(own, comm, "ring")
            assert np.array_equal(own, np.full(3, 3.0))
        return refused

    assert run_threads(3, reduce) == [20, 20, 20]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sharing_is_found_whatever_the_ranks_passed_before(size):
    # Each round every rank picks an array from a few (its own two, or views of one pool, some
    # overlapping); rounds repeat and change the choices, as loops do. Exactly the rounds in
    # which two ranks' arrays overlap raise, on every rank; the others sum.
    pool = np.zeros(16)
    own = [[np.zeros(4) for _ in range(2)] for _ in range(size)]
    views = [pool[0:4], pool[4:8], pool[8:12], pool[2:6]]  # the last overlaps the first two
    rounds = 150
    rng = np.random.default_rng(size)
    choices = [rng.integers(0, 6, size) for _ in range(rounds // 3)]
    plan = [choices[i] for i in rng.integers(0, len(choices), rounds)]

    def pick(rank: int, choice: int) -> np.ndarray:
        return own[rank][choice] if choice < 2 else views[choice - 2]

    def overlaps(round_: int) -> bool:
        picked = [pick(rank, int(c)) for rank, c in enumerate(plan[round_])]
        return any(np.shares_memory(a, b) for i, a in enumerate(picked) for b in picked[:i])

    def reduce(comm):
        rank, outcomes = comm.Get_rank(), []
        for round_ in range(rounds):
            buf = pick(rank, int(plan[round_][rank]))
            comm.Barrier()  # every rank has read the last sum before the arrays are refilled
            buf[:] = 1.0
            comm.Barrier()
            try:
                allreduce(buf, comm, "ring")
                outcomes.append(bool(np.all(buf == size)))
            except ValueError:
                outcomes.append(None)
        return outcomes

    expected = [None if overlaps(r) else True for r in range(rounds)]
    assert None in expected and True in expected
    for outcomes in run_threads(size, reduce):
        assert outcomes == expected


# -- the same checks under a real mpiexec ---------------------------------------------------------


@requires_mpi
@pytest.mark.timeout(240)
# Under the second MPI library (mpi_once: MPICH runs every P): P = 1; P = 2, a power of two and
# a ring whose two neighbours are one rank; P = 3, odd, folded by recursive doubling and
# Rabenseifner. P = 4 and 5 take the same paths at another depth.
@pytest.mark.parametrize("ranks", [1, 2, 3, pytest.param(4, marks=pytest.mark.mpi_once),
                                   pytest.param(5, marks=pytest.mark.mpi_once)])  # fmt: skip
def test_every_algorithm_passes_its_checks_under_mpiexec(ranks):
    # P > 2 is oversubscribed on 2 cores (MPICH busy-polls), hence the generous timeout.
    done = run_mpiexec(ranks, [WORKER], timeout=60 + 20 * ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {ranks} ranks" in done.stdout


MISMATCH_WORDS = {  # words the message of some rank must hold: hand-written, library
    "longer": ("different length", "lengths from 5 to 4101"),
    "float32": ("dtype float32", "dtypes float32 and float64"),
    "int64": ("dtype int64", "dtypes float64 and int64"),
    "strided": ("C-contiguous", "C-contiguous"),
    "read-only": ("read-only", "read-only"),
    "read-only-last": ("read-only", "read-only"),
}


@requires_mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.mpi_once), 3])  # P = 3: odd
def test_mismatched_buffers_raise_on_every_rank_under_mpiexec(ranks):
    done = run_mpiexec(ranks, [WORKER, "--mismatch"], timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "ValueError" in line]
    seen = sorted(tuple(line.split(": ")[:3]) for line in lines)
    expected = [(f"rank {r}", a, n) for r in range(ranks) for a in ALGORITHMS for n in MISMATCHES]
    assert seen == sorted(expected)
    for algorithm in ALGORITHMS:
        for name, (hand_written, library) in MISMATCH_WORDS.items():
            word = library if algorithm in ("mpi", "auto") else hand_written
            assert any(f": {algorithm}: {name}: " in line and word in line for line in lines), (
                algorithm, name, done.stdout,
            )  # fmt: skip


@requires_mpi
@pytest.mark.timeout(180)
def test_an_uncaught_mismatch_fails_the_mpi_job_cleanly():
    done = run_mpiexec(3, [WORKER, "--mismatch-uncaught"], timeout=60)
    assert done.returncode != 0
    assert "failed: ValueError('ring_allreduce: " in done.stderr and "differ" in done.stderr
    assert "returned although" not in done.stderr + done.stdout


@requires_mpi
@pytest.mark.timeout(180)
def test_a_failing_rank_ends_the_mpi_job_instead_of_hanging():
    done = run_mpiexec(2, [WORKER, "--fail-on-rank", "1"], timeout=60)
    assert done.returncode != 0
    assert "rank 1 of 2 failed: AssertionError('failing on purpose')" in done.stderr
    assert "ok:" not in done.stdout


OPEN_SENDS_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
from syncsgd.collectives import allreduce
comm = MPI.COMM_WORLD
for algorithm in ("ring", "rabenseifner"):
    buf = np.random.default_rng(comm.rank).standard_normal(int(sys.argv[1]))
    allreduce(buf, comm, algorithm)
    if comm.rank == 0:
        open(f"{sys.argv[2]}.{algorithm}", "wb").write(buf.tobytes())
"""


@requires_mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [3, pytest.param(4, marks=pytest.mark.mpi_once)])  # 3: odd
def test_sends_left_open_under_mpi_give_the_thread_ranks_bits(ranks, tmp_path):
    # Chunks of about 100 KiB: under MPI each step's send is left open (at least 64 KiB), on
    # thread ranks each step waits for it; the adds, and so the bits, are the same.
    from syncsgd.collectives.executor import OPEN_SEND_BYTES

    length = ranks * (OPEN_SEND_BYTES // 8 + 5000)
    script = tmp_path / "open_sends.py"
    script.write_text(OPEN_SENDS_SCRIPT)
    done = run_mpiexec(ranks, [str(script), str(length), str(tmp_path / "sum")], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    def summed(comm, algorithm):
        buf = np.random.default_rng(comm.rank).standard_normal(length)
        return allreduce(buf, comm, algorithm).tobytes()

    for algorithm in ("ring", "rabenseifner"):
        threads = run_threads(ranks, summed, algorithm)[0]
        assert (tmp_path / f"sum.{algorithm}").read_bytes() == threads, algorithm
