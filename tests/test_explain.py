"""The "How it works" tab: each page's figure holds what the shipped trace holds, the texts quote the traces' own
numbers (the counts of the featured decoding step are the ones its figures show), the featured step is an ordinary
one in the middle of the answer, the page buttons open their pages, the matrix explorer follows a token's row,
nothing imports torch, and in headless Chromium the tab works with no model loaded at desktop and phone width (every
page shows its figure; screenshots go to $APP_SHOTS_DIR)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import ROOT

from tr_core.spec_bench import load_questions
from ui import lesson
from ui.explain import (
    build_tab,
    clamp,
    explorer_choices,
    explorer_html,
    indicator_html,
    page_updates,
    resolve_token,
    row_history,
)
from ui.lesson import PAGES
from visualize import ancestor_mask, label, shown_rows
from visualize.lesson_fig import row_before
from visualize.tree_fig import LABEL_W, MARKER_GAP
from visualize.tree_layout import node_roles, tree_layout

LESSON = lesson.load_lesson()
EVENT = LESSON.event
TITLES = [s.title for s in PAGES]
SPECIAL_TEXT = re.compile(r"<\|[^|]*\|>")  # <|im_end|>, <|im_start|>, <|endoftext|>


def figure(title: str):
    return lesson.page_figure(LESSON, TITLES.index(title))


def text(title: str) -> str:
    return lesson.page_text(LESSON, TITLES.index(title))


# --- the shipped traces ---------------------------------------------------------------------------------------------

def test_the_traces_are_small_described_and_one_prompt_hot_and_cold():
    files = sorted((ROOT / "assets" / "traces").glob("*.json"))
    assert {f.name for f in files} == {"hot.json", "hot.meta.json", "cold.json", "cold.meta.json"}
    assert sum(f.stat().st_size for f in files) < 1_000_000
    hot, cold = LESSON.hot.meta, LESSON.cold.meta
    assert (hot["start"], cold["start"]) == ("hot", "cold")
    for key in ("prompt", "model", "tree", "top_k", "vocab_size", "matrix_bytes"):
        assert hot[key] == cold[key]
    assert hot["matrix_bytes"] == hot["vocab_size"] * hot["top_k"] * 4 == 49_152 * 8 * 4
    assert 48 <= hot["tokens"] <= 96 and hot["tree"] == "small"
    assert hot["prompt"] not in {q.prompt for q in load_questions()}  # a generic prompt, not a benchmark question
    for trace in (LESSON.hot, LESSON.cold):
        assert trace.meta["steps"] == len(trace.events) and trace.meta["tokens"] == trace.events[-1].total_tokens
        assert all(e.method == "tr" and len(e.tree_tokens) == trace.meta["tree_nodes"] for e in trace.events)


def test_the_meta_names_every_token_the_trace_holds():
    from tr_core.events import token_ids_named as token_ids

    for trace in (LESSON.hot, LESSON.cold):
        assert {str(t) for t in token_ids(trace.events)} == set(trace.meta["token_text"])
        assert all(trace.text(e.bonus_token) == trace.meta["token_text"][str(e.bonus_token)] for e in trace.events)


def test_every_draft_came_from_its_parents_row_as_the_step_found_it():
    """Retrieval, checked on the real trace: node i is rank r of its parent's row before the update."""
    for e in LESSON.hot.events + LESSON.cold.events:
        for i in range(1, len(e.tree_tokens)):
            parent_row = row_before(e, e.tree_tokens[e.tree_parents[i]])
            assert e.tree_tokens[i] == parent_row[e.tree_ranks[i]]


# --- the decoding step pages 2-6 look at ---------------------------------------------------------------------------

