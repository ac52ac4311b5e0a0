"""The draft tree of a decoding step, and a whole run as one animated figure.

Depth runs left to right (``tree_layout``); each node is a marker followed by its token text, whitespace made
visible. Colour and shape tell the step's story: the root, the accepted path, the nodes where acceptance stopped
(the last accepted node's children, which the model rejected), the other rejected drafts, and the bonus token,
drawn as a star beside the last accepted node, as if it were that node's first child (``step_layout``), joined to
it by a short dashed edge. A step's figure therefore has ``len(tree_tokens) + 1`` node markers. On a small tree
(``RANK_TEXT_NODES``) each edge carries the child's rank among its parent's k candidates (0 = likeliest); on any
tree the hover says it.

A tree built per step (``tree_sources``) also tells where each node came from, by shape within the role's colour:
a square for a node grown best-first from the matrix, a diamond (and a green edge into it) for one copied from the
context; the legend lists those sources only where the step (or, in an animation, any step) has such nodes.

``compact=True`` lays the figure out for a phone (about 360 px wide): smaller fonts, shorter labels, titles
wrapped, and on a tree larger than ``RANK_TEXT_NODES`` only the story's nodes labelled (the rest in the hover).

    fig = tree_figure(events[12])            # one decoding step
    fig = tree_animation(events)             # frames, a play button and a slider over the decoding steps
"""

from __future__ import annotations

from functools import lru_cache
from html import escape
from typing import TYPE_CHECKING, Sequence

import plotly.graph_objects as go

from .palette import BLUE, CONTEXT_EDGE, GREY, NODE_ROLES, NODE_SOURCES, ORANGE, SOURCE_KEY, legend_rows, look, wrap
from .trace import TokenNamer, label, quoted, text_lookup
from .tree_layout import ROLES, TreeLayout, node_roles, node_sources, tree_layout

if TYPE_CHECKING:
    from tr_core.events import StepEvent

# A node's label takes the first LABEL_W of the gap to the next depth; edges start after it so no line crosses
# text, turn at ELBOW_X, between the label and the next column, and stop MARKER_GAP short of the child's marker
# (the accepted path is drawn above the markers). A draft's rank is written on the child's row, above the edge and
# ending just left of the turn (RANK_X): a place no label or marker takes, whatever the row holds.
LABEL_W = 0.62
ELBOW_X = 0.8
MARKER_GAP = 0.04
RANK_X = ELBOW_X - 0.02
ROW_PX = 20  # height of one row of the layout: a label of the 11 px font plus a gap
RANK_TEXT_NODES = 20  # trees of at most this many nodes write each draft's rank on its edge
KEY_AT = -1000  # where a legend key's point lies: far outside the fixed axes, so never drawn
CHAR_EM = 0.62  # a label's sign is about this many font sizes wide (whitespace signs included)
TEXT_PAD = 3  # px between a marker's edge and its label


Edge = list[tuple[float, float]]  # the corners of one edge's polyline


def elbow(x0: float, y0: float, x1: float, y1: float) -> Edge:
    """The edge from a parent at (x0, y0) to a child at (x1, y1): right past the parent's label, down, right."""
    xm = x0 + ELBOW_X
    return [(x0 + LABEL_W, y0), (xm, y0), (xm, y1), (x1 - MARKER_GAP, y1)]


def _edges(pos: TreeLayout, pairs) -> list[Edge]:
    return [elbow(pos.x[p], pos.y[p], pos.x[c], pos.y[c]) for p, c in pairs]


