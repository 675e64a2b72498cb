"""`syncsgd model --collectives` and `--scaling`: the α-β-γ cost of each collective on its own,
and the figure of the allreduces' time against P and against the message size.

n is the bytes of the whole buffer: what broadcast and reduce move, P blocks for allgather and
reduce-scatter (the gathered buffer, the summed one), each rank's send buffer for alltoall; p' and
L as in `costmodel`, ⌈lg P⌉ = (P - 1).bit_length(). As `syncsgd.collectives` implements them
(Thakur, Rabenseifner and Gropp 2005; Chan, Heimlich, Purkayastha and van de Geijn, "Collective
communication: theory, practice, and experience", CCPE 19(13), 2007):

    broadcast  ring                  2(P-1)α + 2(P-1)/P·nβ                  P blocks down a chain
    broadcast  binomial              ⌈lg P⌉(α + nβ)
    reduce     ring                  2(P-1)α + 2(P-1)/P·nβ + 2(P-1)/P·nγ
    reduce     binomial              ⌈lg P⌉(α + nβ + nγ)
    allgather  ring                  (P-1)α + (P-1)/P·nβ
    allgather  recursive-doubling    Lα + (p'-1)/p'·nβ;  r > 0: (L+2)α + (1 + (p'+S)/P)·nβ
    reduce-scatter ring              (P-1)α + (P-1)/P·n(β + γ)
    reduce-scatter recursive-halving Lα + (p'-1)/p'·n(β + γ);
                                     r > 0: (L+2)α + (1 + (p'+S)/P)·nβ + (1 + (p'-1+S)/P)·nγ
    alltoall   pairwise              (P-1)α + (P-1)/P·nβ

Where P = p' + r is not a power of two (r > 0), recursive doubling and halving fold as MPICH does:
the first r even ranks hand over their data (allgather: their block; reduce-scatter: the whole
buffer, added) to the odd rank above, p' ranks exchange, and the odd ranks hand back the result
(the whole buffer; one block). The folded ranks hold two blocks each and sit at the low end, so
the busiest rank, folded rank 0, moves 2^k + min(r, 2^k) blocks of n/P at the exchange of 2^k
ranks' blocks, S = Σ_{k<L} min(r, 2^k) blocks more than p' - 1 in all: at P = 3 the allgather
moves n/3 + 2n/3 + n = 2n. This is not Bruck's allgather (⌈lg P⌉α + (P-1)/P·nβ, which Thakur et
al. give for non-powers of two): the fold costs two more rounds and about n more bytes (at
P = 3, 2n against Bruck's 2n/3).

Ring reduce-scatter + ring allgather = the ring allreduce, term by term. Where P is a power of two,
recursive halving + recursive doubling = Rabenseifner's allreduce; elsewhere the two parts fold
twice, where Rabenseifner's allreduce folds once (2α + 2nβ + nγ).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from syncsgd.apps import costmodel, costmodel_levels
from syncsgd.apps.costmodel import (
    Cost,
    Params,
    cost,
    format_bytes,
    format_seconds,
    parse_quantity,
    predict,
)
from syncsgd.util.argtypes import positive_int
from syncsgd.util.figures import (
    ALGORITHM_STYLES,
    SLIDE_DPI,
    algorithm_style,
    figure_path,
    new_figure,
    save,
)
from syncsgd.util.options import writes

PARTS = (
    ("broadcast", "ring"), ("broadcast", "binomial"), ("reduce", "ring"), ("reduce", "binomial"),
    ("allgather", "ring"), ("allgather", "recursive-doubling"), ("reduce-scatter", "ring"),
    ("reduce-scatter", "recursive-halving"), ("alltoall", "pairwise"),
)  # fmt: skip
FORMULAS = {
    ("broadcast", "ring"): "2(P-1)α + 2(P-1)/P·nβ",
    ("broadcast", "binomial"): "⌈lg P⌉(α + nβ)",
    ("reduce", "ring"): "2(P-1)α + 2(P-1)/P·n(β + γ)",
    ("reduce", "binomial"): "⌈lg P⌉(α + nβ + nγ)",
    ("allgather", "ring"): "(P-1)α + (P-1)/P·nβ",
    ("allgather", "recursive-doubling"): "Lα + (p'-1)/p'·nβ; P = p'+r, r > 0: (L+2)α + "
                                         "(1 + (p'+S)/P)·nβ",
    ("reduce-scatter", "ring"): "(P-1)α + (P-1)/P·n(β + γ)",
    ("reduce-scatter", "recursive-halving"): "Lα + (p'-1)/p'·n(β + γ); r > 0: (L+2)α + "
                                             "(1 + (p'+S)/P)·nβ + (1 + (p'-1+S)/P)·nγ",
    ("alltoall", "pairwise"): "(P-1)α + (P-1)/P·nβ",
}  # fmt: skip


SHORT = dict(zip(PARTS, ("bcast ring", "bcast tree", "reduce rng", "reduce tre", "gather rng",
                         "gather rd", "rscat ring", "rscat rh", "alltoall"), strict=True))


def part_cost(collective: str, algorithm: str, ranks: int) -> Cost:
    """The α, nβ, nγ coefficients of `collective` by `algorithm` on `ranks` ranks: the rounds,
    and the bytes and additions along the critical path of its schedules."""
    cost("ring", ranks)  # the same check of `ranks`
    p = int(ranks)
    if p == 1:
        return Cost(0, 0, 0)
    share, rounds = (p - 1) / p, (p - 1).bit_length()
    table = {
        ("broadcast", "ring"): Cost(2 * (p - 1), 2 * share, 0),
        ("broadcast", "binomial"): Cost(rounds, rounds, 0),
        ("reduce", "ring"): Cost(2 * (p - 1), 2 * share, 2 * share),
        ("reduce", "binomial"): Cost(rounds, rounds, rounds),
        ("allgather", "ring"): Cost(p - 1, share, 0),
        ("allgather", "recursive-doubling"): _doubling(p)._replace(c=0),
        ("reduce-scatter", "ring"): Cost(p - 1, share, share),
        ("reduce-scatter", "recursive-halving"): _doubling(p),
        ("alltoall", "pairwise"): Cost(p - 1, share, 0),
    }
    try:
        return table[collective, algorithm]
    except KeyError:
        raise ValueError(f"no cost for {collective} by {algorithm}") from None


def _doubling(p: int) -> Cost:
    """Recursive halving's α, nβ, nγ on `p` ranks (recursive doubling's α and nβ are the same).

    P = p' + r: the fold moves the whole buffer (halving; doubling: one block) and the unfold one
    block (doubling: the whole buffer); folded rank 0, which holds two blocks, sends or receives
    2^k + min(r, 2^k) blocks of n/P at each of the L exchanges, and adds what it receives."""
    levels, pow2 = p.bit_length() - 1, 1 << (p.bit_length() - 1)
    extra = p - pow2
    if extra == 0:
        return Cost(levels, (p - 1) / p, (p - 1) / p)
    blocks = pow2 - 1 + sum(min(extra, 1 << k) for k in range(levels))  # p' - 1 + S
    return Cost(levels + 2, 1 + (blocks + 1) / p, 1 + blocks / p)


def describe_parts(ranks: Sequence[int], sizes: Sequence[int], params: Params) -> list[str]:
    """Each collective's formula, its predicted times, and allreduce built from two of them."""
    lines = ["", "# each collective on its own (n: the bytes of the whole buffer)"]
    width = max(len(f"{c} {a}") for c, a in PARTS)
    for part in PARTS:
        name = " ".join(part)
        lines.append(f"#   {SHORT[part]:>10} = {name:<{width}}  {FORMULAS[part]}")
    lines.append("#   p' = 2^L <= P < 2^(L+1), r = P - p', S = Σ min(r, 2^k) over k < L: where P "
                 "is not a power of two, MPICH's fold (not Bruck's allgather)")  # fmt: skip
    lines.append(f"{'ranks':>7} {'size':>9}  " + "  ".join(f"{SHORT[part]:>10}" for part in PARTS))
    for p in ranks:
        for nbytes in sizes:
            cells = [format_seconds(part_cost(c, a, p).seconds(nbytes, params)) for c, a in PARTS]
            lines.append(f"{p:>7} {format_bytes(nbytes):>9}  "
                         + "  ".join(f"{cell:>10}" for cell in cells))  # fmt: skip
    for p in ranks:
        built = _add(part_cost("reduce-scatter", "ring", p), part_cost("allgather", "ring", p))
        lines.append(f"# P = {p}: ring reduce-scatter + ring allgather = {_terms(built)} = the "
                     f"ring allreduce {_terms(cost('ring', p))}")  # fmt: skip
    return lines


