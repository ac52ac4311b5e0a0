"""The draft tree of a step, and a whole run as one animated figure.

Depth runs left to right (``tree_layout``); each node is a marker followed by its token text, whitespace made
visible. Colour and shape tell the step's story: the root, the accepted path, the nodes where acceptance stopped
(the last accepted node's children, which the model rejected), the other rejected drafts, and the bonus token,
drawn as an extra star node in the lane above the tree, joined to the last accepted node by a dashed edge. A
step's figure therefore has ``len(tree_tokens) + 1`` node markers.

A tree built per step (``tree_sources``) also tells where each node came from, by shape within the role's colour:
a square for a node grown best-first from the matrix, a diamond (and a green edge into it) for one copied from the
context; the legend lists those sources only where the step (or, in an animation, any step) has such nodes.

    fig = tree_figure(events[12])            # one step
    fig = tree_animation(events)             # frames, a play button and a step slider
"""

from __future__ import annotations

from functools import lru_cache
from html import escape
from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go

from .palette import BLUE, CONTEXT_EDGE, GREY, NODE_ROLES, NODE_SOURCES, ORANGE, SOURCE_KEY
from .trace import TokenNamer, label, quoted, text_lookup
from .tree_layout import BONUS_Y, ROLES, TreeLayout, node_roles, node_sources, tree_layout

if TYPE_CHECKING:
    from tr_core.events import StepEvent

# A node's label takes the first LABEL_W of the gap to the next depth; edges start after it so no line crosses
# text, turn at ELBOW_X, between the label and the next column, and stop MARKER_GAP short of the child's marker
# (the accepted path is drawn above the markers).
LABEL_W = 0.62
ELBOW_X = 0.8
MARKER_GAP = 0.04
ROW_PX = 20  # height of one row of the layout: a label of the 11 px font plus a gap


Edge = list[tuple[float, float]]  # the corners of one edge's polyline


def _elbow(x0: float, y0: float, x1: float, y1: float) -> Edge:
    """The edge from a parent at (x0, y0) to a child at (x1, y1): right past the parent's label, down, right."""
    xm = x0 + ELBOW_X
    return [(x0 + LABEL_W, y0), (xm, y0), (xm, y1), (x1 - MARKER_GAP, y1)]


def _edges(pos: TreeLayout, pairs) -> list[Edge]:
    return [_elbow(pos.x[p], pos.y[p], pos.x[c], pos.y[c]) for p, c in pairs]


@lru_cache(maxsize=64)
def _tree_edges(pos: TreeLayout) -> tuple[Edge, ...]:
    """Every edge of a tree shape; the same for all steps of a template, so computed once."""
    return tuple(_edges(pos, ((p, i) for i, p in enumerate(pos.parents) if p >= 0)))


def _shape(edges: Sequence[Edge], colour: str, width: float, dash: str = "solid", layer: str = "above") -> dict:
    """A layout shape drawing ``edges`` as one SVG path: ``[[(0, 0), (1, 0)]]`` -> ``'M0,0L1,0'``."""
    path = "".join("M" + "L".join(f"{x:g},{y:g}" for x, y in edge) for edge in edges)
    # A step without accepted drafts has no blue path; an invisible placeholder keeps the shapes' order.
    return dict(type="path", path=path or "M0,0", layer=layer, visible=bool(path),
                line=dict(color=colour, width=width, dash=dash))


def _line_trace(edges: Sequence[Edge]) -> dict:
    """A grey line trace drawing ``edges``, ``None`` between them to lift the pen."""
    xs = [x for edge in edges for x in [*(x for x, _ in edge), None]]
    ys = [y for edge in edges for y in [*(y for _, y in edge), None]]
    return dict(type="scatter", mode="lines", name="tree edges", x=xs, y=ys, line=dict(color=GREY, width=1),
                hoverinfo="skip", showlegend=False)


def tree_edges(event: StepEvent) -> dict:
    """All edges of the step's tree, grey, as a layout shape."""
    return _shape(_tree_edges(tree_layout(tuple(event.tree_parents))), GREY, 1, layer="below")


def has_context(event: StepEvent) -> bool:
    return "context" in event.tree_sources


