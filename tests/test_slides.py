"""Every figure is a slide: 14-point text at 1920x1080, 4.5:1 contrast, one stated encoding."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from syncsgd.apps import costmodel, costmodel_parts, demo, demo_core, demo_html, demo_png, study  # noqa: E402
from syncsgd.apps.bench import allreduce as bench_allreduce  # noqa: E402
from syncsgd.apps.demo_core import ranks_summed  # noqa: E402
from syncsgd.cli import main  # noqa: E402
from syncsgd.training import timeline  # noqa: E402
from syncsgd.util import figures  # noqa: E402

pytestmark = pytest.mark.timeout(240)

RANKS = (3, 8, 16)


def span(name: str, category: str, tid: int, start: float, length: float, **args) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": 0, "tid": tid, "ts": start,
            "dur": length, "args": args}  # fmt: skip


def train_trace(ranks: int, steps: int = 3) -> list[dict]:
    """A trace like train's: a slow first step, then compute, the ring's steps, the update."""
    events = []
    for rank in range(ranks):
        clock = 0.0
        for step in range(steps):
            compute = 400_000.0 if step == 0 else 900.0
            events.append(span("compute", "compute", rank, clock, compute, step=step))
            clock += compute
            for phase in ("reduce-scatter", "allgather"):
                for s in range(ranks - 1):
                    events.append(span(f"{phase} {s}", "allreduce", rank, clock, 40.0))
                    clock += 40.0
            events.append(span("update", "update", rank, clock, 100.0, step=step))
            clock += 100.0
    return events


def calls_trace(ranks: int) -> list[dict]:
    """A trace like bench's: each call outlined around its steps."""
    events = []
    for rank in range(ranks):
        events.append(span("ring 64 B", "call", rank, 0.0, 500.0, bytes=64))
        events += [span(f"reduce-scatter {s}", "allreduce", rank, 10.0 + 30 * s, 25.0)
                   for s in range(ranks - 1)]  # fmt: skip
    return events


def demo_figures(ranks: int) -> dict[str, object]:
    """ring-demo's slides at P = `ranks`: the whole run, its first and last round."""
    run = demo.run_demo(ranks, 8, "ring")
    layout = demo_png.FrameLayout(run)
    return {
        "grid": demo_png.grid_canvas(run).finish(),
        "first round": demo_png.frame_canvas(run, 1, layout).finish(),
        "last round": demo_png.frame_canvas(run, len(run.steps), layout).finish(),
    }


def sweep_rows(ranks: int) -> list[dict]:
    """Rows like bench allreduce's: every algorithm and its baseline, sizes 8 B to 64 MiB."""
    return [{"algorithm": name, "size_bytes": size, "time_us": 10 + size * ranks / 1e3,
             "busbw_GBps": size / (10 + size / 1e3) / 1e3}
            for name in ("ring", "recursive-doubling", "rabenseifner", "tree", "naive",
                         "numpy-sum")
            for size in (8, 1 << 10, 1 << 20, 64 << 20)]  # fmt: skip


def study_rows(ranks: int) -> tuple[list, study.Knee]:
    """A batch-size study of `ranks` batch sizes: steps halve until the knee."""
    rows = [study.Row(16 << k, max(4, 200 >> k), 0.1, 0.9, noise_scale=60.0 + k)
            for k in range(ranks)]  # fmt: skip
    return rows, study.Knee(4.0, 800.0, 200.0)


@pytest.mark.parametrize("ranks", RANKS)
def test_every_figure_is_legible_on_a_slide(ranks, tmp_path):
    params = costmodel.Params(costmodel.DEFAULT_ALPHA, costmodel.DEFAULT_BETA,
                              costmodel.DEFAULT_GAMMA)  # fmt: skip
    drawn = {**demo_figures(ranks),
             "timeline": timeline.gantt_figure(train_trace(ranks), "train"),
             "20 steps": timeline.gantt_figure(train_trace(ranks, 20), "train"),
             "calls": timeline.gantt_figure(calls_trace(ranks), "bench"),
             "bench": bench_allreduce.sweep_figure(sweep_rows(ranks), f"{ranks} ranks"),
             "study": study.study_figure(*study_rows(ranks), "batch-size study"),
             "why the ring": costmodel_parts.draw_scaling(str(tmp_path / "ring.png"), 64 << 20,
                                                          8 * ranks, params, costmodel.ALGORITHMS),
             }  # fmt: skip
    if ranks == RANKS[-1]:  # one model figure has a panel per P
        drawn["model"] = costmodel.model_figure(RANKS, [1024], costmodel.ALGORITHMS, params)
    for name, figure in drawn.items():
        assert figures.slide_scale(figure) == pytest.approx(1.0, abs=1e-3), name
        assert figures.legibility(figure) == [], name


