"""Token Recycling, live: watch the draft tree and the adjacency matrix at every step, then race the decoders.

    python app.py                      # http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT to change)
    python app.py --allow-local-models # the Model box may also name a folder on this machine

This file lays out the page and wires tr_core's step events into visualize's figures (and ui's HTML); it holds no
algorithm. The model loads once per process, right after the page is served; each user's adjacency matrix and run
history live in their session (gr.State); all model work goes through one queue slot: one decoding already uses
every core.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import time
from contextlib import contextmanager

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from ui.gpu import live_seconds, on_gpu, race_seconds  # noqa: E402  (first: ZeroGPU asks for spaces before torch)

# isort: split
import gradio as gr  # noqa: E402

from tr_core.backend import MODES, every_mode_at_once  # noqa: E402
from tr_core.events import Rates  # noqa: E402
from tr_core.models import ModelLoadError  # noqa: E402
from tr_core.spec_bench import load_questions, stratified  # noqa: E402
from ui.errors import as_user_error, user_errors  # noqa: E402
from ui.explain import EXPLAIN_CSS  # noqa: E402
from ui.explain import build_tab as explain_tab
from ui.frames import (  # noqa: E402
    AFTER_LIVE_OUTPUTS,
    LIVE_OUTPUTS,
    RACE_OUTPUTS,
    REPLAY_OUTPUTS,
    RESET_OUTPUTS,
    STEP_OUTPUTS,
    after_live,
    live_frame,
    placeholder,
    race_chart,
    race_frame,
    step_slider,
    step_view,
)
from ui.gradio_fix import (  # noqa: E402
    CopiedAsItself,
    drop_copies,
    forget_session,
    keep_no_deep_link_state,
    limit_malloc_arenas,
    release_freed_memory,
)
from ui.inputs import (  # noqa: E402
    MAX_NEW_TOKENS,
    SAMPLE_TOP_K,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    InputError,
    check_model_id,
    check_step,
)
from ui.models import ModelCache, model_name  # noqa: E402
from ui.page import (  # noqa: E402
    BUDGET_PLACEHOLDER,
    CLAMP_NOTES_JS,
    CSS,
    INTRO,
    MATRIX_PLACEHOLDER,
    NARROW_PX,
    PROJECTION_PLACEHOLDER,
    RACE_INTRO,
    RACE_PLACEHOLDER,
    STEPS_PLACEHOLDER,
    TREE_PLACEHOLDER,
    WATCH_TREE,
)
from ui.records import race_summary  # noqa: E402
from ui.render import (  # noqa: E402
    ANSWER_LEGEND,
    answer_html,
    counters_html,
    history_html,
    lanes_html,
    notice_html,
    race_verdict,
)
from ui.run import RACE_METHODS, RACE_ROUNDS, Every, LiveRun, Race, Stoppable, TraceReplay  # noqa: E402
from ui.session import Session  # noqa: E402
from ui.settings import (  # noqa: E402
    DEFAULT_RACE,
    RACE_CHOICES,
    RACE_MATRICES,
    Settings,
    method_choices,
    methods_help,
    tree_choices,
    tree_picker_note,
)

MODEL_CONCURRENCY = 1  # one decoding at a time: torch already spreads one over every core
# Requests waiting for a worker, all users together; one more is refused at once with "the queue is full". At about
# 2-10 s per run on a small CPU, the last of 32 waits a few minutes.
QUEUE_MAX_SIZE = 32
# Sessions whose state (adjacency matrix, latest run, race) the server keeps, least recently used dropped first: a
# dropped user's next run starts again from the shipped hot start. The embedded model's matrix alone is 1.5 MB.
SESSIONS_KEPT = 500
# While decoding, the page updates at most every FRAME_EVERY_S (steps in between are not drawn: frames are dropped,
# never queued), the answer, the counters and the figures of one step together, so the tree shown is the counters'
# step; then plain decoding of the same prompt is measured for the speedup, its counters at the same cadence. After
# each frame the run waits, untimed, for the machine's other processes (a browser drawing the page on this machine) to
# be quiet again (ui.quiet) before it times its next step. Why plain decoding after the run: ui.run.PlainAlongside.
FRAME_EVERY_S = 0.25
REPLAY_FRAME_S = 0.1
PLAY_EVERY_S = 0.8
DEFAULT_PROMPT = "Explain how a bicycle works, in a few sentences."
# A tree worth watching: the small template branches at every level, and the status line says what a tree of its
# size is predicted to run at here against the size that pays most on this machine (tree "auto", fitted by
# measurement; on a small CPU often one or two nodes, a tree too small to watch). README and page agree.
DEFAULT_TREE = "small"
# exact: fp32; fast: a separate copy of the model, loaded on first use, in the half-precision format measured fastest
# here among the row-invariant ones (tr_core.speed.layouts); in both every method's output equals plain decoding's in
# that mode, token for token (tr_core/speed/attention.py); the status says which format and whether this CPU allowed
# invariance
MODE_LABELS = {"exact": "exact (fp32)", "fast": "fast (half precision, the format measured fastest here)"}
SHARED = ("prompt", "tree", "max_new", "top_k", "mode", "hot", "model_id", "temperature", "top_p", "sample_top_k",
          "seed")  # a setting in both tabs, kept alike

TITLE = "# ♻️ Token Recycling, live"
SUMMARY = ("Speculative decoding with no draft model: each forward pass checks a tree of guesses recycled from earlier "
           "passes, and the answer stays exactly plain decoding's (greedy, or sampled with the same seed). **Live** "
           "decodes your prompt step by step, **Race** measures the speedup on this machine, **How it works** walks "
           "through the method in nine pages.")
RACE_ROUNDS_NOTE = (f"Each method runs **{RACE_ROUNDS} times, interleaved**: a round runs every method once, in an "
                    "order rotated each round, and the table gives the median with its range (min–max). Every run of "
                    "a matrix method starts from a fresh copy of the same matrix: by default the shipped hot start "
                    "(whatever your live runs taught yours), or, if you pick it, your session's matrix. Nothing a "
                    "run teaches carries over to another run or round; only what the app learns about sizing trees "
                    "on this machine (measured step times) carries over, as between your live runs. The replay shows "
                    "each method's median round.")
APP_CSS = """
.tr-notice { font-size: 15px; line-height: 1.5; padding: 10px 14px; border-radius: 6px; margin: 4px 0;
             color: var(--body-text-color); }
