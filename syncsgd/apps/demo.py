"""`syncsgd ring-demo`: every round of an allreduce on small integers, printed or drawn.

    syncsgd ring-demo --ranks 3 --length 7
    syncsgd ring-demo --ranks 4 --length 10 --png ring.png --frames slides/ --html ring.html
    syncsgd ring-demo --zero-stage 3 --ranks 3 --length 7

The rounds and their text are in `demo_core`, the figures in `demo_png`, the page in `demo_html`;
`--zero-stage K`'s training step in `demo_zero`, its slide and page in `demo_zero_png` and
`demo_zero_html`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from syncsgd.apps.demo_core import (  # noqa: F401  (the names tests and users reach through here)
    ADDED,
    COPIED,
    MAX_LENGTH,
    MAX_RANKS,
    RESET,
    Demo,
    Snapshot,
    render_text,
    resolve_allreduce,
    run_demo,
    schedule_rounds,
)
from syncsgd.apps.demo_html import write_html
from syncsgd.apps.demo_png import draw_png, write_frames
from syncsgd.apps.demo_zero_png import MAX_RANKS as ZERO_SLIDE_RANKS
from syncsgd.collectives import INTER_ALGORITHMS, Hierarchical
from syncsgd.collectives.hierarchy import blocks
from syncsgd.comm.world import launched_by_mpi
from syncsgd.util.argtypes import nonnegative_int, positive_int
from syncsgd.util.figures import figure_path
from syncsgd.util.options import RANKS, draws, writes, writes_into

# -- the command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd ring-demo`."""
    RANKS.add(parser, default=4, help=f"thread ranks, 1..{MAX_RANKS} (default 4)")
    parser.add_argument(
        "--length",
        type=nonnegative_int,
        default=10,
        help=f"elements per buffer, 0..{MAX_LENGTH} (default 10)",
    )
    parser.add_argument(
        "--algorithm",
        type=shown_algorithm,
        help="the allreduce to show (default ring; others from syncsgd.collectives)",
    )
    parser.add_argument("--ranks-per-node", type=positive_int, metavar="R",
                        help="--algorithm hierarchical: nodes of R consecutive ranks (default: "
                        "one node)")  # fmt: skip
    parser.add_argument("--inter-algorithm", choices=INTER_ALGORITHMS, default="ring",
                        help="--algorithm hierarchical: the allreduce among the nodes (ring)")
    parser.add_argument("--collective", default="allreduce",
                        choices=("allreduce", "broadcast", "reduce", "allgather", "reduce-scatter",
                                 "alltoall"),
                        help="the collective to show (default allreduce); --algorithm then names "
                        "one of its algorithms: ring (the default), binomial (broadcast, reduce), "
                        "recursive-doubling (allgather), recursive-halving (reduce-scatter); "
                        "alltoall: pairwise (the default), on a --length that is a multiple of "
                        "--ranks")  # fmt: skip
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0, metavar="K",
                        help="0: the collective alone (the default); 1, 2, 3: one training step of "
                        "ZeRO stage K on its numbers: the gradient sums reduce-scattered by the "
                        "ring allreduce's first half, each rank's block updated with its own "
                        "optimizer state, the parameters allgathered by its second half (2: each "
                        "rank keeps its block of the sums alone; 3: and of the parameters, "
                        "allgathered before the passes instead of after the update); as text, on "
                        "one slide (--png) or a page (--html) (docs/sharded.md)")  # fmt: skip
    parser.add_argument("--root", type=nonnegative_int,
                        help="broadcast and reduce: the root rank (default 0)")
    writes(parser.add_argument("--png", metavar="PATH", type=figure_path,
                               help="also draw every round on one slide: .png, .svg or .pdf"))
    draws(writes_into(parser.add_argument("--frames", metavar="DIR", help="also write one "
                                          "1920x1080 PNG slide per round into DIR")))
    writes(parser.add_argument("--html", metavar="PATH",
                               help="also write a self-contained HTML page that steps through "
                               "the rounds (arrow keys, PageUp/PageDown, space, buttons, "
                               "auto-play, or PATH#step=k)"))  # fmt: skip
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="highlight in colour: auto = on a terminal, not under mpiexec, unless NO_COLOR is "
        "set (default auto)",
    )


