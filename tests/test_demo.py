"""`syncsgd ring-demo`: every round printed against a naive ring, plain and colour, the figures."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from syncsgd import collectives
from syncsgd.apps import demo, demo_png
from syncsgd.apps.costmodel import ALGORITHMS, cost
from syncsgd.collectives import chunk_bounds

pytestmark = pytest.mark.timeout(120)

ROW = re.compile(r"^  rank (\d+) *: (.*?)(?:   (->.*|<-.*|\(idle\)))?$")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="syncsgd ring-demo")
    demo.add_arguments(parser)
    return parser.parse_args(argv)


def naive_ring_states(ranks: int, length: int) -> list[list[np.ndarray]]:
    """Every rank's buffer after each of the 2(P-1) steps of reduce-scatter then allgather."""
    buffers = [np.full(length, 10**r, dtype=np.int64) for r in range(ranks)]
    bounds = chunk_bounds(length, ranks)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(ranks)]
    states = []
    for step in range(ranks - 1):  # reduce-scatter: add chunk (r - s - 1) from the left
        before = [b.copy() for b in buffers]
        for r in range(ranks):
            c = chunk[(r - step - 1) % ranks]
            buffers[r][c] = before[r][c] + before[(r - 1) % ranks][c]
        states.append([b.copy() for b in buffers])
    for step in range(ranks - 1):  # allgather: copy chunk (r - s) from the left
        before = [b.copy() for b in buffers]
        for r in range(ranks):
            c = chunk[(r - step) % ranks]
            buffers[r][c] = before[(r - 1) % ranks][c]
        states.append([b.copy() for b in buffers])
    return states


def blocks(text: str) -> dict[str, list[str]]:
    """The output's blank-line separated blocks, by their first line."""
    found = {}
    for block in text.split("\n\n"):
        lines = block.splitlines()
        found[lines[0]] = lines[1:]
    return found


def test_every_step_of_p3_n7_matches_a_naive_ring(capsys):
    assert demo.main(parse("--ranks", "3", "--length", "7", "--color", "never")) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    steps = blocks(out)
    names = [f"round {s} of 4: reduce-scatter {s} of 2" for s in (1, 2)]
    names += [f"round {s + 2} of 4: allgather {s} of 2" for s in (1, 2)]
    assert [name for name in steps if name.startswith("round")] == names
    bounds = chunk_bounds(7, 3)
    for number, (name, state) in enumerate(zip(names, naive_ring_states(3, 7), strict=True)):
        rows = steps[name]
        assert len(rows) == 3
        step = number % 2
        for rank, line in enumerate(rows):
            match = ROW.match(line)
            assert match and int(match[1]) == rank, line
            cells = match[2]
            values = [int(v) for v in re.findall(r"\d+", cells)]
            assert values == state[rank].tolist(), (name, rank, line)
            # the bracketed range is the chunk just received
            received = (rank - step - 1) % 3 if number < 2 else (rank - step) % 3
            sent = (rank - step) % 3 if number < 2 else (rank + 1 - step) % 3
            inside = re.search(r"\[(.*)\]", cells)[1]
            expected = state[rank][bounds[received] : bounds[received + 1]].tolist()
            assert [int(v) for v in inside.split()] == expected
            verb = "added" if number < 2 else "copied"
            span = [f"[{bounds[c]}:{bounds[c + 1]})" for c in (sent, received)]
            assert match[3] == (
                f"-> rank {(rank + 1) % 3}: chunk {sent} {span[0]}; "
                f"<- rank {(rank - 1) % 3}: chunk {received} {span[1]} ({verb})"
            )
    assert [line.split(":")[1].split() for line in steps["result"][:3]] == [["111"] * 7] * 3
    assert steps["result"][3].split(":")[1].split() == ["111"] * 7  # the NumPy line
    assert steps["result"][4] == "ring allreduce result: equal to the NumPy sum on every rank"


def test_colour_marks_with_escape_codes_and_no_brackets(capsys):
    assert demo.main(parse("--ranks", "3", "--length", "7", "--color", "always")) == 0
    out = capsys.readouterr().out
    assert demo.ADDED in out and demo.COPIED in out and demo.RESET in out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    ranges = re.compile(r"\[\d+:\d+\)")  # the ranges named after the buffers
    assert "[" not in ranges.sub("", plain.split("\nstart\n")[1])  # colours replace brackets
    assert "round 2 of 4: reduce-scatter 2 of 2" in plain and "111 111 111 111 111 111 111" in plain


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_colour_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert demo.use_color("auto", FakeTerminal())
    assert not demo.use_color("auto", io.StringIO())
    assert demo.use_color("always", io.StringIO()) and not demo.use_color("never", FakeTerminal())
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # Open MPI gives ranks a pseudo-terminal
    assert not demo.use_color("auto", FakeTerminal())
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("NO_COLOR", "1")
    assert not demo.use_color("auto", FakeTerminal())


