"""ring-demo --collective: broadcast, reduce, allgather, reduce-scatter, alltoall round by round."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from syncsgd.apps import demo
from syncsgd.apps.costmodel_parts import part_cost
from syncsgd.apps.demo_core import render_text
from syncsgd.apps.demo_parts import SHOWN, run_collective_demo
from syncsgd.collectives import COLLECTIVES, chunk_bounds

pytestmark = pytest.mark.timeout(120)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="syncsgd ring-demo")
    demo.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("ranks, length", [(1, 3), (3, 7), (4, 2), (5, 0), (6, 13)])
def test_every_collective_and_algorithm_ends_as_expected(ranks, length):
    for collective in SHOWN:
        for algorithm in COLLECTIVES[collective]:
            root = ranks - 1
            size = length - length % ranks if collective == "alltoall" else length  # P blocks
            shown = run_collective_demo(collective, ranks, size, algorithm, root)
            assert shown.correct, (collective, algorithm)
            assert len(shown.steps) == part_cost(collective, algorithm, ranks).a
            text = render_text(shown)
            assert text.endswith(f"{algorithm} {collective} result: as expected on every rank")
            assert f"`syncsgd model`'s {len(shown.steps)}α" in text or ranks == 1


def test_the_results_are_the_closed_forms():
    ranks, length = 4, 8
    everyone = np.full(length, 1111)
    bounds = chunk_bounds(length, ranks)
    reduced = run_collective_demo("reduce", ranks, length, "ring", root=2)
    assert np.array_equal(reduced.final[2], everyone)
    scattered = run_collective_demo("reduce-scatter", ranks, length, "recursive-halving")
    for rank, final in enumerate(scattered.final):
        assert np.all(final[bounds[rank] : bounds[rank + 1]] == 1111)
    gathered = run_collective_demo("allgather", ranks, length, "ring")
    assert all(np.array_equal(f, np.repeat([1, 10, 100, 1000], 2)) for f in gathered.final)
    sent = run_collective_demo("broadcast", ranks, length, "binomial", root=3)
    assert all(np.all(f == 1000) for f in sent.final)


def test_alltoall_shows_the_blocks_sent_and_received(capsys):
    shown = run_collective_demo("alltoall", 3, 6, "pairwise")
    assert shown.length == 12 and shown.correct  # 3 blocks sent, 3 received, 2 elements each
    for rank, final in enumerate(shown.final):
        assert final.tolist() == [10**rank] * 6 + [1, 1, 10, 10, 100, 100]
    text = render_text(shown)
    assert "round 1 of 2: alltoall 1 of 2" in text and "round 2 of 2: alltoall 2 of 2" in text
    assert "-> rank 1: block 1 [2:4); <- rank 2: block 5 [10:12) (copied)" in text
    assert demo.main(parse("--collective", "alltoall", "--ranks", "2", "--length", "4")) == 0
    assert "pairwise alltoall of 8 int64 elements over 2 thread ranks" in capsys.readouterr().out
    with pytest.raises(ValueError, match="a --length that is a multiple of 3"):
        demo.main(parse("--collective", "alltoall", "--ranks", "3", "--length", "7"))


def test_a_wrong_result_is_reported():
    shown = run_collective_demo("reduce-scatter", 3, 6, "ring")
    wrong = shown._replace(final=[np.zeros(6, np.int64)] * 3)
    assert not wrong.correct
    assert render_text(wrong).endswith("WRONG: not as expected")


def test_the_command_line_text_png_and_html(tmp_path, capsys):
    png, page = tmp_path / "reduce.png", tmp_path / "reduce.html"
    assert demo.main(parse("--collective", "reduce", "--algorithm", "binomial", "--root", "1",
                           "--ranks", "3", "--length", "4", "--png", str(png), "--html",
                           str(page))) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("binomial reduce to rank 1 of 4 int64 elements over 3 thread ranks")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "binomial reduce to rank 1 on 3 ranks" in page.read_text()


@pytest.mark.parametrize(
    "argv, words",
    [
        (("--collective", "reduce", "--algorithm", "tree"), "no reduce algorithm 'tree'"),
        (("--collective", "broadcast", "--root", "4"), "--root 4 is not one of the 4 ranks"),
    ],
)
def test_bad_input_is_one_line(argv, words, capsys):
    from syncsgd.cli import main

    assert main(["ring-demo", *argv]) != 0
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
