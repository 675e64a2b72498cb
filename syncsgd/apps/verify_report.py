"""The grid's report: a self-contained HTML page and the heatmap alone (PNG, SVG, PDF).

Each cell is one run: its colour the relative distance from the serial run of its configuration
on a log scale (viridis: ordered in lightness, readable in grey and to the common colour-vision
deficiencies), its text that distance, the max ULP distance and "bitwise" where the SHA-256 of
the final state is the serial run's. A run that should match and does not is marked with a
cross and a dashed frame, not by colour alone.
"""

from __future__ import annotations

import html
import math
from typing import Any

from syncsgd.util import jsonout
from syncsgd.util.files import atomic_path, write_text

# The colour scale: log10 of the relative distance, from FLOOR (and bitwise) to CEILING.
FLOOR, CEILING = -18.0, 0.0
# viridis at nine evenly spaced points (matplotlib's), interpolated linearly between them
VIRIDIS = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962",
           "#addc30", "#fde725")  # fmt: skip
SCALE_TEXT = (f"colour: log10 of the relative distance max |Δθ| / max(1, max |θ|) from the "
              f"serial run, viridis from 1e{FLOOR:.0f} and below (dark; bitwise runs too) to "
              f"1e{CEILING:.0f} (yellow): ordered in lightness, readable in grey and to the "
              "common colour-vision deficiencies")  # fmt: skip


def position(run: dict[str, Any]) -> float:
    """Where a run's relative distance lies on the scale, 0 (floor, bitwise) to 1 (ceiling)."""
    distance = run["rel_diff"]
    if run["bitwise"] or distance is None or distance <= 0:
        return 0.0 if run["bitwise"] or distance == 0 else 1.0  # None: not finite, the top
    exponent = math.log10(distance)
    return min(1.0, max(0.0, (exponent - FLOOR) / (CEILING - FLOOR)))


def colour(at: float) -> str:
    """viridis at `at` in [0, 1], as #rrggbb."""
    scaled = at * (len(VIRIDIS) - 1)
    low = min(int(scaled), len(VIRIDIS) - 2)
    part = scaled - low
    a, b = (tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in VIRIDIS[low : low + 2])
    return "#" + "".join(f"{round(x + (y - x) * part):02x}" for x, y in zip(a, b, strict=True))


