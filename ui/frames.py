"""What the Live and Race tabs show after each snapshot of a run, as gradio updates by output name: the answer, the
counters and the figures of a live step, the race's progress, verdict, table and chart. Built from run records and
step events alone (no model); ``app.py`` wires them to the page's components."""

from __future__ import annotations

from html import escape

import gradio as gr
import plotly.graph_objects as go

from visualize import budget_figure, matrix_figure, race_figure, tree_figure
from visualize.charts import step_latency_figure
from visualize.palette import wrap

from .page import BUDGET_PLACEHOLDER, CANNOT_PAY
from .records import RaceRun, decoding_speed, ms_per_step, race_summary
from .render import (
    answer_html,
    counters_html,
    finished_status,
    history_html,
    lanes_html,
    method_label,
    notice_html,
    race_table_html,
    race_verdict,
)
from .run import LiveRun, Race, RaceProgress, Snapshot
from .session import Session

LIVE_OUTPUTS = ("answer", "counters", "tree_plot", "matrix_plot", "step", "session", "history", "budget_plot",
                "notice", "step_plot", "watch")
RACE_OUTPUTS = ("race_status", "lanes", "table", "race_plot", "session", "history", "race_step_plot")


def by_name(names: tuple[str, ...], **values) -> tuple:
    """One update per output in ``names`` order; an output not given stays as it is."""
    return tuple(values.get(name, gr.skip()) for name in names)


def placeholder(text: str) -> go.Figure:
    """An empty figure that says what will be drawn there."""
    fig = go.Figure().add_annotation(text=text, showarrow=False, font=dict(size=14, color="#777777"))
    return fig.update_layout(height=220, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white",
                             margin=dict(l=20, r=20, t=20, b=20))


def step_slider(n: int, value: int | None = None) -> gr.Slider:
    return gr.Slider(minimum=0, maximum=max(1, n - 1), value=n - 1 if value is None else value, step=1,
                     interactive=n > 1, label=f"Decoding step ({n} in this run): drag to see any")


def budget_view(event) -> go.Figure:
    """The step's tree budget (expected tokens/s against tree size), or what the chart would show."""
    return budget_figure(event) if event.budget is not None else placeholder(BUDGET_PLACEHOLDER)


def live_frame(snap: Snapshot, run: LiveRun, figures: bool, session: Session) -> tuple:
    """The Live tab after a step: the answer and counters; the figures of the latest step where ``figures``; on the
    final snapshot, everything, so that the page and an API caller's result (the last update) agree."""
    last = snap.events[-1] if snap.events else None
    status = (finished_status(last, snap.stopped) if snap.done else
              "decoded; now measuring plain decoding on your prompt, for comparison…" if snap.measuring_baseline
              else "running")
    values = dict(answer=answer_html(snap.events, hidden=run.hidden), session=session,
                  counters=counters_html(snap.rates, status, snap.note, snap.baseline, decoding_speed(snap.events)))
    if (figures or snap.done) and last:
        values.update(tree_plot=tree_figure(last, run.token_text, compact=session.narrow),
                      matrix_plot=matrix_figure(last, run.token_text, compact=session.narrow),
                      step=step_slider(len(snap.events)), budget_plot=budget_view(last))
    if snap.done:
        baseline_ms = snap.baseline.ms_per_token if snap.baseline else None
        values.update(history=history_html(session.history), watch=gr.Button(visible=snap.drafted_nothing),
                      notice=notice_html(CANNOT_PAY, "callout") if snap.drafted_nothing else "",
                      step_plot=step_latency_figure(snap.events, baseline_ms=baseline_ms) if last else gr.skip())
    return by_name(LIVE_OUTPUTS, **values)


def race_step_plot(runs: dict[str, RaceRun]) -> go.Figure:
    """Token Recycling's (else the first method's) decoding steps in the race, against plain decoding's ms per
    token."""
    method = "tr" if "tr" in runs else next(m for m in runs if m != "plain")
    return step_latency_figure(runs[method].events, baseline_ms=ms_per_step(runs["plain"].events),
                               title=f"{method_label(method)}: each decoding step of its median round, against "
                                     "plain decoding")


def race_frame(progress: RaceProgress, race: Race, session: Session) -> tuple:
    """The Race tab while measuring, and the verdict, the table and the step figure once every round is measured."""
    tree = race.settings.tree
    if not progress.done:
        return by_name(RACE_OUTPUTS, race_status=progress.status,
                       lanes=lanes_html(progress.runs, None, tree, race.hidden))
    if progress.stopped:
        return by_name(RACE_OUTPUTS, race_status=progress.status)
    verdict = race_verdict(race_summary(progress.rounds))
    table = race_table_html(progress.rounds, race.decode, tree)
    table += f'<div class="tr-status">Token Recycling ran with {escape(race.about_setup)}.</div>'
    return by_name(RACE_OUTPUTS, race_status=f"{verdict} Replaying the median rounds side by side…", table=table,
                session=session, history=history_html(session.history), race_step_plot=race_step_plot(progress.runs))


def race_chart(race, at_s: float | None = None):
    """The race figure of each method's median round, every step finished ``at_s`` seconds into its run (``None``:
    all), on the axes of the whole race so that the lines grow instead of the axes; each method's legend gives its
    median tokens/s over the rounds and their range."""
    runs = race.runs
    fig = race_figure({m: [e for e in r.events if at_s is None or e.elapsed_s <= at_s] for m, r in runs.items()})
    for trace, (method, summary) in zip(fig.data, race_summary(race.rounds).items()):
        trace.name = f"{method}: {summary.tokens_per_s.shown()} tok/s"
    end = max(r.elapsed_s for r in runs.values())
    tokens = max(r.events[-1].total_tokens for r in runs.values())
    return (fig.update_xaxes(range=[0, end * 1.03]).update_yaxes(range=[0, tokens * 1.05])
            .update_layout(title=wrap(f"tokens against time: each method's median round of "
                                      f"{len(race.rounds['plain'])} (legend: median tokens/s, range)", 40)))