def test_png_is_written(tmp_path, capsys):
    path = tmp_path / "ring.png"
    assert demo.main(parse("--ranks", "3", "--length", "7", "--png", str(path))) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.endswith(f"wrote {path}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["ring.png"]  # no temporary file left


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    run = demo.run_demo(2, 3)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[plot\]'"):
        demo_png.draw_png(run, str(tmp_path / "x.png"))


def without_matplotlib(tmp_path, *argv: str, code: str = "") -> subprocess.CompletedProcess:
    """`syncsgd ring-demo ARGV` (or the Python `code`) in a process where matplotlib cannot be
    imported, as without the plot extra, in `tmp_path`."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(demo.__file__))))
    path = os.pathsep.join([str(blocker), root])  # the package under test, matplotlib blocked
    command = ["-c", code] if code else ["-m", "syncsgd.cli", "ring-demo", *argv]
    return subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": path})  # fmt: skip


@pytest.mark.parametrize("argv", [("--frames", "slides"), ("--png", "r.png"),
                                  ("--png", "r.svg", "--html", "r.html")])  # fmt: skip
def test_without_the_plot_extra_figures_are_one_line_before_any_work(tmp_path, argv):
    done = without_matplotlib(tmp_path, *argv)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "needs matplotlib: install the plot extra, pip install -e '.[plot]'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]  # nothing written


def test_frame_workers_without_matplotlib_end_with_the_line(tmp_path):
    # A pool whose workers' start fails restarts them for ever: the error must reach the command.
    code = ("from syncsgd.apps import demo, demo_png\n"
            "demo_png._WORKER.clear()\n"
            "demo_png._write_all(demo.run_demo(3, 4), [f'f{i}.png' for i in range(5)])\n")
    done = without_matplotlib(tmp_path, code=code)
    assert done.returncode == 1
    assert "RuntimeError: --frames needs matplotlib: install the plot extra" in done.stderr
    assert not list(tmp_path.glob("f*.png"))


@pytest.mark.parametrize(("ranks", "length", "algorithm"),
                         [(8, 10, "ring"), (16, 16, "ring"), (8, 12, "rabenseifner"),
                          (16, 8, "tree"), (16, 16, "recursive-doubling")])  # fmt: skip
def test_no_text_overflows_its_box_at_p8_and_p16(ranks, length, algorithm):
    run = demo.run_demo(ranks, length, algorithm)
    assert demo_png.overflows(demo_png.grid_canvas(run)) == []
    for row in (0, 1, len(run.steps) // 2, len(run.steps)):
        assert demo_png.overflows(demo_png.frame_canvas(run, row)) == [], row


def test_frames_never_take_a_cell_colour():
    for ranks in (4, 10, 16):
        colours = [demo_png.count_colour(c, ranks) for c in range(ranks + 1)]
        assert (0.0, 0.0, 0.0) not in colours and len(set(colours)) == ranks + 1
    assert demo_png.FRAME == "black"


def test_frames_writes_one_png_per_round(tmp_path, capsys):
    directory = tmp_path / "frames"
    argv = ("--ranks", "4", "--length", "8", "--frames", str(directory))
    assert demo.main(parse(*argv)) == 0
    names = sorted(p.name for p in directory.iterdir())
    assert names == [f"step-{k:03d}.png" for k in range(7)]  # the start and 2(P-1) rounds
    assert all((directory / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    assert "wrote 7 frames" in capsys.readouterr().out


def test_frames_of_a_longer_earlier_run_are_removed_and_nothing_else(tmp_path, capsys):
    directory = tmp_path / "frames"
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")
    (directory / "step-01.png").write_text("not one of ours: two digits")
    (directory / "step-099.png").write_text("not a PNG: not one of ours")
    assert demo.main(parse("--ranks", "4", "--length", "4", "--frames", str(directory))) == 0
    assert demo.main(parse("--ranks", "2", "--length", "4", "--frames", str(directory))) == 0
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["notes.txt", "step-000.png", "step-001.png", "step-002.png", "step-01.png",
                     "step-099.png"]  # fmt: skip
    assert "wrote 3 frames" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize(("ranks", "length"), [(1, 3), (2, 0), (4, 2), (5, 13), (11, 4)])
def test_small_and_odd_shapes(ranks, length):
    run = demo.run_demo(ranks, length)
    assert run.correct
    assert len(run.steps) == 2 * (ranks - 1)
    text = demo.render_text(run)
    assert "equal to the NumPy sum on every rank" in text
    if 1 < length < ranks:
        assert "(empty)" in text  # a chunk with no elements still travels


def collective_names() -> list[str]:
    return [name for name in collectives.ALGORITHMS if name != "mpi"]


@pytest.mark.parametrize("ranks", [2, 3, 5, 8])
def test_every_algorithm_counts_each_rank_once(ranks):
    for algorithm in collective_names():
        run = demo.run_demo(ranks, 7, algorithm)
        assert run.correct, algorithm
        assert run.expected.tolist() == [int("1" * ranks)] * 7
        for _, group in run.steps:
            for snapshot in group:
                # each digit says whether a rank is in the partial sum: never 2 or more
                assert set("".join(map(str, snapshot.buffer.tolist()))) <= {"0", "1"}
        text = demo.render_text(run)
        assert f"{run.algorithm} allreduce result: equal to the NumPy sum" in text


def test_tree_rounds_name_the_peers_one_message_at_a_time():
    text = demo.render_text(demo.run_demo(3, 2, "tree"))
    assert blocks(text)["round 1 of 4: reduce 1 of 2"] == [
        "  rank 0: [ 11  11]   <- rank 1: the buffer (added)",
        "  rank 1:   10  10    -> rank 0: the buffer",
        "  rank 2:  100 100    (idle)",
    ]
    assert blocks(text)["round 2 of 4: reduce 2 of 2"] == [
        "  rank 0: [111 111]   <- rank 2: the buffer (added)",
        "  rank 1:   10  10    (idle)",
        "  rank 2:  100 100    -> rank 0: the buffer",
    ]
    assert "4 rounds, each rank sending and receiving at most one message in each: " in text
    assert "`syncsgd model`'s 4α" in text


def test_no_two_rounds_have_the_same_title():
    # The tree's reduce took two rounds per level, both titled "reduce 1 of 2".
    from syncsgd.apps.demo_parts import run_collective_demo

    for ranks in (2, 3, 4, 5, 6, 7, 9):
        runs = [demo.run_demo(ranks, 4, name) for name in collective_names()]
        runs += [run_collective_demo(name, ranks, 4, algorithm)
                 for name, algorithms in collectives.COLLECTIVES.items() if name != "alltoall"
                 for algorithm in algorithms]  # fmt: skip
        for run in runs:
            titles = [title for title, _ in run.steps]
            assert len(set(titles)) == len(titles), (run.what, ranks, titles)
    tree = [title for title, _ in demo.run_demo(6, 4, "tree").steps]
    assert tree == [*(f"reduce {k} of 4" for k in range(1, 5)),
                    *(f"broadcast {k} of 3" for k in range(1, 4))]  # fmt: skip


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_rounds_are_the_alpha_terms_of_the_cost_model(algorithm):
    for ranks in range(1, 17):
        schedules = [collectives.schedule(algorithm, 10, ranks, r) for r in range(ranks)]
        rounds = demo.schedule_rounds(schedules)
        count = max((numbers[-1] + 1 for numbers in rounds if numbers), default=0)
        assert count == cost(algorithm, ranks).a, ranks
        for numbers in rounds:  # a rank takes its steps in order, one per round
            assert numbers == sorted(set(numbers))


def test_rabenseifner_names_the_range_of_chunks_that_moves():
    text = demo.render_text(demo.run_demo(4, 6, "rabenseifner"))
    first = blocks(text)["round 1 of 4: reduce-scatter 1 of 2"]
    # chunks of 6 elements over p' = 4: [0:2) [2:4) [4:5) [5:6)
    assert first[0].endswith("-> rank 1: chunks 2-3 [4:6); <- rank 1: chunks 0-1 [0:4) (added)")
    second = blocks(text)["round 2 of 4: reduce-scatter 2 of 2"]
    assert second[0].endswith("-> rank 2: chunk 1 [2:4); <- rank 2: chunk 0 [0:2) (added)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "17"], "1 to 16 ranks"),
        (["--length", "65"], "0 to 64 elements"),
        (["--png", "/nonexistent-dir/ring.png"], "does not exist"),
        (["--root", "1"], "--root: allreduce has no root (broadcast and reduce have one)"),
        (["--collective", "allgather", "--root", "0"], "--root: allgather has no root"),
        (["--html", "r.png"], "--html r.png: the page is HTML, so its name must end in .html"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        demo.main(parse(*argv))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ranks", "0"], "error"), (["--length", "-1"], "error"),
     (["--color", "sometimes"], "error"),
     (["--algorithm", "butterfly"], "unknown algorithm 'butterfly'"),
     (["--algorithm", "mpi"], "no steps to show")],
)  # fmt: skip
def test_bad_options_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err