def test_the_walkthrough_looks_at_an_ordinary_step_in_the_middle_of_the_answer():
    """On the shipped trace, so that a re-recording cannot regress it: not in the first or last fifth of the run,
    two or three accepted drafts and some rejected ones, and no special (chat-template) token in what it drafted,
    accepted or added."""
    events, i = LESSON.hot.events, LESSON.featured
    assert 0.2 * len(events) <= i < 0.8 * len(events)
    assert EVENT is events[i] and EVENT.step == i
    assert 2 <= EVENT.accepted_draft_tokens <= 3 and len(EVENT.accepted_path) < len(EVENT.tree_tokens)
    assert len(EVENT.new_tokens) == EVENT.accepted_draft_tokens + 1  # the answer did not end inside it
    texts = [*EVENT.tree_text, *(LESSON.hot.text(t) for t in [EVENT.bonus_token, *EVENT.new_tokens])]
    assert not [t for t in texts if SPECIAL_TEXT.search(t)]
    special = set(LESSON.hot.meta["special_ids"])
    assert special and not special & {*EVENT.tree_tokens, EVENT.bonus_token, *EVENT.new_tokens}
    assert all(SPECIAL_TEXT.fullmatch(LESSON.hot.text(t)) for t in special)


def test_the_featured_step_is_chosen_by_its_rule_not_by_hand():
    chosen = lesson.featured_step(LESSON.hot.events, set(LESSON.hot.meta["special_ids"]))
    assert chosen == LESSON.featured
    # the run's last decoding step (the answer's end: <|im_end|> drafted, the path cut at the end) never fits
    special = set(LESSON.hot.meta["special_ids"])
    assert not lesson.fits_walkthrough(LESSON.hot.events, len(LESSON.hot.events) - 1, special)


def test_the_verification_text_counts_what_its_figure_shows():
    """Every count in the verification page's text, read back from the text, against the event its figure draws."""
    body = text("Verification: keep what the model agrees with, plus one")
    title = str(figure("Verification: keep what the model agrees with, plus one").layout.title.text)
    n = EVENT.accepted_draft_tokens
    shown = int(re.search(r"(\d+) (?:of \d+ )?draft tokens? accepted", title).group(1))
    said = re.search(r"decoding step (\d+) the model accepted (.*?) \((\d+) guess(?:es)?, blue\) and added the "
                     r"bonus token (`.*?`)\s+\(orange star\): \*\*(\d+) tokens? from one forward pass\*\*", body, re.S)
    assert said, body
    assert int(said.group(1)) == EVENT.step and f"step {EVENT.step} " in title
    assert int(said.group(3)) == shown == n == len(said.group(2).split())
    assert int(said.group(5)) == n + 1 == len(EVENT.new_tokens)
    roles = node_roles(EVENT)
    crosses = re.search(r"held (\d+) guess(?:es)? for the next token there", body)
    assert int(crosses.group(1)) == roles.count("broke") > 0
    assert int(re.search(r"other (\d+) rejected guess", body).group(1)) == roles.count("rejected")
    assert roles.count("broke") + roles.count("rejected") == len(EVENT.tree_tokens) - 1 - n


def test_the_pages_about_the_step_name_it_and_count_it_as_their_figures_do():
    step = f"decoding step {EVENT.step}"
    for title in TITLES[1:6]:
        assert f"step {EVENT.step}" in str(figure(title).layout.title.text), title
    assert step in text(TITLES[1]) and step in text(TITLES[4])
    assert f"{len(EVENT.tree_tokens)} nodes" in text(TITLES[2])
    assert f"{len(EVENT.tree_tokens)} nodes in" in str(figure(TITLES[2]).layout.title.text)
    drafted = sum(1 for code in figure(TITLES[1]).data[0].z[0] if code)
    assert f"Its first {drafted} candidates" in text(TITLES[1])
    rewrote = re.search(r"rewrote (\d+) rows?\b.*?; (\d+) of them gained .*?and (\d+) belong", text(TITLES[5]), re.S)
    on_path = {EVENT.tree_tokens[i] for i in EVENT.accepted_path}
    rows = EVENT.rows_updated
    assert [int(g) for g in rewrote.groups()] == [len(rows), sum(bool(set(r.new) - set(r.old)) for r in rows),
                                                 sum(r.token not in on_path for r in rows)]
    assert len(figure(TITLES[5]).data[0].customdata) == len(EVENT.rows_updated)


