"""The local gradient of a --model network: one layered pass for every mode and precision.

    begin_    the forward pass and the loss; exact mode: the whole backward pass, the peaks every
              rank agrees on (a MAX-allreduce) and the extracted loss sum
    layers_   the gradient sums of layers top down to bottom (exact mode: their extraction)
The step calls both at once; --overlap calls layers_ a few layers at a time and hands each
bucket to its allreduce as soon as its layers are done.

With --accumulate K the shard is K micro-batches (numpy.array_split's sizes): begin_ runs every
micro-batch but the last through both passes, adding their SUMS into the same buffer, then the
last one's forward pass; layers_ is the last one's backward pass. Exact mode registers every
micro-batch's terms, agrees on peaks that cover them all, and extracts them all in layers_.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from syncsgd.collectives import allreduce as collective_allreduce
from syncsgd.comm.watchdog import watching
from syncsgd.comm.world import constants
from syncsgd.nn.network import Network
from syncsgd.nn.numerics import LocalGroup


class LayeredLocalGradient:
    """This rank's gradient SUM and loss sum, in the buffer the allreduce sums."""

    def __init__(self, config: Any, network: Network, max_batch: int, buffer: Any,
                 trace: Any = None) -> None:  # fmt: skip
        from syncsgd.nn.backprop import Backprop  # imports Numba: only when training
        from syncsgd.nn.numerics import numerics

        # The passes' workspaces hold one micro-batch of the shard (the largest, of K).
        self.micro_batches = config.accumulate
        largest = -(-max_batch // self.micro_batches)
        self.nx: Any = numerics(config.exact, config.precision, network.dtype,
                                network.largest_weight(), largest * network.largest_block(),
                                network.n_params)  # fmt: skip
        self.network, self.passes = network, Backprop(network, largest, self.nx)
        self.nx.global_batch = config.batch_size
        self.allreduce_ = functools.partial(collective_allreduce, algorithm=config.algorithm,
                                            check=False, trace=trace)  # fmt: skip
        self.group = StatsGroup(self, config.batchnorm == "local", config.bn_eps,
                                config.bn_momentum)  # fmt: skip
        self.nx.group = self.group
        # BatchNorm's running statistics: rank 0's are the run's (local); alike (sync)
        self.running = network.init_running() if network.n_running else None
        self.comm_seconds = [0.0, 0.0]  # in BatchNorm's allreduces: the first step, the others
        self.calls = 0
        self.global_batch, self.n_params = config.batch_size, network.n_params
        self.n_layers = network.n_layers
        self.loss_slot = buffer.register("loss sum").start
        self.exact = config.exact
        self.bounds = np.zeros(0)
        self.scales: list[tuple[float, float]] | None = None  # exact: None if not finite
        # What a micro-batch's loss is multiplied by, from (its size, the shard's, K): 1, so
        # that its gradient SUM is added; a pitfall changes it (variants.py).
        self.micro_batch_weight: Any = lambda size, shard, count: 1.0
        self._buffer: np.ndarray | None = None  # the buffer the views below are of
        self._gradient = np.zeros(0)

    @property
    def sums_between_layers(self) -> bool:
        """Whether the float-mode backward pass allreduces sums of its own (sync batchnorm)."""
        return self.running is not None and not self.group.alone and not self.exact

    @property
    def scale(self) -> float:
        """The loss scale: the sums are of `scale` times the loss's gradients."""
        return self.nx.scale

    @scale.setter
    def scale(self, value: float) -> None:
        self.nx.scale = value

    def __call__(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                 sums: np.ndarray) -> None:  # fmt: skip
        """Fill `sums` with this shard's gradient sum and loss sum."""
        self.begin_(comm, params, X, y, sums)
        self.layers_(params, X, sums, self.n_layers - 1, 0)

    def begin_(self, comm: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray,
               sums: np.ndarray) -> None:  # fmt: skip
        """The forward pass and the loss sum (exact mode: the backward pass and the peaks);
        with micro-batches, every one but the last through both passes first."""
        grads = self.gradient_of(sums)
        if self.exact:
            grads[:] = 0  # the extracted sums are added in
        self.group.comm, self.calls = comm, self.calls + 1
        if self.exact:
            self.nx.begin_()
        top, scale = self.n_layers - 1, self.nx.scale
        bounds = micro_batch_bounds(len(X), self.micro_batches)
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            # float mode: the first micro-batch's sums are written into their slots, the others
            # added to them
            self.nx.first_sums = not self.exact and index == 0
            self.nx.scale = scale * self.micro_batch_weight(stop - start, len(X),
                                                            self.micro_batches)  # fmt: skip
            loss_sum, _ = self.passes.forward_loss_(params, X[start:stop], y[start:stop],
                                                    self.running)  # fmt: skip
            if not self.exact:
                sums[self.loss_slot] = loss_sum if index == 0 else sums[self.loss_slot] + loss_sum
            last = index == self.micro_batches - 1
            if self.exact or not last:  # float mode: layers_ is the last one's backward pass
                self.passes.backward_(grads, top, 0)
            if self.exact and not last:
                self.nx.next_micro_batch_()
        self.nx.scale = scale
        if not self.exact:
            return
        self.scales = self.agree_(comm)
        if self.scales is None:
            sums[:] = np.nan  # the same on every rank: all skip or stop alike
            return
        sums[self.loss_slot] = self.nx.extract_loss(self.scales)

    def gradient_of(self, sums: np.ndarray) -> np.ndarray:
        """The gradient part of the buffer the allreduce sums (one view per buffer)."""
        if self._buffer is not sums:
            self._buffer, self._gradient = sums, sums[: self.n_params]
        return self._gradient

    def agree_(self, comm: Any) -> list[tuple[float, float]] | None:
        """The peaks of every term, MAX-allreduced; their fixed points, or None if not finite."""
        if self.bounds.size != len(self.nx.peaks):
            self.bounds = np.zeros(len(self.nx.peaks))
        self.nx.bounds(self.bounds)
        mpi = constants(comm)
        with watching("exact mode's allreduce of the bounds"):
            comm.Allreduce(mpi.IN_PLACE, self.bounds, op=mpi.MAX)
        if not np.isfinite(self.bounds).all():
            return None
        return self.nx.scales(self.bounds, self.global_batch)

    def layers_(self, params: np.ndarray, X: np.ndarray, sums: np.ndarray, top: int,
                bottom: int) -> None:  # fmt: skip
        """The gradient sums of layers top down to bottom."""
        if not self.exact:
            self.passes.backward_(self.gradient_of(sums), top, bottom)
        elif self.scales is not None:
            self.nx.accumulate_(self.scales, top, bottom)


def micro_batch_bounds(shard_size: int, count: int) -> list[int]:
    """Where each of `count` micro-batches of a shard starts, then its end: numpy.array_split's
    sizes (the first shard_size % count one larger; empty ones when count > shard_size)."""
    if count == 1:
        return [0, shard_size]
    size, larger = divmod(shard_size, count)
    return [index * size + min(index, larger) for index in range(count + 1)]


class StatsGroup(LocalGroup):
    """Whose samples BatchNorm's statistics are over: the global batch (sync: the sums
    allreduced, the hand-written allreduce) or this rank's shard alone (local)."""

    def __init__(self, local: LayeredLocalGradient, alone: bool, eps: float,
                 momentum: float) -> None:  # fmt: skip
        super().__init__(True, eps, momentum)
        self.local, self.alone = local, alone
        self.comm: Any = None  # the rank's communicator, set at every step

    def sum_(self, values: np.ndarray) -> None:
        """Sync: the sum over the ranks; local: the shard's alone."""
        if not self.alone:
            started = time.perf_counter()
            self.local.allreduce_(values, self.comm)
            self.local.comm_seconds[self.local.calls > 1] += time.perf_counter() - started

    def max_(self, values: np.ndarray) -> None:
        """Sync: the largest over the ranks; local: the shard's own."""
        if not self.alone:
            mpi, started = constants(self.comm), time.perf_counter()
            with watching("batch norm's allreduce of the bounds"):
                self.comm.Allreduce(mpi.IN_PLACE, values, op=mpi.MAX)
            self.local.comm_seconds[self.local.calls > 1] += time.perf_counter() - started
