"""The adjacency-matrix rows a step touched, before and after its update, as two heatmaps side by side.

Each row is one tree token (``RowUpdate.token``), each column a rank ``0..k-1``, each cell the candidate token's
text. Rows of accepted tokens come first (root first, in path order), then the other tree tokens in BFS order,
``max_rows`` at most. A cell's colour says what the step did to it:

    kept      the same token at the same rank before and after
    replaced  before: overwritten by this step; after: written by this step
    accepted  before: the draft drawn from this cell that the model accepted (the parent's row, the child's rank);
              after: the model's own next token after an accepted node (the next accepted draft, or the bonus)

    fig = matrix_figure(events[12])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import CELL_ROLES, discrete_colorscale
from .trace import TokenNamer, label, quoted, text_lookup

if TYPE_CHECKING:
    from tr_core.events import RowUpdate, StepEvent

KEPT, REPLACED, ACCEPTED = range(3)
CELL_CHARS = 8  # a cell is about 70 px wide at a laptop's width


def shown_rows(event: StepEvent, max_rows: int = 12) -> list[RowUpdate]:
    """The updated rows to draw: accepted tokens first, in path order, then tree order; ``max_rows`` at most."""
    by_token = {r.token: r for r in event.rows_updated}
    order = [event.tree_tokens[i] for i in event.accepted_path] + list(event.tree_tokens) + list(by_token)
    picked = [t for t in dict.fromkeys(order) if t in by_token]  # first occurrence of each token, in order
    return [by_token[t] for t in picked[:max_rows]]


def accepted_cells(event: StepEvent) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """``(before, after)``: the ``(row token, candidate token)`` pairs that lie on the accepted path.

    Before, a pair is a parent's token and the accepted child's token; after, an accepted node's token and the
    model's prediction there. For path ``[0, 1, 4]`` with tokens ``a, b, c`` and bonus ``d``: before
    ``{(a, b), (b, c)}``, after ``{(a, b), (b, c), (c, d)}``.
    """
    tokens, path = event.tree_tokens, event.accepted_path
    before = {(tokens[p], tokens[c]) for p, c in zip(path, path[1:])}
    after = {(tokens[i], event.predicted[i]) for i in path}
    return before, after


def cell_codes(row: RowUpdate, on_path: set[tuple[int, int]], side: str) -> list[int]:
    """Colour codes for one row, ``side`` being ``"before"`` (``row.old``) or ``"after"`` (``row.new``):
    ``old [5, 6], new [5, 7]`` -> before ``[KEPT, REPLACED]``, after ``[KEPT, REPLACED]``."""
    cells = row.old if side == "before" else row.new
    codes = []
    for rank, token in enumerate(cells):
        if (row.token, token) in on_path:
            codes.append(ACCEPTED)
        else:
            codes.append(KEPT if row.old[rank] == row.new[rank] else REPLACED)
    return codes


def _heatmap(rows: list[RowUpdate], on_path: set, side: str, text: TokenNamer) -> go.Heatmap:
    ids = [r.old if side == "before" else r.new for r in rows]
    verb = {KEPT: "kept", REPLACED: "replaced by this step" if side == "before" else "written by this step",
            ACCEPTED: "on the accepted path"}
    codes = [cell_codes(r, on_path, side) for r in rows]
    hover = [[f"{quoted(text(t))} (id {t})<br>rank {k} in the row of {quoted(text(r.token))}, {side}<br>{verb[c]}"
              for k, (t, c) in enumerate(zip(row_ids, row_codes))]
             for r, row_ids, row_codes in zip(rows, ids, codes)]
    return go.Heatmap(
        z=codes, customdata=ids, text=[[label(text(t), CELL_CHARS) for t in row_ids] for row_ids in ids],
        hovertext=hover, texttemplate="%{text}", textfont=dict(size=11, color="black"),
        hovertemplate="%{hovertext}<extra></extra>", colorscale=discrete_colorscale([c for _, c in CELL_ROLES]),
        zmin=0, zmax=len(CELL_ROLES) - 1, showscale=False, xgap=2, ygap=2, name=side)


def matrix_figure(event: StepEvent, token_text: TokenNamer | None = None, max_rows: int = 12) -> go.Figure:
    """Before/after heatmaps of the rows this step updated. Trace 0 is before (``z``: codes, ``customdata``:
    token ids, ``(rows, k)``), trace 1 after; traces 2.. are legend entries only."""
    text = text_lookup([event], token_text)
    rows = shown_rows(event, max_rows)
    if not rows:
        fig = go.Figure()
        fig.add_annotation(text=f"step {event.step} ({event.method}) updated no adjacency-matrix rows",
                           showarrow=False, font=dict(size=14))
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white")
        return fig
    before, after = accepted_cells(event)
    k = len(rows[0].old)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=("before the step: the drafts came from here",
                                        "after the step: the model's top-k at each node"))
    fig.add_trace(_heatmap(rows, before, "before", text), row=1, col=1)
    fig.add_trace(_heatmap(rows, after, "after", text), row=1, col=2)
    for name, colour in CELL_ROLES:  # heatmaps have no legend of their own
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour, line=dict(color="#888", width=1))))
    path_tokens = {event.tree_tokens[i] for i in event.accepted_path}
    ticks = [(f"<b>{label(text(r.token))}</b>" if r.token in path_tokens else label(text(r.token))) for r in rows]
    fig.update_yaxes(tickvals=list(range(len(rows))), ticktext=ticks, autorange="reversed", row=1, col=1)
    fig.update_xaxes(tickvals=list(range(k)), title_text="rank in the row", side="bottom")
    shown = f"{len(rows)} of {len(event.rows_updated)}" if len(rows) < len(event.rows_updated) else str(len(rows))
    height = 30 * len(rows) + 210
    fig.update_layout(
        title=dict(text=f"step {event.step}: adjacency-matrix rows updated ({shown}; accepted tokens first, bold)",
                   font=dict(size=14), y=1 - 12 / height, yanchor="top"),
        height=height, margin=dict(l=20, r=20, t=125, b=50), plot_bgcolor="white",
        legend=dict(orientation="h", yref="container", y=1 - 42 / height, yanchor="top", x=0))
    return fig