def test_the_words_one_name_for_the_key_number_pages_and_decoding_steps():
    bodies = [lesson.page_text(LESSON, i) for i in range(len(PAGES))]
    for body in bodies:
        assert "tokens per pass" not in body and not re.search(r"\bsteps? \d", re.sub(r"(?i)decoding steps?", "", body))
        assert not re.search(r"(?<![\d.,])1 (tokens|guesses|rows|candidates|passes)\b", body)  # "1 tokens"
    assert lesson.KEY == "tokens per forward pass (bonus token included)"
    assert lesson.KEY in bodies[0] and bodies[6].count(lesson.KEY) == 2
    for i in range(len(PAGES)):
        assert "per pass" not in str(lesson.page_figure(LESSON, i).to_plotly_json())
    assert lesson.counted(1, "token") == "1 token" and lesson.counted(3, "guess", "guesses") == "3 guesses"


# --- each page's figure holds the trace -----------------------------------------------------------------------------

def test_the_run_figure_counts_tokens_against_passes():
    fig = figure("Why decoding is slow, and how guessing helps")
    line = fig.data[1]
    assert list(line.x) == [0] + [e.total_steps for e in LESSON.hot.events]
    assert list(line.y) == [0] + [e.total_tokens for e in LESSON.hot.events]
    assert f"{LESSON.hot.meta['tokens']} tokens in {LESSON.hot.meta['steps']} forward passes" in text(TITLES[0])


def test_the_row_figure_is_the_last_tokens_row_before_the_step():
    fig = figure("The adjacency matrix: what the model predicted before")
    root = EVENT.tree_tokens[0]
    assert list(fig.data[0].customdata[0]) == row_before(EVENT, root)
    drafted = [r for r, code in enumerate(fig.data[0].z[0]) if code]
    assert drafted == sorted(EVENT.tree_ranks[i] for i, p in enumerate(EVENT.tree_parents) if p == 0)


def test_the_retrieval_figure_is_the_steps_draft_tree_layer_by_layer():
    fig = figure("Retrieval: a tree of guesses, grown layer by layer")
    nodes = [t for t in fig.data if t.mode == "markers+text"]
    order = [i for t in nodes for i in t.customdata]
    assert order == list(range(len(EVENT.tree_tokens)))  # every node once, BFS order, layer after layer
    assert [s for t in nodes for s in t.text] == [label(s) for s in EVENT.tree_text]
    pos = tree_layout(tuple(EVENT.tree_parents))
    for d, t in enumerate(nodes):
        assert set(t.x) == {d}
    # each edge runs from its parent's label to its child's marker: the tree's parents, read back from the drawing
    at = {(pos.x[i], pos.y[i]): i for i in range(len(pos.x))}
    edges = set()
    for t in fig.data:
        if t.mode == "lines":
            points = list(zip(t.x, t.y))
            for start in range(0, len(points), 5):  # 4 corners, then None
                (x0, y0), (x1, y1) = points[start], points[start + 3]
                edges.add((at[(round(x0 - LABEL_W, 6), y0)], at[(round(x1 + MARKER_GAP, 6), y1)]))
    assert edges == {(p, i) for i, p in enumerate(EVENT.tree_parents) if p >= 0}
    steps = fig.layout.sliders[0].steps
    assert len(steps) == pos.depth + 1 and steps[0].args[0]["visible"][:2] == [True, True]
    assert steps[-1].args[0]["visible"] == [True] * len(fig.data)


def test_the_mask_figure_is_the_trees_ancestor_mask():
    fig = figure("One pass checks every branch: tree attention")
    n = len(EVENT.tree_tokens)
    z = [list(row) for row in fig.data[0].z]
    assert len(z) == n and all(len(row) == n for row in z)
    assert [[bool(c) for c in row] for row in z] == ancestor_mask(EVENT.tree_parents)


def test_the_verification_figure_shows_the_accepted_path_and_the_bonus():
    fig = figure("Verification: keep what the model agrees with, plus one")
    points = sum(len(t.x) for t in fig.data if t.mode == "markers+text")
    assert points == len(EVENT.tree_tokens) + 1  # every node, and the bonus token
    assert f"{EVENT.accepted_draft_tokens + 1} tokens from one forward pass" in text(TITLES[4])


