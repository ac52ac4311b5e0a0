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
import os
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from tr_core.kernels import MODES, mode_dtype  # noqa: E402
from tr_core.models import ModelLoadError  # noqa: E402
from tr_core.spec_bench import load_questions, stratified  # noqa: E402
from ui.page import CSS, INTRO, MATRIX_PLACEHOLDER, RACE_INTRO, RACE_PLACEHOLDER, TREE_PLACEHOLDER  # noqa: E402
from tr_core.events import Rates  # noqa: E402
from ui.render import (ANSWER_LEGEND, RaceRun, answer_html, counters_html, finished_status,  # noqa: E402
                       history_html, lanes_html, method_label, race_table_html)
from ui.errors import user_errors  # noqa: E402
from ui.inputs import (MAX_NEW_TOKENS, TOP_K, InputError, check_choice, check_flag, check_model_id,  # noqa: E402
                       check_number, check_step, clean_prompt, prompt_ids)
from ui.session import ModelCache, Session, tree_choices, tree_note  # noqa: E402
from ui.explain import build_tab as explain_tab  # noqa: E402
from visualize import matrix_figure, race_figure, tree_figure  # noqa: E402

MODEL_CONCURRENCY = 1  # one decoding at a time: torch already spreads one over every core
# Requests waiting for a worker, all users together; one more is refused at once with "the queue is full". At about
# 2-10 s per run on a small CPU, the last of 32 waits a few minutes.
QUEUE_MAX_SIZE = 32
# Sessions whose state (adjacency matrix, latest run, race) the server keeps, least recently used dropped first: a
# dropped user's next run starts again from the shipped hot start. The embedded model's matrix alone is 1.5 MB.
SESSIONS_KEPT = 500
# While decoding, the answer updates at most every TEXT_EVERY_S (steps in between arrive together) and the figures every
# FIGURE_EVERY_S: a browser on a small CPU that draws more often falls behind the stream.
TEXT_EVERY_S = 0.1
FIGURE_EVERY_S = 0.75
REPLAY_FRAME_S = 0.1
PLAY_EVERY_S = 0.8
RACE_METHODS = ("plain", "pld", "tr")
DEFAULT_PROMPT = "Explain how a bicycle works, in a few sentences."
# A tree a user can watch at work. "auto", the fastest on this machine, can be empty on a small CPU, where verifying
# any draft costs more than it saves: the status line then says so.
DEFAULT_TREE = "small"
# exact: fp32, every output equals plain fp32 decoding up to float near-ties; fast: a separate copy of the model, loaded
# on first use, with its linear weights stored in fp16 (fp32 arithmetic) on x86 CPUs, bf16 elsewhere (tr_core.kernels)
MODE_LABELS = {"exact": "exact (fp32)", "fast": "fast (fp16 weights)"}
LIVE_OUTPUTS = ("answer", "counters", "tree_plot", "matrix_plot", "step", "session", "history")
RACE_OUTPUTS = ("race_status", "lanes", "table", "race_plot", "session", "history")


def _out(names: tuple[str, ...], **values) -> tuple:
    """One update per output in ``names`` order; an output not given stays as it is."""
    return tuple(values.get(name, gr.skip()) for name in names)


def _token_text(engine):
    return lambda token: engine.tokenizer.decode([token])


def placeholder(text: str) -> go.Figure:
    """An empty figure that says what will be drawn there."""
    fig = go.Figure().add_annotation(text=text, showarrow=False, font=dict(size=14, color="#777777"))
    return fig.update_layout(height=220, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white",
                             margin=dict(l=20, r=20, t=20, b=20))


def _step_slider(n: int, value: int | None = None) -> gr.Slider:
    return gr.Slider(minimum=0, maximum=max(1, n - 1), value=n - 1 if value is None else value, step=1,
                     interactive=n > 1, label=f"Step ({n} in this run): drag to see any step")


