"""One run of the app, from checked settings to the finished record, below the UI (nothing here knows gradio).

    run = LiveRun(session, models, settings)
    run.prepare()                       # the model (loaded on first use), the run's engine, matrix and prompt
    for snapshot in run.snapshots():    # one per decoding step; the last one is final (finished or stopped)
        show(snapshot)
    run.stop()                          # from another request: the run ends after its current step

A live run drafts from the session's own matrix (hot start) and leaves its record in ``session.live`` and a line in
``session.history``; plain decoding of the same prompt is measured right after it, to the same token count and timed
on its own (``PlainAlongside``), so that the page gives the speedup as the race and the benchmark define it
(``tr_core.stats.speedup``) from two runs measured under the same load. A ``Race`` measures
plain decoding and the methods the user picked (by default Prompt Lookup, Token Recycling and the best extension
beyond the paper) in rounds: each round runs every method once, one after another, in an order rotated per round,
each matrix method from a fresh copy of one matrix; it leaves ``session.race``. Reading a record (the step slider,
the replay, ``/trace``) needs no model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from tr_core import trace_file
from tr_core.backend import device_name, machine_profile
from tr_core.engine import AUTO, TREE_DIRS, Engine
from tr_core.events import Rates, StepEvent, token_ids_named
from tr_core.fitting import auto_tree, has_acceptance_stats
from tr_core.matrix import AdjacencyMatrix
from tr_core.methods import METHODS
from tr_core.stats import collector_paused
from tr_core.text import shown_piece
from tr_core.tree import load_template
from visualize.trace import token_text_map

from .inputs import InputError, prompt_ids
from .models import ModelCache
from .quiet import Quiet
from .records import Baseline, RaceRun, median_run, ms_per_step
from .render import method_label
from .session import LiveRecord, RaceRecord, Session, shared_start
from .settings import DEFAULT_RACE, Settings
from .summaries import run_summary

log = logging.getLogger("token_recycling.app")
REPLAY_MAX_S = 12.0  # a recorded run replays at its own pace, sped up to last at most this long
RACE_METHODS = ("plain",) + DEFAULT_RACE  # the race's lanes before the user picks
# Each method runs this many times in a race, interleaved: on a shared CPU one run's speed drifts by up to 2x within
# minutes, so the page gives the median and the range
RACE_ROUNDS = 3


def tree_for(method: str, tree: str) -> str:
    """The tree a method drafts with: the methods beyond the paper size their own trees with the measured tree
    budget ("auto"); the others, the tree picked."""
    return AUTO if METHODS[method].beyond_paper else tree


def tree_note(engine: Engine, requested: str, fitted=None) -> str:
    """What tree a run drafts with, e.g. ``"tree auto: starts at 9 draft nodes fitted to this machine (predicted 1.3×
    over plain decoding, per step over a 256-token context), then sizes each step's tree by the step times it
    measures (...)"``."""
    nodes = f"{engine.tree.size - 1} draft node{'s' * (engine.tree.size != 2)}"
    if requested != AUTO:
        return f"tree {requested}: {nodes}{against_best(engine.tree.size, fitted)}"
    fitted = engine.fitted
    if fitted is None:
        return f"tree auto: no acceptance statistics for this model, so the {engine.tree.name} tree ({nodes})"
    adapts = ", then sizes each step's tree by the step times it measures (the tree-budget chart shows why)"
    if engine.tree.size == 1:
        start = ("tree auto: no draft nodes to start with: on this machine, verifying even one draft token was "
                 "expected to cost more than it saves")
        return start + (adapts if engine.adaptive else ", so the fitted tree is plain decoding; pick another tree "
                                                       "to watch drafting")
    where = f", per step over a {fitted.context}-token context" if isinstance(fitted.context, int) else ""
    fit = (f"fitted to this machine (predicted {fitted.predicted_speedup:.2f}× over plain decoding{where}"
           f"{why_size(fitted, engine.tree.size)})")
    return f"tree auto: starts at {nodes} {fit}{adapts}" if engine.adaptive else f"tree auto: {nodes} {fit}"


