"""One step of synchronous data-parallel SGD on one rank, and the buffer its allreduce sums."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from syncsgd.collectives import allreduce as collective_allreduce
from syncsgd.comm.watchdog import current
from syncsgd.nn.arrays import shape_size
from syncsgd.nn.network import Network
from syncsgd.nn.optim import Optimizer, learning_rate
from syncsgd.training import data
from syncsgd.training.run import Run
from syncsgd.training.variants import Variant

if TYPE_CHECKING:
    from syncsgd.training.layered import RankGradient
    from syncsgd.training.sharded import ShardedUpdate
    from syncsgd.training.windows import PlacedSums

# The ring's chunk boundaries depend on the buffer's length, and with them the order in which a
# gradient element's float sum is taken: the buffer keeps at least as many slots for the values
# that ride along as it always had, so that float-mode results stay bitwise those of before.
MIN_RIDER_SLOTS = 6


class CommBuffer:
    """The buffer the allreduce sums: the gradient sum, then values that ride along with it."""

    def __init__(self, n_params: int, dtype: np.dtype) -> None:
        self.n_params, self.dtype = n_params, dtype
        self.riders: dict[str, slice] = {}
        self.array: np.ndarray | None = None

    def register(self, name: str, count: int = 1) -> slice:
        """Reserve `count` slots after the gradient for `name`; before the buffer is built."""
        assert self.array is None, "riders register before the buffer is built"
        start = self.n_params + sum(s.stop - s.start for s in self.riders.values())
        self.riders[name] = slice(start, start + count)
        return self.riders[name]

    def build(self) -> np.ndarray:
        """Allocate the buffer, zeroed: the gradient, the riders, and unused slots."""
        self.array = np.zeros(self.length, self.dtype)
        return self.array

    @property
    def length(self) -> int:
        """The buffer's elements: the gradient, the riders, and unused slots."""
        riders = sum(s.stop - s.start for s in self.riders.values())
        return self.n_params + max(riders, MIN_RIDER_SLOTS)

    def stand_in(self) -> np.ndarray:
        """An array of the buffer's length and dtype that holds no memory: to cut buckets by."""
        return np.broadcast_to(np.zeros(1, self.dtype), (self.length,))


class StepRecord(NamedTuple):
    """What one step did, for the hooks that run after it."""

    step: int
    shard_size: int
    batch_size: int
    loss: float  # the global batch's mean loss, before the update
    finite: bool  # loss and mean gradient finite (the update was taken)
    lr: float
    grad_norm: float  # nan unless clipping or a log asked for it
    started: float  # time.perf_counter() at the start, after the local sum, the allreduce, the end
    computed: float
    reduced: float
    ended: float
    backward: float = math.nan  # --overlap: when the backward pass began (nan: not timed apart)


@dataclass
class Rider:
    """Values a hook sends along with the gradient: filled before the allreduce, summed by it."""

    name: str
    count: int
    fill_: Callable[[np.ndarray, np.ndarray, int], None]  # (its slots, grad_sum, shard_size)
    # After the allreduce, before the update: (its summed slots, grad_mean, batch size, finite).
    read_: Callable[[np.ndarray, np.ndarray, int, bool], None] = lambda *_: None
    slots: np.ndarray = field(default_factory=lambda: np.empty(0))
    # Whether fill_ reads grad_sum: with --overlap, such riders wait for the whole backward pass.
    needs_gradient: bool = True


class StepEnd(Protocol):
    """What a step does after the exchange: the division by B, the update."""

    def divide_once_(self, batch_size: int) -> tuple[float, bool]: ...

    def update_(self, step: int, finite: bool) -> tuple[float, float]: ...