.tr-notice.tr-error { border-left: 6px solid #D55E00; background: rgba(213, 94, 0, 0.10); }
.tr-notice.tr-callout { border-left: 6px solid #E69F00; background: rgba(230, 159, 0, 0.16); font-weight: 500; }
#race-status p { font-size: 17px; font-weight: 600; line-height: 1.5; }
.tr-counters { grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)) !important; }
.tr-stat { flex-direction: column; align-items: flex-start !important; gap: 0 !important; }
.tr-baseline { font-size: 13px; margin-top: 6px; }
.tr-lanes { grid-template-columns: repeat(auto-fit, minmax(240px, 1fr)) !important; }
.tr-table-wrap { overflow-x: auto; }
#answer { scroll-margin-top: 8px; }  /* Run scrolls it into view (SHOW_ANSWER): its border not at the window's edge */
.tr-narrow-only { display: none; }
@media (max-width: 640px) {
  .tr-table .tr-minor { display: none; }  /* a phone's width holds the columns that matter, none cut or scrolled */
  .tr-narrow-only { display: inline; }
  .js-plotly-plot .modebar-container { display: none !important; }  /* on a phone it covered the figures' titles */
  #intro h1 { font-size: 22px; margin-bottom: 4px; }
  #intro p { font-size: 13px; }
  .tr-stat { padding: 2px 8px; }
  .tr-stat b { font-size: 18px; }
  .tr-wide-only { display: none; }
  .tr-table { font-size: 12px; }
  /* words wrap whole (a word broken mid-way, "identi-cal", read badly); the columns still fit 390 px */
  .tr-table th, .tr-table td { padding: 3px 2px; overflow-wrap: normal; }
}
"""


def _shown_errors(stream, failed):
    """``stream``'s updates; a failure ends it with ``failed(message)`` (the updates that show the message in the
    page, in plain sight: no toast or error badge over it) and, for an API caller, the same message as the error."""
    try:
        yield from stream
    except Exception as e:
        message = as_user_error(e).message
        yield failed(message)
        raise gr.Error(message, visible=False, print_exception=False) from None


class Handlers:
    """The app's event handlers: adapters that check a request's values (by name, as the page's controls and the
    API call them), ask a run (``ui.run``) for its next snapshot, throttle it and return the updates by output name
    (``ui.frames``; ``app.named`` maps the names to the page's components). Holds the models loaded in this process
    (shared by all users) and, per browser session, what its Stop ends; everything of one user lives in their
    ``Session``. The events take raw values (``preprocess=False``); every failure ends as one message in the page
    (``_shown_errors``) and, for an API caller, as the error (``ui.errors``). ``trees`` are the draft trees a user
    may pick; ``allow_local_models`` lets the Model box name a folder on the server."""

    def __init__(self, models: ModelCache, trees: list[str], allow_local_models: bool = False):
        self.models, self.trees, self.allow_local_models = models, trees, allow_local_models
        self.running: dict[str, Stoppable] = {}  # browser session -> its run, race or replay in progress
        self.page: gr.Blocks | None = None  # the page these handlers serve (``build_app``)

    def _settings(self, values: dict) -> Settings:
        return Settings.check(**values, trees=self.trees, allow_local_models=self.allow_local_models)

    @contextmanager
    def _stoppable(self, request: gr.Request, run: Stoppable):
        """While ``run`` goes on, Stop from the same browser session ends it. Before and after it, the component
        copies that runs leave in the session's gradio state go (``ui.gradio_fix``): after it, those of the run's
        last frame (gradio has handled it when the generator resumes), so that an idle session keeps none, and the
        memory the run freed goes back to the system (glibc's heap otherwise keeps tens of MB of it, more or less
        from one run to the next)."""
        if self.page is not None:
            drop_copies(self.page, request.session_hash)
        if getattr(run, "session", None) is not None:
            run.session.session_hash = request.session_hash  # to forget gradio's state of it when it expires
        self.running[request.session_hash] = run
        try:
            yield run
        finally:
            if self.running.get(request.session_hash) is run:
                del self.running[request.session_hash]
            if self.page is not None:
                drop_copies(self.page, request.session_hash)
            release_freed_memory()  # the run's freed memory back to the system: 2.5 ms median here (max 20)

    def session_expired(self, session: Session) -> None:
        """A browser session closed and its ``Session`` expired: gradio's copy of its page goes too, and the freed
        memory back to the system (``ui.gradio_fix.forget_session``)."""
        if self.page is not None and session.session_hash:
            forget_session(self.page, session.session_hash)

    @user_errors
    @on_gpu(live_seconds)
    def live(self, session: Session, request: gr.Request = None, **values):
        """Decode with the method picked (Token Recycling by default), greedy or sampled as set, streaming the
        answer, the counters and the figures of the latest step at most every ``FRAME_EVERY_S`` (the steps in between
        are not drawn), then plain decoding of the same prompt measured for the speedup (``ui.run.PlainAlongside``),
        and the run's summary (JSON). After each frame the run waits, untimed, until the machine is quiet
        (``ui.quiet``)."""
        yield from _shown_errors(self._live(values, session, request), lambda message: dict(
            notice_html=notice_html(message), counters_html=counters_html(Rates(), "not run: see the message")))

    def _live(self, values: dict, session: Session, request: gr.Request):
        run = LiveRun(session, self.models, self._settings(values))
        yield dict(notice_html="", run_summary=None, counters_html=counters_html(
            Rates(), "loading the model (once per process and mode)…" if run.needs_loading else "setting up…"))
        run.prepare()
        yield dict(answer_html=answer_html([], placeholder="prefill: reading the prompt…"),
                   counters_html=counters_html(Rates(), "running", run.note),
                   budget_chart=placeholder(BUDGET_PLACEHOLDER))
        due = Every(FRAME_EVERY_S)
        with self._stoppable(request, run):
            for snap in run.snapshots(due):  # a frame when due, while the run decodes and while plain decoding does
                yield live_frame(snap, run, True, session)
                if not snap.done:  # the last frame: nothing more is timed, the run ends at once
                    run.settle()  # the frame is on its way: the next step is timed once the machine is quiet
                    due.restart()  # the next frame after FRAME_EVERY_S of decoding, not of waiting

    @user_errors
    def replay_trace(self, trace_file, session: Session, request: gr.Request = None):
        """Replay a run recorded elsewhere (the trace file ``python -m tr_core --trace FILE`` wrote there) with every
        figure of a live run, at its recorded pace and with the speeds measured there; nothing is decoded here."""
        yield from _shown_errors(self._replay_trace(trace_file, session, request), lambda message: dict(
            notice_html=notice_html(message), counters_html=counters_html(Rates(), "not replayed: see the message")))

    def _replay_trace(self, path, session: Session, request: gr.Request):
        if not path:
            raise InputError("Pick a trace file first: the JSON file that `python -m tr_core --trace FILE` writes.")
        replay = TraceReplay(session, path)
        yield dict(notice_html="", run_summary=None, counters_html=counters_html(Rates(), "replaying", replay.note))
        due = Every(FRAME_EVERY_S)
        with self._stoppable(request, replay):
            for snap in replay.snapshots():
                if snap.done or due():
                    yield live_frame(snap, replay, True, session)

    @staticmethod
    def after_live(session: Session) -> dict:
        """The step slider and the "watch a tree" button, once a run is over."""
        return after_live(session)

    def stop(self, request: gr.Request) -> None:
        """Stop pressed: this browser session's run, race or replay ends after its current step."""
        running = self.running.get(request.session_hash)
        if running is not None:
            running.stop()

    @user_errors
    def view_step(self, index: float, session: Session) -> dict:
        """The answer with step ``index`` outlined, and that step's tree, matrix rows and event (JSON): from the
        session's record of its latest run, never from a model."""
        live = session.live
        if live is None or not live.events:
            return dict(answer_html=gr.skip())  # nothing to show: every output stays as it is
        return step_view(live, check_step(index, len(live.events)), session.narrow)

    @user_errors
    def play(self, index: float, session: Session) -> dict:
        """Start the step player, from the first step when the slider stands at the last."""
        n = len(session.live.events) if session.live else 0
        if n < 2:
            return dict(timer=gr.Timer(active=False))
        start = 0 if int(index) >= n - 1 else int(index)
        return dict(timer=gr.Timer(active=True), step=step_slider(n, start), **self.view_step(start, session))

    @user_errors
    def tick(self, index: float, session: Session) -> dict:
        n = len(session.live.events) if session.live else 0
        if int(index) + 1 >= n:
            return dict(timer=gr.Timer(active=False))
        return dict(timer=gr.Timer(), step=step_slider(n, int(index) + 1), **self.view_step(int(index) + 1, session))

    def reset(self) -> dict:
        """A fresh session: the matrix goes back to the shipped hot start, the history is cleared."""
        session = Session()
        return dict(session=session, counters_html=counters_html(Rates()), run_summary=None,
                    answer_html=answer_html([], placeholder="Reset: your matrix starts again from the shipped hot "
                                                            "start."),
                    draft_tree=placeholder(TREE_PLACEHOLDER), matrix_rows=placeholder(MATRIX_PLACEHOLDER),
                    budget_chart=placeholder(BUDGET_PLACEHOLDER), history_html=history_html(session.history),
                    notice_html="", step_chart=placeholder(STEPS_PLACEHOLDER),
                    projection_chart=placeholder(PROJECTION_PLACEHOLDER))

    @user_errors
    @on_gpu(race_seconds)
    def race(self, session: Session, request: gr.Request = None, **values):
        """Measure plain decoding and the picked methods in rounds, each run alone on the CPU; the verdict, the
        table and the race's summary (JSON) come out here, the side-by-side replay follows in ``replay`` (which
        needs no model)."""
        yield from _shown_errors(self._race(values, session, request), lambda message: dict(
            race_status=f"Not run: {message}", race_summary=None))

    def _race(self, values: dict, session: Session, request: gr.Request):
        race = Race(session, self.models, self._settings(values))
        yield dict(race_status="Loading the model…" if race.needs_loading else "Setting up…", race_summary=None,
                   lanes_html=lanes_html(dict.fromkeys(race.methods), None, race.settings.tree), race_table_html="",
                   race_chart=placeholder(RACE_PLACEHOLDER), race_steps_chart=placeholder(STEPS_PLACEHOLDER),
                   race_projection_chart=placeholder(PROJECTION_PLACEHOLDER))
        race.prepare()
        with self._stoppable(request, race):
            for progress in race.progress():
                yield race_frame(progress, race, session)
                if not progress.done:
                    race.settle()  # the next method is timed once the page has drawn this frame

    @user_errors
    def replay(self, session: Session, request: gr.Request):
        """Each method's median round side by side, each step appearing when it finished in its own run; then the
        race's verdict again."""
        race = session.race
        if race is None:
            return
        end, t0 = max(run.elapsed_s for run in race.runs.values()), time.perf_counter()
        with self._stoppable(request, Stoppable()) as replay:
            while (t := time.perf_counter() - t0) < end and not replay.stopped:
                yield dict(race_status=f"Replaying each method's median round at its measured speed: {t:.1f} s of "
                                       f"{end:.1f} s", lanes_html=lanes_html(race.runs, t, race.tree, race.hidden),
                           race_chart=race_chart(race, t))
                time.sleep(REPLAY_FRAME_S)
        yield dict(race_status=race_verdict(race_summary(race.rounds)), race_chart=race_chart(race),
                   lanes_html=lanes_html(race.runs, None, race.tree, race.hidden))

    @user_errors
    def load_model(self, model_id: str, session: Session = None, mode: str = "exact"):
        """Load a model (a hub id, a local folder where allowed; empty: the embedded one) in ``mode`` (the tab's
        selected one) and say how it went, in the page, with the kernels of that mode; a model that does not load
        ends as an error for an API caller, and the session keeps the model it had (the page's Model box goes back
        to it)."""
        session = session if isinstance(session, Session) else Session()
        yield from _shown_errors(self._load(model_id, session, mode), lambda message: (
            f"**Not loaded.** {message} Runs keep {model_name(session.model_id)}."))

    def _load(self, model_id: str, session: Session, mode: str):
        model_id = check_model_id(model_id, self.allow_local_models)
        if mode not in MODES:
            raise InputError(f"The mode must be one of {', '.join(MODES)}; got {str(mode)[:40]!r}.")
        if not self.models.loaded(model_id, mode):
            yield f"Loading {model_name(model_id)}…"
        described = self.models.describe(model_id, mode)
        session.model_id = model_id
        yield f"**Loaded** {described}."

    def default_mode(self) -> tuple:
        """Both tabs' mode, as a page opens: the one measured faster here (``ModelCache.measure_modes``), said so."""
        mode, why = self.models.default_mode()
        return tuple(gr.Radio(value=mode, info=mode_info(mode, why)) for _ in range(2))

    @staticmethod
    def kept_model(session: Session) -> str:
        """The Model box after a load or a run: the model the session last loaded or ran without a fault."""
        return session.model_id

    @staticmethod
    def viewport(narrow, session: Session) -> Session:
        """Remember whether the page is on a narrow screen, for the figures drawn from now on."""
        session.narrow = narrow is True
        return session

    @user_errors
    def trace(self, session: Session) -> dict:
        """This session's latest live run and race, every step event as plain data (as the command line's
        ``--trace`` writes them): built here from the session, never read from a file."""
        return session.trace()


def example_prompts() -> tuple[list[str], list[str]]:
    """One Spec-Bench question per category, and a short label for each: ``"qa: Who played anna in once…"``."""
    picks = stratified(load_questions(), 1)
    labels = [f"{q.category}: {q.prompt[:70]}{'…' if len(q.prompt) > 70 else ''}" for q in picks]
    return [q.prompt for q in picks], labels


def mode_info(mode: str, why: str) -> str | None:
    """The Mode control's line: which mode is the default here and why."""
    return f"default here: {mode}, {why}" if why else None


def mode_control(prefix: str, mode: tuple[str, str]) -> gr.Radio:
    """The Mode control, set to ``mode`` (``ModelCache.default_mode``: measured by an earlier start here, so that a
    Run clicked before the page's load event decodes in it; the load event sets it again once measured)."""
    return gr.Radio([(MODE_LABELS[m], m) for m in MODES], value=mode[0], info=mode_info(*mode),
                    label="Mode (every method alike)", elem_id=f"{prefix}mode")


def settings_panel(prefix: str, choices, example_labels: list[str], allow_local_models: bool,
                   mode: tuple[str, str] = ("exact", "")) -> dict:
    """The run's settings, as one tab shows them (``prefix`` tells its elements apart): the prompt and the tree in
    sight, the rest folded. Both tabs have one, kept alike. ``mode``: the default mode and why (``mode_control``)."""
    c = {}
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=300):
            c["prompt"] = gr.Textbox(DEFAULT_PROMPT, label="Prompt", lines=2, max_lines=8, elem_id=f"{prefix}prompt")
            c["example"] = gr.Dropdown([(label, i) for i, label in enumerate(example_labels)], value=None,
                                       label="…or take a Spec-Bench question (one per category)",
                                       elem_id=f"{prefix}example")
            with gr.Accordion("Sampling: greedy unless you set a temperature", open=False), \
                    gr.Row(elem_classes="tr-sampling"):
                c["temperature"] = gr.Slider(TEMPERATURE[0], TEMPERATURE[1], value=0.0, step=0.05,
                                             label="Temperature (0 = greedy)", elem_id=f"{prefix}temperature",
                                             min_width=260)
                c["top_p"] = gr.Slider(TOP_P[0], TOP_P[1], value=1.0, step=0.01, label="Top-p (1 = off)",
                                       elem_id=f"{prefix}top-p", min_width=260)
                c["sample_top_k"] = gr.Number(0, label="Top-k filter (0 = off; not the matrix's k)", precision=0,
                                              minimum=SAMPLE_TOP_K[0], maximum=SAMPLE_TOP_K[1],
                                              elem_id=f"{prefix}sample-top-k", min_width=160)
                c["seed"] = gr.Number(0, label="Seed", precision=0, minimum=SEED[0], maximum=SEED[1],
                                      elem_id=f"{prefix}seed", min_width=160)
        with gr.Column(scale=2, min_width=300):
            c["tree"] = gr.Dropdown(choices, value=DEFAULT_TREE, label="Draft tree", elem_id=f"{prefix}tree")
            c["max_new"] = gr.Slider(MAX_NEW_TOKENS[0], MAX_NEW_TOKENS[1], value=64, step=1, label="Max new tokens",
                                     elem_id=f"{prefix}max-new")
            with gr.Accordion("More settings: k, mode, hot start, model", open=False):
                c["top_k"] = gr.Slider(TOP_K[0], TOP_K[1], value=8, step=1, label="k: candidates per row",
                                       elem_id=f"{prefix}k")
                c["mode"] = mode_control(prefix, mode)
                c["hot"] = gr.Checkbox(True, label="Hot start: begin from the shipped matrix and keep what your runs "
                                       "teach it (off: an empty matrix every run)", elem_id=f"{prefix}hot")
                c["model_id"] = gr.Textbox("", label="Model: hub id" + (" or local folder" if allow_local_models
                                                                        else ""),
                                           placeholder="empty: the embedded SmolLM2-135M-Instruct (default)",
                                           elem_id=f"{prefix}model-id")
                c["load"] = gr.Button("Load model", size="sm", elem_id=f"{prefix}load")
                c["model_status"] = gr.Markdown("", label="model_status", elem_id=f"{prefix}model-status")
    return c


