"""Record traces with the embedded model: the one recorder of the runs the project ships and tests read.

    python -m tr_core.tools.record_trace              # assets/traces/{hot,cold}.json and {hot,cold}.meta.json
    python -m tr_core.tools.record_trace --fixtures   # tests/fixtures/trace_paper.json and trace_small.json

The shipped traces are what the app's "How it works" tab replays: one prompt decoded by Token Recycling twice, once
from the shipped hot-start matrix and once from an empty (cold) matrix. The test fixtures are two runs the figure
tests draw: the paper tree on a matrix warmed by one answer, and the small tree from an empty matrix.

``<name>.json`` is a plain trace (a JSON list of ``StepEvent.to_dict()``, read by ``visualize.load_trace`` without
torch). ``<name>.meta.json`` says what a reader needs to know about it::

    {"name": "hot", "start": "hot", "prompt": "...", "model": "smollm2-135m-instruct", "tree": "small",
     "tree_nodes": 13, "top_k": 8, "vocab_size": 49152, "matrix_bytes": 1572864, "steps": 30, "tokens": 64,
     "mean_accepted_tokens": 2.13, "text": "...",
     "token_text": {"1234": " rain", ...},          # every id the trace names, decoded by the tokenizer
     "special_ids": [1, 2],                          # those of them that are special (chat-template) tokens
     "calibration": {"machine": "...", "t_ms": {"1": 47.4, ...}},   # t(N) on the recording machine
     "tree_sizes": [{"nodes": 1, "expected_accepted": 1.0, "step_ms": 47.4, "predicted_speedup": 1.0}, ...]}

``matrix_bytes`` counts the token ids Token Recycling reads (not the probabilities a hot-start file may keep beside
them for the best-first tree). ``tree_sizes`` is the table the fitted ("auto") tree is chosen from: the paper tree's
nodes taken likeliest first (shipped acceptance statistics) against the measured t(N). Re-run this command after the
engine or the hot-start matrix changes. The tab's pages 2-6 follow a decoding step of the hot run picked by rule
(``ui.lesson.featured_step``); ``tests/test_explain.py`` checks that the recording has one.
The fixtures are plain traces, without a meta file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..assets import ASSETS_DIR, TRACES_DIR, model_slug
from ..engine import Engine, EngineConfig
from ..events import StepEvent, token_ids_named
from ..fitting import auto_tree
from ..speed.calibrate import context_curve, machine_key, streamed_parameters
from ..text import shown_piece

# Not a Spec-Bench question, nor one of the prompts the hot-start matrix was built from (assets/prompts/generic.txt).
PROMPT = "Explain how a rainbow forms, in a few sentences."
FIXTURES_DIR = ASSETS_DIR.parent / "tests" / "fixtures"
FIXTURE_PROMPT = "Explain how a bicycle works."


def write_trace(path: Path, events: list[StepEvent]) -> None:
    """A plain trace: a JSON list of ``StepEvent.to_dict()``, what ``visualize.load_trace`` reads."""
    path.write_text(json.dumps([e.to_dict() for e in events], separators=(",", ":")))


def record_fixtures(engine: Engine, out: Path) -> None:
    """``trace_paper.json``: the paper tree, k = 8, on a matrix warmed by one answer to ``FIXTURE_PROMPT`` (from
    cold), answering a variant of it; ``trace_small.json``: the small tree from an empty matrix on
    ``FIXTURE_PROMPT``."""
    paper = engine.with_config(tree="paper", top_k=8, matrix_path=None)
    paper.generate(FIXTURE_PROMPT, 96)  # the matrix learns from this answer: the recorded run is a hot start
    runs = {"trace_paper": paper.generate("Explain how a bicycle works in simple words.", 48),
            "trace_small": engine.with_config(tree="small", top_k=8, matrix_path=None).generate(FIXTURE_PROMPT, 32)}
    for name, result in runs.items():
        write_trace(out / f"{name}.json", list(result.events))
        print(f"{name}: {result.steps} steps, {len(result.token_ids)} tokens, "
              f"{len(result.token_ids) / result.steps:.2f} tokens per forward pass (bonus token included) -> "
              f"{out / name}.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.tools.record_trace", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tree", default="small", help="a template whose pictures read well (default: small)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixtures", action="store_true",
                   help="record the test fixtures (tests/fixtures/trace_{paper,small}.json) instead")
    p.add_argument("--out", default=None, help=f"the folder (default: {TRACES_DIR}, or with --fixtures "
                                               f"{FIXTURES_DIR})")
    args = p.parse_args(argv)
    lesson_options = ("prompt", "tree", "top_k", "max_new_tokens")
    if args.fixtures and any(getattr(args, k) != p.get_default(k) for k in lesson_options):
        p.error("--fixtures records fixed runs: --prompt, --tree, --top-k and --max-new-tokens are for the "
                "shipped traces")
    out = Path(args.out or (FIXTURES_DIR if args.fixtures else TRACES_DIR))
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    engine = Engine.load(None, EngineConfig(method="tr", tree=args.tree, top_k=args.top_k))
    if args.fixtures:
        record_fixtures(engine, out)
        print(f"done in {time.perf_counter() - started:.0f} s")
        return 0
    shipped = engine.shipped_matrix_path()
    if shipped is None:
        p.error(f"no shipped hot-start matrix for k={args.top_k}: run python -m tr_core.tools.build_assets first")
    curve = context_curve(engine.model, engine.config.fit_context)  # cached per machine and context
    sizes = auto_tree(engine.model, context=engine.config.fit_context).table
    slug = model_slug(engine.model)
    for name, matrix in (("hot", shipped), ("cold", None)):
        run = engine.with_config(matrix_path=matrix)
        result = run.generate(args.prompt, args.max_new_tokens)
        events = list(result.events)
        decode = engine.tokenizer.decode
        meta = {
            "name": name,
            "start": name,
            "about": ("the shipped hot-start matrix (assets/hot_start/), built from other prompts" if matrix else
                      "an empty matrix: only the prompt's own tokens get rows, from reading the prompt"),
            "prompt": args.prompt,
            "model": slug,
            "tree": run.tree.name,
            "tree_nodes": run.tree.size,
            "top_k": args.top_k,
            "vocab_size": engine.vocab_size,
            "matrix_bytes": run.matrix.rows.numel() * run.matrix.rows.element_size(),  # the ids Token Recycling reads
            "seed_from_prompt": run.config.seed_from_prompt,
            "mode": run.config.mode,
            "steps": result.steps,
            "tokens": len(result.token_ids),
            "mean_accepted_tokens": round(len(result.token_ids) / result.steps, 4),
            "text": decode(result.token_ids),
            "recorded_by": "python -m tr_core.tools.record_trace",
            "token_text": {str(t): shown_piece(engine.tokenizer, t, decode([t])) for t in token_ids_named(events)},
            "special_ids": sorted(set(engine.tokenizer.all_special_ids) & set(token_ids_named(events))),
            "calibration": {"machine": machine_key(engine.model), "t_ms": {str(n): round(ms, 2)
                                                                            for n, ms in curve.items()}},
            "tree_sizes": [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in sizes],
            # what the step-cost model (tr_core.projection) needs of the model: weights streamed a step, layers
            "shape": {"parameters": streamed_parameters(engine.model),
                      "layers": engine.model.config.num_hidden_layers},
        }
        write_trace(out / f"{name}.json", events)
        (out / f"{name}.meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        print(f"{name}: {result.steps} steps, {len(result.token_ids)} tokens, "
              f"{meta['mean_accepted_tokens']:.2f} tokens per forward pass (bonus token included) -> "
              f"{out / name}.json")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
