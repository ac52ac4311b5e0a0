"""Race and speed: methods side by side.

    race_figure({"plain": events_a, "tr": events_b})     tokens produced against wall-clock time
    speedup_figure(benchmark)                             speedup (median, interval) and tokens per forward pass
    accepted_length_figure({"pld": ..., "tr": ...})       how many tokens each decoding step produced
    step_latency_figure(events, baseline_ms=70.0)         per decoding step: tokens added, and its time against plain
    tree_size_figure(benchmark)                           predicted and measured speedup against tree size
    methods_figure(runs)                                  per run (mode), every method's median speedup and interval

``benchmark`` is the benchmark's JSON::

    {"methods": {"tr": {"tokens_per_s": 41.2, "speedup": 1.9, "mean_accepted_tokens": 2.6, "identical": true,
                        "questions": 80, "speedup_median": 1.8, "speedup_ci95": [1.6, 2.0],
                        "by_category": {"writing": {<the same keys>}, ...}}, ...},
     "config": {...}}
"""

from __future__ import annotations

from collections import Counter
from html import escape
from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tr_core.events import StepEvent  # plain dataclasses: no torch

from .palette import BAR_PATTERNS, BLACK, BLUE, GREY, ORANGE, SKY_BLUE, VERMILLION, method_style, wrap

ALL = "all"  # the category name for a method's overall numbers
KEY_NUMBER = "tokens per forward pass (bonus token included)"  # the one name of the key number in every figure


def race_figure(runs: Mapping[str, Sequence[StepEvent]]) -> go.Figure:
    """One step line per method from (0 s, 0 tokens) through each step's ``(elapsed_s, total_tokens)``; a method's
    tokens appear when its step ends, hence the steps."""
    fig = go.Figure()
    for index, (method, events) in enumerate(runs.items()):
        colour, dash = method_style(method, index)
        last = events[-1] if events else None
        name = f"{method}: {last.rates.tokens_per_s:.1f} tok/s" if last else method
        fig.add_trace(go.Scatter(
            x=[0.0] + [e.elapsed_s for e in events], y=[0] + [e.total_tokens for e in events], name=name,
            mode="lines", line=dict(color=colour, dash=dash, width=3, shape="hv"),
            customdata=[0] + [e.step for e in events],
            hovertemplate=f"{escape(method)}<br>decoding step %{{customdata}}<br>%{{y}} tokens at %{{x:.2f}} s"
                          "<extra></extra>"))
    fig.update_layout(title="tokens produced against wall-clock time", xaxis_title="seconds",
                      yaxis_title="tokens produced", height=420, plot_bgcolor="white", hovermode="closest",
                      xaxis=dict(gridcolor="#EEEEEE", rangemode="tozero"),
                      yaxis=dict(gridcolor="#EEEEEE", rangemode="tozero"),
                      # under the plot: above it, a phone's wrapped legend ran over the title
                      legend=dict(orientation="h", yanchor="top", y=-0.22, x=0), margin=dict(l=60, r=20, t=80, b=110))
    return fig


def categories(benchmark: dict) -> list[str]:
    """``"all"`` followed by every category any method reports, sorted: ``["all", "coding", "math", ...]``."""
    found = {c for m in benchmark["methods"].values() for c in m.get("by_category", {})}
    return [ALL] + sorted(found)


def _metric(method: dict, category: str, key: str) -> float | None:
    source = method if category == ALL else method.get("by_category", {}).get(category)
    return None if source is None else source.get(key)


def _interval(method: dict, category: str) -> tuple[float, float] | None:
    """A method's 95% interval of its median speedup in ``category`` (``None`` in results without one)."""
    source = method if category == ALL else method.get("by_category", {}).get(category)
    return tuple(source["speedup_ci95"]) if source and source.get("speedup_ci95") else None


