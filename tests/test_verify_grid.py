"""`syncsgd verify` over a grid: every combination in the JSON, the report's page and figure."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from test_demo_html import Browser, needs_chromium

from syncsgd.cli import main

pytestmark = pytest.mark.timeout(300)

TINY = ["--samples", "40", "--features", "4", "--hidden", "5", "--batch-size", "10",
        "--steps", "2", "--seed", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One small grid: its exit status, JSON, page and PNG."""
    where = tmp_path_factory.mktemp("grid")
    paths = {kind: where / f"r.{kind}" for kind in ("json", "html", "png")}
    status = main(["verify", "--ranks", "1,2", "--algorithms", "ring,tree", "--modes",
                   "float,exact", "--accumulates", "1,4", *TINY, "--json", str(paths["json"]),
                   "--report", str(paths["html"]), "--png", str(paths["png"])])  # fmt: skip
    return status, json.loads(paths["json"].read_text()), paths


def test_every_combination_is_a_run_and_exact_cells_are_bitwise(report):
    status, document, _ = report
    assert status == 0
    runs = document["runs"]
    keys = {(r["ranks"], r["algorithm"], r["mode"], r["accumulate"]) for r in runs}
    assert keys == set(itertools.product([1, 2], ["ring", "tree"], ["float", "exact"], [1, 4]))
    assert len(runs) == 16
    for run in runs:
        assert set(run) >= {"ranks", "algorithm", "precision", "mode", "accumulate", "optimizer",
                            "bitwise", "max_ulp", "rel_diff", "sha256", "first_diff_step",
                            "first_diff_param"}  # fmt: skip
        assert run["precision"] == "fp32" and run["optimizer"] == "sgd"
        if run["mode"] == "exact" or run["ranks"] == 1 and run["accumulate"] == 1:
            assert run["bitwise"] and run["first_diff_step"] is None
        if not run["bitwise"]:
            assert run["first_diff_step"] >= 1 and run["first_diff_param"] in ("W0", "b0", "W1",
                                                                              "b1")  # fmt: skip
    exact = {r["sha256"] for r in runs if r["mode"] == "exact"}
    assert len(exact) == 1  # one state for every P, K and algorithm
    assert document["versions"]["numpy"] and document["machine"]["cores"] >= 1
    assert document["command"].startswith("syncsgd verify --ranks 1,2")


def test_the_page_holds_the_json_and_the_figure_is_a_png(report):
    _, document, paths = report
    page = paths["html"].read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing fetched
    embedded = re.search(r'<script id="data" type="application/json">(.*?)</script>', page,
                         re.DOTALL)[1]  # fmt: skip
    assert json.loads(embedded.replace("<\\/", "</"))["runs"] == document["runs"]
    assert "viridis" in page and "colour-vision" in page
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def cells(dom: str) -> list[dict]:
    """The heatmap's cells as the browser holds them."""
    found = re.findall(r'<td class="cell[^"]*"[^>]*data-ranks="(\d+)" data-config="([^"]*)" '
                       r'data-rel="([^"]*)" data-ulp="(\d+)" data-bitwise="(\w+)">(.*?)</td>',
                       dom)  # fmt: skip
    return [{"ranks": int(r), "config": c, "rel": float(rel), "ulp": int(u),
             "bitwise": b == "true", "text": t} for r, c, rel, u, b, t in found]  # fmt: skip


@needs_chromium
def test_the_page_renders_in_chromium_with_the_json_numbers(report, tmp_path):
    from syncsgd.apps.verify_grid import label

    _, document, paths = report
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(paths["html"].as_uri(), 1000, 900, ready="document.readyState === 'complete'")
        dom = browser.value("document.documentElement.outerHTML")
        shot = browser.screenshot()
    finally:
        browser.close()
    shown = {(cell["config"], cell["ranks"]): cell for cell in cells(dom)}
    assert len(shown) == len(document["runs"])
    for run in document["runs"]:
        cell = shown[(label(run), run["ranks"])]
        assert cell["rel"] == run["rel_diff"] and cell["ulp"] == run["max_ulp"]
        assert cell["bitwise"] == run["bitwise"]
        assert ("bitwise" if run["bitwise"] else f"{run['rel_diff']:.2e}") in cell["text"]
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000


