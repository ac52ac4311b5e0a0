"""The "How it works" tab: each step's figure holds what the shipped trace holds, the texts quote the traces' own
numbers, the matrix explorer follows a token's row, nothing imports torch, and in headless Chromium the tab works
with no model loaded (every step shows its figure; screenshots go to $APP_SHOTS_DIR)."""

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
from ui.explain import clamp, explorer_choices, explorer_html, indicator_html, resolve_token, row_history
from ui.lesson import STEPS
from visualize import ancestor_mask, label, shown_rows
from visualize.lesson_fig import row_before
from visualize.tree_fig import LABEL_W, MARKER_GAP
from visualize.tree_layout import tree_layout

LESSON = lesson.load_lesson()
EVENT = LESSON.event
TITLES = [s.title for s in STEPS]


def figure(title: str):
    return lesson.step_figure(LESSON, TITLES.index(title))


def text(title: str) -> str:
    return lesson.step_text(LESSON, TITLES.index(title))


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


# --- each step's figure holds the trace -----------------------------------------------------------------------------

def test_the_run_figure_counts_tokens_against_passes():
    fig = figure("Why decoding is slow, and how guessing helps")
    line = fig.data[1]
    assert list(line.x) == [0] + [e.total_steps for e in LESSON.hot.events]
    assert list(line.y) == [0] + [e.total_tokens for e in LESSON.hot.events]
    assert f"{LESSON.hot.meta['tokens']} tokens in {LESSON.hot.meta['steps']} passes" in text(TITLES[0])


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
    assert EVENT.accepted_draft_tokens >= 2
    body = text(TITLES[4])
    assert f"{len(EVENT.new_tokens)} tokens from one pass" in body


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
        assert f"{meta['tokens'] / meta['steps']:.2f} tokens per pass" in body


def test_the_cost_step_quotes_the_matrix_size_and_the_size_table():
    fig = figure("What it costs")
    table = LESSON.hot.meta["tree_sizes"]
    assert list(fig.data[0].x) == [row["nodes"] for row in table]
    assert list(fig.data[0].y) == [row["expected_accepted"] for row in table]
    assert list(fig.data[2].y) == [row["predicted_speedup"] for row in table]
    assert "1,572,864 bytes" in text("What it costs") and "1.5 MiB" in text("What it costs")


def test_every_step_has_a_title_a_filled_text_and_a_figure():
    assert len(STEPS) == 9
    for i, step in enumerate(STEPS):
        body = lesson.step_text(LESSON, i)
        assert step.title and len(body) > 200 and not re.search(r"\{\w+[^}]*\}", body)
        assert lesson.step_figure(LESSON, i).data


def test_navigation_stays_within_the_steps():
    assert clamp(-1) == 0 and clamp(3) == 3 and clamp(99) == len(STEPS) - 1
    assert 'data-step="1"' in indicator_html(0) and "Step 8 of 9" in indicator_html(7)
    assert indicator_html(2).count("tr-pill-on") == 1


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
            "[(s.step_figure(l, i), s.step_text(l, i)) for i in range(len(s.STEPS))]; "
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
    import app
    from test_app import free_port
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


@pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)")
def test_the_tab_walks_through_every_step_without_a_model(no_model_app, tmp_path):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    url, models = no_model_app
    shots = Path(os.environ.get("APP_SHOTS_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    expected = [str(lesson.step_figure(LESSON, i).layout.title.text)[:14] for i in range(len(STEPS))]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.get_by_role("tab", name="How it works").click()
        page.wait_for_selector("#explain-plot .js-plotly-plot .main-svg", timeout=30_000)
        assert page.locator("#explain-prev").is_disabled()
        for i in range(len(STEPS)):
            page.wait_for_selector(f'#explain-indicator [data-step="{i + 1}"]', timeout=15_000)
            page.wait_for_function("t => (document.querySelector('#explain-plot .gtitle')?.textContent || '')"
                                   ".startsWith(t)", arg=expected[i].replace("&gt;", ">"), timeout=15_000)
            assert page.locator("#explain-plot .js-plotly-plot").count() == 1
            assert STEPS[i].title in page.locator("#explain-indicator").inner_text()
            page.locator("#explain-tab").scroll_into_view_if_needed()
            time.sleep(0.3)
            page.screenshot(path=shots / f"explain_{i + 1}.png")
            if STEPS[i].title.startswith("Retrieval"):  # the slider grows the tree: layer 1 = root + its children
                page.locator("#explain-plot g.slider-container text", has_text="layer 1").first.click(force=True)
                first_layer = 1 + sum(1 for p in EVENT.tree_parents if p == 0)
                page.wait_for_function("n => document.querySelectorAll('#explain-plot .scatterlayer path.point')"
                                       ".length === n", arg=first_layer, timeout=10_000)
                page.screenshot(path=shots / f"explain_{i + 1}_layer1.png")
            if i < len(STEPS) - 1:
                page.click("#explain-next")
        assert page.locator("#explain-next").is_disabled()
        page.click("#explain-prev")
        page.wait_for_selector(f'#explain-indicator [data-step="{len(STEPS) - 1}"]', timeout=15_000)

        # the explorer: type a token's id and read its row
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
        outside = [u for u in requests if urlparse(u).scheme not in ("data", "blob")
                   and urlparse(u).hostname not in {"127.0.0.1", "localhost"}]
        assert not outside, f"requests left 127.0.0.1: {outside}"
        assert not errors, f"console errors: {errors}"
        browser.close()
    assert not models.loaded("")
