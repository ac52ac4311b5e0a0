"""The lesson of the "How it works" tab: Token Recycling in eight pages, each drawn from a real recorded run, and a
ninth on this project's methods beyond the paper, quoting a shipped benchmark summary. Pages 2-6 follow one decoding
step of the recorded run, chosen by rule (``featured_step``).

The pages are data (``PAGES``: a title, a Markdown text with ``{fields}`` filled from the trace by ``facts``, and a
function drawing the page's figure from the trace). Everything comes from ``assets/traces/`` (``python -m
tr_core.tools.record_trace``), the shipped acceptance statistics and benchmark summary (``python -m
tr_core.tools.bench_summary``): no model, and no torch.

    lesson = load_lesson()
    page_text(lesson, 2), page_figure(lesson, 2)      # page 3 of 9: retrieval
    page_figure(lesson, 2, compact=True)              # laid out for a phone
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from html import escape
from pathlib import Path
from typing import Callable

import plotly.graph_objects as go

from tr_core.assets import BEYOND_PAPER, TRACES_DIR, acceptance_path
from tr_core.events import TOKENS_PER_PASS
from tr_core.methods import METHODS
from tr_core.projection import DEVICES, Shape, paper_check, step_ms
from tr_core.stats import SPEEDUP_DEFINITION
from visualize import load_trace, mask_figure, matrix_figure, methods_figure, text_lookup, tree_figure, visible
from visualize.lesson_fig import (
    TITLE_CHARS,
    children_ranks,
    passes_figure,
    retitle,
    retrieval_figure,
    row_figure,
    tree_size_table_figure,
)
from visualize.palette import wrap
from visualize.trace import TokenNamer
from visualize.tree_layout import node_roles

RUN_NAMES = {"hot": "hot start", "cold": "cold start"}


@dataclass
class Trace:
    """One recorded run: its step events, what ``<name>.meta.json`` says about it, and an ``id -> text`` lookup."""

    events: list
    meta: dict
    text: TokenNamer


@dataclass
class Lesson:
    hot: Trace
    cold: Trace
    acceptance: dict  # assets/acceptance/<model>.json
    featured: int  # the index in ``hot.events`` of the decoding step that pages 2-6 look at (``featured_step``)
    figures: dict = field(default_factory=dict, repr=False)  # (page index, compact) -> its figure, drawn once
    benchmark: dict = field(default_factory=lambda: {"runs": []})  # assets/benchmarks/beyond_paper.json

    @property
    def event(self):
        return self.hot.events[self.featured]


def load_run(name: str, folder: Path = TRACES_DIR) -> Trace:
    events = load_trace(folder / f"{name}.json")
    meta = json.loads((folder / f"{name}.meta.json").read_text(encoding="utf-8"))
    known = {int(k): v for k, v in meta.get("token_text", {}).items()}
    own = text_lookup(events)
    return Trace(events, meta, text_lookup(events, lambda t: known[t] if t in known else own(t)))


def special_ids(trace: Trace) -> set[int]:
    """The ids of the special (chat-template) tokens the trace names, ``<|im_end|>`` and the like, as the recorder's
    tokenizer listed them."""
    return set(trace.meta["special_ids"])


def rejected_drafts(event) -> int:
    """The draft nodes (the root is no draft) that are not on the accepted path."""
    return len(event.tree_tokens) - len(event.accepted_path)


def stopped_at_a_guess(event) -> bool:
    """Whether the accepted path stopped at a node with children (the model rejected them all), rather than at the
    end of a branch of the tree."""
    return event.accepted_path[-1] in event.tree_parents


def fits_walkthrough(events: list, i: int, special: set[int]) -> bool:
    """What pages 2-6 need of the decoding step they look at: in the middle of the answer (not in the first or last
    fifth of the run's steps), two or three accepted drafts and some rejected ones, every token it kept (the answer
    did not end inside it), and no special token among its drafts, its bonus and what it added."""
    e, n = events[i], len(events)
    return (n / 5 <= i < n - n / 5 and 2 <= e.accepted_draft_tokens <= 3 and rejected_drafts(e) > 0
            and len(e.new_tokens) == e.accepted_draft_tokens + 1
            and not special.intersection([*e.tree_tokens, e.bonus_token, *e.new_tokens]))


def featured_step(events: list, special: set[int]) -> int:
    """The index of the decoding step pages 2-6 look at, by rule: of the steps that ``fits_walkthrough``, one where
    the path stopped at rejected guesses (so that every part of a step shows), nearest the middle of the run. With
    none (a trace recorded otherwise), the ordinary-token step with the most accepted drafts, nearest the middle.

    >>> from types import SimpleNamespace as E
    >>> def step(accepted, parents=(-1, 0, 1, 2, 0)):
    ...     return E(tree_tokens=[5] * len(parents), tree_parents=list(parents), bonus_token=5,
    ...              accepted_path=list(range(accepted + 1)), accepted_draft_tokens=accepted,
    ...              new_tokens=[5] * (accepted + 1))
    >>> run = [step(0), step(2)] + [step(0)] * 2 + [step(2, (-1, 0, 1, 0)), step(3, (-1, 0, 1, 2)), step(2)]
    >>> featured_step(run + [step(0)] * 3, set())  # 1: too early; 4: ends on a leaf; 5: rejects nothing
    6
    """
    middle = (len(events) - 1) / 2
    fits = [i for i in range(len(events)) if fits_walkthrough(events, i, special)]
    if fits:
        return min(fits, key=lambda i: (not stopped_at_a_guess(events[i]), abs(i - middle)))
    ordinary = [i for i, e in enumerate(events) if not special.intersection([*e.tree_tokens, e.bonus_token])]
    return max(ordinary or range(len(events)), key=lambda i: (events[i].accepted_draft_tokens, -abs(i - middle)))


@lru_cache(maxsize=4)
def load_lesson(folder: Path = TRACES_DIR) -> Lesson:
    hot, cold = load_run("hot", folder), load_run("cold", folder)
    acceptance = json.loads(acceptance_path(hot.meta["model"]).read_text())
    benchmark = json.loads(BEYOND_PAPER.read_text()) if BEYOND_PAPER.is_file() else {"runs": []}
    return Lesson(hot, cold, acceptance, featured_step(hot.events, special_ids(hot)), benchmark=benchmark)


# --- the numbers the texts quote -----------------------------------------------------------------------------------

def _q(text: str) -> str:
    """A token as inline code for Markdown prose, whitespace made visible: ``' rain'`` -> ``"`␣rain`"``."""
    return "`" + visible(text).replace("`", "'") + "`"


def counted(n: int, one: str, many: str | None = None) -> str:
    """``counted(1, "token")`` -> ``'1 token'``, ``counted(3, "guess", "guesses")`` -> ``'3 guesses'``."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def facts(lesson: Lesson) -> dict:
    """Every ``{field}`` the page texts use, computed from the traces and the shipped statistics. The counts about
    the featured decoding step come from that one event, as its figures do."""
    e, hot, cold = lesson.event, lesson.hot, lesson.cold
    text = hot.text
    meta, t_ms = hot.meta, {int(n): ms for n, ms in hot.meta["calibration"]["t_ms"].items()}
    sizes = {row["nodes"]: row for row in meta["tree_sizes"]}
    best = max(meta["tree_sizes"], key=lambda row: row["predicted_speedup"])
    path_accept = {tuple(p): a for p, a in zip(lesson.acceptance["node_paths"], lesson.acceptance["acceptance"])}
    on_path = {e.tree_tokens[i] for i in e.accepted_path}
    first, second = [i for i, p in enumerate(e.tree_parents) if p == 0][:2]  # two guesses for the next token
    roles = node_roles(e)
    so_far = "".join(x.new_text for x in hot.events[:lesson.featured])
    n_cold = 10
    return dict(
        prompt=meta["prompt"], model=meta["model"], tree=meta["tree"], k=meta["top_k"],
        vocab=meta["vocab_size"], tokens=meta["tokens"], steps=meta["steps"], mat=meta["mean_accepted_tokens"],
        step=e.step, so_far=escape(_tail(so_far, 80)),
        root=_q(text(e.tree_tokens[0])), first_guesses=counted(len(children_ranks(e, 0)), "candidate"),
        nodes=len(e.tree_tokens), depth=_depth(e), guesses=counted(len(e.tree_tokens) - 1, "guess", "guesses"),
        small_speedup=sizes[meta["tree_nodes"]]["predicted_speedup"],
        sib1=_q(e.tree_text[first]), sib2=_q(e.tree_text[second]),
        pair=_q(e.tree_text[first] + e.tree_text[second]),
        acc0=path_accept.get((0,), 0.0), acc1=path_accept.get((1,), 0.0), acc2=path_accept.get((2,), 0.0),
        accepted=" ".join(_q(e.tree_text[i]) for i in e.accepted_path[1:]) or "none of the guesses",
        n_accepted=counted(e.accepted_draft_tokens, "guess", "guesses"), bonus=_q(text(e.bonus_token)),
        produced=counted(e.accepted_draft_tokens + 1, "token"), added=_q(e.new_text),
        stopped=_stopped(e, roles, text),
        rows=counted(len(e.rows_updated), "row"), changed=sum(bool(set(r.new) - set(r.old)) for r in e.rows_updated),
        rejected_rows=sum(r.token not in on_path for r in e.rows_updated),
        hot_steps=meta["steps"], hot_tokens=meta["tokens"], hot_mat=meta["mean_accepted_tokens"],
        cold_steps=cold.meta["steps"], cold_tokens=cold.meta["tokens"], cold_mat=cold.meta["mean_accepted_tokens"],
        same_text="Both runs wrote exactly the same text" if hot.meta["text"] == cold.meta["text"] else
                  ("The two texts differ (the kernels of the machine that recorded them were not "
                   "batch-invariant; see the README)"),
        one_share=sum(len(x.accepted_path) == 1 for x in hot.events) / len(hot.events),
        n_cold=n_cold, cold_first=_mat(cold.events[:n_cold]), cold_last=_mat(cold.events[-n_cold:]),
        matrix_bytes=meta["matrix_bytes"], matrix_mib=meta["matrix_bytes"] / 2**20,
        machine=meta["calibration"]["machine"], t1=t_ms[1], step_ms=sizes[meta["tree_nodes"]]["step_ms"],
        tree_nodes=meta["tree_nodes"], cost=sizes[meta["tree_nodes"]]["step_ms"] / t_ms[1],
        t81=sizes[max(sizes)]["step_ms"], cost81=sizes[max(sizes)]["step_ms"] / t_ms[1], paper_nodes=max(sizes),
        paper_speedup=sizes[max(sizes)]["predicted_speedup"], best_n=best["nodes"],
        best_speedup=best["predicted_speedup"], best_tokens=best["expected_accepted"],
        **gpu_facts(meta), **beyond_facts(lesson.benchmark),
    )


