"""The tree-attention mask of a step's merged draft sequence.

The whole tree is verified in one forward pass as one sequence (nodes in BFS order). Node ``i`` may attend to
node ``j`` only when ``j`` is ``i`` itself or one of its ancestors, so that every branch reads as its own
continuation; the prompt and answer already in the KV cache are visible to every node and are not drawn.

    parents [-1, 0, 0, 1]  ->  row i = who node i sees    1 . . .
                                                          1 1 . .
                                                          1 . 1 .
                                                          1 1 . 1
    fig = mask_figure(events[12])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go

from .palette import BLUE, SKY_BLUE, discrete_colorscale
from .trace import label, quoted

if TYPE_CHECKING:
    from tr_core.events import StepEvent

HIDDEN, SEES, ON_PATH = range(3)
MASK_COLOURS = ["#FFFFFF", SKY_BLUE, BLUE]


def ancestor_mask(parents: Sequence[int]) -> list[list[bool]]:
    """``mask[i][j]`` is True when node ``j`` is node ``i`` or one of its ancestors (``parents[0] == -1``)."""
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def mask_codes(event: StepEvent) -> list[list[int]]:
    """The mask as colour codes: ``HIDDEN``, ``SEES``, or ``ON_PATH`` when both nodes lie on the accepted path."""
    on_path = set(event.accepted_path)
    return [[(ON_PATH if i in on_path and j in on_path else SEES) if seen else HIDDEN for j, seen in enumerate(row)]
            for i, row in enumerate(ancestor_mask(event.tree_parents))]


def mask_figure(event: StepEvent) -> go.Figure:
    """An ``n x n`` heatmap (trace 0; ``z`` codes, row = the attending node, column = the node attended to)
    with each node's index and token as tick labels (the event names every tree token itself)."""
    n = len(event.tree_tokens)
    names = [f"{i} {label(t)}" for i, t in enumerate(event.tree_text)]
    codes = mask_codes(event)
    hover = [[f"node {i} {quoted(event.tree_text[i])} {'sees' if c else 'does not see'} "
              f"node {j} {quoted(event.tree_text[j])}" for j, c in enumerate(row)] for i, row in enumerate(codes)]
    fig = go.Figure(go.Heatmap(
        z=codes, hovertext=hover, hovertemplate="%{hovertext}<extra></extra>", showscale=False, xgap=1, ygap=1,
        colorscale=discrete_colorscale(MASK_COLOURS), zmin=0, zmax=len(MASK_COLOURS) - 1))
    for name, colour in [("sees (ancestor or itself)", SKY_BLUE), ("sees, both on the accepted path", BLUE)]:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour)))
    tick_font = dict(size=11 if n <= 30 else 8)
    cell = 22 if n <= 30 else 11  # px per node: 81 nodes fit in about 900 px
    ticks = dict(tickvals=list(range(n)), ticktext=names, tickfont=tick_font, showgrid=False, zeroline=False)
    fig.update_layout(
        title=dict(text=f"step {event.step}: tree attention over the {n} draft nodes "
                        f"(row = attending node, column = node it attends to; the cached prefix is seen by all)",
                   font=dict(size=13)),
        xaxis=dict(ticks, side="top", tickangle=-90, constrain="domain"),
        yaxis=dict(ticks, autorange="reversed", scaleanchor="x"),
        width=None, height=cell * n + 260, margin=dict(l=20, r=20, t=170, b=20), plot_bgcolor="white",
        legend=dict(orientation="h", yanchor="top", y=-0.01, x=0))
    return fig
