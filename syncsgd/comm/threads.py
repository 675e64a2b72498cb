"""Communicators: P ranks as threads with mpi4py's buffer methods, or MPI's own COMM_WORLD.

`ThreadComm` implements the buffer subset of mpi4py's `Comm` that syncsgd uses (`Get_rank`,
`Get_size`, `Send`, `Recv`, `Isend`, `Irecv`, `Sendrecv`, `Barrier`, `Bcast`, `Allreduce`) with
MPI's semantics, so the collectives are written once and run on either communicator:

- Point-to-point messages match on (source, tag) in posting order and never overtake each other.
- A send buffer may be reused as soon as the call returns (or `Wait` does), as in MPI. The send
  of a `Sendrecv` or an `Isend` of at most `EAGER_BYTES` is *eager*: its bytes go straight into a
  receive already posted for it, or else are copied aside, and the send is complete at once, so a
  `Sendrecv` waits only for its receive. Every other send - `Send`, a longer message, the sends of
  `Bcast` - is *synchronous* (rendezvous): it completes when the receiver has the bytes. A program
  that relies on MPI buffering a `Send` therefore deadlocks here, and the deadlock is *detected*
  and raised on every rank (`DeadlockError`) instead of hanging.
- A message longer than its receive buffer raises `MessageTruncated` (MPI_ERR_TRUNCATE); the
  message is consumed, as in MPI.
- If any rank fails, every rank blocked in (or later entering) a communication call raises
  `RankAborted`, so `run_threads` always returns or raises - never hangs.
- A rank that waits longer than its timeout (`set_timeout`, off by default) makes every rank
  raise `CollectiveTimeout`, naming what each waiting rank waits for; a communicator used after
  its `run_threads` returned raises `CommClosed`.

mpi4py is imported lazily: nothing here needs an MPI library unless the MPI backend is chosen.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd.comm.watchdog import Doing, bind, current_frames, describe, timeout_seconds
from syncsgd.util.machine import cgroup, meminfo, memory_rooms, numbers

ANY_SOURCE = -1
ANY_TAG = -1
TAG_UB = 32767  # the smallest MPI_TAG_UB the MPI standard allows


class _InPlace:
    """The `IN_PLACE` marker of `ThreadComm.Allreduce` (MPI.IN_PLACE's twin)."""

    def __repr__(self) -> str:
        return "IN_PLACE"


IN_PLACE = _InPlace()
SUM, MAX, MIN = "sum", "max", "min"
_REDUCE = {SUM: np.add, MAX: np.maximum, MIN: np.minimum}

# Message contexts: collectives never match point-to-point traffic, as in MPI.
_P2P, _COLL = 0, 1


class CommError(RuntimeError):
    """Base class of the thread communicator's errors."""


class MessageTruncated(CommError):
    """A message was longer than the receive buffer posted for it (MPI_ERR_TRUNCATE)."""


class RankAborted(CommError):
    """Raised on a rank blocked in a communication call after another rank failed."""


class DeadlockError(CommError):
    """Every live rank is blocked in a communication call that no other rank can complete."""


class CollectiveTimeout(CommError):
    """A rank waited longer than its timeout: raised on every rank, naming what each waited for."""


class CommClosed(CommError):
    """A thread communicator was used after its `run_threads` had returned."""


# Failures of the whole world, raised alike on every rank (not as RankAborted).
_WORLD_FAILURES = (DeadlockError, CollectiveTimeout, CommClosed)


def _bytes_of(buf: Any, *, writable: bool) -> memoryview:
    """Return a flat byte memoryview of a buffer-protocol object (or mpi4py-style [buf, type])."""
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        if writable and buf.readonly:  # the fast path: how the collectives pass their messages
            raise ValueError("receive buffer is read-only")
        return buf
    if isinstance(buf, (list, tuple)):  # [buf, MPI.DOUBLE] / [buf, count, MPI.DOUBLE]
        buf = buf[0]
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("message buffers must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError("receive buffer is read-only")
        # Through a uint8 view: any dtype exports bytes, and np.matrix stays 2-D otherwise.
        return buf.view(np.ndarray).reshape(-1).view(np.uint8).data
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("receive buffer is read-only")
    return view.cast("B")


class Status:
    """Source, tag and byte count of a received message (mpi4py's `MPI.Status` subset)."""

    def __init__(self) -> None:
        self.source = ANY_SOURCE
        self.tag = ANY_TAG
        self.count = 0

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_count(self, datatype: Any = None) -> int:
        """Number of bytes received (the default `datatype=MPI.BYTE` of mpi4py)."""
        return self.count


class _Message:
    """A small send whose bytes were copied aside when posted: complete, waiting to be matched."""

    __slots__ = ("rank", "tag", "seq", "data")
    done, awaited = True, False  # (a Request's own, in its slots)

    def __init__(self, rank: int, tag: int, seq: int, data: Any) -> None:  # bytes, or a view
        self.rank, self.tag, self.seq, self.data = rank, tag, seq, data


class Request(_Message):
    """A pending send or receive; `Wait` blocks until it completes (mpi4py's `Request` subset)."""

    # Slots: thousands of ranks create one or two of these per message.
    __slots__ = ("world", "kind", "peer", "context", "done", "awaited", "error", "source",
                 "received_tag", "count", "eager")  # fmt: skip

    def __init__(self, world: _World, rank: int, kind: str, peer: int, tag: int, context: int,
                 data: memoryview) -> None:  # fmt: skip
        self.world, self.rank, self.kind, self.peer = world, rank, kind, peer
        self.tag, self.context, self.data = tag, context, data
        self.seq = 0  # posting order, set when posted: the earliest match wins
        self.done = False
        self.awaited = False  # its rank sleeps until this (and its other requests) complete
        self.error: Exception | None = None
        self.source, self.received_tag, self.count = ANY_SOURCE, ANY_TAG, 0
        self.eager = False  # a send that may complete by copying its bytes aside

    def Test(self) -> bool:
        return self.done  # one attribute read: atomic, and set only after the bytes moved

    def Wait(self, status: Status | None = None) -> None:
        self.world.wait(self.rank, (self,), [])
        self.finish(status)

    def finish(self, status: Status | None) -> None:
        """Fill `status` from a completed receive and raise its error, if any."""
        if status is not None:
            status.source, status.tag, status.count = self.source, self.received_tag, self.count
        if self.error is not None:
            raise self.error

    def describe(self) -> str:
        peer = "any" if self.peer == ANY_SOURCE else self.peer
        tag = "any" if self.tag == ANY_TAG else self.tag
        where = "to" if self.kind == "send" else "from"
        ctx = "" if self.context % 2 == _P2P else " (collective)"  # a Dup's contexts: +2n
        return f"{self.kind} {where} {peer} tag {tag}{ctx}"


# Messages up to this size are copied under the world's lock (cheaper than taking it twice);
# longer ones outside it, by NumPy, which drops the GIL so that ranks copy in parallel.
_COPY_UNDER_LOCK = 1 << 16
# Sendrecv and Isend send messages up to this size eagerly (see the module's docstring): a rank
# runs on instead of handing the GIL to its receiver, the one cost that grew with P.
EAGER_BYTES = 1 << 16

Queues = dict[tuple[int, int], deque[Any]]  # (source, context) -> requests in posting order
Found = tuple[Any, deque[Any], int]  # a matching request, its queue and its place there


def _move(data: bytes | memoryview, into: memoryview) -> int:
    """Copy the bytes of a message into a receive buffer, as many as fit; how many."""
    nbytes = len(data)
    if nbytes > len(into):
        nbytes = len(into)
        into[:] = data[:nbytes]
    elif nbytes:
        into[:nbytes] = data
    return nbytes


def _check_tag(tag: int) -> None:
    """Refuse a send's tag outside 0..TAG_UB."""
    if not 0 <= tag <= TAG_UB:
        raise ValueError(f"invalid tag {tag}: must be in 0..{TAG_UB}")


def _truncation(rank: int, source: int, tag: int, sent: int, room: int) -> MessageTruncated:
    """The error of a message of `sent` bytes received into a buffer of `room` bytes."""
    return MessageTruncated(
        f"rank {rank} received {sent} bytes from rank {source} (tag {tag}) "
        f"into a buffer of {room} bytes"
    )


def _earliest(queues: Queues, keys: Any, tag: int) -> Found | None:
    """The earliest-posted request in `queues[key]` for `keys` that matches `tag` (or ANY_TAG)."""
    best = None
    for key in keys:
        queue = queues.get(key)
        if queue is None:
            continue
        for index, other in enumerate(queue):  # the head, unless tags are mixed on one queue
            if other.tag == tag or other.tag == ANY_TAG or tag == ANY_TAG:
                if best is None or other.seq < best[0].seq:
                    best = (other, queue, index)
                break
    return best


def _take(queues: Queues, key: tuple[int, int], found: Found) -> Request:
    """Remove a matched request from its queue (dropping the queue once empty) and return it."""
    request, queue, index = found
    if index:
        del queue[index]
    else:
        queue.popleft()
    if not queue:
        del queues[key]
    return request


class _World:
    """State shared by the thread ranks: unmatched sends, posted receives, sleepers, failures.

    One lock guards it all; each rank sleeps on its own gate (a lock held while it may sleep) and
    is woken only when every request it waits for has completed, or when the world fails.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.gates = [threading.Lock() for _ in range(size)]
        for gate in self.gates:
            gate.acquire()  # closed: a sleeping rank blocks on it until someone opens it
        self.sends: list[Queues] = [{} for _ in range(size)]  # unmatched, by destination
        self.recvs: list[Queues] = [{} for _ in range(size)]  # posted, by receiver
        self.outstanding = [0] * size  # requests a sleeping rank still waits for
        self.sleeping: dict[int, tuple[Request, ...]] = {}  # rank -> what it waits for
        self.seq = 0
        self.live = size  # ranks whose function has not returned yet
        self.copying = 0  # matched messages whose bytes are being copied outside the lock
        self.failure: tuple[int, BaseException] | None = None  # (rank, exception); -1: deadlock
        self.slots: list[Any] = [None] * size  # per-rank scratch for Allreduce
        self.total: Any = None  # Allreduce's result, computed once by rank 0
        self.opening: list[Any] = []  # gates to open once the lock is released; empty when free
        self.timeouts = [-1.0] * size  # seconds a rank waits before the world times out; -1: ever
        self.doing = [Doing() for _ in range(size)]  # what each rank is in, for the timeout
        # (call number, memory owner, array) of each rank's latest hand-written collective
        self.claims: list[tuple[int, Any, Any]] = [(0, None, None)] * size
        self.epoch = 0  # moves when a rank claims another array than last time: look again
        self.sharing: dict[int, str] = {}  # collective number -> why its buffers were refused

    # -- matching ---------------------------------------------------------------------------
    def post(self, requests: tuple[Request, ...]) -> list[Any]:
        """Match each request with its partner (copying the bytes) or queue it, in order.

        Returns the gates of the ranks this completed for, which the caller must open: best just
        before it sleeps itself, so that a woken rank finds the GIL free rather than waking twice.
        """
        large = []
        with self.lock:
            self._raise_if_failed(requests[0].rank)
            for req in requests:
                self.seq += 1
                req.seq = self.seq
                pair = self._match_send(req) if req.kind == "send" else self._match_recv(req)
                if pair is not None and not self._copy_small(*pair):
                    large.append(pair)
            opening, self.opening = self.opening, []
        for send, recv in large:
            self._copy_large(send, recv)
        return opening

    def _match_send(self, send: Request) -> tuple[Request, Request] | None:
        recvs, context = self.recvs[send.peer], send.context
        found = _earliest(recvs, ((send.rank, context), (ANY_SOURCE, context)), send.tag)
        if found is None:
            if send.eager and len(send.data) <= EAGER_BYTES:
                send.data = send.data.tobytes()  # the caller's buffer is free again
                send.done = True
            self.sends[send.peer].setdefault((send.rank, context), deque()).append(send)
            return None
        key = (found[0].peer, context)
        return send, _take(recvs, key, found)

    def _match_recv(self, recv: Request) -> tuple[Request, Request] | None:
        sends, context = self.sends[recv.rank], recv.context
        if not sends:
            found = None
        elif recv.peer == ANY_SOURCE:  # every source with a message waiting (rarely more than one)
            found = _earliest(sends, [key for key in sends if key[1] == context], recv.tag)
        else:
            found = _earliest(sends, ((recv.peer, context),), recv.tag)
        if found is None:
            self.recvs[recv.rank].setdefault((recv.peer, context), deque()).append(recv)
            return None
        return _take(sends, (found[0].rank, context), found), recv

    def _copy_small(self, send: Request, recv: Request) -> bool:
        """Copy a matched message now if it is small (True), else count it as copying (False)."""
        nbytes = min(len(send.data), len(recv.data))
        if nbytes > _COPY_UNDER_LOCK:
            self.copying += 1
            return False
        recv.data[:nbytes] = send.data[:nbytes]
        self._complete(send, recv, nbytes)
        return True

    def _copy_large(self, send: Request, recv: Request) -> None:
        """Copy a long message outside the lock, so that ranks move their bytes in parallel."""
        nbytes = min(len(send.data), len(recv.data))
        try:
            target = np.frombuffer(recv.data, np.uint8, nbytes)
            np.copyto(target, np.frombuffer(send.data, np.uint8, nbytes))
        finally:
            with self.lock:
                self.copying -= 1
                self._complete(send, recv, nbytes)
                opening, self.opening = self.opening, []
            for gate in opening:
                gate.release()

    def _complete(self, send: Request, recv: Request, nbytes: int) -> None:
        """Mark a matched pair done (with a truncation error if so) and wake whom it concerns."""
        self._deliver(recv, send.rank, send.tag, len(send.data), nbytes)
        if not send.done:  # an eager send was done when posted
            send.done = True
            if send.awaited:
                self._wake(send)

    def _deliver(self, recv: Request, source: int, tag: int, sent: int, nbytes: int) -> None:
        """Mark a receive done with `nbytes` of the `sent` bytes `source` sent; wake its rank."""
        recv.source, recv.received_tag, recv.count = source, tag, nbytes
        if sent > len(recv.data):
            recv.error = _truncation(recv.rank, source, tag, sent, len(recv.data))
        recv.done = True
        if recv.awaited:
            self._wake(recv)

    def _wake(self, req: Request) -> None:
        """One of the requests a rank sleeps on is done: open its gate if it was the last."""
        req.awaited = False
        rank = req.rank
        self.outstanding[rank] -= 1
        if self.outstanding[rank] == 0 and self.sleeping.pop(rank, ()):
            self.opening.append(self.gates[rank])  # opened by the caller, after the lock

    # -- Sendrecv of a small message from one source: the collectives' hot path ----------------
    def exchange(self, rank: int, out: memoryview, dest: int, tag: int, into: memoryview,
                 source: int, recvtag: int, status: Status | None,
                 context: int = _P2P) -> None:  # fmt: skip
        """Receive from `source` and send `out` (eagerly) under one lock; sleep at most once."""
        error = recv = None
        sleep = False
        with self.lock:
            if self.failure is not None:
                self._raise_if_failed(rank)
            send = self._arrived(rank, source, recvtag, context)
            if send is None:
                recv = self._queue_recv(rank, into, source, recvtag, context)
            else:
                error = self._take_in(send, rank, into, status)
            self._send_eagerly(rank, out, dest, tag, context)
            if recv is not None and not recv.done:  # a send to ourselves may have completed it
                self._sleep_on(rank, (recv,))
                sleep = True
            opening = self._opening()
        for gate in opening:
            gate.release()
        if sleep:  # even if done by now: its gate was opened, and must be closed again
            self._sleep(rank, (recv,))  # type: ignore[arg-type]
        if recv is not None:
            recv.finish(status)
        elif error is not None:
            raise error

    def _arrived(self, rank: int, source: int, tag: int, context: int) -> Request | None:
        """Take the earliest unmatched send from `source` to `rank` that `tag` accepts, if any."""
        sends = self.sends[rank]
        if not sends:
            return None
        key = (source, context)
        queue = sends.get(key)
        if queue is None:
            return None
        send = queue[0]
        if tag != ANY_TAG and send.tag != tag:  # mixed tags: look past the head
            found = _earliest(sends, (key,), tag)
            return None if found is None else _take(sends, key, found)
        queue.popleft()
        if not queue:
            del sends[key]
        return send

    def _take_in(self, send: Request, rank: int, into: memoryview,
                 status: Status | None) -> MessageTruncated | None:  # fmt: skip
        """Copy a matched send into `into` and complete it; the truncation error, if any."""
        data = send.data
        if len(data) == len(into):  # the usual case: a whole message into its buffer
            into[:] = data
            nbytes = len(data)
        else:
            nbytes = _move(data, into)
        if status is not None:
            status.source, status.tag, status.count = send.rank, send.tag, nbytes
        if not send.done:  # a synchronous send: its sender may go on now
            send.done = True
            if send.awaited:
                self._wake(send)
        if len(send.data) > len(into):
            return _truncation(rank, send.rank, send.tag, len(send.data), len(into))
        return None

    def _queue_recv(self, rank: int, into: memoryview, source: int, tag: int,
                    context: int) -> Request:  # fmt: skip
        """Post a receive nothing matches yet."""
        recv = Request(self, rank, "recv", source, tag, context, into)
        self.seq += 1
        recv.seq = self.seq
        self.recvs[rank].setdefault((source, context), deque()).append(recv)
        return recv

    def _send_eagerly(self, rank: int, out: memoryview, dest: int, tag: int,
                      context: int) -> None:  # fmt: skip
        """Copy `out` into the earliest receive posted for it, or queue a copy of it."""
        recvs = self.recvs[dest]
        if recvs:  # (usually not: the receiver is behind, or has taken a message already there)
            found = _earliest(recvs, ((rank, context), (ANY_SOURCE, context)), tag)
            if found is not None:
                recv = _take(recvs, (found[0].peer, context), found)
                self._deliver(recv, rank, tag, len(out), _move(out, recv.data))
                return
        self.seq += 1  # the caller's buffer is free again: its bytes are ours
        message = _Message(rank, tag, self.seq, out.tobytes())
        sends, key = self.sends[dest], (rank, context)
        queue = sends.get(key)
        if queue is None:
            sends[key] = deque((message,))
        else:
            queue.append(message)

    def _opening(self) -> list[Any] | tuple[()]:
        """Take the gates to open once the lock is released (never the list others append to)."""
        opening = self.opening
        if not opening:
            return ()
        self.opening = []
        return opening

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, rank: int, requests: tuple[Request, ...], opening: list[Any]) -> None:
        """Open the gates in `opening`, then block until all of `rank`'s `requests` complete."""
        try:
            if all(req.done for req in requests):  # no lock: `done` is set last, under the lock
                return
            with self.lock:
                self._raise_if_failed(rank)
                pending = tuple(req for req in requests if not req.done)
                if not pending:
                    return
                self._sleep_on(rank, pending)
        finally:
            for gate in opening:  # even when raising: those ranks' requests are done
                gate.release()
        self._sleep(rank, requests)

    def _sleep_on(self, rank: int, pending: tuple[Request, ...]) -> None:
        """Record (under the lock) that `rank` will sleep until its `pending` requests complete."""
        for req in pending:
            req.awaited = True
        self.outstanding[rank] = len(pending)
        self.sleeping[rank] = pending
        self._check_deadlock()

    def _sleep(self, rank: int, requests: tuple[Request, ...]) -> None:
        """Block on `rank`'s gate until its requests complete, or raise the world's failure."""
        timeout = self.timeouts[rank]
        if not self.gates[rank].acquire(True, timeout):  # opened once: completion, failure...
            self._expire(rank, timeout)  # ... or not in time
        if not all(req.done for req in requests):
            with self.lock:
                self._raise_if_failed(rank)

    def _expire(self, rank: int, timeout: float) -> None:
        """`rank` waited `timeout` seconds: fail the world, unless its gate opened just now."""
        with self.lock:
            if rank in self.sleeping:  # nobody is opening the gate: the wait timed out
                waits = self._waits()
                del self.sleeping[rank]
                failure = CollectiveTimeout(
                    f"collective timeout: no progress for {timeout:g} s (--timeout): {waits}"
                )
                self._fail(rank, failure)
                raise failure
        self.gates[rank].acquire()  # opened as we gave up: a wake-up, received at once

    def _waits(self) -> str:
        """What every sleeping rank waits in and for, in rank order."""
        frames = current_frames()  # once: every rank's frames
        return "; ".join(
            f"rank {rank} in {describe(self.doing[rank], _peers(requests), frames)}"
            for rank, requests in sorted(self.sleeping.items())
        )

    def _check_deadlock(self) -> None:
        """Every live rank sleeps and no bytes are moving: nobody can proceed."""
        if self.failure is None and self.copying == 0 and 0 < len(self.sleeping) >= self.live:
            waits = "; ".join(
                f"rank {rank}: " + " and ".join(req.describe() for req in requests)
                for rank, requests in sorted(self.sleeping.items())
            )
            self._fail(-1, DeadlockError(f"deadlock: every rank is waiting ({waits})"))

    def _fail(self, rank: int, exc: BaseException) -> None:
        """Record the world's failure and wake every sleeping rank to raise it."""
        self.failure = (rank, exc)
        for sleeper in self.sleeping:
            self.gates[sleeper].release()
        self.sleeping.clear()

    def _raise_if_failed(self, rank: int) -> None:
        if self.failure is None:
            return
        failed_rank, failure = self.failure
        if isinstance(failure, _WORLD_FAILURES):
            raise type(failure)(str(failure))
        raise RankAborted(f"rank {rank} stopped because rank {failed_rank} failed: {failure!r}")

    # -- rank life cycle --------------------------------------------------------------------
    def finish(self, rank: int, exc: BaseException | None) -> None:
        """Record that a rank's function returned (or raised) and wake anyone it leaves stuck."""
        with self.lock:
            self.live -= 1
            if exc is not None and self.failure is None and not isinstance(exc, CommError):
                self._fail(rank, exc)
            else:
                self._check_deadlock()

    def close(self) -> None:
        """`run_threads` has returned: any later call on this world's communicators raises."""
        with self.lock:
            self._fail(-1, CommClosed(
                "this thread communicator's run_threads has returned: a communicator is "
                "usable only inside the function run_threads runs"
            ))  # fmt: skip


def _owner(array: np.ndarray) -> Any:
    """The array that owns `array`'s memory, or the foreign object (bytes, mmap) that does."""
    base = array.base
    while isinstance(base, np.ndarray):
        array, base = base, base.base
    return array if base is None else base


def _sharing(claims: list[tuple[int, Any, Any]], me: int, number: int) -> int | None:
    """A rank whose buffer in call `number` shares memory with rank `me`'s, or None.

    Only the same call counts: a rank cannot finish a call before every rank has claimed in it,
    so of two ranks that share memory the later sees the earlier (nothing is released). A rank
    not in the call yet will look at ours; if it finds sharing, the call fails on every rank.
    """
    _, owner, array = claims[me]
    foreign = not isinstance(owner, np.ndarray)
    for rank, (called, other_owner, other) in enumerate(claims):
        # Arrays that own their memory are disjoint: views of different ones never overlap, so
        # NumPy compares bounds (of C-contiguous arrays: their bytes) only when needed.
        maybe = other_owner is owner or foreign or not isinstance(other_owner, np.ndarray)
        if called == number and maybe and rank != me and np.may_share_memory(array, other):
            return rank
    return None


def _peers(requests: tuple[Request, ...]) -> str:
    """Whom pending requests wait for: the ranks they receive from, else those they send to."""
    sources = {req.peer for req in requests if req.kind == "recv"}
    if sources:
        return " or ".join("any rank" if p == ANY_SOURCE else f"rank {p}" for p in sorted(sources))
    return " and ".join(f"rank {p} to receive" for p in sorted({req.peer for req in requests}))


class _RankThread(threading.local):
    """The world whose rank this thread is (None: a thread run_threads did not start)."""

    world: _World | None = None


_rank_thread = _RankThread()


class ThreadComm:
    """One rank's handle on a world of thread ranks, with mpi4py's upper-case buffer methods."""

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._p2p = _P2P  # the context of this communicator's point-to-point messages
        self._collectives = 0  # hand-written collectives entered (`claim`): names a call
        self._buf: Any = None  # the caller's array of the last claim, its memory's owner, and
        self._owner: Any = None  # the world's epoch when this rank last found no sharing
        self._epoch = -1
        self.attributes: dict[str, Any] = {}  # MPI's attribute caching: kept on Dup

    def __repr__(self) -> str:
        return f"ThreadComm(rank={self._rank}, size={self._world.size})"

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._world.size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def set_timeout(self, seconds: float | None) -> float | None:
        """Fail the world when this rank waits longer than `seconds` (None or 0: never); the
        previous setting."""
        seconds = timeout_seconds(seconds, "set_timeout")
        timeouts = self._world.timeouts
        previous = None if timeouts[self._rank] < 0 else timeouts[self._rank]
        timeouts[self._rank] = min(seconds, threading.TIMEOUT_MAX) if seconds else -1.0
        return previous

    def Dup(self) -> ThreadComm:
        """The same ranks in message contexts of their own (MPI's Dup): a collective call, so
        every rank's n-th Dup gets the same contexts. Its Allreduce and Barrier share the world's
        slots: a rank must not be in collectives on both communicators at once."""
        self._check_caller()
        made = self._world.__dict__.setdefault("duplicates", [0] * self._world.size)
        made[self._rank] += 1
        duplicate = _Duplicate(self._world, self._rank, 2 * made[self._rank])
        duplicate.attributes = dict(self.attributes)
        return duplicate

    def _check_caller(self) -> None:
        """Refuse a call from a rank of another world (an inner run_threads' rank calling its
        outer rank's communicator): the ranks of this world would never match it."""
        world = _rank_thread.world
        if world is not None and world is not self._world:
            raise ValueError(
                f"{self!r} was called from a rank of another run_threads (an inner one?): a "
                "thread communicator serves only the ranks of the run_threads that made it; "
                "call the communicator your own rank function was given"
            )

    # -- buffers of the hand-written collectives --------------------------------------------
    def claim(self, array: np.ndarray | None, buf: Any, name: str) -> str | None:
        """Record `array`, the flat view of the caller's `buf` (None: unusable), as this rank's
        buffer for its next collective; why not, if another rank's shares memory with it."""
        self._check_caller()
        number = self._collectives = self._collectives + 1  # every rank counts calls alike
        if array is None or array.size == 0:
            return None  # the slot keeps an older call's number: never compared
        world, me = self._world, self._rank
        if buf is self._buf:  # the caller's array of last time: same memory, known owner
            world.claims[me] = number, self._owner, array
            # No rank has passed another array since a look that found no sharing, and no
            # call has failed since: the ranks' arrays are those already compared.
            if world.epoch == self._epoch:
                return None
        else:
            self._buf, self._owner = buf, _owner(array)
            world.claims[me] = number, self._owner, array  # written before the epoch moves
            world.epoch += 1
        self._epoch = world.epoch
        rank = _sharing(world.claims, me, number)
        if rank is None:
            return None
        self._epoch = -1  # look again next time
        return self._refuse(name, rank)

    def _refuse(self, name: str, rank: int) -> str:
        """Why this rank's buffer is refused: it shares memory with `rank`'s, now in flight."""
        why = (
            f"{name}: rank {self._rank}'s array shares memory with rank {rank}'s; "
            "thread ranks share one address space: give each its own array"
        )
        world, number = self._world, self._collectives
        # Ranks are at most one call apart: the notes of older calls go.
        world.sharing = {n: w for n, w in world.sharing.items() if n >= number - 1}
        world.sharing[number] = why
        return why

    def failed(self) -> str | None:
        """This rank's collective failed: look for sharing again next time. Why, if a rank
        found shared memory in it."""
        self._epoch = -1  # a verdict that counted on another rank's look is void
        return self._world.sharing.get(self._collectives)

    # -- point to point ---------------------------------------------------------------------
    def _check_peer(self, peer: int, *, any_ok: bool) -> None:
        if not (0 <= peer < self._world.size or (any_ok and peer == ANY_SOURCE)):
            raise ValueError(f"invalid rank {peer} for a communicator of size {self._world.size}")

    def _request(self, kind: str, buf: Any, peer: int, tag: int, context: int) -> Request:
        """A checked request, not yet posted."""
        self._check_caller()
        self._check_peer(peer, any_ok=kind == "recv")
        if kind == "send":
            _check_tag(tag)
        data = _bytes_of(buf, writable=kind == "recv")
        return Request(self._world, self._rank, kind, peer, tag, context, data)

    def _post(self, kind: str, buf: Any, peer: int, tag: int, context: int,
              eager: bool = False) -> Request:  # fmt: skip
        """Post a request and return it at once (Isend, Irecv; Bcast's sends, synchronous)."""
        req = self._request(kind, buf, peer, tag, context)
        req.eager = eager
        for gate in self._world.post((req,)):
            gate.release()
        return req

    def _call(self, kind: str, buf: Any, peer: int, tag: int, context: int,
              status: Status | None = None) -> None:  # fmt: skip
        """Post a request and wait for it (Send, Recv): whom it woke runs once we sleep."""
        req = self._request(kind, buf, peer, tag, context)
        world = self._world
        world.wait(self._rank, (req,), world.post((req,)))
        req.finish(status)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        return self._post("send", buf, dest, tag, _P2P, eager=True)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return self._post("recv", buf, source, tag, _P2P)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._call("send", buf, dest, tag, _P2P)

    def Recv(
        self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> None:
        self._call("recv", buf, source, tag, _P2P, status)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        # Both checked before either is posted; posted under one lock, waited for in one sleep.
        self._check_caller()
        into, out = _bytes_of(recvbuf, writable=True), _bytes_of(sendbuf, writable=False)
        self._check_peer(source, any_ok=True)
        self._check_peer(dest, any_ok=False)
        _check_tag(sendtag)
        self.exchange(out, dest, sendtag, into, source, recvtag, status)

    def exchange(self, sendbuf: memoryview, dest: int, sendtag: int, recvbuf: memoryview,
                 source: int, recvtag: int, status: Status | None) -> None:  # fmt: skip
        """`Sendrecv` of flat byte views to and from valid ranks, unchecked: the executor's."""
        world, rank, context = self._world, self._rank, self._p2p
        if len(sendbuf) <= EAGER_BYTES and source != ANY_SOURCE:
            world.exchange(rank, sendbuf, dest, sendtag, recvbuf, source, recvtag, status, context)
            return
        recv = Request(world, rank, "recv", source, recvtag, context, recvbuf)
        send = Request(world, rank, "send", dest, sendtag, context, sendbuf)
        send.eager = True  # (if short enough: a receive from any source)
        world.wait(rank, (recv, send), world.post((recv, send)))
        recv.finish(status)

    # -- collectives (built on point-to-point messages in their own context) ----------------
    def Barrier(self) -> None:
        """Everyone reports to rank 0, then rank 0 releases everyone."""
        empty = np.empty(0, np.uint8)
        if self._rank == 0:
            for source in range(1, self.size):
                self._call("recv", empty, source, 0, _COLL)
            for dest in range(1, self.size):
                self._call("send", empty, dest, 0, _COLL)
        else:
            self._call("send", empty, 0, 0, _COLL)
            self._call("recv", empty, 0, 0, _COLL)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """Root sends its buffer to every other rank."""
        self._check_peer(root, any_ok=False)
        if self._rank == root:
            requests = [
                self._post("send", buf, dest, 1, _COLL) for dest in range(self.size) if dest != root
            ]
            for req in requests:
                req.Wait()
        else:
            self._call("recv", buf, root, 1, _COLL)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Plain NumPy reduction of all ranks' buffers, in rank order, copied to every rank."""
        self._check_caller()
        ufunc = _REDUCE[_op_name(op)]
        out = np.asarray(recvbuf[0] if isinstance(recvbuf, (list, tuple)) else recvbuf)
        source = out if _is_in_place(sendbuf) else np.asarray(sendbuf)
        if source.shape != out.shape:
            raise ValueError("Allreduce: send and receive buffers differ in shape")
        world = self._world
        world.slots[self._rank] = source
        self.Barrier()  # every rank has published its buffer
        if self._rank == 0:  # reduced once, not on every rank: O(P) work, not O(P^2)
            total = np.array(world.slots[0], copy=True)
            for contribution in world.slots[1:]:
                ufunc(total, contribution, out=total)
            world.total = total  # a new array each call: nobody still reads the last one
        self.Barrier()  # the total is ready; every buffer was read, so they may be overwritten
        out[...] = world.total


class _Duplicate(ThreadComm):
    """A `ThreadComm.Dup`: its messages travel in contexts shifted by `shift`."""

    def __init__(self, world: _World, rank: int, shift: int) -> None:
        super().__init__(world, rank)
        self._shift = shift
        self._p2p = _P2P + shift  # Sendrecv and exchange: eager, in this communicator's context

    def _request(self, kind: str, buf: Any, peer: int, tag: int, context: int) -> Request:
        return super()._request(kind, buf, peer, tag, context + self._shift)


def _op_name(op: Any) -> str:
    """Map SUM/MAX/MIN given as strings or as mpi4py's `MPI.Op` objects to their names."""
    if isinstance(op, str) and op in _REDUCE:
        return op
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        for name in _REDUCE:
            if op == getattr(mpi, name.upper()):
                return name
    raise ValueError(f"unsupported reduction operation {op!r} (use SUM, MAX or MIN)")


def _is_in_place(buf: Any) -> bool:
    if buf is IN_PLACE:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and buf is mpi.IN_PLACE


# -- how many thread ranks this machine holds -------------------------------------------------

SMALL_WORLD = 64  # up to this many ranks, threads keep the platform's default stack
RANK_STACK_BYTES = 1 << 20  # beyond: 1 MiB each (Numba compiles fine in 256 KiB; see the docs)
RANK_BYTES = 64 * 1024  # resident bytes an idle thread rank costs, rounded up from measurements
# What a rank's collectives keep per peer: the ring's per-thread plan holds 2(P-1) steps, measured
# at about 1.7 KiB per peer - so a world's memory grows as P^2 and 5000 ranks would need ~40 GiB.
PEER_BYTES = 2 * 1024
_SPARE_THREADS = 64  # threads left for everything else (BLAS, Numba, the rest of the machine)


def _thread_room() -> tuple[int, str] | None:
    """How many more threads this process may start, and which limit says so (Linux)."""
    rooms = []
    total = numbers("/proc/loadavg")  # "0.1 0.2 0.3 running/total last-pid": threads in use
    in_use = total[4] if total and len(total) > 4 else 0
    for path in ("/proc/sys/kernel/threads-max", "/proc/sys/kernel/pid_max"):
        limit = numbers(path)
        if limit:
            rooms.append((limit[0] - in_use, path))
    pids = cgroup("pids")
    if pids is not None:
        rooms.append((pids[0] - pids[1], "the cgroup's pids.max"))
    nproc = _rlimit("RLIMIT_NPROC")
    if nproc is not None and os.geteuid() != 0:  # root is not held to it
        rooms.append((nproc - in_use, "RLIMIT_NPROC (ulimit -u)"))
    return min(rooms) if rooms else None


def _rlimit(name: str) -> int | None:
    """The soft limit `resource.<name>` of this process, or None if unlimited or unknown."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft = resource.getrlimit(getattr(resource, name))[0]
    return None if soft == resource.RLIM_INFINITY else soft


def stack_bytes(size: int) -> int:
    """The stack size the threads of a world of `size` ranks get (0: the platform's default)."""
    return 0 if size <= SMALL_WORLD else RANK_STACK_BYTES


def capacity_problem(size: int, rank_bytes: int = 0) -> str | None:
    """Why this machine cannot hold `size` thread ranks using `rank_bytes` each, or None."""
    threads = _thread_room()
    if threads is not None and size > threads[0] - _SPARE_THREADS:
        return f"{threads[1]} leaves room for about {max(threads[0] - _SPARE_THREADS, 0)} threads"
    per_rank = RANK_BYTES + PEER_BYTES * size + rank_bytes
    for room, what in memory_rooms():
        if size * per_rank > room:
            return (f"they need about {size * per_rank / 2**20:.0f} MiB "
                    f"({per_rank / 2**10:.0f} KiB per rank), more than the "
                    f"{room / 2**20:.0f} MiB of {what}")  # fmt: skip
    return _address_problem(size)


def _address_problem(size: int) -> str | None:
    """Why the stacks of `size` rank threads do not fit the address-space or commit limits."""
    stack = stack_bytes(size) or _rlimit("RLIMIT_STACK") or 8 << 20
    need = size * stack
    address = _rlimit("RLIMIT_AS")
    if address is not None and need > address:
        return f"their stacks need {need / 2**20:.0f} MiB, more than RLIMIT_AS (ulimit -v)"
    strict = numbers("/proc/sys/vm/overcommit_memory") == [2]
    commit, committed = meminfo("CommitLimit"), meminfo("Committed_AS")
    if strict and commit is not None and committed is not None and need > commit - committed:
        return f"their stacks need {need / 2**20:.0f} MiB, more than the commit limit left"
    return None


def check_capacity(size: int, rank_bytes: int = 0) -> None:
    """Refuse, in one line, a world this machine cannot hold (threads, memory); see the docs.

    `rank_bytes`: what each rank's own work adds (model copies, shards), if the caller knows.
    """
    problem = capacity_problem(size, rank_bytes)
    if problem is not None:
        raise ValueError(
            f"cannot run {size} thread ranks on this machine: {problem}; "
            "use fewer ranks, or the MPI backend"
        )


_START_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore
# Beyond SMALL_WORLD ranks, many threads may be ready and waiting for the GIL; each waiter asks the
# holder to drop it every switch interval (5 ms by default). With rendezvous sends the forced
# switches cost about 20% of the time per message at P = 256; with eager sends 5, 50 and 500 ms
# measure alike, and 0.5 ms three to five times slower. Large worlds run with this interval.
LARGE_WORLD_SWITCH_INTERVAL = 0.05


def _start(threads: list[threading.Thread], size: int) -> BaseException | None:
    """Start the rank threads with their stack size; the error that stopped it, if any."""
    with _START_LOCK:
        previous = threading.stack_size(stack_bytes(size))
        try:
            for thread in threads:
                thread.start()
        except (RuntimeError, MemoryError) as exc:  # "can't start new thread"
            return exc
        finally:
            threading.stack_size(previous)
    return None


def _name_failure(errors: list[BaseException | None], size: int) -> BaseException | None:
    """The lowest failing rank's exception with a note naming it (the cause, not the released)."""
    failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
    if not failed:
        return None
    primary = [(r, e) for r, e in failed if not isinstance(e, RankAborted)]
    rank, exc = (primary or failed)[0]
    note = f"(raised on rank {rank} of {size}, threads backend)"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: the same attribute, which tracebacks there do not print
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    return exc


# After a timeout, the ranks that were not waiting (stuck in their own code) get this long to end;
# then run_threads raises without them (their threads are daemons).
TIMEOUT_GRACE = 2.0


def _join(thread: threading.Thread, world: _World) -> None:
    """Wait for a rank's thread; after a timeout, only for TIMEOUT_GRACE seconds."""
    while thread.is_alive():
        failure = world.failure
        if failure is not None and isinstance(failure[1], CollectiveTimeout):
            thread.join(TIMEOUT_GRACE)
            return
        thread.join(_JOIN_POLL)


_JOIN_POLL = 0.5  # how often a join looks whether the world has timed out


def run_threads(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(comm, *args, **kwargs)` on `size` thread ranks; return the results in rank order.

    If a rank raises, the other ranks are released from any communication call and the exception
    of the lowest failing rank is re-raised here with a note naming that rank. A world larger
    than the machine holds is refused up front (`check_capacity`).
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {size!r}")
    if size > SMALL_WORLD:  # a few small worlds always fit: no /proc reads on the common path
        check_capacity(int(size))
    world = _World(int(size))
    results: list[Any] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def rank_main(rank: int) -> None:
        exc: BaseException | None = None
        bind(world.doing[rank])
        _rank_thread.world = world
        try:
            results[rank] = fn(ThreadComm(world, rank), *args, **kwargs)
        except BaseException as caught:  # noqa: BLE001 - reported to the caller below
            exc = errors[rank] = caught
        finally:
            world.finish(rank, exc)

    threads = [
        threading.Thread(target=rank_main, args=(rank,), name=f"syncsgd-rank-{rank}", daemon=True)
        for rank in range(world.size)
    ]
    interval = sys.getswitchinterval()
    if world.size > SMALL_WORLD:
        sys.setswitchinterval(max(interval, LARGE_WORLD_SWITCH_INTERVAL))
    try:
        refused = _start(threads, world.size)
        started = [thread for thread in threads if thread.ident is not None]
        if refused is not None:  # release the started ranks as if the first unstarted one failed
            for rank in range(len(started), world.size):
                world.finish(rank, refused)
        for thread in started:
            _join(thread, world)
    finally:
        sys.setswitchinterval(interval)
        world.close()
    if refused is not None:
        raise RuntimeError(
            f"could start only {len(started)} of {world.size} thread ranks ({refused}); "
            "use fewer ranks"
        ) from refused
    failure = _name_failure(errors, world.size)
    if failure is not None:
        raise failure
    return results
