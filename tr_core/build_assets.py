"""Build the shipped assets for a model from its own outputs on generic prompts (none of them a Spec-Bench
question):

- the hot-start adjacency matrix (``assets/hot_start/<model>-k<k>.safetensors``): the matrix left after decoding
  every prompt with the paper tree, as the paper's hot start inherits it from earlier requests;
- the acceptance statistics of the paper tree (``assets/acceptance/<model>.json``): for every node, the share of
  steps in which it lay on the accepted path, counted on the second half of the prompts (the matrix already warm),
  with the matrix seeded from each prompt's prefill as the fitted tree does.

    python -m tr_core.build_assets [--model ID] [--max-new-tokens 96] [--top-k 8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from .calibrate import model_slug, node_acceptance
from .engine import ASSETS_DIR, Engine, EngineConfig

PROMPTS = ASSETS_DIR / "prompts" / "generic.txt"


def generic_prompts(path: Path = PROMPTS) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line.replace("\\n", "\n") for line in lines if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.build_assets", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--out", default=str(ASSETS_DIR))
    p.add_argument("--prompts", default=str(PROMPTS), help="one prompt per line ('#' lines are comments)")
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
    out = Path(args.out)
    (out / "hot_start").mkdir(parents=True, exist_ok=True)
    (out / "acceptance").mkdir(parents=True, exist_ok=True)
    matrix_path = out / "hot_start" / f"{slug}-k{args.top_k}.safetensors"
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
    (out / "acceptance" / f"{slug}.json").write_text(json.dumps(stats, indent=1))
    rows_used = int((engine.matrix.rows != 0).any(dim=1).sum())
    print(f"hot-start matrix: {matrix_path} ({engine.matrix.nbytes / 2**20:.2f} MB, {rows_used} rows filled)")
    print(f"acceptance of the paper tree over {steps} steps: mean accepted tokens {tokens / steps:.2f} "
          f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