def why_size(fitted, size: int) -> str:
    """Why the fitted tree has its ``size`` (nodes, root included), from the step times it was fitted on: what
    verifying it costs here against a one-token step, and what twice as many rows would cost; ``""`` without them.

    >>> from types import SimpleNamespace as NS
    >>> rows = [dict(nodes=n, step_ms=10.0 + n) for n in range(1, 21)]
    >>> why_size(NS(table=rows), 10)
    '; verifying them, 10 rows with the root, costs 1.82× a one-token step here, 20 rows would cost 2.73×'
    """
    table = {row["nodes"]: row["step_ms"] for row in fitted.table}
    if not table.get(1) or not table.get(size):
        return ""
    more = max((n for n in table if n <= 2 * size), default=size)
    said = f"; verifying them, {size} rows with the root, costs {table[size] / table[1]:.2f}× a one-token step here"
    return said + (f", {more} rows would cost {table[more] / table[1]:.2f}×" if more > size else "")


def draft_note(engine: Engine, method: str, tree: str) -> str:
    """What a run drafts with: the tree (``tree_note``) for a matrix method, else the method's own draft."""
    if METHODS[method].uses_matrix:
        return tree_note(engine, tree, fitted_tree(engine))
    if method == "lookahead":
        size = engine.lookahead_size()
        return (f"Lookahead window of {size['width']} guesses, n-grams of {size['n']}, up to {size['guesses']} "
                f"verified a step ({size['why']}); the tree picked applies to Token Recycling only")
    own = {"plain": "no draft: one token a forward pass", "pld": "drafts a chain copied from the context",
           "suffix": "drafts a trie of the context's continuations",
           "rest": "drafts a trie of the datastore's continuations, sized by this machine's t(N)"}
    return f"{own.get(method, 'drafts its own way')}; the tree picked applies to Token Recycling only"


def fitted_tree(engine: Engine):
    """The tree fitted to the model on this machine (shipped acceptance statistics, t(N) measured here), whatever
    tree the run drafts with; ``None`` for a model without statistics."""
    if engine.fitted is not None:
        return engine.fitted
    if not has_acceptance_stats(engine.model):
        return None
    curve = engine.step_curve() if engine.backend_name == "torch" else None  # the native t(N): its own cache
    return auto_tree(engine.model, context=engine.config.fit_context, curve=curve)


def against_best(size: int, fitted) -> str:
    """For a tree the user picked (``size`` nodes, root included): what a tree of its size is predicted to run at
    here, per step, against the size that pays most on this machine (``fitted``); ``""`` where nothing was fitted.

    >>> from types import SimpleNamespace as NS
    >>> table = [dict(nodes=n, predicted_speedup=s) for n, s in [(1, 1.0), (2, 1.25), (3, 1.2)]]
    >>> note = against_best(3, NS(table=table, tree=NS(size=2), predicted_speedup=1.25))
    >>> "a tree of its size is predicted at 1.20×" in note, "most here, 1 draft node (tree auto), at 1.25×)" in note
    (True, True)
    """
    mine = next((row for row in fitted.table if row["nodes"] == size), None) if fitted else None
    if mine is None:
        return ""
    best = fitted.tree.size - 1
    return (f" (a tree of its size is predicted at {mine['predicted_speedup']:.2f}× plain decoding per step here; "
            f"the size that pays most here, {best} draft node{'s' * (best != 1)} (tree auto), at "
            f"{fitted.predicted_speedup:.2f}×)")


class Every:
    """A throttle: true at the first call, then whenever ``seconds`` have passed since it was last true.

    >>> now = iter([0.0, 0.05, 0.12, 0.15, 0.3]).__next__
    >>> due = Every(0.1, clock=now)
    >>> [due() for _ in range(5)]
    [True, False, True, False, True]
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self.clock, self.last = seconds, clock, None

    def restart(self) -> None:
        """Count the next ``seconds`` from now (after a wait that should not count)."""
        self.last = self.clock()

    def __call__(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.seconds:
            return False
        self.last = now
        return True


@dataclass(frozen=True)
class Snapshot:
    """A live run after a step. ``events`` is the run's own list (read it, do not change it); ``rates`` count the
    time spent decoding (prefill included), not drawing, so tokens/s compares with the command line's."""

    events: list[StepEvent]
    rates: Rates
    note: str  # what the run drafts with: the prompt's cut, the mode, the tree, the matrix
    done: bool = False
    stopped: bool = False
    baseline: Baseline | None = None
    drafted_nothing: bool = False  # the auto tree stayed empty at every step: the run was plain decoding
    measuring_plain: bool = False  # the run's steps are done; plain decoding of the prompt is being measured


