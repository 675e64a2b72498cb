"""`ring-demo --html`: one self-contained page that steps through the rounds of an allreduce.

No network and no server: the rounds are embedded as JSON, the page draws the ranks and every
pair that ever exchanges a message as inline SVG, the round's messages as arrows coloured and
labelled by the chunk they carry, each rank's buffer coloured by how many ranks it holds the
sum of (the PNG slides' colours) with the range just received framed, a line on what happens in
the round, and the bytes each rank has sent so far beside what the cost model says a rank sends
in all. The arrow keys, PageUp/PageDown (what presentation clickers send), space, the buttons or
auto-play step; `page.html#step=k` opens at round k (k = 0 is the start), `#step=k&play` plays
from there, which is how the tests drive it in a headless browser. The page holds the same demo
at every other P it can run at too, chosen in the heading (`#ranks=P&step=k`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from syncsgd.apps.demo_core import (
    MAX_RANKS,
    Demo,
    chunk_name,
    demo_chunks,
    exchange_text,
    explain_round,
    hex_colour,
    ranks_summed,
    rounds_line,
)
from syncsgd.util import figures, jsonout
from syncsgd.util.files import write_text

TOPOLOGY = {"tree": "tree", "naive": "star"}  # the rest: the ranks on a circle
CHUNK_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#555555")
WHOLE_BUFFER = "#000000"  # a message that carries the whole buffer


def rounds_data(demo: Demo) -> list[dict[str, Any]]:
    """The start and every round: buffers, messages, ranks summed in, bytes sent so far."""
    sent = [0] * demo.ranks
    frames = [{"title": "start", "explain": "each rank holds its own contribution",
               "buffers": [buf.tolist() for buf in demo.start], "messages": [],
               "received": [None] * demo.ranks, "notes": [""] * demo.ranks, "sent": list(sent),
               "counts": [ranks_summed(b, demo.ranks).tolist() for b in demo.start]}]  # fmt: skip
    current = list(demo.start)
    for number, (title, group) in enumerate(demo.steps, start=1):
        received: list[Any] = [None] * demo.ranks
        notes, messages = [""] * demo.ranks, []
        for snapshot in group:
            event, rank = snapshot.event, snapshot.event.rank
            current[rank] = snapshot.buffer
            sent[rank] += int(event.nbytes)
            notes[rank] = exchange_text(demo, snapshot)
            lo, hi = event.recv_range
            if snapshot.recv_from >= 0 and hi > lo:
                received[rank] = [int(lo), int(hi), bool(snapshot.added)]
            if snapshot.send_to >= 0:
                label = chunk_name(demo, event, event.send_chunk, tuple(event.send_range))
                colour = WHOLE_BUFFER if label == "all" else (
                    CHUNK_COLOURS[event.send_chunk % len(CHUNK_COLOURS)])  # fmt: skip
                messages.append([rank, snapshot.send_to, label, colour])
        frames.append({
            "title": f"round {number} of {len(demo.steps)}: {title}",
            "explain": explain_round(demo, title),
            "buffers": [buf.tolist() for buf in current], "messages": messages,
            "received": received, "notes": notes, "sent": list(sent),
            "counts": [ranks_summed(b, demo.ranks).tolist() for b in current],
        })  # fmt: skip
    return frames


def links(demo: Demo) -> list[list[int]]:
    """Every pair of ranks that exchanges a message at some round, lower rank first."""
    pairs = {tuple(sorted((s.event.rank, s.send_to))) for _, group in demo.steps for s in group
             if s.send_to >= 0}  # fmt: skip
    return [list(pair) for pair in sorted(pairs)]


def model_bytes(demo: Demo) -> str:
    """What the cost model says the busiest rank sends, n·b bytes, for the counters' caption."""
    from syncsgd.apps.costmodel import ALGORITHMS, cost

    n = demo.length * 8
    if demo.algorithm not in ALGORITHMS or demo.collective != "allreduce":
        return ""
    b = cost(demo.algorithm, demo.ranks).b
    formula = {"ring": "2(P−1)/P·n"}.get(demo.algorithm, f"{b:g}·n")
    return f"the model charges {formula} = {b * n:g} bytes of n = {n} bytes on the critical path"


