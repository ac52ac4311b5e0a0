"""HTML for the app, from step events alone: the streamed answer, the live counters, the race lanes and its table.

Every function is pure (events in, an HTML string out), so tests check what a user reads without a browser. The
answer marks each step: in a step that produced several tokens, the accepted draft tokens and the bonus token get
their own colour (blue and orange, as in the tree figure), so a multi-token step stands out in the text:

    step 7 produced ' of engineering' + '.'   ->
    <span class="tr-step tr-multi" data-step="7" data-tokens="3" title="...">
      <span class="tr-draft"> of engineering</span><span class="tr-bonus">.</span></span>
"""

from __future__ import annotations

from html import escape
from typing import Collection, Mapping, Sequence

from tr_core.events import TOKENS_PER_PASS, Rates, StepEvent
from tr_core.methods import METHODS
from tr_core.stats import SPEEDUP_DEFINITION, first_difference, speedup

from .records import Baseline, RaceRun, RaceSummary, race_summary

METHOD_NAMES = {name: m.label for name, m in METHODS.items()}
STOP_REASONS = {"eos": "the model ended its answer", "max_new_tokens": "reached max new tokens",
                "context_full": "the model's context is full"}


def split_step(event: StepEvent) -> tuple[str, str]:
    """``(draft text, bonus text)`` of one step's ``new_text``.

    The accepted draft tokens' text is their tree nodes' text; whatever follows is the bonus token's. A step cut by
    EOS or the token budget before its bonus token is all draft; where the pieces do not line up with ``new_text``
    (a character split across tokens) the whole step counts as its last kind.
    """
    drafted = [event.tree_tokens[i] for i in event.accepted_path[1:]]
    draft_text = "".join(event.tree_text[i] for i in event.accepted_path[1:])
    if event.new_tokens == drafted + [event.bonus_token] and event.new_text.startswith(draft_text):
        return draft_text, event.new_text[len(draft_text):]
    if event.new_tokens == drafted[: len(event.new_tokens)]:
        return event.new_text, ""
    return ("", event.new_text) if len(event.new_tokens) == 1 else (event.new_text, "")


def shown_text(text: str, hidden: Collection[str] = ()) -> str:
    """``text`` as the answer shows it: without the special tokens' text in ``hidden`` (e.g. ``"<|im_end|>"``); the
    events keep their token ids.

    >>> shown_text("Paris.<|im_end|>", {"<|im_end|>"})
    'Paris.'
    """
    for special in hidden:
        text = text.replace(special, "")
    return text


def step_span(event: StepEvent, current: bool = False, hidden: Collection[str] = ()) -> str:
    draft, bonus = (shown_text(part, hidden) for part in split_step(event))
    n = len(event.new_tokens)
    drafts = n - (1 if bonus else 0)
    title = (f"decoding step {event.step}: {drafts} accepted draft token{'s' * (drafts != 1)}"
             + (" + the bonus token" if bonus else "") + f" = {n} token{'s' * (n != 1)} from one forward pass")
    classes = "tr-step" + (" tr-multi" if n > 1 else "") + (" tr-current" if current else "")
    inner = (f'<span class="tr-draft">{escape(draft)}</span>' if draft else "") + \
            (f'<span class="tr-bonus">{escape(bonus)}</span>' if bonus else "")
    return (f'<span class="{classes}" data-step="{event.step}" data-tokens="{n}" title="{escape(title)}">'
            f"{inner}</span>")


def answer_html(events: Sequence[StepEvent], current: int | None = None, placeholder: str = "",
                hidden: Collection[str] = ()) -> str:
    """The answer so far, one span per decoding step; ``current`` outlines the step the figures show; the text of
    the special tokens in ``hidden`` (the tokenizer's, e.g. ``"<|im_end|>"``) is not shown."""
    if not events:
        return f'<div class="tr-answer tr-empty">{escape(placeholder)}</div>'
    spans = "".join(step_span(e, e.step == current, hidden) for e in events)
    return f'<div class="tr-answer" data-steps="{len(events)}">{spans}</div>'


