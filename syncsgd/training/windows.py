"""The buckets under way, for ZeRO stages 2 and 3: a rank keeps its blocks of the gradient
(stage 2) and of the parameters (stage 3), and holds a whole bucket only while a pass is in
the layers whose tensors lie in it, in a few buffers reused bucket after bucket.

    PlacedSums     the backward pass writes each layer's gradient sums into the buffer of its
                   bucket; a bucket is reduce-scattered as soon as its layers are done, and its
                   buffer then serves a bucket further down
    PlacedParams   a layer's pass reads its parameters from the buffer of its bucket, allgathered
                   from every rank's blocks just before (forward, and again backward)
Bucket j lives in buffer j mod k, k the most buckets under way at once: the passes go through the
layers in order, and buckets hold whole tensors in layer order, so the buckets under way are
consecutive and their buffers distinct. docs/sharded.md draws it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from syncsgd.nn.backprop import Placed, no_wait
from syncsgd.nn.network import Network


def layer_buckets(network: Network, buckets: list[slice]) -> list[list[int]]:
    """Per layer, the buckets its parameter tensors lie in, in order."""
    starts = [bucket.start for bucket in buckets]
    found: list[list[int]] = [[] for _ in range(network.n_layers)]
    for name, _, offset in network.layout():
        bucket, layer = bisect.bisect_right(starts, offset) - 1, network.layer_of(name)
        if bucket not in found[layer]:
            found[layer].append(bucket)
    return found


def bucket_spans(network: Network, buckets: list[slice]) -> list[tuple[int, int]]:
    """Per bucket, the lowest and the highest layer of its tensors."""
    spans: dict[int, list[int]] = {}
    for layer, indices in enumerate(layer_buckets(network, buckets)):
        for index in indices:
            spans.setdefault(index, []).append(layer)
    return [(min(spans[index]), max(spans[index])) if index in spans else (0, -1)
            for index in range(len(buckets))]  # fmt: skip


class BucketBuffers:
    """k buffers of the longest bucket's length; bucket j in buffer j mod k (`apart`: a bucket
    with a buffer of its own)."""

    def __init__(self, buckets: list[slice], count: int, dtype: np.dtype,
                 apart: int | None = None) -> None:  # fmt: skip
        self.buckets, self.count, self.apart = buckets, max(count, 1), apart
        self.starts = [bucket.start for bucket in buckets]
        shared = [b.stop - b.start for index, b in enumerate(buckets) if index != apart]
        self.shared = np.zeros((self.count, max(shared, default=0)), dtype)
        own = buckets[apart] if apart is not None else slice(0, 0)
        self.own = np.zeros(own.stop - own.start, dtype)

    def of(self, index: int) -> np.ndarray:
        """Bucket `index`'s buffer, its length."""
        if index == self.apart:
            return self.own
        bucket = self.buckets[index]
        return self.shared[index % self.count, : bucket.stop - bucket.start]

    def place(self, offset: int, size: int) -> np.ndarray:
        """Where the tensor at `offset` of the flat layout lies: in its bucket's buffer."""
        index = bisect.bisect_right(self.starts, offset) - 1
        start = offset - self.starts[index]
        return self.of(index)[start : start + size]

    @property
    def nbytes(self) -> int:
        """The bytes of every buffer."""
        return self.shared.nbytes + self.own.nbytes


class PlacedSums:
    """The gradient sums of the buckets under way; the last bucket, which carries the riders
    (the loss sum, the flags), in a buffer of its own for the whole step."""

    def __init__(self, network: Network, buckets: list[slice], dtype: np.dtype) -> None:
        last = len(buckets) - 1
        spans = bucket_spans(network, buckets)
        under_way = [sum(1 for index, (low, high) in enumerate(spans)
                         if index != last and low <= layer <= high)
                     for layer in range(network.n_layers)]  # fmt: skip
        self.buffers = BucketBuffers(buckets, max(under_way, default=1), dtype, apart=last)
        self.placed = Placed(network.placed_layer_views(self.buffers.place), no_wait)
        self.riders = self.buffers.own[network.n_params - buckets[last].start :]


class PlacedParams:
    """The parameters of the buckets under way, gathered from every rank's blocks just before a
    layer's pass reads them; `forget_` after the update, which changed them."""

    def __init__(self, network: Network, buckets: list[slice], dtype: np.dtype,
                 fill_: Callable[[int, np.ndarray], None]) -> None:  # fmt: skip
        self.layer_buckets = layer_buckets(network, buckets)
        count = max((len(indices) for indices in self.layer_buckets), default=1)
        self.buffers = BucketBuffers(buckets, count, dtype)
        self.fill_ = fill_  # (bucket, its buffer): every rank's blocks of it, gathered
        self.held = [-1] * self.buffers.count  # the bucket each buffer holds
        self.placed = Placed(network.placed_layer_views(self.buffers.place), self.ready_)
        self.gathers = 0  # buckets gathered this run

    def ready_(self, layer: int) -> None:
        """Gather the buckets of a layer's tensors, unless their buffers hold them already."""
        for index in self.layer_buckets[layer]:
            slot = index % self.buffers.count
            if self.held[slot] != index:
                self.fill_(index, self.buffers.of(index))
                self.held[slot] = index
                self.gathers += 1

    def forget_(self) -> None:
        """The parameters changed: gather every bucket afresh."""
        self.held = [-1] * self.buffers.count


__all__ = ["BucketBuffers", "PlacedParams", "PlacedSums", "bucket_spans", "layer_buckets"]