def live_tab(choices, example_labels: list[str], allow_local_models: bool, mode: tuple[str, str]) -> dict:
    """The Live tab's components, by name; an output's label is the name an API caller reads it by."""
    c = {"panel": settings_panel("", choices, example_labels, allow_local_models, mode)}
    with gr.Row():
        c["method"] = gr.Dropdown(method_choices(), value="tr", label="Method", elem_id="method", min_width=200,
                                  scale=2)
        c["run"] = gr.Button("Run", variant="primary", size="md", scale=2, elem_id="run", min_width=100)
        c["stop"] = gr.Button("Stop", size="md", scale=1, elem_id="stop", min_width=80)
    c["notice_html"] = gr.HTML("", label="notice_html", elem_id="notice")
    c["watch"] = gr.Button(f"Watch the {WATCH_TREE} tree anyway", variant="primary", visible=False, elem_id="watch")
    c["counters_html"] = gr.HTML(counters_html(Rates()), label="counters_html", elem_id="counters")
    with gr.Row(equal_height=False):
        with gr.Column(scale=5, min_width=320):
            gr.HTML(ANSWER_LEGEND)
            c["answer_html"] = gr.HTML(answer_html([], placeholder="The answer streams here, step by step."),
                                       label="answer_html", elem_id="answer")
            c["step"] = gr.Slider(0, 1, value=0, step=1, interactive=False, elem_id="step",
                                  label="Decoding step: after a run, drag to see any")
            with gr.Row():
                c["play"] = gr.Button("▶ Play the decoding steps", size="sm", elem_id="play", min_width=120)
                c["pause"] = gr.Button("❚❚ Pause", size="sm", elem_id="pause", min_width=80)
        with gr.Column(scale=7, min_width=320):
            c["draft_tree"] = gr.Plot(placeholder(TREE_PLACEHOLDER), label="draft_tree", show_label=False,
                                      elem_id="tree-plot")
    c["step_chart"] = gr.Plot(placeholder(STEPS_PLACEHOLDER), label="step_chart", show_label=False,
                              elem_id="step-plot")
    c["projection_chart"] = gr.Plot(placeholder(PROJECTION_PLACEHOLDER), label="projection_chart", show_label=False,
                                    elem_id="projection-plot")
    c["matrix_rows"] = gr.Plot(placeholder(MATRIX_PLACEHOLDER), label="matrix_rows", show_label=False,
                               elem_id="matrix-plot")
    c["budget_chart"] = gr.Plot(placeholder(BUDGET_PLACEHOLDER), label="budget_chart", show_label=False,
                                elem_id="budget-plot")
    with gr.Accordion("Your runs in this session", open=True):
        c["history_html"] = gr.HTML(history_html([]), label="history_html", elem_id="history")
        c["reset"] = gr.Button("Reset my matrix and history", size="sm", elem_id="reset")
    return {**c, **replay_panel(), **json_panel()}