ANSWER_LEGEND = ('<div class="tr-legend"><span class="tr-draft">accepted draft tokens</span> '
                 '<span class="tr-bonus">bonus token</span> mark the steps that produced several tokens at once; '
                 "unmarked text came one token per decoding step. Hover a step for its count.</div>")


def in_words(events: Sequence[StepEvent]) -> str:
    """What the run's steps did, in a learner's words: how many guesses each step checked, how many it kept, so how
    many tokens each step made.

    >>> from types import SimpleNamespace as E
    >>> in_words([E(tree_tokens=list(range(13)), total_tokens=7, total_steps=4)] * 4)[:82]
    'each step checked 12 guesses, kept 0.75 of them on average, so each step made 1.75'
    >>> in_words([E(tree_tokens=[5], total_tokens=3, total_steps=3)])
    'each step made 1 token, as plain decoding does: there were no guesses to check'
    """
    if not events:
        return ""
    last = events[-1]
    made = last.total_tokens / last.total_steps if last.total_steps else 0.0
    guesses = sum(len(e.tree_tokens) - 1 for e in events) / len(events)
    if guesses == 0:
        return "each step made 1 token, as plain decoding does: there were no guesses to check"
    whole = abs(guesses - round(guesses)) < 0.05
    shown = f"{guesses:.0f} guess{'es' * (round(guesses) != 1)}" if whole else f"{guesses:.1f} guesses on average"
    return (f"each step checked {shown}, kept {made - 1:.2f} of them on average, so "
            f"each step made {made:.2f} tokens (the kept guesses plus the model's own next token)")


def counters_html(c: Rates, status: str = "", note: str = "", baseline: Baseline | None = None,
                  words: str = "") -> str:
    """The live counters after a step: ``c`` counts the time spent inside the decoder, prefill included, not
    drawing the page. With a ``baseline``, plain decoding's speed on the same prompt and answer length and the
    speedup (``tr_core.stats.SPEEDUP_DEFINITION``, as the race and the benchmark compute it): one tokens/s figure
    per method. The status line says in ``words`` what the steps did (``in_words``); what the run was set up with
    (``note``: the mode, the kernels, the tree's fit, the matrix) and how plain decoding was measured are folded
    under "Details"."""
    stats = [("steps", str(c.steps), "decoding steps (forward passes)"),
             ("tokens", str(c.tokens), "tokens produced"),
             ("tokens_per_pass", f"{c.mean_accepted_tokens:.2f}", TOKENS_PER_PASS),
             ("tokens_per_s", f"{c.tokens_per_s:.1f}", "tokens/s, this run (whole answer, prefill included)")]
    if baseline is not None:
        so_far = "" if baseline.final else ", so far"
        run = c.tokens_per_s if baseline.final or baseline.run_tokens_per_s is None else baseline.run_tokens_per_s
        stats += [("plain_tokens_per_s", f"{baseline.tokens_per_s:.1f}", "tokens/s of plain decoding, same prompt "
                   f"and length{so_far}"),
                  ("speedup", f"{speedup(run, baseline.tokens_per_s):.2f}×", "plain decoding's speed" + (
                      "" if baseline.final else ", so far: both over the answer's start that plain decoding has "
                                                "reached"))]
    tiles = "".join(f'<div class="tr-stat" data-key="{key}" data-value="{value.rstrip("×")}"><b>{value}</b>'
                    f"<span>{escape(name)}</span></div>" for key, value, name in stats)
    same, about = "", ""
    if baseline is not None and baseline.final:  # while the run goes on, the details say how plain is measured
        same = {True: "Plain decoding gave the very same tokens.",
                False: "Plain decoding's tokens DIFFER from this run's."}.get(baseline.identical, "")
        about = (f'<div class="tr-baseline">Plain decoding: {escape(baseline.source)}; {baseline.ms_per_token:.1f} '
                 f"ms per decoding step. Speedup: {escape(SPEEDUP_DEFINITION)}.</div>")
    line = " · ".join(escape(part) for part in (status, words, same) if part)
    details = (f'<details class="tr-details"><summary>Details: how this run was set up and measured</summary>'
               f'<div class="tr-note">{escape(note)}</div>{about}</details>' if note or about else "")
    return f'<div class="tr-counters">{tiles}</div><div class="tr-status">{line}</div>{details}'