def gpu_facts(meta: dict) -> dict:
    """The cost page's fields on other hardware: the A100's modelled speedup for the paper's tree and the recorded
    tree (``on_a100``), and the model's own check against the paper's measured figure."""
    gpu, check = on_a100(meta) or [], paper_check()
    by_nodes = dict(zip((row["nodes"] for row in meta["tree_sizes"]), gpu))
    return dict(a100_paper=by_nodes.get(max(by_nodes, default=0), 0.0), a100_tree=by_nodes.get(meta["tree_nodes"], 0.0),
                paper_modelled=check["modelled"], paper_measured=check["measured"], paper_error=check["error"])


def _tail(text: str, n: int) -> str:
    """The last words of ``text``, about ``n`` characters, from a word's start: ``'…the end'``."""
    text = text.strip()
    return text if len(text) <= n else "…" + text[-n:].split(" ", 1)[-1]


def _stopped(event, roles: list[str], text: TokenNamer) -> str:
    """Why the accepted path of ``event`` ended, and its rejected guesses counted by the roles the tree figure
    draws them with (``node_roles``)."""
    broke, grey = roles.count("broke"), roles.count("rejected")
    last = _q(event.tree_text[event.accepted_path[-1]])
    others = (f" The other {counted(grey, 'rejected guess', 'rejected guesses')} (grey circles) lay on branches the "
              "path never took." if grey else "")
    if stopped_at_a_guess(event):
        crosses = "a red cross" if broke == 1 else "red crosses"
        return (f"The path stopped after {last}: the tree held {counted(broke, 'guess', 'guesses')} for the next "
                f"token there ({crosses}), and the model wanted {_q(text(event.bonus_token))} instead." + others)
    return (f"The path ran to the end of its branch: the tree held no guess after {last}, so the model's own next "
            "token became the bonus." + others)


