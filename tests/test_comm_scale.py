"""The thread communicator at scale: its properties over many world sizes, and hundreds of ranks."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import ring_allreduce
from syncsgd.comm import threads
from syncsgd.comm.threads import (
    ANY_SOURCE,
    ANY_TAG,
    IN_PLACE,
    MAX,
    MIN,
    SUM,
    DeadlockError,
    MessageTruncated,
    RankAborted,
    Status,
    run_threads,
)
from syncsgd.comm.world import check_capacity, launch

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling CI

sizes = st.integers(1, 64)
MODES = ("exact", "any_source", "any_tag", "any")


@st.composite
def traffic(draw):
    """A world size, every rank's sends as (destination, tag), and each receiver's wildcards."""
    size = draw(sizes)
    sends = [
        draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 2)), max_size=6))
        for _ in range(size)
    ]
    return size, sends, [draw(st.sampled_from(MODES)) for _ in range(size)]


def _receive_specs(rank, size, sends, mode):
    """The (source, tag) of each receive `rank` posts, wildcards as its mode says."""
    expected = [(src, tag) for src in range(size) for dest, tag in sends[src] if dest == rank]
    source = {"exact": None, "any_tag": None, "any_source": ANY_SOURCE, "any": ANY_SOURCE}[mode]
    wild_tag = mode in ("any_tag", "any")
    return [(src if source is None else source, ANY_TAG if wild_tag else tag)
            for src, tag in expected]  # fmt: skip


@given(traffic())
def test_every_message_arrives_once_and_none_overtakes(plan):
    size, sends, modes = plan

    def talk(comm):
        rank = comm.rank
        requests = [comm.Isend(np.array([rank, i, tag]), dest, tag)
                    for i, (dest, tag) in enumerate(sends[rank])]  # fmt: skip
        got, buf, status = [], np.zeros(3, np.int64), Status()
        for source, tag in _receive_specs(rank, size, sends, modes[rank]):
            comm.Recv(buf, source, tag, status)
            assert (status.Get_source(), status.Get_tag()) == (buf[0], buf[2])
            got.append(tuple(buf.tolist()))
        for request in requests:
            request.Wait()
        return got

    for rank, got in enumerate(run_threads(size, talk)):
        sent = [(src, i, tag) for src in range(size)
                for i, (dest, tag) in enumerate(sends[src]) if dest == rank]  # fmt: skip
        assert sorted(got) == sorted(sent)
        wild_tag = modes[rank] in ("any_tag", "any")
        for src in range(size):  # a later message never overtakes one the receive also matched
            for tag in (None,) if wild_tag else (0, 1, 2):
                order = [i for s, i, t in got if s == src and tag in (None, t)]
                assert order == sorted(order)


@given(sizes, st.data())
def test_truncation_is_reported_and_the_message_consumed(size, data):
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=size, max_size=size))
    room = data.draw(st.lists(st.integers(0, 5), min_size=size, max_size=size))

    def shift(comm):
        right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
        buf, status = np.zeros(room[comm.rank]), Status()
        try:
            comm.Sendrecv(np.ones(lengths[comm.rank]), right, 1, buf, left, 1, status)
        except MessageTruncated:
            return "truncated", status.Get_count()
        return "ok", status.Get_count()

    for rank, (outcome, count) in enumerate(run_threads(size, shift)):
        sent = lengths[(rank - 1) % size]
        assert outcome == ("truncated" if sent > room[rank] else "ok")
        assert count == 8 * min(sent, room[rank])


def _outcome(call):
    """Run `call()` and say how it ended, so that every rank's fate can be checked."""
    try:
        call()
    except DeadlockError:
        return "deadlock"
    except RankAborted as exc:
        return str(exc)
    return "done"


@given(st.integers(2, 64), st.data())
def test_a_rank_that_leaves_early_is_a_deadlock_for_every_other(size, data):
    leaver = data.draw(st.integers(0, size - 1))

    def barrier_without_one(comm):
        if comm.rank == leaver:
            return "left"
        return _outcome(comm.Barrier)

    results = run_threads(size, barrier_without_one)
    assert results == ["left" if r == leaver else "deadlock" for r in range(size)]


@given(st.integers(2, 64), st.data())
def test_a_failing_rank_releases_every_other(size, data):
    failing = data.draw(st.integers(0, size - 1))
    released = []

    def fail(comm):
        if comm.rank == failing:
            time.sleep(0.005)
            raise KeyError("boom")
        released.append(_outcome(lambda: comm.Recv(np.zeros(1), failing)))

    with pytest.raises(KeyError) as info:
        run_threads(size, fail)
    assert f"raised on rank {failing} of {size}" in " ".join(info.value.__notes__)
    assert len(released) == size - 1
    assert all(f"because rank {failing} failed" in message for message in released)


