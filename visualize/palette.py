"""Colours, marker shapes and sizes, one place for every figure.

Colours are Okabe & Ito's palette (distinguishable with the common colour-vision deficiencies), and each node
role in the draft tree also has its own marker shape, so the story survives a grey-scale print. The same role keeps
its colour across figures: blue is always the accepted path, orange the bonus token.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Sequence

# Okabe & Ito (2008), "Color Universal Design".
BLACK = "#000000"
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
BLUISH_GREEN = "#009E73"
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
REDDISH_PURPLE = "#CC79A7"
GREY = "#BBBBBB"
LIGHT_GREY = "#E4E4E4"
DARK_GREY = "#6E6E6E"  # not Okabe & Ito's: a ninth line colour
BROWN = "#8C5A2B"  # nor this: a tenth

# Draft-tree node roles: (legend name, fill colour, marker symbol, marker size).
NODE_ROLES: dict[str, tuple[str, str, str, int]] = {
    "root": ("root (last token)", BLACK, "square", 13),
    "accepted": ("accepted path", BLUE, "circle", 13),
    "bonus": ("bonus token (model's own)", ORANGE, "star", 17),
    "broke": ("rejected where the path stopped", VERMILLION, "x", 12),
    "rejected": ("rejected", GREY, "circle-open", 9),
}

# Where a draft node came from (``StepEvent.tree_sources``), told by its marker's shape while its colour stays its
# role's: (legend name, {role: symbol}). A template's matrix nodes (no sources recorded) keep NODE_ROLES' shapes.
NODE_SOURCES: dict[str, tuple[str, dict[str, str]]] = {
    "best-first": ("best-first from the matrix",
                   {"accepted": "square", "broke": "square-x-open", "rejected": "square-open"}),
    "context": ("copied from the context",
                {"accepted": "diamond", "broke": "diamond-x-open", "rejected": "diamond-open"}),
    "datastore": ("retrieved from the datastore (REST)",
                  {"accepted": "triangle-up", "broke": "triangle-up-open-dot", "rejected": "triangle-up-open"}),
    "window": ("a guess of the Jacobi window (Lookahead)",
               {"accepted": "hexagon", "broke": "hexagon-open-dot", "rejected": "hexagon-open"}),
    "n-gram": ("an n-gram from the pool (Lookahead)",
               {"accepted": "pentagon", "broke": "pentagon-open-dot", "rejected": "pentagon-open"}),
}
SOURCE_KEY = "#444444"  # a source's legend key: its shape, in a colour no role uses
CONTEXT_EDGE = BLUISH_GREEN  # the edges into nodes copied from the context

# Adjacency-matrix cells: (legend name, colour), in the order of their code in the heatmap. The update rewrites
# every row of a tree token; only a token new to its row (or dropped from it) is a change worth the eye.
CELL_ROLES: list[tuple[str, str]] = [
    ("same token, same rank", "#F3F3F3"),
    ("same token, moved to another rank", LIGHT_GREY),
    ("changed: new in the row, or dropped from it", YELLOW),
    ("on the accepted path", SKY_BLUE),
]

# Decoding methods in charts: colour and line dash, so lines differ in shape as well as colour.
METHOD_STYLE: dict[str, tuple[str, str]] = {
    "plain": (BLACK, "dot"),
    "pld": (VERMILLION, "dash"),
    "tr": (BLUE, "solid"),
    "suffix": (ORANGE, "dashdot"),
    "rest": (DARK_GREY, "longdash"),
    "lookahead": (BROWN, "dashdot"),
    "tr-context": (BLUISH_GREEN, "longdash"),
    "tr-dynamic": (SKY_BLUE, "longdashdot"),
    "tr-plus": (REDDISH_PURPLE, "solid"),
}
_SPARE = [(BLUISH_GREEN, "dashdot"), (REDDISH_PURPLE, "longdash"), (ORANGE, "longdashdot"), (SKY_BLUE, "solid")]
BAR_PATTERNS = ["", "/", ".", "x", "\\", "+", "-", "|"]


def method_style(method: str, index: int = 0) -> tuple[str, str]:
    """``(colour, dash)`` for a method; unknown names take spare styles by ``index`` so two never share one."""
    return METHOD_STYLE.get(method, _SPARE[index % len(_SPARE)])


def discrete_colorscale(colours: list[str]) -> list[list]:
    """A plotly colourscale that maps the integer codes ``0..n-1`` (with ``zmin=0, zmax=n-1``) to flat colours:
    ``[a, b]`` -> ``[[0, a], [0.5, a], [0.5, b], [1, b]]``."""
    n = len(colours)
    if n == 1:
        return [[0, colours[0]], [1, colours[0]]]
    scale = []
    for i, colour in enumerate(colours):
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    return scale


@dataclass(frozen=True)
class Look:
    """Sizes for one target width: ``width`` is the narrowest plot a figure is laid out for (a wider one only adds
    room), ``font`` its labels', ``title_chars`` where its title wraps, ``side`` its left and right margins."""

    width: int
    font: int
    title_font: int
    title_chars: int
    legend_font: int
    side: int


