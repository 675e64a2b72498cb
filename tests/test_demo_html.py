"""`ring-demo --html`: a self-contained page; in headless Chromium `#step=k` shows round k."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest

from syncsgd.apps import demo, demo_core, demo_html
from syncsgd.apps.demo_parts import run_collective_demo
from syncsgd.util import figures

pytestmark = pytest.mark.timeout(180)

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)  # fmt: skip
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: "
                                    "apt-get install chromium to run the headless page tests")


def page_data(page: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>',
                                page, re.DOTALL)[1])  # fmt: skip


def test_the_page_is_self_contained_and_holds_every_round(tmp_path):
    run = demo.run_demo(4, 8, "ring")
    page = demo_html.page(run)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing fetched from a network
    data = page_data(page)
    assert len(data["frames"]) == 1 + 2 * (4 - 1)
    assert data["frames"][-1]["buffers"] == [[1111] * 8] * 4
    # every rank of the ring sends 2(P-1) chunks of n/P elements: 2(P-1)/P * n bytes
    assert data["frames"][-1]["sent"] == [2 * 3 * 2 * 8] * 4
    assert "2(P−1)/P·n = 96 bytes" in data["model"]
    assert data["links"] == [[0, 1], [0, 3], [1, 2], [2, 3]]
    # round 1: rank r sends chunk r to its right neighbour, in chunk r's colour
    assert [m[:3] for m in data["frames"][1]["messages"]] == [[r, (r + 1) % 4, f"c{r}"]
                                                              for r in range(4)]  # fmt: skip
    assert len({m[3] for m in data["frames"][1]["messages"]}) == 4
    assert data["frames"][1]["explain"].startswith("each rank adds the chunk")


@pytest.mark.parametrize(("algorithm", "ranks"), [("rabenseifner", 5), ("recursive-doubling", 6),
                                                  ("tree", 6), ("naive", 3)])  # fmt: skip
def test_every_message_runs_on_a_drawn_link(algorithm, ranks):
    data = page_data(demo_html.page(demo.run_demo(ranks, 8, algorithm)))
    drawn = {tuple(pair) for pair in data["links"]}
    for frame in data["frames"]:
        for sender, receiver, *_ in frame["messages"]:
            assert tuple(sorted((sender, receiver))) in drawn, (frame["title"], sender, receiver)
    if algorithm == "rabenseifner":  # ranks 1, 2, 3, 4 after the fold renumbers them 0-3
        assert drawn == {(0, 1), (1, 2), (1, 3), (2, 4), (3, 4)}


@pytest.mark.parametrize(("collective", "algorithm"), [("allgather", "recursive-doubling"),
                                                       ("reduce-scatter", "recursive-halving")])
@pytest.mark.parametrize("ranks", [3, 4, 5, 6])
def test_arrows_of_doubling_and_halving_name_the_blocks_they_carry(collective, algorithm, ranks):
    from syncsgd.apps.demo_parts import run_collective_demo
    from syncsgd.collectives import chunk_bounds

    length = 2 * ranks  # two elements a block
    shown = run_collective_demo(collective, ranks, length, algorithm)
    bounds = chunk_bounds(length, ranks)
    expected = []  # each round's arrows: sender, receiver and the blocks of the range sent
    for _, group in shown.steps:
        arrows = []
        for snapshot in group:
            if snapshot.send_to < 0:
                continue
            lo, hi = snapshot.event.send_range
            blocks = [c for c in range(ranks) if lo <= bounds[c] and bounds[c + 1] <= hi]
            label = ("all" if len(blocks) == ranks else f"c{blocks[0]}" if len(blocks) == 1
                     else f"c{blocks[0]}-{blocks[-1]}")  # fmt: skip
            arrows.append([snapshot.event.rank, snapshot.send_to, label])
        expected.append(arrows)
    frames = page_data(demo_html.page(shown))["frames"][1:]
    assert [[m[:3] for m in frame["messages"]] for frame in frames] == expected
    labels = {m[2] for frame in frames for m in frame["messages"]}
    assert "c0" in labels or "c1" in labels  # one block: the first exchange (or the fold)
    if ranks == 4:  # no fold: nothing carries the whole buffer
        assert "all" not in labels


def test_no_backticks_in_the_text_a_reader_sees():
    page = demo_html.page(demo.run_demo(3, 4, "tree"))
    data = page_data(page)
    assert "`" in data["rounds"]  # the code span, shown as <code> by the page ...
    visible = re.sub(r"<script.*?</script>", "", page, flags=re.DOTALL)
    assert "`" not in visible  # ... and nowhere as text


def rank_rows(dom: str) -> dict[int, list[int]]:
    """Each rank's buffer as the page shows it."""
    rows = {}
    for rank, cells in re.findall(r'<tr id="rank-(\d+)"[^>]*>(.*?)</tr>', dom):
        rows[int(rank)] = [int(v) for v in re.findall(r'<td class="value[^"]*"[^>]*>(\d+)</td>',
                                                      cells)]  # fmt: skip
    return rows


