"""Figures for the guided explanation ("How it works"): each draws one idea from recorded step events.

    row_figure(event, text)                  the adjacency-matrix row of the step's last token, before the step
    retrieval_figure(event)                  the draft tree grown layer by layer (a slider over depths)
    passes_figure({"hot": events, ...})      tokens produced against forward passes, and tokens per forward pass
    tree_size_table_figure(table)            tree size against expected tokens per forward pass and its cost

Each takes ``compact=True`` for a phone (a plot about 330 px wide): titles wrapped to ``TITLE_CHARS``
(``retitle``), panels stacked, legends under the plot. A row that was never written is all zeros (an empty row);
``row_before`` returns it as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .charts import accepted_lengths
from .palette import BLACK, BLUE, COMPACT, GREY, LIGHT_GREY, VERMILLION, discrete_colorscale, legend_rows, wrap
from .trace import LABEL_CHARS, TokenNamer, label, quoted
from .tree_fig import LABEL_W, elbow, figure_layout, label_chars
from .tree_layout import node_sources, tree_layout

if TYPE_CHECKING:
    from tr_core.events import StepEvent

UNUSED, DRAFTED = range(2)
# By depth, root first: one green, darker near the root (blue and orange stay the accepted path and the bonus).
LAYER_COLOURS = [BLACK, "#00664A", "#009E73", "#3DBF96", "#85D9BE", "#B8EBDA"]
DRAFT_GREEN = "#85D9BE"  # a matrix cell a draft was taken from (light, under black text)
TITLE_CHARS = 38  # a compact title's lines: about 330 px at COMPACT.title_font
LEGEND_ROW_PX = 22


def _lines(title: str) -> int:
    return title.count("<br>") + 1 if title else 0


def retitle(fig: go.Figure, title: str) -> go.Figure:
    """Give a compact figure ``title`` (``<br>`` lines) at its top: the top margin and the height grow by the lines
    it adds to the old title, so the plot keeps its size and whatever sits under the title (a legend placed from
    the top, subplot titles) moves down with it. ``retitle(fig, wrap(text, TITLE_CHARS))``."""
    grow = round(COMPACT.title_font * 1.35) * (_lines(title) - _lines(str(fig.layout.title.text or "")))
    old = fig.layout.height
    height = old + grow
    if fig.layout.legend.yref == "container" and fig.layout.legend.y is not None:
        fig.update_layout(legend_y=1 - ((1 - fig.layout.legend.y) * old + grow) / height)
    # plotly sets a title of several lines about a line too high for its anchor: one more line down
    return fig.update_layout(height=height, margin_t=fig.layout.margin.t + grow, title=dict(
        text=title, font=dict(size=COMPACT.title_font), x=0, xref="paper", y=1 - (8 + COMPACT.title_font) / height,
        yanchor="top"))


def legend_below(fig: go.Figure, names: Sequence[str], gap_px: int, plot_px: int) -> int:
    """Put a compact figure's horizontal legend ``gap_px`` under the plot area (``plot_px`` high); returns the
    bottom margin it needs."""
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-gap_px / plot_px, x=0,
                                  font=dict(size=COMPACT.legend_font)))
    return gap_px + legend_rows(names, COMPACT) * LEGEND_ROW_PX + 8


def row_before(event: StepEvent, token: int) -> list[int]:
    """The matrix row of ``token`` as the step found it (the row retrieval read), from ``rows_updated``."""
    for row in event.rows_updated:
        if row.token == token:
            return list(row.old)
    raise KeyError(f"step {event.step} did not touch the row of token {token}")


def is_empty(row: Sequence[int]) -> bool:
    """A row never written holds zeros only (the matrix starts as zeros)."""
    return not any(row)


def children_ranks(event: StepEvent, node: int) -> list[int]:
    """The ranks the tree template takes from ``node``'s row: ``[0, 1, 2]`` for a node with three children (a child
    copied from the context, rank -1, is not from the row)."""
    return [r for r, p in zip(event.tree_ranks, event.tree_parents) if p == node and r >= 0]


def row_figure(event: StepEvent, text: TokenNamer, compact: bool = False) -> go.Figure:
    """One heatmap row: the last token's ``k`` candidates before the step (``customdata``: ids, ``z``: whether a
    depth-1 draft was taken from that rank), ``(1, k)``; ``compact``: a column, ``(k, 1)``, rank 0 on top."""
    root = event.tree_tokens[0]
    row = row_before(event, root)
    used = set(children_ranks(event, 0))
    codes = [[DRAFTED if r in used else UNUSED for r in range(len(row))]]
    hover = [[f"rank {r}: {quoted(text(t))} (id {t})<br>"
              + ("drafted as a depth-1 guess" if r in used else "kept in the row, not drafted by this tree")
              for r, t in enumerate(row)]]
    cells = [[label(text(t), 14 if compact else 9) for t in row]]
    grid = dict(z=codes, customdata=[row], text=cells, hovertext=hover)
    if compact:  # one cell per line: a phone's width holds a token's text, not eight of them
        grid = {key: [list(column) for column in zip(*value)] for key, value in grid.items()}
    fig = go.Figure(go.Heatmap(
        **grid, texttemplate="%{text}", textfont=dict(size=14, color="black"),
        hovertemplate="%{hovertext}<extra></extra>", colorscale=discrete_colorscale([LIGHT_GREY, DRAFT_GREEN]),
        zmin=0, zmax=1, showscale=False, xgap=3, ygap=3))
    legend = [("taken as a depth-1 draft", DRAFT_GREEN), ("kept, not drafted", LIGHT_GREY)]
    for name, colour in legend:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour)))
    title = (f"decoding step {event.step}: the row of the last token {quoted(text(root))} in the adjacency matrix, "
             "read before the step")
    ranks = dict(tickvals=list(range(len(row))), ticktext=[f"rank {r}" for r in range(len(row))], fixedrange=True)
    token = dict(tickvals=[0], ticktext=[f"<b>{label(text(root))}</b>"], fixedrange=True)
    if compact:
        plot_px = 34 * len(row)
        fig.update_layout(xaxis=dict(token, side="top"), yaxis=dict(ranks, autorange="reversed"),
                          plot_bgcolor="white", height=plot_px)
        bottom = legend_below(fig, [n for n, _ in legend], 12, plot_px)
        fig.update_layout(height=plot_px + 40 + bottom, margin=dict(l=COMPACT.side, r=COMPACT.side, t=40, b=bottom))
        return retitle(fig, wrap(title, TITLE_CHARS))
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)), xaxis=dict(ranks, side="top"),
        yaxis=dict(token, autorange="reversed"),
        height=280, margin=dict(l=20, r=20, t=110, b=60), plot_bgcolor="white",
        legend=dict(orientation="h", yanchor="top", y=-0.05, x=0))
    return fig


def _layer_traces(event: StepEvent, depth: int, chars: int = LABEL_CHARS) -> tuple[dict, dict]:
    """Layer ``depth`` of the tree: its edges (a line trace) and its nodes (``customdata`` = node index)."""
    pos = tree_layout(tuple(event.tree_parents))
    shown = [i for i in range(len(event.tree_tokens)) if pos.x[i] == depth]
    sources = node_sources(event)
    hover = []
    for i in shown:
        if i == 0:
            hover.append(f"<b>{quoted(event.tree_text[0])}</b> the last token: the root")
        else:
            p = event.tree_parents[i]
            where = ("copied from the context, after" if sources[i] == "context"
                     else f"rank {event.tree_ranks[i]} in the row of")
            hover.append(f"<b>{quoted(event.tree_text[i])}</b> layer {depth}: {where} {quoted(event.tree_text[p])} "
                         f"(node {p})")
    colour = LAYER_COLOURS[min(depth, len(LAYER_COLOURS) - 1)]
    name = "root: the last token" if depth == 0 else f"layer {depth}"
    edges = [elbow(pos.x[p], pos.y[p], pos.x[i], pos.y[i]) for i in shown if (p := event.tree_parents[i]) >= 0]
    xs = [x for e in edges for x in [*(x for x, _ in e), None]]
    ys = [y for e in edges for y in [*(y for _, y in e), None]]
    lines = dict(type="scatter", mode="lines", name=f"edges into {name}", x=xs, y=ys, showlegend=False,
                 line=dict(color=GREY, width=1.5), hoverinfo="skip")
    nodes = dict(type="scatter", mode="markers+text", name=name, x=[pos.x[i] for i in shown],
                 y=[pos.y[i] for i in shown], customdata=shown,
                 text=[label(event.tree_text[i], chars) for i in shown],
                 hovertext=hover, hovertemplate="%{hovertext}<extra></extra>", textposition="middle right",
                 textfont=dict(size=12, color="#222222"), marker=dict(size=12, color=colour))
    return lines, nodes


def retrieval_figure(event: StepEvent, compact: bool = False) -> go.Figure:
    """The step's draft tree as retrieval builds it, one layer (depth) after another: traces ``2d`` and ``2d + 1``
    are layer ``d``'s edges and nodes (``customdata``: node indices, so that the node traces together list every
    node in BFS order). A slider (which works without plotly frames) shows layers 0..d; it opens on the whole tree.
    """
    pos = tree_layout(tuple(event.tree_parents))
    depth = pos.depth
    chars = label_chars(pos, compact) if compact else LABEL_CHARS
    traces = [t for d in range(depth + 1) for t in _layer_traces(event, d, chars)]
    layout = figure_layout([pos], compact=compact)
    layout["xaxis"].update(range=[-0.25, depth + LABEL_W + 0.3], tickvals=list(range(depth + 1)),
                           ticktext=["root"] + [f"layer {d}" for d in range(1, depth + 1)], title=None)
    layout["yaxis"]["range"] = [-(pos.rows - 1) - 0.8, 0.8]
    title = (f"decoding step {event.step}: the draft tree, {len(event.tree_tokens)} nodes in {depth} layers (slide to "
             "grow it layer by layer)")
    layout["title"]["text"] = "" if compact else title
    layout["height"] = max(380, 34 * pos.rows + 200)
    layout["margin"] = dict(l=20, r=20, t=90, b=90)
    layout["sliders"] = [dict(
        active=depth, x=0, len=1, y=0, yanchor="top", pad=dict(t=20),
        currentvalue=dict(prefix="built so far: ", font=dict(size=12, color="#444444")),
        steps=[dict(label="root" if d == 0 else f"layer {d}", method="restyle",
                    args=[{"visible": [t // 2 <= d for t in range(len(traces))]}]) for d in range(depth + 1)])]
    fig = go.Figure(data=traces, layout=layout)
    if compact:  # the legend under the slider (about 90 px), the title above the plot
        plot_px = 34 * pos.rows + 40
        names = [t["name"] for t in traces if t.get("showlegend", True)]
        bottom = legend_below(fig, names, 100, plot_px)
        fig.update_layout(height=plot_px + 20 + bottom, margin=dict(l=COMPACT.side, r=COMPACT.side, t=20, b=bottom))
        retitle(fig, wrap(title, TITLE_CHARS))
    return fig


def passes_figure(runs: Mapping[str, Sequence[StepEvent]], names: Mapping[str, str] | None = None,
                  compact: bool = False) -> go.Figure:
    """Left (``compact``: top): tokens produced against forward passes, one line per run and plain decoding's
    diagonal (one token per forward pass); right (below): the share of each run's passes that produced 1, 2, 3...
    tokens. Run ``m``'s line is trace ``1 + i`` (after the diagonal), its bars follow all lines."""
    names = names or {}
    two = len(runs) > 1
    if compact:
        fig = make_subplots(rows=2, cols=1, row_heights=[0.58, 0.42], vertical_spacing=0.17,
                            subplot_titles=("tokens produced against forward passes",
                                            "tokens per forward pass (bonus included)"))
    else:
        fig = make_subplots(rows=1, cols=2, column_widths=[0.58, 0.42], horizontal_spacing=0.1,
                            subplot_titles=("tokens produced against forward passes of the model",
                                            "tokens per forward pass<br>(bonus token included)"))
    bars = dict(row=2, col=1) if compact else dict(row=1, col=2)
    longest = max(e.total_tokens for events in runs.values() for e in events[-1:])
    fig.add_trace(go.Scatter(x=[0, longest], y=[0, longest], mode="lines",
                             name=f"plain decoding: 1 token per {'pass' if compact else 'forward pass'}",
                             line=dict(color=BLACK, dash="dot", width=2), hoverinfo="skip"), row=1, col=1)
    styles = {}
    for index, (key, events) in enumerate(runs.items()):
        colour, dash = (BLUE, "solid") if key == "hot" or not two else (VERMILLION, "dash")
        styles[key] = colour
        last = events[-1]
        name = names.get(key, key)
        passes = "passes" if compact else "forward passes"
        fig.add_trace(go.Scatter(
            x=[0] + [e.total_steps for e in events], y=[0] + [e.total_tokens for e in events], mode="lines+markers",
            name=f"{name}: {last.total_tokens} tokens in {last.total_steps} {passes}",
            line=dict(color=colour, dash=dash, width=3),
            marker=dict(size=5), hovertemplate=f"{name}<br>after %{{x}} forward passes: %{{y}} tokens<extra></extra>"),
            row=1, col=1)
    for key, events in runs.items():
        counts = accepted_lengths(events)
        fig.add_trace(go.Bar(x=list(counts), y=[100 * c / len(events) for c in counts.values()],
                             customdata=list(counts.values()), name=names.get(key, key), showlegend=False,
                             marker=dict(color=styles[key]),
                             hovertemplate=f"{names.get(key, key)}: %{{customdata}} passes (%{{y:.0f}}%) produced "
                                           "%{x} tokens<extra></extra>"), **bars)
    fig.update_annotations(font_size=12 if compact else 13)  # the subplot titles
    fig.update_xaxes(title_text="forward passes", rangemode="tozero", gridcolor="#EEEEEE", row=1, col=1)
    fig.update_yaxes(title_text="tokens produced", rangemode="tozero", gridcolor="#EEEEEE", row=1, col=1)
    fig.update_xaxes(title_text="accepted drafts + the bonus token", dtick=1, **bars)
    fig.update_yaxes(title_text="% of passes", gridcolor="#EEEEEE", **bars)
    if not compact:
        return fig.update_layout(height=440, plot_bgcolor="white", barmode="group",
                                 margin=dict(l=60, r=20, t=60, b=60),
                                 legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
    plot_px = 520
    bottom = legend_below(fig, [t.name for t in fig.data if t.showlegend is not False], 50, plot_px)
    return fig.update_layout(height=plot_px + 30 + bottom, plot_bgcolor="white", barmode="group",
                             margin=dict(l=50, r=COMPACT.side + 4, t=30, b=bottom))


def tree_size_table_figure(table: Sequence[dict], marks: Mapping[str, int] | None = None,
                           compact: bool = False, elsewhere: tuple[str, Sequence[float]] | None = None) -> go.Figure:
    """Per tree size N (``table`` rows: nodes, expected_accepted, step_ms, predicted_speedup): the expected tokens
    per forward pass, the cost of that pass relative to a one-token pass, and their ratio, the predicted speedup.
    Traces 0, 1, 2 in that order; ``marks`` draws a labelled vertical line at named sizes. ``compact``: shorter
    legend names, under the plot. ``elsewhere``: ``(device, speedups by row)``, the same prediction with another
    device's modelled step times (``tr_core.projection``), trace 3, dotted."""
    n = [row["nodes"] for row in table]
    plain_ms = table[0]["step_ms"]
    lines = [
        ("expected tokens per forward pass, bonus token included (acceptance statistics)",
         [row["expected_accepted"] for row in table], BLUE, "solid"),
        ("cost of the pass, in one-token passes (measured t(N))", [row["step_ms"] / plain_ms for row in table],
         VERMILLION, "dash"),
        ("predicted speedup = tokens per forward pass / cost", [row["predicted_speedup"] for row in table], BLACK,
         "solid"),
    ]
    if compact:
        short = ["tokens per forward pass, bonus included", "cost of the pass, in one-token passes",
                 "predicted speedup = tokens / cost"]
        lines = [(name, *rest) for name, (_, *rest) in zip(short, lines)]
    if elsewhere is not None:
        device, speedups = elsewhere
        lines.append((f"predicted speedup on an {device} (a model of its step time, not measured)", list(speedups),
                      GREY, "dot"))
    fig = go.Figure()
    for name, ys, colour, dash in lines:
        fig.add_trace(go.Scatter(x=n, y=ys, name=name, mode="lines", line=dict(color=colour, dash=dash, width=3),
                                 hovertemplate=f"N = %{{x}} nodes: %{{y:.2f}}<extra>{name.split(' (')[0]}</extra>"))
    for name, size in (marks or {}).items():
        fig.add_vline(x=size, line=dict(color=GREY, width=1, dash="dot"))
        # on a phone the label of the largest size would run off the plot's right edge: it sits left of its line
        side = "right" if compact and size >= max(n) else "left"
        fig.add_annotation(x=size, y=1, yref="paper", text=name, showarrow=False, xanchor=side, yanchor="top",
                           font=dict(size=12, color="#444444"))
    title = "draft-tree size: more guesses accept more tokens, but cost more to check"
    fig.update_layout(title=dict(text=title, font=dict(size=14)),
                      xaxis=dict(title="tree size N (nodes, the root included)", gridcolor="#EEEEEE"),
                      yaxis=dict(title="× (relative to one plain pass)", gridcolor="#EEEEEE", rangemode="tozero"),
                      height=440, plot_bgcolor="white", margin=dict(l=60, r=20, t=60, b=60), hovermode="x unified",
                      legend=dict(orientation="h", yanchor="top", y=-0.18, x=0))
    if not compact:
        return fig
    plot_px = 300
    bottom = legend_below(fig, [name for name, *_ in lines], 55, plot_px)
    fig.update_layout(title_text="", height=plot_px + 20 + bottom, margin=dict(l=50, r=COMPACT.side + 4, t=20,
                                                                               b=bottom))
    return retitle(fig, wrap(title, TITLE_CHARS))