BEYOND = tuple(n for n, m in METHODS.items() if m.beyond_paper)


def shown_methods(run: dict) -> list[str]:
    """The methods a run compares, plain and fixed sizes (``tr-N``) left out."""
    return [n for n in run["methods"] if n != "plain" and not n[3:].isdigit()]


def _beyond_figure(lesson: Lesson, compact: bool) -> go.Figure:
    runs = [r for r in lesson.benchmark["runs"] if r.get("methods")]
    if not runs:
        return go.Figure().update_layout(title="no benchmark summary shipped")
    fig = methods_figure(runs)
    return retitle(fig, wrap(fig.layout.title.text, TITLE_CHARS)) if compact else fig


def _interval(m: dict) -> str:
    ci = m.get("speedup_ci95")
    return f"{m['speedup_median']:.2f}×" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def beyond_facts(benchmark: dict) -> dict:
    """The ninth page's fields, from the shipped benchmark summary: the setting, a table of every method in every
    run, and, per run, how the best method beyond the paper compared with Token Recycling and Prompt Lookup."""
    runs = benchmark.get("runs", [])
    if not runs:
        return dict(beyond_setting="No benchmark summary is shipped with this build", beyond_table="",
                    beyond_verdict="", rivals_order="")
    first = runs[0]
    setting = (f"Measured on {first.get('cpu', 'this project’s machine')} ({first.get('threads', '?')} threads), "
               f"Spec-Bench, {first.get('questions', '?')} questions, {first.get('max_new_tokens', '?')} new tokens "
               f"each, every method on the same questions, alternated, in one run per mode; speedup: "
               f"{SPEEDUP_DEFINITION} (the median over questions)")
    modes = [r.get("mode", "?") for r in runs]
    rows = ["| method | " + " | ".join(f"{m} mode: speedup [95%], {KEY}, draft nodes per decoding step"
                                     for m in modes) + " |", "|---" * (1 + len(runs)) + "|"]
    for name in shown_methods(runs[0]):
        cells = []
        for run in runs:
            m = run["methods"].get(name)
            cells.append(f"{_interval(m)}, {m['mean_accepted_tokens']:.2f}, {m.get('mean_draft_nodes', 0):.1f}"
                         if m else "")
        label_ = METHODS[name].label if name in METHODS else name
        rows.append(f"| {label_} (`{name}`) | " + " | ".join(cells) + " |")
    verdicts = []
    for run in runs:
        beyond = [n for n in BEYOND if n in run["methods"]]
        if not beyond:
            continue
        best = max(beyond, key=lambda n: run["methods"][n]["speedup_median"])
        pairs = {p["against"]: p for p in run.get("pairwise", []) if p["method"] == best}
        against = "; ".join(f"against {METHODS[a].label}: {_interval(p)}, {p['verdict']}"
                            for a, p in pairs.items() if a in METHODS)
        verdicts.append(f"In {run.get('mode', '?')} mode the best of them was **{METHODS[best].label}** "
                        f"(`{best}`), {_interval(run['methods'][best])} over plain decoding ({against}).")
    return dict(beyond_setting=setting, beyond_table="\n".join(rows), beyond_verdict=" ".join(verdicts),
                rivals_order=rivals_order(runs))


