"""Each collective's α-β-γ cost against its schedules; the scaling figure for a slide."""

from __future__ import annotations

import pytest
from test_collective_parts import rounds
from test_costmodel import simulate

from syncsgd.apps import costmodel_parts
from syncsgd.apps.costmodel import Cost, Params, cost
from syncsgd.apps.costmodel_parts import PARTS, part_cost
from syncsgd.collectives import Collective, schedule
from syncsgd.util import figures

DEFAULTS = Params(2e-6, 1 / 12.5e9, 1e-10)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 8, 12])
def test_the_alpha_term_is_the_rounds_of_the_schedules(size):
    for collective, algorithm in PARTS:
        assert part_cost(collective, algorithm, size).a == rounds(collective, algorithm, size)


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8])
def test_the_beta_term_of_the_rings_is_what_each_rank_sends(size):
    n = 12 * size  # elements of one byte: the whole buffer (alltoall: what each rank sends)
    for collective, algorithm in PARTS:
        if collective not in ("allgather", "reduce-scatter", "alltoall") or algorithm not in (
            "ring", "pairwise"
        ):
            continue
        length = 2 * n if collective == "alltoall" else n  # alltoall: sent, then received
        for rank in range(size):
            steps = schedule(Collective(collective, algorithm), length, size, rank)
            sent = sum(step.send.stop - step.send.start for step in steps)
            assert sent == pytest.approx(part_cost(collective, algorithm, size).b * n)


@pytest.mark.parametrize("part", PARTS, ids=" ".join)
def test_the_formulas_are_the_schedules_own_rounds_bytes_and_additions(part):
    # The schedules' time with each message costing α + bytes·β and each addition bytes·γ, along
    # the longest chain of steps (test_costmodel.simulate), for P = 2..16: the formula's α, nβ and
    # nγ terms, one at a time and together. n = 720720 one-byte elements divides by every P here.
    collective, algorithm = part
    n = 720720
    length = 2 * n if collective == "alltoall" else n  # alltoall: sent, then received
    for size in range(2, 17):
        expected = part_cost(collective, algorithm, size)
        for params in (Params(1, 0, 0), Params(0, 1, 0), Params(0, 0, 1), Params(1, 1e-6, 3e-6)):
            moved = simulate(Collective(collective, algorithm), size, length, params, itemsize=1)
            assert moved == pytest.approx(expected.seconds(n, params), rel=1e-12), (size, params)


def test_the_fold_of_recursive_doubling_and_halving_by_hand():
    # P = 3: rank 0 hands its block to rank 1 (n/3), ranks 1 and 2 swap 2n/3 and n/3, rank 1
    # returns the whole buffer: 2n. Reduce-scatter: n added at the fold, 2n/3 at the exchange.
    assert part_cost("allgather", "recursive-doubling", 3) == pytest.approx(Cost(3, 2, 0))
    assert part_cost("reduce-scatter", "recursive-halving", 3) == pytest.approx(Cost(3, 2, 5 / 3))
    # P = 5: n/5 + 2n/5 + 3n/5 + n
    assert part_cost("allgather", "recursive-doubling", 5) == pytest.approx(Cost(4, 2.2, 0))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 16, 1000, 1024])
def test_allreduce_is_reduce_scatter_plus_allgather(size):
    def plus(first: Cost, second: Cost) -> Cost:
        return Cost(*(x + y for x, y in zip(first, second, strict=True)))

    ring = plus(part_cost("reduce-scatter", "ring", size), part_cost("allgather", "ring", size))
    assert ring == pytest.approx(cost("ring", size))
    halving = plus(part_cost("reduce-scatter", "recursive-halving", size),
                   part_cost("allgather", "recursive-doubling", size))  # fmt: skip
    if size & (size - 1) == 0:
        assert halving == pytest.approx(cost("rabenseifner", size))
    else:  # two folds where Rabenseifner's allreduce has one
        extra = plus(halving, Cost(0, 0, 0))
        assert extra.a == cost("rabenseifner", size).a + 2


def test_thakur_et_al_for_a_power_of_two():
    # P = 8, Thakur, Rabenseifner and Gropp 2005: binomial broadcast lg P (α + nβ); recursive
    # doubling allgather lg P α + (P-1)/P nβ; recursive halving lg P α + (P-1)/P n(β + γ).
    assert part_cost("broadcast", "binomial", 8) == Cost(3, 3, 0)
    assert part_cost("allgather", "recursive-doubling", 8) == Cost(3, 7 / 8, 0)
    assert part_cost("reduce-scatter", "recursive-halving", 8) == Cost(3, 7 / 8, 7 / 8)
    assert part_cost("reduce", "binomial", 8) == Cost(3, 3, 3)


