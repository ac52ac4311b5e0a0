"""Spec-Bench benchmark: every method on the same questions, interleaved question by question in one process.

    python -m tr_core.bench [--questions FILE] [--per-category 5] [--max-new-tokens 128]
                            [--methods plain,pld,tr,tr-paper] [--model ID] [--mode exact|fast] [--compile]
                            [--out bench_out]

It writes ``results.json`` and ``report.md`` to ``--out``. The charts are drawn from ``results.json`` by
``visualize``, which this package does not import: ``python benchmark.py`` (beside ``app.py``) takes the same
options, runs this benchmark, then draws ``speedup.html`` and ``tree_size.html``.

Methods: ``plain`` (greedy, one token per forward), ``pld`` (Prompt Lookup), ``tr`` (Token Recycling with the tree
fitted to this machine, matrix seeded from each prompt), ``tr-paper`` (the paper's 81-node tree), and ``tr-cold``
(the fitted tree from an empty matrix on every question). Token Recycling starts from the shipped hot-start matrix
and carries it across questions, as the paper's hot start does. All methods share one model in one mode, so
speedups compare like with like. Speedup = mean per-question tokens/s of a method / that of ``plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .calibrate import context_curve, context_weights, describe_context
from .decoding import DecodeResult
from .engine import Engine, EngineConfig
from .kernels import mode_dtype
from .models import encode_prompt
from .spec_bench import load_questions, stratified

ALL_METHODS = ("plain", "pld", "tr", "tr-paper", "tr-cold")
DEFAULT_METHODS = ("plain", "pld", "tr", "tr-paper")


@dataclass
class Record:
    question_id: int
    category: str
    method: str
    tokens: int
    steps: int
    seconds: float
    identical: bool
    accepted_lengths: list[int]
    forward_ms: float
    overhead_ms: float
    first_difference: dict | None = None


@dataclass
class MethodRunner:
    name: str
    engine: Engine
    method: str
    reset_each_question: bool = False
    records: list[Record] = field(default_factory=list)

    def run(self, ids: list[int], max_new_tokens: int, engine: Engine | None = None) -> DecodeResult:
        """Decode one prompt on the runner's engine (or ``engine``); a cold runner starts from an empty matrix."""
        if engine is None:
            engine = self.engine.with_matrix(self.engine.fresh_matrix()) if self.reset_each_question else self.engine
        return engine.generate(ids, max_new_tokens, method=self.method)


def _sized(name: str) -> bool:
    """``tr-N``: Token Recycling with the N likeliest nodes of the acceptance statistics (root included)."""
    return name.startswith("tr-") and name[3:].isdigit()


def build_runners(base: Engine, methods: list[str], hot: Path | None) -> list[MethodRunner]:
    matrix = str(hot) if hot else None
    runners = []
    for name in methods:
        if name == "plain":
            runners.append(MethodRunner(name, base.with_config(method="plain", tree="tiny"), "plain"))
        elif name == "pld":
            runners.append(MethodRunner(name, base.with_config(method="pld", tree="tiny"), "pld"))
        elif name == "tr":
            runners.append(MethodRunner(name, base.with_config(method="tr", tree="auto", matrix_path=matrix,
                                                               seed_from_prompt=True), "tr"))
        elif name == "tr-paper":
            runners.append(MethodRunner(name, base.with_config(method="tr", tree="paper", matrix_path=matrix,
                                                               seed_from_prompt=False), "tr"))
        elif name == "tr-cold":
            runners.append(MethodRunner(name, base.with_config(method="tr", tree="auto", seed_from_prompt=True),
                                        "tr", reset_each_question=True))
        elif _sized(name):
            runners.append(MethodRunner(name, base.with_config(method="tr", tree=f"auto-{name[3:]}",
                                                               matrix_path=matrix, seed_from_prompt=True), "tr"))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}, or tr-N")
    return runners