@lru_cache(maxsize=256)
def step_layout(parents: tuple[int, ...], last: int) -> TreeLayout:
    """``tree_layout`` of the tree with the bonus token added as node ``len(parents)``, the first child of ``last``
    (the last accepted node): in ``last``'s row, one column right of it. If ``last`` has children, the rest of
    its row (its first child onward) and every row below move down one row to make room; a leaf's bonus takes
    the free place after it and nothing moves. Same as laying out the tree with the bonus inserted before
    ``last``'s first child:

        parents [-1, 0, 0], last 0  ->  row 0: 0 ─┬─ ★       (the star's dashed edge crosses no branch)
                                        row 1:    ├─ 1
                                        row 2:    └─ 2
    """
    pos = tree_layout(parents)
    x_last, row_last = pos.x[last], -pos.y[last]
    opens_row = last in parents  # the star pushes last's first child into a new row

    def row(i: int) -> float:
        r = -pos.y[i]
        return r + 1 if opens_row and (r > row_last or (r == row_last and pos.x[i] > x_last)) else r

    n = len(parents)
    return TreeLayout(parents + (last,), pos.x + (x_last + 1,), tuple(-row(i) for i in range(n)) + (-row_last,),
                      pos.rows + opens_row)


def event_layout(event: StepEvent) -> TreeLayout:
    return step_layout(tuple(event.tree_parents), event.accepted_path[-1])


@lru_cache(maxsize=256)
def _tree_edges(pos: TreeLayout) -> tuple[Edge, ...]:
    """Every edge of the draft tree (the bonus token's, into the last node, left out)."""
    return tuple(_edges(pos, ((p, i) for i, p in enumerate(pos.parents[:-1]) if p >= 0)))


def _shape(edges: Sequence[Edge], colour: str, width: float, dash: str = "solid", layer: str = "above") -> dict:
    """A layout shape drawing ``edges`` as one SVG path: ``[[(0, 0), (1, 0)]]`` -> ``'M0,0L1,0'``."""
    path = "".join("M" + "L".join(f"{x:g},{y:g}" for x, y in edge) for edge in edges)
    # A step without accepted drafts has no blue path; an invisible placeholder keeps the shapes' order.
    return dict(type="path", path=path or "M0,0", layer=layer, visible=bool(path),
                line=dict(color=colour, width=width, dash=dash))


def tree_edges(event: StepEvent) -> dict:
    """All edges of the step's tree, grey, as a layout shape."""
    return _shape(_tree_edges(event_layout(event)), GREY, 1, layer="below")


def has_context(event: StepEvent) -> bool:
    return "context" in event.tree_sources


def step_shapes(event: StepEvent, context: bool | None = None) -> list[dict]:
    """The edges of one step as layout shapes: the tree (grey, under the markers), then the edges into nodes
    copied from the context (green) if ``context`` (by default: if the step has such nodes; an animation asks for
    them in every frame, drawn or not, so that its frames keep one list of shapes), the accepted path (blue) and
    the bonus token's dashed link to the last accepted node (orange). Shapes, not line traces: animation frames
    replace shapes outright, while a changed line trace is tweened from its old path and can be left drawn
    half-way."""
    pos = event_layout(event)
    path = event.accepted_path
    bonus = len(event.tree_tokens)
    shapes = [tree_edges(event), _shape(_edges(pos, zip(path, path[1:])), BLUE, 3),
              _shape(_edges(pos, [(path[-1], bonus)]), ORANGE, 2, "dash")]
    if context is None:
        context = has_context(event)
    if context:
        copied = [(p, i) for i, (p, s) in enumerate(zip(event.tree_parents, node_sources(event))) if s == "context"]
        shapes.insert(1, _shape(_edges(pos, copied), CONTEXT_EDGE, 2))
    return shapes


def draft_rank(event: StepEvent, i: int) -> int | None:
    """Node ``i``'s rank among its parent's k candidates in the matrix (0 = likeliest), or None where the node
    did not come from a matrix row: the root, a node copied from the context, a prompt-lookup chain."""
    if i == 0 or event.method == "pld" or node_sources(event)[i] in ("context", "datastore", "window", "n-gram"):
        return None
    return event.tree_ranks[i]


LOOKAHEAD_HOVER = {
    "window": "a guess of the Jacobi window: the model's output one step ago at the position before this one, "
              "refined every step",
    "n-gram": "from the n-gram pool: a trajectory of the window (or a stretch of the context) that started with the "
              "token above",
}


