"""--overlap: each gradient bucket is allreduced on a communication thread while the backward pass
goes on, last bucket first; the update waits for all of them.

The buckets, and how each is summed, are those of the step without --overlap: only when their
allreduces start changes, so the parameters are bitwise the same. docs/overlap.md says why, how
exact mode and the riders fit in, and what it buys.
"""

from __future__ import annotations

import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd.comm.watchdog import Doing, records, watching
from syncsgd.nn.network import Network
from syncsgd.training.layered import RankGradient
from syncsgd.training.run import agree
from syncsgd.training.variants import Variant

JOIN_SECONDS = 5.0  # how long closing waits for an idle communication thread to end
# With WAITS = "sleep", an MPI wait on the communication thread polls with sleeps growing from
# the first pause to the longest. Longer pauses starve a transfer of progress (1 ms cost 40% on
# 1 Gbit/s links: docs/overlap.md).
FIRST_PAUSE, LONGEST_PAUSE = 20e-6, 1e-4


class CommThread:
    """A daemon thread that runs the jobs handed to it one after the other, in order."""

    def __init__(self, rank: int, doing: Doing) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.finished: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.pending = 0  # jobs handed and not yet seen finished
        self.error: BaseException | None = None  # the first job's failure, raised on the rank
        self.doing, self.owner = doing, doing.thread
        self.thread = threading.Thread(target=self.run, name=f"syncsgd-comm-{rank}", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Take jobs until None; after a failure, only count them done."""
        records.doing = self.doing  # the rank's record: a timeout names what we wait in
        while (job := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - raised on the rank's own thread
                    self.error = exc
            self.finished.put(None)

    def hand(self, job: Callable[[], None]) -> None:
        """Run `job` after those handed before."""
        # The watchdog and the thread ranks' timeout look for collectives in this thread now.
        self.doing.thread = self.thread.ident or self.owner
        self.pending += 1
        self.jobs.put(job)

    def wait_all(self) -> None:
        """Until every job handed so far is done; then raise the first failure, if any."""
        while self.pending:
            self.finished.get()
            self.pending -= 1
        self.doing.thread = self.owner
        if self.error is not None:
            raise self.error

    def close(self) -> bool:
        """End the thread; True if it was idle (and has ended), False if still in a job."""
        self.jobs.put(None)
        if self.pending:  # failed mid-step: a job may be stuck in a collective; it is a daemon
            return False
        self.thread.join(JOIN_SECONDS)
        return True


class Yielding:
    """An MPI communicator whose point-to-point calls wait by polling, yielding the core between
    tests rather than spinning (measured in docs/overlap.md); the rest is the communicator's own."""

    # Not Allreduce: MPI's Iallreduce may sum in another order than its Allreduce, and the
    # library's allreduce (--algorithm mpi, auto) must give the bits it gives without --overlap.

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = -1, recvtag: int = -1, status: Any = None) -> None:  # fmt: skip
        comm = self.comm
        settle([comm.Irecv(recvbuf, source, recvtag), comm.Isend(sendbuf, dest, sendtag)], status)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        settle([self.comm.Isend(buf, dest, tag)])

    def Recv(self, buf: Any, source: int = -1, tag: int = -1, status: Any = None) -> None:
        settle([self.comm.Irecv(buf, source, tag)], status)


def settle(requests: list[Any], status: Any = None) -> None:
    """Wait for MPI requests by testing them, yielding or sleeping between tests; the first
    one's status."""
    mpi = sys.modules["mpi4py.MPI"]
    statuses = [status if status is not None else mpi.Status()] + [mpi.Status()
                                                                   for _ in requests[1:]]
    pause = FIRST_PAUSE
    while not mpi.Request.Testall(requests, statuses):
        if WAITS == "yield":
            os.sched_yield()  # runnable, but behind any thread that wants the core
            continue
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)


def duplicate(comm: Any) -> Any:
    """A communicator of the same ranks whose messages never match `comm`'s; MPI's yields."""
    if mpi_of(comm) is not None and WAITS != "spin":
        return Yielding(comm.Dup())
    return comm.Dup()


# How the MPI duplicate waits: "yield" (polling with sched_yield: the core goes to the backward
# pass whenever it wants it), "sleep" (polling with sleeps), "spin" (MPI's own blocking calls,
# which spin); benchmarks/overlap.py measures all three.
WAITS = "yield"


def thread_level_problem(comm: Any) -> str | None:
    """Why this communicator cannot be used from a second thread, or None."""
    mpi = mpi_of(comm)
    if mpi is None:
        return None  # thread ranks: every call is thread-safe
    if mpi.Query_thread() >= mpi.THREAD_MULTIPLE:
        return None
    return ("--overlap needs an MPI library initialised with MPI_THREAD_MULTIPLE; this one "
            "gives less (mpi4py.rc.thread_level?): leave out --overlap")  # fmt: skip