def _add(first: Cost, second: Cost) -> Cost:
    """The cost of one collective after the other."""
    return Cost(first.a + second.a, first.b + second.b, first.c + second.c)


def _terms(c: Cost) -> str:
    """'14α + 1.75nβ + 0.875nγ'."""
    return f"{c.a:g}α + {c.b:.4g}nβ + {c.c:.4g}nγ"


def parts_json(ranks: Sequence[int], sizes: Sequence[int], params: Params) -> list[dict[str, Any]]:
    """Every collective's coefficients and predicted seconds per (P, size)."""
    rows = []
    for collective, algorithm in PARTS:
        for p in ranks:
            c = part_cost(collective, algorithm, p)
            rows.append({"collective": collective, "algorithm": algorithm, "ranks": p,
                         "a": c.a, "b": c.b, "c": c.c,
                         "seconds": {str(n): c.seconds(n, params) for n in sizes}})  # fmt: skip
    return rows


# -- why the ring: time against P and against size ----------------------------------------------

FONT_POINTS = 16  # on a 1920 x 1080 slide
RING_COLOUR = ALGORITHM_STYLES["ring"][0]  # the ring's own lines: its latency and its floor
SCALING_RANKS = 2 ** np.arange(1, 13)  # P = 2 .. 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd model`: the allreduces', then the collectives' and the figure's."""
    costmodel.add_arguments(parser)
    parser.add_argument("--collectives", action="store_true",
                        help="also give broadcast, reduce, allgather, reduce-scatter and alltoall "
                        "on their own: formulas and times")  # fmt: skip
    writes(parser.add_argument("--scaling", metavar="PATH", type=figure_path,
                               help="draw the allreduces' time against P at --scaling-size and "
                               "against the size at --scaling-ranks, for a 1920x1080 slide "
                               "(.png, .svg, .pdf)"))  # fmt: skip
    parser.add_argument("--scaling-size", type=scaling_size,
                        help="--scaling: bytes for time against P (default 64M)")  # fmt: skip
    parser.add_argument("--scaling-ranks", type=positive_int,
                        help="--scaling: ranks for time against size (default 64)")  # fmt: skip
    costmodel_levels.add_arguments(parser)


