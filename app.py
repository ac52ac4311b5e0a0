"""Token Recycling, live: a first page that streams a decoding with the engine's own figures.

The full app (animated draft tree, matrix heatmap, race) comes with the app issue; this page already runs every
method on the embedded model and shows each step's accepted tokens.
"""

from __future__ import annotations

import html
import os
from functools import lru_cache

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from tr_core.engine import METHODS, Engine, EngineConfig  # noqa: E402
from tr_core.tree import BUILTIN_TEMPLATES  # noqa: E402


@lru_cache(maxsize=1)
def shared_engine() -> Engine:
    """The model loads once per process, on first use; each request gets its own matrix (see below)."""
    return Engine.load(None, EngineConfig())


def run_live(prompt: str, method: str, tree: str, max_new_tokens: int, matrix_state):
    if not prompt or not prompt.strip():
        raise gr.Error("Type a prompt first.")
    base = shared_engine()
    engine = base.with_config(method=method, tree=tree)
    if matrix_state is not None:
        engine.matrix = matrix_state  # hot start from this user's earlier requests
    shown = []
    for event in engine.stream(prompt, int(max_new_tokens)):
        cls = "multi" if len(event.new_tokens) > 1 else "single"
        shown.append(f'<span class="{cls}">{html.escape(event.new_text)}</span>')
        stats = (f"steps {event.total_steps} · tokens {event.total_tokens} · mean accepted tokens "
                 f"{event.mean_accepted_tokens:.2f} · {event.tokens_per_s:.1f} tokens/s")
        yield "".join(shown), stats, engine.matrix


CSS = ".multi { background: #cfe8ff; border-radius: 3px; } #answer { white-space: pre-wrap; }"


def build_app() -> gr.Blocks:
    with gr.Blocks(title="Token Recycling") as demo:
        gr.Markdown("# Token Recycling\nTraining-free speculative decoding (arXiv 2408.08696). Steps that produced "
                    "several tokens at once are highlighted.")
        matrix_state = gr.State(None)
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", value="Write a short poem about the sea.", lines=3, scale=3)
            with gr.Column(scale=1):
                method = gr.Dropdown(list(METHODS), value="tr", label="Method")
                tree = gr.Dropdown(sorted(BUILTIN_TEMPLATES), value="paper", label="Draft tree")
                max_new = gr.Slider(8, 512, value=128, step=8, label="Max new tokens")
        run = gr.Button("Run", variant="primary")
        answer = gr.HTML(elem_id="answer")
        stats = gr.Markdown()
        run.click(run_live, [prompt, method, tree, max_new, matrix_state], [answer, stats, matrix_state],
                  api_name="live", concurrency_limit=1)
    return demo


if __name__ == "__main__":
    build_app().queue(default_concurrency_limit=1).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", os.environ.get("PORT", "7860"))),
        css=CSS,
    )