def shown_algorithm(text: str) -> str:
    """--algorithm: an allreduce with steps to show, or an algorithm of another collective
    (which --collective then checks); a wrong one is a usage error, status 2."""
    from syncsgd.collectives.parts import COLLECTIVES

    if any(text in algorithms for algorithms in COLLECTIVES.values()):
        return text
    try:
        resolve_allreduce(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def use_color(choice: str, stream: Any = None) -> bool:
    """Whether to print ANSI colours for --color `choice` on `stream` (default stdout)."""
    if choice in ("always", "never"):
        return choice == "always"
    if launched_by_mpi():  # a launcher may give a rank a pseudo-terminal while writing to a file
        return False
    stream = sys.stdout if stream is None else stream
    terminal = hasattr(stream, "isatty") and stream.isatty()
    return terminal and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def check_options(options: argparse.Namespace) -> None:
    """Refuse, before any work, what would do nothing or write one format under another's name,
    and figures without matplotlib."""
    from syncsgd.util.figures import require_matplotlib

    if options.zero_stage and options.collective != "allreduce":  # the default
        raise ValueError(f"--zero-stage {options.zero_stage} shows the ring allreduce's two halves "
                         f"in a training step: drop --collective {options.collective}")  # fmt: skip
    if options.zero_stage and (options.algorithm or "ring") != "ring":
        raise ValueError(f"--zero-stage {options.zero_stage} runs the ring allreduce's halves, as "
                         f"train does: drop --algorithm {options.algorithm}")  # fmt: skip
    if options.zero_stage and (options.ranks_per_node is not None
                               or options.inter_algorithm != "ring"):  # fmt: skip
        raise ValueError(f"--ranks-per-node and --inter-algorithm shape --algorithm hierarchical; "
                         f"--zero-stage {options.zero_stage} runs the ring: drop them")
    if options.zero_stage and options.frames:
        raise ValueError(f"--frames: --zero-stage {options.zero_stage} is drawn on one slide "
                         "(--png) or a page (--html), not as frames")  # fmt: skip
    if options.zero_stage and options.png and options.ranks > ZERO_SLIDE_RANKS:
        raise ValueError(f"--zero-stage {options.zero_stage} --png draws 1 to {ZERO_SLIDE_RANKS} "
                         f"ranks on a slide, got --ranks {options.ranks}")  # fmt: skip
    if options.root is not None and options.collective not in ("broadcast", "reduce"):
        raise ValueError(f"--root: {options.collective} has no root (broadcast and reduce "
                         "have one)")  # fmt: skip
    if options.html and not options.html.lower().endswith((".html", ".htm")):
        raise ValueError(f"--html {options.html}: the page is HTML, so its name must end in .html "
                         "or .htm")  # fmt: skip
    if options.png or options.frames:
        require_matplotlib("--png" if options.png else "--frames")


def layout(options: argparse.Namespace) -> Hierarchical | None:
    """--algorithm hierarchical's nodes: --ranks-per-node consecutive ranks (None: one node)."""
    hierarchical = options.algorithm == "hierarchical" and options.collective == "allreduce"
    if not hierarchical:
        if options.ranks_per_node is not None or options.inter_algorithm != "ring":
            raise ValueError("--ranks-per-node and --inter-algorithm shape --algorithm "
                             "hierarchical: give it too")  # fmt: skip
        return None
    per_node = options.ranks_per_node or options.ranks
    return Hierarchical(blocks(options.ranks, per_node), options.inter_algorithm)


def main(options: argparse.Namespace) -> int:
    """`syncsgd ring-demo`: print every round; 1 if the result is not the NumPy sum."""
    from syncsgd.util.files import check_writable

    check_options(options)
    for path in (options.png, options.html):
        if path:
            check_writable(path)
    if options.zero_stage:
        return zero_main(options)
    algorithm = options.algorithm or ("pairwise" if options.collective == "alltoall" else "ring")
    if options.collective == "allreduce":
        demo = run_demo(options.ranks, options.length, algorithm, layout=layout(options))
    else:
        from syncsgd.apps.demo_parts import run_collective_demo

        demo = run_collective_demo(options.collective, options.ranks, options.length,
                                   algorithm, options.root or 0)  # fmt: skip
    print(render_text(demo, use_color(options.color)))
    if options.png:
        draw_png(demo, options.png)
        print(f"wrote {options.png}")
    if options.frames:
        paths = write_frames(demo, options.frames)
        print(f"wrote {len(paths)} frames to {options.frames}")
    if options.html:
        write_html(demo, options.html)
        print(f"wrote {options.html}")
    if not demo.correct:
        print(f"syncsgd: ring-demo: the {demo.what} result is wrong", file=sys.stderr)
        return 1
    return 0


def zero_main(options: argparse.Namespace) -> int:
    """`ring-demo --zero-stage K`: print one step of ZeRO stage K; 1 if it ends unlike the serial
    step."""
    from syncsgd.apps.demo_zero import render_zero_text, run_zero_demo

    zero = run_zero_demo(options.ranks, options.length, options.zero_stage)
    print(render_zero_text(zero, use_color(options.color)))
    if options.png:
        from syncsgd.apps.demo_zero_png import draw_zero_png

        draw_zero_png(zero, options.png)
        print(f"wrote {options.png}")
    if options.html:
        from syncsgd.apps.demo_zero_html import write_zero_html

        write_zero_html(zero, options.html)
        print(f"wrote {options.html}")
    if not zero.correct:
        print(f"syncsgd: ring-demo: the ZeRO-{zero.stage} step's parameters are wrong",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
