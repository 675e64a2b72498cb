"""`ring-demo --html`: one self-contained page that steps through the rounds of an allreduce.

No network and no server: the rounds are embedded as JSON, the page draws the topology (ring,
butterfly, tree, star) as inline SVG with the round's messages as arrows, each rank's buffer with
the range just received framed, and the bytes each rank has sent so far beside what the cost
model says a rank sends in all. The arrow keys or the buttons step; `page.html#step=k` opens at
round k (k = 0 is the start), which is how the tests read it in a headless browser.
"""

from __future__ import annotations

import html
from typing import Any

from syncsgd.apps.demo_core import Demo, contributors, demo_chunks, exchange_text, rounds_line
from syncsgd.util import jsonout
from syncsgd.util.files import write_text

TOPOLOGY = {
    "ring": "ring",
    "naive": "star",
    "recursive-doubling": "butterfly",
    "rabenseifner": "butterfly",
    "tree": "tree",
}


def rounds_data(demo: Demo) -> list[dict[str, Any]]:
    """The start and every round: buffers, messages, shares summed in, bytes sent so far."""
    buffers = [buf.tolist() for buf in demo.start]
    sent = [0] * demo.ranks
    frames = [{"title": "start", "buffers": buffers, "messages": [],
               "received": [None] * demo.ranks, "notes": [""] * demo.ranks, "sent": list(sent),
               "share": [contributors(b, demo.ranks).tolist() for b in demo.start]}]  # fmt: skip
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
                messages.append([rank, snapshot.send_to])
        frames.append({
            "title": f"round {number} of {len(demo.steps)}: {title}",
            "buffers": [buf.tolist() for buf in current], "messages": messages,
            "received": received, "notes": notes, "sent": list(sent),
            "share": [contributors(b, demo.ranks).tolist() for b in current],
        })  # fmt: skip
    return frames


def model_bytes(demo: Demo) -> str:
    """What the cost model says the busiest rank sends, n·b bytes, for the counters' caption."""
    from syncsgd.apps.costmodel import ALGORITHMS, cost

    n = demo.length * 8
    if demo.algorithm not in ALGORITHMS or demo.collective != "allreduce":
        return ""
    b = cost(demo.algorithm, demo.ranks).b
    formula = {"ring": "2(P−1)/P·n"}.get(demo.algorithm, f"{b:g}·n")
    return f"the model charges {formula} = {b * n:g} bytes of n = {n} bytes on the critical path"


def page(demo: Demo) -> str:
    """The whole HTML document."""
    document = {
        "algorithm": demo.algorithm, "ranks": demo.ranks, "length": demo.length,
        "topology": TOPOLOGY.get(demo.algorithm, "ring"), "frames": rounds_data(demo),
        "model": model_bytes(demo), "rounds": rounds_line(demo), "correct": demo.correct,
        "bounds": demo_chunks(demo),
    }  # fmt: skip
    # "</" escaped: the payload never ends its <script>
    payload = jsonout.dumps(document, ensure_ascii=False).replace("</", "<\\/")
    title = html.escape(f"{demo.what} on {demo.ranks} ranks")
    return TEMPLATE.replace("@TITLE@", title).replace("@DATA@", payload)