def notice_html(text: str = "", kind: str = "error") -> str:
    """A message in the page, in plain sight (``kind``: ``"error"`` or ``"callout"``); ``""`` shows nothing."""
    return f'<div class="tr-notice tr-{kind}" role="alert">{escape(text)}</div>' if text else ""


def finished_status(event: StepEvent | None, stopped: bool = False) -> str:
    if stopped:
        return "stopped by you"
    if event is None:
        return ""
    return f"finished: {STOP_REASONS.get(event.stop_reason or '', event.stop_reason or 'done')}"


# --- the race -------------------------------------------------------------------------------------------------------

def method_label(method: str, tree: str | None = None) -> str:
    name = METHOD_NAMES.get(method, method)
    return f"{name} (tree {tree})" if method == "tr" and tree else name


def lanes_html(runs: Mapping[str, RaceRun | None], at_s: float | None, tree: str | None = None,
               hidden: Collection[str] = ()) -> str:
    """Side-by-side lanes, each showing what its method had produced ``at_s`` seconds into its own measured run
    (``None``: the whole run); a method not measured yet shows as waiting."""
    lanes = []
    for method, run in runs.items():
        if run is None:
            body, foot = '<div class="tr-answer tr-empty">waiting to be measured…</div>', ""
        else:
            shown = [e for e in run.events if at_s is None or e.elapsed_s <= at_s]
            done = len(shown) == len(run.events)
            last = shown[-1] if shown else None
            clock = run.elapsed_s if done else (at_s or 0.0)
            tokens = last.total_tokens if last else 0
            steps = last.total_steps if last else 0
            foot = (f"{tokens} tokens in {steps} decoding steps, {clock:.1f} s"
                    + (f" — done, {run.rates.tokens_per_s:.1f} tokens/s" if done else ""))
            body = answer_html(shown, hidden=hidden)
        lanes.append(f'<div class="tr-lane tr-lane-{escape(method)}" data-method="{escape(method)}">'
                     f"<h4>{escape(method_label(method, tree))}</h4>{body}"
                     f'<div class="tr-lane-foot">{escape(foot)}</div></div>')
    return f'<div class="tr-lanes">{"".join(lanes)}</div>'


def difference_html(plain: RaceRun, other: RaceRun, decode) -> str:
    """Where ``other``'s output leaves plain decoding's: the shared text, then both continuations."""
    i = first_difference(plain.token_ids, other.token_ids)
    if i is None:
        return ""
    shared, a, b = decode(plain.token_ids[:i]), decode(plain.token_ids[i:]), decode(other.token_ids[i:])
    name = escape(METHOD_NAMES.get(other.method, other.method))
    return (f'<div class="tr-diff" data-method="{escape(other.method)}"><b>{name}</b> differs from plain decoding at '
            f"token {i}:<br>…{escape(shared[-60:])}"
            f'<del>{escape(a[:80])}</del><ins>{escape(b[:80])}</ins></div>')


def race_verdict(summary: Mapping[str, RaceSummary]) -> str:
    """One sentence on why Token Recycling (else the fastest method raced) won or lost against plain decoding, from
    what was measured: the tokens each forward pass added against what a pass over its tree cost."""
    others = [s for m, s in summary.items() if m != "plain"]
    if not others:
        return "Only plain decoding was measured."
    s = summary.get("tr") or max(others, key=lambda x: x.speedup.median)
    rounds = f"median of {s.rounds} round{'s' * (s.rounds != 1)}, range {s.speedup.low:.2f}–{s.speedup.high:.2f}×"
    head = f"{METHOD_NAMES.get(s.method, s.method)} ran at {s.speedup.median:.2f}× plain decoding ({rounds})"
    if s.speedup.median > 1:
        why = (f"each forward pass added {s.tokens_per_pass:.2f} tokens (bonus token included) for "
               f"{s.pass_cost:.2f}× the cost of a one-token pass")
    else:
        why = (f"each forward pass added only {s.tokens_per_pass:.2f} tokens (bonus token included) but cost "
               f"{s.pass_cost:.2f}× a one-token pass")
    differs = "" if s.identical else "; its output differed from plain decoding's (see below the table)"
    return f"{head}: {why}{differs}."