class Stoppable:
    """Something a user's Stop ends: a run, a race, a replay. It checks ``stopped`` between its steps."""

    stopped = False

    def stop(self) -> None:
        self.stopped = True


class _ModelRun(Stoppable):
    """What a live run and a race share: the settings, the loaded model, the run's engine, matrix and prompt."""

    def __init__(self, session: Session, models: ModelCache, settings: Settings):
        self.session, self.models, self.settings = session, models, settings
        self.quiet: Quiet | None = None  # made by ``prepare``: the machine's background use of the CPU

    def settle(self) -> None:
        """A frame was sent: wait, untimed, until the machine's other processes (a browser drawing it on this
        machine) are back to their use before the run (``ui.quiet``), so that no timed step pays for the drawing."""
        if self.quiet is not None:
            self.quiet.wait()

    @property
    def needs_loading(self) -> bool:
        return not self.models.loaded(self.settings.model_id, self.settings.mode)

    def prepare(self) -> None:
        """Load the model if needed and set the run up; ``InputError`` or ``ModelLoadError`` if it cannot run."""
        s = self.settings
        self.base = self.models.get(s.model_id, s.mode)
        self.session.model_id = s.model_id  # it loaded: the session's model from now on
        tree = tree_for(s.method, s.tree)
        engine = self._configured(s.method, tree)
        self.matrix, self.about_matrix = self._matrix(engine)
        self.ids, self.about_prompt = prompt_ids(engine.tokenizer, s.prompt, s.max_new_tokens, engine.context_length)
        self.engine, self.start = engine.with_matrix(self.matrix), self.session.matrix_start(s.hot_start)
        self.matrix_history = self.session.matrix_history(s.prompt.text, s.hot_start)
        self.about_setup = (f"{s.sampling.describe()}; mode {engine.mode_note()}; "
                            f"{draft_note(engine, s.method, tree)}; {where(engine)}")
        self.quiet = Quiet()

    def _matrix(self, engine: Engine) -> tuple[AdjacencyMatrix, str]:
        """The matrix the run drafts from, and a line about it: the session's own (hot start), which it teaches."""
        s = self.settings
        return self.session.matrix_for(engine, s.model_id, s.hot_start, prompt=s.prompt.text)

    def machine_profile(self) -> dict | None:
        """What the step-cost model needs of this machine and the run's model (``tr_core.speed.machine_profile``:
        cached after its first measurement); ``None``, logged, where it cannot be taken."""
        try:
            return machine_profile(self.engine.model, self.engine.config.fit_context)
        except Exception:  # a projection is an extra: the run's own figures stand without it
            log.warning("no machine profile for the projection", exc_info=True)
            return None

    @property
    def hidden(self) -> tuple[str, ...]:
        """The tokenizer's special tokens (``"<|im_end|>"``, ...): the page does not show their text."""
        return tuple(self.base.tokenizer.all_special_tokens)

    def _configured(self, method: str, tree: str) -> Engine:
        """The engine ``method`` runs on, on the loaded model; ``InputError`` where the settings do not fit it."""
        if tree != AUTO:
            rank = load_template(tree, TREE_DIRS).max_rank + 1
            if rank > self.settings.top_k:
                raise InputError(f"The {tree} tree drafts a row's {rank} likeliest candidates, so 'k: candidates per "
                                 f"row' must be at least {rank}; it is {self.settings.top_k}. Raise k, or pick a "
                                 "smaller tree.")
        try:
            engine = self.base.with_config(method=method, tree=tree, top_k=self.settings.top_k)
            engine.drafter(method)  # a method that cannot run with these settings says why, before any decoding
        except ValueError as e:  # e.g. a tree that needs a larger k
            raise InputError(str(e)) from None
        return engine