@needs_chromium
@pytest.mark.parametrize(("algorithm", "ranks", "step"),
                         [("ring", 4, 3), ("rabenseifner", 5, 2), ("tree", 6, 4)])  # fmt: skip
def test_step_fragment_shows_that_rounds_buffers(tmp_path, browser, algorithm, ranks, step):
    run = demo.run_demo(ranks, 8, algorithm)
    path = tmp_path / "demo.html"
    demo_html.write_html(run, str(path))
    browser.open(f"{path.as_uri()}#step={step}")
    dom = browser.value("document.documentElement.outerHTML")
    expected = demo_html.rounds_data(run)[step]
    assert rank_rows(dom) == dict(enumerate(expected["buffers"]))
    assert f'data-step="{step}"' in dom
    for rank, sent in enumerate(expected["sent"]):
        assert f'id="sent-{rank}">{sent} B sent<' in dom
    assert dom.count('class="message drawn"') == len(expected["messages"])


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe: real key events."""

    KEYS = {"ArrowRight": 39, "ArrowLeft": 37, "PageDown": 34, "PageUp": 33, " ": 32,
            "Home": 36, "End": 35, "p": 80}  # fmt: skip

    def __init__(self, profile) -> None:
        to_browser, self.writer = os.pipe()
        self.reader, from_browser = os.pipe()

        def pipes() -> None:  # the browser reads commands on fd 3 and answers on fd 4
            commands, answers = os.dup(to_browser), os.dup(from_browser)  # neither is 3 or 4 now
            os.dup2(commands, 3)
            os.dup2(answers, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--hide-scrollbars", f"--user-data-dir={profile}", "--remote-debugging-pipe"]
        self.process = subprocess.Popen([CHROMIUM, *flags, "about:blank"], preexec_fn=pipes,
                                        close_fds=False, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self.next_id, self.buffer, self.session = 0, b"", None

    def call(self, method: str, session: bool = True, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.writer, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self.next_id:
                    assert "error" not in answer, answer
                    return answer["result"]
            chunk = os.read(self.reader, 1 << 20)
            assert chunk, "the browser closed its pipe"
            self.buffer += chunk
        raise TimeoutError(method)

    def open(self, url: str, width: int = 1024, height: int = 768,
             ready: str = "document.readyState === 'complete' && document.body.dataset.step",
             ) -> None:  # fmt: skip
        if self.session is None:  # one tab: a second one would run in the background, throttled
            target = self.call("Target.createTarget", session=False, url="about:blank")
            self.session = self.call("Target.attachToTarget", session=False, flatten=True,
                                     targetId=target["targetId"])["sessionId"]  # fmt: skip
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        self.call("Page.navigate", url=url)
        self.wait_for(ready)

    def value(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression,
                         returnByValue=True)["result"].get("value")  # fmt: skip

    def wait_for(self, expression: str, seconds: float = 30):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = self.value(expression)
            if found:
                return found
            time.sleep(0.05)
        raise TimeoutError(expression)

    def press(self, key: str) -> None:
        code = self.KEYS[key]
        extra = {"text": key} if len(key) == 1 else {}
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, windowsVirtualKeyCode=code,
                      **(extra if kind == "keyDown" else {}))  # fmt: skip

    def step(self) -> int:
        return int(self.value("document.body.dataset.step"))

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        os.close(self.reader)
        os.close(self.writer)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One browser and one tab for the tests below: starting Chromium takes seconds."""
    opened = Browser(tmp_path_factory.mktemp("profile"))
    yield opened
    opened.close()