def scaling_size(text: str) -> float:
    """--scaling-size: bytes > 0, as --sizes gives them (64M) or as a number (6.7e7)."""
    from syncsgd.apps.bench.allreduce import parse_bytes

    try:
        return float(parse_bytes(text))
    except argparse.ArgumentTypeError:
        value = parse_quantity(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def main(options: argparse.Namespace) -> int:
    """`syncsgd model`, with --collectives and --scaling."""
    for flag, value in (("--scaling-size", options.scaling_size),
                        ("--scaling-ranks", options.scaling_ranks)):  # fmt: skip
        if value is not None and not options.scaling:
            raise ValueError(f"{flag} sets the --scaling figure: give --scaling PATH too")
    drawn: list[Params] = []

    def collectives(options: argparse.Namespace, params: Params, result: dict[str, Any]
                    ) -> list[str]:  # fmt: skip
        drawn.append(params)
        levels = costmodel_levels.describe(options, params, result)
        if not options.collectives:
            return levels
        result["collectives"] = parts_json(options.ranks, options.sizes, params)
        return describe_parts(options.ranks, options.sizes, params) + levels

    status = costmodel.main(options, collectives)
    if options.scaling and drawn:
        size = float(64 << 20) if options.scaling_size is None else options.scaling_size
        ranks = 64 if options.scaling_ranks is None else options.scaling_ranks
        draw_scaling(options.scaling, size, ranks, drawn[0], options.algorithms)
        print(f"wrote {options.scaling}")
    return status


def shown_algorithms(algorithms: Sequence[str]) -> list[str]:
    """The algorithms the scaling figure draws: the naive one, far above, only if alone."""
    drawn = [name for name in algorithms if name != "naive"]
    return drawn or list(algorithms)


def bandwidth_bound_from(nbytes: float, params: Params) -> float:
    """P up to which the ring's nβ/P per message costs more than its α: nβ/α."""
    return nbytes * params.beta / params.alpha


def draw_scaling(path: str, nbytes: float, ranks: int, params: Params,
                 algorithms: Sequence[str]) -> Any:  # fmt: skip
    """Write the two panels to `path` (its extension says the format); return the figure."""
    figure = new_figure(layout="constrained", dpi=SLIDE_DPI)
    left, right = figure.subplots(1, 2)
    algorithms = shown_algorithms(algorithms)
    _against_ranks(left, nbytes, params, algorithms)
    _against_size(right, ranks, params, algorithms)
    figure.suptitle(f"Why the ring: α = {format_seconds(params.alpha)}, "
                    f"{1 / params.beta / 1e9:.3g} GB/s, γ = {params.gamma:.3g} s/B",
                    fontsize=FONT_POINTS + 2)  # fmt: skip
    save(figure, path)
    return figure


def _style(axes: Any, name: str, x: np.ndarray, y: np.ndarray, label: str) -> None:
    """One algorithm's line in its colour, marker and dashes."""
    axes.plot(x, y, linewidth=2.5, markersize=9, label=label, markevery=max(len(x) // 12, 1),
              **algorithm_style(name))  # fmt: skip


def _against_ranks(axes: Any, nbytes: float, params: Params, algorithms: Sequence[str]) -> None:
    """Time against P at a fixed size: the ring flattens at 2nβ + nγ until its α takes over."""
    ranks = SCALING_RANKS
    for name in algorithms:
        _style(axes, name, ranks, np.array([predict(name, int(p), nbytes, params) for p in ranks]),
               name)  # fmt: skip
    latency = 2 * (ranks - 1) * params.alpha
    axes.plot(ranks, latency, color=RING_COLOUR, linestyle="-", linewidth=1.2,
              label="ring's latency 2(P-1)α")  # fmt: skip
    floor = 2 * nbytes * params.beta + nbytes * params.gamma
    axes.axhline(floor, color=RING_COLOUR, linestyle=":", linewidth=2.5,
                 label="ring's floor 2nβ + nγ")  # fmt: skip
    turn = bandwidth_bound_from(nbytes, params)
    if ranks[0] <= turn <= ranks[-1]:
        axes.axvline(turn, color="#000000", linestyle="--", linewidth=1.5,
                     label=f"P = nβ/α = {turn:.3g}")  # fmt: skip
    _finish(axes, "ranks P", f"against P at n = {format_bytes(nbytes)}: bandwidth-bound\nleft of "
                             "nβ/α, latency-bound right")  # fmt: skip


def _against_size(axes: Any, ranks: int, params: Params, algorithms: Sequence[str]) -> None:
    """Time against size at a fixed P: latency-bound below Pα/β, bandwidth-bound above."""
    n = 2.0 ** np.arange(3, 31, 0.5)
    for name in algorithms:
        _style(axes, name, n, np.array([predict(name, ranks, x, params) for x in n]), name)
    turn = ranks * params.alpha / params.beta
    if n[0] <= turn <= n[-1]:
        axes.axvline(turn, color="#000000", linestyle="--", linewidth=1.5,
                     label=f"n = Pα/β = {format_bytes(turn)}")  # fmt: skip
    _finish(axes, "message size n (bytes)",
            f"against n at P = {ranks}: latency-bound\n"
            "left of Pα/β, bandwidth-bound right")  # fmt: skip


def _finish(axes: Any, xlabel: str, title: str) -> None:
    """Log-log axes of predicted time, their labels and title, slide-sized ticks, a grid and the
    legend."""
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel(xlabel, fontsize=FONT_POINTS)
    axes.set_ylabel("predicted allreduce time (s)", fontsize=FONT_POINTS)
    axes.set_title(title, fontsize=FONT_POINTS)
    axes.minorticks_off()  # hundreds of unlabelled ticks cost seconds of layout
    axes.tick_params(labelsize=FONT_POINTS)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=FONT_POINTS - 2, loc="best")