class PlainAlongside:
    """Plain decoding of a live run's prompt, measured right after the run (``LiveRun.snapshots``) to the same token
    count, timed on its own as the race times each run: its time counts its prefill and every decoding step, not the
    page's drawing (``tr_core.stats.SPEEDUP_DEFINITION``), nor the garbage collections the drawing causes
    (``collector_paused``: they run between steps). Both runs send a frame after each ``FRAME_EVERY_S`` of decoding
    and wait after it until the machine is quiet (``Quiet``), so both are interrupted alike.

    Why after the run and not step by step beside it: on this project's 2-vCPU machine a tree pass (13 rows, exact
    mode) ran slower right after a one-row pass of plain decoding than in a run of tree passes (74.0 ms for the first
    after a turn of plain steps against 70-71 ms for the later ones, medians over 4 runs of 128 tokens), and plain
    passes ran faster right after tree passes (45.6 against 47 ms): the two lanes change each other's speed for
    several steps. Interleaved step by step, Live read 1.13-1.19x where the race, which runs each method alone,
    read 1.22-1.23x on the same prompt; in turns of a frame, still 1.14-1.18x. Measured one after the other, as a
    round of the race is, the two agree (docs/app.md)."""

    def __init__(self, engine: Engine, ids: list[int], max_new_tokens: int, sampling):
        self.steps = engine.stream(ids, max_new_tokens, method="plain", sampling=sampling)
        self.events: list[StepEvent] = []
        self.seconds = 0.0

    @property
    def tokens(self) -> int:
        return self.events[-1].total_tokens if self.events else 0

    def step(self, tokens: int) -> bool:
        """One timed step of plain decoding, unless it already has ``tokens`` tokens or has finished: whether it
        took one."""
        if self.tokens >= tokens or (self.events and self.events[-1].finished):
            return False
        started = time.perf_counter()
        with collector_paused():
            event = next(self.steps, None)
        self.seconds += time.perf_counter() - started
        if event is None:
            return False
        event.elapsed_s = self.seconds
        self.events.append(event)
        return True

    def baseline(self, events: list[StepEvent], final: bool = False) -> Baseline | None:
        """Plain decoding's speed so far (``final``: over the whole answer), beside the run's ``events``."""
        if not self.events:
            return None
        rates = Rates(self.tokens, len(self.events), self.seconds)
        so_far = "" if final else " so far"
        source = (f"plain decoding of your prompt, measured right after your run{so_far}: {self.tokens} tokens, "
                  "decoded and timed on its own, as a round of the race times each method")
        same, along = None, None
        if final:
            same = [t for e in self.events for t in e.new_tokens] == [t for e in events for t in e.new_tokens]
        else:  # the run over the same stretch: its first steps up to plain decoding's token count so far
            reached = next((e for e in events if e.total_tokens >= self.tokens), events[-1] if events else None)
            if reached is not None and reached.elapsed_s > 0:
                along = reached.total_tokens / reached.elapsed_s
        return Baseline(rates.tokens_per_s, ms_per_step(self.events), source, same, final, along)


def where(engine: Engine) -> str:
    """Where the run decodes, in words: "runs on the CPU (AMD EPYC ...)" or "runs on NVIDIA H200 (cuda:0), ..."."""
    device = engine.model.device
    name = device_name(device)
    if device.type == "cpu":
        return f"runs on the CPU ({name}{', torch backend' if engine.backend_name == 'torch' else ''})"
    graphs = ", one captured CUDA graph a step" if getattr(engine.backend, "capture", False) else ""
    return f"runs on {name} ({device}{graphs})"