def speedup_figure(benchmark: dict) -> go.Figure:
    """Grouped bars per category: speedup over plain decoding (left) and tokens per forward pass, the bonus token
    included (right).
    Traces come in pairs per method (speedup, then accepted), in the order of ``benchmark["methods"]``.

    Where the results hold them (``speedup_median``, ``speedup_ci95``), the speedup bars are the median of the
    per-question speedups, with their 95% interval as error bars; older results draw ``speedup`` (the ratio of
    mean tokens/s) without bars."""
    cats = categories(benchmark)
    medians = any("speedup_median" in m for m in benchmark["methods"].values())
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=(
        "speedup over plain greedy decoding" + (": median, 95% interval" if medians else ""),
        KEY_NUMBER))
    for index, (method, numbers) in enumerate(benchmark["methods"].items()):
        colour, _ = method_style(method, index)
        pattern = dict(shape=BAR_PATTERNS[index % len(BAR_PATTERNS)], fgcolor="white", solidity=0.3)
        # A method whose text differs from plain decoding is not lossless: say so where the speed is read.
        identical = numbers.get("identical", True)  # a count of identical outputs (or a bool)
        differs = identical is False or (not isinstance(identical, bool) and identical < numbers.get("questions", 0))
        name = f"{method} (output differs from plain!)" if differs else method
        speed_key = "speedup_median" if "speedup_median" in numbers else "speedup"
        for col, key, fmt, what in [(1, speed_key, "{:.2f}×", "speedup"),
                                    (2, "mean_accepted_tokens", "{:.2f}", KEY_NUMBER)]:
            values = [_metric(numbers, c, key) for c in cats]
            tok_s = [_metric(numbers, c, "tokens_per_s") for c in cats]
            intervals = [_interval(numbers, c) if col == 1 else None for c in cats]
            error = None
            if any(intervals):
                error = dict(type="data", symmetric=False, color=GREY, thickness=1.5, width=4,
                             array=[i[1] - v if i and v is not None else None for i, v in zip(intervals, values)],
                             arrayminus=[v - i[0] if i and v is not None else None for i, v in zip(intervals, values)])
            hover = [f"{t:.1f}" if t is not None else "?" for t in tok_s]
            hover = [h + (f" tok/s<br>95% interval {i[0]:.2f}–{i[1]:.2f}" if i else " tok/s")
                     for h, i in zip(hover, intervals)]
            fig.add_trace(go.Bar(
                x=cats, y=values, name=name, legendgroup=method, showlegend=col == 1, error_y=error,
                marker=dict(color=colour, pattern=pattern, line=dict(color=colour, width=1)),
                text=[fmt.format(v) if v is not None else "" for v in values], textposition="outside",
                customdata=hover,
                hovertemplate=f"{escape(method)}, %{{x}}<br>{what} %{{y:.2f}}<br>%{{customdata}}<extra></extra>"),
                row=1, col=col)
    fig.add_hline(y=1.0, line=dict(color=GREY, dash="dash"), row=1, col=1)  # plain decoding itself
    questions = {m: n.get("questions") for m, n in benchmark["methods"].items()}
    height = 460
    fig.update_layout(barmode="group", height=height, plot_bgcolor="white", margin=dict(l=50, r=20, t=120, b=60),
                      title=dict(text=f"benchmark ({max((q or 0) for q in questions.values())} questions)",
                                 font=dict(size=14), y=1 - 12 / height, yanchor="top"),
                      legend=dict(orientation="h", yref="container", y=1 - 42 / height, yanchor="top", x=0))
    fig.update_yaxes(gridcolor="#EEEEEE", rangemode="tozero")
    return fig


def accepted_lengths(events: Sequence[StepEvent]) -> dict[int, int]:
    """``{len(accepted_path): number of decoding steps}``, e.g. ``{1: 12, 4: 1}``. A step that accepted no draft
    has ``accepted_path == [0]``, length 1: it still produced its bonus token."""
    return dict(sorted(Counter(len(e.accepted_path) for e in events).items()))


