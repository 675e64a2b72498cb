"""The thread communicator: mpi4py's buffer methods with MPI's semantics, and run_threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from syncsgd.collectives import ring_allreduce
from syncsgd.comm.threads import (
    ANY_SOURCE,
    ANY_TAG,
    IN_PLACE,
    MAX,
    MIN,
    SUM,
    CommClosed,
    DeadlockError,
    MessageTruncated,
    RankAborted,
    Status,
    ThreadComm,
    run_threads,
)
from syncsgd.comm.world import constants, launch, launched_by_mpi, resolve_backend

pytestmark = pytest.mark.timeout(60)  # a hang fails the test instead of stalling CI


class CommChecks:
    """Assertions about ThreadComm, bound to thread worlds of several sizes below."""

    SIZE = 1

    def run(self, fn, *args, **kwargs):
        return run_threads(self.SIZE, fn, *args, **kwargs)

    # -- run_threads --------------------------------------------------------------------------
    def test_results_come_back_in_rank_order_with_args_and_kwargs(self):
        def describe(comm, base, *, scale):
            time.sleep(0.001 * (self.SIZE - comm.rank))  # finish in reverse order
            return base + scale * comm.Get_rank(), comm.Get_size(), comm.size

        results = self.run(describe, 100, scale=10)
        assert results == [(100 + 10 * r, self.SIZE, self.SIZE) for r in range(self.SIZE)]

    def test_the_ranks_run_at_the_same_time_in_their_own_threads(self):
        meeting = threading.Barrier(self.SIZE, timeout=10)  # breaks unless all ranks are running

        def meet(comm):
            meeting.wait()
            return threading.current_thread().name

        assert self.run(meet) == [f"syncsgd-rank-{rank}" for rank in range(self.SIZE)]

    # -- collectives --------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ["float64", "float32", "int64", "uint8"])
    def test_bcast_from_every_root(self, dtype):
        def bcast(comm, root):
            buf = np.full((3, 4), comm.rank + 1, dtype)
            comm.Bcast(buf, root=root)
            return buf

        for root in range(self.SIZE):
            for buf in self.run(bcast, root):
                assert np.array_equal(buf, np.full((3, 4), root + 1, dtype))

    def test_bcast_accepts_mpi4py_buffer_specs(self):
        def bcast(comm):
            buf = np.arange(5.0) if comm.rank == 0 else np.zeros(5)
            comm.Bcast([buf, "d"], root=0)
            return buf

        assert all(np.array_equal(buf, np.arange(5.0)) for buf in self.run(bcast))

    def test_barrier_lets_nobody_through_before_everybody_arrived(self):
        arrived = []
        lock = threading.Lock()

        def meet(comm):
            seen = []
            for round_ in range(3):
                time.sleep(0.002 * ((comm.rank + round_) % self.SIZE))  # arrive at different times
                with lock:
                    arrived.append(round_)
                comm.Barrier()
                with lock:
                    seen.append(arrived.count(round_))
            return seen

        assert self.run(meet) == [[self.SIZE] * 3] * self.SIZE

    @pytest.mark.parametrize("op, reference", [(SUM, np.sum), (MAX, np.max), (MIN, np.min)])
    @pytest.mark.parametrize("in_place", [False, True])
    def test_allreduce_matches_a_numpy_reduction(self, op, reference, in_place):
        contributions = [
            np.random.default_rng(r).integers(-50, 50, (2, 3)) for r in range(self.SIZE)
        ]
        expected = reference(np.stack(contributions), axis=0)

        def allreduce(comm):
            mine = contributions[comm.rank].copy()
            if in_place:
                comm.Allreduce(IN_PLACE, mine, op=op)
                return mine
            out = np.empty_like(mine)
            comm.Allreduce(mine, out, op=op)
            assert np.array_equal(mine, contributions[comm.rank]), "send buffer was modified"
            return out

        assert all(np.array_equal(result, expected) for result in self.run(allreduce))

    def test_allreduce_understands_mpi4py_ops(self):
        mpi = pytest.importorskip("mpi4py.MPI")

        def allreduce(comm):
            value = np.array([comm.rank + 1.0])
            comm.Allreduce(mpi.IN_PLACE, value, op=mpi.MAX)
            return value[0]

        assert self.run(allreduce) == [float(self.SIZE)] * self.SIZE

    def test_allreduce_rejects_bad_arguments(self):
        def bad_op(comm):
            comm.Allreduce(IN_PLACE, np.zeros(2), op="prod")

        with pytest.raises(ValueError, match="unsupported reduction"):
            self.run(bad_op)

        def bad_shapes(comm):
            comm.Allreduce(np.zeros(2), np.zeros(3))

        with pytest.raises(ValueError, match="differ in shape"):
            self.run(bad_shapes)

    # -- point to point -----------------------------------------------------------------------
    def test_sendrecv_around_the_ring(self):
        def shift(comm):
            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            received, status = np.zeros(3), Status()
            comm.Sendrecv(np.full(3, float(comm.rank)), right, 7, received, left, ANY_TAG, status)
            return received, status.Get_source(), status.Get_tag(), status.Get_count()

        for rank, (received, source, tag, count) in enumerate(self.run(shift)):
            left = (rank - 1) % self.SIZE
            assert np.array_equal(received, np.full(3, float(left)))
            assert (source, tag, count) == (left, 7, 24)

    def test_messages_do_not_overtake_and_match_by_tag(self):
        def talk(comm):
            if comm.rank == 0:
                requests = [
                    comm.Isend(np.array([float(i)]), self.SIZE - 1, tag=i % 2) for i in range(4)
                ]
            if comm.rank == self.SIZE - 1:
                got, buf = [], np.zeros(1)
                for tag in (1, 0, 1, 0):  # take the odd tags first: tag 1 skips the tag-0 message
                    comm.Recv(buf, source=ANY_SOURCE, tag=tag)
                    got.append(buf[0])
            if comm.rank == 0:
                for request in requests:
                    request.Wait()
            return got if comm.rank == self.SIZE - 1 else None

        assert self.run(talk)[-1] == [1.0, 0.0, 3.0, 2.0]

    def test_irecv_then_test_and_wait(self):
        def exchange(comm):
            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            buf = np.zeros(2, np.int64)
            recv = comm.Irecv(buf, source=left, tag=3)
            send = comm.Isend(np.array([comm.rank, 42]), dest=right, tag=3)
            recv.Wait()
            send.Wait()
            return buf.tolist(), recv.Test(), send.Test()

        for rank, (buf, recv_done, send_done) in enumerate(self.run(exchange)):
            assert buf == [(rank - 1) % self.SIZE, 42] and recv_done and send_done

    def test_a_message_longer_than_the_receive_buffer_is_an_error(self):
        def truncate(comm):
            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            comm.Sendrecv(np.zeros(4), right, 0, np.zeros(3), left, 0)

        with pytest.raises(MessageTruncated, match="32 bytes .* buffer of 24 bytes"):
            self.run(truncate)

    @pytest.mark.parametrize(
        "call, words",
        [
            (lambda comm: comm.Send(np.zeros(1), comm.size), "invalid rank"),
            (lambda comm: comm.Send(np.zeros(1), -1), "invalid rank"),
            (lambda comm: comm.Recv(np.zeros(1), comm.size + 3), "invalid rank"),
            (lambda comm: comm.Send(np.zeros(1), 0, tag=-2), "invalid tag"),
            (lambda comm: comm.Send(np.zeros(1), 0, tag=40000), "invalid tag"),
            (lambda comm: comm.Bcast(np.zeros(1), root=comm.size), "invalid rank"),
            (lambda comm: comm.Send(np.zeros((2, 2))[:, 0], 0), "C-contiguous"),
            (lambda comm: comm.Recv(np.frombuffer(bytes(8)), 0), "read-only"),
            (lambda comm: comm.Sendrecv(np.zeros(1), comm.size, 0, np.zeros(1), 0), "invalid rank"),
        ],
    )
    def test_bad_arguments_raise_value_error(self, call, words):
        with pytest.raises(ValueError, match=words):
            self.run(call)

    # -- failures and deadlocks ---------------------------------------------------------------
    def test_everybody_receiving_first_is_a_detected_deadlock(self):
        def recv_first(comm):
            buf = np.zeros(1)
            comm.Recv(buf, (comm.rank - 1) % comm.size)
            comm.Send(buf, (comm.rank + 1) % comm.size)

        with pytest.raises(DeadlockError, match="every rank is waiting"):
            self.run(recv_first)

    def test_synchronous_sends_in_a_cycle_deadlock_as_in_mpi(self):
        def send_first(comm):  # relies on MPI buffering a small message: unsafe
            comm.Send(np.zeros(1), (comm.rank + 1) % comm.size)
            comm.Recv(np.zeros(1), (comm.rank - 1) % comm.size)

        with pytest.raises(DeadlockError) as info:
            self.run(send_first)
        assert "send to" in str(info.value)

    def test_waiting_for_a_rank_that_returned_is_a_deadlock(self):
        def late(comm):
            if comm.rank == 0:
                return "done"
            comm.Recv(np.zeros(1), 0)

        if self.SIZE == 1:
            assert self.run(late) == ["done"]
            return
        with pytest.raises(DeadlockError, match="recv from 0"):
            self.run(late)

    def test_a_failing_rank_releases_the_others_and_is_named(self):
        failing = self.SIZE // 2
        released = []

        def fail(comm):
            if comm.rank == failing:
                time.sleep(0.01)  # the others are blocked by now
                raise ZeroDivisionError("rank failed")
            try:
                comm.Recv(np.zeros(1), failing)
            except RankAborted as exc:
                released.append(str(exc))
                raise

        with pytest.raises(ZeroDivisionError) as info:
            self.run(fail)
        assert f"raised on rank {failing} of {self.SIZE}" in " ".join(info.value.__notes__)
        assert len(released) == self.SIZE - 1
        assert all(f"because rank {failing} failed" in message for message in released)


class PairChecks(CommChecks):
    """Assertions that need a sender and a receiver on two ranks."""

    def test_send_buffer_may_be_reused_as_soon_as_send_returns(self):
        def reuse(comm):
            if comm.rank == 0:
                buf = np.arange(4.0)
                req = comm.Isend(buf, 1)
                req.Wait()
                buf[:] = -1  # MPI semantics: the message was already taken
                comm.Send(buf, 1, tag=1)
            elif comm.rank == 1:
                first, second = np.zeros(4), np.zeros(4)
                time.sleep(0.01)  # let rank 0 block in Wait first
                comm.Recv(first, 0, 0)
                comm.Recv(second, 0, 1)
                return first, second

        first, second = self.run(reuse)[1]
        assert np.array_equal(first, np.arange(4.0)) and np.array_equal(second, np.full(4, -1.0))

    def test_a_small_sendrecv_returns_before_its_message_is_received(self):
        def eager(comm):
            if comm.rank == 0:
                buf, got = np.array([1.0]), np.zeros(1)
                comm.Sendrecv(buf, 1, 0, got, 1, 0)  # rank 1 receives it only later
                buf[:] = -1  # the send buffer is free: the message was copied aside
                comm.Send(np.zeros(1), 1, tag=1)
                return got[0]
            if comm.rank == 1:
                comm.Send(np.array([5.0]), 0, tag=0)
                first = np.zeros(1)
                comm.Recv(np.zeros(1), 0, tag=1)  # overtakes nothing: another tag
                comm.Recv(first, 0, tag=0)
                return first[0]

        assert self.run(eager)[:2] == [5.0, 1.0]

    def test_sendrecv_takes_a_synchronous_send_that_waits_for_it(self):
        big = np.arange(20000.0)  # longer than a message sent eagerly

        def meet(comm):
            if comm.rank == 1:
                comm.Send(big, 0, tag=2)  # waits for rank 0's Sendrecv
                back = np.zeros(1)
                comm.Recv(back, 0, tag=3)
                return back[0]
            if comm.rank == 0:
                time.sleep(0.01)  # rank 1 is sleeping in its Send by now
                got, status = np.zeros(big.size), Status()
                comm.Sendrecv(np.array([7.0]), 1, 3, got, 1, ANY_TAG, status)
                return np.array_equal(got, big), status.Get_tag(), status.Get_count()

        assert self.run(meet)[:2] == [(True, 2, big.nbytes), 7.0]


class TestCommWorld1(CommChecks):
    SIZE = 1


class TestCommWorld2(PairChecks):
    SIZE = 2


class TestCommWorld3(PairChecks):
    SIZE = 3


class TestCommWorld5(PairChecks):
    SIZE = 5


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "2", None])
def test_run_threads_needs_a_positive_number_of_ranks(size):
    with pytest.raises(ValueError, match="positive integer"):
        run_threads(size, lambda comm: None)


def test_the_lowest_failing_rank_is_reported():
    def fail_on_odd(comm):
        if comm.rank % 2:
            raise ValueError(f"odd rank {comm.rank}")
        comm.Barrier()

    with pytest.raises(ValueError, match="odd rank 1") as info:
        run_threads(4, fail_on_odd)
    assert "raised on rank 1 of 4" in " ".join(info.value.__notes__)


def test_constants_fit_the_communicator_and_are_built_once():
    comm = ThreadComm.__new__(ThreadComm)
    first, second = constants(comm), constants(comm)
    assert first is second
    assert (first.SUM, first.MAX, first.IN_PLACE, first.ANY_TAG) == (SUM, MAX, IN_PLACE, ANY_TAG)
    assert first.Status is Status


def test_backend_choice(monkeypatch):
    for name in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE",
                 "SLURM_STEP_NUM_TASKS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_mpi() and resolve_backend("auto") == "threads"
    monkeypatch.setenv("PMI_RANK", "0")
    assert launched_by_mpi() and resolve_backend("auto") == "mpi"
    assert resolve_backend("threads") == "threads"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("gloo")


def test_launch_on_threads_runs_every_rank():
    assert launch(lambda comm, x: comm.rank * x, 3, backend="threads", ranks=3) == [0, 3, 6]
    assert launch(lambda comm: comm.size, backend="threads") == [1]


@pytest.mark.parametrize(
    "use",
    [
        lambda comm: comm.Barrier(),
        lambda comm: comm.Send(np.ones(1), dest=1 - comm.Get_rank()),
        lambda comm: comm.Recv(np.ones(1)),
        lambda comm: comm.Isend(np.ones(1), dest=0),
        lambda comm: comm.Bcast(np.ones(1), root=0),
        lambda comm: comm.Allreduce(IN_PLACE, np.ones(1), op=SUM),
        lambda comm: ring_allreduce(np.ones(3), comm),
    ],
)
def test_a_communicator_used_after_run_threads_returned_raises(use):
    comms = run_threads(2, lambda comm: comm)
    outcome: list[BaseException] = []

    def call() -> None:  # in a thread, so that a hang fails the test instead of stalling it
        try:
            use(comms[0])
        except BaseException as exc:  # noqa: BLE001 - examined below
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "hung"
    assert len(outcome) == 1 and isinstance(outcome[0], CommClosed), outcome
    assert "run_threads has returned" in str(outcome[0])


def test_claims_find_sharing_whichever_rank_claims_first():
    # The order in which two ranks reach a collective changes call by call; the array they share
    # is found in every call, even by a rank that found nothing the call before.
    shared, order = np.zeros(4), (0, 1, 0, 0, 1, 1, 0)

    def rank(comm):
        me, found = comm.Get_rank(), []
        for first in order:
            for turn in (first, 1 - first):
                if turn == me:
                    found.append(comm.claim(shared.ravel(), shared, "f") is not None)
                comm.Barrier()
            comm.failed()  # the call fails on every rank (the flag reaches them all)
        return found

    by_rank = run_threads(2, rank)
    # Whoever claims second sees the first one's array in the same call.
    assert all(by_rank[1 - first][call] for call, first in enumerate(order))


def test_a_duplicates_small_sendrecv_is_eager_in_its_own_context():
    def eager(comm):
        dup = comm.Dup()
        if comm.rank == 0:
            got = np.zeros(1)
            dup.Sendrecv(np.array([1.0]), 1, 0, got, 1, 0)  # rank 1 receives it only later
            comm.Send(np.zeros(1), 1, tag=0)  # the original's tag 0: never the duplicate's
            return got[0]
        dup.Send(np.array([5.0]), 0, tag=0)
        comm.Recv(np.zeros(1), 0, tag=0)
        first = np.zeros(1)
        dup.Recv(first, 0, tag=0)
        return first[0]

    assert run_threads(2, eager) == [5.0, 1.0]
