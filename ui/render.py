"""HTML for the app, from step events alone: the streamed answer, the live counters, the race lanes and its table.

Every function is pure (events in, an HTML string out), so tests check what a user reads without a browser. The
answer marks each step: in a step that produced several tokens, the accepted draft tokens and the bonus token get
their own colour (blue and orange, as in the tree figure), so a multi-token step stands out in the text:

    step 7 produced ' of engineering' + '.'   ->
    <span class="tr-step tr-multi" data-step="7" data-tokens="3" title="...">
      <span class="tr-draft"> of engineering</span><span class="tr-bonus">.</span></span>
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Mapping, Sequence

from tr_core.events import Rates, StepEvent
from tr_core.methods import METHODS

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


def step_span(event: StepEvent, current: bool = False) -> str:
    draft, bonus = split_step(event)
    n = len(event.new_tokens)
    drafts = n - (1 if bonus else 0)
    title = (f"step {event.step}: {drafts} accepted draft token{'s' * (drafts != 1)}"
             + (" + the bonus token" if bonus else "") + f" = {n} token{'s' * (n != 1)} from one forward pass")
    classes = "tr-step" + (" tr-multi" if n > 1 else "") + (" tr-current" if current else "")
    inner = (f'<span class="tr-draft">{escape(draft)}</span>' if draft else "") + \
            (f'<span class="tr-bonus">{escape(bonus)}</span>' if bonus else "")
    return (f'<span class="{classes}" data-step="{event.step}" data-tokens="{n}" title="{escape(title)}">'
            f"{inner}</span>")


def answer_html(events: Sequence[StepEvent], current: int | None = None, placeholder: str = "") -> str:
    """The answer so far, one span per step; ``current`` outlines the step the figures show."""
    if not events:
        return f'<div class="tr-answer tr-empty">{escape(placeholder)}</div>'
    spans = "".join(step_span(e, e.step == current) for e in events)
    return f'<div class="tr-answer" data-steps="{len(events)}">{spans}</div>'


ANSWER_LEGEND = ('<div class="tr-legend"><span class="tr-draft">accepted draft tokens</span> '
                 '<span class="tr-bonus">bonus token</span> mark the steps that produced several tokens at once; '
                 "unmarked text came one token per step. Hover a step for its count.</div>")


def counters_html(c: Rates, status: str = "", note: str = "") -> str:
    """The live counters after a step: ``c`` counts the time spent inside the decoder (prefill included), not
    drawing the page, so its tokens/s compares with the command line's."""
    stats = [("steps", str(c.steps), "steps (forward passes)"),
             ("tokens", str(c.tokens), "tokens produced"),
             ("mean_accepted_tokens", f"{c.mean_accepted_tokens:.2f}", "mean accepted tokens per step"),
             ("tokens_per_s", f"{c.tokens_per_s:.1f}", "tokens/s (decoding time)")]
    tiles = "".join(f'<div class="tr-stat" data-key="{key}" data-value="{value}"><b>{value}</b>'
                    f"<span>{escape(name)}</span></div>" for key, value, name in stats)
    line = " · ".join(escape(part) for part in (status, note) if part)
    return f'<div class="tr-counters">{tiles}</div><div class="tr-status">{line}</div>'


def finished_status(event: StepEvent | None, stopped: bool = False) -> str:
    if stopped:
        return "stopped by you"
    if event is None:
        return ""
    return f"finished: {STOP_REASONS.get(event.stop_reason or '', event.stop_reason or 'done')}"


# --- the race -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RaceRun:
    """One method's measured run: its events and the text and token ids they produced."""

    method: str
    events: list[StepEvent]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.new_tokens]

    @property
    def text(self) -> str:
        return "".join(e.new_text for e in self.events)

    @property
    def elapsed_s(self) -> float:
        return self.events[-1].elapsed_s if self.events else 0.0

    @property
    def rates(self) -> Rates:
        return self.events[-1].rates if self.events else Rates()


def method_label(method: str, tree: str | None = None) -> str:
    name = METHOD_NAMES.get(method, method)
    return f"{name} (tree {tree})" if method == "tr" and tree else name


def lanes_html(runs: Mapping[str, RaceRun | None], at_s: float | None, tree: str | None = None) -> str:
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
            foot = (f"{tokens} tokens in {steps} steps, {clock:.1f} s"
                    + (f" — done, {run.rates.tokens_per_s:.1f} tokens/s" if done else ""))
            body = answer_html(shown)
        lanes.append(f'<div class="tr-lane tr-lane-{escape(method)}" data-method="{escape(method)}">'
                     f"<h4>{escape(method_label(method, tree))}</h4>{body}"
                     f'<div class="tr-lane-foot">{escape(foot)}</div></div>')
    return f'<div class="tr-lanes">{"".join(lanes)}</div>'


def first_different_token(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or where the shorter ends); ``None`` if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def difference_html(plain: RaceRun, other: RaceRun, decode) -> str:
    """Where ``other``'s output leaves plain decoding's: the shared text, then both continuations."""
    i = first_different_token(plain.token_ids, other.token_ids)
    if i is None:
        return ""
    shared, a, b = decode(plain.token_ids[:i]), decode(plain.token_ids[i:]), decode(other.token_ids[i:])
    name = escape(METHOD_NAMES.get(other.method, other.method))
    return (f'<div class="tr-diff" data-method="{escape(other.method)}"><b>{name}</b> differs from plain decoding at '
            f"token {i}:<br>…{escape(shared[-60:])}"
            f'<del>{escape(a[:80])}</del><ins>{escape(b[:80])}</ins></div>')


def race_table_html(runs: Mapping[str, RaceRun], decode, tree: str | None = None) -> str:
    """One row per method: tokens/s, speedup over plain, mean accepted tokens, steps, and whether its output is
    identical to plain decoding's; a difference is spelled out below the table."""
    plain = runs["plain"]
    rows, diffs = [], []
    for method, run in runs.items():
        same = run.token_ids == plain.token_ids
        rates, plain_rates = run.rates, plain.rates
        speedup = rates.tokens_per_s / plain_rates.tokens_per_s if plain_rates.tokens_per_s else 0.0
        check = "✓ identical" if same else "✗ differs (see below)"
        rows.append(f'<tr data-method="{escape(method)}" data-identical="{str(same).lower()}">'
                    f"<td>{escape(method_label(method, tree))}</td><td>{rates.tokens_per_s:.1f}</td>"
                    f"<td>{speedup:.2f}×</td><td>{rates.mean_accepted_tokens:.2f}</td>"
                    f"<td>{len(run.events)}</td><td>{run.elapsed_s:.2f}</td>"
                    f'<td class="{"tr-same" if same else "tr-differs"}">{check}</td></tr>')
        if not same:
            diffs.append(difference_html(plain, run, decode))
    head = ("<tr><th>method</th><th>tokens/s</th><th>speedup over plain</th><th>mean accepted tokens</th>"
            "<th>steps</th><th>seconds</th><th>output vs plain decoding</th></tr>")
    return f'<table class="tr-table">{head}{"".join(rows)}</table>{"".join(diffs)}'


def history_html(history: Sequence[Mapping]) -> str:
    """This session's runs, newest first."""
    if not history:
        return '<div class="tr-empty">No runs yet in this session.</div>'
    keys = ["run", "what", "tree", "k", "matrix at start", "tokens", "steps", "mean accepted tokens", "tokens/s"]
    head = "".join(f"<th>{escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(row.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for row in reversed(history))
    return f'<table class="tr-table tr-history"><tr>{head}</tr>{body}</table>'
