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


def sums_buffers(network: Network, buckets: list[slice]) -> int:
    """How many buffers the gradient's buckets under way take (but the last bucket's, which has
    its own): the most buckets but the last that one layer of the backward pass is within."""
    last, spans = len(buckets) - 1, bucket_spans(network, buckets)
    under_way = [sum(1 for index, (low, high) in enumerate(spans)
                     if index != last and low <= layer <= high)
                 for layer in range(network.n_layers)]  # fmt: skip
    return max(max(under_way, default=1), 1)


def params_buffers(network: Network, buckets: list[slice], prefetch: bool) -> int:
    """How many buffers the parameters' buckets under way take: the most one layer's tensors
    touch, or (prefetching) two neighbouring layers' together."""
    found = [set(indices) for indices in layer_buckets(network, buckets) if indices]
    if prefetch:
        found = [a | b for a, b in zip(found, found[1:], strict=False)] or found
    return max(max(map(len, found), default=1), 1)


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

    def __init__(self, network: Network, buckets: list[slice], dtype: np.dtype,
                 spare: int = 0) -> None:  # fmt: skip
        # `spare`: buffers more than the passes need at once (--overlap: one, for the bucket on
        # the communication thread while the next one is written)
        last, count = len(buckets) - 1, sums_buffers(network, buckets) + spare
        self.buffers = BucketBuffers(buckets, count, dtype, apart=last)
        self.layer_buckets = layer_buckets(network, buckets)
        self.placed = Placed(network.placed_layer_views(self.buffers.place), no_wait)
        self.riders = self.buffers.own[network.n_params - buckets[last].start :]

    def buffer_of(self, index: int) -> int:
        """Which buffer bucket `index` lives in (-1: the last bucket's own)."""
        return -1 if index == self.buffers.apart else index % self.buffers.count

    def buffers_of(self, top: int, bottom: int) -> set[int]:
        """The buffers the sums of layers top down to bottom are written into."""
        return {self.buffer_of(index) for layer in range(bottom, top + 1)
                for index in self.layer_buckets[layer]}  # fmt: skip


Fill = Callable[[int, np.ndarray], None]  # (bucket, its buffer): its parameters gathered into it


class PlacedParams:
    """The parameters of the buckets under way, gathered from every rank's blocks just before a
    layer's pass reads them; `forget_` after the update, which changed them. With a `start_`
    (--overlap: a gather handed to the communication thread), the next layer's buckets are
    gathered while this layer computes, in the direction the passes go."""

    def __init__(self, network: Network, buckets: list[slice], dtype: np.dtype,
                 fill_: Fill, prefetch: bool = False) -> None:  # fmt: skip
        self.layer_buckets = layer_buckets(network, buckets)
        self.with_params = [layer for layer, indices in enumerate(self.layer_buckets) if indices]
        self.buffers = BucketBuffers(buckets, params_buffers(network, buckets, prefetch), dtype)
        self.fill_ = fill_  # (bucket, its buffer): every rank's blocks of it, gathered
        self.start_: Fill | None = None  # the same, not waited for
        self.wait_: Callable[[], None] = no_gathers  # until every gather started is done
        self.held = [-1] * self.buffers.count  # the bucket each buffer holds (or will)
        self.pending: set[int] = set()  # buckets started and not yet waited for
        self.last, self.direction = -1, 1  # the layer read last; the passes' direction
        self.placed = Placed(network.placed_layer_views(self.buffers.place), self.ready_)

    def ready_(self, layer: int) -> None:
        """Gather the buckets of a layer's tensors, unless their buffers hold them already (or
        are being filled); then start on the next layer's."""
        if not self.layer_buckets[layer]:
            return
        if layer != self.last:
            self.direction = 1 if layer > self.last else -1
        self.last = layer
        for index in self.layer_buckets[layer]:
            slot = index % self.buffers.count
            if self.held[slot] != index:
                self.fill_(index, self.buffers.of(index))
                self.held[slot] = index
            if index in self.pending:
                self.wait_()
                self.pending.clear()
        if self.start_ is not None:
            self.prefetch_(layer)

    def prefetch_(self, layer: int) -> None:
        """Start gathering the buckets of the next layer with parameters, the passes' way."""
        position = self.with_params.index(layer) + self.direction
        if not 0 <= position < len(self.with_params):
            return
        assert self.start_ is not None
        for index in self.layer_buckets[self.with_params[position]]:
            slot = index % self.buffers.count
            if self.held[slot] != index:
                self.start_(index, self.buffers.of(index))
                self.held[slot] = index
                self.pending.add(index)

    def forget_(self) -> None:
        """The parameters changed: gather every bucket afresh, from a forward pass."""
        self.held = [-1] * self.buffers.count
        self.pending.clear()
        self.last, self.direction = -1, 1


def no_gathers() -> None:
    """Nothing was started: nothing to wait for."""


__all__ = ["BucketBuffers", "PlacedParams", "PlacedSums", "bucket_spans", "layer_buckets",
           "params_buffers", "sums_buffers"]
