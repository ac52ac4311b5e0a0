"""Decode one prompt from the command line.

    python -m tr_core --method tr --prompt "Write a haiku about autumn." [--json]
    python -m tr_core --method tr --prompt "..." --temperature 0.7 --top-p 0.9 --sample-top-k 50 --seed 3
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

import torch
from transformers.utils import logging as transformers_logging

from . import trace_file
from .backend import add_device_arguments, device_name
from .engine import METHODS, Engine, EngineConfig
from .models import ModelLoadError
from .modes import MODES
from .sampling import Sampling
from .stats import SPEEDUP_DEFINITION, speedup
from .tree import TreeTemplateError


def trace_meta(args, engine: Engine, result, plain, sampling: Sampling) -> dict:
    """What a reader of the trace elsewhere needs: where and how it ran, and the speeds measured here."""
    model = engine.model
    rates = result.rates
    meta = {"machine": device_name(model.device), "device": str(model.device), "backend": engine.backend_name,
            "backend_note": engine.backend.describe(), "threads": torch.get_num_threads(),
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "method": args.method, "tree": engine.tree.name if args.method != "plain" else None, "mode": args.mode,
            "format": engine.mode_note(),
            "sampling": sampling.describe(), "prompt": args.prompt,
            "tokens": len(result.token_ids), "steps": result.steps, "tokens_per_s": round(rates.tokens_per_s, 3),
            "tokens_per_forward_pass": round(rates.mean_accepted_tokens, 4),
            "special_tokens": list(engine.tokenizer.all_special_tokens),
            "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "recorded_by": "python -m tr_core " + " ".join(sys.argv[1:]) if sys.argv[1:] else "python -m tr_core"}
    if plain is not None:
        meta.update(plain_tokens_per_s=round(plain.rates.tokens_per_s, 3),
                    plain_ms_per_step=round(sum(e.forward_ms + e.overhead_ms for e in plain.events) / plain.steps, 3),
                    identical_to_plain=plain.token_ids == result.token_ids,
                    speedup=round(speedup(rates.tokens_per_s, plain.rates.tokens_per_s), 4),
                    speedup_definition=SPEEDUP_DEFINITION)
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core", description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="tr")
    p.add_argument("--prompt", required=True, help="user prompt (the chat template is applied for chat models)")
    p.add_argument("--model", default=None, help="hub id or local folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="auto",
                   help="Token Recycling tree: auto (fitted to this machine), a template name, or a .json file")
    p.add_argument("--top-k", type=int, default=8, help="candidates kept per matrix row (Token Recycling)")
    p.add_argument("--matrix", default="shipped",
                   help="hot-start matrix: 'shipped' (assets/hot_start, if built for this model), a file, or 'none'")
    p.add_argument("--seed-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="seed the matrix from the prompt's prefill logits (default: on)")
    p.add_argument("--mode", choices=MODES, default="exact",
                   help="exact (fp32) or fast (fp16 weights, fp32 arithmetic)")
    add_device_arguments(p)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; above 0: sample, with every method's output equal to plain sampling's "
                        "for the same --seed")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the top-p set (default 1: all tokens)")
    p.add_argument("--sample-top-k", type=int, default=0,
                   help="sampling: keep the k likeliest tokens (default 0: all); not --top-k, the matrix's candidates")
    p.add_argument("--seed", type=int, default=0, help="sampling: the seed of every position's randomness")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    p.add_argument("--trace", default=None,
                   help="write every step event, with the machine, the settings and the speeds, to this JSON file "
                        "(the app's Live tab replays it)")
    p.add_argument("--trace-plain", action=argparse.BooleanOptionalAction, default=True,
                   help="with --trace: also decode with plain decoding to the same length, so that the trace holds "
                        "plain's speed on this machine too (default: on)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)

    transformers_logging.disable_progress_bar()
    try:
        if args.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {args.max_new_tokens}")
        sampling = Sampling(args.temperature, args.top_p, args.sample_top_k, args.seed)
        config = EngineConfig(method=args.method, tree=args.tree, top_k=args.top_k, seed_from_prompt=args.seed_prompt,
                              mode=args.mode, device=args.device, backend=args.backend, rows=args.rows)
        engine = Engine.load(args.model, config)
        if args.matrix == "shipped":
            engine = engine.with_config(matrix_path=engine.shipped_matrix_path())
        elif args.matrix != "none":
            engine = engine.with_config(matrix_path=args.matrix)
        result = engine.generate(args.prompt, args.max_new_tokens, chat=not args.no_chat_template,
                                 sampling=sampling)
    except (ModelLoadError, TreeTemplateError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.trace:
        plain = None
        if args.trace_plain and args.method != "plain":
            plain = engine.generate(args.prompt, len(result.token_ids), method="plain",
                                    chat=not args.no_chat_template, sampling=sampling)
        trace_file.write(args.trace, result.events, trace_meta(args, engine, result, plain, sampling))
    summary = {
        "method": args.method,
        "text": result.text,
        "token_ids": result.token_ids,
        "steps": result.steps,
        "mean_accepted_tokens": round(result.rates.mean_accepted_tokens, 4),
        "tokens_per_s": round(result.rates.tokens_per_s, 3),
        "elapsed_s": round(result.elapsed_s, 4),
        "stop_reason": result.stop_reason,
        "sampling": sampling.describe(),
        "tree": engine.tree.name if args.method == "tr" else None,
        "tree_nodes": engine.tree.size if args.method == "tr" else None,
        "hot_start": engine.config.matrix_path,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(result.text)
        print(f"\n[{args.method}] {len(result.token_ids)} tokens in {result.steps} steps, "
              f"mean accepted tokens {result.rates.mean_accepted_tokens:.2f}, "
              f"{result.rates.tokens_per_s:.1f} tokens/s, "
              f"stopped by {result.stop_reason}; {sampling.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