def _node_hover(event: StepEvent, i: int, depth: int, source: str, text: TokenNamer) -> str:
    token = event.tree_tokens[i]
    lines = [f"<b>{quoted(event.tree_text[i])}</b>  (id {token}, node {i}, depth {depth})"]
    if i == 0:
        lines.append("root: the last token; its matrix row gives the depth-1 drafts")
    else:
        p = event.tree_parents[i]
        parent = quoted(event.tree_text[p])
        rank = draft_rank(event, i)
        if source == "datastore":
            lines.append("retrieved from the datastore: one of the continuations that most often followed the "
                         f"longest match of the text ending here (parent {parent}, node {p})")
        elif source in LOOKAHEAD_HOVER:
            lines.append(f"{LOOKAHEAD_HOVER[source]} (parent {parent}, node {p})")
        elif rank is None:  # not from the matrix: tree_ranks holds -1 (or a chain's 0)
            lines.append("copied from the context: what followed the latest earlier occurrence of the text ending "
                         f"here (parent {parent}, node {p})")
        else:
            why = "; grown best-first by estimated path probability" if source == "best-first" else ""
            lines.append(f"rank {rank} in the matrix row of {parent} (0 = likeliest; parent, node {p}{why})")
    probs = getattr(event, "draft_probs", None)
    if i and probs and i < len(probs):  # a sampled step: the chance that the sample at the parent was this draft
        lines.append(f"probability {probs[i]:.1%} at its parent, after temperature and filters")
    sampled = getattr(event, "sampling", "greedy") != "greedy"
    lines.append(f"model's {'sampled' if sampled else 'next'} token here: {quoted(text(event.predicted[i]))}")
    return "<br>".join(lines)


def _symbol(role: str, source: str) -> str:
    """A node's marker: its role's shape, or for a best-first or context node that source's shape for the role."""
    return NODE_SOURCES[source][1].get(role, NODE_ROLES[role][2]) if source in NODE_SOURCES else NODE_ROLES[role][2]


def label_chars(pos: TreeLayout, compact: bool = False) -> int:
    """The longest label (in signs) that fits between a node and the next depth at the figure's narrowest width:
    the column's width in px times ``LABEL_W``, less the widest marker, over one sign's width."""
    lk = look(compact)
    x0, x1 = x_range(pos)
    column_px = (lk.width - 2 * lk.side) / (x1 - x0)
    widest_marker = max(size for *_, size in NODE_ROLES.values())
    return max(3, int((column_px * LABEL_W - widest_marker / 2 - TEXT_PAD) / (CHAR_EM * lk.font)))


def _shows_label(role: str, n_nodes: int, compact: bool) -> bool:
    """On a phone a large tree's plain rejected drafts go unlabelled (their hover keeps the text)."""
    return not (compact and n_nodes > RANK_TEXT_NODES and role == "rejected")


def rank_trace(event: StepEvent, compact: bool = False) -> dict:
    """Each draft's rank among its parent's k candidates, written above the edge into it, on the draft's row just
    before the turn towards it; empty on a
    tree of more than ``RANK_TEXT_NODES`` nodes (the hover gives it there). Point ids: ``"rank <node>"``."""
    pos = event_layout(event)
    points = []
    if len(event.tree_tokens) <= RANK_TEXT_NODES:
        for i, p in enumerate(event.tree_parents):
            rank = draft_rank(event, i)
            if rank is not None:
                points.append((pos.x[p] + RANK_X, pos.y[i], str(rank), f"rank {i}"))
    xs, ys, texts, ids = zip(*points) if points else ((),) * 4
    return dict(type="scatter", mode="text", name="draft ranks", showlegend=False, x=list(xs), y=list(ys),
                text=list(texts), hovertext=[], ids=list(ids), hoverinfo="skip", textposition="top left",
                textfont=dict(size=look(compact).font - 2, color="#666666"))