def test_the_recycling_figure_holds_every_row_the_step_rewrote():
    fig = figure("Recycling: every guess refreshes the table")
    rows = shown_rows(EVENT, len(EVENT.rows_updated))
    assert len(rows) == len(EVENT.rows_updated)  # all of them, rejected tokens' rows included
    assert [list(r) for r in fig.data[0].customdata] == [r.old for r in rows]
    assert [list(r) for r in fig.data[1].customdata] == [r.new for r in rows]
    rejected = {r.token for r in EVENT.rows_updated} - {EVENT.tree_tokens[i] for i in EVENT.accepted_path}
    assert rejected and f"{len(rejected)} belong to tokens" in text(TITLES[5])


def test_hot_and_cold_are_measured_on_the_two_traces():
    fig = figure("Hot start and cold start")
    hot, cold = fig.data[1], fig.data[2]
    assert list(hot.y)[-1] == LESSON.hot.events[-1].total_tokens and list(hot.x)[-1] == len(LESSON.hot.events)
    assert list(cold.y)[-1] == LESSON.cold.events[-1].total_tokens and list(cold.x)[-1] == len(LESSON.cold.events)
    body = text("Hot start and cold start")
    for meta in (LESSON.hot.meta, LESSON.cold.meta):
        assert f"{meta['tokens'] / meta['steps']:.2f} tokens per forward pass (bonus token included)" in body


def test_the_cost_step_quotes_the_matrix_size_and_the_size_table():
    fig = figure("What it costs")
    table = LESSON.hot.meta["tree_sizes"]
    assert list(fig.data[0].x) == [row["nodes"] for row in table]
    assert list(fig.data[0].y) == [row["expected_accepted"] for row in table]
    assert list(fig.data[2].y) == [row["predicted_speedup"] for row in table]
    assert "1,572,864 bytes" in text("What it costs") and "1.5 MiB" in text("What it costs")
    # the dotted line: the same table with an A100's modelled step times (tr_core.projection), quoted in the text
    a100 = list(fig.data[3].y)
    assert fig.data[3].name.startswith("predicted speedup on an A100 (a model") and len(a100) == len(table)
    assert f"the paper's tree at {a100[-1]:.2f}×" in text("What it costs")
    assert a100[-1] > max(row["predicted_speedup"] for row in table), "on a GPU the big tree pays"
    assert "it says 2.70×, where the paper measured 2.03× (+33%)" in text("What it costs").replace("\n", " ")


def test_every_page_has_a_title_a_filled_text_and_a_figure():
    assert len(PAGES) == 9
    for i, page in enumerate(PAGES):
        body = lesson.page_text(LESSON, i)
        assert page.title and len(body) > 200 and not re.search(r"\{\w+[^}]*\}", body)
        assert lesson.page_figure(LESSON, i).data


def test_navigation_stays_within_the_pages():
    assert clamp(-1) == 0 and clamp(3) == 3 and clamp(99) == len(PAGES) - 1
    assert 'data-page="1"' in indicator_html(0) and "Page 8 of 9" in indicator_html(7)
    assert PAGES[7].title in indicator_html(7)


def test_a_page_button_opens_its_page():
    """Gradio-level: the click handler the tab registered on button 5 shows page 5, whichever page was shown."""
    import gradio as gr

    with gr.Blocks() as demo:
        with gr.Tabs():
            tab = build_tab(LESSON)
    outputs = [tab.index, tab.indicator, tab.text, tab.plot, tab.back, tab.forward, *tab.pages]
    for n in (4, 0, 8):
        [handler] = [f for f in demo.fns.values() if (tab.pages[n]._id, "click") in f.targets]
        assert [c._id for c in handler.inputs] == [tab.narrow._id]
        assert [c._id for c in handler.outputs] == [c._id for c in outputs]
        index, heading, body, plot, back, forward, *buttons = handler.fn(False)
        assert index == n and f'data-page="{n + 1}"' in heading and PAGES[n].title in heading
        assert body == lesson.page_text(LESSON, n) and plot is lesson.page_figure(LESSON, n)
        assert (back.interactive, forward.interactive) == (n > 0, n < len(PAGES) - 1)
        assert [b.variant for b in buttons] == ["primary" if m == n else "secondary" for m in range(len(PAGES))]
    assert page_updates(LESSON, 3)[:3] == (3, indicator_html(3), lesson.page_text(LESSON, 3))