def replay_panel() -> dict:
    """A run recorded on another machine (a GPU, a larger model), replayed here with its own speeds."""
    c = {}
    with gr.Accordion("Replay a run recorded on another machine (a GPU, a larger model)", open=False):
        gr.Markdown("There: `python -m tr_core --method tr --prompt \"...\" --trace run.json` (add `--model ID` for "
                    "another model). Here: pick `run.json` and replay it: the answer, the trees, the matrix rows and "
                    "the step times as recorded, with that machine's speeds (and plain decoding's, measured there).")
        with gr.Row():
            c["trace_file"] = gr.File(label="trace_file", file_types=[".json"], type="filepath",
                                      elem_id="trace-file", scale=3)
            c["replay_trace"] = gr.Button("Replay the trace", elem_id="replay-trace", scale=1)
    return c


def json_panel() -> dict:
    """What the Live tab measured, as JSON (as the API returns it): the run's summary, a step's event, the trace."""
    c = {}
    with gr.Accordion("This run's figures and step events, as JSON (what the API returns)", open=False):
        c["run_summary"] = gr.JSON(label="run_summary", elem_id="run-summary")
        c["step_event"] = gr.JSON(label="step_event", elem_id="step-event")
        c["show_trace"] = gr.Button("Show the step events of your latest run and race (as --trace writes them)",
                                    size="sm", elem_id="show-trace")
        c["trace"] = gr.JSON(label="trace", elem_id="trace")
    return c


