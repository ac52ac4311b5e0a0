"""The adjacency-matrix rows a decoding step rewrote, before and after its update, as two heatmaps.

Each row is one tree token (``RowUpdate.token``), each column a rank ``0..k-1``, each cell the candidate token's
text, whole (wrapped onto a second line when long; the hover has it too). Rows of accepted tokens come first (root
first, in path order), then the other tree tokens in BFS order, ``max_rows`` at most. The update rewrites every
row of a tree token with the model's top-k there, so most cells are rewritten with what they held already; the
colours single out what the step changed:

    same      the same token at the same rank before and after (muted)
    moved     a token in the row before and after, at another rank (muted)
    changed   before: a token the step dropped from the row; after: a token new in the row
    accepted  before: the draft drawn from this cell that the model accepted (the parent's row, the child's rank);
              after: the model's own next token after an accepted node (the next accepted draft, or the bonus)

    fig = matrix_figure(events[12])                   # side by side
    fig = matrix_figure(events[12], compact=True)     # a phone or a narrow column: stacked, COMPACT_RANKS ranks
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import CELL_ROLES, discrete_colorscale, legend_rows, look, wrap
from .trace import TokenNamer, quoted, text_lookup, visible

if TYPE_CHECKING:
    from tr_core.events import RowUpdate, StepEvent

SAME, MOVED, CHANGED, ACCEPTED = range(4)
CELL_FONT = 10
CHAR_EM = 0.7  # a sign is at most about this many font sizes wide ("m", "<", "|" included)
COMPACT_RANKS = 4  # a phone shows the likeliest ranks only, so that each cell is wide enough for a word
COMPACT_ROWS = 8  # and fewer rows, as its two panels are stacked
TICK_PX = 90  # room for the row tokens' labels left of the cells
# the side-by-side figure spans a laptop's page: at 1366 px, about 1180 px inside gradio's margins (narrower places
# take compact=True)
FULL_WIDTH = 1180


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
    ``old [5, 6, 7], new [5, 7, 8]`` -> before ``[SAME, CHANGED, MOVED]`` (6 dropped, 7 moved up),
    after ``[SAME, MOVED, CHANGED]`` (8 is new)."""
    cells, other = (row.old, row.new) if side == "before" else (row.new, row.old)
    codes = []
    for rank, token in enumerate(cells):
        if (row.token, token) in on_path:
            codes.append(ACCEPTED)
        elif other[rank] == token:
            codes.append(SAME)
        else:
            codes.append(MOVED if token in other else CHANGED)
    return codes


def cell_text(text: str, chars: int) -> str:
    """A token's whole text for a cell, whitespace visible, in lines of ``chars`` signs, HTML-escaped:
    ``cell_text(' connection', 6)`` -> ``'␣conne<br>ction'``."""
    shown = visible(text)
    return "<br>".join(escape(shown[i:i + chars], quote=False) for i in range(0, max(1, len(shown)), chars))


def _verb(code: int, side: str, token: int, row: RowUpdate) -> str:
    if code == ACCEPTED:
        return "on the accepted path"
    if code == SAME:
        return "unchanged: rewritten with the same token at the same rank"
    if code == MOVED:
        elsewhere = (row.new if side == "before" else row.old).index(token)
        return f"unchanged token, {'now' if side == 'before' else 'was'} at rank {elsewhere}"
    return "dropped from the row by this step" if side == "before" else "new in the row: written by this step"


def _heatmap(rows: list[RowUpdate], on_path: set, side: str, text: TokenNamer, ranks: int, chars: int) -> go.Heatmap:
    ids = [(r.old if side == "before" else r.new)[:ranks] for r in rows]
    codes = [cell_codes(r, on_path, side)[:ranks] for r in rows]
    hover = [[f"{quoted(text(t))} (id {t})<br>rank {k} in the row of {quoted(text(r.token))}, {side} the step<br>"
              f"{_verb(c, side, t, r)}" for k, (t, c) in enumerate(zip(row_ids, row_codes))]
             for r, row_ids, row_codes in zip(rows, ids, codes)]
    return go.Heatmap(
        z=codes, customdata=ids, text=[[cell_text(text(t), chars) for t in row_ids] for row_ids in ids],
        hovertext=hover, texttemplate="%{text}", textfont=dict(size=CELL_FONT, color="black"),
        hovertemplate="%{hovertext}<extra></extra>", colorscale=discrete_colorscale([c for _, c in CELL_ROLES]),
        zmin=0, zmax=len(CELL_ROLES) - 1, showscale=False, xgap=2, ygap=2, name=side)