class Handlers:
    """The app's event handlers. Holds the models loaded in this process (shared by all users); everything of one
    user arrives and leaves through their ``Session``. Every value a request brings is checked by ``ui.inputs``
    (the events take raw values: ``preprocess=False``); every failure ends as one message (``ui.errors``).
    ``trees`` are the draft trees a user may pick; ``allow_local_models`` lets the Model box name a folder on the
    server (``python app.py --allow-local-models``)."""

    def __init__(self, models: ModelCache, trees: list[str], allow_local_models: bool = False):
        self.models, self.trees, self.allow_local_models = models, trees, allow_local_models

    def _checked(self, prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode) -> tuple:
        """A run's settings, each checked: ``InputError`` names the first that is refused."""
        return (clean_prompt(prompt), check_number(max_new_tokens, "Max new tokens", MAX_NEW_TOKENS),
                check_choice(tree, "draft tree", self.trees), check_number(top_k, "k (candidates per row)", TOP_K),
                check_flag(hot_start, "Hot start"), check_model_id(model_id, self.allow_local_models),
                check_choice(mode, "mode", list(MODES)))

    def _engine(self, session: Session, model_id: str, tree: str, top_k: int, hot_start: bool, mode: str,
                keep: bool = True):
        base = self.models.get(model_id, mode)
        try:
            return session.engine(base, model_id, tree, top_k, hot_start, keep)
        except ValueError as e:  # e.g. a tree that needs a larger k
            raise InputError(str(e)) from None

    @user_errors
    def live(self, prompt: str, max_new_tokens: int, tree: str, top_k: int, hot_start: bool, model_id: str,
             mode: str, session: Session):
        """Decode ``prompt`` with Token Recycling, streaming the answer every step and the figures every
        ``FIGURE_EVERY_S``."""
        prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode = self._checked(
            prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode)
        if not self.models.loaded(model_id, mode):
            yield _out(LIVE_OUTPUTS, counters=counters_html(Rates(), "loading the model (once per process and "
                                                                        "mode)…"))
        try:
            engine, note = self._engine(session, model_id, tree, top_k, hot_start, mode)
            ids, prompt_note = prompt_ids(engine.tokenizer, prompt, max_new_tokens, engine.context_length)
        except Exception:
            yield _out(LIVE_OUTPUTS, counters=counters_html(Rates(), "not run: see the message"))
            raise
        start = session.matrix_start(hot_start)
        session.begin_run(model_id, tree, top_k, start, hot_start)
        session.mode = mode
        events, text = session.events, _token_text(engine)
        session.note = "; ".join(filter(None, [prompt_note, f"mode {mode_dtype(mode)[1]}", tree_note(engine, tree),
                                               f"adjacency matrix: {note}"]))
        yield _out(LIVE_OUTPUTS, answer=answer_html([], placeholder="prefill: reading the prompt…"),
                   counters=counters_html(Rates(), "running", session.note), step=_step_slider(1, 0))
        steps, compute = engine.stream(ids, max_new_tokens), 0.0
        shown_at = drawn_at = time.perf_counter()
        while not session.stop_requested:
            t0 = time.perf_counter()
            try:
                event = next(steps, None)
            except ValueError as e:  # e.g. a prompt longer than the model's context
                raise gr.Error(str(e), print_exception=False) from None
            compute += time.perf_counter() - t0
            if event is None:
                break
            events.append(event)
            session.counters = Rates(event.total_tokens, event.total_steps, compute)
            now = time.perf_counter()
            if event.finished or (len(events) > 1 and now - shown_at < TEXT_EVERY_S):
                continue  # the last step is shown below; between updates, steps gather
            shown_at, figures = now, {}
            if now - drawn_at >= FIGURE_EVERY_S:
                figures = dict(tree_plot=tree_figure(event, text), matrix_plot=matrix_figure(event, text),
                               step=_step_slider(len(events)))
                drawn_at = time.perf_counter()
            yield _out(LIVE_OUTPUTS, answer=answer_html(events), session=session,
                       counters=counters_html(session.counters, "running", session.note), **figures)
        stopped = session.stop_requested
        session.end_run("live (stopped)" if stopped else "live")
        # The whole final state, so that the page and an API caller's result (the last update) agree.
        last = events[-1] if events else None
        figures = dict(tree_plot=tree_figure(last, text), matrix_plot=matrix_figure(last, text),
                       step=_step_slider(len(events))) if last else {}
        counters = counters_html(session.counters, finished_status(last, stopped), session.note)
        yield _out(LIVE_OUTPUTS, answer=answer_html(events), counters=counters, session=session,
                   history=history_html(session.history), **figures)

    def stop(self, session: Session) -> None:
        """Stop pressed: the run in progress ends after its current step (and a race or replay, too)."""
        session.stop_requested = True

    @user_errors
    def view_step(self, index: float, session: Session):
        """The answer with step ``index`` outlined, and that step's tree and matrix rows."""
        events = session.events
        if not events:
            return gr.skip(), gr.skip(), gr.skip()
        event = events[check_step(index, len(events))]
        text = _token_text(self.models.get(session.model_id, session.mode))
        return answer_html(events, current=event.step), tree_figure(event, text), matrix_figure(event, text)

    @user_errors
    def play(self, index: float, session: Session):
        """Start the step player, from the first step when the slider stands at the last."""
        n = len(session.events)
        if n < 2:
            return gr.Timer(active=False), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        start = 0 if int(index) >= n - 1 else int(index)
        return (gr.Timer(active=True), _step_slider(n, start), *self.view_step(start, session))

    @user_errors
    def tick(self, index: float, session: Session):
        n = len(session.events)
        if int(index) + 1 >= n:
            return gr.Timer(active=False), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return (gr.Timer(), _step_slider(n, int(index) + 1), *self.view_step(int(index) + 1, session))

    def reset(self):
        """A fresh session: the matrix goes back to the shipped hot start, the history is cleared."""
        session = Session()
        return (session, answer_html([], placeholder="Reset: your matrix starts again from the shipped hot start."),
                counters_html(Rates()), placeholder(TREE_PLACEHOLDER), placeholder(MATRIX_PLACEHOLDER),
                _step_slider(1, 0), history_html(session.history))

    @user_errors
    def race(self, prompt: str, max_new_tokens: int, tree: str, top_k: int, hot_start: bool, model_id: str,
             mode: str, session: Session):
        """Measure plain, Prompt Lookup and Token Recycling one after another, each alone on the CPU; the table
        comes out here, the side-by-side replay follows in ``replay`` (which needs no model)."""
        prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode = self._checked(
            prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode)
        runs: dict[str, RaceRun | None] = dict.fromkeys(RACE_METHODS)
        session.stop_requested, session.race = False, None
        yield _out(RACE_OUTPUTS, race_status="Loading the model…", lanes=lanes_html(runs, None, tree), table="",
                   race_plot=placeholder(RACE_PLACEHOLDER))
        try:  # on a copy of the user's matrix: measuring does not teach it
            engine, note = self._engine(session, model_id, tree, top_k, hot_start, mode, keep=False)
            ids, prompt_note = prompt_ids(engine.tokenizer, prompt, max_new_tokens, engine.context_length)
        except Exception:
            yield _out(RACE_OUTPUTS, race_status="Not run: see the message.")
            raise
        about_prompt = f" ({prompt_note})" if prompt_note else ""
        start = session.matrix_start(hot_start)
        yield _out(RACE_OUTPUTS, race_status=f"Warming up (one token, not measured){about_prompt}…")
        engine.generate(ids, 1, method="plain")
        for i, method in enumerate(RACE_METHODS, 1):
            yield _out(RACE_OUTPUTS, race_status=f"Measuring {i} of {len(RACE_METHODS)}: {method_label(method)}, "
                                                 f"alone on the CPU{about_prompt}…", lanes=lanes_html(runs, None, tree))
            events = []
            for event in engine.stream(ids, max_new_tokens, method=method):
                events.append(event)  # nothing else between steps: the run's clock measures decoding alone
                if session.stop_requested:
                    yield _out(RACE_OUTPUTS, race_status="Stopped.")
                    return
            runs[method] = RaceRun(method, events)
        for method, run in runs.items():
            tr = method == "tr"
            session.record(f"race: {method}", tree if tr else "-", top_k if tr else "-", start if tr else "-",
                           len(run.token_ids), len(run.events), run.tokens_per_s)
        session.race, session.race_tree = runs, tree
        session.race_note = f"mode {mode_dtype(mode)[1]}; {tree_note(engine, tree)}; adjacency matrix: {note}"
        yield _out(RACE_OUTPUTS, race_status=f"Measured{about_prompt}. Replaying side by side at the measured speed…",
                   table=race_table_html(runs, engine.tokenizer.decode, tree), session=session,
                   history=history_html(session.history))

    @user_errors
    def replay(self, session: Session):
        """The measured runs side by side, each step appearing when it finished in its own run."""
        runs, tree = session.race, session.race_tree
        if not runs:
            return
        end = max(run.elapsed_s for run in runs.values())
        t0 = time.perf_counter()
        while (t := time.perf_counter() - t0) < end and not session.stop_requested:
            yield (f"Replaying at the measured speed: {t:.1f} s of {end:.1f} s", lanes_html(runs, t, tree),
                   race_chart(runs, t))
            time.sleep(REPLAY_FRAME_S)
        done = "Replay stopped" if session.stop_requested else "Done"
        yield (f"{done}. Token Recycling's {session.race_note}.", lanes_html(runs, None, tree),
               race_chart(runs))

    @user_errors
    def load_model(self, model_id: str):
        """Load a model (a hub id, a local folder where allowed; empty: the embedded one) and say how it went: a
        model that does not load ends as an error, after the status line says so."""
        try:
            model_id = check_model_id(model_id, self.allow_local_models)
            name = model_id or "the embedded SmolLM2-135M-Instruct"
            if not self.models.loaded(model_id):
                yield f"Loading {name}…"
            engine = self.models.get(model_id)
        except (InputError, ModelLoadError) as e:
            yield f"**Not loaded.** {e}"
            raise
        seconds = self.models.load_seconds.get((model_id, "exact"), 0.0)
        params = sum(p.numel() for p in engine.model.parameters()) / 1e6
        yield f"**Loaded** {name}: {params:.0f}M parameters, vocabulary {engine.vocab_size}, in {seconds:.1f} s."

    @user_errors
    def trace(self, session: Session) -> dict:
        """This session's latest live run and race, every step event as plain data (as the command line's
        ``--trace`` writes them): built here from the session, never read from a file."""
        live = dict(tree=session.tree, model=session.model_id or "embedded",
                    events=[e.to_dict() for e in session.events])
        race = {m: [e.to_dict() for e in run.events] for m, run in (session.race or {}).items()}
        return dict(live=live, race=dict(tree=session.race_tree, runs=race))