def test_the_check_finds_small_and_faint_text():
    figure = figures.new_figure()
    axes = figure.add_axes((0, 0, 1, 1))
    axes.axis("off")
    axes.text(0.1, 0.8, "small", fontsize=10)
    axes.text(0.1, 0.5, "faint", fontsize=20, color="#E69F00")  # orange on white: 2.1:1
    axes.text(0.1, 0.2, "fine", fontsize=20, color="black")
    problems = figures.legibility(figure)
    assert [p.split(":")[0] for p in problems] == ["'small'", "'faint'"]
    big = figures.new_figure((2 * figures.SLIDE[0], 2 * figures.SLIDE[1]))
    big.text(0.5, 0.5, "halved on a slide", fontsize=20)
    assert "10.0 points on a slide" in figures.legibility(big)[0]


def test_contrast_is_wcag():
    assert figures.contrast((0, 0, 0), (1, 1, 1)) == pytest.approx(21.0)
    assert figures.contrast((1, 1, 1), (1, 1, 1)) == pytest.approx(1.0)
    grey = (0x77 / 255,) * 3  # WCAG's own example: #777 on white is just below 4.5:1
    assert figures.contrast(grey, (1, 1, 1)) == pytest.approx(4.48, abs=0.01)


def test_cell_colours_keep_black_text_readable_and_differ():
    for ranks in RANKS:
        colours = [demo_png.count_colour(c, ranks) for c in range(1, ranks + 1)]
        assert len(set(colours)) == ranks
        assert min(figures.contrast(c, (0, 0, 0)) for c in colours) >= figures.MIN_CONTRAST


@pytest.mark.parametrize("ranks", range(2, 17))
def test_neighbouring_counts_are_told_apart_and_black_text_reads_on_each(ranks):
    colours = [demo_png.count_colour(c, ranks) for c in range(1, ranks + 1)]
    steps = [figures.contrast(a, b) for a, b in zip(colours, colours[1:], strict=False)]
    assert min(steps) >= figures.MIN_STEP_CONTRAST, steps
    text = [figures.contrast(c, (0, 0, 0)) for c in colours]
    assert min(text) >= figures.MIN_CONTRAST, text
    # the page shows the same colours as the slides
    page = demo_html.page(demo.run_demo(ranks, 2 * ranks, "ring"))
    for colour in colours:
        assert demo_core.hex_colour(colour) in page


def cell_numbers(canvas) -> list[list[int]]:
    """The numbers written in the cells, one list per buffer."""
    return [[int(v) for v in artist.get_text().split()] for artist, _ in canvas.boxes
            if artist.get_fontfamily()[0] == demo_png.MONO
            and artist.get_position()[1] < demo_png.HEIGHT - demo_png.LEGEND]  # fmt: skip


@pytest.mark.parametrize(("ranks", "kind"), [(3, "value"), (8, "count")])
def test_one_kind_of_number_per_figure_and_the_legend_names_it(ranks, kind):
    run = demo.run_demo(ranks, 8, "ring")
    layout = demo_png.FrameLayout(run)
    assert layout.numbers == kind
    canvas = demo_png.frame_canvas(run, 1, layout)
    shown = cell_numbers(canvas)
    group = {s.event.rank: s for s in run.steps[0][1]}
    buffers = [group[r].buffer if r in group else run.start[r] for r in range(ranks)]
    expected = [b.tolist() if kind == "value" else
                ranks_summed(b, ranks).tolist() for b in buffers]  # fmt: skip
    assert shown == expected
    legend = " ".join(artist.get_text() for artist, _ in canvas.boxes)
    assert ("10**r" in legend) == (kind == "value")
    assert ("how many ranks the element holds the sum of" in legend) == (kind == "count")


def test_p16_numbers_are_counts_of_binary_digits():
    run = demo.run_demo(16, 4, "ring")
    assert run.start[5].tolist() == [32] * 4 and run.final[0].tolist() == [65535] * 4
    counts = ranks_summed(np.array([0, 1, 6, 65535]), 16)
    assert counts.tolist() == [0, 1, 2, 16]


def test_a_large_demo_is_the_compact_grid_of_ranks_by_rounds():
    run = demo.run_demo(8, 16, "ring")
    canvas = demo_png.grid_canvas(run)
    texts = [artist.get_text() for artist, _ in canvas.boxes]
    assert "each rank's buffer after each round" in texts[0]
    assert [str(k) for k in range(2 * 7 + 1)] == [t for t in texts if t.isdigit()][:15]
    assert "round 0: start; 1-7: reduce-scatter; 8-14: allgather" in texts
    assert cell_numbers(canvas) == []  # colour alone, and the legend says so
    assert any("no numbers: the colour alone" in t for t in texts)


