"""Figures for slides: the slide's size, a colour-blind-safe palette, contrast, saving by extension.

A figure is drawn for a 16:9 slide, 13.33 x 7.5 inches (PowerPoint's), which a 1920 x 1080
projector shows at 144 pixels per inch; text is at least 14 points at that size and at least
4.5:1 against what is behind it (WCAG 2's contrast ratio). `legibility` measures both from the
text a figure actually draws. Nothing here imports matplotlib until a figure is made.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

SLIDE = (13.333, 7.5)  # inches: a 16:9 slide
SLIDE_DPI = 144  # 1920 x 1080 pixels
MIN_POINTS = 14.0
MIN_CONTRAST = 4.5
FORMATS = ("png", "svg", "pdf")

# Okabe & Ito (2008), "Color Universal Design": told apart under every common colour blindness.
OKABE_ITO = {
    "orange": "#E69F00", "sky blue": "#56B4E9", "bluish green": "#009E73", "yellow": "#F0E442",
    "blue": "#0072B2", "vermillion": "#D55E00", "reddish purple": "#CC79A7", "black": "#000000",
}  # fmt: skip
LINE_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (1, 1)))
# One colour, marker and dash pattern per algorithm, the same in every figure that draws it
# (the model's, why-the-ring, bench allreduce's): a slide's ring is the next slide's ring.
ALGORITHM_STYLES = {
    "ring": ("#0072B2", "o", "-"),
    "recursive-doubling": ("#E69F00", "s", "--"),
    "rabenseifner": ("#009E73", "D", "-."),
    "tree": ("#D55E00", "^", (0, (5, 1, 1, 1, 1, 1))),
    "naive": ("#CC79A7", "v", (0, (1, 1))),
    "mpi": ("#000000", "X", (0, (8, 2))),
    "numpy-sum": ("#000000", "X", (0, (8, 2))),  # the threads backend's baseline, in mpi's place
    "auto": ("#56B4E9", "P", ":"),
}  # fmt: skip
TEXT_POINTS = 16.0  # the figures' text on a slide: above the 14-point floor

# viridis at 0, 0.1, ..., 1: the hue of a count's colour, from the last quarter (blue) to yellow
VIRIDIS = ("#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c", "#22a884",
           "#44bf70", "#7ad151", "#bddf26", "#fde725")  # fmt: skip
# Relative luminances the steps alternate between: black text is >= 4.7:1 on the dark ones and
# neighbouring steps are >= 3:1 apart (WCAG 2's contrast for what is not text), at any count.
DARK_STEP, LIGHT_STEP = 0.185, 0.67
MIN_STEP_CONTRAST = 3.0


def algorithm_style(name: str, index: int = 0) -> dict[str, Any]:
    """Matplotlib's color, marker and linestyle of an algorithm; others by their index."""
    colour, marker, dashes = ALGORITHM_STYLES.get(
        name, (LINE_COLOURS[index % len(LINE_COLOURS)], MARKERS[index % len(MARKERS)],
               DASHES[index % len(DASHES)]))  # fmt: skip
    return {"color": colour, "marker": marker, "linestyle": dashes}


def series_style(index: int) -> dict[str, Any]:
    """The index-th series of a figure: an Okabe-Ito colour, a marker and dashes of its own."""
    return {"color": LINE_COLOURS[index % len(LINE_COLOURS)],
            "marker": MARKERS[index % len(MARKERS)], "linestyle": DASHES[index % len(DASHES)]}


def slide_axes(axes: Any, points: float = TEXT_POINTS) -> None:
    """Axis labels, ticks, title and legend of `axes` at `points`, a light grid."""
    axes.xaxis.label.set_size(points)
    axes.yaxis.label.set_size(points)
    axes.title.set_size(points)
    axes.tick_params(which="both", labelsize=points - 2)
    axes.grid(True, which="major", alpha=0.3)
    legend = axes.get_legend()
    if legend is not None:
        for text in legend.get_texts():
            text.set_fontsize(points - 2)


def figure_path(text: str) -> str:
    """An argparse type: a figure's file name, whose extension says the format."""
    extension = os.path.splitext(text)[1].lower().lstrip(".")
    if extension not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a figure is written as .png, .svg or .pdf, by its extension")
    return text


INSTALL_PLOT = "pip install -e '.[plot]' (from PyPI: pip install 'syncsgd[plot]')"


