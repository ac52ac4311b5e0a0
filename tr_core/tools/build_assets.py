"""Build the shipped assets for a model from its own outputs on generic prompts (none of them a Spec-Bench
question):

- the hot-start adjacency matrix (``assets/hot_start/<model>-k<k>.safetensors``): the matrix left after decoding
  every prompt with the paper tree, as the paper's hot start inherits it from earlier requests, with each
  candidate's probability beside its id (read by the best-first methods, ignored by the paper's);
- the acceptance statistics of the paper tree (``assets/acceptance/<model>.json``): for every node, the share of
  steps in which it lay on the accepted path, counted on the second half of the prompts (the matrix already warm),
  with the matrix seeded from each prompt's prefill as the fitted tree does;
- in the same file, ``size_factors``: how much of that acceptance trees of the N likeliest nodes keep when they run
  themselves (N = ``--sizes``): each decodes the second half of the prompts from an empty matrix, the first third of
  them warming it, and its mean accepted tokens per step on the rest is set against the statistics' promise
  (``fitting.size_factors``). A small tree refreshes few rows a step, so its matrix is staler than the paper
  tree's; the fitted tree's prediction uses these factors. ``--sizes-only`` measures them again for the existing
  statistics, without rebuilding the rest;
- in the same file, ``lookahead``: Lookahead decoding's mean tokens and draft nodes per step at each size of
  ``rivals.lookahead.LADDER`` (W, N, G), on the first ``--lookahead-prompts`` of the second half of the prompts.
  Which size runs is chosen on each machine from these and its t(N). ``--lookahead-only`` measures them alone.

    python -m tr_core.tools.build_assets [--model ID] [--max-new-tokens 96] [--top-k 8] [--sizes 2,4,8,16]
                                   [--sizes-max-new-tokens 64] [--sizes-only] [--hot-start-dir assets/hot_start]
                                   [--acceptance-dir assets/acceptance] [--lookahead-only]
                                   [--lookahead-prompts 12]

The files are named by ``tr_core.assets`` (``hot_start_path``, ``acceptance_path``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from ..assets import ACCEPTANCE_DIR, GENERIC_PROMPTS, HOT_START_DIR, acceptance_path, hot_start_path, model_slug
from ..budget import likeliest_first
from ..decoding import run
from ..drafters import RecyclingDrafter
from ..engine import Engine, EngineConfig
from ..fitting import node_acceptance, size_factors
from ..matrix import AdjacencyMatrix
from ..rivals.lookahead import LADDER, LookaheadDrafter
from ..text import TokenText
from ..tree import build_tree


def generic_prompts(path: Path = GENERIC_PROMPTS) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line.replace("\\n", "\n") for line in lines if line and not line.startswith("#")]


def paper_drafter(engine: Engine) -> RecyclingDrafter:
    """Token Recycling with the engine's (paper) tree that also hands the matrix each candidate's probability."""
    drafter = RecyclingDrafter(engine.matrix, engine.tree, seed_from_prompt=True)
    drafter.wants_probs = True
    return drafter


def measure_sizes(engine: Engine, prompts: list[str], stats: dict, sizes: list[int],
                  max_new_tokens: int) -> dict[int, float]:
    """Mean accepted tokens per step of the ``n`` likeliest nodes of ``stats`` for each ``n`` in ``sizes``: each
    decodes ``prompts`` in order from an empty matrix (seeded from every prompt's prefill), counting the steps of
    the last two thirds of them."""
    order = likeliest_first(stats["acceptance"])
    warm = len(prompts) // 3
    ids = [engine.encode(p) for p in prompts]
    measured = {}
    for n in sizes:
        tree = build_tree([tuple(stats["node_paths"][i]) for i in order[1:n]], name=f"auto-{n}")
        matrix = AdjacencyMatrix(engine.vocab_size, engine.config.top_k, engine.model.device)
        tokens = steps = 0
        for i, prompt in enumerate(tqdm(ids, desc=f"the {n} likeliest nodes", unit="prompt")):
            result = run(engine.model, prompt, RecyclingDrafter(matrix, tree, seed_from_prompt=True),
                         max_new_tokens, engine.eos_ids, keep_events=False, head=engine.head)
            if i >= warm:
                tokens, steps = tokens + len(result.token_ids), steps + result.steps
        measured[n] = round(tokens / steps, 4)
    return measured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.tools.build_assets", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hot-start-dir", default=str(HOT_START_DIR), help="where the hot-start matrix goes")
    p.add_argument("--acceptance-dir", default=str(ACCEPTANCE_DIR), help="where the acceptance statistics go")
    p.add_argument("--prompts", default=str(GENERIC_PROMPTS), help="one prompt per line ('#' lines are comments)")
    p.add_argument("--sizes", default="2,4,8,16", help="tree sizes (nodes, root included) to measure size_factors at")
    p.add_argument("--sizes-only", action="store_true", help="measure size_factors again for the existing statistics")
    p.add_argument("--sizes-max-new-tokens", type=int, default=64, help="new tokens per prompt when measuring sizes")
    p.add_argument("--lookahead-only", action="store_true",
                   help="measure Lookahead decoding's sizes again for the existing statistics")
    p.add_argument("--lookahead-prompts", type=int, default=12, help="prompts to measure Lookahead's sizes on")
    args = p.parse_args(argv)
    try:
        sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    except ValueError:
        p.error(f"--sizes takes whole numbers separated by commas, got {args.sizes!r}")
    if any(not 2 <= n <= 81 for n in sizes):
        p.error("--sizes must be between 2 and 81 nodes (the root included)")

    engine = Engine.load(args.model, EngineConfig(method="tr", tree="paper", top_k=args.top_k, seed_from_prompt=True))
    engine.matrix.with_probs()  # the matrix keeps each candidate's probability too (for tr-dynamic and tr-plus)
    prompts = generic_prompts(Path(args.prompts))
    if len(prompts) < 2:
        p.error("need at least 2 prompts: the first half warms the matrix, the second half is counted")
    half = len(prompts) // 2
    stats_path = acceptance_path(model_slug(engine.model), Path(args.acceptance_dir))
    if args.sizes_only or args.lookahead_only:
        if not stats_path.is_file():
            p.error(f"--sizes-only and --lookahead-only need existing statistics at {stats_path}; build them first")
        stats = json.loads(stats_path.read_text())
        if args.sizes_only:
            write_size_factors(engine, prompts[half:], stats, sizes, args.sizes_max_new_tokens, stats_path)
        if args.lookahead_only:
            write_lookahead(engine, prompts[half:half + args.lookahead_prompts], stats, args.sizes_max_new_tokens,
                            stats_path)
        return 0
    counted, tokens, steps = [], 0, 0
    started = time.perf_counter()
    for i, prompt in enumerate(tqdm(prompts, desc="decoding generic prompts", unit="prompt")):
        result = run(engine.model, engine.encode(prompt), paper_drafter(engine), args.max_new_tokens, engine.eos_ids,
                     TokenText(engine.tokenizer), head=engine.head)
        if i >= half:
            counted.extend(result.events)
            tokens += len(result.token_ids)
            steps += result.steps
    acceptance = node_acceptance(counted, engine.tree)

    slug = model_slug(engine.model)
    matrix_path = hot_start_path(slug, args.top_k, Path(args.hot_start_dir))
    matrix_path.parent.mkdir(parents=True, exist_ok=True)
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    engine.matrix.save(matrix_path, {"model": slug, "built_by": "python -m tr_core.tools.build_assets",
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
    write_size_factors(engine, prompts[half:], stats, sizes, args.sizes_max_new_tokens, stats_path)
    write_lookahead(engine, prompts[half:half + args.lookahead_prompts], stats, args.sizes_max_new_tokens, stats_path)
    return 0


def write_size_factors(engine: Engine, prompts: list[str], stats: dict, sizes: list[int], max_new_tokens: int,
                       path: Path) -> None:
    """Measure ``size_factors`` on ``prompts`` and write them into the statistics file."""
    measured = measure_sizes(engine, prompts, stats, sizes, max_new_tokens)
    stats["measured_mean_accepted_tokens"] = {str(n): m for n, m in measured.items()}
    stats["size_factors"] = {str(n): f for n, f in size_factors(stats["acceptance"], measured).items()}
    stats["size_factors_max_new_tokens"] = max_new_tokens
    path.write_text(json.dumps(stats, indent=1))
    print("mean accepted tokens of the N likeliest nodes, measured (size factor): " + ", ".join(
        f"{n}: {m:.2f} (factor {stats['size_factors'].get(str(n), 'n/a')})" for n, m in measured.items()))


def measure_lookahead(engine: Engine, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """Lookahead decoding's mean tokens and draft-tree nodes (root included) per step at each size of ``LADDER``,
    decoding ``prompts``; tokens and nodes do not depend on the machine, so a machine's t(N) chooses among them."""
    ids = [engine.encode(p) for p in prompts]
    measured = []
    for width, n, guesses in LADDER:
        tokens = steps = nodes = 0
        for prompt in tqdm(ids, desc=f"lookahead W={width} N={n} G={guesses}", unit="prompt"):
            result = run(engine.model, prompt, LookaheadDrafter(width, n, guesses), max_new_tokens, engine.eos_ids,
                         head=engine.head)
            tokens, steps = tokens + len(result.token_ids), steps + result.steps
            nodes += sum(len(e.tree_tokens) for e in result.events)
        measured.append(dict(width=width, n=n, guesses=guesses, tokens_per_step=round(tokens / steps, 4),
                             nodes_per_step=round(nodes / steps, 2)))
    return measured


def write_lookahead(engine: Engine, prompts: list[str], stats: dict, max_new_tokens: int, path: Path) -> None:
    """Measure Lookahead's sizes on ``prompts`` and write them into the statistics file."""
    stats["lookahead"] = measure_lookahead(engine, prompts, max_new_tokens)
    stats["lookahead_prompts"], stats["lookahead_max_new_tokens"] = len(prompts), max_new_tokens
    path.write_text(json.dumps(stats, indent=1))
    print("lookahead, tokens (nodes) per step: " + ", ".join(
        f"W{m['width']} N{m['n']} G{m['guesses']}: {m['tokens_per_step']:.2f} ({m['nodes_per_step']:.1f})"
        for m in stats["lookahead"]))


if __name__ == "__main__":
    raise SystemExit(main())