def rivals_order(runs: list[dict]) -> str:
    """The paper's training-free methods in each run, fastest first, beside the paper's A100 order; "" where a run
    has fewer than two of them.

    >>> runs = [{"mode": "exact", "methods": {"tr": {"speedup_median": 1.1}, "lookahead": {"speedup_median": 1.2}}}]
    >>> print(rivals_order(runs))
    Here, exact mode: Lookahead decoding 1.20×, Token Recycling 1.10×. The paper, on an A100: Token Recycling 2.22×, \
Lookahead decoding 1.34×.
    """
    paper = sorted((m for m in METHODS.values() if m.paper_a100), key=lambda m: -m.paper_a100[0])
    parts = []
    for run in runs:
        here = sorted((m for m in paper if m.name in run["methods"]),
                      key=lambda m: -run["methods"][m.name]["speedup_median"])
        if len(here) < 2:
            continue
        parts.append(f"Here, {run.get('mode', '?')} mode: " + ", ".join(
            f"{m.label} {run['methods'][m.name]['speedup_median']:.2f}×" for m in here) + ".")
    if not parts:
        return ""
    named = {n for run in runs for n in run["methods"]}
    return " ".join(parts) + " The paper, on an A100: " + ", ".join(
        f"{m.label} {m.paper_a100[0]:.2f}×" for m in paper if m.name in named) + "."


