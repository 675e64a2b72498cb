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
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from syncsgd.collectives.executor import execute, sent_bytes
from syncsgd.collectives.schedules import Collective, chunk_bounds, owned_block
from syncsgd.nn.exact import SQUARE_LIMBS, add_square_limbs_, exact_square_sum, limbs_value
from syncsgd.nn.optim import learning_rate, make_optimizer
from syncsgd.nn.optim.schedule import clip_
from syncsgd.nn.optim.tensors import FlatOptimizer, tensor_slices

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
        edges = [0, *(edge for part in self.owned for edge in (part.start, part.stop)), n_params]
        self.others = [slice(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
        self.buckets = stepper.buckets  # views of the communication buffer
        self.rider_bucket = self.buckets[-1]  # the riders ride in the last bucket
        self.width = width = sum(part.stop - part.start for part in self.owned)
        dtype = run.model.dtype
        # It clips by the norm over every shard, which this step reduces: not by its own.
        self.optim = run.optim
        # Its tensors are the pieces of the model's tensors in the blocks it owns, their norms
        # (LAMB's, LARS's trust ratios) summed over the ranks.
        self.pieces = pieces(self.owned, tensor_slices(run.model.layout(), n_params))
        layout = [(f"piece {index}", (stop - start,), offset) for index, (_, start, stop, offset)
                  in enumerate(self.pieces)]  # fmt: skip
        inner = make_optimizer(config.optimizer, replace(run.optim, clip_norm=None), width, dtype,
                               config, layout)  # fmt: skip
        if isinstance(inner, FlatOptimizer):  # the Adam family: LAMB's, LARS's norms
            inner.shared_norms = self.tensor_norms
        self.n_tensors = len(run.model.layout())
        self.optimizer = ShardOptimizer(inner, self)
        # One contiguous array each for the optimizer: views when the rank owns one block
        many = len(self.owned) > 1
        self.params_shard = np.empty(width if many else 0, dtype)
        self.grad_shard = np.empty(width if many else 0, dtype)
        buffer = stepper.comm_buffer
        self.riders = buffer[n_params:]  # the loss sum and the hooks' slots
        # Agreed in one small allreduce: the riders, kept before the reduce-scatter sums them in
        # part; then the ranks whose blocks are not finite; then the blocks' sum of squares.
        self.agreed = np.zeros(self.riders.size + 2, buffer.dtype)
        self.reduce_scatter_ = functools.partial(execute, REDUCE_SCATTER, trace=trace)
        self.allgather_ = functools.partial(execute, ALLGATHER, trace=trace)
        self.allreduce_ = functools.partial(execute, "ring", trace=trace)
        self.limbs = np.zeros(SQUARE_LIMBS, np.int64)  # exact mode's squares, summed exactly
        self.grad_norm = math.nan
        if run.start is not None:  # resumed: this rank's blocks of the whole run's state
            self.optimizer.load_state_arrays(run.start.optimizer)

    def bytes_per_step(self) -> int:
        """What this rank sends in a step: every bucket's two halves and the agreement."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        agreement = sent_bytes("ring", self.agreed.size, self.agreed.itemsize, size, rank)
        return agreement + sum(sent_bytes(half, bucket.size, bucket.itemsize, size, rank)
                               for bucket in self.buckets
                               for half in (REDUCE_SCATTER, ALLGATHER))  # fmt: skip

    def reduce_(self, bucket: np.ndarray, comm: Any) -> None:
        """A bucket's reduce-scatter (the step's `allreduce_`, on whichever thread runs it)."""
        if bucket is self.rider_bucket:  # summed apart, in full: keep them before
            self.agreed[: self.riders.size] = self.riders
        self.reduce_scatter_(bucket, comm)

    def divide_once_(self, batch_size: int) -> tuple[float, bool]:
        """The owned blocks' sums become the mean, once; the riders and the verdict agreed by
        every rank: (mean loss, loss and the whole gradient finite)."""
        stepper = self.stepper
        terms, divisor = stepper.divisors(batch_size)
        finite = True
        for part in self.owned:  # the same division, element by element, as the replicated one
            finite &= stepper.divide_finite_(stepper.grad_sum[part], divisor,
                                             stepper.grad_mean[part])  # fmt: skip
        own_squares = self.squares_()
        self.agreed[-2:] = (0.0 if finite else 1.0), own_squares
        self.allreduce_(self.agreed, self.comm)
        self.riders[...] = self.agreed[: self.riders.size]
        loss = float(stepper.comm_buffer[stepper.loss_slot]) / terms
        every = math.isfinite(loss) and self.agreed[-2] == 0
        finite = stepper.variant.shard_finite(math.isfinite(loss) and finite, every)
        own = self.own_norm(own_squares)  # (exact mode: from the limbs, before they are summed)
        self.grad_norm = stepper.variant.shard_norm(own, self.norm_(every))
        return loss, finite

    @property
    def needs_norm(self) -> bool:
        """Whether this step takes the mean gradient's norm: to clip it, or for a log."""
        return self.optim.clip_norm is not None or self.stepper.want_grad_norm

    def squares_(self) -> float:
        """This rank's part of the squared norm, summed in float64 (float mode); exact mode adds
        its squares to the limbs instead (0 here)."""
        grad_mean = self.stepper.grad_mean
        if not self.needs_norm or self.optim.exact_norm:
            self.limbs[...] = 0
            if self.needs_norm:
                for part in self.owned:
                    add_square_limbs_(grad_mean[part], self.limbs)
            return 0.0
        return sum(float(np.dot(grad_mean[part].astype(np.float64), grad_mean[part]))
                   for part in self.owned)  # fmt: skip

    def tensor_norms(self, values: np.ndarray, slices: list[slice]) -> list[float]:
        """Every piece's tensor's norm: the pieces' squares summed per tensor over the ranks
        (exact mode: exactly, in limbs; else in float64)."""
        exact = self.optim.exact_norm
        sums = np.zeros((self.n_tensors, SQUARE_LIMBS) if exact else self.n_tensors,
                        np.int64 if exact else np.float64)  # fmt: skip
        own = []
        for (tensor, _, _, _), part in zip(self.pieces, slices, strict=True):
            if exact:
                add_square_limbs_(values[part], sums[tensor])
                own.append(math.sqrt(exact_square_sum(values[part])))
            else:
                squares = float(np.dot(values[part].astype(np.float64), values[part]))
                sums[tensor] += squares
                own.append(math.sqrt(squares))
        self.allreduce_(sums.reshape(-1), self.comm)
        whole = [limbs_value(row) for row in sums] if exact else sums.tolist()
        every = [math.sqrt(whole[tensor]) for tensor, _, _, _ in self.pieces]
        return self.stepper.variant.shard_tensor_norms(own, every)

    def own_norm(self, own_squares: float) -> float:
        """The norm of this rank's blocks alone (a pitfall clips by it)."""
        if not self.needs_norm:
            return math.nan
        return math.sqrt(limbs_value(self.limbs) if self.optim.exact_norm else own_squares)

    def norm_(self, finite: bool) -> float:
        """The norm of the whole mean gradient (nan when not needed, or not finite): exact mode
        sums the limbs over the ranks, integers, and rounds once: the bits of one rank's."""
        if not self.needs_norm or not finite:
            return math.nan
        if not self.optim.exact_norm:
            return math.sqrt(self.agreed[-1])
        self.allreduce_(self.limbs, self.comm)
        return math.sqrt(limbs_value(self.limbs))

    def update_(self, step: int, finite: bool) -> tuple[float, float]:
        """The optimizer's step on the owned blocks, then every bucket's parameters allgathered;
        a non-finite step changes nothing. (lr, grad norm)."""
        params_shard, grad_shard = self.shards()
        if not finite:  # unchanged, but allgathered: a pitfall may make the ranks disagree
            self.allgather_params_(params_shard)
            return learning_rate(self.stepper.optim, step), math.nan
        if self.optim.clip_norm is not None:  # the replicated step's first move, the same norm
            clip_(grad_shard, self.optim.clip_norm, self.grad_norm)
        info = self.optimizer.step_(params_shard, grad_shard, step, want_norm=False)
        self.allgather_params_(params_shard)
        return info["lr"], self.grad_norm

    def shards(self) -> tuple[np.ndarray, np.ndarray]:
        """The owned parameters and mean gradient, each one contiguous array: views when the
        rank owns one block (one bucket), else copies."""
        stepper = self.stepper
        params, grad_mean = stepper.params, stepper.grad_mean
        if len(self.owned) == 1:
            return params[self.owned[0]], grad_mean[self.owned[0]]
        start = 0
        for part in self.owned:
            stop = start + part.stop - part.start
            self.params_shard[start:stop] = params[part]
            self.grad_shard[start:stop] = grad_mean[part]
            start = stop
        return self.params_shard, self.grad_shard

    def allgather_params_(self, shard: np.ndarray) -> None:
        """Every rank's updated blocks to every rank, through the communication buffer: the
        others' blocks copied into the parameters, and ours when they were updated apart."""
        params, whole = self.stepper.params, self.gathered(shard)
        for part in self.others if len(self.owned) == 1 else [slice(0, self.n_params)]:
            params[part] = whole[part]

    def gathered(self, shard: np.ndarray) -> np.ndarray:
        """Every rank's blocks of an array of the parameters' layout, whole (a view of the
        communication buffer, in its dtype: until the next step)."""
        buffer, start = self.stepper.comm_buffer, 0
        for part in self.owned:  # the gradient sums are spent: the buffer carries these
            stop = start + part.stop - part.start
            buffer[part] = shard[start:stop]
            start = stop
        for bucket in self.buckets:
            self.allgather_(bucket, self.comm)
        return buffer[: self.n_params]

    def taken(self, whole: np.ndarray) -> np.ndarray:
        """This rank's blocks of an array of the parameters' layout, as one array."""
        return np.concatenate([whole[part] for part in self.owned]) if self.owned else whole[:0]


def pieces(owned: list[slice], tensors: list[slice]) -> list[tuple[int, int, int, int]]:
    """(tensor, start, stop, offset in the shard) of every piece of a tensor in the owned blocks,
    in the shard's order."""
    found, offset = [], 0
    for part in owned:
        for tensor, whole in enumerate(tensors):
            start, stop = max(part.start, whole.start), min(part.stop, whole.stop)
            if stop > start:
                found.append((tensor, start, stop, offset))
                offset += stop - start
    return found


class ShardOptimizer:
    """The optimizer of this rank's blocks; its state read and written as the whole run's (every
    array of the parameters' length gathered, or taken apart), so that a checkpoint holds what
    the replicated step's would, and resumes at any P and stage."""

    def __init__(self, inner: Any, sharded: ShardedUpdate) -> None:
        self.inner, self.sharded = inner, sharded

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """The inner optimizer's step on the blocks."""
        return self.inner.step_(params, grad, step, want_norm=want_norm)  # type: ignore[no-any-return]

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The whole run's state: a collective (every rank calls it at the same step)."""
        sharded, arrays = self.sharded, {}
        for name, value in self.inner.state_arrays().items():
            per_parameter = value.shape == (sharded.width,)
            arrays[name] = (sharded.gathered(value).astype(value.dtype) if per_parameter
                            else value)  # fmt: skip
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """This rank's blocks of the whole run's state."""
        sharded = self.sharded
        self.inner.load_state_arrays({
            name: sharded.taken(np.asarray(value))
            if np.shape(value) == (sharded.n_params,) else value
            for name, value in arrays.items()})  # fmt: skip