def test_the_scaling_figure_is_slide_sized_readable_and_colour_blind_safe(tmp_path):
    path = str(tmp_path / "why.svg")
    figure = costmodel_parts.draw_scaling(path, 64 << 20, 64, DEFAULTS,
                                          ["ring", "naive", "rabenseifner", "tree"])  # fmt: skip
    assert open(path).read(200).lstrip().startswith("<?xml")
    width, height = figure.get_size_inches() * figure.dpi
    assert (round(width), round(height)) == (1920, 1080)
    sizes = [text.get_fontsize() for text in figure.findobj(lambda o: hasattr(o, "get_fontsize"))
             if text.get_text()]  # fmt: skip
    assert sizes and min(sizes) >= 14
    palette = {colour.lower() for colour in figures.OKABE_ITO.values()}
    styles = set()
    for axes in figure.axes:
        for line in axes.get_lines():
            from matplotlib.colors import to_hex

            assert to_hex(line.get_color()) in palette, line.get_label()
            styles.add((line.get_marker(), str(line.get_linestyle())))
        labels = [line.get_label() for line in axes.get_lines()]
        assert "naive" not in labels and "ring" in labels
    algorithms = [line for line in figure.axes[0].get_lines() if line.get_marker() != "None"]
    assert len({(line.get_marker(), str(line.get_linestyle())) for line in algorithms}) == len(
        algorithms
    )


@pytest.mark.parametrize(("nbytes", "ranks"), [(64 << 20, 64), (1 << 30, 4096)])
def test_the_scaling_titles_fit_the_slide_apart(tmp_path, nbytes, ranks):
    # docs/instructor.md's figure: the two panels' titles ran together, the right one off the page
    figure = costmodel_parts.draw_scaling(str(tmp_path / "why.png"), nbytes, ranks, DEFAULTS,
                                          ["ring", "rabenseifner"])  # fmt: skip
    renderer = figure.canvas.get_renderer()
    page = figure.bbox
    boxes = [axes.title.get_window_extent(renderer) for axes in figure.axes]
    boxes.append(figure._suptitle.get_window_extent(renderer))
    for box in boxes:
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    left, right, top = boxes
    assert left.x1 < right.x0 and top.y0 > max(left.y1, right.y1)


def test_other_extensions_are_refused(tmp_path):
    for name in ("why.gif", "why"):
        with pytest.raises(ValueError, match="png, .svg or .pdf"):
            costmodel_parts.draw_scaling(str(tmp_path / name), 1e6, 8, DEFAULTS, ["ring"])
        assert not (tmp_path / name).exists()


def test_the_cli_prints_the_collectives_and_writes_the_figure(tmp_path, capsys):
    from syncsgd.cli import main

    path = tmp_path / "why.png"
    assert main(["model", "--ranks", "8", "--sizes", "1K", "--collectives",
                 "--scaling", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "reduce-scatter ring" in out and "= the ring allreduce 14α + 1.75nβ + 0.875nγ" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as refused:  # a malformed option: argparse's status 2
        main(["model", "--scaling", str(tmp_path / "why.jpg")])
    assert refused.value.code == 2
    assert "a figure is written as .png, .svg or .pdf" in capsys.readouterr().err


def test_the_scaling_options_need_the_figure(tmp_path, capsys):
    from syncsgd.cli import main

    for option, value in (("--scaling-ranks", "8"), ("--scaling-size", "1M")):
        assert main(["model", option, value]) == 1
        out, err = capsys.readouterr()
        assert out == ""  # refused before the table
        line = f"{option} sets the --scaling figure: give --scaling PATH too"
        assert err == f"syncsgd: error: {line}\n"
    path = tmp_path / "why.svg"
    assert main(["model", "--ranks", "8", "--sizes", "1K", "--scaling", str(path),
                 "--scaling-size", "1M", "--scaling-ranks", "8"]) == 0  # fmt: skip
    assert path.exists()


def test_the_numbers_the_instructor_guide_quotes(capsys):
    from syncsgd.apps.costmodel import format_bytes, format_seconds, predict
    from syncsgd.cli import main

    assert main(["model", "--ranks", "6,48,64,1024", "--sizes", "1M,64M",
                 "--algorithms", "ring,rabenseifner"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.split("\n")
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in lines if line[:1] == " "}
    quoted = {("64", "64", "MiB"): ["17.4", "ms", "17.2", "ms*"],
              ("1024", "64", "MiB"): ["21.5", "ms", "17.5", "ms*"],
              ("1024", "1", "MiB"): ["4.36", "ms", "312", "us*"],
              ("6", "64", "MiB"): ["14.6", "ms*", "30.5", "ms"],
              ("48", "64", "MiB"): ["17.3", "ms*", "34.4", "ms"]}  # fmt: skip
    for key, cells in quoted.items():
        assert rows[key][:4] == cells, key
    n = 64 << 20
    assert f"{costmodel_parts.bandwidth_bound_from(n, DEFAULTS):.3g}" == "2.68e+03"
    assert format_bytes(64 * DEFAULTS.alpha / DEFAULTS.beta) == "1.53 MiB"
    lead = predict("ring", 64, n, DEFAULTS) - predict("rabenseifner", 64, n, DEFAULTS)
    assert format_seconds(lead) == "228 us" and format_seconds(n / 2 * DEFAULTS.beta) == "2.68 ms"
    assert f"{lead / (n / 2 * DEFAULTS.beta):.3f}" == "0.085"