class LiveRun(_ModelRun):
    """One live run of Token Recycling on the session's own matrix, step by step."""

    record: LiveRecord | None = None

    @property
    def note(self) -> str:
        """What the run drafts with: the prompt's cut, the mode, the tree, the matrix."""
        quiet = self.quiet.describe() if self.quiet else ""
        return "; ".join(filter(None, [self.about_setup, f"adjacency matrix: {self.about_matrix}",
                                       quiet]))

    def snapshots(self, frame_due: Callable[[], bool] = lambda: True) -> Iterator[Snapshot]:
        """Decode, one snapshot after each step at which ``frame_due()`` is true (by default every step); then,
        unless the method is plain decoding, measure plain decoding of the same prompt to the same token count
        (``PlainAlongside``), one snapshot (``measuring_plain``) after each of its steps at which ``frame_due()`` is
        true; the final snapshot last (finished or stopped). The record in ``session.live`` grows with the run; the
        history gets its line at the end, finished or stopped."""
        s = self.settings
        teaches = s.hot_start and METHODS[s.method].uses_matrix  # the others leave the matrix as it was
        self.record = self.session.begin_live(s.model_id, s.mode, tree_for(s.method, s.tree), teaches, self.hidden,
                                              s.prompt.text)
        events, rates, seconds = self.record.events, Rates(), 0.0
        steps = self.engine.stream(self.ids, s.max_new_tokens, method=s.method, sampling=s.sampling)
        while not self.stopped:
            started = time.perf_counter()
            try:
                with collector_paused():  # the collections the page's drawing causes run between steps, untimed
                    event = next(steps, None)
            except ValueError as e:  # e.g. a prompt longer than the model's context
                raise InputError(str(e)) from None
            seconds += time.perf_counter() - started
            if event is None:
                break
            event.elapsed_s = seconds  # the time spent decoding: not drawing
            events.append(event)
            self._name_tokens(event)
            rates = Rates(event.total_tokens, event.total_steps, seconds)
            if event.finished:
                break
            if frame_due():
                yield Snapshot(events, rates, self.note)
        plain = None
        if s.method != "plain" and events and not self.stopped:
            plain = PlainAlongside(self.engine, self.ids, s.max_new_tokens, s.sampling)
            yield Snapshot(events, rates, self.note, measuring_plain=True)
            while not self.stopped and plain.step(events[-1].total_tokens):
                if frame_due():
                    yield Snapshot(events, rates, self.note, baseline=plain.baseline(events), measuring_plain=True)
        if teaches:
            self.session.keep_matrix(self.matrix)  # what the run taught, as the rows it changed
        if events:
            what = ("live" if s.method == "tr" else f"live: {s.method}") + (" (stopped)" if self.stopped else "")
            tr = METHODS[s.method].uses_matrix  # the others draft without the tree and the matrix: "-", as races
            self.session.record(what, tree_for(s.method, s.tree) if tr else "-", s.top_k if tr else "-",
                                self.start if tr else "-", rates)
        if events and not self.stopped:
            self.record.baseline = (plain.baseline(events, final=True) if plain else
                                    Baseline(rates.tokens_per_s, ms_per_step(events), "this run itself is plain "
                                             "decoding", True))
        self.record.drafted_nothing = self.drafted_nothing
        self.record.summary = run_summary(s.method, tree_for(s.method, s.tree), events, rates, self.record.baseline,
                                          self.matrix_history, self.machine_profile() if events else None)
        try:
            yield Snapshot(events, rates, self.note, done=True, stopped=self.stopped, baseline=self.record.baseline,
                           drafted_nothing=self.drafted_nothing)
        finally:  # shown (or the generator closed): the session keeps the record compressed
            self.record.pack()

    @property
    def drafted_nothing(self) -> bool:
        """Whether a matrix method on the auto tree drafted nothing at any step: the tree fitted to this machine was
        empty (verifying drafts would cost more than they save), so the run was plain decoding."""
        s, events = self.settings, self.record.events if self.record else []
        return (bool(events) and METHODS[s.method].uses_matrix and tree_for(s.method, s.tree) == AUTO
                and all(len(e.tree_tokens) == 1 for e in events))

    def _name_tokens(self, event: StepEvent) -> None:
        """Add the text of the tokens this step names that the record has not named yet (outside the timed
        decoding)."""
        names = self.record.names
        names.update(zip(event.tree_tokens, event.tree_text))
        missing = [t for t in token_ids_named([event]) if t not in names]
        if missing:
            tokenizer = self.engine.tokenizer  # a token that is not whole UTF-8 is named by its bytes
            names.update((t, shown_piece(tokenizer, t, text))
                         for t, text in zip(missing, tokenizer.batch_decode([[t] for t in missing])))

    def token_text(self, token: int) -> str:
        return self.record.token_text(token)