def step_traces(event: StepEvent, text: TokenNamer, compact: bool = False, chars: int | None = None) -> list[dict]:
    """The texts and markers of one step: the edges' ranks (``rank_trace``), then one scatter trace per role in
    ``ROLES`` (rejected, broke, accepted, root, bonus), always those six in that order so that animation frames can
    swap their data. Each point's ``ids`` entry is its node index (the bonus: ``"bonus after <node>"``), so that a
    frame matches points by node. A step with ``tree_sources`` gives every node trace one marker symbol per point
    (``_symbol``); a template's step, one symbol per trace. Labels are cut to ``chars`` signs (default: what fits,
    ``label_chars``)."""
    pos = event_layout(event)
    n = len(event.tree_tokens)
    chars = chars or label_chars(pos, compact)
    points: dict[str, list[tuple]] = {role: [] for role in ROLES}
    for i, (role, source) in enumerate(zip(node_roles(event), node_sources(event))):
        hover = _node_hover(event, i, int(pos.x[i]), source, text)
        shown = label(event.tree_text[i], chars) if _shows_label(role, n, compact) else ""
        points[role].append((pos.x[i], pos.y[i], shown, hover, str(i), _symbol(role, source)))
    last = event.accepted_path[-1]
    bonus_text = text(event.bonus_token)
    points["bonus"].append((pos.x[n], pos.y[n], label(bonus_text, chars),
                            f"<b>bonus token {quoted(bonus_text)}</b>  (id {event.bonus_token})<br>"
                            f"the model's own next token after node {last} "
                            f"{quoted(event.tree_text[last])}; not drafted, produced by the same forward pass",
                            f"bonus after {last}", NODE_ROLES["bonus"][2]))
    traces = [rank_trace(event, compact)]
    font = look(compact).font
    for role in ROLES:
        name, colour, symbol, size = NODE_ROLES[role]
        xs, ys, labels, hovers, ids, symbols = zip(*points[role]) if points[role] else ((),) * 6
        traces.append(dict(
            type="scatter", mode="markers+text", name=name, legendgroup=role, showlegend=False, x=list(xs),
            y=list(ys), text=list(labels), hovertext=list(hovers), ids=list(ids),
            hovertemplate="%{hovertext}<extra></extra>", textposition="middle right",
            textfont=dict(size=font, color="#555555" if role == "rejected" else "#222222"),
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
    ("best-first", "context"): its shape in a neutral grey, the context's with its green edge. Each key's one
    point lies outside the axes (``KEY_AT``): an animation draws a point at ``None`` in the plot's corner."""
    keys = [dict(type="scatter", mode="markers", name=name, legendgroup=role, legendrank=order, x=[KEY_AT],
                 y=[KEY_AT], hoverinfo="skip",
                 marker=dict(color=colour, symbol=symbol, size=size, line=dict(color=colour, width=2)))
            for order, (role, (name, colour, symbol, size)) in enumerate(NODE_ROLES.items())]
    for order, source in enumerate(sources, start=len(keys)):
        name, symbols = NODE_SOURCES[source]
        key = dict(type="scatter", mode="markers", name=name, legendgroup=f"source {source}", legendrank=order,
                   x=[KEY_AT], y=[KEY_AT], hoverinfo="skip",
                   marker=dict(color=SOURCE_KEY, symbol=symbols["rejected"], size=11,
                               line=dict(color=SOURCE_KEY, width=2)))
        if source == "context":
            key.update(mode="lines+markers", line=dict(color=CONTEXT_EDGE, width=2))
        keys.append(key)
    return keys


def step_title(event: StepEvent, text: TokenNamer, compact: bool = False) -> str:
    """What the step did, in words, on two lines (more, wrapped, when ``compact``)::

        Decoding step 12 (tr, tree small): 2 of 12 draft tokens accepted, plus 1 bonus token
        added the text '␣the␣cat␣sat' (3 tokens from one forward pass)

    with accepted nodes copied from the context, ``"... 2 of 12 draft tokens accepted (1 copied from the
    context) ..."``; a run cut at its end before the bonus token says so."""
    n = event.accepted_draft_tokens
    drafted = len(event.tree_tokens) - 1
    sources = node_sources(event)
    copied = sum(1 for i in event.accepted_path[1:] if sources[i] == "context")
    added = len(event.new_tokens)
    tree = "" if event.tree_name == event.method else f", tree {escape(event.tree_name)}"  # rest's tree is "rest"
    head = f"Decoding step {event.step} ({event.method}{tree}): "
    if drafted == 0:
        head += "no draft tokens, the model's own next token only"
    else:
        head += (f"{n} of {drafted} draft token{'s' * (drafted != 1)} accepted"
                 f"{f' ({copied} copied from the context)' if copied else ''}"
                 + (", plus 1 bonus token" if added > n else ", the run ended before the bonus token"))
    tail = f"added the text {quoted(event.new_text)} ({added} token{'s' * (added != 1)} from one forward pass)"
    chars = look(compact).title_chars
    return wrap(head, chars) + "<br>" + wrap(tail, chars)


def x_range(pos: TreeLayout) -> tuple[float, float]:
    """The x axis: from just left of the root's marker to the end of the deepest column's label."""
    return -0.25, pos.depth + LABEL_W + 0.05


def figure_layout(layouts: list[TreeLayout], title: str = "", legend: Sequence[str] = (), compact: bool = False,
            ranks: bool = False) -> dict:
    """Axes wide enough for every tree in ``layouts``, so an animation never rescales; the title (``<br>`` lines)
    on top, the ``legend`` names under it, each given the room it needs at the narrowest width."""
    lk = look(compact)
    depth = max(p.depth for p in layouts)
    rows = max(p.rows for p in layouts)
    y_range = [-(rows - 1) - 0.8, 0.8]
    title_px = 10 + (title.count("<br>") + 1) * round(lk.title_font * 1.35)
    legend_px = legend_rows(legend, lk) * 30 if legend else 0  # a row holds the bonus token's star
    axis_title = ("depth in the draft tree; the number on an edge: the draft's rank among its parent's k candidates "
                  "(0 = likeliest)" if ranks else "depth in the draft tree (hover a node for its rank and more)")
    axis_title = wrap(axis_title, lk.title_chars + 10)
    margin = dict(l=lk.side, r=lk.side, t=title_px + legend_px + 12, b=40 + 16 * (axis_title.count("<br>") + 1))
    height = max(320, round(ROW_PX * (y_range[1] - y_range[0]) + margin["t"] + margin["b"]))
    return dict(
        height=height,
        margin=margin,
        plot_bgcolor="white",
        hovermode="closest",
        # the legend grows up from the plot and the title down from the top: each keeps its place at any height
        legend=dict(orientation="h", yanchor="bottom", y=1, x=0, font=dict(size=lk.legend_font)),
        xaxis=dict(range=list(x_range(max(layouts, key=lambda p: p.depth))), tickvals=list(range(depth + 1)),
                   ticktext=["root"] + [str(d) for d in range(1, depth + 1)],
                   title=dict(text=axis_title, font=dict(size=lk.font + 1)), showgrid=False, zeroline=False,
                   fixedrange=True),
        yaxis=dict(range=y_range, visible=False, fixedrange=True),
        title=dict(text=title, font=dict(size=lk.title_font), x=0, xref="paper",
                   # plotly sets a title of several lines about a line too high for its anchor: one more line down
                   y=1 - (8 + lk.title_font) / height, yanchor="top"),
    )


def _legend_names(sources: Sequence[str]) -> list[str]:
    return [t["name"] for t in legend_keys(sources)]


def tree_figure(event: StepEvent, token_text: TokenNamer | None = None, compact: bool = False) -> go.Figure:
    """The draft tree of one decoding step. ``token_text`` names ids the event does not (predictions, the bonus):
    a tokenizer's decode, or ``text_lookup(all_events)`` to use everything a trace decoded. ``compact``: laid out
    for a phone."""
    text = text_lookup([event], token_text)
    sources = _sources_drawn([event])
    traces = step_traces(event, text, compact)
    layout = figure_layout([event_layout(event)], step_title(event, text, compact), _legend_names(sources), compact,
                     ranks=bool(traces[0]["x"]))
    layout["shapes"] = step_shapes(event)
    return go.Figure(data=legend_keys(sources) + traces, layout=layout)


def _animation_controls(names: list[str], below: int) -> dict:
    """Play, pause and a slider over the frames, ``below`` px under the plot (past the x axis and its title)."""
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
                          yanchor="top", pad=dict(t=below + 15, r=10), showactive=False)],
        sliders=[dict(steps=steps, active=0, x=0.16, len=0.84, y=0, yanchor="top", pad=dict(t=below),
                      currentvalue=dict(prefix="decoding step ", font=dict(size=12, color="#444444")),
                      font=dict(color=tick_colour))],
    )