@needs_chromium
def test_keys_and_clicker_keys_step_through_the_rounds(tmp_path, browser):
    path = tmp_path / "demo.html"
    demo_html.write_html(demo.run_demo(4, 8, "ring"), str(path))  # 7 frames: 0 to 6
    browser.open(f"{path.as_uri()}#step=2")
    assert browser.step() == 2
    for key, expected in (("PageDown", 3), (" ", 4), ("ArrowRight", 5), ("PageUp", 4),
                          ("ArrowLeft", 3), ("End", 6), ("PageDown", 6), ("Home", 0),
                          ("PageUp", 0)):  # fmt: skip
        browser.press(key)
        assert browser.step() == expected, key
    assert browser.value("location.hash") == "#step=0"
    assert browser.value("window.scrollY") == 0  # space and PageDown step, they do not scroll
    text = browser.value("document.body.innerText")
    assert "`" not in text and "syncsgd model" in text
    browser.press("p")  # auto-play, and P again pauses it
    assert browser.value("document.body.dataset.playing") == "yes"
    browser.press("p")
    assert browser.value("document.body.dataset.playing") == "no"
    browser.open(f"{path.as_uri()}#step=4&play=100")  # from the address: runs to the end, stops
    browser.wait_for("document.body.dataset.step === '6' && document.body.dataset.playing === 'no'",
                     seconds=10)  # fmt: skip


@needs_chromium
def test_arrows_are_labelled_by_chunk_and_links_follow_the_renumbering(tmp_path, browser):
    run = demo.run_demo(5, 8, "rabenseifner")
    path = tmp_path / "demo.html"
    demo_html.write_html(run, str(path))
    browser.open(f"{path.as_uri()}#step=2")  # a reduce-scatter round among ranks 1, 2, 3, 4
    arrows = browser.value("[...document.querySelectorAll('line.message')].map(l => "
                           "[+l.dataset.from, +l.dataset.to, l.dataset.chunk, "
                           "l.getAttribute('stroke')])")  # fmt: skip
    links = browser.value("[...document.querySelectorAll('line.link')].map(l => "
                          "[+l.dataset.a, +l.dataset.b])")  # fmt: skip
    labels = browser.value("[...document.querySelectorAll('text.label')].map(t => t.textContent)")
    expected = demo_html.rounds_data(run)[2]["messages"]
    assert sorted(arrows) == sorted(expected) and len(arrows) == 2
    assert sorted(labels) == sorted(m[2] for m in expected) == ["c0-1", "c2-3"]
    assert all(sorted((a[0], a[1])) in links for a in arrows)
    assert [1, 2] in links  # new ranks 0 and 1 are ranks 1 and 2: no power-of-two neighbours


@needs_chromium
@pytest.mark.parametrize(("width", "height"), [(1024, 768), (1920, 1080)])
def test_screenshots_at_projector_sizes(tmp_path, browser, width, height):
    path = tmp_path / "demo.html"
    demo_html.write_html(demo.run_demo(8, 8, "ring"), str(path))
    browser.open(f"{path.as_uri()}#step=5", width, height)
    shot = browser.screenshot()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(shot[16:20], "big"), int.from_bytes(shot[20:24], "big")) == (
        width, height)
    (tmp_path / f"shot-{width}.png").write_bytes(shot)
    if os.environ.get("SYNCSGD_SHOTS"):  # to look at them
        (pathlib.Path(os.environ["SYNCSGD_SHOTS"]) / f"shot-{width}.png").write_bytes(shot)
    # the round's title, the buffers and the counters are on screen, not scrolled away
    bottom = browser.value("document.getElementById('rank-7').getBoundingClientRect().bottom")
    assert bottom <= height


