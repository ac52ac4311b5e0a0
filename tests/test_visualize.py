"""Figures drawn from the recorded traces: each test checks what a figure holds against the events themselves,
or against a reference computed here another way (networkx ancestors for the mask, Counter for the histogram)."""

from __future__ import annotations

import html
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import networkx as nx
import plotly.graph_objects as go
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tr_core.events import RowUpdate, StepEvent  # noqa: E402
from visualize import (  # noqa: E402
    accepted_length_figure,
    label,
    load_trace,
    mask_figure,
    matrix_figure,
    node_roles,
    race_figure,
    shown_rows,
    speedup_figure,
    text_lookup,
    token_text_map,
    tree_animation,
    tree_figure,
    tree_layout,
    visible,
)
from visualize.charts import KEY_NUMBER, step_latency_figure  # noqa: E402
from visualize.lesson_fig import retrieval_figure, row_figure  # noqa: E402
from visualize.matrix_fig import ACCEPTED, CHANGED, COMPACT_RANKS, MOVED, SAME, cell_text  # noqa: E402
from visualize.palette import BLACK, BLUE, CONTEXT_EDGE, GREY, NODE_ROLES, NODE_SOURCES, ORANGE, VERMILLION  # noqa: E402
from visualize.tree_fig import (  # noqa: E402
    CHAR_EM,
    RANK_TEXT_NODES,
    RANK_X,
    TEXT_PAD,
    event_layout,
    has_context,
    label_chars,
    step_layout,
)
from visualize.tree_layout import ROLES  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
PAPER = load_trace(FIXTURES / "trace_paper.json")
SMALL = load_trace(FIXTURES / "trace_small.json")
ROLE_NAMES = {NODE_ROLES[r][0]: r for r in ROLES}


def hand_event(**changes):
    """A 5-node tree by hand: root 'a' -> ' b' (rank 0) -> '\\n' (rank 0), ' b' -> 'c' (rank 1); 'a' -> 'd'."""
    event = StepEvent(
        step=3, method="tr", tree_name="hand", tree_tokens=[10, 11, 12, 13, 14], tree_parents=[-1, 0, 0, 1, 1],
        tree_ranks=[0, 0, 1, 0, 1], tree_text=["a", " b", "d", "\n", "c"], predicted=[11, 13, 99, 15, 16],
        accepted_path=[0, 1, 3], bonus_token=15, new_tokens=[11, 13, 15], new_text=" b\n e",
        rows_updated=[RowUpdate(10, [11, 12], [11, 40]), RowUpdate(11, [13, 14], [13, 99]),
                      RowUpdate(13, [50, 51], [15, 51])])
    return replace(event, **changes)


def node_points(fig) -> dict[str, list[tuple[float, float, str]]]:
    """``{role: [(x, y, text), ...]}`` from a tree figure's node traces (not its legend keys)."""
    out = {}
    for trace in fig.data:
        if trace.mode == "markers+text":
            out[ROLE_NAMES[trace.name]] = list(zip(trace.x, trace.y, trace.text))
    return out


# --- token text ----------------------------------------------------------------------------------------------------

def test_whitespace_is_visible_and_labels_are_short_and_escaped():
    assert visible(" a\n\tb\r") == "␣a↵⇥b⇤"
    assert label(" engineering") == "␣engineer…"
    assert label("<|im_end|>") == "&lt;|im_end|&gt;"


def test_token_text_comes_from_the_trace_or_the_caller():
    known = token_text_map(SMALL)
    assert known[12985] == " marvel" and known[30] == "."
    # A bonus token's text is what new_text holds after the accepted drafts; it is also the next step's root.
    for e, nxt in zip(SMALL, SMALL[1:]):
        assert known[e.bonus_token] == nxt.tree_text[0]
    assert text_lookup(SMALL)(10 ** 6) == "#1000000"
    assert text_lookup(SMALL, lambda t: f"<{t}>")(30) == "<30>"


# --- draft tree ----------------------------------------------------------------------------------------------------

def test_layout_of_the_paper_tree_keeps_every_label_apart():
    e = PAPER[0]
    pos = tree_layout(tuple(e.tree_parents))
    assert Counter(pos.x) == {0: 1, 1: 8, 2: 21, 3: 25, 4: 15, 5: 8, 6: 3}  # x is the depth
    assert pos.rows == sum(1 for i in range(81) if i not in e.tree_parents) == 40  # one row per leaf
    assert len(set(zip(pos.x, pos.y))) == 81  # no two nodes (hence labels) at one place
    for i, p in enumerate(e.tree_parents[1:], start=1):
        assert pos.y[i] <= pos.y[p]  # children never above their parent: edges only go right and down
    assert all(tree_layout(tuple(x.tree_parents)) is pos for x in PAPER)  # stable across steps