def _frame_data(traces: list[dict], symbols: bool) -> list[dict]:
    """What changes between frames: positions, texts and ids, and with ``symbols`` each node's marker symbol; the
    other styles stay those of the figure's own traces. Plotly merges frame data into the traces (a frame without
    a symbol list would keep the previous frame's), and validating less keeps 300 frames fast."""
    data = [{k: t[k] for k in ("x", "y", "text", "hovertext", "ids")} for t in traces]
    if symbols:
        for d, t in zip(data[1:], traces[1:]):  # the node traces; the first holds the ranks' texts
            symbol = t["marker"]["symbol"]
            d["marker"] = dict(symbol=symbol if isinstance(symbol, list) else [symbol] * len(t["x"]))
    return data


def tree_animation(events: Sequence[StepEvent], token_text: TokenNamer | None = None,
                   compact: bool = False) -> go.Figure:
    """A whole run as one figure: one frame per decoding step (named by its step number), a play button and a
    slider. ``token_text`` and ``compact`` as for ``tree_figure``; by default the whole trace names the tokens.

    Every frame carries the six traces of ``step_traces`` and the edge shapes of ``step_shapes``. The bonus star
    sits beside the step's last accepted node, so the rows below it move down one row in steps where that node has
    children; each point keeps its id, so a frame moves a node rather than swapping it for another. Where some
    step has ``tree_sources``, every frame gives each node trace its per-point marker symbols, and where some step
    copied nodes from the context, every frame has the green edges' shape. Labels are cut to what fits the
    largest tree of the run, the same in every frame.
    """
    if not events:
        raise ValueError("tree_animation needs at least one step event")
    text = text_lookup(events, token_text)
    names = [str(e.step) for e in events]
    if len(set(names)) < len(names):  # events of several runs: frames need distinct names for the slider
        names = [str(i) for i in range(len(events))]
    layouts = [event_layout(e) for e in events]
    widest = max(layouts, key=lambda p: p.depth)
    chars = label_chars(widest, compact)
    traces = [step_traces(e, text, compact, chars) for e in events]
    symbols = any(e.tree_sources for e in events)
    context = any(has_context(e) for e in events)
    sources = _sources_drawn(events)
    keys = legend_keys(sources)
    first = len(keys)
    titles = [step_title(e, text, compact) for e in events]
    frames = [dict(name=name, data=_frame_data(t, symbols), traces=list(range(first, first + len(t))),
                   layout=dict(title=dict(text=title), shapes=step_shapes(e, context)))
              for name, e, t, title in zip(names, events, traces, titles)]
    longest = max(titles, key=lambda s: s.count("<br>"))
    layout = figure_layout(layouts, longest, _legend_names(sources), compact,
                     ranks=any(t[0]["x"] for t in traces))
    layout["title"]["text"] = titles[0]
    layout["shapes"] = frames[0]["layout"]["shapes"]
    below = layout["margin"]["b"]
    layout["height"] += 80  # room for the play button and the slider
    layout["margin"]["b"] += 80
    layout.update(_animation_controls(names, below))
    return go.Figure(data=keys + traces[0], layout=layout, frames=frames)
