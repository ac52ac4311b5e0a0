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
        **beyond_facts(lesson.benchmark),
    )


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
BENCH_ONLY = {"tr-paper": "Token Recycling, the paper's 81-node tree", "tr-cold": "Token Recycling, cold start"}


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
                    beyond_verdict="")
    first = runs[0]
    setting = (f"Measured on {first.get('cpu', 'this project’s machine')} ({first.get('threads', '?')} threads), "
               f"Spec-Bench, {first.get('questions', '?')} questions, {first.get('max_new_tokens', '?')} new tokens "
               f"each, every method on the same questions, alternated, in one run per mode")
    modes = [r.get("mode", "?") for r in runs]
    rows = ["| method | " + " | ".join(f"{m} mode: speedup [95%], {KEY}, draft nodes per decoding step"
                                     for m in modes) + " |", "|---" * (1 + len(runs)) + "|"]
    for name in shown_methods(runs[0]):
        cells = []
        for run in runs:
            m = run["methods"].get(name)
            cells.append(f"{_interval(m)}, {m['mean_accepted_tokens']:.2f}, {m.get('mean_draft_nodes', 0):.1f}"
                         if m else "")
        label_ = METHODS[name].label if name in METHODS else BENCH_ONLY.get(name, name)
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
    return dict(beyond_setting=setting, beyond_table="\n".join(rows), beyond_verdict=" ".join(verdicts))


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


def _tree_sizes(lesson: Lesson, compact: bool) -> go.Figure:
    meta = lesson.hot.meta
    sizes = [row["nodes"] for row in meta["tree_sizes"]]
    marks = {f"'{meta['tree']}' ({meta['tree_nodes']})": meta["tree_nodes"], f"paper ({max(sizes)})": max(sizes)}
    return tree_size_table_figure(meta["tree_sizes"], marks, compact)


KEY = TOKENS_PER_PASS  # the one name of the key number (tr_core.events)