@pytest.mark.parametrize("event", PAPER + SMALL, ids=lambda e: f"{e.tree_name}-{e.step}")
def test_tree_figure_shows_the_step(event):
    fig = tree_figure(event)
    pts = node_points(fig)
    pos = event_layout(event)
    n = len(event.tree_tokens)
    assert sum(len(v) for v in pts.values()) == n + 1  # every node, plus the bonus node
    at = {(x, y): text for v in pts.values() for x, y, text in v}
    chars = label_chars(pos)
    for i, text in enumerate(event.tree_text):
        assert at[(pos.x[i], pos.y[i])] == label(text, chars)
    expect = {
        "root": [0], "accepted": event.accepted_path[1:],
        "broke": [i for i, p in enumerate(event.tree_parents) if p == event.accepted_path[-1]],
    }
    for role, nodes in expect.items():
        assert sorted((x, y) for x, y, _ in pts[role]) == sorted((pos.x[i], pos.y[i]) for i in nodes), role
    (bx, by, btext), = pts["bonus"]
    last = event.accepted_path[-1]
    assert (bx, by) == (pos.x[last] + 1, pos.y[last])  # beside its parent, the last accepted node, in its row
    assert btext == label(text_lookup([event])(event.bonus_token), chars)
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert sorted(legend) == sorted(ROLE_NAMES)  # every role in the legend, even one with no node this step
    blue = [t.name for t in fig.data if t.mode == "markers+text" and t.marker.color == BLUE]
    assert blue == [NODE_ROLES["accepted"][0]]  # the accepted colour is the accepted nodes' only


def test_tree_hover_names_rank_depth_parent_row_and_prediction():
    fig = tree_figure(hand_event())
    hover = {t.name: t.hovertext for t in fig.data if t.mode == "markers+text"}
    accepted = hover[NODE_ROLES["accepted"][0]]
    assert "'↵'" in accepted[1] and "depth 2" in accepted[1]
    assert "rank 0 in the matrix row of '␣b'" in accepted[1] and "model's next token here: '␣e'" in accepted[1]
    assert hover[NODE_ROLES["broke"][0]] is None or len(hover[NODE_ROLES["broke"][0]]) == 0  # '\n' is a leaf
    assert [h.split("</b>")[0] for h in hover[NODE_ROLES["rejected"][0]]] == ["<b>'d'", "<b>'c'"]
    assert "bonus token '␣e'" in hover[NODE_ROLES["bonus"][0]][0]


def test_animation_has_one_frame_per_step_and_frames_follow_the_events():
    fig = tree_animation(SMALL)
    assert len(fig.frames) == len(SMALL) == len(fig.layout.sliders[0].steps)
    assert [f.name for f in fig.frames] == [str(e.step) for e in SMALL]
    accepted_index = len(fig.data) - len(ROLES) + ROLES.index("accepted")
    bonus_index = len(fig.data) - len(ROLES) + ROLES.index("bonus")
    for frame, e in zip(fig.frames, SMALL):
        by_trace = dict(zip(frame.traces, frame.data))
        assert 0 not in by_trace  # the legend keys stay
        assert list(by_trace[accepted_index].ids) == [str(i) for i in e.accepted_path[1:]]  # points keyed by node
        pos = event_layout(e)
        last = e.accepted_path[-1]
        assert (by_trace[bonus_index].x[0], by_trace[bonus_index].y[0]) == (pos.x[last] + 1, pos.y[last])
        assert f"step {e.step} " in frame.layout.title.text
        tree, accepted_edges, bonus_link = frame.layout.shapes
        assert tree.path.count("M") == len(e.tree_tokens) - 1
        assert accepted_edges.path.count("M") == len(e.accepted_path) - 1 or not accepted_edges.visible
        assert bonus_link.line.dash == "dash" and bonus_link.path.count("M") == 1


def test_animation_of_trees_that_change_shape_redraws_their_edges():
    chains = [hand_event(step=k, tree_tokens=list(range(10, 11 + k)), tree_parents=list(range(-1, k)),
                         tree_ranks=[0] * (k + 1), tree_text=["x"] * (k + 1), predicted=list(range(20, 21 + k)),
                         accepted_path=[0], bonus_token=20, new_tokens=[20], rows_updated=[]) for k in (1, 3, 2)]
    fig = tree_animation(chains)
    for frame, e in zip(fig.frames, chains):
        tree, _, _ = frame.layout.shapes
        assert tree.path.count("M") == len(e.tree_tokens) - 1


def test_a_300_step_animation_carries_in_each_frame_only_what_changes():
    """What keeps a long animation cheap to build, validate and send: each frame holds only the texts' and node
    traces' positions, texts and ids, the title and the three edge shapes (the tree's edges move with the bonus
    star, which pushes rows down); no styles, axes or controls, so the figure grows by one frame of the tree's
    size per step."""
    events = [replace(PAPER[i % len(PAPER)], step=i) for i in range(300)]
    fig = tree_animation(events)
    assert len(fig.frames) == len(fig.layout.sliders[0].steps) == 300
    traces = list(range(len(fig.data) - len(ROLES) - 1, len(fig.data)))  # the edges' ranks, then the nodes
    for frame, e in zip(fig.frames, events):
        assert list(frame.traces) == traces
        assert [set(d.to_plotly_json()) for d in frame.data] == [{"type", "x", "y", "text", "hovertext", "ids"}] * 6
        assert sum(len(d.x) for d in frame.data[1:]) == len(e.tree_tokens) + 1  # the nodes and the bonus token
        assert len(frame.data[0].x) == 0  # 81 nodes: the ranks are in the hover only
        assert set(frame.layout.to_plotly_json()) == {"title", "shapes"}
        assert len(frame.layout.shapes) == 3  # the tree's edges, the accepted path and the bonus link


