"""Variants of the step: the correct run changes nothing; each pitfall changes one seam.

The seams are the sample order, the global batch, the weight of a micro-batch's samples, a rank's
contribution to the allreduce, the allreduce itself, the values sent along with the gradient and
the clipping of the global gradient. `docs/pitfalls.md` says where each pitfall is met in
practice and why it breaks the equality with serial SGD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

Allreduce = Callable[..., Any]


class Variant:
    """The correct run: every seam as serial large-batch SGD has it."""

    name: ClassVar[str | None] = None
    why: ClassVar[str] = "synchronous SGD: sum the sums, divide once by B"
    # Options that make the pitfall show, and the smallest P at which it does (tests, teaching).
    shows_with: ClassVar[dict[str, Any]] = {}
    shows_at: ClassVar[int] = 2
    sharded: ClassVar[bool] = False  # a pitfall of the sharded step (--zero-stage 1) alone
    float_only: ClassVar[str] = ""  # why exact mode leaves nothing for it to show, if it does

    def __init__(self, clip_norm: float | None = None, optimizer: str = "sgd") -> None:
        """`optimizer`: the run's --optimizer, for a pitfall that needs a particular one."""
        self.clip_norm = clip_norm

    def order_seed(self, seed: int, rank: int) -> int:
        """The seed this rank draws the sample order from."""
        return seed

    def global_batch(self, batch: np.ndarray, size: int) -> np.ndarray:
        """The samples this step trains on, the same on every rank."""
        return batch

    def micro_batch_weight(self, size: int, shard_size: int, count: int) -> float:
        """What a micro-batch of `size` samples (of `count` in a shard) multiplies its loss
        with before its gradient sum is added: 1, a sum like every other."""
        return 1.0

    def contribution_(self, grad_sum: np.ndarray, shard_size: int, batch_size: int,
                      size: int) -> None:  # fmt: skip
        """Turn this rank's gradient sum into what it sends to the allreduce (in place)."""

    def allreduce(self, allreduce: Allreduce) -> Allreduce:
        """The allreduce this run sums with."""
        return allreduce

    def riders(self, stepper: Any) -> list[tuple[Any, ...]]:
        """Values this run sends along with the gradient: the fields of a `step.Rider` each."""
        return []

    def global_clip_norm(self) -> float | None:
        """The norm the allreduced gradient is clipped to (None: no clipping)."""
        return self.clip_norm

    def shard_norm(self, own: float, every: float) -> float:
        """The norm a sharded rank clips its blocks by: the norm over every shard's, not `own`."""
        return every

    def shard_finite(self, own: bool, every: bool) -> bool:
        """Whether a sharded rank takes the step: every shard finite, not only its `own`."""
        return every

    def shard_tensor_norms(self, own: list[float], every: list[float]) -> list[float]:
        """The norms of its pieces of the model's tensors a sharded rank's trust ratios take: the
        whole tensors', not its `own` pieces'."""
        return every


class MeanOfMeans(Variant):
    """Every rank sends its shard's mean gradient and the sum is divided by P."""

    name = "mean-of-means"
    why = "averages per-rank means: uneven shards weigh their samples unevenly"
    shows_with = {"batch_size": 30}
    shows_at = 4

    def contribution_(self, grad_sum: np.ndarray, shard_size: int, batch_size: int,
                      size: int) -> None:  # fmt: skip
        if shard_size:
            # Sends sum/m_r; the trainer later divides the allreduced sum by B, so pre-scale by
            # B/P: (1/B) * sum_r (B/P) * sum_r/m_r = (1/P) * sum_r mean_r, the mean of means.
            grad_sum *= (batch_size / size) / shard_size


class LocalClip(Variant):
    """Every rank clips its own mean gradient before the allreduce; the sum is not clipped."""

    name = "local-clip"
    why = "clips each rank's gradient: the mean of clipped gradients is not the clipped mean"
    shows_with = {"clip_norm": 0.05}
    shows_at = 3

    def __init__(self, clip_norm: float | None = None, optimizer: str = "sgd") -> None:
        if clip_norm is None:
            raise ValueError("--pitfall local-clip needs --clip-norm")
        super().__init__(clip_norm, optimizer)

    def contribution_(self, grad_sum: np.ndarray, shard_size: int, batch_size: int,
                      size: int) -> None:  # fmt: skip
        assert self.clip_norm is not None  # checked when the variant was made
        if shard_size:
            local_norm = float(np.linalg.norm(grad_sum.astype(np.float64))) / shard_size
            if local_norm > self.clip_norm:
                grad_sum *= self.clip_norm / local_norm

    def global_clip_norm(self) -> float | None:
        return None  # clipped per rank instead


class UnsyncedShuffle(Variant):
    """Every rank shuffles with its own seed (seed + rank)."""

    name = "unsynced-shuffle"
    why = "per-rank seeds: the ranks disagree on the batch, samples are skipped or repeated"

    def order_seed(self, seed: int, rank: int) -> int:
        return seed + rank


class Fp32Allreduce(Variant):
    """The gradient travels and is summed in float32 although the model is float64."""

    name = "fp32-allreduce"
    why = "sums in float32: the rounding depends on how the batch was split"

    def allreduce(self, allreduce: Allreduce) -> Allreduce:
        def reduce_in_float32_(buf: np.ndarray, comm: Any) -> np.ndarray:
            narrow = buf.astype(np.float32)
            allreduce(narrow, comm)
            buf[...] = narrow
            return buf

        return reduce_in_float32_


