"""The collective timeout: what each rank is doing, and a watchdog that ends a job stuck in one.

Every rank keeps a `Doing` record of the named collective it is in (`watching` blocks, the
library's allreduce) and of its training step. The hand-written allreduces record nothing - their
hot loop must not slow down: the watchdog finds them in the thread's frames (`_take_steps`), and
reads their plan and current step from that frame only when it reports.
Thread ranks time out in their own waits (`ThreadComm.set_timeout`); an MPI process cannot leave
a blocking call, so a watchdog thread reads the record, tells the other ranks on a communicator of
its own (`ReportChannel`), and the lowest rank that timed out prints one line for the job and
calls `Abort`: docs/thread-backend.md.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from syncsgd.util.lines import print_line

# A rank that timed out hears this long from the other ranks stuck by the same hang (they time
# out within a sampling interval of each other) before the lowest of them ends the job.
ABORT_GRACE = 2.0
_LONGEST_POLL = 1.0  # the watchdog looks at least this often (and ten times per timeout)


class Doing:
    """What one rank is doing: the collective it is in (None between), its step, its peer."""

    __slots__ = ("calls", "what", "peer", "during", "thread")

    def __init__(self) -> None:
        self.calls = 0  # named collectives entered: progress the watchdog can see
        self.what: str | None = None  # the named collective it is in; None: in none
        self.peer: int | None = None  # whom a named call waits for; None: any or every rank
        self.during: int | None = None  # the training step, if training
        self.thread = threading.get_ident()  # the thread whose record it is


class _Records(threading.local):
    """Each thread's record; a thread rank's is bound to its world's (`bind`)."""

    def __init__(self) -> None:
        self.doing = Doing()


records = _Records()  # `records.doing`: this thread's record (the collectives read it per call)


def bind(doing: Doing) -> None:
    """Make `doing` this thread's record (a thread rank: its world reads it when it times out)."""
    doing.thread = threading.get_ident()
    records.doing = doing


def current() -> Doing:
    """This thread's record."""
    return records.doing


class watching:  # noqa: N801 - used as a context manager, like contextlib's
    """Within: this thread is in the collective `what`, waiting for `peer` (None: any rank)."""

    __slots__ = ("doing", "what", "peer", "previous")

    def __init__(self, what: str, peer: int | None = None) -> None:
        self.what, self.peer = what, peer

    def __enter__(self) -> None:
        doing = self.doing = records.doing
        self.previous = doing.what, doing.peer
        doing.calls += 1
        doing.what, doing.peer = self.what, self.peer

    def __exit__(self, *exc: object) -> None:
        doing = self.doing
        doing.what, doing.peer = self.previous


# The hand-written collectives' loops (a short ring's, and every other), whose locals `plan`,
# `step` we read.
_EXECUTORS = ("_gathered", "_take_steps")


def current_frames() -> dict[int, Any]:
    """Every thread's innermost frame (CPython's `sys._current_frames`; elsewhere none)."""
    frames = getattr(sys, "_current_frames", None)
    return frames() if frames is not None else {}


def executor_frame(doing: Doing, frames: dict[int, Any] | None = None) -> Any:
    """The frame of the hand-written collective the record's thread is in, or None."""
    frame = (current_frames() if frames is None else frames).get(doing.thread)
    while frame is not None and frame.f_code.co_name not in _EXECUTORS:
        frame = frame.f_back
    return frame


def in_collective(doing: Doing) -> Any:
    """What shows progress in the collective the rank is in (None: in none): a named call's
    number, or the executor's frame (a new one per call)."""
    frame = executor_frame(doing)
    if frame is not None:
        return frame
    return None if doing.what is None else doing.calls


# Duck-typed below: the executor's Plan (.name, .steps) and PlannedStep (.source, .dest, .about
# with .phase and .step); this layer does not import them.


def describe(doing: Doing, awaited: str | None = None, frames: dict[int, Any] | None = None) -> str:
    """Where a rank is and whom it waits for (`awaited`, if the caller knows better), e.g.
    "ring_allreduce (reduce-scatter step 0) at training step 3, waiting for rank 1"."""
    frame = executor_frame(doing, frames)
    step = plan = None
    if frame is not None:
        local = frame.f_locals  # only now, when reporting
        plan, step = local.get("plan"), local.get("step")
    where = plan.name if plan is not None else doing.what or "a communication call"
    if step is not None:
        where += f" ({step.about.phase} step {step.about.step})"
    if doing.during is not None:
        where += f" at training step {doing.during}"
    return f"{where}, waiting for {awaited or _awaited(doing, plan, step)}"


