"""This rank's part of a step: the local gradient of its shard (nn/local.py) in the buffer the
allreduce sums, with the groups that reach across the ranks.

    begin_    the forward pass of every micro-batch and the loss sum (exact mode: the whole
              backward pass, and the peaks every rank agrees on in a MAX-allreduce)
    layers_   the gradient sums of layers top down to bottom (exact mode: their extraction)
The step calls both at once; --overlap calls layers_ a few layers at a time and hands each
bucket to its allreduce as soon as its layers are done.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from syncsgd.collectives import allreduce as collective_allreduce
from syncsgd.comm.watchdog import watching
from syncsgd.comm.world import constants
from syncsgd.nn.backprop import Placed
from syncsgd.nn.network import Network
from syncsgd.nn.numerics import LocalGroup


class RankGradient:
    """This rank's gradient SUM and loss sum, in the buffer the allreduce sums."""

    def __init__(self, config: Any, network: Network, comm: Any, max_batch: int, buffer: Any,
                 trace: Any = None) -> None:  # fmt: skip
        from syncsgd.nn.local import local_gradient  # imports Numba: only when training

        self.allreduce_ = functools.partial(collective_allreduce, algorithm=config.algorithm,
                                            check=False, trace=trace)  # fmt: skip
        self.comm_seconds = [0.0, 0.0]  # in BatchNorm's allreduces: the first step, the others
        self.calls = 0
        self.group = Ranks(self, comm, config.batchnorm == "local", config.bn_eps,
                           config.bn_momentum)  # fmt: skip
        agreement = Ranks(self, comm, False, what="exact mode's allreduce of the bounds")
        self.local = local_gradient(network, max_batch, exact=config.exact,
                                    precision=config.precision, micro_batches=config.accumulate,
                                    group=self.group, ranks=agreement)  # fmt: skip
        self.network, self.passes = network, self.local.passes
        # BatchNorm's running statistics: rank 0's are the run's (local); alike (sync)
        self.running = network.init_running() if network.n_running else None
        self.global_batch, self.n_params = config.batch_size, network.n_params
        self.n_layers = network.n_layers
        self.loss_slot = buffer.register("loss sum").start
        self.scale = 1.0  # the loss scale: the sums are of `scale` times the loss's gradients
        self._buffer: np.ndarray | None = None  # the buffer the views below are of
        # ZeRO-2: the sums placed in the buffers of the buckets under way, and the loss slot
        self.placed: tuple[Placed, np.ndarray] | None = None
        self._gradient, self._loss = np.zeros(0), np.zeros(0)

    @property
    def micro_batch_weight(self) -> Any:
        """What a micro-batch's loss is multiplied by (a pitfall changes it)."""
        return self.local.micro_batch_weight

    @micro_batch_weight.setter
    def micro_batch_weight(self, weight: Any) -> None:
        self.local.micro_batch_weight = weight

    @property
    def sums_between_layers(self) -> bool:
        """Whether the backward pass allreduces sums of its own (BatchNorm's, over the ranks)."""
        return self.running is not None and self.local.nx.sums_in_layers

    def __call__(self, params: np.ndarray | Placed, X: np.ndarray, y: np.ndarray,
                 sums: np.ndarray) -> None:  # fmt: skip
        """Fill `sums` with this shard's gradient sum and loss sum."""
        self.begin_(params, X, y, sums)
        self.layers_(params, X, sums, self.n_layers - 1, 0)

    def begin_(self, params: np.ndarray | Placed, X: np.ndarray, y: np.ndarray,
               sums: np.ndarray) -> None:  # fmt: skip
        """The forward passes and the loss sum (exact mode: the backward pass and the peaks)."""
        self.calls += 1
        grads, loss = self.views_of(sums)
        self.local.forward_(params, X, y, grads, loss, self.scale, self.running,
                            self.global_batch)  # fmt: skip

    def layers_(self, params: np.ndarray | Placed, X: np.ndarray, sums: np.ndarray, top: int,
                bottom: int) -> None:  # fmt: skip
        """The gradient sums of layers top down to bottom."""
        self.local.backward_(self.views_of(sums)[0], top, bottom)

    def views_of(self, sums: np.ndarray) -> tuple[np.ndarray | Placed, np.ndarray]:
        """The gradient part and the loss slot of the buffer the allreduce sums (made once), or
        where they are placed."""
        if self.placed is not None:
            return self.placed
        if self._buffer is not sums:
            self._buffer, self._gradient = sums, sums[: self.n_params]
            self._loss = sums[self.loss_slot : self.loss_slot + 1]
        return self._gradient, self._loss


class Ranks(LocalGroup):
    """The ranks as a group: sums through the hand-written allreduce, peaks through a
    MAX-allreduce; or, `alone`, this rank's shard (BatchNorm local)."""

    def __init__(self, owner: RankGradient, comm: Any, alone: bool, eps: float = 1e-5,
                 momentum: float = 0.1,
                 what: str = "batch norm's allreduce of the bounds") -> None:  # fmt: skip
        super().__init__(True, eps, momentum)
        self.owner, self.comm, self.alone, self.what = owner, comm, alone, what

    def sum_(self, values: np.ndarray) -> None:
        """The sum over the ranks (alone: the shard's)."""
        if not self.alone:
            started = time.perf_counter()
            self.owner.allreduce_(values, self.comm)
            self.owner.comm_seconds[self.owner.calls > 1] += time.perf_counter() - started

    def max_(self, values: np.ndarray) -> None:
        """The largest over the ranks (alone: the shard's own)."""
        if not self.alone:
            mpi, started = constants(self.comm), time.perf_counter()
            with watching(self.what):
                self.comm.Allreduce(mpi.IN_PLACE, values, op=mpi.MAX)
            self.owner.comm_seconds[self.owner.calls > 1] += time.perf_counter() - started