@given(sizes, st.sampled_from([SUM, MAX, MIN]), st.booleans(), st.data())
def test_collectives_give_the_rank_order_reduction_bitwise(size, op, in_place, data):
    root = data.draw(st.integers(0, size - 1))
    values = [np.random.default_rng(r).standard_normal(5) for r in range(size)]
    expected = values[0].copy()
    for value in values[1:]:  # the order Allreduce promises: rank 0, 1, 2, ...
        {SUM: np.add, MAX: np.maximum, MIN: np.minimum}[op](expected, value, out=expected)

    def collect(comm):
        mine = values[comm.rank].copy()
        out = mine if in_place else np.empty_like(mine)
        comm.Allreduce(IN_PLACE if in_place else mine, out, op=op)
        sent = np.full(3, float(comm.rank))
        comm.Bcast(sent, root=root)
        ring = values[comm.rank].copy()
        ring_allreduce(ring, comm)
        return out, sent, ring

    results = run_threads(size, collect)
    for out, sent, ring in results:
        assert out.tobytes() == expected.tobytes()
        assert np.array_equal(sent, np.full(3, float(root)))
        assert ring.tobytes() == results[0][2].tobytes()  # every rank bitwise the same


@pytest.fixture
def constant_switching():
    """Make the interpreter switch threads every few bytecodes, then restore its interval."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_sendrecv_rings_stay_exact_under_constant_thread_switches(constant_switching):
    # A rank woken between posting and sleeping must neither sleep past its message nor leave
    # its gate open for the next call (which would then return before its message came).
    def ring(comm):
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        got, status, wrong = np.zeros(1), Status(), 0
        for i in range(2000):
            comm.Sendrecv(np.array([float(i * 100 + comm.rank)]), right, 5, got, left, ANY_TAG,
                          status)  # fmt: skip
            wrong += got[0] != i * 100 + left or status.Get_tag() != 5
        return wrong

    for _ in range(4):
        assert run_threads(8, ring) == [0] * 8


def test_five_hundred_and_twelve_ranks():
    size = 512

    def work(comm):
        right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
        got = np.zeros(1)
        for _ in range(5):
            comm.Sendrecv(np.array([float(comm.rank)]), right, 0, got, left)
        total = np.array([float(comm.rank)])
        comm.Allreduce(IN_PLACE, total, op=SUM)
        comm.Barrier()
        return got[0], total[0], threading.current_thread().name

    results = run_threads(size, work)
    assert [r[0] for r in results] == [float((r - 1) % size) for r in range(size)]
    assert {r[1] for r in results} == {float(sum(range(size)))}
    assert results[-1][2] == f"syncsgd-rank-{size - 1}"


def test_deadlock_at_256_ranks_names_every_rank():
    def recv_first(comm):
        comm.Recv(np.zeros(1), (comm.rank - 1) % comm.size)

    with pytest.raises(DeadlockError, match="every rank is waiting") as info:
        run_threads(256, recv_first)
    assert "rank 255: recv from 254" in str(info.value)


def test_failure_at_256_ranks_releases_everyone():
    def fail(comm):
        if comm.rank == 200:
            time.sleep(0.02)
            raise OSError("disk")
        return _outcome(comm.Barrier)

    with pytest.raises(OSError, match="disk") as info:
        run_threads(256, fail)
    assert "raised on rank 200 of 256" in " ".join(info.value.__notes__)


def test_a_world_the_machine_cannot_hold_is_refused_before_a_thread_starts(monkeypatch):
    monkeypatch.setattr(threading.Thread, "start", lambda thread: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match="cannot run 10000000 thread ranks"):
        run_threads(10_000_000, lambda comm: None)
    with pytest.raises(ValueError, match="cannot run"):
        launch(lambda comm: None, backend="threads", ranks=10_000_000)
    monkeypatch.setattr(threads, "_thread_room", lambda: (500, "a test limit"))
    with pytest.raises(ValueError, match="a test limit leaves room for about 436 threads"):
        run_threads(437, lambda comm: None)
    monkeypatch.setattr(threads, "memory_rooms", lambda: [(2**30, "available memory")])
    with pytest.raises(ValueError, match="per rank.*available memory"):
        check_capacity(100, rank_bytes=2**24)
    check_capacity(100, rank_bytes=2**20)  # 100 MiB fits in 1 GiB


def test_a_thread_that_cannot_start_releases_the_started_ones(monkeypatch):
    real_start, count = threading.Thread.start, [0]

    def start(thread):
        count[0] += 1
        if count[0] > 70:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="could start only 70 of 100 thread ranks"):
        run_threads(100, lambda comm: comm.Barrier())