def accepted_length_figure(runs: Mapping[str, Sequence[StepEvent]]) -> go.Figure:
    """A histogram per method of ``len(accepted_path)`` (its tokens per forward pass, the bonus token included)
    over its decoding steps, as a share of that method's steps so that
    runs of different lengths compare; the counts are in ``customdata`` and in the hover."""
    fig = go.Figure()
    for index, (method, events) in enumerate(runs.items()):
        colour, _ = method_style(method, index)
        counts = accepted_lengths(events)
        total = max(1, len(events))
        fig.add_trace(go.Bar(
            x=list(counts), y=[100 * c / total for c in counts.values()], customdata=list(counts.values()),
            name=f"{method} (mean {sum(k * c for k, c in counts.items()) / total:.2f})",
            marker=dict(color=colour, pattern=dict(shape=BAR_PATTERNS[index % len(BAR_PATTERNS)], fgcolor="white",
                                                   solidity=0.3)),
            hovertemplate=f"{escape(method)}: %{{customdata}} decoding steps (%{{y:.0f}}%) produced %{{x}} tokens"
                          "<extra></extra>"))
    fig.update_layout(
        barmode="group", height=400, plot_bgcolor="white", margin=dict(l=60, r=20, t=80, b=60),
        title=f"{KEY_NUMBER}: the accepted draft tokens and the bonus token",
        xaxis=dict(title="tokens produced by one decoding step", dtick=1),
        yaxis=dict(title="% of decoding steps", gridcolor="#EEEEEE"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def tree_size_figure(benchmark: dict) -> go.Figure:
    """Where the ceiling is: speedup over plain decoding against the number of tree nodes (root included).

    The line is the prediction the fitted tree was chosen by (``config.fitted_tree.table``: the likeliest nodes of
    the acceptance statistics, expected accepted tokens / calibrated t(N)); the markers are the Token Recycling
    methods as measured (``tree_nodes``, ``speedup``), labelled with their measured tokens per forward pass. Where the
    results say how long the steps took per token (``step_ms_per_token``), open grey circles show the steps' own
    speedup, which is what the line predicts: the end-to-end speedup also carries each question's prefill."""
    fitted = (benchmark.get("config") or {}).get("fitted_tree") or {}
    table = fitted.get("table") or []
    fig = go.Figure()
    if table:
        fig.add_trace(go.Scatter(
            x=[row["nodes"] for row in table], y=[row["predicted_speedup"] for row in table], name="predicted",
            mode="lines", line=dict(color=GREY, width=2),
            customdata=[[row["expected_accepted"], row["step_ms"]] for row in table],
            hovertemplate="%{x} nodes: predicted %{y:.2f}×<br>expected " + KEY_NUMBER + " %{customdata[0]:.2f}, "
                          "decoding step %{customdata[1]:.0f} ms<extra></extra>"))
    # the steps alone (each method's step time per token against plain's): what the prediction models, before the
    # prompt's prefill, which every method pays alike, pulls the end-to-end speedups towards 1
    plain_token = benchmark["methods"].get("plain", {}).get("step_ms_per_token")
    steps = [(numbers["tree_nodes"], plain_token / numbers["step_ms_per_token"], method)
             for method, numbers in benchmark["methods"].items()
             if "tree_nodes" in numbers and numbers.get("step_ms_per_token") and plain_token]
    if steps:
        fig.add_trace(go.Scatter(
            x=[n for n, _, _ in steps], y=[v for _, v, _ in steps], name="steps only (measured, prefill left out)",
            mode="markers", marker=dict(color=GREY, size=11, symbol="circle-open", line=dict(width=2)),
            customdata=[m for _, _, m in steps],
            hovertemplate="%{customdata}: %{x} nodes, its steps %{y:.2f}× plain's per token<extra></extra>"))
    at_size: Counter = Counter()  # markers already drawn at each tree size: their labels go above, then below
    for index, (method, numbers) in enumerate(benchmark["methods"].items()):
        if "tree_nodes" not in numbers:
            continue
        at_size[numbers["tree_nodes"]] += 1
        colour, _ = method_style(method, index)
        mat = numbers.get("mean_accepted_tokens")
        fig.add_trace(go.Scatter(
            x=[numbers["tree_nodes"]], y=[numbers["speedup"]], name=f"{method} (measured)", mode="markers+text",
            marker=dict(color=colour, size=13, symbol=["circle", "diamond", "square", "triangle-up"][index % 4]),
            text=[f"{method}: {numbers['speedup']:.2f}×, {mat:.2f} tokens per forward pass" if mat is not None
                  else method],
            # labels of the largest trees (near the right edge) extend to the left, so that they are not cut off
            textposition=("top" if at_size[numbers["tree_nodes"]] % 2 else "bottom")
            + (" left" if numbers["tree_nodes"] >= 40 else " center"),
            hovertemplate=f"{escape(method)}: %{{x}} nodes, measured %{{y:.2f}}×"
                          + (f"<br>{KEY_NUMBER} {mat:.2f}" if mat is not None else "") + "<extra></extra>"))
    fig.add_hline(y=1.0, line=dict(color=GREY, dash="dash"))  # plain decoding itself
    fig.update_layout(
        title="speedup over plain decoding against tree size: predicted (line) and measured (markers)",
        height=440, plot_bgcolor="white", margin=dict(l=60, r=20, t=90, b=60), hovermode="closest",
        xaxis=dict(title="tree nodes, root included (log scale)", type="log", gridcolor="#EEEEEE"),
        yaxis=dict(title="speedup over plain", gridcolor="#EEEEEE", rangemode="tozero"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def methods_figure(runs: Sequence[dict]) -> go.Figure:
    """One panel per benchmark run (``tr_core.tools.bench_summary``'s entries, e.g. exact and fast mode): a horizontal
    bar per method, its median speedup over plain decoding with the 95% interval, the bar's text giving the tokens
    per forward pass (bonus token included). Plain decoding is the dashed line at 1."""
    fig = make_subplots(rows=1, cols=len(runs), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{r.get('mode', '?')} mode" for r in runs])
    for col, run in enumerate(runs, start=1):
        names = [n for n in run["methods"] if n != "plain"]
        for index, name in enumerate(names):
            m = run["methods"][name]
            ci = m.get("speedup_ci95")
            colour, _ = method_style(name, index)
            error = None if not ci else dict(type="data", symmetric=False, color="#555555", thickness=1.5, width=3,
                                             array=[ci[1] - m["speedup_median"]],
                                             arrayminus=[m["speedup_median"] - ci[0]])
            fig.add_trace(go.Bar(
                x=[m["speedup_median"]], y=[name], orientation="h", error_x=error, showlegend=False,
                marker=dict(color=colour),
                text=[f"{m['speedup_median']:.2f}×, {m['mean_accepted_tokens']:.2f} tokens per forward pass"],
                textposition="inside", insidetextanchor="start", textfont=dict(color="white", size=11),
                hovertemplate=(f"<b>{escape(name)}</b><br>median speedup %{{x:.2f}}×"
                               + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
                               + f"<br>{KEY_NUMBER} {m['mean_accepted_tokens']:.2f}"
                               + f"<br>{m.get('mean_draft_nodes', 0):.1f} draft nodes per decoding step"
                               + "<extra></extra>")),
                row=1, col=col)
        fig.add_vline(x=1.0, line=dict(color=GREY, dash="dash"), row=1, col=col)
    height = 90 + 34 * max(len(r["methods"]) for r in runs)
    fig.update_layout(height=height, plot_bgcolor="white", margin=dict(l=90, r=20, t=60, b=40),
                      title=dict(text="speedup over plain decoding (median, 95% interval)", font=dict(size=13)))
    fig.update_xaxes(gridcolor="#EEEEEE", rangemode="tozero")
    fig.update_yaxes(autorange="reversed")
    return fig


def _step_event(event) -> StepEvent:
    return event if isinstance(event, StepEvent) else StepEvent.from_dict(event)


def step_latency_figure(events: list, baseline_ms: float | None = None, title: str | None = None) -> go.Figure:
    """Per decoding step of a run (``StepEvent`` objects or their dicts), two panels sharing the step axis.

    Top: the tokens the step added, its accepted draft tokens (trace 0) and the bonus token (trace 1) stacked:
    the tokens per forward pass. Bottom: the step's time, the forward pass with the choice over the vocabulary (trace
    2) and the host work around it (trace 3: drafting, accepting, updating the matrix and the cache) stacked, in ms.
    With ``baseline_ms`` (plain decoding's time for one token, measured on the same machine) a dashed line at that
    height and, per step, a tick at what plain decoding would take for the tokens the step added: a step whose bar
    ends below its tick paid. A step cut at the run's end may add fewer tokens than it accepted; the bars count what
    it added."""
    steps = [_step_event(e) for e in events]
    if not steps:
        fig = go.Figure()
        fig.add_annotation(text="No decoding steps yet: run a prompt, and each step's tokens and time appear here.",
                           showarrow=False, font=dict(size=13))
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white",
                          title=title)
        return fig
    x = [e.step for e in steps]
    added = [len(e.new_tokens) for e in steps]
    drafts = [min(e.accepted_draft_tokens, n) for e, n in zip(steps, added)]
    bonus = [n - d for n, d in zip(added, drafts)]
    forward = [e.forward_ms for e in steps]
    overhead = [e.overhead_ms for e in steps]
    total = [f + o for f, o in zip(forward, overhead)]

    def verdict(n: int, ms: float) -> str:
        per_token = f"{n} token{'s' * (n != 1)} in {ms:.1f} ms: {ms / n:.1f} ms per token" if n else f"{ms:.1f} ms"
        if baseline_ms is None or not n:
            return per_token
        paid = "paid" if ms < n * baseline_ms else "did not pay"
        return f"{per_token}<br>plain decoding: {n * baseline_ms:.1f} ms for {n}; this step {paid}"

    hover = [verdict(n, ms) for n, ms in zip(added, total)]
    bottom = "time per decoding step, ms"
    if baseline_ms is not None:
        bottom += "<br>a bar below its tick beat plain decoding"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.16, row_heights=[0.4, 0.6],
                        subplot_titles=(KEY_NUMBER, bottom))
    for annotation in fig.layout.annotations:
        annotation.font = dict(size=12)
    for name, values, colour in [("accepted draft tokens", drafts, BLUE), ("bonus token", bonus, ORANGE)]:
        fig.add_trace(go.Bar(x=x, y=values, name=name, marker=dict(color=colour), customdata=hover,
                             hovertemplate=f"decoding step %{{x}}: %{{y}} {name}<br>%{{customdata}}<extra></extra>"),
                      row=1, col=1)
    for name, values, colour in [("forward pass", forward, SKY_BLUE), ("overhead", overhead, VERMILLION)]:
        fig.add_trace(go.Bar(x=x, y=values, name=name, marker=dict(color=colour), customdata=hover,
                             hovertemplate=f"decoding step %{{x}}: {name} %{{y:.1f}} ms<br>%{{customdata}}"
                                           "<extra></extra>"), row=2, col=1)
    if baseline_ms is not None:
        line = dict(color=BLACK, dash="dash", width=1.5)
        fig.add_hline(y=baseline_ms, line=line, row=2, col=1)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=line,
                                 name=f"plain decoding: one token per {baseline_ms:.1f} ms"), row=2, col=1)
        fig.add_trace(go.Scatter(
            x=x, y=[n * baseline_ms for n in added], mode="markers", customdata=hover,
            name="tick: plain decoding's time for those tokens",
            marker=dict(symbol="line-ew-open", size=14, color=BLACK, line=dict(color=BLACK, width=2)),
            hovertemplate="decoding step %{x}: plain decoding would take %{y:.1f} ms<br>%{customdata}<extra></extra>"),
            row=2, col=1)
    # Laid out for a phone as well as a laptop: the title wrapped, the legend under the plot with room for the
    # five rows it takes at 360 px (one at a laptop's width).
    # 36 signs fit a phone's 390 px
    title = wrap(title or "Each decoding step: the tokens it added and the time it took", 36)
    height = 560
    fig.update_layout(
        barmode="stack", height=height, plot_bgcolor="white", hovermode="closest", bargap=0.15,
        title=dict(text=title, font=dict(size=14), x=0, xref="paper", y=1 - 22 / height, yanchor="top"),
        legend=dict(orientation="h", yanchor="top", y=-0.14, x=0, font=dict(size=11), traceorder="normal"),
        margin=dict(l=50, r=10, t=70 + 18 * title.count("<br>"), b=150))
    fig.update_xaxes(title_text="decoding step", tickformat="d", row=2, col=1)
    fig.update_yaxes(title_text="tokens", dtick=1, gridcolor="#EEEEEE", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="ms", gridcolor="#EEEEEE", rangemode="tozero", row=2, col=1)
    return fig


def _projection_label(row: Mapping) -> str:
    """``"2.41×"``, with what is known of the model's error: against a measurement elsewhere (``"model error
    +33%"``, the paper check) or, for this machine, against its measured step times (``"model's t(N) error here
    12%"``)."""
    label, error = f"{row['speedup']:.2f}×", row.get("model_error")
    if error is None:
        return label
    return label + (f" (model error {error:+.0%})" if row.get("modelled", True) else
                    f" (the model's t(N) off by {error:.0%} here)")


def projection_figure(rows: Sequence[Mapping], title: str = "", compact: bool = False) -> go.Figure:
    """The same run's speedup on other hardware (``tr_core.projection.projection`` rows): one bar per device, this
    machine's as measured (blue), the others modelled (grey, hatched), each labelled with the model's error where
    it was checked; a line at 1×, plain decoding."""
    rows = [r for r in rows if r.get("speedup") is not None]
    fig = go.Figure()
    names = [r["device"] + ("" if r.get("modelled", True) else " (measured)") for r in rows]
    labels = [_projection_label(r) for r in rows]
    # on a phone the bars carry the speedup alone (the error's words ran past the figure's edge): the rest on hover
    shown = [f"{r['speedup']:.2f}×" for r in rows] if compact else labels
    fig.add_trace(go.Bar(
        y=names, x=[r["speedup"] for r in rows], orientation="h", text=shown, textposition="outside",
        cliponaxis=False, marker=dict(color=[GREY if r.get("modelled", True) else BLUE for r in rows],
                                      pattern_shape=["/" if r.get("modelled", True) else "" for r in rows]),
        customdata=labels, hovertemplate="%{y}: %{customdata} plain decoding<extra></extra>"))
    fig.add_vline(x=1.0, line=dict(color=BLACK, dash="dash", width=1))
    top = max([r["speedup"] for r in rows] + [1.0])
    title = wrap(title or "the same accepted tokens on other hardware: a model, not a measurement",
                 40 if compact else 90)
    top_margin = 24 + 22 * (title.count("<br>") + 1)  # room for every line of the title (4-5 on a phone)
    return fig.update_layout(
        title=dict(text=title, font=dict(size=14), yref="container", y=1, yanchor="top", pad=dict(t=10)),
        height=30 + top_margin + 36 * len(rows),
        margin=dict(l=10, r=10, t=top_margin, b=30), plot_bgcolor="white", showlegend=False,
        xaxis=dict(title="speedup over plain decoding", range=[0, top * 1.45], gridcolor="#eeeeee"),
        yaxis=dict(autorange="reversed", automargin=True))