def ready_layers(network: Network, buckets: list[slice]) -> list[int]:
    """Per bucket: the layer after whose backward pass its gradient is complete."""
    # Buckets hold whole tensors in layer order, and the backward pass runs from the last layer
    # down, so a bucket is complete once it has done the layer of the bucket's first tensor.
    layer_at = {offset: network.layer_of(name) for name, _, offset in network.layout()}
    return [layer_at[bucket.start] for bucket in buckets]


def waits_in_two_threads(comm: Any) -> bool:
    """Whether two threads of a rank may wait in `comm` at once: MPI's (THREAD_MULTIPLE is
    checked); the thread ranks' world keeps one wait per rank."""
    return mpi_of(comm) is not None


def mpi_of(comm: Any) -> Any:
    """mpi4py's MPI module if `comm` is one of its communicators; None for thread ranks."""
    mpi = sys.modules.get("mpi4py.MPI")  # loaded by then if comm is MPI's
    return mpi if mpi is not None and isinstance(comm, mpi.Comm) else None


def changes_contribution(variant: Variant) -> bool:
    """True if the variant changes a rank's whole gradient before the allreduce (a pitfall)."""
    return type(variant).contribution_ is not Variant.contribution_


class WholePhases:
    """No pieces: the whole local sum first (kernels without a layered form, or a pitfall that
    changes the whole gradient), then the buckets; correct, with nothing of the backward hidden."""

    def __init__(self, local: Any, variant: Variant, batch_size: Callable[[], tuple[int, int]],
                 size: int) -> None:  # fmt: skip
        self.local, self.variant, self.batch_size, self.size = local, variant, batch_size, size
        self.n_params = local.n_params

    def begin_(self, params: np.ndarray, X: np.ndarray, y: np.ndarray, sums: np.ndarray) -> None:
        """The whole local sum, then the variant's change of it."""
        self.local(params, X, y, sums)
        shard_size, batch_size = self.batch_size()
        self.variant.contribution_(sums[: self.n_params], shard_size, batch_size, self.size)

    def layers_(self, params: np.ndarray, X: np.ndarray, sums: np.ndarray, top: int,
                bottom: int) -> None:  # fmt: skip
        """Nothing left to compute."""


def phases_for(local: RankGradient, variant: Variant,
               batch_size: Callable[[], tuple[int, int]], size: int) -> Any:  # fmt: skip
    """The local gradient in the pieces the overlap interleaves with its buckets: its own
    begin_ and layers_, or the whole of it first when a pitfall changes the whole gradient."""
    if changes_contribution(variant):
        return WholePhases(local, variant, batch_size, size)
    return local