def write_html(demo: Demo, path: str) -> None:
    """Write the page to `path`, atomically."""
    write_text(path, page(demo))


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<style>
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
#title { font-size: 1.15em; font-weight: bold; margin: .5em 0; }
table.buffers { border-collapse: collapse; }
table.buffers td { padding: .15em .4em; text-align: right; font-family: monospace;
  border: 1px solid #fff; }
td.name { font-family: sans-serif; text-align: left; padding-right: 1em; }
td.received-added { outline: 3px solid #000; }
td.received-copied { outline: 3px dashed #000; }
td.note, td.sent { font-family: sans-serif; text-align: left; color: #333; padding-left: 1em; }
.controls button { font-size: 1em; margin-right: .3em; }
svg line.link { stroke: #bbb; stroke-width: 1.5; }
svg line.message { stroke: #c0392b; stroke-width: 3; marker-end: url(#arrow); }
svg circle { fill: #eef; stroke: #335; stroke-width: 1.5; }
svg text { font-size: 13px; text-anchor: middle; dominant-baseline: central; }
.layout { display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; }
</style></head>
<body>
<h1>@TITLE@</h1>
<div class="controls"><button id="first">&laquo; start</button><button id="prev">&#x25C0; back
</button><button id="next">next &#x25B6;</button><button id="last">end &raquo;</button>
<span id="position"></span> &mdash; arrow keys step; the address <code>#step=k</code> opens
round k</div>
<div id="title"></div>
<div class="layout"><svg id="topology" width="360" height="360" viewBox="0 0 360 360">
<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6"
markerHeight="6" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#c0392b"/>
</marker></defs></svg>
<div><table class="buffers" id="buffers"></table>
<p id="rounds"></p><p id="model"></p></div></div>
<script id="data" type="application/json">@DATA@</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const frames = data.frames, P = data.ranks;
const palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
  "#f7b6d2"];
let step = 0;

function positions() {
  const cx = 180, cy = 180, r = 140, spots = [];
  if (data.topology === "tree") {
    for (let i = 0; i < P; i++) {
      const depth = Math.floor(Math.log2(i + 1)), first = (1 << depth) - 1;
      const across = 1 << depth, at = i - first;
      spots.push([20 + (320 * (at + 0.5)) / across, 30 + depth * 70]);
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

function links() {
  const pairs = [];
  for (let i = 0; i < P; i++) {
    if (data.topology === "ring" && P > 1) pairs.push([i, (i + 1) % P]);
    if (data.topology === "tree" && i > 0) pairs.push([i, Math.floor((i - 1) / 2)]);
    if (data.topology === "star" && i > 0) pairs.push([0, i]);
    if (data.topology === "butterfly")
      for (let k = 1; k < P; k <<= 1) if ((i ^ k) < P && i < (i ^ k)) pairs.push([i, i ^ k]);
  }
  return pairs;
}

function svg(name, attributes, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawTopology(frame) {
  const root = document.getElementById("topology"), spots = positions();
  root.querySelectorAll(".drawn").forEach((node) => node.remove());
  for (const [a, b] of links())
    root.appendChild(svg("line", {class: "link drawn", x1: spots[a][0], y1: spots[a][1],
      x2: spots[b][0], y2: spots[b][1]}));
  frame.messages.forEach(([from, to], index) => {
    const [x1, y1] = spots[from], [x2, y2] = spots[to];
    const length = Math.hypot(x2 - x1, y2 - y1) || 1, ux = (x2 - x1) / length,
      uy = (y2 - y1) / length, bend = from < to ? 4 : -4;
    root.appendChild(svg("line", {class: "message drawn", "data-from": from, "data-to": to,
      x1: x1 + 18 * ux - bend * uy, y1: y1 + 18 * uy + bend * ux,
      x2: x2 - 20 * ux - bend * uy, y2: y2 - 20 * uy + bend * ux}));
  });
  spots.forEach(([x, y], rank) => {
    root.appendChild(svg("circle", {class: "drawn", cx: x, cy: y, r: 17}));
    root.appendChild(svg("text", {class: "drawn", x: x, y: y}, String(rank)));
  });
}

function chunkOf(i) {
  if (!data.bounds) return 0;
  let c = 0;
  while (c + 1 < data.bounds.length - 1 && data.bounds[c + 1] <= i) c++;
  return c;
}

function mix(hex, strength) {
  const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  return "rgb(" + rgb.map((v) => Math.round(255 - strength * (255 - v))).join(",") + ")";
}

function drawBuffers(frame) {
  const table = document.getElementById("buffers");
  table.replaceChildren();
  for (let rank = 0; rank < P; rank++) {
    const row = table.insertRow();
    row.id = "rank-" + rank;
    const name = row.insertCell();
    name.className = "name";
    name.textContent = "rank " + rank;
    const received = frame.received[rank];
    frame.buffers[rank].forEach((value, i) => {
      const cell = row.insertCell();
      cell.className = "value";
      cell.textContent = String(value);
      const strength = 0.15 + 0.85 * Math.min(frame.share[rank][i], 1);
      cell.style.background = mix(palette[chunkOf(i) % palette.length], strength);
      cell.style.color = strength > 0.6 ? "#fff" : "#000";
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

function show(k) {
  step = Math.max(0, Math.min(frames.length - 1, k));
  const frame = frames[step];
  document.getElementById("title").textContent = frame.title;
  document.getElementById("position").textContent = "step " + step + " of " + (frames.length - 1);
  document.body.dataset.step = String(step);
  drawTopology(frame);
  drawBuffers(frame);
  if (location.hash !== "#step=" + step) history.replaceState(null, "", "#step=" + step);
}

function fromHash() {
  const match = /step=(\\d+)/.exec(location.hash);
  show(match ? parseInt(match[1], 10) : 0);
}

document.getElementById("rounds").textContent = data.rounds;
document.getElementById("model").textContent = data.model;
document.getElementById("first").onclick = () => show(0);
document.getElementById("prev").onclick = () => show(step - 1);
document.getElementById("next").onclick = () => show(step + 1);
document.getElementById("last").onclick = () => show(frames.length - 1);
document.addEventListener("keydown", (event) => {
  if (event.key === "ArrowRight" || event.key === "ArrowDown" || event.key === " ") show(step + 1);
  if (event.key === "ArrowLeft" || event.key === "ArrowUp") show(step - 1);
  if (event.key === "Home") show(0);
  if (event.key === "End") show(frames.length - 1);
});
window.addEventListener("hashchange", fromHash);
fromHash();
</script>
</body></html>
"""
