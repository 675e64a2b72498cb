"""ZeRO stages 1-3: each rank keeps the optimizer state (1), the gradient (2) and the parameters
(3) of its shard of the parameters, and updates its shard.

    reduce-scatter   every bucket of gradient sums: the ring allreduce's first half, so the block
                     each rank ends with holds the allreduce's bits (stage 2: each bucket as soon
                     as the backward pass has written it, into a buffer reused bucket after bucket)
    agree            the riders (loss sum, flags), a finite flag and the shard's squares in one
                     small allreduce: every rank skips, stops and logs alike
    divide, update   the owned blocks' mean gradient, the optimizer's step on them alone
    allgather        every bucket's updated parameters: the ring allreduce's second half
                     (stage 3: none here; a pass gathers the buckets of a layer as it reads them)
A rank owns, in every bucket, the block the ring's reduce-scatter completes on it (block (r + 1)
mod P of numpy.array_split's P blocks of the bucket): the same elements, summed in the same
order, as the replicated step. docs/sharded.md shows the partition and what it sends.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from syncsgd.collectives.executor import execute, sent_bytes
from syncsgd.collectives.schedules import Collective, chunk_bounds, owned_block
from syncsgd.nn.exact import SQUARE_LIMBS, add_square_limbs_, exact_square_sum, limbs_value
from syncsgd.nn.optim import learning_rate, make_optimizer
from syncsgd.nn.optim.schedule import clip_
from syncsgd.nn.optim.tensors import FlatOptimizer, tensor_slices
from syncsgd.nn.precision import narrow_copy_
from syncsgd.training.windows import PlacedParams, PlacedSums

Gather = Callable[[np.ndarray, Any], Any]  # an allgather of a buffer over a communicator

# What the passes are handed for a buffer of the whole gradient when the sums are placed in the
# buckets' buffers: they never touch it.
NO_SUMS = np.zeros(0)

REDUCE_SCATTER = Collective("reduce-scatter", "ring-allreduce")
ALLGATHER = Collective("allgather", "ring-allreduce")


def owned_slices(buckets: list[slice], n_params: int, rank: int, size: int) -> list[slice]:
    """The parameters this rank owns: per bucket, its block of the bucket, without the riders."""
    return [slice(start, stop) for _, start, stop, _ in owned_parts(buckets, n_params, rank, size)]


def owned_parts(buckets: list[slice], n_params: int, rank: int,
                size: int) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """(bucket, start, stop, offset in the shard) of every block of parameters this rank owns."""
    owned, offset = [], 0
    for index, bucket in enumerate(buckets):
        bounds = chunk_bounds(bucket.stop - bucket.start, size)
        block = owned_block(rank, size)
        start = min(bucket.start + bounds[block], n_params)
        stop = min(bucket.start + bounds[block + 1], n_params)
        if stop > start:
            owned.append((index, start, stop, offset))
            offset += stop - start
    return owned


def places_sums(config: Any, buckets: int, reads_whole_gradient: bool) -> bool:
    """Whether a sharded step writes the gradient sums into the buffers of the buckets under way
    (stages 2 and 3), not into one buffer of the whole gradient. It cannot where a later pass
    adds into every bucket (exact mode's extraction after every pass; the micro-batches of
    --accumulate), or something reads the whole local gradient (the loss scaler's overflow
    check, the noise scale, a pitfall); with one bucket the bucket under way is the whole."""
    return (config.zero_stage >= 2 and buckets > 1 and not config.exact
            and config.accumulate == 1 and not reads_whole_gradient)  # fmt: skip


def prefetches(config: Any, comm: Any) -> bool:
    """Whether stage 3's passes gather the next layer's buckets while a layer computes: with
    --overlap under MPI, where two threads of a rank may wait at once (thread ranks keep one
    wait per rank: BatchNorm's and exact mode's peaks, taken on the training thread, would wait
    beside a gather)."""
    from syncsgd.training.overlap import waits_in_two_threads

    return bool(config.overlap) and comm.Get_size() > 1 and waits_in_two_threads(comm)


class ShardedUpdate:
    """The sharded end of a step: built once per run, used in place of the replicated one."""

    def __init__(self, stepper: Any, buckets: list[slice], run: Any, trace: Any = None,
                 placed: PlacedSums | None = None) -> None:  # fmt: skip
        config, comm = run.config, stepper.comm
        self.stepper, self.comm, self.stage = stepper, comm, config.zero_stage
        self.n_params = n_params = run.model.n_params
        self.bucket_slices, self.placed_sums = buckets, placed
        self.owned_at = owned_parts(buckets, n_params, comm.Get_rank(), comm.Get_size())
        self.owned = [slice(start, stop) for _, start, stop, _ in self.owned_at]
        edges = [0, *(edge for part in self.owned for edge in (part.start, part.stop)), n_params]
        self.others = [slice(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
        self.width = width = sum(part.stop - part.start for part in self.owned)
        dtype = run.model.dtype
        # It clips by the norm over every shard, which this step reduces: not by its own.
        self.optim = run.optim
        # Its tensors are the pieces of the model's tensors in the blocks it owns, their norms
        # (LAMB's, LARS's trust ratios) summed over the ranks.
        self.pieces = pieces(self.owned, tensor_slices(run.model.layout(), n_params))
        self.n_tensors = len(run.model.layout())
        # An update element by element steps each block where it lies, one optimizer per block;
        # LAMB's and LARS's norms of tensors take one over the blocks copied into one array.
        self.per_block = config.optimizer not in ("lamb", "lars")
        self.optimizer = self.make_optimizer(run, dtype)
        self.sums_, self.means_ = self.gradient_blocks(stepper, width)
        from syncsgd.training.overlap import ready_layers

        self.bottoms = ready_layers(run.model, buckets)  # a bucket is written after these layers
        # The parameters' blocks as one contiguous array (stage 3: the parameters themselves, the
        # only copy this rank keeps; else only for LAMB, LARS over several blocks), and the
        # gradient's (those two, the sums not placed).
        copies = not self.per_block and len(self.owned) > 1
        # (what is not needed is an empty view: no allocation, and no hold on the parameters)
        self.params_shard = (np.empty(width, dtype) if self.stage == 3 or copies
                             else stepper.params[:0])  # fmt: skip
        nothing = self.params_shard[:0]
        self.grad_shard = np.empty(width, dtype) if copies and placed is None else nothing
        self.placed_params = None
        if self.stage == 3:
            self.params_shard[...] = self.taken(stepper.params)
            # The passes read the parameters in their dtype: float32 for bf16/fp16 (autocast's)
            passes = stepper.local_gradient.local.nx.dtype
            self.placed_params = PlacedParams(run.model, buckets, passes, self.gather_bucket_,
                                              prefetch=prefetches(config, comm))
            longest = max(bucket.stop - bucket.start for bucket in buckets)
            self.carrier = np.empty(longest, dtype) if passes != dtype else nothing
        # Agreed in one small allreduce: the riders, kept before the reduce-scatter sums them in
        # part; then the ranks whose blocks are not finite; then the blocks' sum of squares.
        self.agreed = np.zeros(self.riders.size + 2, self.riders.dtype)
        self.reduce_scatter_ = functools.partial(execute, REDUCE_SCATTER, trace=trace)
        self.allgather_ = functools.partial(execute, ALLGATHER, trace=trace)
        self.allreduce_ = functools.partial(execute, "ring", trace=trace)
        # The passes' gathers (stage 3); --overlap relays them to its communication thread.
        self.passes_allgather_ = self.allgather_
        self.limbs = np.zeros(SQUARE_LIMBS, np.int64)  # exact mode's squares, summed exactly
        self.grad_norm = math.nan
        self.steps, self.gathered_bytes = 0, 0  # stage 3: what the passes' gathers sent
        if run.start is not None:  # resumed: this rank's blocks of the whole run's state
            self.optimizer.load_state_arrays(run.start.optimizer)

    def make_optimizer(self, run: Any, dtype: np.dtype) -> ShardOptimizer:
        """The optimizers of this rank's blocks: one per block, or one over them all."""
        config = run.config
        spans = ([(offset, offset + stop - start) for _, start, stop, offset in self.owned_at]
                 if self.per_block and self.owned_at else [(0, self.width)])  # fmt: skip
        inners = []
        for low, high in spans:
            layout = [(f"piece {index}", (stop - start,), offset - low) for index,
                      (_, start, stop, offset) in enumerate(self.pieces) if low <= offset < high]
            inner = make_optimizer(config.optimizer, replace(run.optim, clip_norm=None),
                                   high - low, dtype, config, layout)  # fmt: skip
            if isinstance(inner, FlatOptimizer):  # the Adam family: LAMB's, LARS's norms
                inner.shared_norms = self.tensor_norms
            inners.append(inner)
        return ShardOptimizer(inners, spans, self)

    def gradient_blocks(self, stepper: Any, width: int) -> tuple[list[np.ndarray],
                                                                 list[np.ndarray]]:  # fmt: skip
        """The owned blocks of the gradient sums and of the mean, and where the buckets and the
        riders are: in the buffer of the whole gradient, or (placed) in the buckets' buffers."""
        placed = self.placed_sums
        if placed is None:
            self.buckets = stepper.buckets  # views of the communication buffer
            self.riders = stepper.comm_buffer[self.n_params :]  # the loss sum, the hooks' slots
            return ([stepper.grad_sum[part] for part in self.owned],
                    [stepper.grad_mean[part] for part in self.owned])  # fmt: skip
        self.buckets = [placed.buffers.of(index) for index in range(len(self.bucket_slices))]
        self.riders = placed.riders
        # Float mode: the sums are in the model's dtype, and divided in place.
        self.grad_sums = np.empty(width, placed.buffers.own.dtype)
        blocks = [self.grad_sums[offset : offset + stop - start]
                  for _, start, stop, offset in self.owned_at]  # fmt: skip
        return blocks, blocks

    @property
    def rider_bucket(self) -> np.ndarray:
        """The bucket the riders ride in: the last."""
        return self.buckets[-1]

    def bytes_per_step(self) -> int:
        """What this rank sends in a step: every bucket's reduce-scatter, the agreement, and the
        parameters' allgathers (stage 3: what the passes gathered, per step taken)."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        agreement = sent_bytes("ring", self.agreed.size, self.agreed.itemsize, size, rank)
        halves = (REDUCE_SCATTER,) if self.stage == 3 else (REDUCE_SCATTER, ALLGATHER)
        sent = agreement + sum(sent_bytes(half, bucket.size, bucket.itemsize, size, rank)
                               for bucket in self.buckets for half in halves)  # fmt: skip
        return sent + (self.gathered_bytes // self.steps if self.steps else 0)

    def reduce_(self, bucket: np.ndarray, comm: Any) -> None:
        """A bucket's reduce-scatter (the step's `allreduce_`, on whichever thread runs it)."""
        if bucket is self.rider_bucket:  # summed apart, in full: keep them before
            self.agreed[: self.riders.size] = self.riders
        self.reduce_scatter_(bucket, comm)

    def exchange_(self, X: np.ndarray, y: np.ndarray, shard_size: int) -> float:
        """Placed sums: the passes, each bucket reduce-scattered as soon as the backward pass has
        written it, its owned block kept; when the local work ended."""
        stepper, gradient = self.stepper, self.stepper.local_gradient
        params = stepper.pass_params
        gradient.begin_(params, X, y, NO_SUMS)
        for rider in stepper.riders:  # the stop flag: riders that read no gradient
            rider.fill_(rider.slots, NO_SUMS, shard_size)
        bottoms = self.bottoms
        top, computed = gradient.n_layers - 1, time.perf_counter()
        for index in range(len(bottoms) - 1, -1, -1):  # from the last layer back
            if bottoms[index] <= top:
                gradient.layers_(params, X, NO_SUMS, top, bottoms[index])
                top, computed = bottoms[index] - 1, time.perf_counter()
            self.reduce_bucket_(index)
        return computed

    def reduce_bucket_(self, index: int, comm: Any = None) -> None:
        """Bucket `index`'s reduce-scatter from its buffer (over `comm`, default the step's);
        its owned block kept (with --allreduce-dtype: the gradient cast before, the narrow sum
        restored after)."""
        stepper, bucket, start = self.stepper, self.buckets[index], self.bucket_slices[index].start
        gradient = bucket[: self.n_params - start]
        if stepper.wire_format:
            stepper.round_flat_(gradient, stepper.wire_format)
        self.reduce_(bucket, comm or self.comm)
        for (owner, low, high, _), block in zip(self.owned_at, self.sums_, strict=True):
            if owner == index:
                block[...] = bucket[low - start : high - start]
                if stepper.wire_format:
                    stepper.round_flat_(block, stepper.wire_format)

    def divide_once_(self, batch_size: int) -> tuple[float, bool]:
        """The owned blocks' sums become the mean, once; the riders and the verdict agreed by
        every rank: (mean loss, loss and the whole gradient finite)."""
        stepper = self.stepper
        terms, divisor = stepper.divisors(batch_size)
        finite = True
        for sums, mean in zip(self.sums_, self.means_, strict=True):  # as the replicated step
            finite &= stepper.divide_finite_(sums, divisor, mean)
        own_squares = self.squares_()
        self.agreed[-2:] = (0.0 if finite else 1.0), own_squares
        self.allreduce_(self.agreed, self.comm)
        self.riders[...] = self.agreed[: self.riders.size]
        loss = float(self.riders[stepper.loss_slot - self.n_params]) / terms
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
        if not self.needs_norm or self.optim.exact_norm:
            self.limbs[...] = 0
            if self.needs_norm:
                for mean in self.means_:
                    add_square_limbs_(mean, self.limbs)
            return 0.0
        return sum(float(np.dot(mean.astype(np.float64), mean)) for mean in self.means_)
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
        self.steps += 1
        if not finite:  # unchanged, but allgathered: a pitfall may make the ranks disagree
            self.allgather_params_()
            return learning_rate(self.stepper.optim, step), math.nan
        params, grads = self.blocks()
        if self.optim.clip_norm is not None:  # the replicated step's first move, the same norm
            for grad in grads:
                clip_(grad, self.optim.clip_norm, self.grad_norm)
        info = self.optimizer.step_(params, grads, step)
        if not self.per_block and len(self.owned) > 1 and self.stage < 3:  # copies, back
            for (_, start, stop, offset) in self.owned_at:
                self.stepper.params[start:stop] = self.params_shard[offset : offset + stop - start]
        self.allgather_params_()
        return info["lr"], self.grad_norm

    def blocks(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The owned parameters and mean gradient as the optimizer steps them: block by block,
        where they lie; or (LAMB, LARS) each one contiguous array, a view of a rank's one block
        or a copy of its blocks (stage 3: the parameters are one array already)."""
        stage, owned_at = self.stage, self.owned_at
        if self.per_block and owned_at:
            if stage == 3:  # the blocks, one after the other in the one array kept
                return ([self.params_shard[offset : offset + stop - start]
                         for _, start, stop, offset in owned_at], list(self.means_))  # fmt: skip
            return [self.stepper.params[part] for part in self.owned], list(self.means_)
        whole = self.params_shard if stage == 3 else self.contiguous(self.stepper.params,
                                                                     self.params_shard)
        if self.placed_sums is not None:
            return [whole], [self.grad_sums]
        return [whole], [self.contiguous_blocks(self.means_, self.grad_shard)]

    def contiguous(self, whole: np.ndarray, out: np.ndarray) -> np.ndarray:
        """This rank's blocks of `whole`: a view of its one block, or copied into `out`."""
        return self.contiguous_blocks([whole[part] for part in self.owned], out)

    @staticmethod
    def contiguous_blocks(blocks: list[np.ndarray], out: np.ndarray) -> np.ndarray:
        """One block as it is; several copied one after the other into `out`."""
        if len(blocks) == 1:
            return blocks[0]
        start = 0
        for block in blocks:
            out[start : start + block.size] = block
            start += block.size
        return out[:start]

    def allgather_params_(self) -> None:
        """Every rank's updated blocks to every rank (stage 3: to none; the passes gather what
        they read, afresh)."""
        if self.placed_params is not None:
            self.placed_params.forget_()
            return
        params = self.stepper.params
        if self.placed_sums is None:  # through the communication buffer, spent
            whole = self.gathered_in_buffer(params)
            for part in self.others:
                params[part] = whole[part]
            return
        last = len(self.bucket_slices) - 1
        for index, bucket in enumerate(self.bucket_slices):
            if index < last:  # the parameters carry their own bucket
                self.allgather_(params[bucket], self.comm)
                continue
            carrier = self.buckets[last]  # with the riders' slots: its buffer, spent
            carrier[: self.n_params - bucket.start] = params[bucket.start :]
            self.allgather_(carrier, self.comm)
            params[bucket.start :] = carrier[: self.n_params - bucket.start]

    def gathered_in_buffer(self, whole: np.ndarray) -> np.ndarray:
        """Every rank's blocks of an array of the parameters' layout (this rank's in `whole`),
        whole: a view of the communication buffer, in its dtype, until the next step."""
        buffer = self.stepper.comm_buffer
        for part in self.owned:  # the gradient sums are spent: the buffer carries these
            buffer[part] = whole[part]
        for bucket in self.buckets:
            self.allgather_(bucket, self.comm)
        return buffer[: self.n_params]

    def gathered(self, shard: np.ndarray) -> np.ndarray:
        """Every rank's blocks of an array of the parameters' layout, whole: a new array."""
        whole = np.empty(self.n_params, shard.dtype)
        last = len(self.bucket_slices) - 1
        for index, bucket in enumerate(self.bucket_slices[:last]):  # gathered where they lie
            self.fill_bucket_(index, shard, whole[bucket])
        bucket = self.bucket_slices[last]  # with the riders' slots: through a buffer of its own
        carrier = np.zeros(bucket.stop - bucket.start, shard.dtype)
        self.fill_bucket_(last, shard, carrier)
        whole[bucket.start :] = carrier[: self.n_params - bucket.start]
        return whole

    def fill_bucket_(self, index: int, shard: np.ndarray, carrier: np.ndarray,
                     allgather_: Gather | None = None) -> None:  # fmt: skip
        """Bucket `index` of an array of the parameters' layout, gathered into `carrier` from
        every rank's blocks of it."""
        start = self.bucket_slices[index].start
        for owner, low, high, offset in self.owned_at:
            if owner == index:
                carrier[low - start : high - start] = shard[offset : offset + high - low]
        (allgather_ or self.allgather_)(carrier, self.comm)

    def gather_bucket_(self, index: int, out: np.ndarray, allgather_: Gather | None = None) -> None:
        """Stage 3: bucket `index`'s parameters for a pass, as the passes read them (rounded
        to a narrow --precision from the parameters' own values, as the replicated step's)."""
        nx = self.stepper.local_gradient.local.nx
        carrier = out if out.dtype == self.params_shard.dtype else self.carrier[: out.size]
        self.fill_bucket_(index, self.params_shard, carrier, allgather_ or self.passes_allgather_)
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self.gathered_bytes += sent_bytes(ALLGATHER, carrier.size, carrier.itemsize, size, rank)
        if carrier is out:
            nx.round_(out)
        else:  # float64 parameters, float32 passes: rounded once, to the format
            narrow_copy_(carrier, out, nx.fmt)

    def whole_params(self) -> np.ndarray:
        """The whole parameters: a collective at stage 3 (every rank calls it at the same step)."""
        if self.stage < 3:
            return self.stepper.params  # type: ignore[no-any-return]
        return self.gathered(self.params_shard)

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
    """The optimizers of this rank's blocks (one per block, or one over them all); their state
    loaded from the whole run's (every array of the parameters' length taken apart), so that a
    run resumes at any P and stage."""

    def __init__(self, inners: list[Any], spans: list[tuple[int, int]],
                 sharded: ShardedUpdate) -> None:  # fmt: skip
        self.inners, self.spans, self.sharded = inners, spans, sharded

    def step_(self, params: list[np.ndarray], grads: list[np.ndarray],
              step: int) -> dict[str, float]:  # fmt: skip
        """Every inner optimizer's step on its blocks."""
        info: dict[str, float] = {}
        for inner, block, grad in zip(self.inners, params, grads, strict=True):
            info = inner.step_(block, grad, step, want_norm=False)
        return info

    def own_state(self) -> list[dict[str, np.ndarray]]:
        """Every inner optimizer's state, of its blocks alone (not a collective)."""
        return [inner.state_arrays() for inner in self.inners]

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """This rank's blocks of the whole run's state."""
        sharded = self.sharded
        taken = {name: sharded.taken(np.asarray(value))
                 if np.shape(value) == (sharded.n_params,) else value
                 for name, value in arrays.items()}  # fmt: skip
        for inner, (low, high) in zip(self.inners, self.spans, strict=True):
            inner.load_state_arrays({
                name: value[low:high] if np.shape(value) == (sharded.width,) else value
                for name, value in taken.items()})  # fmt: skip
