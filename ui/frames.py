"""What the Live and Race tabs show after each snapshot of a run, as gradio updates by output name: the answer, the
counters and the figures of a live step, the race's progress, verdict, table and chart. Built from run records and
step events alone (no model); ``app.py`` wires them to the page's components."""

from __future__ import annotations

from html import escape

import gradio as gr
import plotly.graph_objects as go

from visualize import budget_figure, matrix_figure, projection_figure, race_figure, tree_figure
from visualize.charts import step_latency_figure
from visualize.palette import wrap

from .page import BUDGET_PLACEHOLDER, CANNOT_PAY, PROJECTION_PLACEHOLDER
from .records import RaceRun, ms_per_step, race_summary
from .render import (
    answer_html,
    counters_html,
    finished_status,
    history_html,
    in_words,
    lanes_html,
    method_label,
    notice_html,
    race_table_html,
    race_verdict,
)
from .run import LiveRun, Race, RaceProgress, Snapshot
from .session import Session
from .summaries import race_summary_data

# Each endpoint's outputs, by the names an API caller reads (gradio labels them so); every update below is a dict
# of some of them, by name, and app.py maps the names to the page's components
LIVE_OUTPUTS = ("answer_html", "counters_html", "draft_tree", "matrix_rows", "budget_chart", "step_chart",
                "projection_chart", "history_html", "notice_html", "run_summary", "session")
STEP_OUTPUTS = ("answer_html", "draft_tree", "matrix_rows", "budget_chart", "step_event")
RESET_OUTPUTS = LIVE_OUTPUTS
AFTER_LIVE_OUTPUTS = ("step", "watch")  # the page's own controls after a run (not part of the API's answer)
RACE_OUTPUTS = ("race_status", "lanes_html", "race_table_html", "race_chart", "race_steps_chart",
                "race_projection_chart", "history_html", "race_summary", "session")
REPLAY_OUTPUTS = ("race_status", "lanes_html", "race_chart")


PLACEHOLDER_CHARS = 44  # an empty figure's text, in lines that fit a phone's width (390 px) as they fit a laptop's


def placeholder(text: str) -> go.Figure:
    """An empty figure that says what will be drawn there, in lines short enough for a phone."""
    fig = go.Figure().add_annotation(text=wrap(text, PLACEHOLDER_CHARS), showarrow=False,
                                     font=dict(size=14, color="#777777"))
    return fig.update_layout(height=220, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white",
                             margin=dict(l=20, r=20, t=20, b=20))


def step_slider(n: int, value: int | None = None) -> gr.Slider:
    return gr.Slider(minimum=0, maximum=max(1, n - 1), value=n - 1 if value is None else value, step=1,
                     interactive=n > 1, label=f"Decoding step ({n} in this run): drag to see any")


def budget_view(event) -> go.Figure:
    """The step's tree budget (expected tokens/s against tree size), or what the chart would show."""
    return budget_figure(event) if event.budget is not None else placeholder(BUDGET_PLACEHOLDER)


def live_frame(snap: Snapshot, run: LiveRun, figures: bool, session: Session) -> dict:
    """The Live tab after a step: the answer and counters; the figures of the latest step where ``figures``; while
    plain decoding is measured after the run, its counters alone; on the final snapshot, everything, so that the page
    and an API caller's result (the last update) agree."""
    last = snap.events[-1] if snap.events else None
    status = (finished_status(last, snap.stopped) if snap.done else
              "your run is done; now plain decoding of the same prompt, timed on its own for the speedup"
              if snap.measuring_plain else "running")
    values = dict(session=session, counters_html=counters_html(
        snap.rates, status, snap.note, snap.baseline,
        # what was done to the prompt stays in sight (the set-up in Details)
        "; ".join(filter(None, [getattr(run, "about_prompt", ""), in_words(snap.events)]))))
    if snap.measuring_plain and snap.baseline is not None:
        return values  # the run's answer and figures are on the page already: only plain decoding's counters move
    values.update(answer_html=answer_html(snap.events, hidden=run.hidden))
    if (figures or snap.done) and last:
        values.update(draft_tree=tree_figure(last, run.token_text, compact=session.narrow),
                      matrix_rows=matrix_figure(last, run.token_text, compact=session.narrow))
        # a run without a tree budget shows its placeholder (set as the run starts): not drawn again every frame
        if last.budget is not None or snap.done:
            values.update(budget_chart=budget_view(last))
    if snap.done:
        baseline_ms = snap.baseline.ms_per_token if snap.baseline else None
        values.update(history_html=history_html(session.history), run_summary=run.record.summary,
                      projection_chart=projection_view(run.record.summary, session.narrow),
                      notice_html=notice_html(CANNOT_PAY, "callout") if snap.drafted_nothing else "",
                      step_chart=step_latency_figure(snap.events, baseline_ms=baseline_ms) if last else gr.skip())
    return values


