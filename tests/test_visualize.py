"""Figures drawn from the recorded traces: each test checks what a figure holds against the events themselves,
or against a reference computed here another way (networkx ancestors for the mask, Counter for the histogram)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from visualize import (accepted_length_figure, label, load_trace, mask_figure, matrix_figure, node_roles,  # noqa: E402
                       race_figure, shown_rows, speedup_figure, text_lookup, token_text_map, tree_animation,
                       tree_figure, tree_layout, visible)
from visualize.matrix_fig import ACCEPTED, KEPT, REPLACED  # noqa: E402
from visualize.lesson_fig import retrieval_figure, row_figure  # noqa: E402
from visualize.palette import (BLACK, BLUE, CONTEXT_EDGE, GREY, NODE_ROLES, NODE_SOURCES, ORANGE,  # noqa: E402
                               VERMILLION)
from tr_core.events import RowUpdate, StepEvent  # noqa: E402
from visualize.tree_fig import has_context  # noqa: E402
from visualize.tree_layout import BONUS_Y, ROLES  # noqa: E402

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
    pos = tree_layout(tuple(event.tree_parents))
    assert sum(len(v) for v in pts.values()) == len(event.tree_tokens) + 1  # every node, plus the bonus node
    at = {(x, y): text for v in pts.values() for x, y, text in v}
    for i, text in enumerate(event.tree_text):
        assert at[(pos.x[i], pos.y[i])] == label(text)
    expect = {
        "root": [0], "accepted": event.accepted_path[1:],
        "broke": [i for i, p in enumerate(event.tree_parents) if p == event.accepted_path[-1]],
    }
    for role, nodes in expect.items():
        assert sorted((x, y) for x, y, _ in pts[role]) == sorted((pos.x[i], pos.y[i]) for i in nodes), role
    (bx, by, btext), = pts["bonus"]
    assert (bx, by) == (pos.x[event.accepted_path[-1]] + 1, BONUS_Y)
    assert btext == label(text_lookup([event])(event.bonus_token))
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
    n_edges = sum(1 for p in SMALL[0].tree_parents if p >= 0)
    assert fig.data[0].x.count(None) == n_edges  # one template: its grey edges are a trace no frame touches
    for frame, e in zip(fig.frames, SMALL):
        by_trace = dict(zip(frame.traces, frame.data))
        assert 0 not in by_trace
        assert list(by_trace[accepted_index].ids) == [str(i) for i in e.accepted_path[1:]]  # points keyed by node
        assert f"step {e.step} " in frame.layout.title.text
        accepted_edges, bonus_link = frame.layout.shapes
        assert accepted_edges.path.count("M") == len(e.accepted_path) - 1 or not accepted_edges.visible
        assert bonus_link.line.dash == "dash"


def test_animation_of_trees_that_change_shape_redraws_their_edges():
    chains = [hand_event(step=k, tree_tokens=list(range(10, 11 + k)), tree_parents=list(range(-1, k)),
                         tree_ranks=[0] * (k + 1), tree_text=["x"] * (k + 1), predicted=list(range(20, 21 + k)),
                         accepted_path=[0], bonus_token=20, new_tokens=[20], rows_updated=[]) for k in (1, 3, 2)]
    fig = tree_animation(chains)
    assert fig.data[0].x == ()  # no static edges
    for frame, e in zip(fig.frames, chains):
        tree, _, _ = frame.layout.shapes
        assert tree.path.count("M") == len(e.tree_tokens) - 1


def test_a_300_step_animation_carries_in_each_frame_only_what_changes():
    """What keeps a long animation cheap to build, validate and send: the template's grey edges are drawn once, in
    the figure, and each frame holds only the node traces' positions, texts and ids, the title and the two shapes
    that change; no styles, axes or controls, so the figure grows by one frame of the tree's size per step."""
    events = [replace(PAPER[i % len(PAPER)], step=i) for i in range(300)]
    fig = tree_animation(events)
    assert len(fig.frames) == len(fig.layout.sliders[0].steps) == 300
    n_edges = sum(1 for p in PAPER[0].tree_parents if p >= 0)
    assert fig.data[0].x.count(None) == n_edges == 80
    node_traces = list(range(len(fig.data) - len(ROLES), len(fig.data)))
    for frame, e in zip(fig.frames, events):
        assert list(frame.traces) == node_traces
        assert [set(d.to_plotly_json()) for d in frame.data] == [{"type", "x", "y", "text", "hovertext", "ids"}] * 5
        assert sum(len(d.x) for d in frame.data) == len(e.tree_tokens) + 1  # the nodes and the bonus token
        assert set(frame.layout.to_plotly_json()) == {"title", "shapes"}
        assert len(frame.layout.shapes) == 2  # the accepted path and the bonus link, not the tree's 80 edges


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
    assert "rank 1 in the matrix row of '␣b' (parent, node 1; grown best-first by estimated path probability)" \
        in styles["4"][2]
    assert not any("rank -1" in h for _, _, h in styles.values())
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == ["best-first from the matrix", "copied from the context"]
    grey, green, blue, _ = fig.layout.shapes
    assert (grey.line.color, green.line.color, blue.line.color) == (GREY, CONTEXT_EDGE, BLUE)
    assert green.path.count("M") == 2 and green.visible  # the edges into ' b' and '↵', under the blue path
    assert "1 draft token accepted (1 copied from the context)" in fig.layout.title.text
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
        assert all(isinstance(t.marker.symbol, str) for t in fig.data)