def test_a_run_that_should_match_and_does_not_exits_1(tmp_path, capsys):
    path = tmp_path / "r.json"
    status = main(["verify", "--ranks", "2", "--exact", "--accumulates", "3,4",
                   "--pitfall", "accumulate-means", *TINY, "--batch-size", "30",
                   "--json", str(path)])  # fmt: skip
    assert status == 1
    runs = {run["accumulate"]: run for run in json.loads(path.read_text())["runs"]}
    assert runs[3]["bitwise"] and runs[3]["matches"]  # even micro-batches: weighed alike
    assert not runs[4]["matches"] and runs[4]["first_diff_step"] == 1
    assert "MISMATCH: 1 of 2 runs" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--algorithms", "ring,bogus"], "'bogus' is not one of"),
    (["--report", "/nonexistent/r.html"], "cannot write /nonexistent/r.html"),
    (["--precision", "bf16", "--loss-scale", "8", "--precisions", "bf16,fp32"],
     "ring fp32 float K=1 sgd: --loss-scale"),
    (["--modes", "exact", "--pitfall", "all"], "--pitfall all is a table of its own"),
])  # fmt: skip
def test_bad_grid_options_are_one_line_before_any_run(args, says, capsys):
    try:
        status = main(["verify", *TINY, *args])
    except SystemExit as exc:  # argparse's refusal
        status = exc.code
    out, err = capsys.readouterr()
    assert status != 0 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert "P  max" not in out  # no table started


def test_a_pitfall_is_checked_with_the_grids_first_configuration(capsys):
    # local-trust-ratio needs lamb or lars: the grid's list gives them, not --optimizer
    status = main(["verify", "--ranks", "2", "--optimizers", "lars,lamb", "--pitfall",
                   "local-trust-ratio", *TINY])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 1 and err == "" and "K=1 lars" in out and "K=1 lamb" in out, err


def test_bf16_is_judged_by_its_own_tolerance_and_a_real_mismatch_in_it_still_fails(capsys):
    # bf16 float mode moves by about 1e-3 with P (each rank rounds its own sums): within
    # u sqrt(T) / 4; a shuffle the ranks do not agree on moves by about 1e-2: beyond it
    assert main(["verify", "--ranks", "1,2,3", "--precisions", "fp32,bf16", "--steps",
                 "20"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "float mode: tolerance 0.00437 (bf16: u sqrt(T) / 4, u\n# = 2^-8, T = 20" in out, out
    assert "float mode: tolerance 1e-09 (float64)" in out
    assert main(["verify", "--ranks", "2", "--precision", "bf16", "--pitfall", "unsynced-shuffle",
                 "--steps", "20"]) == 1  # fmt: skip
    assert "MISMATCH: P = 2 differ" in capsys.readouterr().out


def test_the_figure_is_a_legible_slide(report):
    from syncsgd.apps import verify_report
    from syncsgd.util import figures

    figure = verify_report.heatmap_figure(report[1])
    assert figures.slide_scale(figure) == pytest.approx(1.0, abs=1e-3)
    assert figures.legibility(figure) == []


def test_the_grid_estimates_its_time_left_after_its_first_configuration(capsys):
    assert main(["verify", "--ranks", "2", "--optimizers", "sgd,adam,adamw", *TINY]) == 0
    out = capsys.readouterr().out
    words = (r"# about (\d+(\.\d)?) s left: 2 more configuration\(s\), if each takes as long as "
             r"the first did \((\d+(\.\d)?) s with its serial run\)")  # fmt: skip
    estimate = re.search(words.replace(" ", r"\s+(?:# )?"), out)  # wrapped comment lines
    assert estimate, out
    first = float(estimate.group(3))
    assert float(estimate.group(1)) == pytest.approx(2 * first, abs=0.1 + 0.05 * first)
    # after the first configuration's rows, before the second's
    assert out.index("K=1 sgd:") < estimate.start() < out.index("K=1 adam:")
    assert out.count(" s left") == 1
