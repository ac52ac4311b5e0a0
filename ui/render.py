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
from statistics import median
from typing import Collection, Mapping, Sequence

from tr_core.events import Rates, StepEvent
from tr_core.methods import METHODS

METHOD_NAMES = {name: m.label for name, m in METHODS.items()}
# The key number, one name everywhere: new tokens per verification forward pass, the bonus token counted (so a step
# that accepted no draft still counts 1)
TOKENS_PER_PASS = "tokens per forward pass (bonus token included)"
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


def decoding_speed(events: Sequence[StepEvent]) -> float:
    """Tokens per second over a run's decoding steps alone (each step's forward pass and overhead; the prefill left
    out), so that a short run compares with a long one."""
    seconds = sum(e.forward_ms + e.overhead_ms for e in events) / 1e3
    return sum(len(e.new_tokens) for e in events) / seconds if seconds > 0 else 0.0


def ms_per_step(events: Sequence[StepEvent]) -> float:
    """The mean time of one decoding step (forward pass and overhead), in ms; plain decoding's is its ms per token."""
    return sum(e.forward_ms + e.overhead_ms for e in events) / len(events) if events else 0.0


@dataclass(frozen=True)
class Baseline:
    """Plain decoding's speed on this machine, measured in the session, and where the number comes from."""

    tokens_per_s: float  # over its decoding steps, the prefill left out
    ms_per_token: float
    source: str  # e.g. "measured on your prompt right after your run (24 tokens)"


def counters_html(c: Rates, status: str = "", note: str = "", baseline: Baseline | None = None,
                  speed: float = 0.0) -> str:
    """The live counters after a step: ``c`` counts the time spent inside the decoder (prefill included), not
    drawing the page, so its tokens/s compares with the command line's. With a ``baseline``, plain decoding's speed
    on this machine beside the run's own ``speed`` over its decoding steps (both without the prefill)."""
    stats = [("steps", str(c.steps), "decoding steps (forward passes)"),
             ("tokens", str(c.tokens), "tokens produced"),
             ("tokens_per_pass", f"{c.mean_accepted_tokens:.2f}", TOKENS_PER_PASS),
             ("tokens_per_s", f"{c.tokens_per_s:.1f}", "tokens/s (decoding time, prefill included)")]
    if baseline is not None:
        ratio = speed / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
        stats += [("plain_tokens_per_s", f"{baseline.tokens_per_s:.1f}", "tokens/s of plain decoding here "
                   "(prefill left out)"),
                  ("speedup", f"{ratio:.2f}×", f"plain decoding's speed (this run: {speed:.1f} tokens/s, prefill "
                   "left out)")]
    tiles = "".join(f'<div class="tr-stat" data-key="{key}" data-value="{value.rstrip("×")}"><b>{value}</b>'
                    f"<span>{escape(name)}</span></div>" for key, value, name in stats)
    about = (f'<div class="tr-baseline">Plain decoding: {baseline.ms_per_token:.1f} ms per token, '
             f"{escape(baseline.source)}.</div>") if baseline is not None else ""
    line = " · ".join(escape(part) for part in (status, note) if part)
    return f'<div class="tr-counters">{tiles}</div>{about}<div class="tr-status">{line}</div>'


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


@dataclass(frozen=True)
class Spread:
    """The median of a few measurements and their range.

    >>> Spread.of([1.2, 0.9, 1.1])
    Spread(median=1.1, low=0.9, high=1.2)
    """

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(median(values), min(values), max(values))

    def shown(self, digits: int = 1, unit: str = "") -> str:
        """``"14.2 (13.0–15.1)"``; with ``unit="×"``: ``"1.12× (1.05–1.18×)"``."""
        return f"{self.median:.{digits}f}{unit} ({self.low:.{digits}f}–{self.high:.{digits}f}{unit})"


@dataclass(frozen=True)
class RaceSummary:
    """One method over a race's rounds. Each round's run is set against plain decoding's run of the same round
    (measured minutes apart at most, on the same CPU): its speedup, and what one of its forward passes cost against
    one of plain's (a one-token pass)."""

    method: str
    rounds: int
    tokens_per_s: Spread
    speedup: Spread  # each round's tokens/s over plain's in that round
    tokens_per_pass: float  # the median round's tokens per forward pass, the bonus token included
    pass_cost: float  # median over rounds: the mean decoding step's time over plain's (1.0 for plain itself)
    steps: int  # the median round's decoding steps
    identical: bool  # every round's output equals plain decoding's (of the first round)


def median_run(runs: Sequence[RaceRun]) -> RaceRun:
    """The round whose tokens/s is the median (the lower middle of an even count): the run the replay shows."""
    ranked = sorted(runs, key=lambda r: r.rates.tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def race_summary(rounds: Mapping[str, Sequence[RaceRun]]) -> dict[str, RaceSummary]:
    """Every method's medians and ranges over the race's rounds (``{method: [run of round 1, round 2, ...]}``, plain
    decoding's under ``"plain"``, each list in round order)."""
    plain = rounds["plain"]
    summary = {}
    for method, runs in rounds.items():
        typical = median_run(runs)
        speedups = [r.rates.tokens_per_s / p.rates.tokens_per_s if p.rates.tokens_per_s else 0.0
                    for r, p in zip(runs, plain)]
        costs = [ms_per_step(r.events) / ms_per_step(p.events) if ms_per_step(p.events) else 0.0
                 for r, p in zip(runs, plain)]
        summary[method] = RaceSummary(method, len(runs), Spread.of([r.rates.tokens_per_s for r in runs]),
                                      Spread.of(speedups), typical.rates.mean_accepted_tokens, median(costs),
                                      len(typical.events), all(r.token_ids == plain[0].token_ids for r in runs))
    return summary


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
                    f'data-high="{s.tokens_per_s.high:.1f}">'
                    f"<td>{escape(method_label(method, tree))}</td><td>{s.tokens_per_s.shown()}</td>"
                    f"<td>{s.speedup.shown(2, '×')}</td><td>{s.tokens_per_pass:.2f}</td><td>{s.pass_cost:.2f}×</td>"
                    f'<td>{s.steps}</td><td class="{"tr-same" if s.identical else "tr-differs"}">{check}</td></tr>')
        if not s.identical:
            other = next(r for r in rounds[method] if r.token_ids != plain.token_ids)
            diffs.append(difference_html(plain, other, decode))
    n = len(rounds["plain"])
    head = (f"<tr><th>method</th><th>tokens/s: median of {n} (range)</th><th>speedup over plain</th>"
            f"<th>{escape(TOKENS_PER_PASS)}</th><th>cost of one forward pass, against a one-token pass</th>"
            "<th>decoding steps</th><th>output vs plain decoding</th></tr>")
    return (f'<div class="tr-table-wrap"><table class="tr-table">{head}{"".join(rows)}</table></div>'
            f'{"".join(diffs)}')


def history_html(history: Sequence[Mapping]) -> str:
    """This session's runs, newest first."""
    if not history:
        return '<div class="tr-empty">No runs yet in this session.</div>'
    keys = ["run", "what", "tree", "k", "matrix at start", "tokens", "decoding steps", TOKENS_PER_PASS, "tokens/s"]
    head = "".join(f"<th>{escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(row.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for row in reversed(history))
    return f'<table class="tr-table tr-history"><tr>{head}</tr>{body}</table>'