def test_an_animation_over_steps_with_and_without_context_nodes_gives_every_frame_its_symbols():
    events = [hand_event(step=1), sourced_event(step=2), hand_event(step=3, tree_sources=["root"] + ["matrix"] * 4)]
    fig = tree_animation(events)
    node_traces = list(range(len(fig.data) - len(ROLES), len(fig.data)))
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend[len(NODE_ROLES):] == [NODE_SOURCES["best-first"][0], NODE_SOURCES["context"][0]]
    for frame, e in zip(fig.frames, events):
        assert list(frame.traces) == node_traces
        symbols = {}
        for d, role in zip(frame.data, ROLES):
            assert len(d.marker.symbol) == len(d.x)  # a list in every frame, so none keeps the frame before's
            symbols.update(zip(d.ids, d.marker.symbol))
        expect = node_styles(tree_figure(e))
        assert symbols == {i: s for i, (s, _, _) in expect.items()}
        green, accepted, bonus = frame.layout.shapes  # one list of shapes in every frame
        assert green.line.color == CONTEXT_EDGE and green.visible == has_context(e)


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
    assert [list(r) for r in after.text] == [[label(text(t), 8) for t in r.new] for r in rows]


def test_heatmap_colours_kept_replaced_and_accepted_cells():
    fig = matrix_figure(hand_event())
    # rows: 'a' [11, 12] -> [11, 40]; ' b' [13, 14] -> [13, 99]; '\n' [50, 51] -> [15, 51]
    assert [list(r) for r in fig.data[0].z] == [[ACCEPTED, REPLACED], [ACCEPTED, REPLACED], [REPLACED, KEPT]]
    assert [list(r) for r in fig.data[1].z] == [[ACCEPTED, REPLACED], [ACCEPTED, REPLACED], [ACCEPTED, KEPT]]


def test_heatmap_of_a_step_without_rows_says_so():
    fig = matrix_figure(hand_event(rows_updated=[], method="pld"))
    assert "no adjacency-matrix rows" in fig.layout.annotations[0].text


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


# --- layering ------------------------------------------------------------------------------------------------------

def test_visualize_draws_a_trace_without_torch():
    code = ("import sys, visualize; e = visualize.load_trace('tests/fixtures/trace_small.json');"
            " visualize.tree_figure(e[0]); visualize.matrix_figure(e[0]);"
            " assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
