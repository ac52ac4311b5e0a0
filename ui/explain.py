"""The "How it works" tab: the lesson's pages with Previous/Next and numbered page buttons, and a matrix explorer
in its own accordion, all replayed from the recorded traces (``ui.lesson``), so the tab works before, and without,
any model; this module never imports torch. Its styles are ``EXPLAIN_CSS`` (the tab also inlines them).

    build_tab()                                  # inside gr.Tabs() of a gr.Blocks
    explorer_html(load_lesson(), "␣rain")        # a token's matrix row through the run
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from visualize import label, visible
from visualize.lesson_fig import is_empty
from visualize.trace import TokenNamer

from .lesson import PAGES, RUN_NAMES, Lesson, Trace, load_lesson, page_figure, page_text
from .page import NARROW_PX


def clamp(index: int) -> int:
    return min(max(int(index), 0), len(PAGES) - 1)


def indicator_html(index: int) -> str:
    """The page's heading: ``Page 3 of 9`` and its title."""
    return (f'<div class="tr-page-head" data-page="{index + 1}"><span class="tr-page-count">Page {index + 1} of '
            f'{len(PAGES)}</span><h3 class="tr-page-title">{escape(PAGES[index].title)}</h3></div>')


# --- the matrix explorer --------------------------------------------------------------------------------------------

def row_history(events: list, token: int) -> list[tuple[int, list[int], list[int]]]:
    """``[(step, old row, new row), ...]``: every decoding step that rewrote ``token``'s row, in order."""
    return [(e.step, list(r.old), list(r.new)) for e in events for r in e.rows_updated if r.token == token]


def explorer_choices(trace: Trace) -> list[tuple[str, int]]:
    """The tokens whose rows the run rewrote, most rewritten first: ``("'␣rain' (id 6261), rewritten 4×", 6261)``."""
    counts: dict[int, int] = {}
    for e in trace.events:
        for r in e.rows_updated:
            counts[r.token] = counts.get(r.token, 0) + 1
    order = sorted(counts, key=lambda t: (-counts[t], t))
    return [(f"'{visible(trace.text(t))}' (id {t}), rewritten {counts[t]}×", t) for t in order]


def resolve_token(trace: Trace, query) -> int | None:
    """A token from a pick (an id) or typed text: an id (``6261``, ``#6261``), a token's text (``' rain'``; ``␣``
    stands for a space), or the same text without its leading space or case. Only tokens the run rewrote count."""
    known = {t for _, t in explorer_choices(trace)}
    if query is None:
        return None
    if isinstance(query, int):
        return query if query in known else None
    q = str(query)
    if q.strip().lstrip("#").isdigit():
        t = int(q.strip().lstrip("#"))
        return t if t in known else None
    for choice_label, t in explorer_choices(trace):
        if q == choice_label:
            return t
    q = q.replace("␣", " ").replace("↵", "\n")
    for match in (lambda s: s == q, lambda s: s.strip().lower() == q.strip().lower()):
        for _, t in explorer_choices(trace):  # most rewritten first
            if match(trace.text(t)):
                return t
    return None


def _row_cells(row: list[int], previous: list[int] | None, text: TokenNamer) -> str:
    if is_empty(row):
        return f'<td colspan="{len(row)}" class="tr-empty">empty (never written)</td>'
    cells = []
    for rank, t in enumerate(row):
        changed = previous is not None and not is_empty(previous) and previous[rank] != t
        cells.append(f'<td class="{"tr-changed" if changed else ""}" title="id {t}">{escape(label(text(t), 14))}'
                     "</td>")
    return "".join(cells)


