"""ring-demo --zero-stage 1: one ZeRO-1 step on small integers, against a serial step by hand."""

from __future__ import annotations

import re

import numpy as np
import pytest

from syncsgd.apps.demo_core import ADDED
from syncsgd.apps.demo_zero import render_zero_text, run_zero_demo
from syncsgd.cli import main
from syncsgd.collectives import chunk_bounds

pytestmark = pytest.mark.timeout(120)

SIZES = [(1, 3), (2, 5), (3, 7), (4, 2), (5, 3), (5, 11), (6, 10), (3, 0)]


def by_hand(ranks: int, length: int) -> tuple[np.ndarray, int]:
    """The serial step: every rank's gradient sum B·10**r added, divided by B = P, momentum 0.9
    on m = 0, lr = 1, from θ_i = (i + 1)·10**P. (Also the sum every owned block must hold.)"""
    total = sum(ranks * 10**r for r in range(ranks))  # 33...3: P threes
    mean = total // ranks  # 11...1
    theta = np.array([(i + 1) * 10**ranks for i in range(length)], dtype=np.int64)
    return theta - 1 * (0 + mean), total


def rows(text: str, heading: str) -> dict[str, list[int]]:
    """The '  rank k  : ...' rows (and 'serial') right after the line that starts `heading`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    found = {}
    for line in lines[start:]:
        match = re.match(r"^  (rank \d+|serial) *: ?(.*)$", line)
        if not match:
            break
        found[match[1]] = [int(v) for v in match[2].split()]
    return found


@pytest.mark.parametrize("ranks, length", SIZES)
def test_every_rank_ends_with_the_serial_step(ranks, length):
    zero = run_zero_demo(ranks, length)
    expected, total = by_hand(ranks, length)
    assert zero.correct
    bounds = chunk_bounds(length, ranks)
    for rank, scattered in enumerate(zero.scattered.final):  # its block (r + 1) mod P, summed
        block = (rank + 1) % ranks
        assert np.all(scattered[bounds[block] : bounds[block + 1]] == total)
    for final in zero.gathered.final:
        assert final.tolist() == expected.tolist()
    assert len(zero.scattered.steps) == len(zero.gathered.steps) == ranks - 1
    # the optimizer state: each rank's block alone, the blocks together every parameter once
    assert sorted(m.size for m in zero.momentum) == sorted(np.diff(bounds).tolist())
    text = render_zero_text(zero)
    result = rows(text, "5. result")
    assert result == {**{f"rank {r}": expected.tolist() for r in range(ranks)},
                      "serial": expected.tolist()}  # fmt: skip
    assert "every rank holds the same parameters, equal to the serial step" in text
    assert rows(text, "1. local gradient sums") == {
        f"rank {r}": [ranks * 10**r] * length for r in range(ranks)}  # fmt: skip


def test_the_text_marks_each_ranks_block_and_its_state():
    text = render_zero_text(run_zero_demo(3, 7))
    assert "  rank 0: block 1; rank 1: block 2; rank 2: block 0" in text
    assert "blocks (as numpy.array_split): 0 = [0:3)  1 = [3:5)  2 = [5:7)" in text
    # part 3: m only on the owned block, in brackets; the parameters updated there only
    assert "  on its block each rank: g/B = 333/3 = 111; m = 0.9·0 + 111; θ = θ - 1·111" in text
    assert "  rank 0 m:     ·    ·    ·[ 111  111]   ·    ·\n" in text
    assert "  rank 2 θ: [ 889 1889 2889]4000 5000 6000 7000" in text
    # the last reduce-scatter round leaves 333 in each rank's own block
    last = text.split("round 2 of 2: reduce-scatter 2 of 2\n")[1].split("\n\n")[0]
    assert "  rank 0  :     3    3    3[ 333  333] 303  303" in last
    assert "  rank 2  : [ 333  333  333] 330  330  300  300" in last
    assert "sent: each rank about 2(P-1)/P = 4/3 times the buffer's 7 elements" in text
    assert "  10, 9, 9 elements (rank 0, 1, ...; the allreduce: 10, 9, 9)" in text
    assert "1/P: 2, 2, 3 of 7 elements" in text


def test_fewer_parameters_than_ranks_leave_ranks_without_state():
    text = render_zero_text(run_zero_demo(4, 2))
    assert "  rank 1 m:      ·     ·    block 2 is empty: no parameters, no optimizer state" in text
    assert "1/P: 1, 0, 0, 1 of 2 elements" in text


def test_colour_instead_of_brackets():
    text = render_zero_text(run_zero_demo(2, 4), color=True)
    update = text.split("3. divide")[1].split("4. allgather")[0]
    assert update.count(ADDED) == 8  # two elements of m and of θ on each of the two ranks
    plain = re.sub(r"\x1b\[[0-9;]*m|\[\d+:\d+\)", "", update)  # no colour, no [a:b) ranges
    assert "[" not in plain and "]" not in plain


def test_the_command_prints_the_step_and_stage_0_is_the_allreduce(capsys):
    assert main(["ring-demo", "--zero-stage", "1", "--ranks", "2", "--length", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ZeRO stage 1: one training step of 3 parameters on 2 thread ranks")
    assert main(["ring-demo", "--zero-stage", "0", "--ranks", "2", "--length", "3"]) == 0
    assert capsys.readouterr().out.startswith("ring allreduce of 3 int64 elements")


@pytest.mark.parametrize("argv, line", [
    ("--zero-stage 1 --collective reduce-scatter", "drop --collective reduce-scatter"),
    ("--zero-stage 1 --collective broadcast --root 1", "drop --collective broadcast"),
    ("--zero-stage 1 --algorithm tree", "drop --algorithm tree"),
    ("--zero-stage 1 --frames slides", "--frames: --zero-stage 1 is drawn on one slide (--png) "
     "or a page (--html), not as frames"),
    ("--zero-stage 1 --ranks 9 --png z.png", "--png draws 1 to 8 ranks on a slide, got --ranks 9"),
])  # fmt: skip
def test_refusals_are_one_line_and_write_nothing(argv, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["ring-demo", *argv.split()]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and line in captured.err
    assert list(tmp_path.iterdir()) == []


def test_stage_2_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ring-demo", "--zero-stage", "2"])
    assert exit_.value.code == 2
    assert "argument --zero-stage: invalid choice: 2" in capsys.readouterr().err


def test_the_excerpts_in_sharded_md_are_what_it_prints():
    from pathlib import Path

    text = render_zero_text(run_zero_demo(3, 7))
    page = (Path(__file__).parent.parent / "docs" / "sharded.md").read_text()
    section = page.split("## See it")[1].split("\n## ")[0]
    fenced = re.findall(r"```(\w*)\n(.*?)\n```", section, re.S)  # (language, text), in order
    blocks = [block for language, block in fenced if not language]
    assert len(blocks) == 2
    for block in blocks:
        assert f"\n{block}\n" in f"\n{text}\n", block


@pytest.mark.parametrize("ranks, length", [(1, 3), (3, 4), (3, 7), (4, 0), (6, 10), (8, 64)])
def test_the_slide_is_legible_and_every_label_fits(ranks, length):
    pytest.importorskip("matplotlib")
    from syncsgd.apps import demo_png, demo_zero_png
    from syncsgd.util import figures

    zero = run_zero_demo(ranks, length)
    canvas = demo_zero_png.zero_canvas(zero)
    assert demo_png.overflows(canvas) == []
    assert figures.legibility(canvas.figure) == []
    rows = demo_zero_png.zero_rows(zero)
    rounds = range(1, ranks)
    assert [row.name for row in rows] == (["gradient sums"]
                                          + [f"reduce-scatter {k}" for k in rounds]
                                          + ["m, own block", "θ - lr·m"]
                                          + [f"allgather {k}" for k in rounds])  # fmt: skip
    assert all(cells == zero.serial.tolist() for cells in rows[-1].values)


def test_the_slide_writes_numbers_where_they_fit(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from syncsgd.apps import demo_zero_png

    zero = run_zero_demo(3, 4)
    place = demo_zero_png.layout(zero, demo_zero_png.zero_rows(zero))
    assert place.numbers and place.peers
    texts = [text.get_text() for text in demo_zero_png.zero_canvas(zero).axes.texts]
    assert any("2889" in text for text in texts) and "rank 0: block 1" in texts
    path = tmp_path / "zero.png"
    assert main(["ring-demo", "--zero-stage", "1", "--ranks", "3", "--length", "4",
                 "--png", str(path)]) == 0  # fmt: skip
    assert path.read_bytes().startswith(b"\x89PNG") and f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("ranks, length", [(1, 2), (3, 7), (4, 2), (5, 11)])
def test_the_page_steps_through_the_halves_and_the_update(ranks, length, tmp_path, capsys):
    import json

    from syncsgd.apps.demo_zero_html import zero_page
    from syncsgd.collectives.executor import sent_bytes

    zero = run_zero_demo(ranks, length)
    page = zero_page(zero)
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>',
                                page, re.S)[1])  # fmt: skip
    frames = data["frames"]
    assert len(frames) == 1 + (ranks - 1) + 1 + (ranks - 1)
    assert [f["title"].split(":")[0] for f in frames] == (
        ["start"] + [f"round {k} of {2 * (ranks - 1)}" for k in range(1, ranks)] + ["update"]
        + [f"round {k} of {2 * (ranks - 1)}" for k in range(ranks, 2 * ranks - 1)])  # fmt: skip
    update = frames[ranks]
    assert update["received"] == [[*zero.owned(r), True] if zero.owned(r)[1] > zero.owned(r)[0]
                                  else None for r in range(ranks)]  # fmt: skip
    assert frames[-1]["buffers"] == [zero.serial.tolist()] * ranks
    assert frames[-1]["counts"] == [[ranks] * length] * ranks  # every parameter updated
    assert frames[-1]["sent"] == [sent_bytes("ring", length, 8, ranks, r, stepped=True)
                                  for r in range(ranks)]  # fmt: skip
    path = tmp_path / "zero.html"
    argv = ["ring-demo", "--zero-stage", "1", "--ranks", str(ranks), "--length", str(length)]
    assert main([*argv, "--html", str(path)]) == 0
    assert path.read_text() == page and f"wrote {path}" in capsys.readouterr().out


def test_the_page_shows_the_update_step_in_chromium(tmp_path):
    from test_demo_html import CHROMIUM, Browser, rank_rows

    from syncsgd.apps.demo_zero_html import write_zero_html, zero_frames

    if CHROMIUM is None:
        pytest.skip("no chromium on PATH")
    zero = run_zero_demo(3, 7)
    path = tmp_path / "zero.html"
    write_zero_html(zero, str(path))
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{path.as_uri()}#step=3")
        dom = browser.value("document.documentElement.outerHTML")
        title = browser.value("document.getElementById('title').textContent")
        tip = browser.value("document.querySelector('#rank-2 td.value').title")
    finally:
        browser.close()
    assert rank_rows(dom) == dict(enumerate(zero_frames(zero)[3]["buffers"]))
    assert title.startswith("update: each rank its own block") and tip == "updated"
    assert dom.count('class="value received-added"') == 7  # each rank's own block: 2 + 2 + 3
