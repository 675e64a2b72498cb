"""ZeRO stage 1: each rank keeps the optimizer state of its shard of the parameters and updates it.

    reduce-scatter   every bucket of gradient sums: the ring allreduce's first half, so the block
                     each rank ends with holds the allreduce's bits
    agree            the riders (loss sum, flags), a finite flag and the shard's squares in one
                     small allreduce: every rank skips, stops and logs alike
    divide, update   the owned blocks' mean gradient, the optimizer's step on them alone
    allgather        every bucket's updated parameters: the ring allreduce's second half
A rank owns, in every bucket, the block the ring's reduce-scatter completes on it (block (r + 1)
mod P of numpy.array_split's P blocks of the bucket): the same elements, summed in the same
order, as the replicated step. docs/sharded.md shows the partition and what it sends.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from syncsgd.collectives.executor import execute
from syncsgd.collectives.schedules import Collective, chunk_bounds, owned_block
from syncsgd.nn.optim import learning_rate, make_optimizer

REDUCE_SCATTER = Collective("reduce-scatter", "ring-allreduce")
ALLGATHER = Collective("allgather", "ring-allreduce")


def owned_slices(buckets: list[slice], n_params: int, rank: int, size: int) -> list[slice]:
    """The parameters this rank owns: per bucket, its block of the bucket, without the riders."""
    owned = []
    for bucket in buckets:
        bounds = chunk_bounds(bucket.stop - bucket.start, size)
        block = owned_block(rank, size)
        start = min(bucket.start + bounds[block], n_params)
        stop = min(bucket.start + bounds[block + 1], n_params)
        if stop > start:
            owned.append(slice(start, stop))
    return owned


class ShardedUpdate:
    """The sharded end of a step: built once per run, used in place of the replicated one."""

    def __init__(self, stepper: Any, buckets: list[slice], run: Any, trace: Any = None) -> None:
        config, comm = run.config, stepper.comm
        self.stepper, self.comm = stepper, comm
        self.n_params = n_params = run.model.n_params
        self.owned = owned_slices(buckets, n_params, comm.Get_rank(), comm.Get_size())
        self.buckets = stepper.buckets  # views of the communication buffer
        self.rider_bucket = self.buckets[-1]  # the riders ride in the last bucket
        width = sum(part.stop - part.start for part in self.owned)
        dtype = run.model.dtype
        self.optimizer = make_optimizer(config.optimizer, run.optim, width, dtype, config)
        self.params_shard, self.grad_shard = np.empty(width, dtype), np.empty(width, dtype)
        buffer = stepper.comm_buffer
        self.riders = buffer[n_params:]  # the loss sum and the hooks' slots
        # Agreed in one small allreduce: the riders, kept before the reduce-scatter sums them in
        # part; then the ranks whose blocks are not finite; then the blocks' sum of squares.
        self.agreed = np.zeros(self.riders.size + 2, buffer.dtype)
        self.reduce_scatter_ = functools.partial(execute, REDUCE_SCATTER, trace=trace)
        self.allgather_ = functools.partial(execute, ALLGATHER, trace=trace)
        self.allreduce_ = functools.partial(execute, "ring", trace=trace)

    def reduce_(self, bucket: np.ndarray, comm: Any) -> None:
        """A bucket's reduce-scatter (the step's `allreduce_`, on whichever thread runs it)."""
        if bucket is self.rider_bucket:  # summed apart, in full: keep them before
            self.agreed[: self.riders.size] = self.riders
        self.reduce_scatter_(bucket, comm)

    def divide_once_(self, batch_size: int) -> tuple[float, bool]:
        """The owned blocks' sums become the mean, once; the riders and the verdict agreed by
        every rank: (mean loss, loss and the whole gradient finite)."""
        stepper = self.stepper
        terms = batch_size * stepper.local_gradient.passes.positions
        scale = stepper.local_gradient.scale
        divisor = stepper.grad_sum.dtype.type(terms if scale == 1.0 else terms * scale)
        finite, squares = True, 0.0
        for part in self.owned:  # the same division, element by element, as the replicated one
            finite &= stepper.divide_finite_(stepper.grad_sum[part], divisor,
                                             stepper.grad_mean[part])  # fmt: skip
            if stepper.want_grad_norm:
                squares += float(np.dot(stepper.grad_mean[part].astype(np.float64),
                                        stepper.grad_mean[part]))  # fmt: skip
        self.agreed[-2:] = (0.0 if finite else 1.0), squares
        self.allreduce_(self.agreed, self.comm)
        self.riders[...] = self.agreed[: self.riders.size]
        loss = float(stepper.comm_buffer[stepper.loss_slot]) / terms
        self.grad_norm = math.sqrt(self.agreed[-1]) if stepper.want_grad_norm else math.nan
        return loss, math.isfinite(loss) and self.agreed[-2] == 0

    def update_(self, step: int, finite: bool) -> tuple[float, float]:
        """The optimizer's step on the owned blocks, then every bucket's parameters allgathered;
        a non-finite step changes nothing. (lr, grad norm)."""
        stepper = self.stepper
        if not finite:
            return learning_rate(stepper.optim, step), math.nan
        params, grad_mean = stepper.params, stepper.grad_mean
        start = 0
        for part in self.owned:  # the shard as one contiguous array: the optimizer's
            stop = start + part.stop - part.start
            self.params_shard[start:stop] = params[part]
            self.grad_shard[start:stop] = grad_mean[part]
            start = stop
        info = self.optimizer.step_(self.params_shard, self.grad_shard, step, want_norm=False)
        self.allgather_params_()
        return info["lr"], self.grad_norm

    def allgather_params_(self) -> None:
        """Every rank's updated blocks to every rank, through the communication buffer."""
        stepper, start = self.stepper, 0
        buffer, params = stepper.comm_buffer, stepper.params
        for part in self.owned:  # the gradient sums are spent: the buffer carries parameters
            stop = start + part.stop - part.start
            buffer[part] = self.params_shard[start:stop]
            start = stop
        for bucket in self.buckets:
            self.allgather_(bucket, self.comm)
        params[...] = buffer[: self.n_params]