def document(demo: Demo) -> dict[str, Any]:
    """One P's rounds and captions, as the page's script reads them."""
    return {
        "title": f"{demo.what} on {demo.ranks} ranks",
        "algorithm": demo.algorithm, "ranks": demo.ranks, "length": demo.length,
        "topology": TOPOLOGY.get(demo.algorithm, "circle"), "links": links(demo),
        "frames": rounds_data(demo), "model": model_bytes(demo), "rounds": rounds_line(demo),
        "correct": demo.correct, "bounds": demo_chunks(demo),
        "colours": [hex_colour(figures.stepped_colour(c, demo.ranks))
                    for c in range(demo.ranks + 1)],
    }  # fmt: skip


def page(demo: Demo, others: Sequence[Demo] = ()) -> str:
    """The whole HTML document: `demo` first, and a selector of P where `others` are given."""
    shown = document(demo)
    if others:
        shown["others"] = {str(other.ranks): document(other) for other in others}
    return filled(shown, shown["title"])


def same_at(demo: Demo, ranks: int) -> Demo | None:
    """`demo` run again on `ranks` ranks: the same collective, algorithm, length and root; None
    where that cannot run (a root or an alltoall length that P does not allow, a hierarchical
    layout of its own)."""
    from syncsgd.apps.demo_core import run_demo
    from syncsgd.apps.demo_parts import run_collective_demo

    if demo.algorithm == "hierarchical":  # its nodes were given for its own P
        return None
    try:
        if demo.collective == "allreduce":
            chosen_by_auto = demo.note.startswith("auto ")
            return run_demo(ranks, demo.length, "auto" if chosen_by_auto else demo.algorithm)
        length = demo.length // 2 if demo.collective == "alltoall" else demo.length
        return run_collective_demo(demo.collective, ranks, length, demo.algorithm, demo.root)
    except ValueError:
        return None


def every_other_p(demo: Demo) -> list[Demo]:
    """`demo` at every other P from 2 to 16 that it can run at."""
    runs = (same_at(demo, ranks) for ranks in range(2, MAX_RANKS + 1) if ranks != demo.ranks)
    return [run for run in runs if run is not None]


def filled(document: dict[str, Any], title: str) -> str:
    """The page's template around `document` and `title`."""
    # "</" escaped: the payload never ends its <script>
    payload = jsonout.dumps(document, ensure_ascii=False).replace("</", "<\\/")
    return TEMPLATE.replace("@TITLE@", html.escape(title)).replace("@DATA@", payload)


