"""`ring-demo --html`: a self-contained page; in headless Chromium `#step=k` shows round k."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from syncsgd.apps import demo, demo_html

pytestmark = pytest.mark.timeout(180)

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)  # fmt: skip
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: "
                                    "apt-get install chromium to run the headless page tests")


def test_the_page_is_self_contained_and_holds_every_round(tmp_path):
    run = demo.run_demo(4, 8, "ring")
    page = demo_html.page(run)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing fetched from a network
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>',
                                page, re.DOTALL)[1])  # fmt: skip
    assert len(data["frames"]) == 1 + 2 * (4 - 1)
    assert data["frames"][-1]["buffers"] == [[1111] * 8] * 4
    # every rank of the ring sends 2(P-1) chunks of n/P elements: 2(P-1)/P * n bytes
    assert data["frames"][-1]["sent"] == [2 * 3 * 2 * 8] * 4
    assert data["topology"] == "ring" and "2(P−1)/P·n = 96 bytes" in data["model"]


def headless(*arguments: str, profile) -> subprocess.CompletedProcess:
    """Chromium, headless, with a fresh profile and nothing fetched in the background."""
    assert CHROMIUM is not None
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}"]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *arguments], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def rank_rows(dom: str) -> dict[int, list[int]]:
    """Each rank's buffer as the page shows it."""
    rows = {}
    for rank, cells in re.findall(r'<tr id="rank-(\d+)">(.*?)</tr>', dom):
        rows[int(rank)] = [int(v) for v in re.findall(r'<td class="value[^"]*"[^>]*>(\d+)</td>',
                                                      cells)]  # fmt: skip
    return rows


@needs_chromium
@pytest.mark.parametrize(("algorithm", "ranks", "step"),
                         [("ring", 4, 3), ("rabenseifner", 5, 2), ("tree", 6, 4)])  # fmt: skip
def test_step_fragment_shows_that_rounds_buffers(tmp_path, algorithm, ranks, step):
    run = demo.run_demo(ranks, 8, algorithm)
    path = tmp_path / "demo.html"
    demo_html.write_html(run, str(path))
    done = headless("--dump-dom", f"{path.as_uri()}#step={step}", profile=tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    expected = demo_html.rounds_data(run)[step]
    assert rank_rows(done.stdout) == dict(enumerate(expected["buffers"]))
    assert f'data-step="{step}"' in done.stdout
    for rank, sent in enumerate(expected["sent"]):
        assert f'id="sent-{rank}">{sent} B sent<' in done.stdout
    assert done.stdout.count('class="message drawn"') == len(expected["messages"])


@needs_chromium
def test_a_screenshot_is_taken(tmp_path):
    path = tmp_path / "demo.html"
    demo_html.write_html(demo.run_demo(8, 8, "ring"), str(path))
    shot = tmp_path / "shot.png"
    done = headless("--window-size=1200,800", f"--screenshot={shot}", f"{path.as_uri()}#step=5",
                    profile=tmp_path / "profile")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