def require_matplotlib(what: str = "a figure") -> None:
    """A RuntimeError of one line naming the `plot` extra if matplotlib cannot be imported: call
    it before any work, in the command and in every process that draws."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        raise RuntimeError(f"{what} needs matplotlib: install the plot extra, {INSTALL_PLOT}"
                           ) from None  # fmt: skip


def figure_modules() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas, or a RuntimeError saying how to install them."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg


def new_figure(size: tuple[float, float] = SLIDE, **kwargs: Any) -> Any:
    """A Figure of `size` inches on an Agg canvas."""
    Figure, FigureCanvasAgg = figure_modules()
    figure = Figure(figsize=size, **kwargs)
    FigureCanvasAgg(figure)
    return figure


def save(figure: Any, path: str) -> None:
    """Write `figure` to `path` atomically, as its extension says; a PNG fits 1920 x 1080."""
    from syncsgd.util.files import atomic_path

    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in FORMATS:
        raise ValueError(f"cannot write {path}: a figure is written as .png, .svg or .pdf")
    width, height = figure.get_size_inches()
    dpi = min(1920 / width, 1080 / height)
    with atomic_path(path) as tmp:
        # PNG: zlib's fastest level; slides are flat colours, and a demo writes dozens
        kwargs = {"pil_kwargs": {"compress_level": 1}} if extension == "png" else {}
        figure.savefig(tmp, format=extension, dpi=dpi, metadata=_metadata(extension), **kwargs)


def _metadata(extension: str) -> dict[str, Any]:
    """No creation date in the file: the same figure gives the same bytes."""
    if extension == "pdf":
        return {"CreationDate": None}
    if extension == "svg":
        return {"Date": None}
    return {"Software": None}


def stepped_colour(step: int, steps: int) -> tuple[float, float, float]:
    """The RGB of step 1..steps, white for 0: the hue goes blue to yellow from the last step to the
    first, the lightness alternates dark/light so that neighbours stay apart; the last is dark."""
    if step <= 0:
        return (1.0, 1.0, 1.0)
    at = 1.0 if steps <= 1 else (steps - step) / (steps - 1)  # 1: the first step, 0: the last
    position = (0.25 + 0.75 * at) * (len(VIRIDIS) - 1)
    low = min(int(position), len(VIRIDIS) - 2)
    mix = position - low
    ends = [[int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)] for c in VIRIDIS[low : low + 2]]
    hue = [(1 - mix) * a + mix * b for a, b in zip(*ends, strict=True)]
    return with_luminance(hue, DARK_STEP if (steps - step) % 2 == 0 else LIGHT_STEP)


def with_luminance(rgb: Sequence[float], target: float) -> tuple[float, float, float]:
    """`rgb` mixed with white or scaled towards black, in linear light, to relative luminance
    `target`, rounded to 8 bits a channel."""
    linear = [_linear(c) for c in rgb[:3]]
    now = luminance(rgb)
    if now < target:
        towards_white = (target - now) / (1 - now)
        linear = [c + towards_white * (1 - c) for c in linear]
    else:
        linear = [c * target / now for c in linear]
    encoded = [12.92 * c if c <= 0.0031308 else 1.055 * c ** (1 / 2.4) - 0.055 for c in linear]
    return tuple(round(255 * min(max(c, 0.0), 1.0)) / 255 for c in encoded)  # type: ignore[return-value]


def _linear(channel: float) -> float:
    """An sRGB channel in [0, 1] as linear light."""
    return channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4


def luminance(rgb: Sequence[float]) -> float:
    """WCAG 2's relative luminance of an sRGB colour with channels in [0, 1]."""
    linear = [_linear(c) for c in rgb[:3]]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(first: Sequence[float], second: Sequence[float]) -> float:
    """WCAG 2's contrast ratio of two colours, 1 to 21."""
    lighter, darker = sorted((luminance(first), luminance(second)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def slide_scale(figure: Any) -> float:
    """How much a figure is scaled to fill a 16:9 slide (its points times this: points shown)."""
    width, height = figure.get_size_inches()
    return min(SLIDE[0] / width, SLIDE[1] / height)


def drawn_texts(figure: Any) -> list[tuple[Any, float, tuple[float, ...]]]:
    """(Text artist, points, RGBA) of every text the figure draws, as its renderer sees them."""
    renderer = figure.canvas.get_renderer()
    seen: list[tuple[Any, float, tuple[float, ...]]] = []
    original = renderer.draw_text

    def record(gc: Any, x: float, y: float, s: str, prop: Any, angle: float, ismath: Any = False,
               mtext: Any = None) -> Any:  # fmt: skip
        if s.strip():
            seen.append((mtext, prop.get_size_in_points(), tuple(gc.get_rgb())))
        return original(gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    renderer.draw_text = record
    try:
        figure.draw(renderer)
    finally:
        del renderer.draw_text
    return seen


def legibility(figure: Any) -> list[str]:
    """Every drawn text smaller than 14 points on a slide or below 4.5:1 against its background."""
    from matplotlib.colors import to_rgba

    renderer = figure.canvas.get_renderer()
    texts = drawn_texts(figure)
    fills = _fills(figure, renderer)
    scale = slide_scale(figure)
    problems = []
    for artist, points, ink in texts:
        name = artist.get_text() if artist is not None else "?"
        if points * scale < MIN_POINTS - 1e-6:
            problems.append(f"{name!r}: {points * scale:.1f} points on a slide")
        if artist is None:
            continue
        box = artist.get_window_extent(renderer)
        backgrounds = _backgrounds(artist, box, fills, to_rgba(figure.get_facecolor()))
        worst = min(contrast(ink, back) for back in backgrounds)
        if worst < MIN_CONTRAST:
            problems.append(f"{name!r}: contrast {worst:.2f}:1")
    return problems


def _over_white(rgba: Sequence[float]) -> tuple[float, float, float]:
    """A translucent colour as it shows on white."""
    alpha = rgba[3] if len(rgba) > 3 else 1.0
    return tuple(alpha * c + (1 - alpha) for c in rgba[:3])  # type: ignore[return-value]


def _fills(figure: Any, renderer: Any) -> tuple[Any, Any, Any]:
    """Every filled shape - patches, collections' paths - as display boxes, zorders, RGB rows."""
    import numpy as np
    from matplotlib.collections import Collection
    from matplotlib.patches import Patch

    boxes, orders, colours = [], [], []
    for artist in figure.findobj(lambda a: isinstance(a, (Patch, Collection))):
        if not artist.get_visible() or artist is figure.patch:
            continue
        if isinstance(artist, Patch):
            face: Any = artist.get_facecolor()
            if artist.get_fill() and face[3] > 0:
                boxes.append(artist.get_window_extent(renderer).extents)
                orders.append(artist.get_zorder())
                colours.append(_over_white(face))
            continue
        faces, paths = artist.get_facecolors(), artist.get_paths()
        if len(faces) == 0 or not paths:
            continue
        # every path's corners at once: a collection can hold thousands of cells
        lengths = [len(path.vertices) for path in paths]
        corners = artist.get_transform().transform(np.concatenate([p.vertices for p in paths]))
        starts = np.cumsum([0, *lengths[:-1]])
        extents = np.column_stack([np.minimum.reduceat(corners, starts),
                                   np.maximum.reduceat(corners, starts)])  # fmt: skip
        for index, extent in enumerate(extents):
            colour = faces[index % len(faces)]
            if colour[3] > 0:
                boxes.append(extent)
                orders.append(artist.get_zorder())
                colours.append(_over_white(colour))
    return (np.array(boxes).reshape(-1, 4), np.array(orders, dtype=float),
            np.array(colours).reshape(-1, 3))  # fmt: skip


def _backgrounds(artist: Any, box: Any, fills: tuple[Any, Any, Any],
                 figure_colour: Sequence[float]) -> list[Sequence[float]]:  # fmt: skip
    """The colours behind a text: its own box, or each fill under a fifth of it or more."""
    import numpy as np

    patch = artist.get_bbox_patch()
    if patch is not None and patch.get_fill():
        return [_over_white(patch.get_facecolor())]
    extents, orders, colours = fills
    width = np.minimum(box.x1, extents[:, 2]) - np.maximum(box.x0, extents[:, 0])
    height = np.minimum(box.y1, extents[:, 3]) - np.maximum(box.y0, extents[:, 1])
    area = max(box.width * box.height, 1e-9)
    under = ((orders <= artist.get_zorder()) & (width > 0) & (height > 0)
             & (width * height >= 0.2 * area))  # fmt: skip
    found: list[Sequence[float]] = [tuple(c) for c in np.unique(colours[under], axis=0)]
    return found or [_over_white(figure_colour)]
