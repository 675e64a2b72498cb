"""The ring allreduce on thread ranks: sums vs a naive reference, traces, scratch, bad input."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_ring_check import (
    DTYPES,
    check_rejected_everywhere,
    check_sum,
    check_trace,
    longer_on_last_rank,
    standard_cases,
)
from strategies import world_and_shape

from syncsgd import RankAborted, ThreadComm, run_threads
from syncsgd.collectives.ring import ring_allreduce

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling CI


@given(
    case=world_and_shape(),
    dtype=st.sampled_from(DTYPES),
    integers=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_ring_sums_like_a_naive_sum(case, dtype, integers, seed):
    size, shape = case
    results = run_threads(size, check_sum, shape, dtype, integers, seed)
    # check_sum compared the bits across ranks with Bcast; compare them here independently too
    assert len({result.tobytes() for result in results}) == 1
    assert all(result.shape == shape for result in results)


@given(size=st.integers(1, 12), length=st.integers(0, 40))
def test_trace_events_describe_every_step(size, length):
    traces = run_threads(size, check_trace, length)
    # The ring is consistent: what rank r sends in a step is what rank r+1 receives in it.
    for rank, events in enumerate(traces):
        following = traces[(rank + 1) % size]
        for sent, received in zip(events, following, strict=True):
            assert (sent.phase, sent.step) == (received.phase, received.step)
            assert sent.send_chunk == received.recv_chunk
            assert sent.send_range == received.recv_range


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class RingChecks:
    """Assertions about ring_allreduce, bound to thread worlds of several sizes below."""

    SIZE = 1

    def run(self, fn, *args, **kwargs):
        return run_threads(self.SIZE, fn, *args, **kwargs)

    def test_standard_cases(self):
        for shape, dtype, integers in standard_cases(self.SIZE):
            self.run(check_sum, shape, dtype, integers, 7)

    def test_trace(self):
        for length in sorted({0, 1, self.SIZE - 1, self.SIZE + 2, 37}):
            self.run(check_trace, length)

    def test_trace_does_not_change_the_result(self):
        def both(comm):
            plain = np.arange(23, dtype=np.float32) / (comm.rank + 3)
            traced = plain.copy()
            ring_allreduce(plain, comm)
            ring_allreduce(traced, comm, trace=lambda event: None)
            return plain.tobytes() == traced.tobytes()

        assert all(self.run(both))

    def test_repeated_calls_reuse_scratch_without_allocating(self):
        length = 1 << 18  # float64: 2 MiB, so one chunk is at least 2 MiB / SIZE
        chunk_bytes = 8 * length // self.SIZE

        def second_call_peak(comm):
            buf = np.ones(length)
            ring_allreduce(buf, comm)  # fills this rank's scratch cache
            comm.Barrier()
            if comm.rank == 0:
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
            comm.Barrier()
            ring_allreduce(buf, comm)
            comm.Barrier()
            extra = tracemalloc.get_traced_memory()[1] - before if comm.rank == 0 else 0
            return extra, buf[0]

        tracemalloc.start()
        try:
            results = self.run(second_call_peak)
        finally:
            tracemalloc.stop()
        extra, first = results[0]
        assert first == self.SIZE**2  # the second call summed the first call's sums
        # Scratch allocated per step (or per call) would show up as at least one chunk.
        assert extra < chunk_bytes // 4, f"{extra} bytes allocated by a call with a warm cache"

    @pytest.mark.parametrize("everywhere", [False, True])
    @pytest.mark.parametrize(
        "bad_buffer, words",
        [
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
        ],
    )
    def test_bad_buffer_raises_on_every_rank(self, bad_buffer, words, everywhere):
        bad_rank = self.SIZE // 2

        def make_buffer(rank, size):
            return bad_buffer() if everywhere or rank == bad_rank else np.zeros(6)

        messages = self.run(check_rejected_everywhere, make_buffer)
        assert words in messages[bad_rank]
        for rank, message in enumerate(messages):
            if everywhere:
                assert words in message
            elif rank != bad_rank:
                assert "ring_allreduce" in message and ("differ" in message or "another" in message)

    @pytest.mark.parametrize(
        "make_buffer, words",
        [
            (longer_on_last_rank, "different length"),  # same signature: caught by the count
            (lambda rank, size: np.ones(3 + rank), "different length"),
            (lambda rank, size: np.ones((2, 4) if rank else (8, 1)), None),  # same length: fine
            (lambda rank, size: np.ones(7, np.float32 if rank == 1 else np.float64), "dtype"),
            (lambda rank, size: np.ones(7, np.int64 if rank == 1 else np.float64), "dtype"),
            (lambda rank, size: np.ones(size - rank), "different length"),
        ],
    )
    def test_buffers_that_differ_across_ranks_raise_on_every_rank(self, make_buffer, words):
        if self.SIZE == 1:
            pytest.skip("one rank cannot disagree with itself")
        if words is None:  # the same number of elements in another shape is a legal allreduce
            sums = self.run(lambda comm: ring_allreduce(make_buffer(comm.rank, self.SIZE), comm))
            assert all(np.array_equal(result.ravel(), np.full(8, self.SIZE)) for result in sums)
            return
        messages = self.run(check_rejected_everywhere, make_buffer)
        assert any(words in message for message in messages), messages
        assert all("differ" in message or "another rank" in message for message in messages)

    def test_a_rank_that_raises_is_named_and_nobody_hangs(self):
        if self.SIZE == 1:
            pytest.skip("one rank takes no steps, so no trace callback can fail inside the ring")
        bad_rank = self.SIZE - 1

        def fail_in_the_middle(comm):
            def trace(event):
                if comm.rank == bad_rank and event.phase == "allgather":
                    raise RuntimeError("trace callback failed")

            return ring_allreduce(np.ones(100), comm, trace=trace)

        with pytest.raises(RuntimeError, match="trace callback failed") as info:
            self.run(fail_in_the_middle)
        assert not isinstance(info.value, RankAborted)
        assert f"raised on rank {bad_rank} of {self.SIZE}" in " ".join(info.value.__notes__)

    def test_a_rank_that_fails_before_the_call_releases_the_others(self):
        def skip_on_rank_0(comm):
            if comm.rank == 0:
                raise KeyError("rank 0 never calls the ring")
            return ring_allreduce(np.ones(10), comm)

        with pytest.raises(KeyError) as info:
            self.run(skip_on_rank_0)
        assert "raised on rank 0" in " ".join(info.value.__notes__)


class TestRingWorld1(RingChecks):
    SIZE = 1


class TestRingWorld2(RingChecks):
    SIZE = 2


class TestRingWorld3(RingChecks):
    SIZE = 3


class TestRingWorld5(RingChecks):
    SIZE = 5


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_ndarray_subclasses_are_reduced_in_place(tmp_path):
    def reduce_subclasses(comm):
        matrix = np.asmatrix(np.arange(6.0).reshape(2, 3) * (comm.rank + 1))  # stays 2-D on ravel
        mapped = np.memmap(tmp_path / f"rank{comm.rank}.bin", np.int64, "w+", shape=(7,))
        mapped[:] = np.arange(7) - comm.rank
        assert ring_allreduce(matrix, comm) is matrix and ring_allreduce(mapped, comm) is mapped
        return np.asarray(matrix).copy(), np.asarray(mapped).copy()

    for matrix, mapped in run_threads(3, reduce_subclasses):
        assert np.array_equal(matrix, np.arange(6.0).reshape(2, 3) * 6)
        assert np.array_equal(mapped, 3 * np.arange(7) - 3)


def test_unaligned_buffers_are_reduced():
    def reduce_unaligned(comm):
        buf = np.frombuffer(bytearray(8 * 9 + 1), np.float64, count=9, offset=1)  # misaligned
        assert not buf.flags.aligned and buf.flags.c_contiguous and buf.flags.writeable
        buf[:] = np.arange(9) * (comm.rank + 1)
        return ring_allreduce(buf, comm).copy()

    for result in run_threads(3, reduce_unaligned):
        assert np.array_equal(result, np.arange(9) * 6.0)


def test_many_sizes_in_one_thread_grow_and_evict_the_cached_plans():
    lengths = [*range(0, 80), 5000, 3, 70000, 2, 5000]  # more than the cache holds, up and down

    def sums(comm):
        for length in lengths:
            for dtype in ("float64", "int64"):
                buf = np.arange(length, dtype=dtype) + comm.rank
                ring_allreduce(buf, comm)
                expected = 3 * np.arange(length, dtype=dtype) + 3  # ranks 0 + 1 + 2
                assert np.array_equal(buf, expected), (length, dtype)
        return True

    assert run_threads(3, sums) == [True] * 3


def test_lengths_that_differ_by_a_multiple_of_4096_are_caught_by_the_byte_counts():
    # Same tag signature (length mod 4096) on every rank: only the message sizes can tell.
    messages = run_threads(
        4, check_rejected_everywhere, lambda rank, size: np.ones(9 + 8192 * rank)
    )
    assert all("different length" in m or "another rank" in m for m in messages)


class LateTrouble(ThreadComm):
    """Rank 0 flags every message from its `first`-th Sendrecv on: a problem seen late."""

    def __init__(self, comm: ThreadComm, first: int) -> None:
        super().__init__(comm._world, comm.rank)
        self.calls, self.first = 0, first

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):
        self.calls += 1
        if self.rank == 0 and self.calls >= self.first:
            sendtag |= 1  # the ring's "something is wrong" bit
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


@pytest.mark.parametrize("size", [3, 4, 5])
def test_a_problem_seen_in_a_later_step_still_reaches_every_rank(size):
    # Flagged from reduce-scatter step 1 on, the flag needs allgather steps to go round the ring.
    def late(comm):
        return check_rejected_everywhere(LateTrouble(comm, first=2), lambda rank, size: np.ones(10))

    messages = run_threads(size, late)
    assert all("another rank passed a different or unusable buffer" in m for m in messages)
