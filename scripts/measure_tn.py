"""Print t(N), a step's model work for N tree tokens, for the output layer as transformers computes it (F.linear)
and as the engine computes it (kernels.OutputHead), measured interleaved in one process.

    .venv/bin/python scripts/measure_tn.py [--mode exact|fast] [--repeats 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tr_core.decoding import _tree_mask  # noqa: E402
from tr_core.kernels import OutputHead, mode_dtype  # noqa: E402
from tr_core.models import load_model  # noqa: E402
from tr_core.tree import build_tree, load_template  # noqa: E402


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="exact")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefix", type=int, default=128)
    args = p.parse_args()
    model, _ = load_model(None, dtype=mode_dtype(args.mode)[0])
    base, head = model.base_model, OutputHead(model)
    paper = load_template("paper")
    cache = DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(0)
    base(input_ids=torch.randint(0, 49152, (1, args.prefix), generator=g), cache=cache, use_cache=True)

    def dense(ids, pos, mask):
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True).logits[0]
        return logits

    def engine(ids, pos, mask):
        return head(base(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                         use_cache=True).last_hidden_state[0])

    print(f"mode {args.mode}, threads {torch.get_num_threads()}, prefix {args.prefix}")
    print("N | F.linear head ms | engine head ms | ratio")
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81):
        ids = torch.randint(0, 49152, (1, n), generator=g)
        tree = build_tree(list(paper.node_paths[1:n])) if n > 1 else None
        pos = (args.prefix + (tree.depth if tree else torch.zeros(1, dtype=torch.long)))[None]
        mask = _tree_mask(tree, args.prefix, model.dtype, model.device) if tree else None
        times = {dense: [], engine: []}
        for r in range(args.repeats + 1):
            for f in (dense, engine) if r % 2 else (engine, dense):
                t0 = time.perf_counter()
                logits = f(ids, pos, mask)
                logits.argmax(-1)
                if n > 1:
                    torch.topk(logits, 8, dim=-1)
                times[f].append((time.perf_counter() - t0) * 1e3)
                cache.crop(-n)
        a, b = statistics.median(times[dense][1:]), statistics.median(times[engine][1:])
        print(f"{n} | {a:.1f} | {b:.1f} | {a / b:.2f}", flush=True)


if __name__ == "__main__":
    main()
