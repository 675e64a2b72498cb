"""Every allreduce algorithm as a schedule: which chunk goes where in which step, on each rank.

How each algorithm works, and why every rank ends with the same bits: docs/collectives.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

COPY, ADD_OWN_FIRST, ADD_INCOMING_FIRST = 0, 1, 2  # what a step does with the data it receives
_NONE = slice(0, 0)


class CollectiveStep(NamedTuple):
    """One message operation of one rank: a send, a receive, or both at once (`Sendrecv`)."""

    phase: str
    step: int  # counts within the phase
    send_to: int  # -1: nothing sent
    recv_from: int  # -1: nothing received
    send_chunk: int  # -1: nothing sent
    recv_chunk: int  # -1: nothing received
    send: slice  # elements of the flattened buffer sent
    recv: slice  # elements of the flattened buffer the received data belongs to
    combine: int  # COPY into place, or add: own + incoming or incoming + own


Schedule = tuple[CollectiveStep, ...]


def chunk_bounds(length: int, parts: int) -> list[int]:
    """Start of each of `parts` chunks of `length` elements, plus `length`, as numpy.array_split."""
    base, extra = divmod(length, parts)
    return [c * base + min(c, extra) for c in range(parts + 1)]


@functools.lru_cache(maxsize=256)
def ring_schedule(length: int, size: int, rank: int) -> Schedule:
    """Reduce-scatter, then allgather, each P-1 steps around the ring."""
    bounds = chunk_bounds(length, size)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):  # send a partial sum right, add the one from the left to our own
        send, recv = (rank - s) % size, (rank - s - 1) % size
        steps.append(CollectiveStep("reduce-scatter", s, right, left, send, recv,
                                    chunk[send], chunk[recv], ADD_OWN_FIRST))  # fmt: skip
    for s in range(size - 1):  # pass the finished chunks on
        send, recv = (rank + 1 - s) % size, (rank - s) % size
        steps.append(CollectiveStep("allgather", s, right, left, send, recv,
                                    chunk[send], chunk[recv], COPY))  # fmt: skip
    return tuple(steps)


def _send(phase: str, step: int, peer: int, chunk: int, where: slice) -> CollectiveStep:
    """A step that only sends."""
    return CollectiveStep(phase, step, peer, -1, chunk, -1, where, _NONE, COPY)


def _recv(
    phase: str, step: int, peer: int, chunk: int, where: slice, combine: int
) -> CollectiveStep:
    """A step that only receives."""
    return CollectiveStep(phase, step, -1, peer, -1, chunk, _NONE, where, combine)


def _added_in_order(rank: int, peer: int) -> int:
    """Add the lower rank's data first, so that both partners compute the same bits."""
    return ADD_INCOMING_FIRST if peer < rank else ADD_OWN_FIRST


@functools.lru_cache(maxsize=256)
def naive_schedule(length: int, size: int, rank: int) -> Schedule:
    """Reduce to rank 0 in rank order, then rank 0 sends the sum to each rank in turn."""
    whole = slice(0, length)
    if rank == 0:  # step s: the message of rank s + 1
        reduce = [_recv("reduce", s, s + 1, 0, whole, ADD_OWN_FIRST) for s in range(size - 1)]
        return (*reduce, *(_send("broadcast", s, s + 1, 0, whole) for s in range(size - 1)))
    return _send("reduce", rank - 1, 0, 0, whole), _recv("broadcast", rank - 1, 0, 0, whole, COPY)


@functools.lru_cache(maxsize=256)
def tree_schedule(length: int, size: int, rank: int) -> Schedule:
    """Binary-tree reduce to rank 0 (own, then left, then right subtree), binary-tree broadcast."""
    whole = slice(0, length)
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < size]
    parent = (rank - 1) // 2
    depth, height = (rank + 1).bit_length() - 1, size.bit_length() - 1  # height: deepest depth
    # Reduce round t: ranks at depth height - t send to their parents; broadcast round t: ranks at
    # depth t send to their children.
    steps = [_recv("reduce", height - depth - 1, c, 0, whole, ADD_OWN_FIRST) for c in children]
    if rank:
        steps += [_send("reduce", height - depth, parent, 0, whole)]
        steps += [_recv("broadcast", depth - 1, parent, 0, whole, COPY)]
    steps += [_send("broadcast", depth, child, 0, whole) for child in children]
    return tuple(steps)


