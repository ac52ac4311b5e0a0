"""Token Recycling through transformers' ``generate`` against ``generate``'s own greedy decoding, on held-out
Spec-Bench questions and the embedded model: how many outputs agree (and, for each that does not, the first differing
position and the gap there between the two tokens' logits, as transformers' forward computes them), and tokens/s
side by side, next to the engine's own speedup on the same questions.

    python -m tr_core.tools.hf_bench --per-category 2 --max-new-tokens 96 --method tr

Each question runs, in turn: ``generate`` (greedy, on an untouched copy of the model: what a user has without this
project), ``generate(custom_generate=token_recycling)``, then this project's engine, plain decoding and the method
(on the model the engine prepared), from the matrix generate's run started from. A speed figure is a ratio of two
runs made side by side in this one process; tokens/s count each question's prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..decoding import run
from ..drafters import PlainDrafter
from ..hf import recycler_of, token_recycling
from ..models import encode_prompt, load_model
from ..spec_bench import load_questions, stratified
from ..stats import first_difference


@torch.no_grad()
def logit_gap(model, prompt: list[int], ours: list[int], theirs: list[int], at: int) -> tuple[float, int, int]:
    """At the first differing position ``at`` of two continuations of ``prompt``: transformers' own logits there
    (one forward over the shared prefix) of the token ``generate`` chose minus that of the token we chose, and the
    two tokens."""
    prefix = torch.tensor([prompt + theirs[:at]])
    logits = model(prefix).logits[0, -1].float()
    mine = ours[at] if at < len(ours) else -1
    other = theirs[at] if at < len(theirs) else -1
    gap = float(logits[other] - logits[mine]) if mine >= 0 and other >= 0 else float("nan")
    return gap, other, mine


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--method", default="tr")
    args = p.parse_args(argv)
    stock, tokenizer = load_model(None, dtype=torch.float32)  # never prepared: transformers' own generate
    model, _ = load_model(None, dtype=torch.float32)
    held = recycler_of(model)
    engine = held.engine()
    new = args.max_new_tokens
    questions = stratified(load_questions(), args.per_category)
    rows, agree = [], 0
    print(f"{len(questions)} questions, {new} new tokens, method {args.method}, embedded model fp32 on the CPU "
          f"({torch.get_num_threads()} threads); engine: {engine.backend.describe()}")
    encode = lambda text: encode_prompt(tokenizer, text)  # noqa: E731 (the chat template, as the app)
    warm = encode("Hi")
    stock.generate(torch.tensor([warm]), max_new_tokens=4, do_sample=False)
    model.generate(torch.tensor([warm]), custom_generate=token_recycling, max_new_tokens=4, method=args.method)
    for q in questions:
        prompt = encode(q.prompt)
        ids = torch.tensor([prompt])
        before = held.matrix.clone()  # the engine's own run starts from the matrix generate's run started from
        theirs, t_stock = timed(lambda: stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                       do_sample=False)[0, len(prompt):].tolist())
        ours, t_ours = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                    custom_generate=token_recycling,
                                                    method=args.method)[0, len(prompt):].tolist())
        plain, t_plain = timed(lambda: run(model, prompt, PlainDrafter(), new, engine.eos_ids, head=engine.head,
                                           backend=engine.backend).token_ids)
        method, t_method = timed(lambda: run(model, prompt, engine.with_matrix(before).drafter(args.method),
                                             new, engine.eos_ids, head=engine.head,
                                             backend=engine.backend).token_ids)
        at = first_difference(ours, theirs)
        agree += at is None
        note = "agrees"
        if at is not None:
            gap, other, mine = logit_gap(stock, prompt, ours, theirs, at)
            note = (f"differs at token {at} (generate {other}, ours {mine}); generate's logit minus ours there, "
                    f"in its own forward: {gap:+.2e}")
        rows.append((len(theirs) / t_stock, len(ours) / t_ours, len(plain) / t_plain, len(method) / t_method))
        same = "= plain" if ours == plain else "!= plain"
        print(f"- {q.category:<14} #{q.question_id}: generate {rows[-1][0]:6.1f} tok/s, with Token Recycling "
              f"{rows[-1][1]:6.1f} ({same}); engine plain {rows[-1][2]:6.1f}, {args.method} {rows[-1][3]:6.1f}; {note}")
    mean = [statistics.mean(r[i] for r in rows) for i in range(4)]
    print(f"\nagree with generate's own greedy decoding: {agree}/{len(rows)}")
    print(f"tokens/s (mean over questions): generate {mean[0]:.1f}, generate + Token Recycling {mean[1]:.1f} "
          f"({mean[1] / mean[0]:.2f}x generate); engine plain {mean[2]:.1f}, engine {args.method} {mean[3]:.1f} "
          f"({mean[3] / mean[2]:.2f}x, the engine's own speedup); generate + Token Recycling over the engine's "
          f"plain: {mean[1] / mean[2]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