def explorer_html(lesson: Lesson, query, run: str = "hot") -> str:
    """The row of the picked token in the run (``hot`` or ``cold``): as the run found it, after each decoding step
    that rewrote it (changed cells marked), and so at the end of the run."""
    trace = lesson.hot if run == "hot" else lesson.cold
    token = resolve_token(trace, query)
    if token is None:
        if query in (None, ""):
            return '<p class="tr-empty">Pick a token above, or type one.</p>'
        return (f'<p class="tr-empty">The recorded run never rewrote the row of {escape(repr(str(query)))}: pick one '
                "of the tokens in the list (or type its text or id).</p>")
    history, text = row_history(trace.events, token), trace.text
    k = len(history[0][1])
    head = "".join(f"<th>rank {r}</th>" for r in range(k))
    rows = [f'<tr data-when="start"><th>as the run found it, before decoding step {history[0][0]}</th>'
            f"{_row_cells(history[0][1], None, text)}</tr>"]
    previous = history[0][1]
    for n, (step, _, new) in enumerate(history, 1):
        notes = [" (no change)" * (new == previous), "<br>= the row at the end of the run" * (n == len(history))]
        rows.append(f'<tr data-when="{step}"><th>after decoding step {step}{"".join(notes)}</th>'
                    f"{_row_cells(new, previous, text)}</tr>")
        previous = new
    summary = (f"<p>The row of <b>'{escape(visible(text(token)))}'</b> (id {token}) in the {RUN_NAMES[run]} run: "
               f"rewritten in {len(history)} of its {len(trace.events)} decoding steps. Each line is the row after a "
               "decoding step that rewrote it (yellow: changed by that step); the last is the row at the end of the "
               "run.</p>")
    return (f'<div class="tr-explorer" data-token="{token}">{summary}<table class="tr-table tr-row-table">'
            f"<tr><th></th>{head}</tr>{''.join(rows)}</table></div>")


# --- the tab ---------------------------------------------------------------------------------------------------------

EXPLAIN_INTRO = """\
Token Recycling in {n} pages, each drawn from a **real run recorded with {model}** (prompt: *{prompt}*, tree
`{tree}`, k = {k}), replayed here without loading any model (your own prompt and settings are in the Live and
Race tabs). Use **Previous** and **Next**, or a page's number; hover over a figure for details. \
In token texts, `␣` marks
a space and `↵` a line break."""

EXPLAIN_CSS = """
#explain-nav { flex-wrap: wrap; gap: 6px; align-items: center; }
#explain-nav > button { flex: 0 0 auto !important; width: auto !important; height: auto !important;
                        align-self: center; }
#explain-nav > button.tr-page-btn { min-width: 38px !important; padding-left: 8px; padding-right: 8px; }
@media (max-width: 640px) {  /* a phone: Previous and Next side by side first, the page numbers wrap after them */
  #explain-prev { order: -2; } #explain-next { order: -1; }
}
.tr-page-head { display: flex; align-items: baseline; gap: 12px; flex-wrap: wrap; }
.tr-page-count { font-size: 14px; color: var(--body-text-color-subdued, #555); white-space: nowrap; }
.tr-page-title { font-size: 18px; font-weight: 600; margin: 0; }
#explain-text p, #explain-text li { font-size: 15px; line-height: 1.55; }
#explain-text strong, #explain-intro strong { font-size: inherit; font-weight: 600; }
.tr-explorer { overflow-x: auto; }
.tr-row-table td, .tr-row-table th { font-family: var(--font-mono, monospace); font-size: 13px; white-space: pre; }
.tr-row-table td.tr-changed { background: rgba(240, 228, 66, 0.65); }
"""


@dataclass
class ExplainTab:
    """The tab's components that its events read and write (``build_tab`` returns them, for tests)."""

    index: Any  # gr.State: the page shown
    indicator: Any
    text: Any
    plot: Any
    back: Any
    forward: Any
    pages: list  # one button per page, numbered from 1
    explorer: Any
    narrow: Any  # hidden: whether the browser's window is narrow (a phone), set on page load


def page_updates(lesson: Lesson, index: int, narrow: bool = False) -> tuple:
    """What showing page ``index`` writes, in the order of ``ExplainTab``'s fields up to ``pages``: the index, the
    heading, the text, the figure (its compact layout on a ``narrow`` screen), Previous and Next (enabled unless at
    an end), and each page button (the current one marked)."""
    import gradio as gr

    i = clamp(index)
    return (i, indicator_html(i), page_text(lesson, i), page_figure(lesson, i, narrow is True),
            gr.Button(interactive=i > 0), gr.Button(interactive=i < len(PAGES) - 1),
            *(gr.Button(variant="primary" if n == i else "secondary") for n in range(len(PAGES))))