def projection_view(summary: dict | None, narrow: bool, what: str = "this run") -> go.Figure:
    """The projection of a run or race onto other hardware (``tr_core.projection``), or what the figure would show."""
    rows = (summary or {}).get("projection") or []
    if not rows:
        return placeholder(PROJECTION_PLACEHOLDER)
    return projection_figure(rows, f"{what}'s accepted tokens on other hardware: a model (weights over bandwidth "
                                   "against FLOPs over peak, plus launches), not a measurement; this machine as "
                                   "measured", compact=narrow)


def after_live(session: Session) -> dict:
    """The step slider and the "watch a tree" button once a run is over (or reset): from the session's record."""
    live = session.live
    events = live.events if live else []
    return dict(step=step_slider(max(1, len(events)), max(0, len(events) - 1)),
                watch=gr.Button(visible=bool(live and live.drafted_nothing)))


def step_view(live, index: int, narrow: bool) -> dict:
    """Step ``index`` of a recorded live run: the answer with it outlined, its tree, matrix rows, budget and event."""
    event = live.events[index]
    return dict(answer_html=answer_html(live.events, current=event.step, hidden=live.hidden),
                draft_tree=tree_figure(event, live.token_text, compact=narrow),
                matrix_rows=matrix_figure(event, live.token_text, compact=narrow), budget_chart=budget_view(event),
                step_event=event.to_dict())


def race_step_plot(runs: dict[str, RaceRun]) -> go.Figure:
    """Token Recycling's (else the first method's) decoding steps in the race, against plain decoding's ms per
    token."""
    method = "tr" if "tr" in runs else next(m for m in runs if m != "plain")
    return step_latency_figure(runs[method].events, baseline_ms=ms_per_step(runs["plain"].events),
                               title=f"{method_label(method)}: each decoding step of its median round, against "
                                     "plain decoding")


def race_frame(progress: RaceProgress, race: Race, session: Session) -> dict:
    """The Race tab while measuring, and the verdict, the table, the step figure and the summary once every round
    is measured."""
    tree = race.settings.tree
    if not progress.done:
        return dict(race_status=progress.status, lanes_html=lanes_html(progress.runs, None, tree, race.hidden))
    if progress.stopped:
        return dict(race_status=progress.status)
    summary = race_summary(progress.rounds)
    verdict = race_verdict(summary)
    table = race_table_html(progress.rounds, race.decode, tree)
    table += ('<details class="tr-details"><summary>Details: how the race was set up</summary>'
              f'<div class="tr-status">Token Recycling ran with {escape(race.about_setup)}. Every matrix method '
              f"started from {escape(race.matrix_history)}.</div></details>")
    data = race_summary_data(summary, progress.rounds, verdict, race.matrix_history, progress.runs,
                             race.machine_profile())
    shown = data["projection"][0]["method"] if data["projection"] else ""
    return dict(race_status=verdict, race_table_html=table, session=session,
                history_html=history_html(session.history), race_steps_chart=race_step_plot(progress.runs),
                race_summary=data, race_projection_chart=projection_view(
                    data, session.narrow, f"{method_label(shown)} (median round)"))


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
