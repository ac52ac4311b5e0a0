"""Build the shipped assets for a model from its own outputs on generic prompts (none of them a Spec-Bench
question):

- the hot-start adjacency matrix (``assets/hot_start/<model>-k<k>.safetensors``): the matrix left after decoding
  every prompt with the paper tree, as the paper's hot start inherits it from earlier requests;
- the acceptance statistics of the paper tree (``assets/acceptance/<model>.json``): for every node, the share of
  steps in which it lay on the accepted path, counted on the second half of the prompts (the matrix already warm),
  with the matrix seeded from each prompt's prefill as the fitted tree does.

    python -m tr_core.build_assets [--model ID] [--max-new-tokens 96] [--top-k 8]
                                   [--hot-start-dir assets/hot_start] [--acceptance-dir assets/acceptance]

The files are named by ``tr_core.assets`` (``hot_start_path``, ``acceptance_path``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from .assets import ACCEPTANCE_DIR, GENERIC_PROMPTS, HOT_START_DIR, acceptance_path, hot_start_path
from .calibrate import model_slug, node_acceptance
from .engine import Engine, EngineConfig


def generic_prompts(path: Path = GENERIC_PROMPTS) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line.replace("\\n", "\n") for line in lines if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.build_assets", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hot-start-dir", default=str(HOT_START_DIR), help="where the hot-start matrix goes")
    p.add_argument("--acceptance-dir", default=str(ACCEPTANCE_DIR), help="where the acceptance statistics go")
    p.add_argument("--prompts", default=str(GENERIC_PROMPTS), help="one prompt per line ('#' lines are comments)")
    args = p.parse_args(argv)

    engine = Engine.load(args.model, EngineConfig(method="tr", tree="paper", top_k=args.top_k, seed_from_prompt=True))
    prompts = generic_prompts(Path(args.prompts))
    if len(prompts) < 2:
        p.error("need at least 2 prompts: the first half warms the matrix, the second half is counted")
    half = len(prompts) // 2
    counted, tokens, steps = [], 0, 0
    started = time.perf_counter()
    for i, prompt in enumerate(tqdm(prompts, desc="decoding generic prompts", unit="prompt")):
        result = engine.generate(prompt, args.max_new_tokens)
        if i >= half:
            counted.extend(result.events)
            tokens += len(result.token_ids)
            steps += result.steps
    acceptance = node_acceptance(counted, engine.tree)

    slug = model_slug(engine.model)
    matrix_path = hot_start_path(slug, args.top_k, Path(args.hot_start_dir))
    stats_path = acceptance_path(slug, Path(args.acceptance_dir))
    matrix_path.parent.mkdir(parents=True, exist_ok=True)
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    engine.matrix.save(matrix_path, {"model": slug, "built_by": "python -m tr_core.build_assets",
                                     "prompts": str(len(prompts)), "max_new_tokens": str(args.max_new_tokens)})
    stats = {
        "model": slug,
        "tree": engine.tree.name,
        "node_paths": [list(p) for p in engine.tree.node_paths],
        "acceptance": [round(a, 5) for a in acceptance],
        "steps": steps,
        "mean_accepted_tokens": round(tokens / steps, 4),
        "prompts_counted": len(prompts) - half,
        "max_new_tokens": args.max_new_tokens,
        "seed_from_prompt": True,
    }
    stats_path.write_text(json.dumps(stats, indent=1))
    rows_used = int((engine.matrix.rows != 0).any(dim=1).sum())
    print(f"hot-start matrix: {matrix_path} ({engine.matrix.nbytes / 2**20:.2f} MB, {rows_used} rows filled)")
    print(f"acceptance of the paper tree over {steps} steps: mean accepted tokens {tokens / steps:.2f} -> "
          f"{stats_path} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
