"""The lab's `ddp-step` kind: the data-parallel step written by the student around syncsgd's
layers - shard, local sum, allreduce, divide once, update - graded against serial SGD on the
whole batch: within float rounding in float mode, bit for bit in exact mode.

The model is a small MLP (`dense(8) relu dense` on 4 features, 3 classes, cross-entropy,
float64); a case is P ranks, a batch of B samples drawn from a seed, and the mode. The student's
`local_sum` is syncsgd's local gradient (`nn.local.local_gradient`); in exact mode it agrees on
the peaks of its sums with the other ranks (a MAX-allreduce on the communicator within the
lab's, not counted), so that every rank's sums land on one grid and add exactly in any order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from syncsgd.apps.lab_kinds import Case, Expected, Kind
from syncsgd.comm.world import constants
from syncsgd.nn.numerics import LocalGroup

MODEL, FEATURES, CLASSES, LR = "dense(8) relu dense", 4, 3, 0.1


@functools.cache
def network() -> Any:
    """The lab's model (built once; its layers hold no state between steps)."""
    from syncsgd.nn.network import build

    return build(MODEL, in_shape=(FEATURES,), outputs=CLASSES, loss="xent", dtype="float64")


def data(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a case: B samples of 4 features, labels 0..2."""
    rng = np.random.default_rng([seed, batch])
    return rng.normal(size=(batch, FEATURES)), rng.integers(0, CLASSES, batch)


def make(size: int, batch: int, seed: int, exact: bool) -> Case:
    """A case: every rank starts from the same initial parameters (seeded)."""
    params = network().init_params(seed=seed)
    return Case(size, "float64", tuple(params.copy() for _ in range(size)), 0,
                (batch, seed, exact, LR))  # fmt: skip


class _Ranks(LocalGroup):
    """Exact mode's group: the peaks' MAX over the ranks (no BatchNorm in the lab's model)."""

    alone = False

    def __init__(self, comm: Any) -> None:
        super().__init__(True)
        self.comm = comm

    def max_(self, values: np.ndarray) -> None:
        mpi = constants(self.comm)
        self.comm.Allreduce(mpi.IN_PLACE, values, op=mpi.MAX)


def arguments(case: Case, comm: Any) -> tuple[np.ndarray, np.ndarray, float, Callable]:
    """The student's function's arguments after params and comm: X, y, lr, local_sum."""
    batch, seed, exact, lr = case.extra
    within = getattr(comm, "unwatched", comm)  # the lab's counts only what the answer sends
    ranks = _Ranks(within) if exact and case.size > 1 else None
    gradient = network_gradient(batch, exact, ranks)

    def local_sum(params: np.ndarray, X: np.ndarray, y: np.ndarray, out: np.ndarray) -> float:
        """The sum over the samples of X of each one's gradient, into `out`; their loss sum."""
        loss, _ = gradient(params, X, y, out, global_batch=batch)
        return float(loss)

    X, y = data(batch, seed)
    return X, y, lr, local_sum


def network_gradient(batch: int, exact: bool, ranks: Any = None) -> Any:
    """syncsgd's local gradient of the lab's model for up to `batch` samples."""
    from syncsgd.nn.local import local_gradient

    return local_gradient(network(), max(batch, 1), exact=exact, ranks=ranks)


def expected(case: Case) -> Expected:
    """Serial SGD's step on the whole batch: the sum of the gradients, divided by B once."""
    batch, seed, exact, lr = case.extra
    params = case.inputs[0].copy()
    X, y = data(batch, seed)
    grads = np.empty_like(params)
    network_gradient(batch, exact)(params, X, y, grads, global_batch=batch)
    grads /= batch
    params -= lr * grads
    return [(params, None) for _ in case.inputs]


def _library(allreduce: Callable[[np.ndarray, Any], Any]) -> Callable[[np.ndarray, Any, Case], Any]:
    """The step as syncsgd's training takes it (training/step.py), with `allreduce`."""

    def step(params: np.ndarray, comm: Any, case: Case) -> None:
        X, y, lr, local_sum = arguments(case, comm)
        rank, size, batch = comm.Get_rank(), comm.Get_size(), len(X)
        part = np.array_split(np.arange(batch), size)[rank]
        grads = np.empty_like(params)
        local_sum(params, X[part], y[part], grads)
        allreduce(grads, comm)
        grads /= batch
        params -= lr * grads

    return step


def _ring(grads: np.ndarray, comm: Any) -> None:
    from syncsgd.collectives import allreduce

    allreduce(grads, comm, "ring")


def _mpi(grads: np.ndarray, comm: Any) -> None:
    from mpi4py import MPI

    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)


class Cases:
    """How ddp-step's cases are drawn, listed and shown."""

    @staticmethod
    def drawn(sizes: tuple[int, ...]) -> Any:
        from hypothesis import strategies as st

        @st.composite
        def cases(draw: Any) -> Case:
            size = draw(st.sampled_from(sizes))
            batch = draw(st.integers(1, 3 * size + 2))
            return make(size, batch, draw(st.integers(0, 3)), draw(st.booleans()))

        return cases()

    @staticmethod
    def standard(sizes: tuple[int, ...]) -> list[Case]:
        """B = 1 (parts empty), P and 2P + 1 (parts unequal), in float and exact mode."""
        batches = {size: sorted({1, size, 2 * size + 1}) for size in sizes}
        return [make(size, batch, 0, exact) for size in sizes
                for batch in batches[size] for exact in (False, True)]  # fmt: skip

    @staticmethod
    def cost(size: int) -> Case:
        return make(size, 16, 0, False)

    @staticmethod
    def timed(size: int) -> Case:
        return make(size, 256, 0, False)

    @staticmethod
    def shown(case: Case) -> str:
        batch, seed, exact, lr = case.extra
        return (f"P = {case.size}, B = {batch}, {'exact' if exact else 'float'} mode, "
                f"data seed {seed}, lr {lr:g}, {case.inputs[0].size} parameters")  # fmt: skip


DDP_STUB = '''"""Lab: the data-parallel SGD step. Write `ddp_step` below, then grade it:

    syncsgd lab check {file} --kind ddp-step
    mpiexec -n 4 syncsgd lab check {file} --kind ddp-step --mpi
"""

import numpy as np


def ddp_step(params, comm, X, y, lr, local_sum):
    """One step of synchronous data-parallel SGD, in place: afterwards every rank's `params` is
    serial SGD's step on the whole batch, params - lr * (the mean over the B samples of each
    sample's gradient), the same bits on every rank. Returns nothing.

    params     the flat parameters, float64, the same on every rank
{comm}
    X, y       the global batch: B samples and their labels, the same on every rank
    lr         the learning rate
    local_sum  local_sum(params, X_part, y_part, out) writes into `out` (shaped as params) the
               SUM over the part's samples of each sample's gradient, and returns their loss
               sum. Call it exactly once on every rank, also with an empty part: in exact mode
               it agrees with the other ranks.

    The grader compares with serial SGD on P = 1 to 9 and many B (fewer than P, not a multiple
    of P): in float mode within rounding, in exact mode (syncsgd's --exact) bit for bit. It
    counts the bytes each rank sends against the ring's 2(P-1)/P * n for n bytes of parameters.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    # Round 1 - the shard: this rank's samples are part `rank` of np.array_split(np.arange(B),
    #   size): contiguous, the first B % P parts one sample longer; empty when B < P.
    # Round 2 - the local sum: out = np.empty_like(params); local_sum(params, X[part],
    #   y[part], out). A sum, not a mean: the parts differ in size.
    # Round 3 - the allreduce of the sums: your ring from week 1 (import it from its file), or
    #   syncsgd.collectives.allreduce(out, comm).
    # Round 4 - divide once, by B: out /= B. (Dividing each rank's sum by its part's size and
    #   averaging over the ranks is wrong when P does not divide B.)
    # Round 5 - the update, the same on every rank: params -= lr * out.
    raise NotImplementedError("write the data-parallel step")
'''


KIND = Kind(
    name="ddp-step", function="ddp_step",
    about="one synchronous data-parallel SGD step around syncsgd's layers, as serial SGD's",
    expected=expected, bound=lambda n, p: 2 * (p - 1) / p * n, bound_text="2(P-1)/P·n",
    library=_library(_ring), library_name="step (its ring)", mpi=_library(_mpi),
    stub=DDP_STUB,
    arguments=arguments, cases=Cases, bitwise=lambda case: bool(case.extra[2]),
)  # fmt: skip
