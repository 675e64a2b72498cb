"""`syncsgd model --nodes N --ranks-per-node R`: the flat ring against the two-level allreduce, with
separate α, β for the links inside a node and between nodes.

    hierarchical  2(R-1)α_in + 2(R-1)/R·nβ_in + (R-1)/R·nγ        the ring inside each node
                  + a·α_out + n·b·β_out + (n/R)·c·γ                 the inter-node algorithm's
                                                                    a, b, c on N ranks: R chunks
                                                                    of n/R share the node's link
    flat ring     2(P-1)(α_out + n/P·β_out) + (P-1)/P·nγ            P = NR: with N > 1 every step
                                                                    waits for a link between nodes

(With N = 1 the flat ring is the hierarchical one: α_in, β_in.) The ring's steps run in lockstep,
so each of its 2(P-1) steps takes as long as its slowest link, one between nodes; the two-level
allreduce crosses between nodes in 2(N-1) steps, in which the R ranks of a node each send n/(NR)
bytes over the node's one link. docs/cost-model.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from syncsgd.apps.costmodel import (
    Cost,
    Params,
    cost,
    format_bytes,
    format_seconds,
    positive_quantity,
)
from syncsgd.util.argtypes import positive_int, rank_list

INTER_ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")


def intra_cost(per_node: int) -> Cost:
    """The ring inside a node of `per_node` ranks: its a, b, c on the whole buffer."""
    return cost("ring", per_node)


def hierarchical_seconds(nodes: int, per_node: int, nbytes: float, inside: Params,
                         between: Params, inter: str = "ring") -> float:  # fmt: skip
    """The two-level allreduce's predicted time on N nodes of R ranks."""
    within = intra_cost(per_node).seconds(nbytes, inside)
    a, b, c = cost(inter, nodes)
    # The R ranks of a node share its link: R inter-node allreduces of n/R bytes cross it at once.
    return within + a * between.alpha + nbytes * b * between.beta + nbytes / per_node * c * (
        between.gamma)


def flat_ring_seconds(nodes: int, per_node: int, nbytes: float, inside: Params,
                      between: Params) -> float:  # fmt: skip
    """The flat ring on N x R ranks: every step as slow as a link between nodes (N > 1)."""
    return cost("ring", nodes * per_node).seconds(nbytes, between if nodes > 1 else inside)


def crossover(nodes: int, per_node: int, inside: Params, between: Params, inter: str
              ) -> float | None:  # fmt: skip
    """The size in bytes from which the two-level allreduce is faster, or None if it never is
    (both are lines in n: it wins everywhere at 0, or from where they cross)."""
    fixed = [hierarchical_seconds(nodes, per_node, 0.0, inside, between, inter),
             flat_ring_seconds(nodes, per_node, 0.0, inside, between)]  # fmt: skip
    slope = [hierarchical_seconds(nodes, per_node, 1.0, inside, between, inter) - fixed[0],
             flat_ring_seconds(nodes, per_node, 1.0, inside, between) - fixed[1]]  # fmt: skip
    if fixed[0] <= fixed[1]:
        return 0.0 if slope[0] <= slope[1] else None
    if slope[0] >= slope[1]:
        return None
    return (fixed[0] - fixed[1]) / (slope[1] - slope[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the two-level prediction."""
    parser.add_argument("--nodes", type=rank_list, metavar="N,...",
                        help="also predict the flat ring against the two-level allreduce on N "
                        "nodes of --ranks-per-node ranks")  # fmt: skip
    parser.add_argument("--ranks-per-node", type=positive_int, default=2, metavar="R",
                        help="--nodes: ranks per node (2)")
    parser.add_argument("--inter-algorithm", choices=INTER_ALGORITHMS, default="ring",
                        help="--nodes: the two-level allreduce's algorithm between nodes (ring)")
    for where, what in (("intra", "inside a node"), ("inter", "between nodes")):
        parser.add_argument(f"--{where}-alpha", type=positive_quantity, metavar="SECONDS",
                            help=f"--nodes: α {what} (default: --alpha, or the fit's)")
        parser.add_argument(f"--{where}-beta", type=positive_quantity, metavar="S_PER_BYTE",
                            help=f"--nodes: β {what} (default: --beta, or the fit's)")


def link_params(options: argparse.Namespace, params: Params) -> tuple[Params, Params]:
    """(inside a node, between nodes): the given α, β, else those of `params`; γ is `params`'."""
    pairs = []
    for where in ("intra", "inter"):
        alpha, beta = getattr(options, f"{where}_alpha"), getattr(options, f"{where}_beta")
        pairs.append(params._replace(alpha=params.alpha if alpha is None else alpha,
                                     beta=params.beta if beta is None else beta))  # fmt: skip
    return pairs[0], pairs[1]


def predictions(nodes: Sequence[int], per_node: int, sizes: Sequence[int], inside: Params,
                between: Params, inter: str) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (N, size): both predicted times and their ratio."""
    rows = []
    for count in nodes:
        for size in sizes:
            flat = flat_ring_seconds(count, per_node, size, inside, between)
            two = hierarchical_seconds(count, per_node, size, inside, between, inter)
            rows.append({"nodes": count, "ranks_per_node": per_node, "size_bytes": size,
                         "flat_ring_s": flat, "hierarchical_s": two,
                         "flat_over_hierarchical": flat / two if two > 0 else None})  # fmt: skip
    return rows


def describe(options: argparse.Namespace, params: Params, result: dict[str, Any]) -> list[str]:
    """The lines (and result["two_level"]) of the two-level prediction, when --nodes is given."""
    if not options.nodes:
        for flag in ("intra_alpha", "intra_beta", "inter_alpha", "inter_beta"):
            if getattr(options, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} sets the two-level prediction: "
                                 "give --nodes N too")  # fmt: skip
        return []
    inside, between = link_params(options, params)
    inter, per_node = options.inter_algorithm, options.ranks_per_node
    rows = predictions(options.nodes, per_node, options.sizes, inside, between, inter)
    lines = ["", f"# two levels: N nodes x {per_node} ranks, {inter} between nodes; inside "
             f"α = {format_seconds(inside.alpha)}, β = {inside.beta:.3g} s/B; between "
             f"α = {format_seconds(between.alpha)}, β = {between.beta:.3g} s/B",
             f"{'nodes':>6} {'size':>9} {'flat ring':>11} {'hierarchical':>13} {'flat/hier':>9}"]
    for row in rows:
        ratio = row["flat_over_hierarchical"]
        lines.append(f"{row['nodes']:>6} {format_bytes(row['size_bytes']):>9} "
                     f"{format_seconds(row['flat_ring_s']):>11} "
                     f"{format_seconds(row['hierarchical_s']):>13} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>9}")  # fmt: skip
    for count in options.nodes:
        where = crossover(count, per_node, inside, between, inter)
        told = ("never" if where is None else "at every size" if where == 0
                else f"from {format_bytes(where)}")  # fmt: skip
        lines.append(f"# {count} x {per_node}: the two-level allreduce beats the flat ring {told}")
    result["two_level"] = {"inter_algorithm": inter, "intra": inside._asdict(),
                           "inter": between._asdict(), "rows": rows}  # fmt: skip
    return lines