class PadDuplicate(Variant):
    """The batch is padded by repeating samples until every rank gets as many."""

    name = "pad-duplicate"
    why = "pads shards by repeating samples: some samples of the batch count twice"
    shows_with = {"batch_size": 30}
    shows_at = 4

    def global_batch(self, batch: np.ndarray, size: int) -> np.ndarray:
        padding = -len(batch) % size
        return np.concatenate([batch, np.resize(batch, padding)])


class AccumulateMeans(Variant):
    """Each micro-batch's loss is its mean divided by K: the mean of the micro-batch means."""

    name = "accumulate-means"
    why = "adds micro-batch means: uneven micro-batches weigh their samples unevenly"
    shows_with = {"batch_size": 30, "accumulate": 4}

    def micro_batch_weight(self, size: int, shard_size: int, count: int) -> float:
        # A sum of `size` samples weighed (1/size)(1/K): the mean of the means, then times the
        # shard's size, so that the ranks' shards are weighed as they should be and only the
        # accumulation is wrong. Even micro-batches: exactly 1.
        return shard_size / count / size if size else 1.0


class LocalTrustRatio(Variant):
    """Every rank computes LAMB's or LARS's trust ratios from its own shard's mean gradient; the
    ranks agree on their sample-weighted mean, and the step scales the update by it."""

    name = "local-trust-ratio"
    why = "trust ratios from each rank's gradient: the mean of ratios is not the ratio of the mean"
    shows_with = {"optimizer": "lamb", "lr": 0.01}

    def __init__(self, clip_norm: float | None = None, optimizer: str = "sgd") -> None:
        if optimizer not in ("lamb", "lars"):
            raise ValueError("--pitfall local-trust-ratio needs --optimizer lamb or lars")
        super().__init__(clip_norm, optimizer)
        self.weight = 1.0

    def contribution_(self, grad_sum: np.ndarray, shard_size: int, batch_size: int,
                      size: int) -> None:  # fmt: skip
        self.weight = shard_size / batch_size  # this rank's share of the batch, for its ratios

    def riders(self, stepper: Any) -> list[tuple[Any, ...]]:
        optimizer, params = stepper.optimizer, stepper.params
        local_mean = np.empty(len(params), params.dtype)

        def fill_(slots: np.ndarray, grad_sum: np.ndarray, shard_size: int) -> None:
            slots[...] = 0.0
            if shard_size:  # the shard's mean gradient, unscaled: per token on token data
                local = stepper.local_gradient
                terms = shard_size * local.passes.positions * local.scale
                np.divide(grad_sum, terms, out=local_mean)
                slots += np.array(optimizer.trust_ratios(params, local_mean)) * self.weight

        def read_(slots: np.ndarray, grad_mean: np.ndarray, batch_size: int, finite: bool) -> None:
            optimizer.agreed_trust = [float(ratio) for ratio in slots]

        return [("local trust ratios", len(optimizer.slices), fill_, read_)]


class ShardLocalClip(Variant):
    """Sharded: every rank clips its blocks by the norm of its own blocks."""

    name = "shard-local-clip"
    why = "each rank clips its shard by the shard's norm: the shards' parts are not the whole"
    shows_with = {"zero_stage": 1, "clip_norm": 0.05}
    sharded = True

    def __init__(self, clip_norm: float | None = None, optimizer: str = "sgd") -> None:
        if clip_norm is None:
            raise ValueError("--pitfall shard-local-clip needs --clip-norm")
        super().__init__(clip_norm, optimizer)

    def shard_norm(self, own: float, every: float) -> float:
        return own


class ShardLocalTrustRatio(Variant):
    """Sharded: LAMB's or LARS's ratio of a tensor from the part of it a rank holds."""

    name = "shard-local-trust-ratio"
    why = "trust ratios from the part of a tensor a rank holds: its parts' norms are not its own"
    shows_with = {"zero_stage": 1, "optimizer": "lamb", "lr": 0.01}
    sharded = True

    def __init__(self, clip_norm: float | None = None, optimizer: str = "sgd") -> None:
        if optimizer not in ("lamb", "lars"):
            raise ValueError("--pitfall shard-local-trust-ratio needs --optimizer lamb or lars")
        super().__init__(clip_norm, optimizer)

    def shard_tensor_norms(self, own: list[float], every: list[float]) -> list[float]:
        return own


class ShardLocalOverflow(Variant):
    """Sharded: every rank checks its own blocks for an inf or NaN before it takes the step."""

    name = "shard-local-overflow"
    why = "each rank checks only its shard for an overflow: the ranks skip different steps"
    shows_with = {"zero_stage": 1, "precision": "fp16", "loss_scale": "dynamic"}
    sharded = True
    float_only = ("in exact mode an inf or NaN on any rank makes the agreed peaks infinite and "
                  "every rank's sums NaN: every shard overflows alike")  # fmt: skip

    def shard_finite(self, own: bool, every: bool) -> bool:
        return own


VARIANTS: dict[str, type[Variant]] = {
    v.name: v for v in (MeanOfMeans, LocalClip, UnsyncedShuffle, Fp32Allreduce, PadDuplicate,
                        AccumulateMeans, LocalTrustRatio, ShardLocalClip, ShardLocalTrustRatio,
                        ShardLocalOverflow)
    if v.name is not None
}  # fmt: skip
PITFALLS = tuple(VARIANTS)


def variant(pitfall: str | None, clip_norm: float | None, optimizer: str = "sgd") -> Variant:
    """The variant a run with `--pitfall` (None: the correct run), `--clip-norm` and
    `--optimizer` takes."""
    if pitfall is None:
        return Variant(clip_norm, optimizer)
    if pitfall not in VARIANTS:
        raise ValueError(f"unknown --pitfall {pitfall!r}: choose one of {', '.join(PITFALLS)}")
    return VARIANTS[pitfall](clip_norm, optimizer)