def race_table_html(rounds: Mapping[str, Sequence[RaceRun]], decode, tree: str | None = None) -> str:
    """One row per method: tokens/s and speedup over plain (median of the rounds, with their range), tokens per
    forward pass, a pass's cost against a one-token pass, decoding steps, and whether every round's output is
    identical to plain decoding's; a difference is spelled out below the table."""
    summary = race_summary(rounds)
    plain = rounds["plain"][0]
    rows, diffs = [], []
    for method, s in summary.items():
        check = "✓ identical" if s.identical else "✗ differs (see below)"
        rows.append(f'<tr data-method="{escape(method)}" data-identical="{str(s.identical).lower()}" '
                    f'data-median="{s.tokens_per_s.median:.1f}" data-low="{s.tokens_per_s.low:.1f}" '
                    f'data-high="{s.tokens_per_s.high:.1f}" data-speedup="{s.speedup.median:.3f}" '
                    f'data-speedup-low="{s.speedup.low:.3f}" data-speedup-high="{s.speedup.high:.3f}">'
                    f"<td>{escape(method_label(method, tree))}</td>"
                    f'<td class="{"tr-same" if s.identical else "tr-differs"}">{check}</td>'
                    f"<td>{s.tokens_per_s.shown()}</td><td>{s.speedup.shown(2, '×')}</td>"
                    f'<td>{s.tokens_per_pass:.2f}</td><td class="tr-minor">{s.pass_cost:.2f}×</td>'
                    f'<td class="tr-minor">{s.steps}</td></tr>')
        if not s.identical:
            other = next(r for r in rounds[method] if r.token_ids != plain.token_ids)
            diffs.append(difference_html(plain, other, decode))
    n = len(rounds["plain"])
    head = (f"<tr><th>method</th><th>output vs plain decoding</th><th>tokens/s: median of {n} (range)</th>"
            f"<th>speedup over plain: median (range)</th><th><span class=\"tr-wide-only\">{escape(TOKENS_PER_PASS)}"
            '</span><span class="tr-narrow-only">tokens per pass</span></th>'
            '<th class="tr-minor">cost of one forward pass, against a one-token pass</th>'
            '<th class="tr-minor">decoding steps</th></tr>')
    # the speedup is the median of the rounds' own ratios (each round's tokens/s over that round's plain decoding),
    # not the ratio of the medians beside it
    why = ('<div class="tr-status">Speedup: the median over the rounds of each round\'s ratio to plain decoding in '
           "the same round, so it need not equal the ratio of the two medians of tokens/s. "
           '<span class="tr-narrow-only">On a wider screen the table also gives each pass\'s cost and the '
           "decoding steps.</span></div>")
    return (f'<div class="tr-table-wrap"><table class="tr-table">{head}{"".join(rows)}</table></div>{why}'
            f'{"".join(diffs)}')


def history_html(history: Sequence[Mapping]) -> str:
    """This session's runs, newest first."""
    if not history:
        return '<div class="tr-empty">No runs yet in this session.</div>'
    keys = ["run", "what", "tree", "k", "matrix at start", "tokens", "decoding steps", TOKENS_PER_PASS, "tokens/s"]
    minor = {"tree", "k", "matrix at start", "decoding steps"}  # left out on a phone's width (CSS: .tr-minor)

    def cell(tag: str, key: str, text: str) -> str:
        return f'<{tag}{" class=tr-minor" if key in minor else ""}>{escape(text)}</{tag}>'

    head = "".join(cell("th", k, k) for k in keys)
    body = "".join("<tr>" + "".join(cell("td", k, str(row.get(k, ""))) for k in keys) + "</tr>"
                   for row in reversed(history))
    older = history[0]["run"] - 1 if history else 0
    note = (f'<div class="tr-status">and {older} earlier run{"s" * (older != 1)}, no longer listed</div>'
            if older > 0 else "")
    return f'<div class="tr-table-wrap"><table class="tr-table tr-history"><tr>{head}</tr>{body}</table></div>{note}'