def _folding(size: int, rank: int) -> tuple[int, int, int]:
    """(p', r, this rank's number among the p' ranks or -1) of MPICH's non-power-of-two fold."""
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    if rank < 2 * extra:
        return pof2, extra, -1 if rank % 2 == 0 else rank // 2
    return pof2, extra, rank - extra


def _real_rank(newrank: int, extra: int) -> int:
    """The rank of comm whose number among the p' folded ranks is `newrank`."""
    return newrank * 2 + 1 if newrank < extra else newrank + extra


def _fold(phase: str, rank: int, extra: int, whole: slice) -> list[CollectiveStep]:
    """The non-power-of-two pre ("fold") or post ("unfold") step of the first 2r ranks."""
    if rank >= 2 * extra:
        return []
    even = rank % 2 == 0
    if phase == "fold":  # even ranks hand their data to the odd rank above: lower rank first
        if even:
            return [_send(phase, 0, rank + 1, 0, whole)]
        return [_recv(phase, 0, rank - 1, 0, whole, ADD_INCOMING_FIRST)]
    if even:  # unfold: the odd rank returns the result
        return [_recv(phase, 0, rank + 1, 0, whole, COPY)]
    return [_send(phase, 0, rank - 1, 0, whole)]


@functools.lru_cache(maxsize=256)
def recursive_doubling_schedule(length: int, size: int, rank: int) -> Schedule:
    """Fold, log2(p') whole-buffer exchanges with the partner in bit k, unfold (as MPICH)."""
    whole = slice(0, length)
    pof2, extra, newrank = _folding(size, rank)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        for k in range(pof2.bit_length() - 1):
            peer = _real_rank(newrank ^ (1 << k), extra)
            combine = _added_in_order(rank, peer)
            steps.append(CollectiveStep("exchange", k, peer, peer, 0, 0, whole, whole, combine))
    return tuple(steps + _fold("unfold", rank, extra, whole))


def _halving_and_doubling(
    rank: int, newrank: int, extra: int, bounds: list[int]
) -> list[CollectiveStep]:
    """Rabenseifner's recursive-halving reduce-scatter, then the doubling allgather backwards."""
    levels = (len(bounds) - 1).bit_length() - 1  # len(bounds) = p' + 1

    def elements(first: int, stop: int) -> slice:
        return slice(bounds[first], bounds[stop])

    steps = []
    lo, hi = 0, len(bounds) - 1  # the window of chunks this rank is still responsible for
    for k in range(levels):  # partners at distance 1 first, as MPICH
        peer, mid = _real_rank(newrank ^ (1 << k), extra), (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if newrank >> k & 1 == 0 else ((mid, hi), (lo, mid))
        combine = _added_in_order(rank, peer)
        steps.append(CollectiveStep("reduce-scatter", k, peer, peer, give[0], keep[0],
                                    elements(*give), elements(*keep), combine))  # fmt: skip
        lo, hi = keep
    for step, k in enumerate(reversed(range(levels))):  # the same partners, backwards
        peer, width = _real_rank(newrank ^ (1 << k), extra), hi - lo
        other = (hi, hi + width) if newrank >> k & 1 == 0 else (lo - width, lo)
        steps.append(CollectiveStep("allgather", step, peer, peer, lo, other[0],
                                    elements(lo, hi), elements(*other), COPY))  # fmt: skip
        lo, hi = min(lo, other[0]), max(hi, other[1])
    return steps


@functools.lru_cache(maxsize=256)
def rabenseifner_schedule(length: int, size: int, rank: int) -> Schedule:
    """Fold, recursive-halving reduce-scatter, recursive-doubling allgather, unfold (as MPICH)."""
    whole = slice(0, length)
    pof2, extra, newrank = _folding(size, rank)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        steps += _halving_and_doubling(rank, newrank, extra, chunk_bounds(length, pof2))
    return tuple(steps + _fold("unfold", rank, extra, whole))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "ring": ring_schedule,
    "naive": naive_schedule,
    "recursive-doubling": recursive_doubling_schedule,
    "rabenseifner": rabenseifner_schedule,
    "tree": tree_schedule,
}