def test_a_narrow_screen_gets_the_compact_figures():
    """The page load tells the hidden checkbox whether the window is narrow; the page buttons then draw the compact
    figure, and a change of the checkbox redraws the page shown."""
    import gradio as gr

    with gr.Blocks() as demo:
        with gr.Tabs():
            tab = build_tab(LESSON)
    [load] = [f for f in demo.fns.values() if (demo._id, "load") in f.targets]
    assert [c._id for c in load.outputs] == [tab.narrow._id] and "innerWidth" in load.js
    [button] = [f for f in demo.fns.values() if (tab.pages[0]._id, "click") in f.targets]
    plot = button.fn(True)[3]
    assert plot is lesson.page_figure(LESSON, 0, compact=True)
    assert plot.layout.title.text != lesson.page_figure(LESSON, 0).layout.title.text
    [redraw] = [f for f in demo.fns.values() if (tab.narrow._id, "change") in f.targets]
    assert redraw.fn(6, True) is lesson.page_figure(LESSON, 6, compact=True)
    assert redraw.fn(6, False) is lesson.page_figure(LESSON, 6)


def _title_lines(fig) -> list[str]:
    return [re.sub(r"<[^>]+>", "", line) for line in str(fig.layout.title.text).split("<br>")]


@pytest.mark.parametrize("i", range(len(PAGES)))
def test_every_compact_figure_reads_at_phone_width(i):
    """A phone's plot is about 330 px wide: the title's lines are short, a legend sits under the plot (the tree and
    the matrix keep their own compact layout: legend between title and plot), panels are stacked."""
    fig = lesson.page_figure(LESSON, i, compact=True)
    assert fig.data and all(0 < len(line) <= 40 for line in _title_lines(fig)), _title_lines(fig)
    assert fig.layout.margin.t >= 16 * len(_title_lines(fig))  # the title's lines fit above the plot
    shown = [t for t in fig.data if t.showlegend is not False and t.name]
    if shown and fig.layout.legend.yref != "container" and fig.layout.legend.y != 1:
        assert fig.layout.legend.y < 0 and fig.layout.legend.orientation == "h"
    axes = [fig.layout[name] for name in fig.layout if re.fullmatch(r"xaxis\d*", name)]
    if PAGES[i].figure in (lesson._hot_run, lesson._hot_and_cold):  # two panels, one above the other
        (x1, x2), (y1, y2) = axes, [fig.layout.yaxis, fig.layout.yaxis2]
        assert x1.domain[1] - x1.domain[0] > 0.9 and x2.domain[1] - x2.domain[0] > 0.9
        assert y2.domain[1] < y1.domain[0]
        wide = lesson.page_figure(LESSON, i)
        assert wide.layout.yaxis.domain == wide.layout.yaxis2.domain  # the wide layout keeps them side by side


def test_the_compact_row_figure_is_the_same_row_as_a_column():
    wide, compact = (lesson.page_figure(LESSON, TITLES.index(PAGES[1].title), c).data[0] for c in (False, True))
    assert [row[0] for row in compact.customdata] == list(wide.customdata[0])
    assert [row[0] for row in compact.z] == list(wide.z[0])


# --- the matrix explorer --------------------------------------------------------------------------------------------