def race_tab(choices, example_labels: list[str], allow_local_models: bool, mode: tuple[str, str]) -> dict:
    """The Race tab's components, by name; an output's label is the name an API caller reads it by."""
    gr.Markdown(f"Plain decoding and the methods you pick, each run {RACE_ROUNDS} times, interleaved: the median "
                "speed with its range, every output checked against plain decoding's, and a verdict on why Token "
                "Recycling won or lost on this machine.")
    with gr.Accordion("How the race measures", open=False):
        gr.Markdown(RACE_INTRO + "\n\n" + RACE_ROUNDS_NOTE)
    c = {"panel": settings_panel("race-", choices, example_labels, allow_local_models, mode)}
    c["race_methods"] = gr.CheckboxGroup(method_choices(RACE_CHOICES), value=list(DEFAULT_RACE),
                                         label="Race against plain decoding", elem_id="race-methods")
    c["race_matrix"] = gr.Radio([(about, name) for name, about in RACE_MATRICES.items()], value="shipped",
                                label="Every matrix method starts from", elem_id="race-matrix")
    with gr.Accordion("What each method drafts from", open=False):
        gr.Markdown(methods_help())
    with gr.Row():
        c["run"] = gr.Button("Run the race", variant="primary", size="md", scale=2, elem_id="race-run")
        c["stop"] = gr.Button("Stop", size="md", scale=1, elem_id="race-stop")
    c["race_status"] = gr.Markdown(label="race_status", elem_id="race-status")
    c["race_table_html"] = gr.HTML(label="race_table_html", elem_id="race-table")
    c["race_chart"] = gr.Plot(placeholder(RACE_PLACEHOLDER), label="race_chart", show_label=False,
                              elem_id="race-plot")
    c["race_steps_chart"] = gr.Plot(placeholder(STEPS_PLACEHOLDER), label="race_steps_chart", show_label=False,
                                    elem_id="race-step-plot")
    c["race_projection_chart"] = gr.Plot(placeholder(PROJECTION_PLACEHOLDER), label="race_projection_chart",
                                         show_label=False, elem_id="race-projection-plot")
    c["lanes_html"] = gr.HTML(lanes_html(dict.fromkeys(RACE_METHODS), None), label="lanes_html", elem_id="lanes")
    with gr.Accordion("The race's figures, as JSON (what the API returns)", open=False):
        c["race_summary"] = gr.JSON(label="race_summary", elem_id="race-summary")
    return c


