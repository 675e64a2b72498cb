"""The local gradient: the loss sum and gradient SUM of one shard, through a network's layers.

The one driver of the passes (nn/backprop.py), for every mode and precision:
    forward_    per micro-batch: the forward pass and its loss sum, and the backward passes the
                numerics runs before the sums are wanted; then what the numerics agrees on
    backward_   the sums of layers top down to bottom, a few at a time if the caller likes
                (--overlap hands each bucket to its allreduce as soon as its layers are done)
The numerics (nn/numerics.py) decides what each step of this lifecycle does: float mode writes
the sums as the last micro-batch's backward pass runs in `backward_`; exact mode registers every
sum as a term during `forward_`, agrees on their peaks over the ranks, and extracts them in
`backward_`. This module tests no mode.

With K micro-batches (--accumulate K) the shard is cut as numpy.array_split cuts it; every
micro-batch adds its SUMS into the same buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from syncsgd.nn.arrays import describe
from syncsgd.nn.backprop import Backprop, Placed
from syncsgd.nn.kernels import check_count
from syncsgd.nn.network import Network
from syncsgd.nn.numerics import Group, Numerics, numerics

# What a micro-batch's loss is multiplied by, from (its size, the shard's, K): 1, so that its
# gradient SUM is added; a pitfall changes it (training/variants.py).
MicroBatchWeight = Callable[[int, int, int], float]


# What float mode's lifecycle is handed for sums placed apart: it never touches the flat buffer.
NO_FLAT = np.zeros(0)


def unweighted(size: int, shard: int, count: int) -> float:
    """Every micro-batch's loss as it is: its sums add up to the shard's."""
    return 1.0


class LocalGradient:
    """The loss sum and gradient SUM of one shard of at most `max_batch` samples."""

    def __init__(self, network: Network, nx: Numerics, max_batch: int, micro_batches: int = 1,
                 micro_batch_weight: MicroBatchWeight = unweighted) -> None:  # fmt: skip
        self.network, self.nx = network, nx
        self.micro_batches, self.micro_batch_weight = micro_batches, micro_batch_weight
        # The passes' workspaces hold one micro-batch of the shard (the largest, of K).
        self.passes = Backprop(network, largest_micro_batch(max_batch, micro_batches), nx)
        self.top = network.n_layers - 1
        self._loss = np.zeros(1)

    @property
    def positions(self) -> int:
        """Loss terms per sample: 1, or the positions of a sequence."""
        return self.passes.positions

    def forward_(self, params: np.ndarray | Placed, X: np.ndarray, y: np.ndarray,
                 grads: np.ndarray | Placed, loss: np.ndarray, scale: float = 1.0,
                 running: np.ndarray | None = None,
                 global_batch: int | None = None) -> int:  # fmt: skip
        """Every micro-batch's forward pass; loss[0] = the shard's loss sum; the argmax hits.

        `scale`: the loss scale (the sums are of scale times the loss's gradients); `running`:
        BatchNorm's running statistics; `global_batch`: B, of which X is a shard (default X's).
        Sums placed in buffers of the buckets under way are written once, layer by layer, in
        `backward_`: float mode, one micro-batch (the others write every layer's sums here)."""
        nx, count = self.nx, self.micro_batches
        if isinstance(grads, Placed) and (nx.exact or count > 1):
            raise ValueError("placed gradient sums need float mode and one micro-batch")
        nx.begin_step_(grads if isinstance(grads, np.ndarray) else NO_FLAT,
                       global_batch or max(len(X), 1))  # fmt: skip
        bounds = micro_batch_bounds(len(X), count)
        hits = 0
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            nx.begin_micro_batch_(index, scale * self.micro_batch_weight(stop - start, len(X),
                                                                         count))  # fmt: skip
            loss_sum, correct = self.passes.forward_loss_(params, X[start:stop], y[start:stop],
                                                          running)  # fmt: skip
            loss[0] = loss_sum if index == 0 else loss[0] + loss_sum
            hits += correct
            nx.end_forward_(functools.partial(self.passes.backward_, grads, self.top, 0),
                            index == count - 1)  # fmt: skip
        nx.agree_(grads if isinstance(grads, np.ndarray) else NO_FLAT, loss)
        return hits

    def backward_(self, grads: np.ndarray | Placed, top: int, bottom: int) -> None:
        """The gradient sums of layers top down to bottom, into grads."""
        self.nx.layers_(functools.partial(self.passes.backward_, grads), top, bottom)

    def __call__(self, params: np.ndarray, X: np.ndarray, y: np.ndarray, grad_out: np.ndarray,
                 scale: float = 1.0, running: np.ndarray | None = None,
                 global_batch: int | None = None) -> tuple[float, int]:  # fmt: skip
        """(loss sum, argmax hits); grad_out = the sum of gradients of `scale` times the loss."""
        n_params = self.network.n_params
        if not isinstance(grad_out, np.ndarray) or grad_out.shape != (n_params,) or (
                not grad_out.flags.writeable):  # fmt: skip
            raise ValueError(f"grad_out must be a writable array of shape ({n_params},), got "
                             f"{describe(grad_out)}")  # fmt: skip
        hits = self.forward_(params, X, y, grad_out, self._loss, scale, running, global_batch)
        self.backward_(grad_out, self.top, 0)
        return float(self._loss[0]), hits


def local_gradient(network: Network, max_batch: int, *, exact: bool = False,
                   precision: str = "fp32", micro_batches: int = 1, group: Group | None = None,
                   ranks: Group | None = None,
                   micro_batch_weight: MicroBatchWeight = unweighted) -> LocalGradient:  # fmt: skip
    """The local gradient of `network` in a mode and precision, its workspaces for `max_batch`
    samples; alone (one process: exact mode's peaks are its own, its sums a serial run's) unless
    `group` (BatchNorm's statistics) and `ranks` (exact mode's peaks) say otherwise."""
    largest = largest_micro_batch(max_batch, micro_batches)
    nx = numerics(exact, precision, network.dtype, network.largest_weight(),
                  largest * network.largest_block(), network.n_params, group, ranks)  # fmt: skip
    return LocalGradient(network, nx, max_batch, micro_batches, micro_batch_weight)


def largest_micro_batch(max_batch: int, micro_batches: int) -> int:
    """The most samples of a shard of at most `max_batch` that one of K micro-batches holds."""
    max_batch = check_count("max_batch", max_batch, low=0)
    return -(-max_batch // check_count("micro_batches", micro_batches, low=1))


def micro_batch_bounds(shard_size: int, count: int) -> list[int]:
    """Where each of `count` micro-batches of a shard starts, then its end: numpy.array_split's
    sizes (the first shard_size % count one larger; empty ones when count > shard_size)."""
    if count == 1:
        return [0, shard_size]
    size, larger = divmod(shard_size, count)
    return [index * size + min(index, larger) for index in range(count + 1)]


__all__ = ["LocalGradient", "local_gradient", "micro_batch_bounds"]