def test_the_explorer_follows_a_tokens_row_through_the_run():
    trace = LESSON.hot
    token = EVENT.tree_tokens[0]
    history = row_history(trace.events, token)
    assert history and history[0][0] <= EVENT.step
    shown = explorer_html(LESSON, token)
    assert f'data-token="{token}"' in shown
    assert shown.count("<tr data-when") == len(history) + 1  # the row as found, then after each rewrite
    last_row = shown.rsplit("<tr data-when", 1)[1]
    for t in history[-1][2]:
        assert f'title="id {t}"' in last_row  # the row at the end of the run
    word = trace.text(token)
    assert resolve_token(trace, str(token)) == token and resolve_token(trace, f"#{token}") == token
    assert resolve_token(trace, word) == token
    assert resolve_token(trace, 10 ** 7) is None and "never rewrote" in explorer_html(LESSON, "no such token")
    picks = explorer_choices(trace)
    assert {t for _, t in picks} == {r.token for e in trace.events for r in e.rows_updated}
    assert explorer_html(LESSON, picks[0][1], "cold").count("cold start")


def test_the_tab_module_never_imports_torch():
    code = ("import sys, ui.explain as x, ui.lesson as s; l = s.load_lesson(); "
            "[(s.page_figure(l, i), s.page_text(l, i)) for i in range(len(s.PAGES))]; "
            "x.explorer_html(l, l.event.tree_tokens[0]); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# --- the tab in a browser, with no model ----------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def no_model_app():
    """The app with a model cache that refuses to load anything: the tab must not need a model."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (scripts/test.sh installs it)")
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    from test_app import free_port

    import app
    from ui.models import ModelCache

    def refuse(*args, **kwargs):
        raise AssertionError("the How it works tab tried to load a model")

    models = ModelCache(load=refuse)
    demo = app.build_app(models)
    _, url, _ = app.launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                           quiet=True)
    yield url, models
    demo.close()


def _title(page) -> str:
    return page.locator("#explain-plot .gtitle").first.text_content() or ""


def _open_tab(page) -> None:
    """Click "How it works"; at phone width the tab may sit in the tab bar's overflow menu."""
    page.get_by_role("tab").first.wait_for(timeout=30_000)
    tab = page.get_by_role("tab", name="How it works")
    if not tab.is_visible():
        page.get_by_label("More tabs").click()
    tab.click()
    page.wait_for_selector("#explain-plot .js-plotly-plot .main-svg", timeout=30_000)


def _wait_for_page(page, n: int, title: str) -> None:
    page.wait_for_selector(f'#explain-indicator [data-page="{n}"]', timeout=15_000)
    page.wait_for_function("t => (document.querySelector('#explain-plot .gtitle')?.textContent || '')"
                           ".startsWith(t)", arg=title, timeout=15_000)


@pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")
@pytest.mark.app
def test_the_tab_walks_through_every_page_without_a_model(no_model_app, tmp_path):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    url, models = no_model_app
    shots = Path(os.environ.get("APP_SHOTS_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    expected = [str(lesson.page_figure(LESSON, i).layout.title.text)[:14].replace("&gt;", ">")
                for i in range(len(PAGES))]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        _open_tab(page)
        assert page.locator("#explain-prev").is_disabled()
        assert not page.locator("#explorer").is_visible()  # the explorer has its own, closed, accordion
        for i in range(len(PAGES)):
            _wait_for_page(page, i + 1, expected[i])
            assert page.locator("#explain-plot .js-plotly-plot").count() == 1
            assert PAGES[i].title in page.locator("#explain-indicator").inner_text()
            page.locator("#explain-tab").scroll_into_view_if_needed()
            time.sleep(0.3)
            page.screenshot(path=shots / f"explain_{i + 1}.png")
            if PAGES[i].title.startswith("Retrieval"):  # the slider grows the tree: layer 1 = root + its children
                page.locator("#explain-plot g.slider-container text", has_text="layer 1").first.click(force=True)
                first_layer = 1 + sum(1 for p in EVENT.tree_parents if p == 0)
                page.wait_for_function("n => document.querySelectorAll('#explain-plot .scatterlayer path.point')"
                                       ".length === n", arg=first_layer, timeout=10_000)
                page.screenshot(path=shots / f"explain_{i + 1}_layer1.png")
            if i < len(PAGES) - 1:
                page.click("#explain-next")
        assert page.locator("#explain-next").is_disabled()
        page.click("#explain-prev")
        _wait_for_page(page, len(PAGES) - 1, expected[-2])
        page.click("#explain-page-5")  # a numbered button opens its page
        _wait_for_page(page, 5, expected[4])
        assert page.locator("#explain-page-5").get_attribute("class").count("primary")

        # the explorer: open it, type a token's id and read its row
        page.locator("#explorer-accordion").get_by_text("Matrix explorer").first.click()
        hot_first = explorer_choices(LESSON.hot)[0][1]  # filled as it opens, not held in every session's page
        page.wait_for_selector(f'#explorer [data-token="{hot_first}"]', timeout=15_000)
        token = EVENT.tree_tokens[0]
        box = page.locator("#explorer-token input")
        box.fill(str(token))
        box.press("Enter")
        page.wait_for_selector(f'#explorer [data-token="{token}"]', timeout=15_000)
        page.locator("#explorer").scroll_into_view_if_needed()
        page.screenshot(path=shots / "explain_explorer.png")
        page.get_by_label("cold start").check()  # the other run: its own most rewritten token
        cold_first = explorer_choices(LESSON.cold)[0][1]
        page.wait_for_selector(f'#explorer [data-token="{cold_first}"]', timeout=15_000)
        assert "cold start run" in page.locator("#explorer").inner_text()

        # phone width: the navigation wraps, its buttons keep a button's height, the heading fits the screen
        phone = browser.new_page(viewport={"width": 390, "height": 844})
        phone.on("pageerror", lambda e: errors.append(str(e)))
        phone.goto(url)
        _open_tab(phone)
        phone.click("#explain-page-3")
        _wait_for_page(phone, 3, expected[2])
        for selector in ("#explain-prev", "#explain-next", "#explain-page-3"):
            box = phone.locator(selector).bounding_box()
            assert box["height"] < 60 and box["x"] >= 0 and box["x"] + box["width"] <= 390, (selector, box)
        heading = phone.locator("#explain-indicator .tr-page-title").bounding_box()
        assert heading["x"] >= 0 and heading["x"] + heading["width"] <= 390 and heading["height"] < 120, heading
        phone.locator("#explain-indicator").scroll_into_view_if_needed()
        time.sleep(0.3)
        phone.screenshot(path=shots / "explain_phone_3.png")
        compact = [str(lesson.page_figure(LESSON, i, True).layout.title.text)[:14].replace("&gt;", ">")
                   for i in range(len(PAGES))]
        for i in range(len(PAGES)):  # every page at phone width: its compact figure within the screen
            phone.click(f"#explain-page-{i + 1}")
            _wait_for_page(phone, i + 1, compact[i])
            figure = phone.locator("#explain-plot .js-plotly-plot").bounding_box()
            assert figure["x"] >= 0 and figure["x"] + figure["width"] <= 390, (i + 1, figure)
            if os.environ.get("APP_SHOTS_DIR"):  # full-page screenshots take seconds each: only when asked for
                phone.locator("#explain-indicator").scroll_into_view_if_needed()
                time.sleep(0.3)
                phone.screenshot(path=shots / f"explain_phone_{i + 1}.png", full_page=True)
        outside = [u for u in requests if urlparse(u).scheme not in ("data", "blob")
                   and urlparse(u).hostname not in {"127.0.0.1", "localhost"}]
        assert not outside, f"requests left 127.0.0.1: {outside}"
        assert not errors, f"console errors: {errors}"
        browser.close()
    assert not models.loaded("")


def test_the_pages_prose_is_data_one_file_a_page_paired_with_its_figure(tmp_path):
    from ui.lesson import FIGURES, PAGES_DIR, load_pages
    files = sorted(PAGES_DIR.glob("*.md"))
    assert [f.read_text().splitlines()[0] for f in files] == [f"# {p.title}" for p in PAGES]
    assert [p.figure for p in PAGES] == list(FIGURES)
    for f in files[:-1]:  # a page missing: refused, not paired with the wrong figure
        (tmp_path / f.name).write_text(f.read_text())
    with pytest.raises(ValueError, match="8 pages"):
        load_pages(tmp_path)
    (tmp_path / files[-1].name).write_text("no title\n\ntext\n")
    with pytest.raises(ValueError, match="title"):
        load_pages(tmp_path)
