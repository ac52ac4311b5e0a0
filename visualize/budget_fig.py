"""The tree budget of one step: expected tokens per second against tree size, as the budget saw them.

    budget_figure(event)    the estimates of ``event.budget_estimates``, the step's size marked

A step of ``tr`` on the ``auto`` tree carries the estimates its size was chosen from (``tr_core.budget``): for every
candidate size (draft nodes, the root not counted), the expected step time and tokens per step, hence tokens per
second. The budget runs the size with the most expected tokens per second, or now and then a neighbour of it, to
keep that neighbour's estimate fresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

from .palette import BLUE, GREY, ORANGE, wrap

if TYPE_CHECKING:
    from tr_core.events import StepEvent

CHOSEN = "chosen: the most expected tokens/s"
BEST = "the most expected tokens/s"
EXPLORED = "explored: a neighbour, to keep its estimate fresh"


def rate_at(est: dict, size: int) -> float:
    """The expected tokens/s at ``size`` draft nodes: the estimate there, or interpolated between the candidate
    sizes around it (a best-first or grafted tree's size need not be a candidate).

    >>> rate_at({"sizes": [0, 4], "tokens_per_s": [20.0, 30.0]}, 1)
    22.5
    """
    sizes, rates = est["sizes"], est["tokens_per_s"]
    if size <= sizes[0]:
        return rates[0]
    for (a, ra), (b, rb) in zip(zip(sizes, rates), zip(sizes[1:], rates[1:])):
        if size <= b:
            return ra + (rb - ra) * (size - a) / (b - a)
    return rates[-1]


def _parts(est: dict) -> str:
    """`` (3 from the matrix + 2 copied from the context)`` for a tree with a context branch, else ``""``."""
    branch = est.get("context_branch")
    return f" ({est['matrix_nodes']} from the matrix + {branch} from the context)" if branch else ""


def budget_title(event: StepEvent) -> str:
    """Why the step drafted the nodes it did, e.g. ``"step 12: 6 draft nodes, the most expected tokens/s (31.2) at
    the step times measured so far"``."""
    est = event.budget_estimates
    if event.budget is None or not est:
        return f"step {event.step}: no tree budget (only Token Recycling on the auto tree adapts its size)"
    if est.get("chosen_by") == "path probabilities":
        return (f"step {event.step}: {event.budget} draft nodes{_parts(est)}, the most expected tokens/s from this "
                f"step's own path probabilities (x{est['calibration']:.2f}, as calibrated) at the step times "
                "measured so far")
    if not est["explored"]:
        return (f"step {event.step}: {event.budget} draft nodes{_parts(est)}, the most expected tokens/s "
                f"({rate_at(est, est['best']):.1f}) at the step times measured so far")
    return (f"step {event.step}: {event.budget} draft nodes{_parts(est)}, tried beside the best ({est['best']} "
            f"nodes, {rate_at(est, est['best']):.1f} tokens/s) to keep its estimate fresh")


def budget_figure(event: StepEvent) -> go.Figure:
    """Expected tokens per second against draft nodes from ``event.budget_estimates``: one line over the candidate
    sizes, the step's size marked (a star where it is the best, a diamond where it was explored, the best then an
    open circle). An event without a budget gives an empty chart that says so."""
    fig = go.Figure()
    est = event.budget_estimates
    if event.budget is not None and est:
        sizes, rates = est["sizes"], est["tokens_per_s"]
        info = list(zip(est["step_ms"], est["expected_tokens"]))
        hover = "%{x} draft nodes: %{y:.1f} tokens/s<br>step %{customdata[0]:.1f} ms, " \
                "%{customdata[1]:.2f} tokens a step<extra></extra>"
        fig.add_trace(go.Scatter(x=sizes, y=rates, mode="lines+markers", name="expected tokens/s",
                                 line=dict(color=GREY, width=2), marker=dict(color=GREY, size=7),
                                 customdata=info, hovertemplate=hover))

        def mark(size: int, name: str, colour: str, symbol: str, marker_size: int) -> None:
            fig.add_trace(go.Scatter(x=[size], y=[rate_at(est, size)], mode="markers", name=name,
                                     marker=dict(color=colour, symbol=symbol, size=marker_size,
                                                 line=dict(color=colour, width=2)),
                                     hovertemplate="%{x} draft nodes: %{y:.1f} tokens/s<extra></extra>"))

        ran = est.get("matrix_nodes", event.budget)  # a grafted tree's matrix part is what the curve prices
        if est["explored"]:
            mark(est["best"], BEST, BLUE, "circle-open", 14)
            mark(ran, EXPLORED, ORANGE, "diamond", 14)
        else:
            mark(ran, CHOSEN, BLUE, "star", 18)
    # the size, then why, wrapped to what a phone's 390 px hold (a longer line is cut there)
    title = ",<br>".join(wrap(part, 40) for part in budget_title(event).split(", ", 1))
    fig.update_layout(title=title, xaxis_title="draft nodes (tree size, root not counted)",
                      yaxis_title="expected tokens per second", height=360, plot_bgcolor="white",
                      xaxis=dict(gridcolor="#EEEEEE", rangemode="tozero"),
                      yaxis=dict(gridcolor="#EEEEEE", rangemode="tozero"),
                      legend=dict(orientation="h", yanchor="top", y=-0.28, x=0),  # below the axis title, clear of
                      margin=dict(l=60, r=20, t=40 + 20 * (title.count("<br>") + 1), b=90))
    return fig
