"""Record the traces that the app's "How it works" tab replays: one prompt decoded by Token Recycling twice with the
embedded model, once from the shipped hot-start matrix and once from an empty (cold) matrix.

    python -m tr_core.record_trace            # writes assets/traces/{hot,cold}.json and {hot,cold}.meta.json

``<name>.json`` is a plain trace (a JSON list of ``StepEvent.to_dict()``, read by ``visualize.load_trace`` without
torch). ``<name>.meta.json`` says what a reader needs to know about it::

    {"name": "hot", "start": "hot", "prompt": "...", "model": "smollm2-135m-instruct", "tree": "small",
     "tree_nodes": 13, "top_k": 8, "vocab_size": 49152, "matrix_bytes": 1572864, "steps": 30, "tokens": 64,
     "mean_accepted_tokens": 2.13, "text": "...",
     "token_text": {"1234": " rain", ...},          # every id the trace names, decoded by the tokenizer
     "calibration": {"machine": "...", "t_ms": {"1": 47.4, ...}},   # t(N) on the recording machine
     "tree_sizes": [{"nodes": 1, "expected_accepted": 1.0, "step_ms": 47.4, "predicted_speedup": 1.0}, ...]}

``tree_sizes`` is the table the fitted ("auto") tree is chosen from: the paper tree's nodes taken likeliest first
(shipped acceptance statistics) against the measured t(N). Re-run this command after the engine changes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .calibrate import auto_tree, context_curve, machine_key, model_slug
from .engine import ASSETS_DIR, Engine, EngineConfig
from .events import StepEvent

TRACES_DIR = ASSETS_DIR / "traces"
# Not a Spec-Bench question, nor one of the prompts the hot-start matrix was built from (assets/prompts/generic.txt).
PROMPT = "Explain how a rainbow forms, in a few sentences."


def token_ids(events: list[StepEvent]) -> list[int]:
    """Every id a trace names: tree tokens, predictions, bonus tokens and the candidates of every rewritten row."""
    ids: set[int] = set()
    for e in events:
        ids.update(e.tree_tokens, e.predicted, e.new_tokens, [e.bonus_token])
        for row in e.rows_updated:
            ids.update(row.old, row.new, [row.token])
    return sorted(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.record_trace", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tree", default="small", help="a template whose pictures read well (default: small)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(TRACES_DIR))
    args = p.parse_args(argv)

    started = time.perf_counter()
    engine = Engine.load(None, EngineConfig(method="tr", tree=args.tree, top_k=args.top_k))
    shipped = engine.shipped_matrix_path()
    if shipped is None:
        p.error(f"no shipped hot-start matrix for k={args.top_k}: run python -m tr_core.build_assets first")
    curve = context_curve(engine.model, engine.config.fit_context)  # cached per machine and context
    sizes = auto_tree(engine.model, context=engine.config.fit_context).table
    slug = model_slug(engine.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
            "matrix_bytes": run.matrix.nbytes,
            "seed_from_prompt": run.config.seed_from_prompt,
            "mode": run.config.mode,
            "steps": result.steps,
            "tokens": len(result.token_ids),
            "mean_accepted_tokens": round(len(result.token_ids) / result.steps, 4),
            "text": decode(result.token_ids),
            "recorded_by": "python -m tr_core.record_trace",
            "token_text": {str(t): decode([t]) for t in token_ids(events)},
            "calibration": {"machine": machine_key(engine.model), "t_ms": {str(n): round(ms, 2)
                                                                            for n, ms in curve.items()}},
            "tree_sizes": [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in sizes],
        }
        (out / f"{name}.json").write_text(json.dumps([e.to_dict() for e in events], separators=(",", ":")))
        (out / f"{name}.meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        print(f"{name}: {result.steps} steps, {len(result.token_ids)} tokens, "
              f"mean accepted tokens {meta['mean_accepted_tokens']:.2f} -> {out / name}.json")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