# -- the two-level allreduce -----------------------------------------------------------------------
# Inside each node the ring's reduce-scatter leaves local rank l with chunk (l + 1) mod R of R
# (summed over the node); the ranks of local index l on every node allreduce that chunk by a flat
# schedule among themselves; the ring's allgather then spreads the finished chunks in the node.


class Hierarchical(NamedTuple):
    """The two-level allreduce on `nodes` (each the ranks of one node, all of one size), with the
    flat algorithm `inter` between the nodes."""

    nodes: tuple[tuple[int, ...], ...]
    inter: str = "ring"


def _renumbered(step: CollectiveStep, ranks: tuple[int, ...], phase: str, offset: int
                ) -> CollectiveStep:  # fmt: skip
    """A step of a schedule among `ranks` (numbered 0, 1, ...), on a part of the buffer that
    starts at element `offset`."""
    send, recv = step.send, step.recv
    return step._replace(
        phase=phase, send_to=ranks[step.send_to] if step.send_to >= 0 else -1,
        recv_from=ranks[step.recv_from] if step.recv_from >= 0 else -1,
        send=slice(send.start + offset, send.stop + offset) if step.send_to >= 0 else _NONE,
        recv=slice(recv.start + offset, recv.stop + offset) if step.recv_from >= 0 else _NONE,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def hierarchical_schedule(spec: Hierarchical, length: int, size: int, rank: int) -> Schedule:
    """Ring reduce-scatter inside the node, `spec.inter` among the ranks of the same local index
    on every node, ring allgather inside the node."""
    node = next(n for n, members in enumerate(spec.nodes) if rank in members)
    members = spec.nodes[node]
    local, per_node = members.index(rank), len(members)
    inside = ring_schedule(length, per_node, local)
    bounds = chunk_bounds(length, per_node)
    owned = (local + 1) % per_node  # the chunk the node's reduce-scatter completes here
    start, stop = bounds[owned], bounds[owned + 1]
    peers = tuple(ranks[local] for ranks in spec.nodes)  # the same local index on every node
    across = tuple(_renumbered(step, peers, "inter-node " + step.phase, start)
                   for step in SCHEDULES[spec.inter](stop - start, len(spec.nodes), node))
    within = [_renumbered(step, members, step.phase, 0) for step in inside]
    half = len(within) // 2  # the ring: P-1 reduce-scatter steps, then P-1 allgather steps
    return (*within[:half], *across, *within[half:])


def hierarchy_defect(spec: Hierarchical, size: int) -> str | None:
    """Why `spec` cannot run on `size` ranks, or None if it can."""
    if spec.inter not in SCHEDULES:
        return (f"no inter-node algorithm {spec.inter!r} (choose "
                f"{', '.join(SCHEDULES)})")  # fmt: skip
    sizes = sorted({len(ranks) for ranks in spec.nodes})
    if len(sizes) != 1 or sizes[0] == 0:
        return (f"the nodes hold {', '.join(str(len(r)) for r in spec.nodes)} ranks: the "
                "hierarchical allreduce needs the same number of ranks on every node")
    if sorted(rank for ranks in spec.nodes for rank in ranks) != list(range(size)):
        return f"the nodes {spec.nodes} are not the ranks 0 to {size - 1}, each once"
    return None

# -- the other collectives, each on one buffer of P blocks -----------------------------------------
# Block b is chunk_bounds(length, P)'s chunk b. Broadcast and reduce move the whole buffer (the
# ring: block by block); allgather starts with rank r's data in block r and ends with every block;
# reduce-scatter ends with the sum of block r on rank r; alltoall's buffer is 2P blocks, what rank r
# sends to rank j in block j and what it receives from rank i in block P + i.


class Collective(NamedTuple):
    """A collective other than allreduce, as the executor runs it: which, by what, whose root."""

    name: str  # one of PART_SCHEDULES
    algorithm: str
    root: int = 0


def _pipeline(phase: str, length: int, size: int, position: int, ahead: int, behind: int,
              combine: int) -> Schedule:  # fmt: skip
    """The P blocks along a chain, one step apart: the rank at `position` receives block c from
    `behind` at step c + position - 1 and passes it on to `ahead` at step c + position."""
    bounds = chunk_bounds(length, size)
    block = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    steps = []
    for step in range(max(position - 1, 0), position + size):
        send, recv = step - position, step - position + 1
        sends, recvs = position < size - 1 and 0 <= send < size, position > 0 and recv < size
        if sends or recvs:
            steps.append(CollectiveStep(
                phase, step, ahead if sends else -1, behind if recvs else -1,
                send if sends else -1, recv if recvs else -1, block[send] if sends else _NONE,
                block[recv] if recvs else _NONE, combine if recvs else COPY,
            ))  # fmt: skip
    return tuple(steps)


def ring_broadcast_schedule(length: int, size: int, rank: int) -> Schedule:
    """From rank 0 to the right around the ring, block by block, each rank passing the last on."""
    left, right = (rank - 1) % size, (rank + 1) % size
    return _pipeline("broadcast", length, size, rank, right, left, COPY)


def ring_reduce_schedule(length: int, size: int, rank: int) -> Schedule:
    """From rank P-1 to the left around the ring to rank 0, block by block, each adding its own."""
    left, right = (rank - 1) % size, (rank + 1) % size
    return _pipeline("reduce", length, size, size - 1 - rank, left, right, ADD_OWN_FIRST)


def binomial_broadcast_schedule(length: int, size: int, rank: int) -> Schedule:
    """Rank 0 sends to 2^(K-1), then both 2^(K-2) on, ...: K = ceil(log2 P) rounds (as MPICH)."""
    whole, rounds = slice(0, length), (size - 1).bit_length()
    mask = 1
    while mask < size and not rank & mask:  # the lowest bit set: whom we receive from
        mask <<= 1
    steps = []
    if rank:
        steps.append(_recv("broadcast", rounds - mask.bit_length(), rank - mask, 0, whole, COPY))
    mask >>= 1
    while mask:
        if rank + mask < size:
            steps.append(_send("broadcast", rounds - mask.bit_length(), rank + mask, 0, whole))
        mask >>= 1
    return tuple(steps)


def binomial_reduce_schedule(length: int, size: int, rank: int) -> Schedule:
    """The broadcast's tree backwards: in round k ranks with bit k set send to rank - 2^k."""
    whole, steps, mask = slice(0, length), [], 1
    while mask < size:
        if rank & mask:
            steps.append(_send("reduce", mask.bit_length() - 1, rank - mask, 0, whole))
            break
        if rank + mask < size:  # own + incoming: the lower ranks' sum comes first
            steps.append(_recv("reduce", mask.bit_length() - 1, rank + mask, 0, whole,
                               ADD_OWN_FIRST))  # fmt: skip
        mask <<= 1
    return tuple(steps)


def ring_allgather_schedule(length: int, size: int, rank: int) -> Schedule:
    """P-1 steps: pass on to the right the block received last (first: our own)."""
    bounds = chunk_bounds(length, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):
        send, recv = (rank - s) % size, (rank - s - 1) % size
        steps.append(CollectiveStep("allgather", s, right, left, send, recv,
                                    slice(bounds[send], bounds[send + 1]),
                                    slice(bounds[recv], bounds[recv + 1]), COPY))  # fmt: skip
    return tuple(steps)


def ring_reduce_scatter_schedule(length: int, size: int, rank: int) -> Schedule:
    """P-1 steps: add the block from the left to our own and pass it right; block r ends here."""
    bounds = chunk_bounds(length, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):  # block b starts at rank b + 1 and reaches rank b after P-1 steps
        send, recv = (rank - s - 1) % size, (rank - s - 2) % size
        sent, received = (slice(bounds[c], bounds[c + 1]) for c in (send, recv))
        steps.append(CollectiveStep("reduce-scatter", s, right, left, send, recv, sent, received,
                                    ADD_OWN_FIRST))  # fmt: skip
    return tuple(steps)


def _folded_blocks(length: int, size: int) -> tuple[list[int], list[int]]:
    """Per folded rank n of p': its first block, and where its blocks start, plus `length`."""
    pof2, extra, _ = _folding(size, 0)
    first = [2 * n if n < extra else n + extra for n in range(pof2)]
    bounds = chunk_bounds(length, size)
    return first, [bounds[b] for b in first] + [length]


def recursive_doubling_allgather_schedule(length: int, size: int, rank: int) -> Schedule:
    """Fold, then log2(p') exchanges of 1, 2, 4, ... ranks' blocks with the partner in bit k,
    then unfold: the odd rank returns the whole buffer."""
    pof2, extra, newrank = _folding(size, rank)
    first, starts = _folded_blocks(length, size)
    bounds, whole = chunk_bounds(length, size), slice(0, length)
    steps: list[CollectiveStep] = []
    if rank < 2 * extra:  # the even rank's block to the odd rank above
        own = slice(bounds[rank - rank % 2], bounds[rank - rank % 2 + 1])
        if rank % 2 == 0:
            steps.append(_send("fold", 0, rank + 1, rank, own))
        else:
            steps.append(_recv("fold", 0, rank - 1, rank - 1, own, COPY))
    if newrank >= 0:
        for k in range(pof2.bit_length() - 1):
            partner = newrank ^ (1 << k)
            mine, theirs = newrank >> k << k, partner >> k << k
            peer = _real_rank(partner, extra)
            steps.append(CollectiveStep(
                "allgather", k, peer, peer, first[mine], first[theirs],
                slice(starts[mine], starts[mine + (1 << k)]),
                slice(starts[theirs], starts[theirs + (1 << k)]), COPY,
            ))  # fmt: skip
    return tuple(steps + _fold("unfold", rank, extra, whole))


def recursive_halving_reduce_scatter_schedule(length: int, size: int, rank: int) -> Schedule:
    """Fold, then log2(p') exchanges with the partner p'/2, p'/4, ... away, each keeping the half
    of its window that holds its own block; unfold: the odd rank returns the even rank's block."""
    pof2, extra, newrank = _folding(size, rank)
    first, starts = _folded_blocks(length, size)
    bounds, whole = chunk_bounds(length, size), slice(0, length)
    steps = _fold("fold", rank, extra, whole)
    if newrank >= 0:
        lo, hi = 0, pof2  # the window of folded ranks whose blocks this rank still adds
        for step, k in enumerate(reversed(range(pof2.bit_length() - 1))):  # as MPICH: far first
            peer, mid = _real_rank(newrank ^ (1 << k), extra), (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if newrank >> k & 1 == 0 else ((mid, hi), (lo, mid))
            steps.append(CollectiveStep(
                "reduce-scatter", step, peer, peer, first[give[0]], first[keep[0]],
                slice(starts[give[0]], starts[give[1]]), slice(starts[keep[0]], starts[keep[1]]),
                _added_in_order(rank, peer),
            ))  # fmt: skip
            lo, hi = keep
    if rank < 2 * extra:  # the odd rank returns the even rank's block
        even = slice(bounds[rank - rank % 2], bounds[rank - rank % 2 + 1])
        if rank % 2 == 0:
            steps.append(_recv("unfold", 0, rank + 1, rank, even, COPY))
        else:
            steps.append(_send("unfold", 0, rank - 1, rank - 1, even))
    return tuple(steps)


def pairwise_alltoall_schedule(length: int, size: int, rank: int) -> Schedule:
    """P-1 steps: at step s send block r+s to rank r+s and receive from rank r-s (as MPICH)."""
    bounds = chunk_bounds(length, 2 * size)  # sent: blocks 0..P-1; received: P..2P-1
    steps = []
    for s in range(1, size):
        dest, source = (rank + s) % size, (rank - s) % size
        steps.append(CollectiveStep("alltoall", s - 1, dest, source, dest, source,
                                    slice(bounds[dest], bounds[dest + 1]),
                                    slice(bounds[size + source], bounds[size + source + 1]),
                                    COPY))  # fmt: skip
    return tuple(steps)


PART_SCHEDULES: dict[str, dict[str, Callable[[int, int, int], Schedule]]] = {
    "broadcast": {"ring": ring_broadcast_schedule, "binomial": binomial_broadcast_schedule},
    "reduce": {"ring": ring_reduce_schedule, "binomial": binomial_reduce_schedule},
    "allgather": {
        "ring": ring_allgather_schedule,
        "recursive-doubling": recursive_doubling_allgather_schedule,
    },
    "reduce-scatter": {
        "ring": ring_reduce_scatter_schedule,
        "recursive-halving": recursive_halving_reduce_scatter_schedule,
    },
    "alltoall": {"pairwise": pairwise_alltoall_schedule},
}
ROOTED = ("broadcast", "reduce")


def _rooted(steps: Schedule, root: int, size: int) -> Schedule:
    """A schedule written for root 0 with every peer renumbered: rank v is rank (v + root) % P."""
    if root == 0:
        return steps
    return tuple(
        step._replace(send_to=(step.send_to + root) % size if step.send_to >= 0 else -1,
                      recv_from=(step.recv_from + root) % size if step.recv_from >= 0 else -1)
        for step in steps
    )  # fmt: skip


# An allreduce's own halves, for the sharded step (ZeRO): its reduce-scatter, whose sums are the
# allreduce's bits, and its allgather. `Collective("reduce-scatter", "ring-allreduce")` leaves on
# rank r the block the ring's allgather then sends first, `owned_block(r, P)`.
ALLREDUCE_HALVES = {"ring-allreduce": "ring"}


def owned_block(rank: int, size: int) -> int:
    """The block of a buffer the ring allreduce's reduce-scatter completes on `rank`: (r+1) % P."""
    return (rank + 1) % size


@functools.lru_cache(maxsize=256)
def part_schedule(collective: Collective, length: int, size: int, rank: int) -> Schedule:
    """The steps `rank` takes in `collective` on a buffer of `length` elements."""
    halved = ALLREDUCE_HALVES.get(collective.algorithm)
    if halved is not None:  # one phase of an allreduce's schedule
        return tuple(step for step in SCHEDULES[halved](length, size, rank)
                     if step.phase == collective.name)  # fmt: skip
    try:
        steps_of = PART_SCHEDULES[collective.name][collective.algorithm]
    except KeyError:
        known = PART_SCHEDULES.get(collective.name)
        if known is None:
            raise ValueError(f"no collective {collective.name!r} (choose "
                             f"{', '.join(PART_SCHEDULES)})") from None  # fmt: skip
        raise ValueError(f"no {collective.name} algorithm {collective.algorithm!r} (choose "
                         f"{', '.join(known)})") from None  # fmt: skip
    root = collective.root if collective.name in ROOTED else 0  # the others have no root
    if not 0 <= root < size:
        raise ValueError(f"root {root} is not in a communicator of size {size}")
    relative = (rank - root) % size  # rooted schedules are written for root 0
    return _rooted(steps_of(length, size, relative), root, size)


# What the executor runs: an allreduce by name, another collective, or the two-level allreduce.
Algorithm = str | Collective | Hierarchical


def schedule(algorithm: Algorithm, length: int, size: int, rank: int) -> Schedule:
    """The steps `rank` takes in a hand-written allreduce (or another collective) of `length`
    elements on `size` ranks."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a communicator of size {size}")
    if isinstance(algorithm, Collective):
        return part_schedule(algorithm, length, size, rank)
    if isinstance(algorithm, Hierarchical):
        defect = hierarchy_defect(algorithm, size)
        if defect:
            raise ValueError(defect)
        return hierarchical_schedule(algorithm, length, size, rank)
    try:
        steps_of = SCHEDULES[algorithm]
    except KeyError:
        raise ValueError(
            f"no schedule for allreduce algorithm {algorithm!r} (choose {', '.join(SCHEDULES)})"
        ) from None
    return steps_of(length, size, rank)