# --- where the nodes came from ------------------------------------------------------------------------------------

def sourced_event(**changes):
    """``hand_event``'s tree built per step (tr-plus): ' b' (node 1) and '\\n' (node 3, under it) copied from the
    context, 'd' (node 2) and 'c' (node 4, rank 1 under ' b') grown best-first; ' b' accepted, so '\\n' and 'c' are
    where acceptance broke and 'd' is rejected."""
    return hand_event(**{**dict(method="tr-plus", tree_ranks=[0, -1, 0, -1, 1], predicted=[11, 77, 99, 15, 16],
                                tree_sources=["root", "context", "best-first", "context", "best-first"],
                                accepted_path=[0, 1], bonus_token=77, new_tokens=[11, 77], new_text=" b!"),
                         **changes})


def node_styles(fig) -> dict[str, tuple[str, str, str]]:
    """``{point id: (symbol, colour, hover)}`` over a tree figure's node traces; a trace's one symbol repeated."""
    out = {}
    for t in fig.data:
        if t.mode == "markers+text":
            symbols = t.marker.symbol if isinstance(t.marker.symbol, tuple) else [t.marker.symbol] * len(t.x)
            out.update((i, (s, t.marker.color, h)) for i, s, h in zip(t.ids, symbols, t.hovertext))
    return out


def test_nodes_from_the_context_and_best_first_have_their_own_shapes_edges_and_hovers():
    fig = tree_figure(sourced_event())
    styles = node_styles(fig)
    assert {i: s[:2] for i, s in styles.items()} == {
        "0": ("square", BLACK),  # the root, as ever
        "1": ("diamond", BLUE),  # accepted, copied from the context
        "2": ("square-open", GREY),  # rejected, best-first
        "3": ("diamond-x-open", VERMILLION),  # where it broke, copied from the context
        "4": ("square-x-open", VERMILLION),  # where it broke, best-first
        "bonus after 1": ("star", ORANGE),
    }
    for i in "13":
        assert ("copied from the context: what followed the latest earlier occurrence of the text ending here "
                "(parent ") in styles[i][2]
    assert ("rank 1 in the matrix row of '␣b' (0 = likeliest; parent, node 1; grown best-first by estimated path "
            "probability)") in styles["4"][2]
    assert not any("rank -1" in h for _, _, h in styles.values())
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == ["best-first from the matrix", "copied from the context"]
    grey, green, blue, _ = fig.layout.shapes
    assert (grey.line.color, green.line.color, blue.line.color) == (GREY, CONTEXT_EDGE, BLUE)
    assert green.path.count("M") == 2 and green.visible  # the edges into ' b' and '↵', under the blue path
    assert "1 of 4 draft tokens accepted (1 copied from the context)" in fig.layout.title.text.replace("<br>", " ")
    # The guided explanation's figures read ranks too: no "rank -1", no row cell taken for a context node.
    lesson_hovers = [h for t in retrieval_figure(sourced_event()).data if t.mode == "markers+text" for h in t.hovertext]
    assert "copied from the context, after 'a' (node 0)" in lesson_hovers[1]
    assert not any("rank -1" in h for h in lesson_hovers)
    assert list(row_figure(sourced_event(), text_lookup([sourced_event()])).data[0].z[0]) == [1, 0]