def question_contexts(prompt_lengths: list[int], max_new_tokens: int) -> tuple[int, ...]:
    """Each question's typical context in decoding: its prompt plus half the new tokens."""
    return tuple(n + max_new_tokens // 2 for n in prompt_lengths)


@torch.inference_mode()
def first_difference(engine: Engine, ids: list[int], plain: list[int], other: list[int]) -> dict:
    """Where an output first leaves plain decoding's, and the two tokens' logits there (from a forward over the
    common prefix): a near-tie shows as a tiny gap."""
    k = next(i for i, (a, b) in enumerate(zip(plain + [None], other + [None])) if a != b)
    logits = engine.model(input_ids=torch.tensor([ids + plain[:k]], device=engine.model.device)).logits[0, -1].float()
    out = {"position": k, "plain_token": plain[k] if k < len(plain) else None,
           "method_token": other[k] if k < len(other) else None}
    for key in ("plain_token", "method_token"):
        if out[key] is not None:
            out[key.replace("token", "logit")] = round(float(logits[out[key]]), 5)
    if "plain_logit" in out and "method_logit" in out:
        out["gap"] = round(abs(out["plain_logit"] - out["method_logit"]), 5)
    return out


def summarize(records: list[Record], plain_tps: dict[int, float]) -> dict:
    tps = [r.tokens / r.seconds for r in records]
    base = [plain_tps[r.question_id] for r in records]
    return {
        "tokens_per_s": round(statistics.mean(tps), 3),
        "speedup": round(statistics.mean(tps) / statistics.mean(base), 4),
        "mean_accepted_tokens": round(sum(r.tokens for r in records) / sum(r.steps for r in records), 4),
        "identical": sum(r.identical for r in records),
        "questions": len(records),
        "forward_ms_per_step": round(sum(r.forward_ms for r in records) / sum(r.steps for r in records), 3),
        "overhead_ms_per_step": round(sum(r.overhead_ms for r in records) / sum(r.steps for r in records), 3),
        # where the time went: the decoding steps per generated token, and what each question spent outside its
        # steps (the prompt's prefill, which every method pays alike, and a drafter's seeding from it)
        "step_ms_per_token": round(sum(r.forward_ms + r.overhead_ms for r in records) / sum(r.tokens for r in records), 3),
        "outside_steps_s_per_question": round(statistics.mean(
            r.seconds - (r.forward_ms + r.overhead_ms) / 1e3 for r in records), 4),
    }


def markdown_table(results: dict, category: str | None = None) -> str:
    rows = ["| method | tokens/s | speedup | mean accepted tokens | identical to plain | overhead ms/step |",
            "|---|---|---|---|---|---|"]
    for name, m in results["methods"].items():
        s = m if category is None else m["by_category"].get(category)
        if s:
            rows.append(f"| {name} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}x | {s['mean_accepted_tokens']:.2f} "
                        f"| {s['identical']}/{s['questions']} | {s['overhead_ms_per_step']:.2f} |")
    return "\n".join(rows)


def histogram(records: list[Record]) -> str:
    counts = Counter(n for r in records for n in r.accepted_lengths)
    total = sum(counts.values())
    return "  ".join(f"{n}:{100 * counts[n] / total:.0f}%" for n in sorted(counts))


def parser(prog: str = "python -m tr_core.bench") -> argparse.ArgumentParser:
    """The benchmark's options (``benchmark.py`` adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--questions", default=None, help="JSON-lines questions (default: the Spec-Bench copy in assets/)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(ALL_METHODS)}, and tr-N (the N likeliest nodes, to compare "
                        "tree sizes)")
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=("exact", "fast"), default="exact")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model body for every method (minutes of compiling first; kernels.py)")
    p.add_argument("--fit-context", type=int, default=None,
                   help="the context length (tokens) the auto tree's t(N) is calibrated on (default: t(N) averaged "
                        "over the questions' contexts, each its prompt plus half the new tokens)")
    p.add_argument("--out", default="bench_out", help="the folder results.json and report.md go to")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "plain" not in methods:
        methods.insert(0, "plain")  # speedups are over plain decoding
    unknown = sorted(m for m in set(methods) - set(ALL_METHODS) if not _sized(m))
    if unknown or args.per_category < 1 or args.max_new_tokens < 1:
        p.error(f"unknown methods {unknown}" if unknown else "--per-category and --max-new-tokens must be >= 1")
    if args.fit_context is not None and args.fit_context < 1:
        p.error("--fit-context must be >= 1")

    questions = stratified(load_questions(args.questions), args.per_category)
    base = Engine.load(args.model, EngineConfig(method="plain", tree="tiny", mode=args.mode,
                                                          compile=args.compile))
    prompts = [encode_prompt(base.tokenizer, q.prompt) for q in questions]
    # the tree is fitted for the contexts these questions decode over: a typical step of each sees its prompt and
    # about half of its answer, and t(N) is averaged over them (a step's cost is not linear in its context)
    fit_context = args.fit_context or question_contexts([len(ids) for ids in prompts], args.max_new_tokens)
    base = base.with_config(fit_context=fit_context)
    hot = Path(base.shipped_matrix_path()) if base.shipped_matrix_path() else None
    runners = build_runners(base, methods, hot)
    fitted = next((r.engine.fitted for r in runners if r.engine.fitted), None)
    curve = context_curve(base.model, fit_context)
    print(f"mode {mode_dtype(args.mode)[1]}{', compiled body' if args.compile else ''}; "
          f"torch threads {torch.get_num_threads()}")
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average {load_before:.1f} before the run: another process is using the CPU, and torch's "
              "threads slow down badly when they share cores; timings will be unreliable")
    print(f"hot start: {hot.name if hot else 'none (no shipped matrix: cold start)'}, carried across questions")
    if fitted:
        print(f"fitted tree: {fitted.tree.size} nodes (depth {fitted.tree.max_depth}), predicted mean accepted "
              f"tokens {fitted.expected_accepted:.2f}, predicted speedup {fitted.predicted_speedup:.2f}x")
    weights = "" if isinstance(fit_context, int) else " (calibrated at " + ", ".join(
        f"{g} tokens x {w:.2f}" for g, w in context_weights(fit_context).items()) + ")"
    print(f"t(N) ms over {describe_context(fit_context)}{weights}: "
          + ", ".join(f"{n}:{t:.0f}" for n, t in curve.items()))

    warm = "Say hello in one short sentence."
    for r in runners:  # warm-up, on a throwaway copy of the matrix
        r.run(base.encode(warm), 16, r.engine.with_matrix(r.engine.matrix.clone()))

    plain_runner = runners[0] if runners[0].name == "plain" else next(r for r in runners if r.name == "plain")
    order = [plain_runner] + [r for r in runners if r is not plain_runner]
    started = time.perf_counter()
    bar = tqdm(total=len(questions) * len(order), desc="benchmark", unit="run")
    for qi, (q, ids) in enumerate(zip(questions, prompts)):
        plain_ids = None
        # plain runs first (every output is compared with it); the others rotate so none always runs right after it
        rest = order[1:]
        rest = rest[qi % len(rest):] + rest[: qi % len(rest)] if rest else rest
        for r in [plain_runner] + rest:
            res = r.run(ids, args.max_new_tokens)
            if r is plain_runner:
                plain_ids = res.token_ids
            same = res.token_ids == plain_ids
            r.records.append(Record(
                q.question_id, q.category, r.name, len(res.token_ids), res.steps, res.elapsed_s, same,
                [len(e.new_tokens) for e in res.events], sum(e.forward_ms for e in res.events),
                sum(e.overhead_ms for e in res.events),
                None if same else first_difference(base, ids, plain_ids, res.token_ids),
            ))
            bar.update(1)
    bar.close()

    plain_tps = {r.question_id: r.tokens / r.seconds for r in plain_runner.records}
    categories = list(dict.fromkeys(q.category for q in questions))
    results = {"methods": {}, "config": {
        "questions": len(questions), "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
        "mode": args.mode, "compiled": args.compile, "dtype": str(base.model.dtype), "mode_note": mode_dtype(args.mode)[1],
        "model": args.model or "embedded", "hot_start": hot.name if hot else None,
        "hot_start_carried_across_questions": True, "threads": torch.get_num_threads(),
        "t_n_ms": curve, "fit_context": describe_context(fit_context), "seconds": round(time.perf_counter() - started, 1),
        "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
        "fitted_tree": None if not fitted else {
            "nodes": fitted.tree.size, "depth": fitted.tree.max_depth,
            "node_paths": [list(p) for p in fitted.tree.node_paths],
            "predicted_mean_accepted_tokens": round(fitted.expected_accepted, 4),
            "predicted_speedup": round(fitted.predicted_speedup, 4), "table": fitted.table},
    }}
    for r in runners:
        entry = summarize(r.records, plain_tps)
        entry["by_category"] = {c: summarize([x for x in r.records if x.category == c], plain_tps)
                                for c in categories if any(x.category == c for x in r.records)}
        entry["accepted_length_histogram"] = dict(sorted(Counter(n for x in r.records for n in x.accepted_lengths).items()))
        if r.engine.fitted and r.method == "tr":
            entry["tree_nodes"] = r.engine.tree.size
            entry["predicted_mean_accepted_tokens"] = round(r.engine.fitted.expected_accepted, 4)
            entry["predicted_speedup"] = round(r.engine.fitted.predicted_speedup, 4)
        elif r.method == "tr":
            entry["tree_nodes"] = r.engine.tree.size
        entry["first_differences"] = [{"question_id": x.question_id, **x.first_difference}
                                      for x in r.records if x.first_difference]
        results["methods"][r.name] = entry

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    compiled = ", compiled body" if args.compile else ""
    report = [f"# Spec-Bench, {len(questions)} questions, {args.max_new_tokens} new tokens, mode {args.mode}{compiled}", "",
              "## overall", markdown_table(results)]
    for c in categories:
        report += ["", f"## {c}", markdown_table(results, c)]
    plain_step = results["methods"]["plain"]["forward_ms_per_step"] + results["methods"]["plain"]["overhead_ms_per_step"]
    report += ["", f"## per-step work outside the model forward, as a share of one plain step ({plain_step:.1f} ms)"]
    report += [f"- {n}: {m['overhead_ms_per_step']:.2f} ms ({100 * m['overhead_ms_per_step'] / plain_step:.1f}%)"
               for n, m in results["methods"].items()]
    plain_token = results["methods"]["plain"]["step_ms_per_token"]
    report += ["", "## where the time went (steps only, then the whole question with its prefill)",
               "| method | forward ms/step | overhead ms/step | mean accepted tokens | step ms per token | "
               "speedup of the steps | s per question outside steps | speedup |", "|---|---|---|---|---|---|---|---|"]
    report += [f"| {n} | {m['forward_ms_per_step']:.1f} | {m['overhead_ms_per_step']:.2f} | "
               f"{m['mean_accepted_tokens']:.2f} | {m['step_ms_per_token']:.1f} | "
               f"{plain_token / m['step_ms_per_token']:.2f}x | {m['outside_steps_s_per_question']:.2f} | "
               f"{m['speedup']:.2f}x |" for n, m in results["methods"].items()]
    predicted = [(n, m) for n, m in results["methods"].items() if "predicted_speedup" in m]
    if predicted:
        report += ["", "## fitted trees: predicted (acceptance statistics + t(N)) vs measured",
                   "| method | nodes | predicted MAT | measured MAT | predicted speedup | measured speedup |",
                   "|---|---|---|---|---|---|"]
        report += [f"| {n} | {m['tree_nodes']} | {m['predicted_mean_accepted_tokens']:.2f} | "
                   f"{m['mean_accepted_tokens']:.2f} | {m['predicted_speedup']:.2f}x | {m['speedup']:.2f}x |"
                   for n, m in predicted]
    report += ["", "## accepted tokens per step (share of steps)"]
    report += [f"- {r.name}: {histogram(r.records)}" for r in runners]
    diffs = [(name, d) for name, m in results["methods"].items() for d in m["first_differences"]]
    if diffs:
        report += ["", "## first differences from plain (logits at the first differing position)"]
        report += [f"- {name} q{d['question_id']} @ {d['position']}: plain {d.get('plain_token')} "
                   f"({d.get('plain_logit')}) vs {d.get('method_token')} ({d.get('method_logit')}), gap {d.get('gap')}"
                   for name, d in diffs]
    text = "\n".join(report)
    (out / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