def build_tab(lesson: Lesson | None = None, narrow=None) -> ExplainTab | None:
    """The "How it works" tab, with its events; call it inside ``gr.Tabs()`` of a ``gr.Blocks``. Needs no model:
    everything is drawn from the recorded traces. ``narrow``: the page's hidden checkbox that says whether the window
    is narrow (a phone; ``app.py`` sets it once for every tab), else the tab makes and sets its own. Returns its
    components (``None`` when the traces are missing)."""
    import gradio as gr

    with gr.Tab("How it works", id="explain", elem_id="explain-tab"):
        try:
            lesson = lesson or load_lesson()
        except (OSError, KeyError, ValueError) as e:
            gr.Markdown(f"The recorded traces could not be read ({e}). Record them with "
                        "`python -m tr_core.tools.record_trace`.")
            return None
        meta = lesson.hot.meta
        gr.HTML(f"<style>{EXPLAIN_CSS}</style>", padding=False)
        gr.Markdown(EXPLAIN_INTRO.format(n=len(PAGES), model=meta["model"], prompt=meta["prompt"],
                                         tree=meta["tree"], k=meta["top_k"]), elem_id="explain-intro")
        index = gr.State(0)
        own_check = narrow is None
        if own_check:
            narrow = gr.Checkbox(False, visible=False, elem_id="explain-narrow")
        with gr.Row(elem_id="explain-nav"):
            back = gr.Button("← Previous", size="sm", scale=0, min_width=110, interactive=False,
                             elem_id="explain-prev")
            pages = [gr.Button(str(n + 1), size="sm", scale=0, min_width=38, variant="primary" if n == 0 else
                               "secondary", elem_id=f"explain-page-{n + 1}", elem_classes=["tr-page-btn"])
                     for n in range(len(PAGES))]
            forward = gr.Button("Next →", variant="primary", size="sm", scale=0, min_width=110,
                                elem_id="explain-next")
        indicator = gr.HTML(indicator_html(0), elem_id="explain-indicator")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=320):
                text = gr.Markdown(page_text(lesson, 0), elem_id="explain-text")
            with gr.Column(scale=3, min_width=320):
                plot = gr.Plot(page_figure(lesson, 0), show_label=False, elem_id="explain-plot")
        # the explorer's token list and first row (about 27 KB) are filled when it is opened, not held in every
        # browser session's copy of the page (gradio keeps one per session)
        with gr.Accordion("Matrix explorer: one token's row of the adjacency matrix through the whole run",
                          open=False, elem_id="explorer-accordion") as explorer:
            gr.Markdown("Pick a token, or type its text or id, to see its row of the adjacency matrix through the "
                        "recorded run: which decoding steps rewrote it, what changed, and how it ended.")
            with gr.Row():
                token = gr.Dropdown([], value=None, allow_custom_value=True, scale=3,
                                    label="Token (the run rewrote these rows; most rewritten first)",
                                    elem_id="explorer-token")
                run = gr.Radio([(RUN_NAMES["hot"], "hot"), (RUN_NAMES["cold"], "cold")], value="hot", scale=1,
                               label="Run", elem_id="explorer-run")
            table = gr.HTML("", elem_id="explorer")

        def switch_run(name: str):
            picks = explorer_choices(lesson.hot if name == "hot" else lesson.cold)
            return gr.Dropdown(choices=picks, value=picks[0][1]), explorer_html(lesson, picks[0][1], name)

        outputs = [index, indicator, text, plot, back, forward, *pages]
        quiet = dict(api_visibility="private", show_progress="hidden")
        back.click(lambda i, small: page_updates(lesson, i - 1, small), [index, narrow], outputs, **quiet)
        forward.click(lambda i, small: page_updates(lesson, i + 1, small), [index, narrow], outputs, **quiet)
        for n, button in enumerate(pages):
            button.click(lambda small, n=n: page_updates(lesson, n, small), narrow, outputs, **quiet)
        # the browser says whether its window is narrow; the page shown (the first, on load) is drawn again for it
        if own_check:
            gr.context.Context.root_block.load(None, None, narrow, js=f"() => window.innerWidth < {NARROW_PX}",
                                               **quiet)
        narrow.change(lambda i, small: page_figure(lesson, i, small is True), [index, narrow], plot, **quiet)
        token.input(lambda q, name: explorer_html(lesson, q, name), [token, run], table, **quiet)
        run.input(switch_run, run, [token, table], **quiet)
        explorer.expand(switch_run, run, [token, table], **quiet)
    return ExplainTab(index, indicator, text, plot, back, forward, pages, table, narrow)
