"""`syncsgd model --nodes N --ranks-per-node R`: the flat ring against the two-level allreduce, with
separate α, β for the links inside a node and between nodes.

    hierarchical  2(R-1)α_in + 2(R-1)/R·nβ_in + (R-1)/R·nγ        the ring inside each node
                  + a·α_out + n·b·β_out + (n/R)·c·γ                 the inter-node algorithm's
                                                                    a, b, c on N ranks: R chunks
                                                                    of n/R share the node's link
    flat ring     2(P-1)·max(α_out + n/P·β_out,                     P = NR: with N > 1 every step
                             α_in + n/P·β_in) + (P-1)/P·nγ          has hops between nodes and,
                                                                    with R > 1, inside them

(With N = 1 the flat ring is the hierarchical one: α_in, β_in.) The ring's steps run in lockstep,
so each of its 2(P-1) steps takes as long as its slowest hop: usually one between nodes, but on
cores shared by more ranks a hop inside a node waits for its partner to be scheduled; the two-level
allreduce crosses between nodes in 2(N-1) steps, in which the R ranks of a node each send n/(NR)
bytes over the node's one link. docs/cost-model.md.

α_in, β_in and α_out, β_out are given, or fitted (`--intra-fit`, `--inter-fit`) to the ring's rows
of `bench allreduce --json` sweeps: one on the ranks of one node, one on one rank per node, γ held
at the model's. `--shared-fit` fits instead the inter-node ring measured with all R rings of the
nodes' local indices at once (`syncsgd cluster --levels` measures all three, every rank busy as in
the two-level allreduce); the two-level allreduce's inter-node phase is then that ring on n/R bytes:

    hierarchical  2(R-1)α_in + 2(R-1)/R·nβ_in + (R-1)/R·nγ + a·α_sh + (n/R)·b·β_sh + (n/R)·c·γ

(docs/cluster.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from syncsgd.apps.costmodel import (
    Cost,
    Fit,
    Params,
    cost,
    fit,
    fit_json,
    format_bytes,
    format_seconds,
    load_sweep,
    positive_quantity,
)
from syncsgd.util.argtypes import positive_int, rank_list
from syncsgd.util.figures import figure_path
from syncsgd.util.options import reads, writes

INTER_ALGORITHMS = ("ring", "naive", "recursive-doubling", "rabenseifner", "tree")


def intra_cost(per_node: int) -> Cost:
    """The ring inside a node of `per_node` ranks: its a, b, c on the whole buffer."""
    return cost("ring", per_node)


def hierarchical_seconds(nodes: int, per_node: int, nbytes: float, inside: Params,
                         between: Params, inter: str = "ring", shared: Params | None = None
                         ) -> float:  # fmt: skip
    """The two-level allreduce's predicted time on N nodes of R ranks; `shared`: α, β of the
    inter-node algorithm measured with the R of each node at once, if known."""
    within = intra_cost(per_node).seconds(nbytes, inside)
    if shared is not None:  # the sharing of the node's link is in the measurement
        return within + cost(inter, nodes).seconds(nbytes / per_node, shared)
    a, b, c = cost(inter, nodes)
    # The R ranks of a node share its link: R inter-node allreduces of n/R bytes cross it at once.
    return within + a * between.alpha + nbytes * b * between.beta + nbytes / per_node * c * (
        between.gamma)


def flat_ring_lines(nodes: int, per_node: int, inside: Params, between: Params
                    ) -> list[tuple[float, float]]:  # fmt: skip
    """The flat ring's time as the largest of these lines (seconds at 0 bytes, per byte): each
    of its 2(P-1) lockstep steps lasts as long as its slowest hop, between nodes or inside one."""
    ring = cost("ring", nodes * per_node)
    steps, reduce = ring.a, ring.c * between.gamma
    hops = [between if nodes > 1 else inside] + ([inside] if nodes > 1 and per_node > 1 else [])
    return [(steps * hop.alpha, ring.b * hop.beta + reduce) for hop in hops]


def flat_ring_seconds(nodes: int, per_node: int, nbytes: float, inside: Params,
                      between: Params) -> float:  # fmt: skip
    """The flat ring on N x R ranks: every step as slow as its slowest hop."""
    return max(fixed + nbytes * per_byte
               for fixed, per_byte in flat_ring_lines(nodes, per_node, inside, between))


def crossover(nodes: int, per_node: int, inside: Params, between: Params, inter: str,
              shared: Params | None = None) -> float | None:  # fmt: skip
    """The least size in bytes from which the two-level allreduce is faster at every larger size,
    or None if it is not at the largest (flat ring - hierarchical is the largest of a few lines:
    it is positive from the least start of a rising line, or from 0 if a falling one covers it)."""
    h0 = hierarchical_seconds(nodes, per_node, 0.0, inside, between, inter, shared)
    h1 = hierarchical_seconds(nodes, per_node, 1.0, inside, between, inter, shared) - h0
    gaps = [(f0 - h0, f1 - h1) for f0, f1 in flat_ring_lines(nodes, per_node, inside, between)]
    starts = [max(0.0, -g0 / g1) if g1 > 0 else 0.0 for g0, g1 in gaps
              if g1 > 0 or (g1 == 0 and g0 >= 0)]  # fmt: skip
    if not starts:
        return None
    start = min(starts)
    if any(g1 < 0 and g0 >= 0 and -g0 / g1 >= start for g0, g1 in gaps):
        return 0.0
    return start


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
        reads(parser.add_argument(f"--{where}-fit", metavar="BENCH_JSON",
                                  help=f"--nodes: fit α, β {what} to the ring's rows of a "
                                  "`syncsgd bench allreduce --json` sweep measured there (γ "
                                  f"held; --{where}-alpha, --{where}-beta, if given, too)"))
    reads(parser.add_argument("--shared-fit", metavar="BENCH_JSON",
                              help="--nodes: fit α, β of the inter-node phase to the ring's rows "
                              "of a sweep among the ranks of one local index with all R local "
                              "indices' rings at once over the nodes' links (`syncsgd cluster "
                              "--levels` writes it; default: --inter-fit's with R flows sharing "
                              "each link)"))
    reads(parser.add_argument("--measured", metavar="BENCH_JSON",
                              help="--nodes: set beside the predictions a `bench allreduce "
                              "--algorithms ring,hierarchical --json` sweep on N x "
                              "--ranks-per-node ranks, at its sizes: times and crossover"))
    writes(parser.add_argument("--levels-png", metavar="PATH", type=figure_path,
                               help="--measured: the flat ring and the hierarchical allreduce, "
                               "predicted (lines) and measured (markers), against size: a "
                               "slide, .png, .svg or .pdf"))  # fmt: skip


LEVEL_FLAGS = ("intra_alpha", "intra_beta", "intra_fit", "inter_alpha", "inter_beta", "inter_fit",
               "shared_fit", "measured", "levels_png")
WHERE = {"intra": "inside a node", "inter": "between nodes",
         "shared": "between nodes, R rings at once"}  # fmt: skip


def link_params(options: argparse.Namespace, params: Params
                ) -> tuple[Params, Params, dict[str, tuple[Fit, str, int]]]:  # fmt: skip
    """(inside a node, between nodes, the fits made): the given α, β, else fitted to the
    `--intra-fit`/`--inter-fit` sweep, else those of `params`; γ is `params`'. The fits include
    `--shared-fit`'s, if given."""
    pairs, fits = [], {}
    for where in ("intra", "inter"):
        alpha, beta = getattr(options, f"{where}_alpha"), getattr(options, f"{where}_beta")
        path = getattr(options, f"{where}_fit", None)
        if path:
            held = {"gamma": params.gamma, **({} if alpha is None else {"alpha": alpha}),
                    **({} if beta is None else {"beta": beta})}  # fmt: skip
            ranks, samples = load_sweep(path, ["ring"])
            fits[where] = (fit(samples, ranks, held), path, ranks)
            alpha, beta = fits[where][0].params.alpha, fits[where][0].params.beta
        pairs.append(params._replace(alpha=params.alpha if alpha is None else alpha,
                                     beta=params.beta if beta is None else beta))  # fmt: skip
    if getattr(options, "shared_fit", None):
        ranks, samples = load_sweep(options.shared_fit, ["ring"])
        fits["shared"] = (fit(samples, ranks, {"gamma": params.gamma}), options.shared_fit, ranks)
    return pairs[0], pairs[1], fits


