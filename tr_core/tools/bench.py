"""Spec-Bench benchmark: every method on the same questions, in rounds alternating the methods, in one process.

    python -m tr_core.tools.bench [--questions FILE] [--per-category 5] [--max-new-tokens 128] [--rounds 3]
                            [--methods plain,pld,tr,tr-paper] [--model ID] [--mode exact|fast]
                            [--out bench_out] [--temperatures 0,0.3,0.7,1.0 --seed 0]

It writes ``results.json`` and ``report.md`` to ``--out``. The charts are drawn from ``results.json`` by
``visualize``, which this package does not import: ``python benchmark.py`` (beside ``app.py``) takes the same
options, runs this benchmark, then draws ``speedup.html`` and ``tree_size.html``.

Methods: ``plain`` (greedy, one token per forward), ``pld`` (Prompt Lookup), ``tr`` (Token Recycling with the tree
fitted to this machine, matrix seeded from each prompt), ``tr-paper`` (the paper's 81-node tree), and ``tr-cold``
(the fitted tree from an empty matrix on every question); beyond the paper (``methods.py``): ``suffix`` (drafts from the
context's suffix index alone, a third baseline), ``tr-context``, ``tr-dynamic`` and ``tr-plus``. Token Recycling starts
from the shipped hot-start matrix and carries it across questions, as the paper's hot start does. All methods share
one model in one mode, so speedups compare like with like.

The machine drifts (its speed moves by up to 2x within minutes), so the methods are measured close together in time:
each question is decoded ``--rounds`` times by every method, each round running every method once, in an order
rotated from round to round (``round_orders``). Every round of a question starts Token Recycling from the same
matrix, the one it held before the question; what the first round taught is carried to the next question
(``measure_question``). A method's time on a question is its median round. Its speedup over plain is the median of
the per-question ratios (its tokens/s over plain's on the same question) with a 95% bootstrap interval over the
questions, and a verdict read from the interval (``compare``); the same for each pair of the other methods.
``speedup`` keeps its old meaning: mean per-question tokens/s of a method / that of ``plain``.

With ``--temperatures`` the whole measurement runs once per temperature (sampled with ``--seed``; 0 is greedy),
each from fresh hot-start matrices, and every method's output is compared with plain sampling's at the same
temperature and seed. ``results.json`` then also holds ``temperatures`` (per temperature and method: the median
speedup, mean accepted tokens, identical-to-plain count) and the report a table per temperature; the rest of the
report and of ``results.json`` is the first temperature's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from ..backend import add_device_arguments, device_name
from ..decoding import DecodeResult
from ..engine import Engine, EngineConfig
from ..methods import METHODS
from ..models import encode_prompt
from ..sampling import Sampling
from ..spec_bench import Question, load_questions, stratified
from ..speed.calibrate import context_curve, context_weights, describe_context, interpolate
from ..speed.layouts import cpu_name
from ..stats import BOOTSTRAP, MIN_QUESTIONS_FOR_VERDICT, SPEEDUP_DEFINITION, collector_paused, compare, median_round
from ..stats import first_difference as first_difference_at
from .report import report
from .results import (
    Record,
    pairwise,
    predicted_vs_measured,
    ratios,
    round_spread_pct,
    speedup_on,
    summarize,
    temperature_summary,
    through_run_sizes,
)

UNPADDED = "plain-unpadded"  # the torch backend's plain decoding at one row a pass (a speed baseline, not a method)
ALL_METHODS = ("plain", "pld", "suffix", "rest", "lookahead", "tr", "tr-paper", "tr-cold", "tr-context", "tr-dynamic",
               "tr-plus")
DEFAULT_METHODS = ("plain", "pld", "tr", "tr-paper")
DEFAULT_ROUNDS = 3  # the fewest rounds whose median ignores one round hit by a slow spell


@dataclass
class MethodRunner:
    name: str
    engine: Engine
    method: str
    reset_each_question: bool = False
    records: list[Record] = field(default_factory=list)
    sampling: Sampling | None = None  # how every run of this runner chooses tokens (None: greedy)

    @property
    def carries_matrix(self) -> bool:
        """Whether the runner's matrix goes from one question to the next (Token Recycling's hot start)."""
        return METHODS[self.method].uses_matrix and not self.reset_each_question

    def run(self, ids: list[int], max_new_tokens: int, engine: Engine | None = None) -> DecodeResult:
        """Decode one prompt on the runner's engine (or ``engine``); a cold runner starts from an empty matrix. The
        garbage collector is paused while it decodes (``stats.collector_paused``), as ``timeit`` does: a full
        collection scans every object the benchmark holds (every method's events so far; one took 240 ms in a run
        here), and one inside a timed question is billed to whichever method ran it; the collections run between
        runs."""
        if engine is None:
            engine = self.engine.with_matrix(self.engine.fresh_matrix()) if self.reset_each_question else self.engine
        with collector_paused():
            if self.sampling is None:
                return engine.generate(ids, max_new_tokens, method=self.method)
            return engine.generate(ids, max_new_tokens, method=self.method, sampling=self.sampling)


def _sized(name: str) -> bool:
    """``tr-N``: Token Recycling with the N likeliest nodes of the acceptance statistics (root included)."""
    return name.startswith("tr-") and name[3:].isdigit()


def step_curve(engine: Engine, context, remeasure: bool = False, use_cache_file: bool = True,
               sizes=None) -> dict[int, float]:
    """t(N) of the engine's backend, measured now (``remeasure``) or read from the machine's cache: the native
    backend's ``calibrate.context_curve``, the torch backend's ``fixed.timing.rows_curve``."""
    if engine.backend_name == "torch":
        from ..fixed.timing import rows_curve
        prefix = context if isinstance(context, int) else round(statistics.mean(context))
        return rows_curve(engine.model, prefix, sizes=sizes, use_cache_file=use_cache_file and not remeasure)
    extra = {} if sizes is None else {"sizes": sizes}
    return context_curve(engine.model, context, remeasure=remeasure, use_cache_file=use_cache_file, **extra)


def build_runners(base: Engine, methods: list[str], hot: Path | None,
                  sampling: Sampling | None = None) -> list[MethodRunner]:
    runners = _runners(base, methods, hot)
    for r in runners:
        r.sampling = sampling
    return runners


def _runners(base: Engine, methods: list[str], hot: Path | None) -> list[MethodRunner]:
    matrix = str(hot) if hot else None
    runners = []
    for name in methods:
        if name == "plain":
            runners.append(MethodRunner(name, base.with_config(method="plain", tree="tiny"), "plain"))
            if base.backend_name == "torch" and base.rows != 1:  # plain decoding unpadded: one row a pass
                runners.append(MethodRunner(UNPADDED, base.with_config(method="plain", tree="tiny", rows=1),
                                            "plain"))
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
        elif name in ("suffix", "rest", "lookahead"):
            runners.append(MethodRunner(name, base.with_config(method=name, tree="tiny"), name))
        elif name in ("tr-context", "tr-dynamic", "tr-plus"):
            runners.append(MethodRunner(name, base.with_config(method=name, tree="auto", matrix_path=matrix,
                                                               seed_from_prompt=True), name))
        elif _sized(name):
            runners.append(MethodRunner(name, base.with_config(method="tr", tree=f"auto-{name[3:]}",
                                                               matrix_path=matrix, seed_from_prompt=True), "tr"))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}, or tr-N")
    return runners


def question_contexts(prompt_lengths: list[int], max_new_tokens: int) -> tuple[int, ...]:
    """Each question's typical context in decoding: its prompt plus half the new tokens."""
    return tuple(n + max_new_tokens // 2 for n in prompt_lengths)


def round_orders(names: Sequence[str], rounds: int, question: int) -> list[list[str]]:
    """The order the methods run in on the ``question``-th question, round by round: every method once a round, the
    order rotated by one place from each round to the next and on across questions, so that each method takes every
    place in turn and a drift within a round hits them alike.

    >>> round_orders(["plain", "pld", "tr"], 2, 0)
    [['plain', 'pld', 'tr'], ['pld', 'tr', 'plain']]
    >>> round_orders(["plain", "pld", "tr"], 2, 1)  # the rotation goes on from where question 0 left it
    [['tr', 'plain', 'pld'], ['plain', 'pld', 'tr']]
    """
    n = len(names)
    return [[names[(start + i) % n] for i in range(n)] for start in range(question * rounds, (question + 1) * rounds)]


def measure_question(runners: Sequence[MethodRunner], ids: list[int], max_new_tokens: int, rounds: int,
                     question: int, on_run: Callable[[], None] = lambda: None) -> dict[str, list[DecodeResult]]:
    """Decode one prompt ``rounds`` times with every runner, in the orders of ``round_orders``; each runner's results,
    in round order (``on_run`` is called after each decoding).

    Every round of a runner that carries its matrix starts from a copy of the matrix the runner held before the
    question, so that no round drafts from what an earlier round of the same question taught it (the rounds measure
    the same decoding). After the question the runner keeps the matrix its first round taught: the hot start carried
    to the next question is what one pass over the questions would carry."""
    by_name = {r.name: r for r in runners}
    before = {r.name: r.engine.matrix.clone() for r in runners if r.carries_matrix}
    taught = {}
    results: dict[str, list[DecodeResult]] = {name: [] for name in by_name}
    for order in round_orders(list(by_name), rounds, question):
        for name in order:
            engine = by_name[name].engine.with_matrix(before[name].clone()) if name in before else None
            results[name].append(by_name[name].run(ids, max_new_tokens, engine))
            if engine is not None:
                taught.setdefault(name, engine.matrix)
            on_run()
    for name, matrix in taught.items():
        by_name[name].engine = by_name[name].engine.with_matrix(matrix)
    return results


@torch.inference_mode()
def first_difference(engine: Engine, ids: list[int], plain: list[int], other: list[int]) -> dict:
    """Where an output first leaves plain decoding's, and the two tokens' logits there (from a forward over the
    common prefix): a near-tie shows as a tiny gap."""
    k = first_difference_at(plain, other)
    logits = engine.model(input_ids=torch.tensor([ids + plain[:k]], device=engine.model.device)).logits[0, -1].float()
    out = {"position": k, "plain_token": plain[k] if k < len(plain) else None,
           "method_token": other[k] if k < len(other) else None}
    for key in ("plain_token", "method_token"):
        if out[key] is not None:
            out[key.replace("token", "logit")] = round(float(logits[out[key]]), 5)
    if "plain_logit" in out and "method_logit" in out:
        out["gap"] = round(abs(out["plain_logit"] - out["method_logit"]), 5)
    return out


def parser(prog: str = "python -m tr_core.tools.bench") -> argparse.ArgumentParser:
    """The benchmark's options (``benchmark.py`` adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--questions", default=None, help="JSON-lines questions (default: the Spec-Bench copy in assets/)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="how many times every method decodes each question, the methods alternated in each round; "
                        "a method's time on a question is its median round. The run takes about this many times "
                        f"one pass (default {DEFAULT_ROUNDS}; 1 is the old single pass)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(ALL_METHODS)}, and tr-N (the N likeliest nodes, to compare "
                        "tree sizes)")
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=("exact", "fast"), default="exact")
    add_device_arguments(p)
    p.add_argument("--fit-context", type=int, default=None,
                   help="the context length (tokens) the auto tree's t(N) is calibrated on (default: t(N) averaged "
                        "over the questions' contexts, each its prompt plus half the new tokens)")
    p.add_argument("--out", default="bench_out", help="the folder results.json and report.md go to")
    p.add_argument("--temperatures", default=None,
                   help="comma-separated sampling temperatures, e.g. 0,0.3,0.7,1.0 (0: greedy): the benchmark runs "
                        "once per temperature and reports each (default: greedy only, as before)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed of --temperatures (default 0)")
    p.add_argument("--recalibrate-every", type=int, default=10,
                   help="measure t(N) again after every this many questions (0: only before and after the run), for "
                        "the prediction from t(N) through the run (default 10)")
    return p


def parse_temperatures(text: str | None) -> list[float | None]:
    """``--temperatures`` as a list (``[None]``: not given, greedy as before).

    >>> parse_temperatures("0, 0.7,1"), parse_temperatures(None)
    ([0.0, 0.7, 1.0], [None])
    """
    if text is None:
        return [None]
    values = [float(t) for t in text.split(",") if t.strip()]
    if not values or any(t < 0 for t in values):
        raise ValueError(f"--temperatures takes numbers >= 0, separated by commas; got {text!r}")
    return values


def record(question: Question, name: str, rounds: list[DecodeResult], plain_ids: list[int], base: Engine,
           ids: list[int]) -> Record:
    """A method's record of one question from its rounds: the median round, every round's time, and whether every
    round's output equals plain decoding's (the first that does not is looked at)."""
    res = median_round(rounds, seconds=lambda r: r.elapsed_s)
    differs = next((r.token_ids for r in rounds if r.token_ids != plain_ids), None)
    return Record(question.question_id, question.category, name, len(res.token_ids), res.steps, res.elapsed_s,
                  differs is None, [len(e.new_tokens) for e in res.events], sum(e.forward_ms for e in res.events),
                  sum(e.overhead_ms for e in res.events),
                  None if differs is None else first_difference(base, ids, plain_ids, differs),
                  [round(r.elapsed_s, 4) for r in rounds], sum(len(e.tree_tokens) - 1 for e in res.events))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "plain" not in methods:
        methods.insert(0, "plain")  # speedups are over plain decoding
    unknown = sorted(m for m in set(methods) - set(ALL_METHODS) if not _sized(m))
    if unknown or args.per_category < 1 or args.max_new_tokens < 1 or args.rounds < 1:
        p.error(f"unknown methods {unknown}" if unknown else
                "--per-category, --max-new-tokens and --rounds must be >= 1")
    if args.fit_context is not None and args.fit_context < 1:
        p.error("--fit-context must be >= 1")
    try:
        samplings = [None if t is None else Sampling(t, seed=args.seed)
                     for t in parse_temperatures(args.temperatures)]
    except ValueError as e:
        p.error(str(e))

    questions = stratified(load_questions(args.questions), args.per_category)
    try:
        base = Engine.load(args.model, EngineConfig(method="plain", tree="tiny", mode=args.mode, device=args.device,
                                                    backend=args.backend, rows=args.rows))
    except ValueError as e:
        p.error(str(e))
    prompts = [encode_prompt(base.tokenizer, q.prompt) for q in questions]
    # the tree is fitted for the contexts these questions decode over: a typical step of each sees its prompt and
    # about half of its answer, and t(N) is averaged over them (a step's cost is not linear in its context)
    fit_context = args.fit_context or question_contexts([len(ids) for ids in prompts], args.max_new_tokens)
    base = base.with_config(fit_context=fit_context)
    hot = Path(base.shipped_matrix_path()) if base.shipped_matrix_path() else None
    # t(N) measured anew now, before the engines fit their trees on it: a calibration cached hours ago, on a shared
    # machine, is no prediction for this run (it is measured again after the run, to show how far the machine moved)
    curve = step_curve(base, fit_context, remeasure=True)
    runners = build_runners(base, methods, hot, samplings[0])
    fitted = next((r.engine.fitted for r in runners if r.engine.fitted), None)
    print(f"mode {base.mode_note()}; {base.backend.describe()}; "
          f"torch threads {torch.get_num_threads()}")
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average {load_before:.1f} before the run: another process is using the CPU, and torch's "
              "threads slow down badly when they share cores; timings will be unreliable")
    print(f"hot start: {hot.name if hot else 'none (no shipped matrix: cold start)'}, carried across questions; "
          f"{args.rounds} round(s) a question, each from the matrix held before the question")
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

    plain_runner = next(r for r in runners if r.name == "plain")
    started = time.perf_counter()
    bar = tqdm(total=len(questions) * len(runners) * args.rounds * len(samplings), desc="benchmark", unit="run")
    by_temperature = {}
    # t(N) sampled through the run, at the sizes the fitted trees run: the machine's cost curve moves within minutes
    # (its t(4) / t(1) went from 1.10 to 1.24 during one 6-minute run here), which no calibration taken once foresees
    sizes = through_run_sizes([r.engine.tree.size for r in runners if r.engine.fitted], curve)
    through = [{n: interpolate(curve, n) for n in sizes}]
    for i, sampling in enumerate(samplings):  # the first temperature's runners are the ones warmed up above
        these = runners if i == 0 else build_runners(base, methods, hot, sampling)
        for qi, (q, ids) in enumerate(zip(questions, prompts)):
            rounds = measure_question(these, ids, args.max_new_tokens, args.rounds, qi, lambda: bar.update(1))
            # every round of plain gives the same tokens
            plain_ids = median_round(rounds["plain"], seconds=lambda r: r.elapsed_s).token_ids
            for r in these:
                r.records.append(record(q, r.name, rounds[r.name], plain_ids, base, ids))
            if i == 0 and args.recalibrate_every and (qi + 1) % args.recalibrate_every == 0 and qi + 1 < len(prompts):
                through.append(step_curve(base, fit_context, use_cache_file=False, sizes=sizes))
        if sampling is not None:
            by_temperature[f"{sampling.temperature:g}"] = {"sampling": sampling.describe(),
                                                           "methods": temperature_summary(these)}
    bar.close()
    curve_after = step_curve(base, fit_context, use_cache_file=False)
    through.append({n: interpolate(curve_after, n) for n in sizes})
    curve_through = {n: statistics.mean(c[n] for c in through) for n in sizes}

    # on the torch backend, plain decoding also ran unpadded (one row a pass): the faster of the two is the baseline
    unpadded = next((r for r in runners if r.name == UNPADDED), None)
    if unpadded is not None and (statistics.median(x.tokens / x.seconds for x in unpadded.records)
                                 > statistics.median(x.tokens / x.seconds for x in plain_runner.records)):
        plain_runner = unpadded
    plain_tps = {r.question_id: r.tokens / r.seconds for r in plain_runner.records}
    categories = list(dict.fromkeys(q.category for q in questions))
    results = {"methods": {}, "config": {
        "questions": len(questions), "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
        "mode": args.mode, "compiled": False, "dtype": str(base.model.dtype),
        "mode_note": base.mode_note(),
        "model": args.model or "embedded", "hot_start": hot.name if hot else None, "cpu": cpu_name(),
        "device": str(base.model.device), "machine": device_name(base.model.device), "backend": base.backend_name,
        "backend_note": base.backend.describe(), "rows": base.rows,
        "arguments": list(sys.argv[1:] if argv is None else argv),
        "sampling": (samplings[0] or Sampling()).describe(),
        "hot_start_carried_across_questions": True, "threads": torch.get_num_threads(),
        "t_n_ms": curve, "t_n_ms_after_run": curve_after, "t_n_ms_through_run": curve_through,
        "t_n_calibrations_through_run": len(through), "fit_context": describe_context(fit_context),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
        "fitted_tree": None if not fitted else {
            "nodes": fitted.tree.size, "depth": fitted.tree.max_depth,
            "node_paths": [list(p) for p in fitted.tree.node_paths],
            "predicted_mean_accepted_tokens": round(fitted.expected_accepted, 4),
            "predicted_speedup": round(fitted.predicted_speedup, 4), "table": fitted.table},
        "lookahead_size": next((r.engine.lookahead_size() for r in runners if r.name == "lookahead"), None),
        "rounds": args.rounds, "round_order": [r.name for r in runners],
        "rounds_note": "each round runs every method once, in round_order rotated by one place a round (and on "
                       "across questions); every round of a question starts Token Recycling from the matrix held "
                       "before the question, and the first round's matrix is carried on; a method's time on a "
                       "question is its median round (of an even count, the faster middle one)",
        "speedup_definition": SPEEDUP_DEFINITION,
        "speed_baseline": plain_runner.name,
        "speed_baseline_note": None if unpadded is None else (
            f"plain decoding ran padded to {base.rows} rows a pass (the reference every method's tokens are compared "
            f"with) and unpadded ({UNPADDED}); the faster, {plain_runner.name}, is the speed baseline; their tokens "
            + ("agree on every question" if all(x.identical for x in unpadded.records) else
               f"differ on {sum(not x.identical for x in unpadded.records)} question(s)")),
        "speedup_median_note": "speedup_median: the median over questions of a method's speedup (speedup_definition) "
                               "on each question; speedup_ci95: its percentile-bootstrap interval over questions; "
                               "verdict: faster / slower only where the interval excludes 1",
        "bootstrap": {**BOOTSTRAP, "min_questions_for_verdict": MIN_QUESTIONS_FOR_VERDICT},
    }}
    plain_token = summarize(plain_runner.records, plain_tps)["step_ms_per_token"]
    for r in runners:
        entry = summarize(r.records, plain_tps)
        entry.update(compare(ratios(r.records, plain_runner.records)))
        entry["by_category"] = {}
        for c in categories:
            mine = [x for x in r.records if x.category == c]
            if mine:
                entry["by_category"][c] = {**summarize(mine, plain_tps), **compare(ratios(mine, plain_runner.records))}
        entry["accepted_length_histogram"] = dict(sorted(
            Counter(n for x in r.records for n in x.accepted_lengths).items()))
        entry["steps_speedup"] = round(plain_token / entry["step_ms_per_token"], 4)  # the steps' own, prefill left out
        entry["round_spread_pct"] = round_spread_pct(r.records)
        if r.engine.fitted and r.method == "tr":
            entry["tree_nodes"] = r.engine.tree.size
            entry["predicted_mean_accepted_tokens"] = round(r.engine.fitted.expected_accepted, 4)
            entry["predicted_speedup"] = round(r.engine.fitted.predicted_speedup, 4)
            entry["predicted_speedup_through_run"] = round(speedup_on(r.engine.fitted.predicted_speedup,
                                                                      r.engine.tree.size, curve, curve_through), 4)
        elif r.method == "tr":
            entry["tree_nodes"] = r.engine.tree.size
        entry["first_differences"] = [{"question_id": x.question_id, **x.first_difference}
                                      for x in r.records if x.first_difference]
        results["methods"][r.name] = entry
    for entry in results["methods"].values():
        if "predicted_speedup" in entry:
            entry.update(predicted_vs_measured(entry, results["methods"]["plain"]))
    results["pairwise"] = pairwise({r.name: r.records for r in runners}, categories)
    if by_temperature:
        results["temperatures"] = by_temperature

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, runners, args)
    (out / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