PAGES: list[Page] = [
    Page("Why decoding is slow, and how guessing helps", """\
A language model writes one **token** (a word or a piece of one) at a time. For each token it runs a **forward
pass**: every weight of the model is read once, and out comes a score for every token of its vocabulary. The best
one is written down, and the next pass starts. On the machine that recorded this run, one forward pass of {model}
took about **{t1:.0f} ms**, and most of that time goes into reading the weights.

A pass can also check *guesses*. Feed it a few guessed tokens after the text, and it handles them all at once,
reading the weights only once: at every position it says which token it would itself have written there. That is
**speculative decoding**: guess several tokens cheaply, check them all in one pass, keep the guesses up to the
first one the model disagrees with, plus the model's own next token (the **bonus token**). The text comes out
exactly as plain decoding would write it; only the number of passes drops.

**Token Recycling** takes its guesses from a table of what the model predicted in earlier passes, at almost no
cost. In the run recorded here (prompt: *{prompt}*), it wrote **{tokens} tokens in {steps} forward passes**, where
plain decoding needs {tokens}: **{mat:.2f} tokens per forward pass (bonus token included)**, against 1 for plain
decoding. Each pass is one **decoding step**. On the right, how many tokens each pass gave: {one_share:.0%} of the
passes still gave only one, the others two or more. (Whether fewer passes also take less time depends on what the
bigger passes cost: see page 8.)""", _hot_run),
    Page("The adjacency matrix: what the model predicted before", """\
Each pass scores all {vocab:,} tokens of the vocabulary, and plain decoding keeps only the best one. Token
Recycling keeps the **top {k}**: for every token *t* of the vocabulary it remembers the {k} tokens the model
most recently rated likeliest to come right after *t*. This table, one row per token and {k} columns ranked best
first, is the **adjacency matrix**.

To guess how the text goes on, look up the row of the **last token written**. Pages 2 to 6 follow one decoding
step of the recorded run, **decoding step {step}** (the steps are numbered from 0, one forward pass each), in the
middle of the answer. So far the model has written *{so_far}*

The last token is {root}, and its row, in the figure, lists what the model expected after {root} when it last saw
it. Its first {first_guesses} (green) become the first guesses.

A row never filled is empty (all zeros): guesses drawn from it are useless, and only cost the work of checking
them.""", lambda lesson, compact: row_figure(lesson.event, lesson.hot.text, compact)),
    Page("Retrieval: a tree of guesses, grown layer by layer", """\
A single chain of guesses is fragile: once a guess is wrong, everything after it is wasted. So Token Recycling
guesses a **draft tree**: several alternatives for the next token, and for each of them, alternatives for the
token after.

The tree grows **breadth first**. Layer 1 comes from the last token's row. For layer 2, each layer-1 token's own
row is looked up, and its top candidates become its children; and so on. Which ranks each node takes is fixed in
advance by a **template** (here `{tree}`: {nodes} nodes, the root and {guesses}, in {depth} layers), the same in
every decoding step. The template is lopsided on purpose: the rank-0 guess is the one most often right, so it gets
the most children and the deepest branch, and lower-ranked guesses get fewer. In the shipped statistics for the
paper's tree, the rank-0 guess for the next token was accepted in {acc0:.0%} of decoding steps, the rank-1 guess in
{acc1:.0%}, rank 2 in {acc2:.0%}.

Growing the tree takes one table look-up per layer and no model at all. Drag the slider below the figure to build
it layer by layer; hover over a node to see whose row it came from.""",
         lambda lesson, compact: retrieval_figure(lesson.event, compact)),
    Page("One pass checks every branch: tree attention", """\
The whole tree goes through the model in **one forward pass**, laid out as one sequence: node by node, layer by
layer ({nodes} tokens here), after the text written so far.

In an ordinary sequence every token sees all the tokens before it. But sibling guesses are alternatives, not a
sentence: {sib1} and {sib2} are two guesses for the same place, and {pair}, read as one text, is neither
branch. So the pass gets an **attention mask**: a node may look at the text so far, at itself and at its ancestors
in the tree, and at nothing else; and its position (which the model reads along with the token) is the text's
length plus its depth. Each branch then reads exactly as if it were the only continuation, and the model's output
at every node is what it would be on that branch alone.

In the figure, row *i* shows what node *i* may look at (the text so far is seen by all and not drawn). Dark blue
cells belong to the path the model accepted (next page).""", _mask),
    Page("Verification: keep what the model agrees with, plus one", """\
After the pass, every node knows the model's own choice for the token after it. Start at the root and step to
the child whose token is exactly that choice; repeat until no child matches. The nodes walked through form the
**accepted path**: guesses the model would have written itself. The model's choice after the last accepted node
is right by definition, so it is kept as well: the **bonus token**.

In decoding step {step} the model accepted {accepted} ({n_accepted}, blue) and added the bonus token {bonus}
(orange star): **{produced} from one forward pass**, the text {added}. {stopped}

A pass always yields at least its bonus token, so Token Recycling never needs more passes than plain decoding, and
every token it keeps is the model's own greedy choice: the text is the same.""",
         _verification),
    Page("Recycling: every guess refreshes the table", """\
The pass has computed the model's scores for the next token at **every** node of the tree, the rejected guesses
included. Verification only needed the best one at each node; Token Recycling keeps the top {k} and writes them
into the row of that node's token, replacing what was there. That is the "recycling": candidates other methods
throw away become the next decoding steps' guesses.

Decoding step {step} rewrote {rows} (one per distinct token in its tree); {changed} of them gained candidates they
did not hold before, and {rejected_rows} belong to tokens that were **not** accepted. Why keep rows of rejected
guesses? A rejected guess was still a plausible token, likely to turn up soon, and its new row says what follows
it in this very context. The paper compared the two choices: updating the rows of all draft tokens gave more
tokens per forward pass than updating only the accepted ones.

Left, the rows as the decoding step found them (its guesses came from here); right, the rows it wrote. Yellow
cells are candidates that came in or dropped out; blue cells are the guesses on the accepted path (left) and the
model's choices along it (right).""",
         _recycling),
    Page("Hot start and cold start", """\
The matrix is kept from one request to the next, so what earlier answers taught it helps later ones. Starting
from a matrix filled by earlier requests is a **hot start**; starting from an empty one is a **cold start** (then
only the prompt's own tokens have rows, written while the model reads the prompt).

Both runs in the figure decode the same prompt with the same tree; they were recorded, not simulated.

- **Hot start** (the shipped matrix, filled from other prompts): {hot_tokens} tokens in {hot_steps} forward passes,
  **{hot_mat:.2f} tokens per forward pass (bonus token included)**.
- **Cold start**: {cold_tokens} tokens in {cold_steps} forward passes,
  **{cold_mat:.2f} tokens per forward pass (bonus token included)**; {cold_first:.2f} in its first {n_cold} passes,
  {cold_last:.2f} in its last {n_cold}, while its own passes filled the matrix.

{same_text}.""", _hot_and_cold),
    Page("What it costs", """\
**Memory.** The matrix holds {vocab:,} × {k} token ids of 4 bytes each: {matrix_bytes:,} bytes,
**{matrix_mib:.1f} MiB**, small beside the model's own weights (about 540 MB in fp32 for this 135M-parameter
model). Building the tree is a few table look-ups, and rewriting rows reuses scores the pass computed anyway.

**Time.** The real price is the bigger pass. On a datacenter GPU, checking a tree of about 80 tokens costs about
as much as a one-token pass, and the paper uses an 81-node tree. On the small CPU that recorded this run it does
not: a pass over the {tree_nodes}-node tree cost about {cost:.1f}× a one-token pass ({step_ms:.0f} ms), over
{paper_nodes} nodes {cost81:.1f}× ({t81:.0f} ms).

The figure weighs the two, tree size by tree size: the tokens per forward pass (bonus token included) a tree is
expected to give (from how often each node of the paper's tree was accepted on other prompts, likeliest nodes
first) against the measured cost of the pass. Their ratio, the predicted speedup, peaks at **{best_n} nodes**
({best_speedup:.2f}×, {best_tokens:.2f} tokens per forward pass) on that machine; a tree the size of `{tree}` at
{small_speedup:.2f}×, the paper's tree at {paper_speedup:.2f}×. The app's `auto` tree is chosen this way for each
model and machine: the biggest tree is not the fastest everywhere.""", _tree_sizes),
    Page("Beyond the paper: drafts from the context, and a tree grown where the matrix is sure", """\
On a small CPU only a few draft nodes pay for themselves (page 8), and the paper's fixed template spends them the
same way in every decoding step. This app adds methods of its own beside the paper's, each as exact as it (the
same one-pass verification, so the same text as plain decoding):

- **Token Recycling + context** (`tr-context`): when the text so far contains an earlier occurrence of its last
  tokens, what followed that occurrence is grafted onto the matrix's tree as an extra branch. The branch and the
  matrix tree share one node budget: a branch gets nodes in proportion to how often branches after matches of its
  length were accepted.
- **best-first tree** (`tr-dynamic`): the matrix also keeps each candidate's probability, and each decoding step's
  tree grows towards the likeliest paths, instead of a fixed template.
- **both** (`tr-plus`), and, as a third baseline beside Prompt Lookup, **Suffix decoding** (`suffix`): a small tree
  of the continuations that most often followed the longest earlier match.

{beyond_setting}:

{beyond_table}

{beyond_verdict} A draft node only pays where it is accepted often enough to cover what it adds to the pass; on
this kind of machine that is a node or two, so the extensions' gains stay small. Pick them in the Live tab and in
the race to see their trees: nodes copied from the context are diamonds on a green edge, best-first nodes
squares.""", _beyond_figure),
]


def page_text(lesson: Lesson, index: int) -> str:
    return PAGES[index].text.format(**facts(lesson))


def page_figure(lesson: Lesson, index: int, compact: bool = False) -> go.Figure:
    """The figure of page ``index``, drawn once per lesson and layout (``compact``: for a phone)."""
    key = (index, compact)
    if key not in lesson.figures:
        lesson.figures[key] = PAGES[index].figure(lesson, compact)
    return lesson.figures[key]