def step_shapes(event: StepEvent, context: bool | None = None) -> list[dict]:
    """The edges that change from step to step, as layout shapes: the accepted path (blue) and the bonus token's
    dashed link to the last accepted node (orange), after the edges into nodes copied from the context (green,
    under the blue path) if ``context`` (by default: if the step has such nodes; an animation asks for them in
    every frame, drawn or not, so that its frames keep one list of shapes). Shapes, not line traces: animation
    frames replace shapes outright, while a changed line trace is tweened from its old path and can be left drawn
    half-way."""
    pos = tree_layout(tuple(event.tree_parents))
    path = event.accepted_path
    last = path[-1]
    bonus_link = _elbow(pos.x[last], pos.y[last], pos.x[last] + 1, BONUS_Y)
    shapes = [_shape(_edges(pos, zip(path, path[1:])), BLUE, 3), _shape([bonus_link], ORANGE, 2, "dash")]
    if context is None:
        context = has_context(event)
    if context:
        copied = [(p, i) for i, (p, s) in enumerate(zip(event.tree_parents, node_sources(event))) if s == "context"]
        shapes.insert(0, _shape(_edges(pos, copied), CONTEXT_EDGE, 2))
    return shapes


def _node_hover(event: StepEvent, i: int, depth: int, source: str, text: TokenNamer) -> str:
    token = event.tree_tokens[i]
    lines = [f"<b>{quoted(event.tree_text[i])}</b>  (id {token}, node {i}, depth {depth})"]
    if i == 0:
        lines.append("root: the last token; its matrix row gives the depth-1 drafts")
    else:
        p = event.tree_parents[i]
        parent = quoted(event.tree_text[p])
        if source == "context":  # not from the matrix: tree_ranks holds -1
            lines.append("copied from the context: what followed the latest earlier occurrence of the text ending "
                         f"here (parent {parent}, node {p})")
        else:
            why = "; grown best-first by estimated path probability" if source == "best-first" else ""
            lines.append(f"rank {event.tree_ranks[i]} in the matrix row of {parent} (parent, node {p}{why})")
    lines.append(f"model's next token here: {quoted(text(event.predicted[i]))}")
    return "<br>".join(lines)


def _symbol(role: str, source: str) -> str:
    """A node's marker: its role's shape, or for a best-first or context node that source's shape for the role."""
    return NODE_SOURCES[source][1].get(role, NODE_ROLES[role][2]) if source in NODE_SOURCES else NODE_ROLES[role][2]


def step_traces(event: StepEvent, text: TokenNamer) -> list[dict]:
    """The node markers of one step: one scatter trace per role in ``ROLES`` (rejected, broke, accepted, root,
    bonus), always those five in that order so that animation frames can swap their data. Each point's ``ids``
    entry is its node index (the bonus: ``"bonus after <node>"``), so that a frame matches points by node and a
    node never slides across the figure when it changes role. A step with ``tree_sources`` gives every trace one
    marker symbol per point (``_symbol``); a template's step, one symbol per trace."""
    pos = tree_layout(tuple(event.tree_parents))
    points: dict[str, list[tuple]] = {role: [] for role in ROLES}
    for i, (role, source) in enumerate(zip(node_roles(event), node_sources(event))):
        hover = _node_hover(event, i, int(pos.x[i]), source, text)
        points[role].append((pos.x[i], pos.y[i], label(event.tree_text[i]), hover, str(i), _symbol(role, source)))
    last = event.accepted_path[-1]
    bonus_text = text(event.bonus_token)
    points["bonus"].append((pos.x[last] + 1, BONUS_Y, label(bonus_text),
                            f"<b>bonus token {quoted(bonus_text)}</b>  (id {event.bonus_token})<br>"
                            f"the model's own next token after node {last} "
                            f"{quoted(event.tree_text[last])}; not drafted, produced by the same forward pass",
                            f"bonus after {last}", NODE_ROLES["bonus"][2]))
    traces = []
    for role in ROLES:
        name, colour, symbol, size = NODE_ROLES[role]
        xs, ys, labels, hovers, ids, symbols = zip(*points[role]) if points[role] else ((),) * 6
        traces.append(dict(
            type="scatter", mode="markers+text", name=name, legendgroup=role, showlegend=False, x=list(xs),
            y=list(ys), text=list(labels), hovertext=list(hovers), ids=list(ids),
            hovertemplate="%{hovertext}<extra></extra>", textposition="middle right",
            textfont=dict(size=11, color="#555555" if role == "rejected" else "#222222"),
            marker=dict(color=colour, symbol=list(symbols) if event.tree_sources else symbol, size=size,
                        line=dict(color=colour, width=2))))
    return traces