@needs_chromium
@pytest.mark.parametrize("ranks", [3, 8])
def test_the_page_is_legible_at_1920_by_1080(tmp_path, browser, ranks):
    path = tmp_path / "demo.html"
    demo_html.write_html(demo.run_demo(ranks, 8, "ring"), str(path))
    browser.open(f"{path.as_uri()}#step=3", 1920, 1080)
    smallest = browser.value(
        "Math.min(...[...document.querySelectorAll('h1, #title, #explain, td, .legend, p, "
        ".controls')].filter(e => e.offsetParent !== null && e.textContent.trim())"
        ".map(e => parseFloat(getComputedStyle(e).fontSize)))")  # fmt: skip
    assert smallest >= 24
    graph = browser.value("document.getElementById('topology').getBoundingClientRect().width")
    assert graph >= 500  # not squeezed into a corner
    side = "document.querySelector('.layout > div')"
    assert browser.value(f"{side}.scrollWidth <= {side}.clientWidth + 1")
    bottom = browser.value(f"document.getElementById('rank-{ranks - 1}')"
                           ".getBoundingClientRect().bottom")  # fmt: skip
    assert bottom <= 1080


def test_the_page_holds_the_same_demo_at_every_p_it_can_run_at():
    run = demo.run_demo(4, 8, "ring")
    data = page_data(demo_html.page(run, demo_html.every_other_p(run)))
    assert data["ranks"] == 4 and data["title"] == "ring allreduce on 4 ranks"
    assert sorted(map(int, data["others"])) == [p for p in range(2, 17) if p != 4]
    eight = data["others"]["8"]
    assert eight["frames"] == demo_html.rounds_data(demo.run_demo(8, 8, "ring"))
    assert eight["colours"][8] == demo_core.hex_colour(figures.stepped_colour(8, 8))
    # alltoall splits the rank's elements into P blocks: only the P that divide them
    alltoall = run_collective_demo("alltoall", 2, 8, "pairwise")
    assert [d.ranks for d in demo_html.every_other_p(alltoall)] == [4, 8]
    hierarchical = demo.run_demo(4, 8, "hierarchical")
    assert demo_html.every_other_p(hierarchical) == []  # its nodes were given for its own P


@needs_chromium
def test_the_selector_shows_another_p_and_the_address_keeps_it(tmp_path, browser):
    path = tmp_path / "demo.html"
    demo_html.write_html(demo.run_demo(4, 8, "ring"), str(path))
    browser.open(f"{path.as_uri()}#ranks=8&step=3", 1920, 1080)
    dom = browser.value("document.documentElement.outerHTML")
    assert rank_rows(dom) == dict(enumerate(demo_html.rounds_data(demo.run_demo(8, 8))[3]
                                            ["buffers"]))  # fmt: skip
    assert browser.value("document.getElementById('heading').textContent") == (
        "ring allreduce on 8 ranks")
    assert browser.value("document.querySelectorAll('#legend .swatch').length") == 8
    assert browser.value("document.querySelectorAll('#topology circle').length") == 8
    browser.value("const s = document.getElementById('ranks'); s.value = '3'; "
                  "s.dispatchEvent(new Event('change')); 0")  # fmt: skip
    assert browser.step() == 0 and browser.value("location.hash") == "#ranks=3&step=0"
    assert rank_rows(browser.value("document.documentElement.outerHTML")) == {
        0: [1] * 8, 1: [10] * 8, 2: [100] * 8}
    browser.press("End")
    assert browser.step() == 4  # 2(P-1) rounds of P = 3
    assert browser.value("parseFloat(getComputedStyle(document.getElementById('ranks'))"
                         ".fontSize)") >= 24  # fmt: skip
    # no P in the address: the page's own
    browser.open(f"{path.as_uri()}#step=1", ready="document.body.dataset.ranks === '4' && "
                 "document.body.dataset.step === '1'")  # fmt: skip