def _depth(event) -> int:
    depth = [0] * len(event.tree_parents)
    for i, p in enumerate(event.tree_parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    return max(depth)


def _mat(events: list) -> float:
    """Tokens per forward pass (the bonus token included) over some decoding steps."""
    return sum(len(e.new_tokens) for e in events) / max(1, len(events))


# --- the pages ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    title: str
    text: str  # Markdown with {fields} from ``facts``
    figure: Callable[[Lesson, bool], go.Figure]  # (lesson, compact) -> the page's figure


def _titled(fig: go.Figure, title: str, compact: bool) -> go.Figure:
    if compact:
        return retitle(fig, wrap(title, TITLE_CHARS))
    return fig.update_layout(title=dict(text=title, font=dict(size=14)), margin=dict(t=90))


def _hot_run(lesson: Lesson, compact: bool) -> go.Figure:
    fig = passes_figure({"hot": lesson.hot.events}, {"hot": "Token Recycling"}, compact)
    return _titled(fig, f"the recorded run: “{escape(lesson.hot.meta['prompt'])}”", compact)


def _hot_and_cold(lesson: Lesson, compact: bool) -> go.Figure:
    fig = passes_figure({"hot": lesson.hot.events, "cold": lesson.cold.events}, RUN_NAMES, compact)
    return _titled(fig, "the same prompt, hot start against cold start", compact)


def _mask(lesson: Lesson, compact: bool) -> go.Figure:
    fig = mask_figure(lesson.event)
    n = len(lesson.event.tree_tokens)
    subtitle = ("<span style='font-size:12px;color:#555'>row: the node that looks;<br>"
                "column: a node it may look at</span>")
    # wrapped for a phone's 390 px; the margin holds the title's lines above the column labels
    title = wrap(f"decoding step {lesson.event.step}: tree attention over the {n} nodes of the draft tree", 40)
    if compact:
        return retitle(fig, f"{title}<br>{subtitle}")
    return fig.update_layout(title_text=f"{title}<br>{subtitle}", title_y=0.99, title_yanchor="top",
                             margin_t=fig.layout.margin.t + 40)


def _rewrapped(title: str, first: str = "") -> str:
    """A compact title of the shared figures (wrapped for a wider phone) wrapped again to ``TITLE_CHARS``: the
    heading and its grey note (a ``<span>``) each on their own lines; ``first`` replaces the heading."""
    head, _, note = title.partition("<span")
    head = wrap(first or head.replace("<br>", " "), TITLE_CHARS)
    if not note:
        return head
    style, _, note = note.partition(">")
    note = wrap(note.removesuffix("</span>").replace("<br>", " "), TITLE_CHARS + 2)
    return f"{head}<br><span{style}>{note}</span>"


def _verification(lesson: Lesson, compact: bool) -> go.Figure:
    fig = tree_figure(lesson.event, lesson.hot.text, compact=compact)
    if not compact:
        return fig
    # the title says what the step did, then what it added: two paragraphs, each wrapped again
    head, _, tail = fig.layout.title.text.replace("<br>", " ").partition(" added the text ")
    tail = f"added the text {tail}" if tail else ""
    return retitle(fig, wrap(head, TITLE_CHARS) + (f"<br>{wrap(tail, TITLE_CHARS)}" if tail else ""))


def _recycling(lesson: Lesson, compact: bool) -> go.Figure:
    """Every row the decoding step rewrote (the hover has each whole token; a phone shows the first few)."""
    e = lesson.event
    fig = matrix_figure(e, lesson.hot.text, max_rows=len(e.rows_updated), compact=compact)
    if compact:
        return retitle(fig, _rewrapped(fig.layout.title.text))
    return fig.update_layout(title_text=f"decoding step {e.step}: the {len(e.rows_updated)} adjacency-matrix rows it "
                                        "rewrote (accepted tokens first, bold)")


def on_a100(meta: dict) -> list[float] | None:
    """Per tree size of the recording's table, the predicted speedup with an A100's modelled step time
    (``tr_core.projection``) instead of the recording machine's measured one; ``None`` for a trace without the
    model's shape."""
    if "shape" not in meta:
        return None
    shape, a100 = Shape(**meta["shape"]), DEVICES["A100"]
    return [row["expected_accepted"] * step_ms(a100, shape, 1) / step_ms(a100, shape, row["nodes"])
            for row in meta["tree_sizes"]]


def _tree_sizes(lesson: Lesson, compact: bool) -> go.Figure:
    meta = lesson.hot.meta
    sizes = [row["nodes"] for row in meta["tree_sizes"]]
    marks = {f"'{meta['tree']}' ({meta['tree_nodes']})": meta["tree_nodes"], f"paper ({max(sizes)})": max(sizes)}
    gpu = on_a100(meta)
    return tree_size_table_figure(meta["tree_sizes"], marks, compact, None if gpu is None else ("A100", gpu))


KEY = TOKENS_PER_PASS  # the one name of the key number (tr_core.events)

def _row(lesson: Lesson, compact: bool) -> go.Figure:
    return row_figure(lesson.event, lesson.hot.text, compact)


def _retrieval(lesson: Lesson, compact: bool) -> go.Figure:
    return retrieval_figure(lesson.event, compact)


# The pages' prose lives in ``ui/lesson_pages/`` (one Markdown file a page, in order: its first line the title, then
# the text with {fields} from ``facts``); each page's figure is drawn by the function in the same place here.
PAGES_DIR = Path(__file__).resolve().parent / "lesson_pages"
FIGURES = (_hot_run, _row, _retrieval, _mask, _verification, _recycling, _hot_and_cold, _tree_sizes, _beyond_figure)


def load_pages(folder: Path = PAGES_DIR) -> list[Page]:
    """The pages from their files, paired in order with ``FIGURES``."""
    files = sorted(folder.glob("*.md"))
    if len(files) != len(FIGURES):
        raise ValueError(f"{folder} holds {len(files)} pages; the walkthrough draws {len(FIGURES)} figures")
    pages = []
    for path, figure in zip(files, FIGURES):
        head, _, text = path.read_text().partition("\n\n")
        if not head.startswith("# "):
            raise ValueError(f"{path}: the first line must be the page's title ('# ...')")
        pages.append(Page(head[2:], text.removesuffix("\n"), figure))
    return pages


PAGES: list[Page] = load_pages()


def page_text(lesson: Lesson, index: int) -> str:
    return PAGES[index].text.format(**facts(lesson))


def page_figure(lesson: Lesson, index: int, compact: bool = False) -> go.Figure:
    """The figure of page ``index``, drawn once per lesson and layout (``compact``: for a phone)."""
    key = (index, compact)
    if key not in lesson.figures:
        lesson.figures[key] = PAGES[index].figure(lesson, compact)
    return lesson.figures[key]