def _sources_drawn(events: Sequence[StepEvent]) -> list[str]:
    """The sources of ``NODE_SOURCES`` that some node of ``events`` has, in that dict's order."""
    present = {s for e in events for s in e.tree_sources}
    return [s for s in NODE_SOURCES if s in present]


def legend_keys(sources: Sequence[str] = ()) -> list[dict]:
    """One legend entry per role, in story order (root, accepted, bonus, where it broke, rejected), drawn by
    point-less traces so that the legend stays whole in steps where a role has no node; clicking an entry still
    hides that role's nodes, which share its legend group. Then one entry per node source in ``sources``
    ("best-first", "context"): its shape in a neutral grey, the context's with its green edge."""
    keys = [dict(type="scatter", mode="markers", name=name, legendgroup=role, legendrank=order, x=[None],
                 y=[None], marker=dict(color=colour, symbol=symbol, size=size, line=dict(color=colour, width=2)))
            for order, (role, (name, colour, symbol, size)) in enumerate(NODE_ROLES.items())]
    for order, source in enumerate(sources, start=len(keys)):
        name, symbols = NODE_SOURCES[source]
        key = dict(type="scatter", mode="markers", name=name, legendgroup=f"source {source}", legendrank=order,
                   x=[None], y=[None], marker=dict(color=SOURCE_KEY, symbol=symbols["rejected"], size=11,
                                                   line=dict(color=SOURCE_KEY, width=2)))
        if source == "context":
            key.update(mode="lines+markers", line=dict(color=CONTEXT_EDGE, width=2))
        keys.append(key)
    return keys


def step_title(event: StepEvent, text: TokenNamer) -> str:
    """``"step 12 (tr, tree small): 3 draft tokens accepted + bonus '.' → '␣marvel␣of␣engineering.'"``; with
    accepted nodes copied from the context, ``"... 3 draft tokens accepted (2 copied from the context) + ..."``."""
    n = event.accepted_draft_tokens
    sources = node_sources(event)
    copied = sum(1 for i in event.accepted_path[1:] if sources[i] == "context")
    return (f"step {event.step} ({event.method}, tree {escape(event.tree_name)}): {n} draft token{'s' * (n != 1)} "
            f"accepted{f' ({copied} copied from the context)' if copied else ''} + bonus "
            f"{quoted(text(event.bonus_token))} → {quoted(event.new_text)}")


def _layout(layouts: list[TreeLayout]) -> dict:
    """Axes wide enough for every tree in ``layouts``, so an animation never rescales."""
    depth = max(p.depth for p in layouts)
    rows = max(p.rows for p in layouts)
    y_range = [-(rows - 1) - 0.8, BONUS_Y + 0.8]
    margin = dict(l=20, r=20, t=100, b=50)
    return dict(
        height=max(320, round(ROW_PX * (y_range[1] - y_range[0]) + margin["t"] + margin["b"])),
        margin=margin,
        plot_bgcolor="white",
        hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0, font=dict(size=12)),
        xaxis=dict(range=[-0.25, depth + 1 + LABEL_W + 0.05], tickvals=list(range(depth + 2)),
                   ticktext=["root"] + [str(d) for d in range(1, depth + 2)], title="depth in the draft tree",
                   showgrid=False, zeroline=False, fixedrange=True),
        yaxis=dict(range=y_range, visible=False, fixedrange=True),
        title=dict(font=dict(size=14), y=0.99, yanchor="top"),
    )


def tree_figure(event: StepEvent, token_text: TokenNamer | None = None) -> go.Figure:
    """The draft tree of one step. ``token_text`` names ids the event does not (predictions, the bonus): a
    tokenizer's decode, or ``text_lookup(all_events)`` to use everything a trace decoded."""
    text = text_lookup([event], token_text)
    layout = _layout([tree_layout(tuple(event.tree_parents))])
    layout["title"]["text"] = step_title(event, text)
    layout["shapes"] = [tree_edges(event)] + step_shapes(event)
    return go.Figure(data=legend_keys(_sources_drawn([event])) + step_traces(event, text), layout=layout)