def _cell_chars(ranks: int, panels_across: int, compact: bool) -> int:
    """Signs per line that fit a cell at the narrowest width the figure is laid out for: a phone's, or the page's
    full width at a laptop's (where the wide figure belongs: its 2k columns are too many for a column of it)."""
    lk = look(compact)
    width = lk.width if compact else FULL_WIDTH
    cell_px = (width - 2 * lk.side - TICK_PX) / panels_across / ranks - 6
    return max(3, int(cell_px / (CHAR_EM * CELL_FONT)))


def matrix_figure(event: StepEvent, token_text: TokenNamer | None = None, max_rows: int = 12,
                  compact: bool = False) -> go.Figure:
    """Before/after heatmaps of the rows this decoding step rewrote. Trace 0 is before (``z``: codes,
    ``customdata``: token ids, ``(rows, ranks)``), trace 1 after; traces 2.. are legend entries only. Side by
    side; ``compact`` (a phone): before above after, the first ``COMPACT_RANKS`` ranks of ``COMPACT_ROWS`` rows
    at most."""
    text = text_lookup([event], token_text)
    rows = shown_rows(event, min(max_rows, COMPACT_ROWS) if compact else max_rows)
    lk = look(compact)
    if not rows:
        fig = go.Figure()
        fig.add_annotation(text=wrap(f"Decoding step {event.step} ({event.method}) rewrote no adjacency-matrix rows",
                                     lk.title_chars), showarrow=False, font=dict(size=14))
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white")
        return fig
    before, after = accepted_cells(event)
    k = len(rows[0].old)
    ranks = min(k, COMPACT_RANKS) if compact else k
    chars = _cell_chars(ranks, 1 if compact else 2, compact)
    cells = [cell_text(text(t), chars) for r in rows for t in (r.old[:ranks] + r.new[:ranks])]
    lines = max(c.count("<br>") + 1 for c in cells)
    row_px = 14 + 13 * lines
    titles = ("before the step: the drafts came from here", "after: the model's top-k at each node")
    if compact:
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=60 / (2 * row_px * len(rows) + 60),
                            subplot_titles=titles)
        places = [(1, 1), (2, 1)]
    else:
        fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.03, subplot_titles=titles)
        places = [(1, 1), (1, 2)]
    fig.add_trace(_heatmap(rows, before, "before", text, ranks, chars), *places[0])
    fig.add_trace(_heatmap(rows, after, "after", text, ranks, chars), *places[1])
    for name, colour in CELL_ROLES:  # heatmaps have no legend of their own
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour, line=dict(color="#888", width=1))))
    for annotation in fig.layout.annotations:  # the subplot titles
        annotation.font = dict(size=lk.font + 1)
    path_tokens = {event.tree_tokens[i] for i in event.accepted_path}
    ticks = [f"<b>{escape(visible(text(r.token)), quote=False)}</b>" if r.token in path_tokens
             else escape(visible(text(r.token)), quote=False) for r in rows]
    for row, col in places if compact else places[:1]:
        fig.update_yaxes(tickvals=list(range(len(rows))), ticktext=ticks, autorange="reversed", row=row, col=col)
    if not compact:
        fig.update_yaxes(autorange="reversed", row=1, col=2)
    fig.update_xaxes(tickvals=list(range(ranks)), side="bottom")
    fig.update_xaxes(title_text="rank in the row (0 = likeliest)", row=len(places) if compact else 1)
    shown = f"{len(rows)} of {len(event.rows_updated)}" if len(rows) < len(event.rows_updated) else str(len(rows))
    head = wrap(f"Decoding step {event.step}: the adjacency-matrix rows it rewrote ({shown}; accepted tokens "
                "first, in bold)" + (f", ranks 0-{ranks - 1} of {k}" if ranks < k else ""), lk.title_chars)
    note = wrap("Every row of a tree token is rewritten with the model's top-k; yellow marks the tokens that "
                "actually changed.", round(lk.title_chars * 1.15))
    title = f"{head}<br><span style='font-size:{lk.font + 1}px;color:#555'>{note}</span>"
    title_px = 10 + (head.count("<br>") + 1) * round(lk.title_font * 1.35) + (note.count("<br>") + 1) * 16
    legend_px = legend_rows([n for n, _ in CELL_ROLES], lk) * 24
    top = title_px + legend_px + 34  # the subplot titles under the legend
    panels_px = row_px * len(rows) * (2 if compact else 1) + (60 if compact else 0)
    height = panels_px + top + 50
    fig.update_layout(
        title=dict(text=title, font=dict(size=lk.title_font), x=0, xref="paper",
                   y=1 - (8 + lk.title_font) / height, yanchor="top"),  # one line lower: see tree_fig._layout
        height=height, margin=dict(l=lk.side, r=lk.side, t=top, b=50), plot_bgcolor="white",
        legend=dict(orientation="h", yref="container", y=1 - (title_px + 4) / height, yanchor="top", x=0,
                    font=dict(size=lk.legend_font)))
    return fig