def _awaited(doing: Doing, plan: Any, step: Any) -> str:
    """Whom a rank waits for, as far as its record and the executor's frame tell."""
    if step is not None:
        return f"rank {step.source}" if step.source >= 0 else f"rank {step.dest} to receive"
    if plan is not None:  # the step is unknown: every rank the call receives from
        sources = sorted({s.source for s in plan.steps if s.source >= 0})
        return " or ".join(f"rank {source}" for source in sources) or "no rank"
    return "every other rank" if doing.peer is None else f"rank {doing.peer}"


def timeout_line(seconds: float, waits: dict[int, str], silent: list[int]) -> str:
    """The job's one line when its collective timed out: each waiting rank's `describe`, in rank
    order (as the thread ranks' CollectiveTimeout), and the ranks no word came from."""
    listed = "; ".join(f"rank {rank} in {where}" for rank, where in sorted(waits.items()))
    unheard = f"; no report from {_ranks(silent)}" if silent else ""
    return (f"syncsgd: error: collective timeout: no progress for {seconds:g} s (--timeout): "
            f"{listed}{unheard}; ending the job")  # fmt: skip


def _ranks(ranks: list[int]) -> str:
    """'rank 1', 'ranks 1,4'."""
    return f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}"


_REPORT_TAG = 1  # the only tag on a report channel


class ReportChannel:
    """A communicator of the job's own (a nonblocking Dup of the watched one) on which the
    watchdogs of ranks that timed out tell each other where they wait.

    The Dup is started where every rank enters the timeout alike and never waits: a stopped
    rank leaves it unfinished, and the ranks then report alone. It needs MPI_THREAD_MULTIPLE
    (the watchdog calls MPI beside the blocked rank); with less there is no channel.
    """

    def __init__(self, comm: Any) -> None:
        self.comm, self.request = comm.Idup()

    def ready(self) -> Any:
        """The channel's communicator once every rank has it, else None."""
        try:
            return self.comm if self.request.Test() else None
        except Exception:  # noqa: BLE001 - a broken job: report alone
            return None

    def _told(self, rank: int, where: str) -> Any:
        """Send `where` to every other rank once the channel is ready; the channel, or None."""
        channel = self.ready()
        if channel is not None:
            for other in range(channel.Get_size()):
                if other != rank:  # small and eager: done even towards a stopped rank
                    channel.isend((rank, where), dest=other, tag=_REPORT_TAG)
        return channel

    def exchange(self, rank: int, where: str, until: float, stopped: threading.Event
                 ) -> dict[int, str] | None:  # fmt: skip
        """Send `where` to every other rank, and gather theirs until `until` (monotonic);
        None if the collective finished meanwhile (`stopped`)."""
        heard: dict[int, str] = {rank: where}
        channel = None
        while not stopped.wait(_REPORT_POLL):
            try:
                if channel is None:  # the channel, once every rank has joined it: tell them
                    channel = self._told(rank, where)
                while channel is not None and channel.iprobe(tag=_REPORT_TAG):
                    sender, said = channel.recv(tag=_REPORT_TAG)
                    heard[sender] = said
            except Exception:  # noqa: BLE001 - the channel broke: report what was heard
                return heard
            if time.monotonic() >= until:
                return heard
        return None


_REPORT_POLL = 0.05
_CHANNELS: dict[str, ReportChannel] = {}  # COMM_WORLD's, made once


def report_channel(comm: Any) -> ReportChannel | None:
    """The report channel of MPI's COMM_WORLD, started on its first use; None for another
    communicator (a freed one's handle can come back as a new one's, which not every rank
    would know) or without MPI_THREAD_MULTIPLE. Every rank calls this at the same point (it
    starts a collective)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or getattr(comm, "unwatched", comm) != mpi.COMM_WORLD:
        return None
    found = _CHANNELS.get("world")
    if found is None:
        if mpi.Query_thread() != mpi.THREAD_MULTIPLE:
            return None
        atexit.register(_free_channels)  # after mpi4py's: runs before MPI_Finalize
        found = _CHANNELS["world"] = ReportChannel(comm)
    return found


def _free_channels() -> None:
    """Free the report channels every rank has joined (MPI_Finalize warns of the others)."""
    for channel in _CHANNELS.values():
        if channel.ready() is not None:
            channel.comm.Free()
    _CHANNELS.clear()


class Watchdog:
    """A daemon thread that aborts this MPI process's job when `doing` makes no progress."""

    def __init__(self, comm: Any, seconds: float, doing: Doing,
                 channel: ReportChannel | None = None) -> None:  # fmt: skip
        self.comm, self.seconds, self.doing, self.channel = comm, seconds, doing, channel
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="syncsgd-watchdog", daemon=True)

    def run(self) -> None:
        """Sample the rank; in the same collective call for `seconds`: report and abort."""
        doing, poll = self.doing, min(_LONGEST_POLL, self.seconds / 10)
        seen: Any = None  # (holding a frame keeps it alive: a new call cannot reuse it)
        since = time.monotonic()
        while not self.stopped.wait(poll):
            state = in_collective(doing)
            now = time.monotonic()
            if state is None or state is not seen:  # between collectives, or progress
                seen, since = state, now
            elif now - since >= self.seconds:
                self.abort(doing)
                return

    def abort(self, doing: Doing) -> None:
        """Hear from the other ranks stuck by the same hang (they time out within a sampling
        interval of each other); the lowest of them prints the job's line and ends the job."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        until = time.monotonic() + ABORT_GRACE
        if self.channel is None:
            heard: dict[int, str] | None = {rank: describe(doing)}
            if self.stopped.wait(ABORT_GRACE):
                return
        else:
            heard = self.channel.exchange(rank, describe(doing), until, self.stopped)
        if heard is None:  # the collective finished after all
            return
        if rank != min(heard):  # a lower rank prints and aborts; if it cannot, this one does
            if self.stopped.wait(ABORT_GRACE + _ABORT_LATENCY):
                return
        silent = [] if self.channel is None else sorted(set(range(size)) - set(heard))
        print_line(timeout_line(self.seconds, heard, silent))
        end_job(self.comm)


def end_job(comm: Any, code: int = 1) -> None:
    """End every rank of `comm`'s MPI job, once this rank has said why in its one line."""
    sys.stderr.flush()
    time.sleep(0.2)  # let the launcher forward the line before it kills the job
    # MPICH's MPI_Abort prints a line of its own ("Abort(1) on node 0 ..."): it goes nowhere.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    comm.Abort(code)