def _animation_controls(names: list[str]) -> dict:
    def play(duration: int) -> dict:
        return dict(frame=dict(duration=duration, redraw=True), mode="immediate", transition=dict(duration=0),
                    fromcurrent=True)

    buttons = [dict(label="▶ play", method="animate", args=[None, play(700)]),
               dict(label="❚❚ pause", method="animate", args=[[None], play(0)])]
    steps = [dict(label=name, method="animate", args=[[name], play(0)]) for name in names]
    # Past a few dozen steps the slider's tick labels run together; the current step is still shown above it.
    tick_colour = "#444444" if len(names) <= 40 else "rgba(0,0,0,0)"
    return dict(
        updatemenus=[dict(type="buttons", direction="left", buttons=buttons, x=0, y=0, xanchor="left",
                          yanchor="top", pad=dict(t=45, r=10), showactive=False)],
        sliders=[dict(steps=steps, active=0, x=0.16, len=0.84, y=0, yanchor="top", pad=dict(t=30),
                      currentvalue=dict(prefix="step ", font=dict(size=12, color="#444444")),
                      font=dict(color=tick_colour))],
    )


def _frame_data(traces: list[dict], symbols: bool) -> list[dict]:
    """What changes between frames: positions, texts and ids, and with ``symbols`` each point's marker symbol; the
    other styles stay those of the figure's own traces. Plotly merges frame data into the traces (a frame without
    a symbol list would keep the previous frame's), and validating less keeps 300 frames fast."""
    data = [{k: t[k] for k in ("x", "y", "text", "hovertext", "ids")} for t in traces]
    if symbols:
        for d, t in zip(data, traces):
            symbol = t["marker"]["symbol"]
            d["marker"] = dict(symbol=symbol if isinstance(symbol, list) else [symbol] * len(t["x"]))
    return data


def tree_animation(events: Sequence[StepEvent], token_text: TokenNamer | None = None) -> go.Figure:
    """A whole run as one figure: one frame per step (named by its step number), a play button and a slider.
    ``token_text`` as for ``tree_figure``; by default the whole trace names the tokens.

    Every frame carries the five node traces of ``step_traces`` and the edge shapes of ``step_shapes``; node
    positions depend on the tree shape only, so consecutive frames of one template show one tree whose labels
    and colours change. Where some step has ``tree_sources``, every frame gives each node trace its per-point
    marker symbols, and where some step copied nodes from the context, every frame has the green edges' shape.
    """
    if not events:
        raise ValueError("tree_animation needs at least one step event")
    text = text_lookup(events, token_text)
    names = [str(e.step) for e in events]
    if len(set(names)) < len(names):  # events of several runs: frames need distinct names for the slider
        names = [str(i) for i in range(len(events))]
    traces = [step_traces(e, text) for e in events]
    # Frames replace the whole shapes array. One template (Token Recycling's) keeps its grey edges in a line trace
    # that no frame touches; trees that change shape (Prompt Lookup's chains) redraw theirs as a shape per frame.
    one_shape = len({tuple(e.tree_parents) for e in events}) == 1
    symbols = any(e.tree_sources for e in events)
    context = any(has_context(e) for e in events)
    keys = legend_keys(_sources_drawn(events))
    first = 1 + len(keys)  # after the static edges and the legend keys
    frames = [dict(name=name, data=_frame_data(t, symbols), traces=list(range(first, first + len(t))),
                   layout=dict(title=dict(text=step_title(e, text)),
                               shapes=([] if one_shape else [tree_edges(e)]) + step_shapes(e, context)))
              for name, e, t in zip(names, events, traces)]
    static_edges = _line_trace(_tree_edges(tree_layout(tuple(events[0].tree_parents))) if one_shape else [])
    layout = _layout([tree_layout(tuple(e.tree_parents)) for e in events])
    layout["title"]["text"] = step_title(events[0], text)
    layout["shapes"] = frames[0]["layout"]["shapes"]
    layout["height"] += 80  # room for the play button and the slider
    layout["margin"]["b"] = 130
    layout.update(_animation_controls(names))
    return go.Figure(data=[static_edges] + keys + traces[0], layout=layout, frames=frames)