MODEL_WORK = dict(concurrency_limit=MODEL_CONCURRENCY, concurrency_id="model")
RAW = dict(preprocess=False)  # the handlers check every value themselves (ui.inputs), with clear messages
# The inputs of /live and /race, by the name each handler (and an API caller) gives them, in the API's order
SETTINGS = {"prompt": "prompt", "max_new_tokens": "max_new", "tree": "tree", "top_k": "top_k", "hot_start": "hot",
            "model_id": "model_id", "mode": "mode"}
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "sample_top_k": "sample_top_k", "seed": "seed"}


def named(fn, components: dict):
    """``fn`` (a handler, or a generator of updates) with its updates by name turned into updates by component, as
    gradio takes them; ``functools.wraps`` keeps the signature that names the API's parameters."""
    def by_component(update):
        assert update, "an update names at least one output (gradio reads an empty dict as one value)"
        return {components[name]: value for name, value in update.items()}

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args, **kwargs):
            for update in fn(*args, **kwargs):
                yield by_component(update)
        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return by_component(fn(*args, **kwargs))
    return call


def run_inputs(tab: dict, session: gr.State, *own: str) -> dict:
    """A run's inputs by name: the settings, the tab's own controls (``own``), the sampling, the session."""
    panel = tab["panel"]
    return {**{name: panel[key] for name, key in SETTINGS.items()}, **{name: tab[name] for name in own},
            **{name: panel[key] for name, key in SAMPLING.items()}, "session": session}


# On Run, the answer comes into view (below the settings on a laptop's screen): the counters at the top where the
# counters and the start of the answer fit the window, else the answer itself. On a narrow screen always the answer:
# there the counters stack and the status line under them wraps to a dozen lines once the run has finished, which
# pushed an answer scrolled into view with them below the window (run in the browser before the request: it hands
# the inputs on unchanged)
SHOW_ANSWER = """(...inputs) => { const c = document.getElementById('counters'), a = document.getElementById('answer');
  if (c && a) {
    const fits = window.innerWidth >= %d
                 && a.getBoundingClientRect().top - c.getBoundingClientRect().top + 160 < window.innerHeight;
    (fits ? c : a).scrollIntoView({behavior: 'instant', block: 'start'}); }
  return inputs; }""" % NARROW_PX


