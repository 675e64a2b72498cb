"""Bucket-size tuning of the overlapped step: when each bucket is complete, the communication
thread's queue, and the bucket size that minimises the exposed tail.

A bucket of b bytes costs one ring allreduce, a + s·b, with a = 2(P-1)α paid per bucket and
s = 2(P-1)/P·β + (P-1)/P·γ per byte. Small buckets pay a many times; large ones leave a long
tail after the backward pass. docs/overlap.md derives the optimum `optimal_bucket_bytes` names:

    b* = min(n·sqrt(a / T_b), a / (T_b/n - s))      (the second only when T_b/n > s)

for n bytes of gradient produced evenly over a backward pass of T_b seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from syncsgd.nn.network import Network


class RingLine(NamedTuple):
    """One ring allreduce of b bytes: latency + per_byte·b seconds."""

    latency: float  # a = 2(P-1)α
    per_byte: float  # s = 2(P-1)/P·β + (P-1)/P·γ

    def seconds(self, nbytes: float) -> float:
        """The allreduce of one bucket of `nbytes` bytes."""
        return self.latency + self.per_byte * nbytes


def exposed_seconds(bucket: float, nbytes: float, backward: float, ring: RingLine) -> float:
    """Seconds of communication after the backward pass, gradient produced evenly, equal buckets."""
    # Bucket j (of k = n/b, from the last layer back) is complete at j·b·T_b/n; one thread sends
    # them in turn. The last send ends at max_j(j·b·T_b/n + (k - j + 1)(a + s·b)), which is linear
    # in j: the first bucket's start plus every send, or the last bucket's completion plus its send.
    bucket = min(max(bucket, 1.0), nbytes)
    queue = bucket * backward / nbytes + nbytes / bucket * ring.latency + ring.per_byte * nbytes
    return max(ring.seconds(bucket), queue - backward)


def optimal_bucket_bytes(nbytes: float, backward: float, ring: RingLine) -> float:
    """The bucket size that minimises `exposed_seconds` (docs/overlap.md derives it)."""
    if nbytes <= 0 or backward <= 0 or ring.latency <= 0:
        return max(nbytes, 1.0)  # nothing to hide, or buckets are free: one bucket, or the least
    queue_bound = nbytes * math.sqrt(ring.latency / backward)
    spare = backward / nbytes - ring.per_byte  # the backward pass's seconds per byte, less s
    if spare > 0:  # the network outpaces the backward pass: past a / spare the queue drains
        queue_bound = min(queue_bound, ring.latency / spare)
    return min(max(queue_bound, 1.0), nbytes)  # a bucket holds at least a byte, at most all


def ready_seconds(network: Network, slices: Sequence[slice], backward: float) -> list[float]:
    """Seconds into the backward pass at which each bucket is complete, in parameter order."""
    # Layer l's backward is its sums (m_l multiply-adds) after the gradient at the input of the
    # layer above (m_{l+1}); the first layer computes no input gradient. A bucket is complete
    # once the pass has done the sums of the layer of its first tensor.
    products = network.multiply_adds()
    total = 2 * sum(products) - (products[0] if products else 0)
    scale = backward / total if total > 0 else 0.0
    done = []
    for layer, product in enumerate(products):
        above = sum(2 * later for later in products[layer + 1 :])
        done.append((above + product) * scale)
    owners = [network.layer_of(name) for name, _, _ in network.layout()]
    starts = [offset for _, _, offset in network.layout()]
    ready = []
    for piece in slices:
        first = max(i for i, start in enumerate(starts) if start <= piece.start)
        ready.append(done[owners[first]] if products else 0.0)
    return ready


def queued_step(forward: float, backward: float, comms: Sequence[float], ready: Sequence[float],
                update: float) -> float:  # fmt: skip
    """The overlapped step with each bucket sent once it is complete, one at a time."""
    # The communication thread takes the buckets from the last back, each when it is complete
    # and the previous one is sent; the first bucket (complete last) goes on the rank's own
    # thread after the backward pass and after the others.
    sent = 0.0
    for comm, at in zip(reversed(comms[1:]), reversed(ready[1:]), strict=True):
        sent = max(sent, at) + comm
    return forward + max(backward, sent) + comms[0] + update
