"""Pitfalls of real data-parallel systems, switched on by `--pitfall NAME` so verify shows them.

Each one is a small deviation from the correct step that looks harmless and is common in practice:

- `mean-of-means`: every rank sends the MEAN gradient of its own shard and the sum is divided by
  P (Horovod's `average`, DDP's default division by world size, JAX's `pmean` of per-device means).
  Right only when every shard has the same size; with uneven shards (B not divisible by P, or
  P > B) samples on smaller shards weigh more.
- `local-clip`: each rank clips its own mean gradient to `--clip-norm` before the allreduce, and the
  global gradient is never clipped (TensorFlow/Horovod scripts that call `clip_by_global_norm`
  before `DistributedOptimizer` applies). The average of clipped gradients is not the clipped
  average.
- `unsynced-shuffle`: every rank shuffles with its own seed (seed + rank), as when PyTorch's
  `DistributedSampler` is replaced by a per-process `shuffle=True` loader or seeded per rank: the
  ranks no longer agree on the global batch, so samples are duplicated or skipped.
- `fp32-allreduce`: the gradient travels and is summed in float32 although the model is float64
  (gradient compression, or an NCCL/MPI reduction in lower precision).
- `pad-duplicate`: PyTorch's `DistributedSampler` pads the data by repeating samples so that every
  rank gets the same number: when B is not divisible by P, some samples of the batch count twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

PITFALLS = ("mean-of-means", "local-clip", "unsynced-shuffle", "fp32-allreduce", "pad-duplicate")


def order_seed(pitfall: str | None, seed: int, rank: int) -> int:
    """The seed this rank shuffles with: the shared seed, or seed + rank under unsynced-shuffle."""
    return seed + rank if pitfall == "unsynced-shuffle" else seed


def pad_duplicate(global_batch: np.ndarray, size: int) -> np.ndarray:
    """Repeat samples from the batch's start until its length is a multiple of `size`."""
    padding = -len(global_batch) % size
    return np.concatenate([global_batch, np.resize(global_batch, padding)])


def contribution_(pitfall: str | None, grad_sum: np.ndarray, shard_size: int, global_batch: int,
                  size: int, clip_norm: float | None) -> None:  # fmt: skip
    """Turn this rank's gradient sum into what a pitfall would send instead (in place)."""
    if pitfall == "mean-of-means" and shard_size:
        # Sends sum/m_r; the trainer later divides the allreduced sum by B, so pre-scale by B/P:
        # (1/B) * sum_r (B/P) * sum_r/m_r = (1/P) * sum_r mean_r, the mean of means.
        grad_sum *= (global_batch / size) / shard_size
    elif pitfall == "local-clip" and shard_size and clip_norm is not None:
        local_norm = float(np.linalg.norm(grad_sum.astype(np.float64))) / shard_size
        if local_norm > clip_norm:
            grad_sum *= clip_norm / local_norm


def allreduce_in_float32(allreduce: Callable[[np.ndarray, Any], Any]) -> Callable:
    """An allreduce that rounds the buffer to float32, sums in float32, and widens it again."""

    def reduce_(buf: np.ndarray, comm: Any) -> np.ndarray:
        narrow = buf.astype(np.float32)
        allreduce(narrow, comm)
        buf[...] = narrow
        return buf

    return reduce_