def describe_fits(fits: dict[str, tuple[Fit, str, int]]) -> list[str]:
    """One line per level whose α, β were fitted: the sweep, the values and the worst error."""
    lines = []
    for where, (found, path, ranks) in fits.items():
        worst = max(abs(row.relative_error) for row in found.rows)
        what = WHERE[where]
        lines.append(f"# {what}: fitted to the ring's {len(found.rows)} rows of {path} (P = "
                     f"{ranks}): α = {format_seconds(found.params.alpha)}, β = "
                     f"{found.params.beta:.3g} s/B, R^2 = {found.r_squared:.4f}, |error| at "
                     f"most {worst:.1%}")  # fmt: skip
    return lines


def predictions(nodes: Sequence[int], per_node: int, sizes: Sequence[int], inside: Params,
                between: Params, inter: str, shared: Params | None = None
                ) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (N, size): both predicted times and their ratio."""
    rows = []
    for count in nodes:
        for size in sizes:
            flat = flat_ring_seconds(count, per_node, size, inside, between)
            two = hierarchical_seconds(count, per_node, size, inside, between, inter, shared)
            rows.append({"nodes": count, "ranks_per_node": per_node, "size_bytes": size,
                         "flat_ring_s": flat, "hierarchical_s": two,
                         "flat_over_hierarchical": flat / two if two > 0 else None})  # fmt: skip
    return rows


def describe(options: argparse.Namespace, params: Params, result: dict[str, Any]) -> list[str]:
    """The lines (and result["two_level"]) of the two-level prediction, when --nodes is given."""
    if not options.nodes:
        for flag in LEVEL_FLAGS:
            if getattr(options, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} sets the two-level prediction: "
                                 "give --nodes N too")  # fmt: skip
        return []
    inside, between, fits = link_params(options, params)
    inter, per_node = options.inter_algorithm, options.ranks_per_node
    shared = fits["shared"][0].params if "shared" in fits else None
    rows = predictions(options.nodes, per_node, options.sizes, inside, between, inter, shared)
    lines = ["", *describe_fits(fits),
             f"# two levels: N nodes x {per_node} ranks, {inter} between nodes; inside "
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
        where = crossover(count, per_node, inside, between, inter, shared)
        told = ("never" if where is None else "at every size" if where == 0
                else f"from {format_bytes(where)}")  # fmt: skip
        lines.append(f"# {count} x {per_node}: the two-level allreduce beats the flat ring {told}")
    if options.measured:
        lines += compare(options, inside, between, result, shared)
    elif options.levels_png:
        raise ValueError("--levels-png draws a --measured sweep: give --measured BENCH_JSON too")
    result["two_level"] = {"inter_algorithm": inter, "intra": inside._asdict(),
                           "inter": between._asdict(), "rows": rows,
                           "fits": {where: fit_json(*found) for where, found in fits.items()},
                           "shared": None if shared is None else shared._asdict(),
                           "crossovers": {count: crossover(count, per_node, inside, between, inter,
                                                           shared)
                                          for count in options.nodes}}  # fmt: skip
    return lines


# -- a measured two-level sweep beside the predictions --------------------------------------------

MEASURED = ("ring", "hierarchical")


def measured_rows(path: str, per_node: int) -> tuple[int, dict[int, dict[str, dict]]]:
    """N and, per size, the ring's and the hierarchical allreduce's rows of a bench sweep."""
    from syncsgd.apps.costmodel import _read_json

    document = _read_json(path)
    rows = document.get("rows") if isinstance(document, dict) else None
    ranks = document.get("ranks") if isinstance(document, dict) else None
    if not isinstance(rows, list) or not isinstance(ranks, int) or isinstance(ranks, bool):
        raise ValueError(f"{path} is not the output of `syncsgd bench allreduce --json`")
    if ranks % per_node or ranks < per_node:
        raise ValueError(f"{path} was measured on {ranks} ranks: not nodes of --ranks-per-node "
                         f"{per_node}")  # fmt: skip
    sizes: dict[int, dict[str, dict]] = {}
    for row in rows:
        if isinstance(row, dict) and row.get("algorithm") in MEASURED:
            sizes.setdefault(int(row["size_bytes"]), {})[row["algorithm"]] = row
    both = {size: pair for size, pair in sorted(sizes.items()) if len(pair) == 2}
    if not both:
        raise ValueError(f"{path} has no size with both ring and hierarchical rows (bench "
                         "allreduce --algorithms ring,hierarchical)")  # fmt: skip
    return ranks // per_node, both


def measured_crossover(table: list[dict[str, Any]], key: str) -> int | None:
    """The least size from which the hierarchical allreduce is faster at every larger size of
    the table (by `key`: "measured" or "predicted"), or None if it is not at the largest."""
    found = None
    for row in reversed(table):
        if row[f"hierarchical_{key}_s"] >= row[f"flat_ring_{key}_s"]:
            break
        found = row["size_bytes"]
    return found


def compare(options: argparse.Namespace, inside: Params, between: Params,
            result: dict[str, Any], shared: Params | None = None) -> list[str]:  # fmt: skip
    """The measured sweep beside the predictions, and both crossovers (result["measured"])."""
    per_node, inter = options.ranks_per_node, options.inter_algorithm
    nodes, sizes = measured_rows(options.measured, per_node)
    table = []
    for size, pair in sizes.items():
        table.append({
            "size_bytes": size,
            "flat_ring_measured_s": pair["ring"]["time_us"] * 1e-6,
            "flat_ring_least_s": pair["ring"].get("iter_min_us", pair["ring"]["time_us"]) * 1e-6,
            "flat_ring_predicted_s": flat_ring_seconds(nodes, per_node, size, inside, between),
            "hierarchical_measured_s": pair["hierarchical"]["time_us"] * 1e-6,
            "hierarchical_least_s": pair["hierarchical"].get(
                "iter_min_us", pair["hierarchical"]["time_us"]) * 1e-6,
            "hierarchical_predicted_s": hierarchical_seconds(nodes, per_node, size, inside,
                                                             between, inter, shared),
        })  # fmt: skip
    lines = [f"# measured ({options.measured}, {nodes} x {per_node}): median (fastest) "
             "beside predicted",
             f"{'size':>9} {'flat ring':>21} {'predicted':>10} {'hierarchical':>21} "
             f"{'predicted':>10} {'flat/hier':>9} {'predicted':>9}"]  # fmt: skip
    for row in table:
        measured = [f"{format_seconds(row[f'{a}_measured_s'])} "
                    f"({format_seconds(row[f'{a}_least_s'])})"
                    for a in ("flat_ring", "hierarchical")]  # fmt: skip
        lines.append(f"{format_bytes(row['size_bytes']):>9} {measured[0]:>21} "
                     f"{format_seconds(row['flat_ring_predicted_s']):>10} {measured[1]:>21} "
                     f"{format_seconds(row['hierarchical_predicted_s']):>10} "
                     f"{row['flat_ring_measured_s'] / row['hierarchical_measured_s']:>9.2f} "
                     f"{row['flat_ring_predicted_s'] / row['hierarchical_predicted_s']:>9.2f}")
    crossings = {key: measured_crossover(table, key) for key in ("measured", "predicted")}
    told = {key: "at no size of the sweep" if where is None else
            "at every size of the sweep" if where == table[0]["size_bytes"] else
            f"from {format_bytes(where)}" for key, where in crossings.items()}  # fmt: skip
    lines.append(f"# the two-level allreduce beats the flat ring {told['measured']} (medians); "
                 f"predicted: {told['predicted']}")  # fmt: skip
    result["measured"] = {"source": options.measured, "nodes": nodes, "ranks_per_node": per_node,
                          "rows": table, "crossover_measured_bytes": crossings["measured"],
                          "crossover_predicted_bytes": crossings["predicted"]}  # fmt: skip
    if options.levels_png:
        draw_levels(options.levels_png, table, nodes, per_node, inside, between, inter, shared)
        lines.append(f"wrote {options.levels_png}")
    return lines


def draw_levels(path: str, table: list[dict[str, Any]], nodes: int, per_node: int,
                inside: Params, between: Params, inter: str, shared: Params | None = None
                ) -> None:  # fmt: skip
    """Write `levels_figure` to `path` (.png, .svg or .pdf)."""
    from syncsgd.util import figures

    figures.save(levels_figure(table, nodes, per_node, inside, between, inter, shared), path)


def levels_figure(table: list[dict[str, Any]], nodes: int, per_node: int, inside: Params,
                  between: Params, inter: str, shared: Params | None = None) -> Any:  # fmt: skip
    """The slide: both allreduces' predicted lines and measured medians (filled) and least
    iterations (hollow) against size."""
    import numpy as np

    from syncsgd.util import figures

    figure = figures.new_figure(layout="constrained")
    axes = figure.subplots()
    sizes = [row["size_bytes"] for row in table]
    n = np.geomspace(sizes[0], sizes[-1], 200)
    predicted = {"flat_ring": [flat_ring_seconds(nodes, per_node, x, inside, between) for x in n],
                 "hierarchical": [hierarchical_seconds(nodes, per_node, x, inside, between, inter,
                                                       shared) for x in n]}  # fmt: skip
    for index, (key, label) in enumerate((("flat_ring", "flat ring"),
                                          ("hierarchical", "hierarchical"))):  # fmt: skip
        style = figures.series_style(index)
        colour = style["color"]
        axes.plot(n, [t * 1e3 for t in predicted[key]], color=colour, linewidth=2.2,
                  linestyle=style["linestyle"], label=f"{label}, predicted")
        axes.plot(sizes, [row[f"{key}_measured_s"] * 1e3 for row in table], linestyle="none",
                  marker=style["marker"], markersize=10, color=colour,
                  label=f"{label}, measured (median)")  # fmt: skip
        axes.plot(sizes, [row[f"{key}_least_s"] * 1e3 for row in table], linestyle="none",
                  marker=style["marker"], markersize=10, markerfacecolor="none",
                  color=colour, label=f"{label}, fastest")  # fmt: skip
    axes.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (ms)")
    figures.slide_axes(axes)
    axes.legend(fontsize=figures.TEXT_POINTS, frameon=False)
    figure.suptitle(f"allreduce on {nodes} nodes x {per_node} ranks: measured beside the "
                    "two-level model", fontsize=figures.TEXT_POINTS + 2)  # fmt: skip
    return figure