WIDE = Look(width=760, font=11, title_font=14, title_chars=92, legend_font=12, side=20)  # a laptop's column
COMPACT = Look(width=360, font=10, title_font=12, title_chars=50, legend_font=11, side=8)  # a phone


def look(compact: bool) -> Look:
    return COMPACT if compact else WIDE


def wrap(text: str, chars: int) -> str:
    """Break ``text`` at spaces into ``<br>``-joined lines of at most ``chars`` (a token's text shows its spaces
    as '␣', so it is never broken): ``wrap("a bb ccc", 4)`` -> ``'a bb<br>ccc'``."""
    return "<br>".join(textwrap.wrap(text, chars, break_long_words=False, break_on_hyphens=False))


def legend_rows(names: Sequence[str], lk: Look) -> int:
    """How many rows a horizontal legend of ``names`` takes at ``lk.width`` (plotly wraps its items, each a
    40 px key and its text): ``legend_rows(["a" * 40] * 3, COMPACT)`` -> ``3``."""
    rows, used, room = 1, 0.0, lk.width - 2 * lk.side
    for name in names:
        item = 40 + len(name) * lk.legend_font * 0.58
        if used and used + item > room:
            rows, used = rows + 1, 0.0
        used += item
    return rows


# Every figure sent to a browser carries its template: plotly's default one is about 7 KB of JSON, mostly defaults
# for trace types and subplots these figures never draw (3D scenes, polar, geo, carpets, ...). A browser session
# keeps the latest value of every figure on the server (gradio's per-session config), and every streamed frame sends
# them again, so the figures here use the default template cut to what they draw: the same look, about a quarter
# of the bytes.
SLIM_TEMPLATE = "token-recycling"
DRAWN_TRACES = ("scatter", "bar", "heatmap")
DRAWN_LAYOUT = ("autotypenumbers", "colorway", "font", "hovermode", "hoverlabel", "paper_bgcolor", "plot_bgcolor",
                "xaxis", "yaxis", "shapedefaults", "annotationdefaults", "title", "colorscale", "coloraxis")


def use_slim_template() -> str:
    """Register ``SLIM_TEMPLATE`` (plotly's default template, only what ``DRAWN_TRACES`` and ``DRAWN_LAYOUT`` use)
    and make it plotly's default in this process; returns its name."""
    import plotly.graph_objects as go
    import plotly.io as pio

    if SLIM_TEMPLATE not in pio.templates:
        full = pio.templates["plotly"].to_plotly_json()
        pio.templates[SLIM_TEMPLATE] = go.layout.Template(
            data={k: v for k, v in full["data"].items() if k in DRAWN_TRACES},
            layout={k: v for k, v in full["layout"].items() if k in DRAWN_LAYOUT})
    pio.templates.default = SLIM_TEMPLATE
    return SLIM_TEMPLATE
