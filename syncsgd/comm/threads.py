"""Communicators: P ranks as threads with mpi4py's buffer methods, or MPI's own COMM_WORLD.

`ThreadComm` implements the buffer subset of mpi4py's `Comm` that syncsgd uses (`Get_rank`,
`Get_size`, `Send`, `Recv`, `Isend`, `Irecv`, `Sendrecv`, `Barrier`, `Bcast`, `Allreduce`) with
MPI's semantics, so the collectives are written once and run on either communicator:

- Point-to-point messages match on (source, tag) in posting order and never overtake each other.
- Every send is *synchronous* (rendezvous): the bytes are copied straight from the send buffer into
  the matching receive buffer, and `Send` returns once that copy is done, so a send buffer may be
  reused as soon as the call returns. A program that relies on MPI buffering small messages
  therefore deadlocks here too - and the deadlock is *detected* and raised on every rank
  (`DeadlockError`) instead of hanging.
- A message longer than its receive buffer raises `MessageTruncated` (MPI_ERR_TRUNCATE); the
  message is consumed, as in MPI.
- If any rank fails, every rank blocked in (or later entering) a communication call raises
  `RankAborted`, so `run_threads` always returns or raises - never hangs.

mpi4py is imported lazily: nothing here needs an MPI library unless the MPI backend is chosen.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


def _bytes_of(buf: Any, *, writable: bool) -> np.ndarray:
    """Return a flat uint8 view of a buffer-protocol object (or mpi4py-style [buf, type] list)."""
    if isinstance(buf, (list, tuple)):  # [buf, MPI.DOUBLE] / [buf, count, MPI.DOUBLE]
        buf = buf[0]
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("message buffers must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError("receive buffer is read-only")
        return buf.view(np.ndarray).reshape(-1).view(np.uint8)  # np.matrix stays 2-D otherwise
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("receive buffer is read-only")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


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


@dataclass(eq=False)
class Request:
    """A pending send or receive; `Wait` blocks until it completes (mpi4py's `Request` subset)."""

    world: _World
    rank: int
    kind: str  # "send" or "recv"
    peer: int
    tag: int
    context: int
    data: np.ndarray  # uint8 view of the user's buffer
    done: bool = False
    error: Exception | None = None
    status: Status = field(default_factory=Status)

    def Test(self) -> bool:
        with self.world.cond:
            return self.done

    def Wait(self, status: Status | None = None) -> None:
        self.world.wait(self, status)

    def describe(self) -> str:
        peer = "any" if self.peer == ANY_SOURCE else self.peer
        tag = "any" if self.tag == ANY_TAG else self.tag
        where = "to" if self.kind == "send" else "from"
        ctx = "" if self.context == _P2P else " (collective)"
        return f"{self.kind} {where} {peer} tag {tag}{ctx}"


class _World:
    """State shared by the thread ranks: unmatched sends, posted receives, failures."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition(threading.Lock())
        self.unmatched_sends: list[list[Request]] = [[] for _ in range(size)]  # by destination
        self.posted_recvs: list[list[Request]] = [[] for _ in range(size)]  # by receiver
        self.blocked: dict[int, Request] = {}  # rank -> request it waits for
        self.live = size  # ranks whose function has not returned yet
        self.copying = 0  # matched messages whose bytes are being copied outside the lock
        self.failure: tuple[int, BaseException] | None = None  # (rank, exception); -1: deadlock
        self.slots: list[Any] = [None] * size  # per-rank scratch for Allreduce

    # -- matching ---------------------------------------------------------------------------
    @staticmethod
    def _accepts(recv: Request, send: Request) -> bool:
        return (
            recv.context == send.context
            and recv.peer in (ANY_SOURCE, send.rank)
            and recv.tag in (ANY_TAG, send.tag)
        )

    def post(self, req: Request) -> Request:
        """Queue a request, or match it with its partner and copy the bytes."""
        with self.cond:
            self._raise_if_failed(req.rank)
            if req.kind == "send":
                queue = self.posted_recvs[req.peer]
                match = next((r for r in queue if self._accepts(r, req)), None)
                if match is None:
                    self.unmatched_sends[req.peer].append(req)
                    return req
                queue.remove(match)
                send, recv = req, match
            else:
                queue = self.unmatched_sends[req.rank]
                match = next((s for s in queue if self._accepts(req, s)), None)
                if match is None:
                    self.posted_recvs[req.rank].append(req)
                    return req
                queue.remove(match)
                send, recv = match, req
            self.copying += 1
        # Copy outside the lock so that ranks move their bytes in parallel (numpy drops the GIL).
        nbytes = min(send.data.size, recv.data.size)
        try:
            recv.data[:nbytes] = send.data[:nbytes]
        finally:
            with self.cond:
                self.copying -= 1
                recv.status.source, recv.status.tag, recv.status.count = send.rank, send.tag, nbytes
                if send.data.size > recv.data.size:
                    recv.error = MessageTruncated(
                        f"rank {recv.rank} received {send.data.size} bytes from rank {send.rank} "
                        f"(tag {send.tag}) into a buffer of {recv.data.size} bytes"
                    )
                send.done = recv.done = True
                self.cond.notify_all()
        return req

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, req: Request, status: Status | None = None) -> None:
        """Block until `req` completes; raise if another rank failed or all ranks are stuck."""
        with self.cond:
            while not req.done:
                self._raise_if_failed(req.rank)
                self.blocked[req.rank] = req
                try:
                    self._check_deadlock()
                    self._raise_if_failed(req.rank)
                    self.cond.wait()
                finally:
                    del self.blocked[req.rank]
        if status is not None:
            status.source, status.tag, status.count = (
                req.status.source,
                req.status.tag,
                req.status.count,
            )
        if req.error is not None:
            raise req.error

    def _check_deadlock(self) -> None:
        """Every live rank waits, no bytes are moving, and nothing is done: nobody can proceed."""
        stuck = (
            self.copying == 0
            and len(self.blocked) == self.live
            and not any(r.done for r in self.blocked.values())
        )
        if stuck and self.failure is None:
            waits = "; ".join(f"rank {k}: {r.describe()}" for k, r in sorted(self.blocked.items()))
            self.failure = (-1, DeadlockError(f"deadlock: every rank is waiting ({waits})"))
            self.cond.notify_all()

    def _raise_if_failed(self, rank: int) -> None:
        if self.failure is None:
            return
        failed_rank, failure = self.failure
        if isinstance(failure, DeadlockError):
            raise DeadlockError(str(failure))
        raise RankAborted(f"rank {rank} stopped because rank {failed_rank} failed: {failure!r}")

    # -- rank life cycle --------------------------------------------------------------------
    def finish(self, rank: int, exc: BaseException | None) -> None:
        """Record that a rank's function returned (or raised) and wake anyone it leaves stuck."""
        with self.cond:
            self.live -= 1
            if exc is not None and self.failure is None and not isinstance(exc, CommError):
                self.failure = (rank, exc)
            if self.blocked:
                self._check_deadlock()
            self.cond.notify_all()


class ThreadComm:
    """One rank's handle on a world of thread ranks, with mpi4py's upper-case buffer methods."""

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self._rank = rank

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

    # -- point to point ---------------------------------------------------------------------
    def _check_peer(self, peer: int, *, any_ok: bool) -> None:
        if not (0 <= peer < self._world.size or (any_ok and peer == ANY_SOURCE)):
            raise ValueError(f"invalid rank {peer} for a communicator of size {self._world.size}")

    def _request(self, kind: str, buf: Any, peer: int, tag: int, context: int) -> Request:
        self._check_peer(peer, any_ok=kind == "recv")
        if kind == "send" and not 0 <= tag <= TAG_UB:
            raise ValueError(f"invalid tag {tag}: must be in 0..{TAG_UB}")
        data = _bytes_of(buf, writable=kind == "recv")
        req = Request(self._world, self._rank, kind, peer, tag, context, data)
        return self._world.post(req)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        return self._request("send", buf, dest, tag, _P2P)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return self._request("recv", buf, source, tag, _P2P)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.Isend(buf, dest, tag).Wait()

    def Recv(
        self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> None:
        self.Irecv(buf, source, tag).Wait(status)

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
        self._check_peer(dest, any_ok=False)  # before posting the receive, which cannot be undone
        recv = self.Irecv(recvbuf, source, recvtag)
        send = self.Isend(sendbuf, dest, sendtag)
        try:
            recv.Wait(status)
        finally:
            send.Wait()

    # -- collectives (built on point-to-point messages in their own context) ----------------
    def Barrier(self) -> None:
        """Everyone reports to rank 0, then rank 0 releases everyone."""
        empty = np.empty(0, np.uint8)
        if self._rank == 0:
            for source in range(1, self.size):
                self._request("recv", empty, source, 0, _COLL).Wait()
            for dest in range(1, self.size):
                self._request("send", empty, dest, 0, _COLL).Wait()
        else:
            self._request("send", empty, 0, 0, _COLL).Wait()
            self._request("recv", empty, 0, 0, _COLL).Wait()

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """Root sends its buffer to every other rank."""
        self._check_peer(root, any_ok=False)
        if self._rank == root:
            requests = [
                self._request("send", buf, dest, 1, _COLL)
                for dest in range(self.size)
                if dest != root
            ]
            for req in requests:
                req.Wait()
        else:
            self._request("recv", buf, root, 1, _COLL).Wait()

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Plain NumPy reduction of all ranks' buffers, in rank order, on every rank."""
        ufunc = _REDUCE[_op_name(op)]
        out = np.asarray(recvbuf[0] if isinstance(recvbuf, (list, tuple)) else recvbuf)
        source = out if _is_in_place(sendbuf) else np.asarray(sendbuf)
        if source.shape != out.shape:
            raise ValueError("Allreduce: send and receive buffers differ in shape")
        world = self._world
        world.slots[self._rank] = source
        self.Barrier()  # every rank has published its buffer
        total = np.array(world.slots[0], copy=True)
        for contribution in world.slots[1:]:
            ufunc(total, contribution, out=total)
        self.Barrier()  # every rank has read every buffer; now they may be overwritten
        out[...] = total


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


def run_threads(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(comm, *args, **kwargs)` on `size` thread ranks; return the results in rank order.

    If a rank raises, the other ranks are released from any communication call and the exception
    of the lowest failing rank is re-raised here with a note naming that rank.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {size!r}")
    world = _World(int(size))
    results: list[Any] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def rank_main(rank: int) -> None:
        exc: BaseException | None = None
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
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
    if failed:
        # The rank that caused the failure, not the ranks that were merely released by it.
        primary = [(r, e) for r, e in failed if not isinstance(e, RankAborted)]
        rank, exc = (primary or failed)[0]
        note = f"(raised on rank {rank} of {world.size}, threads backend)"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python 3.10: the same attribute, which tracebacks there do not print
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
        raise exc
    return results