def write_html(demo: Demo, path: str) -> None:
    """Write the page to `path`, atomically: `demo`, and the same demo at every other P."""
    write_text(path, page(demo, every_other_p(demo)))


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font-family: sans-serif; margin: .5em 1em; color: #111; font-size: 24px; }
@media (max-width: 1400px) {  /* a 1024 x 768 projector: the notes move into the rows' tooltips */
  body { font-size: 15px; } td.note { display: none; }
  #topology { width: min(380px, 40vh) !important; height: min(380px, 40vh) !important; } }
h1 { font-size: 1.25em; margin: 0 0 .2em; }
#title { font-size: 1.15em; font-weight: bold; margin: .3em 0 .1em; }
#explain { font-size: 1em; margin: 0 0 .4em; min-height: 1.3em; }
table.buffers { border-collapse: collapse; }
table.buffers td { padding: .1em .35em; text-align: right; font-family: monospace;
  font-size: 1.05em; border: 1px solid #fff; color: #000; }
td.name { font-family: sans-serif; text-align: left; padding-right: 1em; white-space: nowrap; }
td.received-added { outline: 3px solid #000; outline-offset: -3px; }
td.received-copied { outline: 3px dashed #000; outline-offset: -3px; }
td.note, td.sent { font-family: sans-serif; text-align: left; padding-left: 1em; }
td.sent { white-space: nowrap; }
.controls button { font-size: 1em; margin-right: .3em; padding: .2em .6em; }
h1 select { font-size: 1em; font-weight: bold; }
.legend { margin: .5em 0; }
.legend span.swatch { display: inline-block; min-width: 1.6em; text-align: center; color: #000;
  font-family: monospace; }
svg line.link { stroke: #999; stroke-width: 1.5; }
svg line.message { stroke-width: 3.5; }
svg circle { fill: #fff; stroke: #000; stroke-width: 1.5; }
svg text { font-size: 17px; text-anchor: middle; dominant-baseline: central; fill: #000; }
svg text.label { font-size: 17px; font-weight: bold; paint-order: stroke; stroke: #fff;
  stroke-width: 4px; }
.layout { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }
/* the graph fills the height left under the title lines, up to half the width */
#topology { width: min(29vw, calc(100vh - 8em)); height: min(29vw, calc(100vh - 8em));
  flex: none; }
@media (min-width: 1401px) { .layout { flex-wrap: nowrap; }
  .layout > div { flex: 1 1 auto; min-width: 0; overflow-x: auto; }
  table.buffers td { font-size: 1em; padding: .05em .25em; }
  td.note { display: none; } }  /* the graph takes the notes' room: they are the rows' tooltips */
code { font-size: 1em; }
</style></head>
<body>
<h1><span id="heading">@TITLE@</span><label id="choose" hidden> &mdash; P =
<select id="ranks" aria-label="the number of ranks shown"></select></label></h1>
<div class="controls"><button id="first">&laquo; start</button><button id="prev">&#x25C0; back
</button><button id="next">next &#x25B6;</button><button id="last">end &raquo;</button>
<button id="play">play</button>
<span id="position"></span> &mdash; keys: &rarr;, PageDown or space: next; &larr; or PageUp:
back; Home, End; P: play or pause</div>
<div id="title"></div>
<div id="explain"></div>
<div class="layout"><svg id="topology" viewBox="0 0 380 380"
role="img" aria-label="the ranks and the messages of this round"></svg>
<div><table class="buffers" id="buffers"></table>
<div class="legend" id="legend"></div>
<p id="rounds"></p><p id="model"></p></div></div>
<script id="data" type="application/json">@DATA@</script>
<script>
"use strict";
const first = JSON.parse(document.getElementById("data").textContent);
const pages = {[first.ranks]: first, ...(first.others || {})};  // P: its rounds
let data = first, frames = first.frames, P = first.ranks, step = 0, timer = null;

function positions() {
  const cx = 190, cy = 190, r = 150, spots = [];
  if (data.topology === "tree") {
    for (let i = 0; i < P; i++) {
      const depth = Math.floor(Math.log2(i + 1)), first = (1 << depth) - 1;
      const across = 1 << depth, at = i - first;
      spots.push([20 + (340 * (at + 0.5)) / across, 30 + depth * 75]);
    }
    return spots;
  }
  if (data.topology === "star") {
    spots.push([cx, cy]);
    for (let i = 1; i < P; i++) {
      const a = (2 * Math.PI * (i - 1)) / Math.max(P - 1, 1) - Math.PI / 2;
      spots.push([cx + r * Math.cos(a), cy + r * Math.sin(a)]);
    }
    return spots;
  }
  for (let i = 0; i < P; i++) {
    const a = (2 * Math.PI * i) / P - Math.PI / 2;
    spots.push([cx + r * Math.cos(a), cy + r * Math.sin(a)]);
  }
  return spots;
}

function svg(name, attributes, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function arrowHead(root, colour) {
  const id = "arrow-" + colour.slice(1);
  if (!root.querySelector("#" + id)) {
    const marker = svg("marker", {id: id, viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerWidth: 5, markerHeight: 5, orient: "auto-start-reverse"});
    marker.appendChild(svg("path", {d: "M 0 0 L 10 5 L 0 10 z", fill: colour}));
    let defs = root.querySelector("defs");
    if (!defs) { defs = svg("defs", {}); root.appendChild(defs); }
    defs.appendChild(marker);
  }
  return "url(#" + id + ")";
}

function drawTopology(frame) {
  const root = document.getElementById("topology"), spots = positions();
  root.querySelectorAll(".drawn").forEach((node) => node.remove());
  for (const [a, b] of data.links)
    root.appendChild(svg("line", {class: "link drawn", "data-a": a, "data-b": b,
      x1: spots[a][0], y1: spots[a][1], x2: spots[b][0], y2: spots[b][1]}));
  const labels = [];
  frame.messages.forEach(([from, to, label, colour]) => {
    const [x1, y1] = spots[from], [x2, y2] = spots[to];
    const length = Math.hypot(x2 - x1, y2 - y1) || 1, ux = (x2 - x1) / length,
      uy = (y2 - y1) / length, bend = 5;  // to the left of its direction: a→b and b→a apart
    const line = {x1: x1 + 18 * ux - bend * uy, y1: y1 + 18 * uy + bend * ux,
      x2: x2 - 20 * ux - bend * uy, y2: y2 - 20 * uy + bend * ux};
    root.appendChild(svg("line", {class: "message drawn", "data-from": from, "data-to": to,
      "data-chunk": label, stroke: colour, "marker-end": arrowHead(root, colour), ...line}));
    labels.push(svg("text", {class: "label drawn", "data-chunk": label,
      x: (line.x1 + line.x2) / 2 - 16 * uy, y: (line.y1 + line.y2) / 2 + 16 * ux}, label));
  });
  spots.forEach(([x, y], rank) => {
    root.appendChild(svg("circle", {class: "drawn", cx: x, cy: y, r: 17}));
    root.appendChild(svg("text", {class: "drawn", x: x, y: y}, String(rank)));
  });
  labels.forEach((node) => root.appendChild(node));
}

function drawBuffers(frame) {
  const table = document.getElementById("buffers");
  table.replaceChildren();
  for (let rank = 0; rank < P; rank++) {
    const row = table.insertRow();
    row.id = "rank-" + rank;
    row.title = frame.notes[rank];
    const name = row.insertCell();
    name.className = "name";
    name.textContent = "rank " + rank;
    const received = frame.received[rank];
    frame.buffers[rank].forEach((value, i) => {
      const cell = row.insertCell();
      cell.className = "value";
      cell.textContent = String(value);
      cell.title = frame.tips ? frame.tips[rank][i]
        : frame.counts[rank][i] + " of " + P + " ranks summed in";
      cell.style.background = data.colours[frame.counts[rank][i]];
      if (received && received[0] <= i && i < received[1])
        cell.classList.add(received[2] ? "received-added" : "received-copied");
    });
    const sent = row.insertCell();
    sent.className = "sent";
    sent.id = "sent-" + rank;
    sent.textContent = frame.sent[rank] + " B sent";
    const note = row.insertCell();
    note.className = "note";
    note.textContent = frame.notes[rank];
  }
}

function drawLegend() {
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  legend.append("colour: how many ranks an element holds the sum of ");
  for (let count = 1; count <= P; count++) {
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = data.colours[count];
    swatch.textContent = String(count);
    legend.append(swatch);
  }
  legend.append(data.legend || "; frame: just received (solid: added, dashed: copied); an " +
    "arrow's colour and label: the chunk it carries (all: the whole buffer)");
}

function withCode(node, text) {
  // `name` in the text is shown as code, without the backticks
  text.split("`").forEach((part, i) => {
    if (i % 2 === 1) {
      const code = document.createElement("code");
      code.textContent = part;
      node.append(code);
    } else node.append(part);
  });
}

function choose(ranks) {
  // the rounds of another P: the captions, the legend and the graph drawn again for it
  data = pages[ranks] || first;
  frames = data.frames;
  P = data.ranks;
  document.getElementById("ranks").value = String(P);
  document.body.dataset.ranks = String(P);
  if (data.title) {
    document.getElementById("heading").textContent = data.title;
    document.title = data.title;
  }
  for (const id of ["rounds", "model"]) {
    const node = document.getElementById(id);
    node.replaceChildren();
    withCode(node, data[id]);
  }
  drawLegend();
  document.getElementById("topology").replaceChildren();
}

function show(k) {
  step = Math.max(0, Math.min(frames.length - 1, k));
  const frame = frames[step];
  document.getElementById("title").textContent = frame.title;
  document.getElementById("explain").textContent = frame.explain;
  document.getElementById("position").textContent = "step " + step + " of " + (frames.length - 1);
  document.body.dataset.step = String(step);
  drawTopology(frame);
  drawBuffers(frame);
  if (step === frames.length - 1) pause();
  const hash = (P === first.ranks ? "#" : "#ranks=" + P + "&") + "step=" + step;
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

function play(every) {
  if (timer) return;
  if (step === frames.length - 1) show(0);
  timer = setInterval(() => show(step + 1), every || 1500);
  document.body.dataset.playing = "yes";
  document.getElementById("play").textContent = "pause";
  show(step);
}

function pause() {
  if (timer) clearInterval(timer);
  timer = null;
  document.body.dataset.playing = "no";
  document.getElementById("play").textContent = "play";
}

function fromHash() {
  const match = /step=(\\d+)/.exec(location.hash);
  const playing = /[#&]play(?:=(\\d+))?/.exec(location.hash);  // play=ms: the time per round
  const ranks = /ranks=(\\d+)/.exec(location.hash);
  const wanted = ranks && pages[ranks[1]] ? parseInt(ranks[1], 10) : first.ranks;
  if (wanted !== P) choose(wanted);
  show(match ? parseInt(match[1], 10) : 0);
  if (playing) play(playing[1] ? parseInt(playing[1], 10) : 1500);
}

const select = document.getElementById("ranks");
Object.keys(pages).map(Number).sort((a, b) => a - b)
  .forEach((p) => select.add(new Option(String(p), String(p))));
document.getElementById("choose").hidden = select.options.length < 2;
select.onchange = () => { pause(); choose(parseInt(select.value, 10)); show(0); };
choose(first.ranks);
document.getElementById("first").onclick = () => show(0);
document.getElementById("prev").onclick = () => show(step - 1);
document.getElementById("next").onclick = () => show(step + 1);
document.getElementById("last").onclick = () => show(frames.length - 1);
document.getElementById("play").onclick = () => (timer ? pause() : play(1500));
const NEXT = ["ArrowRight", "ArrowDown", "PageDown", " "];
const BACK = ["ArrowLeft", "ArrowUp", "PageUp"];
document.addEventListener("keydown", (event) => {
  if (event.target.tagName === "BUTTON" && (event.key === " " || event.key === "Enter")) return;
  if (event.target.tagName === "SELECT") return;  // its arrow keys choose a P
  let handled = true;
  if (NEXT.includes(event.key)) show(step + 1);
  else if (BACK.includes(event.key)) show(step - 1);
  else if (event.key === "Home") show(0);
  else if (event.key === "End") show(frames.length - 1);
  else if (event.key === "p" || event.key === "P") timer ? pause() : play(1500);
  else handled = false;
  if (handled) event.preventDefault();  // no scrolling: the keys step through the rounds
});
window.addEventListener("hashchange", fromHash);
document.body.dataset.playing = "no";
fromHash();
</script>
</body></html>
"""