def tree_picker(method: str) -> gr.Dropdown:
    """Live's Draft tree picker for ``method``: on for Token Recycling, off with its reason for the others."""
    note = tree_picker_note(method)
    return gr.Dropdown(interactive=note is None, info=note or "")


def wire_live(h: Handlers, live: dict, racing: dict, out: dict, timer: gr.Timer) -> None:
    """The Live tab's events: run (and "watch the tree anyway"), stop, reset, the step slider and the player."""
    session, inputs = out["session"], run_inputs(live, out["session"], "method")
    outputs, after = [out[n] for n in LIVE_OUTPUTS], [out[n] for n in AFTER_LIVE_OUTPUTS]
    run = named(h.live, out)
    clicked = live["run"].click(run, inputs_kwargs=inputs, outputs=outputs, api_name="live", show_progress="hidden",
                                js=SHOW_ANSWER, **MODEL_WORK, **RAW)
    clicked.then(named(h.after_live, out), [session], after, api_visibility="private")
    clicked.failure(h.kept_model, [session], [live["panel"]["model_id"]], api_visibility="private")
    live["watch"].click(lambda: (WATCH_TREE, WATCH_TREE), None, [live["panel"]["tree"], racing["panel"]["tree"]],
                        api_visibility="private").then(
        run, inputs_kwargs=inputs, outputs=outputs, show_progress="hidden", api_visibility="private", **MODEL_WORK,
        **RAW).then(named(h.after_live, out), [session], after, api_visibility="private")
    # Stop bypasses the queue (from the page; gradio_client queues every call): it works however full the queue is
    live["stop"].click(h.stop, None, None, api_name="stop", queue=False)
    # a method that does not draft with the tree picked: the picker is off, and says why (no setting does nothing
    # silently)
    live["method"].change(tree_picker, live["method"], live["panel"]["tree"], api_visibility="private", queue=False)
    live["reset"].click(named(h.reset, out), None, [out[n] for n in RESET_OUTPUTS], api_name="reset").then(
        named(h.after_live, out), [session], after, api_visibility="private")
    figures = [out[n] for n in STEP_OUTPUTS]
    live["step"].input(named(h.view_step, out), [live["step"], session], figures, api_name="step",
                       trigger_mode="always_last", show_progress="hidden", **RAW)
    frame = [timer, live["step"]] + figures
    live["play"].click(named(h.play, out), [live["step"], session], frame, api_visibility="private",
                       show_progress="hidden")
    live["pause"].click(lambda: gr.Timer(active=False), None, timer, api_visibility="private")
    timer.tick(named(h.tick, out), [live["step"], session], frame, api_visibility="private", show_progress="hidden")
    live["show_trace"].click(h.trace, [session], [live["trace"]], api_name="trace")
    # preprocessed: gradio hands over only a file it received itself, never a path a caller names
    live["replay_trace"].click(named(h.replay_trace, out), inputs_kwargs={"trace_file": live["trace_file"],
                                                                          "session": session},
                               outputs=outputs, api_name="replay_trace", show_progress="hidden", **MODEL_WORK).then(
        named(h.after_live, out), [session], after, api_visibility="private")


def wire_race(h: Handlers, racing: dict, live: dict, out: dict) -> None:
    """The Race tab's events (the race, then its replay; stop) and both tabs' model loading."""
    inputs = run_inputs(racing, out["session"], "race_methods")
    inputs["race_matrix"] = racing["race_matrix"]  # last: the API's positional order stays as it was
    run = racing["run"].click(named(h.race, out), inputs_kwargs=inputs, outputs=[out[n] for n in RACE_OUTPUTS],
                              api_name="race", show_progress="hidden", **MODEL_WORK, **RAW)
    run.failure(h.kept_model, [out["session"]], [racing["panel"]["model_id"]], api_visibility="private")
    run.success(named(h.replay, out), [out["session"]], [out[n] for n in REPLAY_OUTPUTS], api_name="replay",
                show_progress="hidden")
    racing["stop"].click(h.stop, None, None, api_visibility="private", queue=False)
    for i, tab in enumerate((live, racing)):
        box = tab["panel"]["model_id"]
        loaded = tab["panel"]["load"].click(h.load_model, [box, out["session"], tab["panel"]["mode"]],
                                            [tab["panel"]["model_status"]], show_progress="hidden",
                                            **({"api_name": "load_model"} if i == 0 else
                                               {"api_visibility": "private"}), **MODEL_WORK, **RAW)
        # failed or not, the box names the model runs use now (a failed load leaves the one the session had, so
        # that Run works at once): .then does not run after a failure
        for after in (loaded.success, loaded.failure):
            after(h.kept_model, [out["session"]], [box], api_visibility="private")


def outputs_by_name(live: dict, racing: dict, session: gr.State, timer: gr.Timer) -> dict:
    """Every component a handler updates, by the name its updates use (``ui.frames``)."""
    names = set(LIVE_OUTPUTS + STEP_OUTPUTS + AFTER_LIVE_OUTPUTS) - {"session"}
    out = {n: live[n] for n in names}
    out.update({n: racing[n] for n in set(RACE_OUTPUTS + REPLAY_OUTPUTS) - {"session", "history_html"}})
    return {**out, "session": session, "timer": timer}