def test_the_legend_lists_only_the_sources_a_step_has():
    suffix = sourced_event(method="suffix", tree_sources=["root"] + ["context"] * 4, tree_ranks=[0] + [-1] * 4)
    legend = [t.name for t in tree_figure(suffix).data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == ["copied from the context"]
    dynamic = sourced_event(method="tr-dynamic", tree_sources=["root"] + ["best-first"] * 4, tree_ranks=[0, 0, 1, 0, 1])
    fig = tree_figure(dynamic)
    assert [t.name for t in fig.data if t.showlegend is not False][len(NODE_ROLES):] == ["best-first from the matrix"]
    assert len(fig.layout.shapes) == 3  # no green edges without context nodes


def test_lookaheads_window_guesses_and_n_grams_have_their_own_shapes_hovers_and_legend():
    event = sourced_event(method="lookahead", tree_name="lookahead", tree_ranks=[0] + [-1] * 4,
                          tree_sources=["root", "n-gram", "window", "n-gram", "window"])
    fig = tree_figure(event)
    styles = node_styles(fig)
    assert {i: s[0] for i, s in styles.items() if i != "bonus after 1"} == {
        "0": "square", "1": "pentagon", "2": "hexagon-open", "3": "pentagon-open-dot", "4": "hexagon-open-dot"}
    assert "a guess of the Jacobi window" in styles["2"][2] and "from the n-gram pool" in styles["1"][2]
    assert not any("rank" in h for _, _, h in styles.values())
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == [NODE_SOURCES["window"][0], NODE_SOURCES["n-gram"][0]]
    assert "Decoding step 3 (lookahead): 1 of 4 draft tokens" in fig.layout.title.text


@pytest.mark.parametrize("event", [PAPER[0], SMALL[0], hand_event(),
                                   hand_event(tree_sources=["root"] + ["matrix"] * 4)],
                         ids=["paper", "small", "hand", "hand-matrix-sources"])
def test_matrix_nodes_keep_their_roles_shapes(event):
    fig = tree_figure(event)
    roles = dict(zip(map(str, range(len(event.tree_tokens))), node_roles(event)))
    for i, (symbol, colour, _) in node_styles(fig).items():
        role = roles.get(i, "bonus")
        _, role_colour, role_symbol, _ = NODE_ROLES[role]
        assert (symbol, colour) == (role_symbol, role_colour)
    assert len([t for t in fig.data if t.showlegend is not False]) == len(NODE_ROLES)  # no source in the legend
    assert len(fig.layout.shapes) == 3
    if not event.tree_sources:  # a template's step: one symbol per trace, as before sources existed
        assert all(isinstance(t.marker.symbol, str) for t in fig.data if "markers" in t.mode)


def test_an_animation_over_steps_with_and_without_context_nodes_gives_every_frame_its_symbols():
    events = [hand_event(step=1), sourced_event(step=2), hand_event(step=3, tree_sources=["root"] + ["matrix"] * 4)]
    fig = tree_animation(events)
    traces = list(range(len(fig.data) - len(ROLES) - 1, len(fig.data)))  # the edges' ranks, then the nodes
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == [NODE_SOURCES["best-first"][0], NODE_SOURCES["context"][0]]
    for frame, e in zip(fig.frames, events):
        assert list(frame.traces) == traces
        symbols = {}
        for d, role in zip(frame.data[1:], ROLES):
            assert len(d.marker.symbol) == len(d.x)  # a list in every frame, so none keeps the frame before's
            symbols.update(zip(d.ids, d.marker.symbol))
        expect = node_styles(tree_figure(e))
        assert symbols == {i: s for i, (s, _, _) in expect.items()}
        tree, green, accepted, bonus = frame.layout.shapes  # one list of shapes in every frame
        assert green.line.color == CONTEXT_EDGE and green.visible == has_context(e)


# --- the bonus star, ranks, columns and labels that never overlap ----------------------------------------

def bonus_first_reference(parents: list[int], last: int):
    """The reference for ``step_layout``: ``tree_layout`` of the tree with the bonus inserted, re-indexed, as
    ``last``'s first child (before its first child in BFS order, or after every node if ``last`` is a leaf).
    Returns ``(layout, index of old node i, index of the bonus)``."""
    children = [i for i, p in enumerate(parents) if p == last]
    at = children[0] if children else len(parents)
    new = [p if p < at else p + 1 for p in parents]
    new.insert(at, last)
    return tree_layout(tuple(new)), (lambda i: i + (i >= at)), at


@pytest.mark.parametrize("event", [PAPER[0], SMALL[0], hand_event()], ids=["paper", "small", "hand"])
def test_the_bonus_star_sits_beside_its_parent_as_its_first_child(event):
    parents = event.tree_parents
    for last in range(len(parents)):  # every node as the last accepted one
        pos = step_layout(tuple(parents), last)
        ref, index, bonus = bonus_first_reference(parents, last)
        assert [(pos.x[i], pos.y[i]) for i in range(len(parents))] == [(ref.x[index(i)], ref.y[index(i)])
                                                                      for i in range(len(parents))]
        assert (pos.x[-1], pos.y[-1]) == (ref.x[bonus], ref.y[bonus]) == (pos.x[last] + 1, pos.y[last])
        assert pos.rows == ref.rows
        assert len(set(zip(pos.x, pos.y))) == len(pos.x)  # the star takes no node's place


@pytest.mark.parametrize("event", [hand_event(), sourced_event(), SMALL[0], PAPER[0]],
                         ids=["hand", "sourced", "small", "paper"])
def test_the_bonus_link_is_one_straight_dashed_line_from_its_parent(event):
    fig = tree_figure(event)
    bonus_link = fig.layout.shapes[-1]
    pos = event_layout(event)
    last = event.accepted_path[-1]
    points = [tuple(map(float, p.split(","))) for p in bonus_link.path[1:].split("L")]
    assert {y for _, y in points} == {pos.y[last]}  # it stays in its parent's row: it crosses no other branch
    assert points[0][0] > pos.x[last] and points[-1][0] < pos.x[last] + 1 and bonus_link.line.dash == "dash"


@pytest.mark.parametrize("event", [hand_event(), SMALL[0], SMALL[5], PAPER[0], PAPER[3], sourced_event()],
                         ids=["hand", "small-0", "small-5", "paper-0", "paper-3", "sourced"])
def test_depth_columns_are_contiguous_and_none_is_empty(event):
    fig = tree_figure(event)
    xs = {x for t in fig.data if t.mode == "markers+text" for x in t.x}
    assert xs == set(range(int(max(xs)) + 1))  # every column from the root to the deepest (the star's) is used
    assert list(fig.layout.xaxis.tickvals) == sorted(xs)
    assert fig.layout.xaxis.range[1] < max(xs) + 1  # and no empty column after the last


def test_ranks_are_written_on_the_edges_of_a_small_tree_and_in_every_hover():
    for event in SMALL[:5] + [hand_event()]:
        fig = tree_figure(event)
        ranks = fig.data[len(fig.data) - len(ROLES) - 1]
        assert ranks.mode == "text"
        pos = event_layout(event)
        expect = {f"rank {i}": (pos.x[p] + RANK_X, pos.y[i], str(event.tree_ranks[i]))
                  for i, p in enumerate(event.tree_parents) if p >= 0}
        assert dict(zip(ranks.ids, zip(ranks.x, ranks.y, ranks.text))) == expect  # above the edge into each draft
        axis_title = fig.layout.xaxis.title.text.replace("<br>", " ")
        assert "rank among its parent's k candidates (0 = likeliest)" in axis_title
    big = tree_figure(PAPER[0])
    assert len(PAPER[0].tree_tokens) > RANK_TEXT_NODES and len(big.data[len(big.data) - len(ROLES) - 1].x) == 0
    hovers = node_styles(big)
    for i in range(1, len(PAPER[0].tree_tokens)):
        assert f"rank {PAPER[0].tree_ranks[i]} in the matrix row of" in hovers[str(i)][2]
    # context nodes have no rank: nothing written on their edges
    ranks = tree_figure(sourced_event()).data[-len(ROLES) - 1]
    assert sorted(ranks.ids) == ["rank 2", "rank 4"]


def test_the_title_says_in_words_what_the_step_did():
    title = tree_figure(hand_event()).layout.title.text.replace("<br>", " ")
    assert title == ("Decoding step 3 (tr, tree hand): 2 of 4 draft tokens accepted, plus 1 bonus token "
                     "added the text '␣b↵␣e' (3 tokens from one forward pass)")
    assert "→" not in title
    for event in PAPER + SMALL:
        title = tree_figure(event, compact=True).layout.title.text
        assert all(len(html.unescape(line)) <= 50 for line in title.split("<br>"))  # wrapped for a phone


def sized_event(n: int, path: str) -> StepEvent:
    """The first ``n`` nodes of the paper tree (BFS order: a tree too) with long token texts, accepting nothing
    (``"none"``), the way to the deepest node (``"deep"``: the star in a column of its own) or the way to the node
    with the most children (``"busy"``: the star pushes them down)."""
    parents = PAPER[0].tree_parents[:n]
    ranks = [0] + [parents[:i].count(p) for i, p in enumerate(parents) if i]
    words = [" engineering", " of", "\n\n", "<|im_end|>", " internationalisation", "A", " the"]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    target = {"none": 0, "deep": max(range(n), key=lambda i: depth[i]),
              "busy": max(range(n), key=lambda i: parents.count(i))}[path]
    way = [target]
    while way[-1] != 0:
        way.append(parents[way[-1]])
    way = way[::-1]
    return hand_event(tree_name=f"paper[:{n}]", tree_tokens=list(range(100, 100 + n)), tree_parents=parents,
                      tree_ranks=ranks, tree_text=[words[i % len(words)] for i in range(n)],
                      predicted=[100 + parents.index(i) if i in parents else 7 for i in range(n)],
                      accepted_path=way, bonus_token=7, new_tokens=[100 + i for i in way[1:]] + [7],
                      new_text="".join(words[i % len(words)] for i in way[1:]) + " marvellously", rows_updated=[])


def text_boxes(fig, width: int):
    """Every label and marker of a tree figure as a pixel box ``(id, (left, top, right, bottom))`` in the plot
    area, from the figure's data alone: positions through the axis ranges and the plot's size (``width`` less the
    margins, the layout's height less its margins), a label's width as its length times ``CHAR_EM`` font sizes.
    A node's label starts ``TEXT_PAD`` past its marker ("middle right"); a rank's text ends at its point, above
    the edge ("top left")."""
    lay = fig.layout
    plot_w, plot_h = width - lay.margin.l - lay.margin.r, lay.height - lay.margin.t - lay.margin.b
    (x0, x1), (y0, y1) = lay.xaxis.range, lay.yaxis.range
    labels, markers = [], []
    for t in fig.data:
        if not t.x or t.showlegend is not False:  # the legend keys
            continue
        font = t.textfont.size
        for name, x, y, text in zip(t.ids, t.x, t.y, t.text):
            cx, cy = (x - x0) / (x1 - x0) * plot_w, (y1 - y) / (y1 - y0) * plot_h
            w, h = len(html.unescape(text or "")) * CHAR_EM * font, 1.2 * font
            if t.mode == "markers+text":
                r = t.marker.size / 2 + 1
                markers.append((name, (cx - r, cy - r, cx + r, cy + r)))
                if text:
                    labels.append((name, (cx + r + TEXT_PAD, cy - h / 2, cx + r + TEXT_PAD + w, cy + h / 2)))
            elif text:
                labels.append((name, (cx - w, cy - 2 - h, cx, cy - 2)))
    return labels, markers, plot_w + lay.margin.r


def overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("compact, width", [(False, 1366), (False, 760), (True, 390), (True, 360)],
                         ids=["laptop", "laptop-column", "phone", "small-phone"])
@pytest.mark.parametrize("path", ["none", "deep", "busy"])
@pytest.mark.parametrize("n", [4, 9, 33, 81])
def test_no_tree_label_overlaps_another_label_or_a_marker(n, path, compact, width):
    event = sized_event(n, path)
    fig = tree_figure(event, compact=compact)
    labels, markers, right_edge = text_boxes(fig, width)
    assert sum(1 for name, _ in labels if not name.startswith("rank")) >= min(n, 5)  # the story is labelled
    for k, (name, box) in enumerate(labels):
        assert box[2] <= right_edge, f"{name}'s label runs off the figure"
        for other, other_box in labels[k + 1:]:
            assert not overlaps(box, other_box), f"labels of {name} and {other} overlap"
        for other, marker in markers:
            if other != name:
                assert not overlaps(box, marker), f"the label of {name} covers the marker of {other}"
    if compact and n > RANK_TEXT_NODES:  # on a phone a big tree names its story's nodes, the rest in the hover
        rejected = fig.data[len(fig.data) - len(ROLES) + ROLES.index("rejected")]
        assert set(rejected.text) == {""} and all(rejected.hovertext)


def test_animation_frames_keep_labels_apart_and_the_star_beside_its_parent():
    events = [sized_event(33, p) for p in ("none", "deep", "busy")]
    events = [replace(e, step=i) for i, e in enumerate(events)]
    fig = tree_animation(events, compact=True)
    for frame, e in zip(fig.frames, events):
        still = go.Figure(data=list(fig.data[:len(fig.data) - len(ROLES) - 1]) + [
            go.Scatter(**{**t.to_plotly_json(), **d.to_plotly_json()})
            for t, d in zip(fig.data[len(fig.data) - len(ROLES) - 1:], frame.data)], layout=fig.layout)
        labels, _, _ = text_boxes(still, 360)
        assert not any(overlaps(a, b) for k, (_, a) in enumerate(labels) for _, b in labels[k + 1:])
        bonus = frame.data[-1]
        pos = event_layout(e)
        assert (bonus.x[0], bonus.y[0]) == (pos.x[e.accepted_path[-1]] + 1, pos.y[e.accepted_path[-1]])


# --- adjacency matrix ----------------------------------------------------------------------------------------------

def test_drafts_are_read_from_the_rows_before_the_update():
    for e in PAPER + SMALL:
        old = {r.token: r.old for r in e.rows_updated}
        for i in range(1, len(e.tree_tokens)):
            assert old[e.tree_tokens[e.tree_parents[i]]][e.tree_ranks[i]] == e.tree_tokens[i]


@pytest.mark.parametrize("event", PAPER[:8] + SMALL, ids=lambda e: f"{e.tree_name}-{e.step}")
def test_heatmap_cells_are_the_rows_of_the_event(event):
    fig = matrix_figure(event, max_rows=12)
    rows = shown_rows(event, 12)
    assert len(rows) == min(12, len(event.rows_updated))
    path_tokens = [event.tree_tokens[i] for i in event.accepted_path]
    assert [r.token for r in rows[:len(set(path_tokens))]] == list(dict.fromkeys(path_tokens))[:12]
    before, after = fig.data[0], fig.data[1]
    assert [list(r) for r in before.customdata] == [r.old for r in rows]
    assert [list(r) for r in after.customdata] == [r.new for r in rows]
    text = text_lookup([event])
    # whole labels: the cell's lines joined again are the token's whole text (whitespace visible), never cut
    assert [[html.unescape(c.replace("<br>", "")) for c in r] for r in after.text] == \
        [[visible(text(t)) for t in r.new] for r in rows]


def test_heatmap_highlights_only_tokens_the_step_changed():
    fig = matrix_figure(hand_event())
    # rows: 'a' [11, 12] -> [11, 40]; ' b' [13, 14] -> [13, 99]; '\n' [50, 51] -> [15, 51]
    assert [list(r) for r in fig.data[0].z] == [[ACCEPTED, CHANGED], [ACCEPTED, CHANGED], [CHANGED, SAME]]
    assert [list(r) for r in fig.data[1].z] == [[ACCEPTED, CHANGED], [ACCEPTED, CHANGED], [ACCEPTED, SAME]]
    # a row rewritten with its own tokens in another order changed nothing there: muted, with where the token went
    moved = hand_event(rows_updated=[RowUpdate(10, [11, 12, 30, 31], [11, 31, 12, 32])])
    fig = matrix_figure(moved)
    assert [list(r) for r in fig.data[0].z] == [[ACCEPTED, MOVED, CHANGED, MOVED]]
    assert [list(r) for r in fig.data[1].z] == [[ACCEPTED, MOVED, MOVED, CHANGED]]
    assert "unchanged token, now at rank 2" in fig.data[0].hovertext[0][1]
    assert "new in the row" in fig.data[1].hovertext[0][3] and "dropped from the row" in fig.data[0].hovertext[0][2]
    legend = [t.name for t in fig.data[2:]]
    assert legend[CHANGED].startswith("changed") and len(legend) == 4
    assert "yellow marks the tokens that actually changed" in fig.layout.title.text.replace("<br>", " ")


@pytest.mark.parametrize("event", PAPER[:3] + SMALL[:3], ids=lambda e: f"{e.tree_name}-{e.step}")
def test_heatmap_on_a_phone_stacks_before_over_after_with_fewer_wider_cells(event):
    wide, phone = matrix_figure(event), matrix_figure(event, compact=True)
    assert len(phone.data[0].z[0]) == COMPACT_RANKS < len(wide.data[0].z[0])
    assert phone.layout.yaxis.domain[0] > phone.layout.yaxis2.domain[1]  # before above after
    before_title, after_title = phone.layout.annotations[:2]
    assert before_title.y > after_title.y  # the subplot titles no longer share a line

    def line_chars(compact):  # the longest line of a cell, every token named ' internationalisation' (21 signs)
        fig = matrix_figure(event, lambda t: " internationalisation", compact=compact)
        return max(len(html.unescape(line)) for r in fig.data[1].text for c in r for line in c.split("<br>"))

    assert line_chars(True) >= 8 and line_chars(False) >= 8  # a cell is wide enough for a word on both
    assert cell_text(" connection", 6) == "␣conne<br>ction"


def test_heatmap_of_a_step_without_rows_says_so():
    fig = matrix_figure(hand_event(rows_updated=[], method="pld"))
    assert "no adjacency-matrix rows" in fig.layout.annotations[0].text.replace("<br>", " ")


# --- tree attention mask -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("event", [PAPER[1], SMALL[15], hand_event()], ids=["paper", "small", "hand"])
def test_mask_is_the_ancestor_mask(event):
    graph = nx.DiGraph((p, i) for i, p in enumerate(event.tree_parents) if p >= 0)
    n = len(event.tree_parents)
    reference = [[j == i or j in nx.ancestors(graph, i) for j in range(n)] for i in range(n)]
    fig = mask_figure(event)
    assert [[c > 0 for c in row] for row in fig.data[0].z] == reference
    assert list(fig.layout.yaxis.ticktext) == [f"{i} {label(t)}" for i, t in enumerate(event.tree_text)]


# --- race and speed ------------------------------------------------------------------------------------------------

def test_race_lines_follow_time_and_tokens():
    fig = race_figure({"tr": SMALL, "tr-paper": PAPER})
    assert [t.name.split(":")[0] for t in fig.data] == ["tr", "tr-paper"]
    assert list(fig.data[0].x) == [0.0] + [e.elapsed_s for e in SMALL]
    assert list(fig.data[0].y) == [0] + [e.total_tokens for e in SMALL]
    assert fig.data[0].line.dash != fig.data[1].line.dash  # lines differ in shape, not colour only


def test_accepted_length_histogram_counts_steps():
    fig = accepted_length_figure({"tr": PAPER, "small": SMALL})
    for trace, events in zip(fig.data, [PAPER, SMALL]):
        counts = Counter(len(e.accepted_path) for e in events)
        assert dict(zip(trace.x, trace.customdata)) == counts
        assert sum(trace.y) == pytest.approx(100)


def test_speedup_bars_per_category():
    def numbers(speedup, accepted, **extra):
        return dict(tokens_per_s=10 * speedup, speedup=speedup, mean_accepted_tokens=accepted, **extra)

    bench = {"config": {}, "methods": {
        "plain": numbers(1.0, 1.0, identical=True, questions=4, by_category={"math": numbers(1.0, 1.0)}),
        "tr": numbers(1.9, 2.5, identical=False, questions=4,
                      by_category={"math": numbers(2.2, 2.8), "writing": numbers(1.5, 2.0)}),
    }}
    fig = speedup_figure(bench)
    plain_speed, plain_acc, tr_speed, tr_acc = fig.data
    assert list(tr_speed.x) == ["all", "math", "writing"]
    assert list(tr_speed.y) == [1.9, 2.2, 1.5] and list(tr_acc.y) == [2.5, 2.8, 2.0]
    assert list(plain_speed.y) == [1.0, 1.0, None]  # plain reported no 'writing' category
    assert "differs" in tr_speed.name and "differs" not in plain_speed.name
    assert tr_speed.error_y.array is None  # results from before the intervals: the ratio of means, no error bars


def test_speedup_bars_are_medians_with_their_intervals_where_the_results_hold_them():
    def numbers(mean, median, ci, **extra):
        return dict(tokens_per_s=10 * mean, speedup=mean, speedup_median=median, speedup_ci95=ci,
                    mean_accepted_tokens=1.5, **extra)

    bench = {"config": {}, "methods": {
        "plain": numbers(1.0, 1.0, [1.0, 1.0], identical=4, questions=4, by_category={"math": numbers(1.0, 1.0, None)}),
        "tr": numbers(1.9, 1.7, [1.2, 2.1], identical=4, questions=4, by_category={"math": numbers(2.2, 2.0, None)}),
    }}
    fig = speedup_figure(bench)
    _, _, tr_speed, tr_acc = fig.data
    assert list(tr_speed.y) == [1.7, 2.0]  # the medians, not the ratios of means
    assert list(tr_speed.error_y.array) == pytest.approx([0.4, None]) and tr_speed.error_y.array[1] is None
    assert tr_speed.error_y.arrayminus[0] == pytest.approx(0.5)  # 1.7 - 1.2; one question in math: no interval
    assert tr_acc.error_y.array is None and "95% interval 1.20–2.10" in tr_speed.customdata[0]
    assert "median" in fig.layout.annotations[0].text


def test_step_latency_bars_are_the_events_numbers_and_the_baseline_is_plain_decoding():
    events = SMALL[:12]
    fig = step_latency_figure(events, baseline_ms=70.0)
    drafts, bonus, forward, overhead = fig.data[:4]
    steps = [e.step for e in events]
    assert all(list(t.x) == steps for t in (drafts, bonus, forward, overhead))
    assert list(drafts.y) == [e.accepted_draft_tokens for e in events]
    assert [d + b for d, b in zip(drafts.y, bonus.y)] == [len(e.new_tokens) for e in events]  # per forward pass
    assert list(forward.y) == [e.forward_ms for e in events] and list(overhead.y) == [e.overhead_ms for e in events]
    assert (drafts.yaxis, forward.yaxis) == ("y", "y2") and fig.layout.xaxis.matches == "x2"  # one step axis
    line, = fig.layout.shapes
    assert line.y0 == line.y1 == 70.0 and line.line.dash == "dash" and line.yref.startswith("y2")
    assert "plain decoding: one token per 70.0 ms" in [t.name for t in fig.data]
    ticks = fig.data[-1]
    assert list(ticks.y) == [70.0 * len(e.new_tokens) for e in events]  # plain's time for the same tokens
    e = events[0]
    ms = e.forward_ms + e.overhead_ms
    assert f"{ms / len(e.new_tokens):.1f} ms per token" in drafts.customdata[0]
    assert ("paid" if ms < 70.0 * len(e.new_tokens) else "did not pay") in drafts.customdata[0]
    assert fig.layout.annotations[0].text == KEY_NUMBER
    assert fig.layout.xaxis2.title.text == "decoding step"


def test_step_latency_reads_dicts_one_event_and_none():
    events = SMALL[:5]
    as_dicts = step_latency_figure([e.to_dict() for e in events])
    assert [list(t.y) for t in as_dicts.data] == [list(t.y) for t in step_latency_figure(events).data]
    assert not as_dicts.layout.shapes  # no baseline, no line
    one = step_latency_figure(events[:1], baseline_ms=10.0, title="one step")
    assert list(one.data[0].x) == [events[0].step] and one.layout.title.text == "one step"
    empty = step_latency_figure([])
    assert not empty.data and "No decoding steps yet" in empty.layout.annotations[0].text


def test_the_key_number_has_one_name_in_every_figure():
    bench = {"config": {}, "methods": {"tr": dict(tokens_per_s=20, speedup=1.5, mean_accepted_tokens=2.0,
                                                   tree_nodes=13, questions=1)}}
    figures = [speedup_figure(bench), accepted_length_figure({"tr": SMALL}), step_latency_figure(SMALL),
               tree_figure(SMALL[0]), matrix_figure(SMALL[0]), race_figure({"tr": SMALL})]
    texts = [f.to_json() for f in figures]
    assert KEY_NUMBER in texts[0] and KEY_NUMBER in texts[1] and KEY_NUMBER in texts[2]
    for text in texts:
        assert "mean accepted" not in text and "MAT " not in text and "tokens per step" not in text


# --- layering ------------------------------------------------------------------------------------------------------

def test_visualize_draws_a_trace_without_torch():
    code = ("import sys, visualize; e = visualize.load_trace('tests/fixtures/trace_small.json');"
            " visualize.tree_figure(e[0]); visualize.matrix_figure(e[0]);"
            " assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_figures_carry_a_slim_template_with_the_default_look():
    """Each figure sent to a browser carries its template: the package's default is plotly's own, cut to the trace
    types and layout it draws, so the figures look the same in far fewer bytes."""
    import json

    import plotly.io as pio

    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    full, slim = pio.templates["plotly"], fig.layout.template
    assert pio.templates.default == "token-recycling"
    for trace in ("scatter", "bar", "heatmap"):
        assert slim.data[trace] == full.data[trace]
    for key in ("colorway", "font", "xaxis", "yaxis", "plot_bgcolor", "paper_bgcolor", "hoverlabel", "colorscale"):
        assert slim.layout[key] == full.layout[key], key
    size = len(json.dumps(slim.to_plotly_json()))
    assert size < len(json.dumps(full.to_plotly_json())) / 2, size


def test_the_projection_chart_makes_room_for_every_line_of_its_title():
    """On a phone the projection's title wraps to 4-5 lines; it overlapped the bars when the top margin held two."""
    from visualize.charts import projection_figure

    rows = [{"device": "this machine", "speedup": 0.9, "modelled": False}, {"device": "A100", "speedup": 1.2}]
    title = ("this run's accepted tokens on other hardware: a model (weights over bandwidth against FLOPs over peak, "
             "plus launches), not a measurement; this machine as measured")
    for compact in (False, True):
        fig = projection_figure(rows, title, compact=compact)
        lines = fig.layout.title.text.count("<br>") + 1
        assert fig.layout.margin.t >= 24 + 22 * lines and fig.layout.height >= fig.layout.margin.t + 36 * len(rows)
    assert lines >= 4  # the phone's layout: the case that overlapped