class Overlap:
    """The local sums and their allreduce, overlapped: built once per run, `exchange_` per step."""

    def __init__(self, stepper: Any, buckets: list[slice], doing: Doing) -> None:
        comm = stepper.comm
        agree(comm, thread_level_problem(comm))  # every rank refuses alike, in one line
        self.comm = comm
        self.dup = duplicate(comm)  # its own messages: never matched with the training thread's
        network = stepper.local_gradient.network  # the layers the backward pass runs through
        self.stepper, self.n_layers = stepper, network.n_layers
        self.bottoms = ready_layers(network, buckets)
        self.starts = [bucket.start for bucket in buckets]
        self.gradient_parts = [stepper.comm_buffer[b.start : min(b.stop, network.n_params)]
                               for b in buckets]  # fmt: skip
        self.early = [rider for rider in stepper.riders if not rider.needs_gradient]
        self.late = [rider for rider in stepper.riders if rider.needs_gradient]
        # Riders that read the whole local gradient read this copy: handed buckets are summed
        # in place while the backward pass goes on.
        self.local = np.empty(network.n_params if self.late else 0, stepper.grad_sum.dtype)
        self.held = len(buckets) - 1 if self.late else None  # the riders' bucket waits for them
        self.shard = (0, 0)  # (shard size, batch size) of the step under way
        self.backward_started = 0.0  # time.perf_counter() when this step's backward pass began
        self.phases = phases_for(stepper.local_gradient, stepper.variant, lambda: self.shard,
                                 comm.Get_size())  # fmt: skip
        self.thread = CommThread(comm.Get_rank(), doing)
        self.unrelayed: Callable[..., Any] | None = None  # BatchNorm's own allreduce, while relayed
        sums_between_layers = self.phases is stepper.local_gradient and (
            stepper.local_gradient.sums_between_layers)  # fmt: skip
        if sums_between_layers and not waits_in_two_threads(comm):
            local = stepper.local_gradient  # thread ranks: BatchNorm's sums join the queue
            self.unrelayed, local.allreduce_ = local.allreduce_, self.relayed(local.allreduce_)
        sharded = stepper.sharded
        if sharded is not None and sharded.placed_params is not None:
            self.prefetch_gathers(sharded)
        # ZeRO-2's sums in the buffers of the buckets under way: a buffer is written again only
        # once the bucket it held has left the communication thread
        self.placed = sharded.placed_sums if sharded is not None else None
        self.in_flight: set[int] = set()  # the buffers of the buckets handed

    def exchange_(self, X: np.ndarray, y: np.ndarray, shard_size: int, batch_size: int) -> float:
        """Fill the buffer and allreduce it, bucket by bucket; when the local work ended."""
        stepper, phases = self.stepper, self.phases
        params, sums = stepper.pass_params, stepper.comm_buffer
        self.shard = (shard_size, batch_size)
        phases.begin_(params, X, y, sums)
        self.backward_started = time.perf_counter()  # the forward pass (exact: and the bounds)
        for rider in self.early:  # the stop flag: it needs no gradient
            rider.fill_(rider.slots, stepper.grad_sum, shard_size)
        # The last bucket has nothing left to overlap with: this thread sums it after the others
        # (in the same order on every rank), which spares a hand-over and a wake-up. With riders
        # that read the gradient it is theirs, held back until they are filled.
        last = 0 if self.held is None else self.held
        top = self.n_layers - 1
        for index in range(len(self.bottoms) - 1, -1, -1):  # from the last layer back, as DDP
            bottom = self.bottoms[index]
            if bottom <= top:
                self.make_room_(top, bottom)
                phases.layers_(params, X, sums, top, bottom)
                top = bottom - 1
            if index != last:
                self.hand_(index)
        if self.held is not None:  # every other bucket is on its way: the riders' turn
            self.keep_(self.held)
            for rider in self.late:
                rider.fill_(rider.slots, self.local, shard_size)
        computed = time.perf_counter()
        self.thread.wait_all()
        self.in_flight.clear()
        self.reduce_bucket_(last)
        # MPI with --batchnorm sync: the two threads' collectives, overlapping, may have left the
        # shared record naming one as under way; none is now.
        self.stepper.doing.what, self.stepper.doing.peer = None, None
        return computed

    def prefetch_gathers(self, sharded: Any) -> None:
        """ZeRO-3: the passes' gathers join the queue, after the buckets handed before them;
        under MPI the next layer's start while this one computes."""
        sharded.passes_allgather_ = self.relayed(sharded.allgather_)
        placed = sharded.placed_params

        def on_the_duplicate_(values: np.ndarray, comm: Any) -> None:
            sharded.allgather_(values, self.dup)

        def start_(index: int, out: np.ndarray) -> None:
            self.thread.hand(functools.partial(sharded.gather_bucket_, index, out,
                                               on_the_duplicate_))  # fmt: skip

        if waits_in_two_threads(self.comm):  # (training/sharded.py: prefetches)
            placed.start_, placed.wait_ = start_, self.thread.wait_all

    def relayed(self, allreduce_: Callable[[np.ndarray, Any], Any]) -> Callable[..., None]:
        """`allreduce_` on the communication thread and its duplicate, after the buckets handed
        before it; the caller waits for it."""

        def allreduce_relayed_(values: np.ndarray, comm: Any) -> None:
            self.thread.hand(functools.partial(allreduce_, values, self.dup))
            self.thread.wait_all()  # in order: the buckets before it, then this one

        return allreduce_relayed_

    def keep_(self, index: int) -> None:
        """Copy bucket `index`'s local gradient for the riders, if one reads it."""
        if self.late:
            part, start = self.gradient_parts[index], self.starts[index]
            self.local[start : start + part.size] = part

    def hand_(self, index: int) -> None:
        """Bucket `index` is complete: its allreduce goes to the communication thread."""
        if index != self.held:
            self.keep_(index)
        if self.placed is not None:
            self.in_flight.add(self.placed.buffer_of(index))
        self.thread.hand(functools.partial(self.reduce_bucket_, index))

    def make_room_(self, top: int, bottom: int) -> None:
        """Placed sums: wait for the communication thread if the buckets of layers top down to
        bottom are to be written into a buffer a bucket on its way still holds."""
        if self.placed is None:
            return
        if self.placed.buffers_of(top, bottom) & self.in_flight:
            self.thread.wait_all()
            self.in_flight.clear()

    def reduce_bucket_(self, index: int) -> None:
        """On the communication thread: the bucket's allreduce, cast as the step would."""
        stepper = self.stepper
        if self.placed is not None:  # the bucket's reduce-scatter, its block kept
            stepper.sharded.reduce_bucket_(index, self.dup)
            return
        gradient = self.gradient_parts[index]
        if stepper.wire_format:  # --allreduce-dtype: the gradient only, as `reduce_` does
            stepper.round_flat_(gradient, stepper.wire_format)
        stepper.allreduce_(stepper.buckets[index], self.dup)
        if stepper.wire_format:
            stepper.round_flat_(gradient, stepper.wire_format)

    def close(self) -> None:
        """End the communication thread and free the duplicate (if the thread is idle)."""
        if self.unrelayed is not None:  # BatchNorm's sums on the training thread again
            self.stepper.local_gradient.allreduce_, self.unrelayed = self.unrelayed, None
        if self.thread.close() and self.thread.error is None and hasattr(self.dup, "Free"):
            with watching("freeing the overlap's communicator"):
                self.dup.Free()


__all__ = ["CommThread", "Overlap"]