@pytest.mark.parametrize("extension", ["svg", "pdf"])
def test_the_format_follows_the_extension(tmp_path, extension):
    path = tmp_path / f"ring.{extension}"
    assert demo.main(demo_parse("--ranks", "3", "--length", "4", "--png", str(path))) == 0
    head = path.read_bytes()[:200]
    assert head.startswith(b"%PDF") if extension == "pdf" else b"<svg" in head
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def demo_parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser(prog="syncsgd ring-demo")
    demo.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [["ring-demo", "--png", "x.jpg"], ["model", "--png", "m.gif"],
                                  ["train", "--timeline-png", "t.png.bak"]])  # fmt: skip
def test_other_extensions_are_refused_in_one_line(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert re.fullmatch(r"syncsgd \S+: error: argument [-a-z]+: .*\.png, \.svg or \.pdf.*\n",
                        capsys.readouterr().err)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def line_styles(figure) -> dict[str, tuple]:
    """Each labelled line's colour, marker and dashes, by label."""
    from matplotlib.colors import to_hex

    return {line.get_label(): (to_hex(line.get_color()), line.get_marker(), line.get_linestyle())
            for axes in figure.axes for line in axes.get_lines()
            if not line.get_label().startswith("_")}  # fmt: skip


def test_an_algorithm_has_one_colour_marker_and_dashes_in_every_figure(tmp_path):
    params = costmodel.Params(costmodel.DEFAULT_ALPHA, costmodel.DEFAULT_BETA,
                              costmodel.DEFAULT_GAMMA)  # fmt: skip
    model = line_styles(costmodel.model_figure([8], [1024], costmodel.ALGORITHMS, params))
    ring = line_styles(costmodel_parts.draw_scaling(str(tmp_path / "r.png"), 64 << 20, 64,
                                                    params, ["ring", "rabenseifner", "tree"]))
    bench = line_styles(bench_allreduce.sweep_figure(sweep_rows(4), "4 ranks"))
    for name in ("ring", "rabenseifner", "tree"):
        assert model[name] == ring[name] == bench[name], name
    assert model["recursive-doubling"] == bench["recursive-doubling"]
    assert len({model[name] for name in costmodel.ALGORITHMS}) == len(costmodel.ALGORITHMS)
    assert len({model[name][0] for name in costmodel.ALGORITHMS}) == len(
        costmodel.ALGORITHMS)  # a colour each, not only a marker each


def test_a_long_timeline_shows_a_few_steps_with_labels_apart():
    figure = timeline.gantt_figure(train_trace(4, 20), "train")
    labels = [artist for artist, _, _ in figures.drawn_texts(figure)
              if artist is not None and artist.get_text().startswith("step ")]  # fmt: skip
    renderer = figure.canvas.get_renderer()
    assert [t.get_text() for t in labels] == ["step 1", "step 2", "step 3", "step 4"]
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda box: box.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    assert "steps 1-4 of the timed 1-19" in figure.axes[0].get_title()


def test_figures_say_microseconds_not_us():
    figure = bench_allreduce.sweep_figure(sweep_rows(3), "3 ranks")
    texts = [artist.get_text() for artist, _, _ in figures.drawn_texts(figure) if artist]
    assert "time (µs)" in texts and not any("(us)" in text for text in texts)


@pytest.mark.parametrize(("algorithm", "expected"), [
    ("ring", "sends, round 1-30: r → r+1 mod 16"),
    ("rabenseifner", "sends, round 1: r ↔ r xor 1; 2: r ↔ r xor 2; 3: r ↔ r xor 4; 4-5: r ↔ "
                     "r xor 8"),
    ("naive", "sends, round 1: 1→0; 2: 2→0; 3: 3→0;"),
])  # fmt: skip
def test_the_compact_grid_says_who_sends_to_whom(algorithm, expected):
    canvas = demo_png.grid_canvas(demo.run_demo(16, 16, algorithm))
    texts = [artist.get_text() for artist, _ in canvas.boxes]
    assert any(text.startswith(expected) for text in texts), texts[-6:]


def test_every_round_of_every_rank_has_its_peer_in_the_rule():
    for algorithm in ("ring", "recursive-doubling", "tree"):
        run = demo.run_demo(5, 8, algorithm)
        for _, group in run.steps:
            rule = demo_png.peer_rule(group, 5)
            sent = [(s.event.rank, s.send_to) for s in group if s.send_to >= 0]
            if "r → r+" in rule:
                shift = int(rule.split("+")[1].split()[0])
                assert all(to == (r + shift) % 5 for r, to in sent)
            elif "xor" not in rule:
                assert rule == ", ".join(f"{r}→{to}" for r, to in sorted(sent))