_ABORT_LATENCY = 3.0  # seconds within which another rank's Abort ends this process


def bcast_peer(comm: Any, root: int) -> int | None:
    """Whom a rank waits for in a broadcast: the root; the root itself, any rank."""
    return None if comm.Get_rank() == root else root


class Watched:
    """`comm` whose Bcast, Send, Recv, Barrier and Allreduce are named `what` for the watchdog.

    For code that does not name its collectives itself (the hooks, the timeline's gather).
    """

    def __init__(self, comm: Any, what: str) -> None:
        self.unwatched, self.what = comm, what

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unwatched, name)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        with watching(f"{self.what} (Bcast)", bcast_peer(self.unwatched, root)):
            self.unwatched.Bcast(buf, root=root)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        with watching(f"{self.what} (Send)", dest):
            self.unwatched.Send(buf, dest=dest, tag=tag)

    def Recv(self, buf: Any, source: int | None = None, tag: int | None = None,
             status: Any = None) -> None:  # fmt: skip
        given = {"source": source, "tag": tag, "status": status}  # the rest: the comm's defaults
        with watching(f"{self.what} (Recv)", None if source is None or source < 0 else source):
            self.unwatched.Recv(buf, **{k: v for k, v in given.items() if v is not None})

    def Barrier(self) -> None:
        with watching(f"{self.what} (Barrier)"):
            self.unwatched.Barrier()

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:
        with watching(f"{self.what} (Allreduce)"):  # op None: the communicator's default, SUM
            self.unwatched.Allreduce(sendbuf, recvbuf, *(() if op is None else (op,)))


def within_timeout(fn: Callable[..., Any], seconds: float | None) -> Callable[..., Any]:
    """`fn(comm, ...)` run within `collective_timeout(comm, seconds)` (for launch, run_threads)."""

    def timed(comm: Any, *args: Any, **kwargs: Any) -> Any:
        with collective_timeout(comm, seconds):
            return fn(comm, *args, **kwargs)

    return timed


def timeout_seconds(seconds: Any, where: str) -> float | None:
    """`seconds` as a timeout (None, or a number >= 0; 0 and None: never), or ValueError."""
    if seconds is None:
        return None
    try:
        value = float(seconds) if not isinstance(seconds, (bool, str)) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0:  # NaN too
        raise ValueError(f"{where}: a timeout is None or a number of seconds >= 0, not "
                         f"{seconds!r}")  # fmt: skip
    return value


@contextmanager
def collective_timeout(comm: Any, seconds: float | None) -> Iterator[None]:
    """Within: a collective that makes no progress for `seconds` (0 or None: never) fails.

    Thread ranks: every rank raises `CollectiveTimeout`, naming each waiting rank's collective
    and peer. MPI: the lowest waiting rank prints one line naming them, and the job is aborted.
    """
    seconds = timeout_seconds(seconds, "collective_timeout")
    if not seconds:
        yield
        return
    set_timeout = getattr(comm, "set_timeout", None)
    if set_timeout is not None:  # thread ranks: their waits time out
        previous = set_timeout(seconds)
        try:
            yield
        finally:
            set_timeout(previous)
        return
    dog = Watchdog(comm, seconds, current(), report_channel(comm))
    dog.thread.start()
    try:
        yield
    finally:
        dog.stopped.set()