class TraceReplay(Stoppable):
    """A run recorded elsewhere, from the trace file ``python -m tr_core --trace`` wrote there, replayed step by step
    at its recorded pace (sped up to last at most ``REPLAY_MAX_S``) with the speeds measured there: nothing is
    decoded here. Its record becomes the session's latest run (the step slider, Play and ``/trace`` read it)."""

    def __init__(self, session: Session, path):
        try:
            self.events, self.meta = trace_file.read(path)
        except (trace_file.TraceFileError, OSError) as e:
            raise InputError(str(e)) from None
        self.session, m = session, self.meta
        self.where = f"{m.get('machine', 'an unnamed machine')}" + (f", {m['threads']} threads" if "threads" in m
                                                                   else "")
        self.hidden = tuple(t for t in m.get("special_tokens", []) if isinstance(t, str))
        self.record: LiveRecord | None = None

    @property
    def note(self) -> str:
        m = self.meta
        settings = ", ".join(f"{k} {m[k]}" for k in ("method", "tree", "format", "sampling") if m.get(k))
        when = f", {m['recorded']}" if m.get("recorded") else ""
        return (f"replaying a run recorded on {self.where}{when} ({m.get('model', 'model not named')}; "
                f"{settings or 'settings not recorded'}): every speed shown is that machine's, as measured there")

    def snapshots(self) -> Iterator[Snapshot]:
        m, events = self.meta, self.events
        method = m.get("method") or events[0].method
        self.record = self.session.begin_live(m.get("model", "recorded"), m.get("mode", "?"), events[0].tree_name,
                                              False, self.hidden)
        self.record.names.update(token_text_map(events))
        total = sum(e.forward_ms + e.overhead_ms for e in events) / 1e3
        pace = min(1.0, REPLAY_MAX_S / total) if total > 0 else 0.0
        for event in events:
            if self.stopped:
                break
            time.sleep((event.forward_ms + event.overhead_ms) / 1e3 * pace)
            self.record.events.append(event)
            yield Snapshot(self.record.events, event.rates, self.note)
        shown = self.record.events
        rates = shown[-1].rates if shown else Rates()
        baseline = None
        if isinstance(m.get("plain_tokens_per_s"), (int, float)) and not self.stopped:
            baseline = Baseline(m["plain_tokens_per_s"], m.get("plain_ms_per_step", 0.0), f"plain decoding measured "
                                f"on {self.where}, to the same length, when the trace was recorded",
                                m.get("identical_to_plain"))
        self.record.baseline = baseline
        self.record.summary = {**run_summary(method, events[0].tree_name, shown, rates, baseline,
                                             f"as recorded on {self.where}"), "recorded_on": self.where}
        self.session.record(f"replay: {method} (recorded elsewhere)", events[0].tree_name, "-", "recorded", rates)
        try:
            yield Snapshot(shown, rates, self.note, done=True, stopped=self.stopped, baseline=baseline)
        finally:
            self.record.pack()

    def token_text(self, token: int) -> str:
        return self.record.token_text(token)


@dataclass(frozen=True)
class RaceProgress:
    """Where a race stands: a status line and each method's latest measured run (``None``: not yet); once done,
    every method's runs of every round (``rounds``) and ``runs`` its median round's."""

    status: str
    runs: dict[str, RaceRun | None]
    done: bool = False
    stopped: bool = False
    rounds: dict[str, list[RaceRun]] | None = None


def slim(run: RaceRun) -> RaceRun:
    """A race run with what the race's table and summary read (tokens, times, tree sizes) and without the rest of
    its events (the matrix rows each step rewrote, the tree's text): a round other than the median one."""
    return RaceRun(run.method, [replace(e, rows_updated=[], tree_text=[], predicted=[], draft_probs=[],
                                       budget_estimates={}, tree_ranks=[], tree_sources=[]) for e in run.events])


