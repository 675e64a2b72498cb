"""ring-demo --zero-stage 1, 2, 3: one step of ZeRO on small integers, against a serial step by
hand."""

from __future__ import annotations

import re

import numpy as np
import pytest

from syncsgd.apps.demo_core import ADDED
from syncsgd.apps.demo_zero import ABSENT, render_zero_text, run_zero_demo
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


def kept_rows(text: str, heading: str, name: str) -> dict[int, list]:
    """The '  rank k <name>: ...' rows of the part that starts with `heading` (ABSENT kept as
    is, brackets and an empty block's note dropped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    found = {}
    for line in lines[start:]:
        if re.match(r"^\d\. ", line):  # the next part
            break
        match = re.match(rf"^  rank (\d+) {name}: ?(.*?)(   block \d+ is empty.*)?$", line)
        if match:
            cells = re.sub(r"[\[\]]", " ", match[2]).split()
            found[int(match[1])] = [v if v == ABSENT else int(v) for v in cells]
    return found


def blocks_of(ranks: int, length: int) -> dict[int, tuple[int, int]]:
    """Rank r's block: (r + 1) mod P of numpy.array_split's."""
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(length), ranks)])
    return {r: (int(bounds[(r + 1) % ranks]), int(bounds[(r + 1) % ranks + 1]))
            for r in range(ranks)}  # fmt: skip


def only(block: tuple[int, int], values: list[int]) -> list:
    """`values` on `block`, ABSENT elsewhere."""
    return [v if block[0] <= i < block[1] else ABSENT for i, v in enumerate(values)]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ranks, length", SIZES)
def test_stages_2_and_3_keep_each_ranks_block_and_end_with_the_serial_step(stage, ranks, length):
    zero = run_zero_demo(ranks, length, stage)
    expected, total = by_hand(ranks, length)
    expected = expected.tolist()
    initial = [(i + 1) * 10**ranks for i in range(length)]
    mean = total // ranks
    own = blocks_of(ranks, length)
    assert zero.correct
    text = render_zero_text(zero)
    first = 1 if stage == 2 else 3  # stage 3 starts with θ's blocks and their allgather
    # each rank keeps its block of the sums, summed, and drops the rest; m on that block alone
    assert kept_rows(text, f"{first + 1}. reduce-scatter", "g") == {
        r: only(own[r], [total] * length) for r in range(ranks)}  # fmt: skip
    update = f"{first + 2}. divide by B = {ranks} and update"
    assert kept_rows(text, update, "m") == {r: only(own[r], [mean] * length) for r in range(ranks)}
    # the ring sends all blocks but one in each collective: 2n less two blocks per rank
    sizes = [hi - lo for lo, hi in sorted(own.values())]
    sent = [2 * length - sizes[(r + 1) % ranks] - sizes[(r + 2) % ranks] for r in range(ranks)]
    if ranks > 1:
        assert f"  {', '.join(map(str, sent))} elements (rank 0, 1, ...; the allreduce:" in text
    kept = ", ".join(str(own[r][1] - own[r][0]) for r in range(ranks))
    if stage == 2:
        assert kept_rows(text, update, "θ") == {
            r: [expected[i] if own[r][0] <= i < own[r][1] else initial[i] for i in range(length)]
            for r in range(ranks)}  # fmt: skip
        assert rows(text, "5. result") == {**{f"rank {r}": expected for r in range(ranks)},
                                           "serial": expected}  # fmt: skip
        assert f"saved: each rank keeps g and m of its block alone, 1/P: {kept} of {length} " \
               "elements each, and θ whole;" in text
        assert zero.fetched is None and len(zero.gathered.steps) == ranks - 1
        return
    # stage 3: θ's blocks at the start, gathered whole before the passes, the updated block kept
    assert zero.gathered is None and len(zero.fetched.steps) == ranks - 1
    assert kept_rows(text, "1. parameters", "θ") == {r: only(own[r], initial)
                                                     for r in range(ranks)}  # fmt: skip
    assert [final.tolist() for final in zero.fetched.final] == [initial] * ranks
    assert kept_rows(text, update, "θ") == {r: only(own[r], expected) for r in range(ranks)}
    assert kept_rows(text, "6. result", "θ") == kept_rows(text, update, "θ")
    result = text.split("6. result")[1]
    blocks_row = re.search(r"^  blocks *: ?(.*)$", result, re.M)[1].split()
    serial_row = re.search(r"^  serial *: ?(.*)$", result, re.M)[1].split()
    assert [int(v) for v in blocks_row] == [int(v) for v in serial_row] == expected
    assert "every rank's block equals the serial step's: together they are its parameters" in text
    assert f"saved: each rank keeps θ, g and m of its block alone, 1/P: {kept} of {length} " \
           "elements each;" in text


def test_stage_3_gathers_before_the_passes_and_keeps_no_allgather_after():
    text = render_zero_text(run_zero_demo(3, 7, 3))
    parts = [line for line in text.splitlines() if re.match(r"^\d\. ", line)]
    assert [part.split(":")[0] for part in parts] == [
        "1. parameters", "2. allgather", "3. local gradient sums", "4. reduce-scatter",
        "5. divide by B = 3 and update", "6. result"]  # fmt: skip
    assert parts[1].endswith("2 rounds on the parameters, before the forward pass")
    fetch = text.split("round 1 of 2: allgather 1 of 2\n")[1].split("\n\n")[0]
    assert "  rank 0  : [1000 2000 3000]4000 5000    ·    ·    -> rank 1: block 1 [3:5); " \
           "<- rank 2: block 0 [0:3) (copied)" in fetch
    assert "  rank 2 θ: [ 889 1889 2889]   ·    ·    ·    ·\n" in text
    assert "  10, 9, 9 elements (rank 0, 1, ...; the allreduce: 10, 9, 9)" in text
    assert "the passes' allgather and the reduce-scatter, none after the update" in text


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
    ("--zero-stage 3 --collective allgather", "drop --collective allgather"),
    ("--zero-stage 2 --algorithm rabenseifner", "drop --algorithm rabenseifner"),
    ("--zero-stage 3 --frames slides", "--frames: --zero-stage 3 is drawn on one slide (--png) "
     "or a page (--html), not as frames"),
    ("--zero-stage 2 --ranks 9 --png z.png", "--png draws 1 to 8 ranks on a slide, got --ranks 9"),
    ("--zero-stage 3 --ranks 17", "ring-demo shows 1 to 16 ranks, got 17"),
    ("--zero-stage 3 --length 65", "ring-demo shows 0 to 64 elements, got 65"),
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


def test_stage_4_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ring-demo", "--zero-stage", "4"])
    assert exit_.value.code == 2
    assert "argument --zero-stage: invalid choice: 4" in capsys.readouterr().err


def test_the_excerpts_in_sharded_md_are_what_it_prints():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "sharded.md").read_text()
    section = page.split("## See it")[1].split("\n## ")[0]
    fenced = re.findall(r"```(\w*)\n(.*?)\n```", section, re.S)  # (language, text), in order
    excerpts, stage = [], None
    for language, block in fenced:
        if language == "bash":  # the command the excerpts below it come from
            (command,) = block.splitlines()
            stage = None
            if command.startswith("syncsgd ring-demo"):
                assert command.endswith("--ranks 3 --length 7"), command
                stage = int(re.search(r"--zero-stage (\d)", command)[1])
        else:
            assert stage is not None, block
            excerpts.append((stage, block))
    assert sorted({stage for stage, _ in excerpts}) == [1, 2, 3] and len(excerpts) == 5
    for stage, block in excerpts:
        text = render_zero_text(run_zero_demo(3, 7, stage))
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


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ranks, length", [(1, 3), (3, 7), (8, 64)])
def test_the_slides_of_stages_2_and_3_are_legible(stage, ranks, length):
    pytest.importorskip("matplotlib")
    from syncsgd.apps import demo_png, demo_zero_png
    from syncsgd.util import figures

    zero = run_zero_demo(ranks, length, stage)
    canvas = demo_zero_png.zero_canvas(zero)
    assert demo_png.overflows(canvas) == []
    assert figures.legibility(canvas.figure) == []
    rows = demo_zero_png.zero_rows(zero)
    rounds = range(1, ranks)
    fetch = ["θ, own block", *(f"allgather {k}" for k in rounds)] if stage == 3 else []
    gather = [f"allgather {k}" for k in rounds] if stage == 2 else []
    assert [row.name for row in rows] == [*fetch, "gradient sums",
                                          *(f"reduce-scatter {k}" for k in rounds),
                                          "g, own block", "m, own block", "θ - lr·m", *gather]
    own = blocks_of(ranks, length)
    if stage == 2:
        assert all(cells == zero.serial.tolist() for cells in rows[-1].values)
    else:  # each rank's updated block, white elsewhere
        assert rows[-1].values == [only(own[r], zero.serial.tolist()) for r in range(ranks)]
        assert {demo_zero_png.cell_colour(zero, rows[-1], 0, i) for i in range(length)
                if not own[0][0] <= i < own[0][1]} <= {demo_zero_png.NONE}  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ranks, length", [(1, 2), (3, 7), (4, 2)])
def test_the_pages_of_stages_2_and_3(stage, ranks, length, tmp_path, capsys):
    import json

    from syncsgd.apps.demo_zero_html import zero_page
    from syncsgd.collectives.executor import sent_bytes

    zero = run_zero_demo(ranks, length, stage)
    page = zero_page(zero)
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>',
                                page, re.S)[1])  # fmt: skip
    frames = data["frames"]
    rounds = [f"round {k} of {2 * (ranks - 1)}" for k in range(1, 2 * ranks - 1)]
    if stage == 2:
        titles = ["start", *rounds[: ranks - 1], "kept", "update", *rounds[ranks - 1 :]]
    else:
        titles = ["start", *rounds[: ranks - 1], "the passes on θ whole", *rounds[ranks - 1 :],
                  "kept", "update"]  # fmt: skip
    assert [f["title"].split(":")[0] for f in frames] == titles
    own = blocks_of(ranks, length)
    kept = frames[titles.index("kept")]
    total = by_hand(ranks, length)[1]
    assert kept["buffers"] == [only(own[r], [total] * length) for r in range(ranks)]
    assert kept["counts"] == [[ranks if v != ABSENT else 0 for v in row] for row in kept["buffers"]]
    ring = [sent_bytes("ring", length, 8, ranks, r) for r in range(ranks)]
    assert frames[-1]["sent"] == ring  # both collectives together: the ring allreduce's bytes
    if stage == 2:
        assert frames[-1]["buffers"] == [zero.serial.tolist()] * ranks
    else:
        initial = zero.initial.tolist()
        assert frames[0]["buffers"] == [only(own[r], initial) for r in range(ranks)]
        assert frames[ranks - 1]["buffers"] == [initial] * ranks  # gathered whole
        assert frames[-1]["buffers"] == [only(own[r], zero.serial.tolist()) for r in range(ranks)]
        assert frames[-1]["counts"] == [[0 if v == ABSENT else ranks for v in row]
                                        for row in frames[-1]["buffers"]]  # fmt: skip
    path = tmp_path / "zero.html"
    argv = ["ring-demo", "--zero-stage", str(stage), "--ranks", str(ranks), "--length",
            str(length)]  # fmt: skip
    assert main([*argv, "--html", str(path)]) == 0
    assert path.read_text() == page and f"wrote {path}" in capsys.readouterr().out


def test_the_stage_3_page_shows_each_ranks_block_alone_in_chromium(tmp_path):
    from test_demo_html import CHROMIUM, Browser

    from syncsgd.apps.demo_zero_html import write_zero_html

    if CHROMIUM is None:
        pytest.skip("no chromium on PATH")
    path = tmp_path / "zero.html"
    write_zero_html(run_zero_demo(3, 7, 3), str(path))
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{path.as_uri()}#step=0")
        cells = browser.value("[...document.querySelectorAll('#rank-0 td.value')]"
                              ".map(c => c.textContent + '|' + c.title).join(',')")  # fmt: skip
    finally:
        browser.close()
    assert cells.split(",") == ["·|not kept here"] * 3 + ["4000|the old parameter",
                                                          "5000|the old parameter"] \
        + ["·|not kept here"] * 2