def wire_shared(live: dict, racing: dict, examples: list[str], live_tab_: gr.Tab, race_tab_: gr.Tab) -> None:
    """What a user set in one tab holds in the other (the tab opened takes the settings of the tab left), and a
    picked Spec-Bench question fills both prompts."""
    live_shared, race_shared = [live["panel"][n] for n in SHARED], [racing["panel"][n] for n in SHARED]
    race_tab_.select(lambda *values: values, live_shared, race_shared, queue=False, api_visibility="private")
    live_tab_.select(lambda *values: values, race_shared, live_shared, queue=False, api_visibility="private")
    prompts = [live["panel"]["prompt"], racing["panel"]["prompt"]]
    for panel in (live["panel"], racing["panel"]):
        panel["example"].input(lambda i: (gr.skip(),) * 2 if i is None else (examples[i],) * 2, panel["example"],
                               prompts, api_visibility="private")


def build_app(models: ModelCache | None = None, allow_local_models: bool = False) -> gr.Blocks:
    """The page. Nothing is loaded here: the page paints at once and the model loads on first use (or right after
    launch, see ``main``). ``allow_local_models``: the Model box may name a folder on the server."""
    examples, example_labels = example_prompts()
    choices = tree_choices()
    h = Handlers(models or ModelCache(), [name for _, name in choices], allow_local_models)
    with gr.Blocks(title="Token Recycling", analytics_enabled=False) as demo:
        session = gr.State(Session(), delete_callback=CopiedAsItself(h.session_expired))
        with gr.Column(elem_id="intro"):
            gr.Markdown(f"{TITLE}\n{SUMMARY}")
            with gr.Accordion("What Token Recycling does", open=False):
                gr.Markdown(INTRO.split("\n", 1)[1])
        # the browser says once whether its screen is narrow (a phone): every tab draws its figures for it
        narrow = gr.Checkbox(False, visible=False, elem_id="narrow")
        with gr.Tabs():
            with gr.Tab("Live", id="live", elem_id="live-tab") as live_tab_:
                live = live_tab(choices, example_labels, allow_local_models, h.models.default_mode())
            with gr.Tab("Race", id="race", elem_id="race-tab") as race_tab_:
                racing = race_tab(choices, example_labels, allow_local_models, h.models.default_mode())
            explain_tab(narrow=narrow)  # "How it works": replays a recorded trace, needs no model
        timer = gr.Timer(PLAY_EVERY_S, active=False)
        demo.load(None, None, narrow, js=CLAMP_NOTES_JS, api_visibility="private")  # and whether the screen is narrow
        narrow.change(h.viewport, [narrow, session], [session], api_visibility="private", queue=False)
        demo.load(h.default_mode, None, [live["panel"]["mode"], racing["panel"]["mode"]], api_visibility="private",
                  queue=False)
        wire_shared(live, racing, examples, live_tab_, race_tab_)
        out = outputs_by_name(live, racing, session, timer)
        wire_live(h, live, racing, out, timer)
        wire_race(h, racing, live, out)
    h.page = demo
    keep_no_deep_link_state(demo)  # its sessions keep no copy of the page for deep links (ui.gradio_fix)
    return demo


def launch(demo: gr.Blocks, queue_max_size: int = QUEUE_MAX_SIZE, **kwargs):
    """Queue (at most ``queue_max_size`` waiting requests) and launch with the page's CSS; host and port from
    GRADIO_SERVER_NAME / GRADIO_SERVER_PORT unless given. Never a public share link."""
    kwargs.setdefault("server_name", os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    kwargs.setdefault("server_port", int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    kwargs.setdefault("state_session_capacity", SESSIONS_KEPT)
    return demo.queue(default_concurrency_limit=4, max_size=queue_max_size).launch(
        share=False, css=CSS + APP_CSS + EXPLAIN_CSS, footer_links=["api"], **kwargs)

def preload(models: ModelCache) -> bool:
    """Load the default model in both modes, so that a Run only decodes, and measure which mode is faster here; False
    where it did not load. A failure is reported here and again, to the user, at their first run."""
    try:
        # both modes' kernels timed in one measurement, at the first load (exact: the page's mode until measured)
        with every_mode_at_once():
            models.get("")
            models.get("", "fast")
        mode, why = models.measure_modes()  # the page's default mode: the one measured faster here
        print(f"default mode: {mode} ({why})", flush=True)
        return True
    except ModelLoadError as e:
        print(f"the default model did not load: {e}", flush=True)
        return False


def prepare() -> int:
    """``python app.py --prepare``: what a first start measures on this machine (the embedded model's kernels and
    tree sizes in both modes, cached), with nothing served, so that no run competes with the measurement; then what
    was chosen. Before a class, or before serving on a new machine, so that the first start takes seconds; and for
    ``scripts/test.sh --fast``, whose tests run side by side and must not be what measures this machine. Exit
    status 1 where the model did not load."""
    models = ModelCache()
    if not preload(models):
        return 1
    print(models.describe("", "fast"), flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Token Recycling, live (http://127.0.0.1:7860).")
    parser.add_argument("--allow-local-models", action="store_true",
                        help="let the Model box load a folder on this machine (off: hub ids only; never on a "
                             "public server)")
    parser.add_argument("--prepare", action="store_true",
                        help="measure this machine for the embedded model in both modes as a first start does "
                             "(cached), say what was chosen, and exit without serving")
    args = parser.parse_args(argv)
    if args.prepare:
        sys.exit(prepare())
    limit_malloc_arenas()  # before gradio's threads start: less memory stranded between malloc arenas
    models = ModelCache()
    demo = build_app(models, allow_local_models=args.allow_local_models)
    launch(demo, prevent_thread_lock=True)  # the page is served (and paints) while the model loads
    # On the main thread: on a busy 2-core CPU, a model loaded on a short-lived thread decoded up to 10x slower
    # afterwards (torch's OpenMP threads), one loaded here did not.
    preload(models)
    demo.block_thread()


if __name__ == "__main__":
    main()