def round_order(methods: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The order the methods run in, in round ``round_index`` (from 0): rotated by one each round, so that no method
    is always first on a cold CPU, or always after the same one.

    >>> [round_order(("plain", "pld", "tr"), r) for r in range(3)]
    [('plain', 'pld', 'tr'), ('pld', 'tr', 'plain'), ('tr', 'plain', 'pld')]
    """
    shift = round_index % len(methods)
    return methods[shift:] + methods[:shift]


class Race(_ModelRun):
    """Plain decoding and the picked methods measured in ``rounds`` rounds: each round runs every method once, one
    after another (``round_order``), each alone on the CPU. Every run of a matrix method starts from its own fresh
    copy of the race's matrix (``Settings.race_matrix``: the shipped hot start by default, else the session's):
    measuring does not teach it, no method starts from what another taught, and no
    round from what an earlier round taught. What does carry over is what the engine learns about sizing trees on
    this machine (measured step times), as between live runs. The record goes to ``session.race``."""

    def __init__(self, session: Session, models: ModelCache, settings: Settings, rounds: int = RACE_ROUNDS):
        super().__init__(session, models, settings)
        self.rounds = rounds

    @property
    def methods(self) -> tuple[str, ...]:
        return ("plain",) + self.settings.race_methods  # checked: never plain again

    def _matrix(self, engine: Engine) -> tuple[AdjacencyMatrix, str]:
        """The matrix every method starts from, in every round (each run on its own copy): by default the shipped
        hot start, the same whatever this session ran before; with ``race_matrix="session"``, the session's."""
        s = self.settings
        if s.race_matrix == "session" or not s.hot_start:
            return self.session.matrix_for(engine, s.model_id, s.hot_start)  # a copy: measuring does not teach it
        base, about = shared_start(engine, s.model_id)
        return base.clone(), about

    def prepare(self) -> None:
        super().prepare()
        s = self.settings
        if s.race_matrix == "shipped" and s.hot_start:
            self.start = "shipped"
            self.matrix_history = ("the same matrix for every method, whatever your runs taught yours: "
                                   f"{self.about_matrix}")
        else:
            self.matrix_history = f"a copy of your session's matrix: {self.matrix_history}"
        self.engines = {m: self._configured(m, tree_for(m, s.tree)).with_matrix(self.matrix.clone())
                        for m in self.methods}

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _engine(self, method: str) -> Engine:
        """``method``'s engine for one run: a matrix method's on a fresh copy of the race's matrix."""
        engine = self.engines[method]
        return engine.with_matrix(self.matrix.clone()) if METHODS[method].uses_matrix else engine

    def progress(self) -> Iterator[RaceProgress]:
        s, latest = self.settings, dict.fromkeys(self.methods)
        rounds: dict[str, list[RaceRun]] = {m: [] for m in self.methods}
        about_prompt = f" ({self.about_prompt})" if self.about_prompt else ""
        self.session.race = None  # the replay never shows an older race as this one
        yield RaceProgress(f"Warming up (one token, not measured){about_prompt}…", latest)
        self.engine.generate(self.ids, 1, method="plain")
        total, done = self.rounds * len(self.methods), 0
        for r in range(self.rounds):
            for method in round_order(self.methods, r):
                done += 1
                yield RaceProgress(f"Round {r + 1} of {self.rounds}, run {done} of {total}: "
                                   f"{method_label(method)}, alone on the CPU{about_prompt}…", latest)
                events, stopped = [], False
                # the collector paused through the run (as through Live's steps): a collection of the app's objects
                # would be billed to whichever method it fell in; the process's collections run between runs
                with collector_paused():
                    for event in self._engine(method).stream(self.ids, s.max_new_tokens, method=method,
                                                            sampling=s.sampling):
                        events.append(event)  # nothing else between steps: the run's clock measures decoding alone
                        if self.stopped:
                            stopped = True
                            break
                if stopped:
                    yield RaceProgress("Stopped.", latest, done=True, stopped=True)
                    return
                rounds[method].append(RaceRun(method, events))
                latest[method] = rounds[method][-1]
        runs = {m: median_run(rounds[m]) for m in self.methods}
        # the other rounds are kept for their figures (time, tokens, steps), not for their trees and matrix rows
        rounds = {m: [r if r is runs[m] else slim(r) for r in rs] for m, rs in rounds.items()}
        for method, run in runs.items():
            tr = METHODS[method].uses_matrix
            self.session.record(f"race: {method}", tree_for(method, s.tree) if tr else "-", s.top_k if tr else "-",
                                self.start if tr else "-", run.rates)
        self.session.race = RaceRecord(runs, s.tree, self.about_setup, rounds, self.hidden, self.matrix_history)
        yield RaceProgress(f"Measured{about_prompt}.", runs, done=True, rounds=rounds)
