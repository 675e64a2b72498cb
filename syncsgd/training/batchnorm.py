"""BatchNorm in training: the running statistics a run starts from and ends with, the time its
allreduces take, and evaluation with the running statistics.

--batchnorm sync allreduces the per-feature sums between layers, so the statistics are those of
the global batch and training equals serial large-batch SGD with BatchNorm; --batchnorm local
normalises each rank's shard alone (Tarantella's and DDP's default), so the result depends on P.
The batchnorm layer (syncsgd/nn/layers/batchnorm.py) computes them; docs/batchnorm.md gives the
derivation, the costs and the caution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from syncsgd.comm.watchdog import bcast_peer, watching
from syncsgd.nn.network import Network

if TYPE_CHECKING:
    from syncsgd.training.run import Run


def start_running(comm: Any, run: Run, stepper: Any) -> np.ndarray | None:
    """The running statistics the run starts from, rank 0's on every rank; None without BN."""
    running = running_of(stepper)
    if running is None:
        return None
    if comm.Get_rank() == 0:
        running[:] = first_running(run)
    with watching("the broadcast of the running statistics", bcast_peer(comm, 0)):
        comm.Bcast(running, root=0)
    return running


def first_running(run: Run) -> np.ndarray:
    """From the checkpoint resumed, the --init file (default where it has none), or defaults."""
    if run.start is not None and run.start.running is not None:
        return run.start.running
    if run.init_running is not None:
        return run.init_running
    return run.model.init_running()


def record_comm(result: Any, stepper: Any) -> None:
    """Seconds in BatchNorm's allreduces into the result: all steps', and the steady state's."""
    first, later = stepper.local_gradient.comm_seconds
    result.batchnorm_comm_seconds, result.steady_batchnorm_comm_seconds = first + later, later


def running_of(stepper: Any) -> np.ndarray | None:
    """The running statistics a stepper keeps (None without BatchNorm)."""
    return stepper.local_gradient.running


def evaluate(network: Network, params: np.ndarray, running: np.ndarray | None, eps: float,
             X: np.ndarray, y: np.ndarray) -> tuple[float, float]:  # fmt: skip
    """(mean loss, accuracy) over X, y in evaluation mode (BatchNorm's running statistics)."""
    from syncsgd.nn.backprop import evaluate as evaluate_network  # imports Numba

    return evaluate_network(network, params, X, y, running, eps)


def micro_batch_note(config: Any) -> str:
    """What --accumulate K does to BatchNorm's statistics, for under the summary."""
    whose = ("each rank's own micro-batch" if config.batchnorm == "local" else
             "every rank's k-th micro-batch together, as a serial run of those samples would")
    return (f"BatchNorm with --accumulate {config.accumulate}: statistics over each micro-batch "
            f"({config.batchnorm if config.batchnorm != 'none' else 'sync'}: {whose}), the "
            f"running statistics moved {config.accumulate} times a step")  # fmt: skip