def ink(at: float) -> str:
    """Text colour readable on viridis at `at`: white or black, whichever contrasts more."""
    from syncsgd.util.figures import contrast

    back = [int(colour(at)[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    white = contrast(back, (1.0, 1.0, 1.0))
    return "#ffffff" if white >= contrast(back, (0.0, 0.0, 0.0)) else "#000000"


def cell_text(run: dict[str, Any]) -> list[str]:
    """A cell's lines: bitwise or the distance, the ULPs, where it first left serial SGD."""
    lines = ["bitwise" if run["bitwise"] else relative_text(run["rel_diff"])]
    if not run["bitwise"]:
        ulps = run["max_ulp"]
        lines.append(f"{ulps if ulps < 10**7 else format(ulps, '.2e')} ULP")
        if run["first_diff_step"] is not None:
            lines.append(f"step {run['first_diff_step']} {run['first_diff_param']}")
    if not run["matches"]:
        lines.append("✗ " + ("not bitwise" if run["mode"] == "exact" else "beyond tolerance"))
    return lines


def relative_text(value: float | None) -> str:
    """The relative distance as the cells and the table show it."""
    return "not finite" if value is None else f"{value:.2e}"


def grid(document: dict[str, Any]) -> list[tuple[str, list[dict[str, Any] | None]]]:
    """Rows: (configuration, its run at each P of the document, None where missing)."""
    from syncsgd.apps.verify_grid import label

    by_cell = {(label(run), run["ranks"]): run for run in document["runs"]}
    return [(name, [by_cell.get((name, ranks)) for ranks in document["ranks"]])
            for name in document["configurations"]]  # fmt: skip


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #111; }
table { border-collapse: collapse; }
th, td { padding: 4px 8px; }
table.heat td.cell { width: 150px; height: 56px; text-align: center; font-size: 12px;
  border: 2px solid #fff; }
table.heat td.mismatch { outline: 3px dashed #000; outline-offset: -4px; font-weight: bold; }
table.heat th.config { text-align: right; font-family: monospace; font-weight: normal; }
.bar { width: 480px; height: 16px; background: linear-gradient(to right, {stops}); }
.ticks { width: 480px; display: flex; justify-content: space-between; font-size: 12px; }
table.runs td, table.runs th { border-bottom: 1px solid #ccc; font-size: 12px; }
code, .mono { font-family: monospace; }
"""


def page(document: dict[str, Any]) -> str:
    """The whole report, one self-contained HTML page (no script, style or font fetched)."""
    stops = ", ".join(VIRIDIS)
    failed = sum(not run["matches"] for run in document["runs"])
    verdict = (f"all {len(document['runs'])} runs match serial SGD" if not failed else
               f"{failed} of {len(document['runs'])} runs differ from serial SGD")  # fmt: skip
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>syncsgd verify: does the result depend on P?</title>",
             f"<style>{STYLE.replace('{stops}', stops)}</style></head><body>",
             "<h1>Every run against serial SGD</h1>",
             f'<p id="verdict">{html.escape(verdict)}. Exact mode must be bitwise; float mode '
             "within the tolerance (stated per run below).</p>",
             heatmap(document), legend(),
             "<h2>Where each run first left serial SGD</h2>", runs_table(document),
             "<h2>How it was made</h2>", provenance(document),
             '<script id="data" type="application/json">'
             + jsonout.dumps(document, default=str).replace("</", "<\\/") + "</script>",
             "</body></html>"]  # fmt: skip
    return "\n".join(parts) + "\n"


def heatmap(document: dict[str, Any]) -> str:
    """The heatmap as a table: a row per configuration, a column per P."""
    head = "".join(f'<th scope="col">P = {ranks}</th>' for ranks in document["ranks"])
    rows = []
    for name, runs in grid(document):
        cells = []
        for run in runs:
            if run is None:
                cells.append('<td class="cell">n/a</td>')
                continue
            at = position(run)
            kind = "cell" if run["matches"] else "cell mismatch"
            text = "<br>".join(html.escape(line) for line in cell_text(run))
            cells.append(
                f'<td class="{kind}" style="background:{colour(at)};color:{ink(at)}" '
                f'data-ranks="{run["ranks"]}" data-config="{html.escape(name)}" '
                f'data-rel="{run["rel_diff"]!r}" data-ulp="{run["max_ulp"]}" '
                f'data-bitwise="{str(run["bitwise"]).lower()}">{text}</td>')  # fmt: skip
        rows.append(f'<tr><th class="config" scope="row">{html.escape(name)}</th>'
                    f"{''.join(cells)}</tr>")  # fmt: skip
    return (f'<table class="heat" id="heatmap"><thead><tr><th>algorithm precision mode K '
            f"optimizer</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def legend() -> str:
    """The colour scale, stated."""
    ticks = "".join(f"<span>1e{exponent:.0f}</span>"
                    for exponent in range(int(FLOOR), int(CEILING) + 1, 3))  # fmt: skip
    return (f'<p id="scale">{html.escape(SCALE_TEXT)}; ✗ and a dashed frame: a run that '
            f'should match and does not.</p><div class="bar"></div><div class="ticks">{ticks}'
            "</div>")


def runs_table(document: dict[str, Any]) -> str:
    """Every run's numbers, as in the JSON."""
    from syncsgd.apps.verify_grid import label

    head = ("<tr><th>configuration</th><th>P</th><th>relative</th><th>max ULP</th>"
            "<th>bitwise</th><th>first step</th><th>first tensor</th><th>tolerance</th>"
            "<th>SHA-256</th></tr>")  # fmt: skip
    rows = []
    for run in document["runs"]:
        tolerance = "bitwise" if run["tolerance"] is None else f"{run['tolerance']:g}"
        values = [label(run), run["ranks"], relative_text(run["rel_diff"]), run["max_ulp"],
                  "yes" if run["bitwise"] else "no",
                  "-" if run["first_diff_step"] is None else run["first_diff_step"],
                  run["first_diff_param"] or "-", tolerance, run["sha256"]]  # fmt: skip
        cells = "".join(f"<td>{html.escape(str(value))}</td>" for value in values)
        rows.append(f'<tr class="run">{cells}</tr>')
    return f'<table class="runs" id="runs">{head}{"".join(rows)}</table>'


def provenance(document: dict[str, Any]) -> str:
    """The command line, the versions, the machine."""
    versions = document["versions"]
    listed = ", ".join(f"{name} {value}" for name, value in versions.items()
                       if value is not None and name != "mpi")  # fmt: skip
    mpi = versions.get("mpi") or "none (thread ranks)"
    machine = document["machine"]
    return (f'<p>Command: <code id="command">{html.escape(document["command"])}</code></p>'
            f'<p id="versions">Versions: {html.escape(listed)}; MPI library: '
            f"{html.escape(mpi)}</p>"
            f'<p id="machine">Machine: {html.escape(str(machine["cpu"]))}, '
            f"{machine['cores']} cores ({machine['usable_cores']} usable), "
            f"{html.escape(str(machine['system']))}</p>")  # fmt: skip


def write_html(document: dict[str, Any], path: str) -> None:
    """Write the page, atomically."""
    write_text(path, page(document))


def check_matplotlib() -> None:
    """RuntimeError, before any run, if the figures cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--png/--svg/--pdf need matplotlib: pip install 'syncsgd[plot]'"
                           ) from None  # fmt: skip


def write_figure(document: dict[str, Any], path: str, kind: str) -> None:
    """The heatmap alone, as `kind` (png, svg or pdf), atomically, on a 16:9 slide."""
    from syncsgd.util import figures

    if kind not in figures.FORMATS:
        raise ValueError(f"cannot write {path}: a figure is written as .png, .svg or .pdf")
    figure = heatmap_figure(document)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=kind, dpi=figures.SLIDE_DPI)


def heatmap_figure(document: dict[str, Any]) -> Any:
    """The slide: a cell per configuration and P, viridis by the distance, 14-point text or more."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    from syncsgd.util import figures

    rows = grid(document)
    columns = document["ranks"]
    shade = np.array([[np.nan if run is None else position(run) for run in runs]
                      for _, runs in rows])  # fmt: skip
    figure = figures.new_figure(layout="constrained")
    axes = figure.add_subplot()
    scale = Normalize(FLOOR, CEILING)
    # cells as a mesh, not an image: the legibility check sees what is behind each text
    values = np.ma.masked_invalid(FLOOR + shade * (CEILING - FLOOR))
    image = axes.pcolormesh(np.arange(len(columns) + 1) - 0.5, np.arange(len(rows) + 1) - 0.5,
                            values, cmap=colormaps["viridis"], norm=scale)  # fmt: skip
    axes.invert_yaxis()
    axes.patch.set_visible(False)  # every cell is drawn: nothing shows of the axes behind them
    points = figures.MIN_POINTS if len(rows) > 8 or len(columns) > 6 else figures.TEXT_POINTS
    for row, (_, runs) in enumerate(rows):
        for column, run in enumerate(runs):
            if run is None:
                continue
            lines = cell_text(run)[:2] + (["✗"] if not run["matches"] else [])
            axes.text(column, row, "\n".join(lines), ha="center", va="center", fontsize=points,
                      color=ink(position(run)), fontweight="normal" if run["matches"] else "bold")
    axes.set_xticks(range(len(columns)), [f"P = {ranks}" for ranks in columns])
    axes.set_yticks(range(len(rows)), [name for name, _ in rows])
    axes.xaxis.tick_top()
    axes.tick_params(labelsize=points)
    bar = figure.colorbar(image, ax=axes, fraction=0.05)
    bar.set_label("log10 relative distance from serial SGD\n(dark: bitwise or below 1e-18)",
                  fontsize=points)  # fmt: skip
    bar.ax.tick_params(labelsize=points)
    return figure