def race_chart(runs: dict[str, RaceRun], at_s: float | None = None):
    """The race figure of every step finished ``at_s`` seconds into each run (``None``: all), on the axes of the
    whole race so that the lines grow instead of the axes."""
    fig = race_figure({m: [e for e in r.events if at_s is None or e.elapsed_s <= at_s] for m, r in runs.items()})
    end = max(r.elapsed_s for r in runs.values())
    tokens = max(r.events[-1].total_tokens for r in runs.values())
    return fig.update_xaxes(range=[0, end * 1.03]).update_yaxes(range=[0, tokens * 1.05])


def example_prompts() -> tuple[list[str], list[str]]:
    """One Spec-Bench question per category, and a short label for each: ``"qa: Who played anna in once…"``."""
    picks = stratified(load_questions(), 1)
    labels = [f"{q.category}: {q.prompt[:70]}{'…' if len(q.prompt) > 70 else ''}" for q in picks]
    return [q.prompt for q in picks], labels


def build_app(models: ModelCache | None = None, allow_local_models: bool = False) -> gr.Blocks:
    """The page. Nothing is loaded here: the page paints at once and the model loads on first use (or right after
    launch, see ``main``). ``allow_local_models``: the Model box may name a folder on the server."""
    examples, example_labels = example_prompts()
    choices = tree_choices()
    h = Handlers(models or ModelCache(), [name for _, name in choices], allow_local_models)
    with gr.Blocks(title="Token Recycling", analytics_enabled=False) as demo:
        session = gr.State(Session())
        gr.Markdown(INTRO, elem_id="intro")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", lines=3, max_lines=8, elem_id="prompt")
                example = gr.Dropdown([(label, i) for i, label in enumerate(example_labels)], value=None,
                                      label="…or take a Spec-Bench question (one per category)", elem_id="example")
                hot = gr.Checkbox(True, label="Hot start: begin from the shipped matrix and keep what your runs "
                                  "teach it (off: an empty matrix every run)", container=False, elem_id="hot")
            with gr.Column(scale=2):
                tree = gr.Dropdown(choices, value=DEFAULT_TREE, label="Draft tree", elem_id="tree")
                mode = gr.Radio([(MODE_LABELS[m], m) for m in MODES], value="exact", label="Mode (every method alike)",
                                elem_id="mode")
                with gr.Row():
                    top_k = gr.Slider(TOP_K[0], TOP_K[1], value=8, step=1, label="k: candidates per row",
                                      elem_id="k")
                    max_new = gr.Slider(8, MAX_NEW_TOKENS[1], value=64, step=8, label="Max new tokens",
                                        elem_id="max-new")
                with gr.Accordion("Model: the embedded SmolLM2-135M-Instruct unless you load another", open=False):
                    model_id = gr.Textbox("", label="Hub id" + (" or local folder" if allow_local_models else ""),
                                          placeholder="empty: the embedded SmolLM2-135M-Instruct (default)",
                                          elem_id="model-id")
                    load = gr.Button("Load model", size="sm")
                    model_status = gr.Markdown("")
        with gr.Tabs():
            with gr.Tab("Live decoding", id="live"):
                with gr.Row():
                    run = gr.Button("Run", variant="primary", size="md", scale=2, elem_id="run")
                    stop = gr.Button("Stop", size="md", scale=1, elem_id="stop")
                    reset = gr.Button("Reset my matrix and history", size="md", scale=1, elem_id="reset")
                counters = gr.HTML(counters_html(Rates()), elem_id="counters")
                with gr.Row(equal_height=False):
                    with gr.Column(scale=5):
                        gr.HTML(ANSWER_LEGEND)
                        answer = gr.HTML(answer_html([], placeholder="The answer streams here, step by step."),
                                         elem_id="answer")
                        step = gr.Slider(0, 1, value=0, step=1, interactive=False, elem_id="step",
                                         label="Step: after a run, drag to see any step")
                        with gr.Row():
                            play = gr.Button("▶ Play the steps", size="sm", elem_id="play")
                            pause = gr.Button("❚❚ Pause", size="sm", elem_id="pause")
                    with gr.Column(scale=7):
                        tree_plot = gr.Plot(placeholder(TREE_PLACEHOLDER), label="Draft tree of the step",
                                            show_label=False, elem_id="tree-plot")
                matrix_plot = gr.Plot(placeholder(MATRIX_PLACEHOLDER), label="Adjacency-matrix rows the step rewrote",
                                      show_label=False, elem_id="matrix-plot")
                with gr.Accordion("Your runs in this session", open=True):
                    history = gr.HTML(history_html([]), elem_id="history")
                with gr.Accordion("Step events of your latest run and race (JSON, as the command line's --trace "
                                  "writes them)", open=False):
                    show_trace = gr.Button("Show the step events", size="sm", elem_id="show-trace")
                    trace = gr.JSON(elem_id="trace")
            with gr.Tab("Race: plain vs Prompt Lookup vs Token Recycling", id="race", elem_id="race-tab"):
                gr.Markdown(RACE_INTRO)
                with gr.Row():
                    race = gr.Button("Run the race", variant="primary", size="md", scale=2, elem_id="race-run")
                    race_stop = gr.Button("Stop", size="md", scale=1)
                    gr.HTML("", scale=2)
                race_status = gr.Markdown(elem_id="race-status")
                lanes = gr.HTML(lanes_html(dict.fromkeys(RACE_METHODS), None), elem_id="lanes")
                table = gr.HTML(elem_id="race-table")
                race_plot = gr.Plot(placeholder(RACE_PLACEHOLDER), label="Tokens against time, as measured",
                                    show_label=False, elem_id="race-plot")
            explain_tab()  # "How it works": replays a recorded trace, needs no model
        timer = gr.Timer(PLAY_EVERY_S, active=False)

        settings = [prompt, max_new, tree, top_k, hot, model_id, mode, session]
        model_work = dict(concurrency_limit=MODEL_CONCURRENCY, concurrency_id="model")
        raw = dict(preprocess=False)  # the handlers check every value themselves (ui.inputs), with clear messages
        example.input(lambda i: gr.skip() if i is None else examples[i], example, prompt, api_visibility="private")
        live_outputs = [answer, counters, tree_plot, matrix_plot, step, session, history]
        run.click(h.live, settings, live_outputs, api_name="live", show_progress="hidden", **model_work, **raw)
        # Stop bypasses the queue (from the page; gradio_client queues every call): it works however full the queue is
        stop.click(h.stop, [session], None, api_name="stop", queue=False)
        reset.click(h.reset, None, [session, answer, counters, tree_plot, matrix_plot, step, history],
                    api_name="reset")
        step.input(h.view_step, [step, session], [answer, tree_plot, matrix_plot], api_name="step",
                   trigger_mode="always_last", show_progress="hidden", **raw)
        frame = [timer, step, answer, tree_plot, matrix_plot]
        play.click(h.play, [step, session], frame, api_visibility="private", show_progress="hidden")
        pause.click(lambda: gr.Timer(active=False), None, timer, api_visibility="private")
        timer.tick(h.tick, [step, session], frame, api_visibility="private", show_progress="hidden")
        race_run = race.click(h.race, settings, [race_status, lanes, table, race_plot, session, history],
                              api_name="race", show_progress="hidden", **model_work, **raw)
        race_run.success(h.replay, [session], [race_status, lanes, race_plot], api_name="replay",
                                       show_progress="hidden")
        race_stop.click(h.stop, [session], None, api_visibility="private", queue=False)
        load.click(h.load_model, [model_id], [model_status], api_name="load_model", **model_work, **raw)
        show_trace.click(h.trace, [session], [trace], api_name="trace")
    return demo