class DataParallelStep:
    """Everything one rank needs to take a step, allocated once; `take_(step)` takes it."""

    def __init__(self, comm: Any, run: Run, params: np.ndarray, optimizer: Optimizer | None,
                 variant: Variant, riders: list[Rider], trace: Any = None) -> None:  # fmt: skip
        config, model = run.config, run.model
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.params, self.variant = params, variant
        if optimizer is not None:  # None: sharded, each rank's own is made below
            self.optimizer: Optimizer = optimizer
        self.X, self.y = run.X, run.y
        self.order = data.SampleOrder(len(run.X), config.batch_size,
                                      variant.order_seed(config.seed, self.rank), config.shuffle)
        from syncsgd.nn.numerics import sums_dtype  # Numba: only when training

        largest_shard = -(-config.batch_size // self.size)
        buffer = CommBuffer(model.n_params, sums_dtype(config.exact, model.dtype))
        self.local_gradient = local_gradient(config, model, comm, largest_shard, buffer, trace)
        self.local_gradient.micro_batch_weight = variant.micro_batch_weight
        riders = [*riders, *(Rider(*fields) for fields in variant.riders(self))]  # a pitfall's
        buckets, placed = self.buffers_(config, model, buffer, riders)
        # The mean gradient: divided in place, unless exact mode's float64 sums are rounded to a
        # float32 model.
        self.grad_mean = (self.grad_sum if self.grad_sum.dtype == model.dtype
                          else np.empty(model.n_params, model.dtype))  # fmt: skip
        self.buckets = [self.comm_buffer[bucket] for bucket in buckets] if placed is None else []
        # check=False: every rank built the same buffer from options and data that the start-up
        # fingerprint showed to be the same on every rank; no agreement round per call. One rank
        # untraced: the sums are already the sum over the ranks, and the call would only return.
        self.allreduce_ = variant.allreduce(functools.partial(
            collective_allreduce, algorithm=config.algorithm, check=False, trace=trace)
            if self.size > 1 or trace is not None else alone)  # fmt: skip
        self.X_shard = np.empty((largest_shard, run.X.shape[1]), run.X.dtype)
        self.y_shard = np.empty((largest_shard, *run.y.shape[1:]), run.y.dtype)
        self.want_grad_norm = False  # a log that records the norm sets this
        self.doing = current()  # this rank's record: a collective timeout names the step
        self.optim = run.optim
        from syncsgd.nn.kernels import divide_finite_, gather_rows_  # Numba: only when training
        from syncsgd.nn.precision import ALLREDUCE_CODES, round_flat_

        self.divide_finite_, self.round_flat_ = divide_finite_, round_flat_
        self.gather_rows_ = gather_rows_
        # 0: the sums travel as they are; else the format they are cast to and restored from.
        self.wire_format = ALLREDUCE_CODES.get(config.allreduce_dtype or "", 0)
        # How the step ends: replicated (every rank divides and updates everything), or sharded
        self.end: StepEnd = self
        self.pass_params: Any = params  # what the passes read the parameters from
        self.sharded: ShardedUpdate | None = None
        if config.zero_stage:
            self.shard_(run, buckets, placed, trace)
        self._exchange_bytes = exchange_bytes(config.algorithm, self.buckets, self.rank, self.size)
        self.overlap = None  # --overlap on one rank: nothing to hide, the plain step
        if config.overlap and self.size > 1:
            from syncsgd.training.overlap import Overlap

            self.overlap = Overlap(self, buckets, self.doing)

    def buffers_(self, config: Any, model: Network, buffer: CommBuffer,
                 riders: list[Rider]) -> tuple[list[slice], PlacedSums | None]:  # fmt: skip
        """The buffer the exchange sums, its buckets, and every rider's slots in it: the whole
        gradient, or (ZeRO-2's sums placed in the buffers of the buckets under way) none, the
        riders in the last bucket's buffer."""
        spans = [buffer.register(rider.name, rider.count) for rider in riders]
        self.loss_slot = self.local_gradient.loss_slot
        buckets = bucket_slices(model, buffer.stand_in(), config.bucket_bytes)
        placed = placed_sums(config, model, buckets, self.variant, riders, buffer.dtype)
        self.comm_buffer = buffer.build() if placed is None else np.zeros(0, buffer.dtype)
        rider_slots = self.comm_buffer[model.n_params :] if placed is None else placed.riders
        for rider, span in zip(riders, spans, strict=True):
            rider.slots = rider_slots[span.start - model.n_params : span.stop - model.n_params]
        self.riders = riders
        self.grad_sum = self.comm_buffer[: model.n_params]
        return buckets, placed

    def shard_(self, run: Run, buckets: list[slice], placed: PlacedSums | None,
               trace: Any) -> None:  # fmt: skip
        """The sharded end of the step in place of the replicated one (stage 3: the parameters
        too, which the passes read from the buckets they gather)."""
        from syncsgd.training.sharded import ShardedUpdate

        self.sharded = sharded = ShardedUpdate(self, buckets, run, trace, placed)
        self.end, self.allreduce_ = sharded, sharded.reduce_
        if placed is not None:  # the passes write each bucket's sums into its buffer
            loss = placed.riders[self.loss_slot - run.model.n_params :][:1]
            self.local_gradient.placed = (placed.placed, loss)
        if sharded.placed_params is not None:  # no rank keeps the whole parameters
            self.pass_params = sharded.placed_params.placed
            self.params = np.empty(0, run.model.dtype)

    @property
    def bytes_per_step(self) -> int | None:
        """The bytes this rank sends per step, as the executor's messages carry them (None: the
        library's own allreduce, whose messages it does not see)."""
        if self.sharded is not None:
            return self.sharded.bytes_per_step()
        return self._exchange_bytes

    def whole_params(self) -> np.ndarray:
        """The whole parameters (ZeRO-3: gathered, a collective: every rank calls it alike)."""
        return self.params if self.sharded is None else self.sharded.whole_params()

    def take_(self, step: int) -> StepRecord:
        """Shard -> local gradient SUM -> allreduce (sum of sums) -> divide once by B -> update."""
        started = time.perf_counter()
        self.doing.during = step
        global_batch = self.variant.global_batch(self.order.batch(step), self.size)
        shard = data.contiguous_shard(global_batch, self.rank, self.size)
        backward = math.nan
        sharded = self.sharded
        if self.overlap is None and sharded is not None and sharded.placed_sums is not None:
            computed = sharded.exchange_(*self.gather_(shard), len(shard))
        elif self.overlap is None:
            computed = self.sum_then_reduce_(shard, len(global_batch))
        else:  # the buckets' allreduces start while the backward pass goes on
            X, y = self.gather_(shard)
            computed = self.overlap.exchange_(X, y, len(shard), len(global_batch))
            backward = self.overlap.backward_started
        reduced = time.perf_counter()
        loss, finite = self.end.divide_once_(len(global_batch))
        for rider in self.riders:
            rider.read_(rider.slots, self.grad_mean, len(global_batch), finite)
        lr, grad_norm = self.end.update_(step, finite)
        return StepRecord(step, len(shard), len(global_batch), loss, finite, lr, grad_norm,
                          started, computed, reduced, time.perf_counter(), backward)  # fmt: skip

    def sum_then_reduce_(self, shard: np.ndarray, batch_size: int) -> float:
        """The local sums, then their allreduce; returns when the local work ended."""
        self.local_sum_(shard)
        self.variant.contribution_(self.grad_sum, len(shard), batch_size, self.size)
        for rider in self.riders:  # stop flag, noise sums: summed with the gradient
            rider.fill_(rider.slots, self.grad_sum, len(shard))
        computed = time.perf_counter()
        self.reduce_()
        return computed

    def close(self) -> None:
        """End the communication thread of --overlap, if any."""
        if self.overlap is not None:
            self.overlap.close()

    def reduce_(self) -> None:
        """Allreduce every bucket; with --allreduce-dtype, the gradient sums compressed."""
        # Only the gradient is cast: the riders (loss sum, flags, counts) travel as they are.
        # The sums are not scaled by 1/P first: docs/mixed-precision.md says why.
        if self.wire_format:
            self.round_flat_(self.grad_sum, self.wire_format)  # cast before the allreduce
        for bucket in self.buckets:  # views of the buffer, in parameter order
            self.allreduce_(bucket, self.comm)
        if self.wire_format:
            self.round_flat_(self.grad_sum, self.wire_format)  # the narrow sum, restored

    def local_sum_(self, shard: np.ndarray) -> None:
        """This shard's gradient sum and loss sum, into the communication buffer."""
        X, y = self.gather_(shard)
        self.local_gradient(self.pass_params, X, y, self.comm_buffer)

    def gather_(self, shard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard's samples and targets, gathered into buffers allocated once."""
        m = len(shard)
        self.gather_rows_(self.X, shard, self.X_shard[:m])
        np.take(self.y, shard, axis=0, out=self.y_shard[:m])
        return self.X_shard[:m], self.y_shard[:m]

    def divide_once_(self, batch_size: int) -> tuple[float, bool]:
        """The one place where the sum becomes the mean: (mean loss, loss and gradient finite)."""
        # After the allreduce, once: averaging per-rank means instead would weigh uneven shards
        # wrongly. Every rank holds the same sums, so every rank decides alike on finiteness.
        terms, divisor = self.divisors(batch_size)
        loss = float(self.comm_buffer[self.loss_slot]) / terms
        gradient_finite = self.divide_finite_(self.grad_sum, divisor, self.grad_mean)
        return loss, math.isfinite(loss) and gradient_finite

    def divisors(self, batch_size: int) -> tuple[int, Any]:
        """(what the loss sum is divided by, what the gradient sums are divided by)."""
        # The loss's terms: B, or B x T for sequences (a loss term per position).
        terms = batch_size * self.local_gradient.passes.positions
        # The terms in the sums' dtype, as NumPy would; times the loss scale S when the sums are
        # scaled (terms * S: one division unscales and averages; exact for S a power of two).
        scale = self.local_gradient.scale
        return terms, self.grad_sum.dtype.type(terms if scale == 1.0 else terms * scale)

    def update_(self, step: int, finite: bool) -> tuple[float, float]:
        """The same update on every rank; a non-finite step changes nothing. (lr, grad norm)."""
        if not finite:
            return learning_rate(self.optim, step), math.nan
        info = self.optimizer.step_(self.params, self.grad_mean, step,
                                    want_norm=self.want_grad_norm)  # fmt: skip
        return info["lr"], info["grad_norm"]


def alone(buf: np.ndarray, comm: Any) -> np.ndarray:
    """The allreduce on one rank: the buffer is already its sum over the ranks."""
    return buf


def placed_sums(config: Any, model: Network, buckets: list[slice], variant: Variant,
                riders: list[Rider], dtype: np.dtype) -> PlacedSums | None:  # fmt: skip
    """ZeRO-2 and -3's gradient sums in the buffers of the buckets under way, where the run
    allows it (training/sharded.py: places_sums); else None: one buffer of the whole gradient."""
    from syncsgd.training.overlap import changes_contribution
    from syncsgd.training.sharded import places_sums
    from syncsgd.training.windows import PlacedSums

    reads = changes_contribution(variant) or any(rider.needs_gradient for rider in riders)
    if not places_sums(config, len(buckets), reads):
        return None
    return PlacedSums(model, buckets, dtype, spare=int(config.overlap))


def local_gradient(config: Any, network: Network, comm: Any, largest_shard: int,
                   buffer: CommBuffer, trace: Any = None) -> RankGradient:  # fmt: skip
    """The passes that fill the buffer with this rank's sums, in the run's mode and precision."""
    from syncsgd.training.layered import RankGradient  # imports Numba: when training

    return RankGradient(config, network, comm, largest_shard, buffer, trace)


def exchange_bytes(algorithm: str, buckets: list[np.ndarray], rank: int,
                   size: int) -> int | None:  # fmt: skip
    """The bytes this rank sends per step in the gradient's exchange, as the executor's messages
    carry them (None: the library's own allreduce, whose messages it does not see)."""
    from syncsgd.collectives.executor import sent_bytes
    from syncsgd.collectives.schedules import SCHEDULES

    if algorithm not in SCHEDULES:
        return None
    return sum(sent_bytes(algorithm, bucket.size, bucket.itemsize, size, rank)
               for bucket in buckets)  # fmt: skip


def bucket_slices(model: Network, buffer: np.ndarray,
                  bucket_bytes: int | None) -> list[slice]:  # fmt: skip
    """Cut the communication buffer into allreduce buckets of whole tensors, in parameter order."""
    # None: one bucket. 0: one per layer (W, b, and gamma, beta with BatchNorm). Otherwise tensors
    # are grouped until a bucket holds at least `bucket_bytes` of `buffer`; the riders go with the
    # last bucket.
    total = buffer.size
    if bucket_bytes is None:
        return [slice(0, total)]
    entries = model.layout()
    layers = [model.layer_of(name) for name, _, _ in entries]
    ends, start = [], 0
    for index, (_, shape, offset) in enumerate(entries):
        filled = offset + shape_size(shape)
        layer_complete = index + 1 == len(entries) or layers[index + 1] != layers[index]
        per_layer_done = bucket_bytes == 0 and layer_complete
        if per_layer_done or (
            bucket_bytes > 0 and (filled - start) * buffer.itemsize >= bucket_bytes
        ):
            ends.append(filled)
            start = filled
    if not ends or ends[-1] != model.n_params:
        ends.append(model.n_params)
    ends[-1] = total
    return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