def launch(demo: gr.Blocks, queue_max_size: int = QUEUE_MAX_SIZE, **kwargs):
    """Queue (at most ``queue_max_size`` waiting requests) and launch with the page's CSS; host and port from
    GRADIO_SERVER_NAME / GRADIO_SERVER_PORT unless given. Never a public share link."""
    kwargs.setdefault("server_name", os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    kwargs.setdefault("server_port", int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    kwargs.setdefault("state_session_capacity", SESSIONS_KEPT)
    return demo.queue(default_concurrency_limit=4, max_size=queue_max_size).launch(
        share=False, css=CSS, footer_links=["api"], **kwargs)


def preload(models: ModelCache) -> None:
    """Load the default model so that the first Run only decodes. A failure is reported here and again, to the
    user, at their first run."""
    try:
        models.get("")
    except ModelLoadError as e:
        print(f"the default model did not load: {e}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Token Recycling, live (http://127.0.0.1:7860).")
    parser.add_argument("--allow-local-models", action="store_true",
                        help="let the Model box load a folder on this machine (off: hub ids only; never on a "
                             "public server)")
    args = parser.parse_args(argv)
    models = ModelCache()
    demo = build_app(models, allow_local_models=args.allow_local_models)
    launch(demo, prevent_thread_lock=True)  # the page is served (and paints) while the model loads
    # On the main thread: on a busy 2-core CPU, a model loaded on a short-lived thread decoded up to 10x slower
    # afterwards (torch's OpenMP threads), one loaded here did not.
    preload(models)
    demo.block_thread()


if __name__ == "__main__":
    main()
