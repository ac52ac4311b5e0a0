"""The benchmark's report (``report.md``): Markdown tables of the results (``results.py``) per category and overall,
the pairwise comparisons, the fitted trees' predictions, the drift of the step times and the accepted lengths."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Protocol

from ..methods import METHODS
from ..stats import BOOTSTRAP, MIN_QUESTIONS_FOR_VERDICT
from .results import Record


class MethodRecords(Protocol):
    """What the report reads of a method's runs (``bench.MethodRunner``, ``bench.RecordsOf``)."""

    name: str
    records: list[Record]


def interval_text(s: dict) -> str:
    """``1.23x [1.10, 1.35]``: a median speedup and its 95% interval (``1.23x (1 question)`` without one)."""
    ci = s["speedup_ci95"]
    return f"{s['speedup_median']:.2f}x " + (f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "(1 question)")


def markdown_table(results: dict, category: str | None = None, machine: str | None = None) -> str:
    """A row per method: overall, or in one category, or on one machine's questions."""
    rows = ["| method | tokens/s | speedup: median [95% interval] | vs plain | speedup of means | "
            "mean accepted tokens | draft nodes per step | identical to plain | overhead ms/step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["methods"].items():
        s = m if category is None else m["by_category"].get(category)
        if machine is not None:
            s = m.get("by_machine", {}).get(machine)
        if s:
            rows.append(f"| {name} | {s['tokens_per_s']:.2f} | {interval_text(s)} | "
                        f"{'(baseline)' if name == 'plain' else s['verdict']} | {s['speedup']:.2f}x | "
                        f"{s['mean_accepted_tokens']:.2f} | {s.get('mean_draft_nodes', 0):.1f} | "
                        f"{s['identical']}/{s['questions']} | "
                        f"{s['overhead_ms_per_step']:.2f} |")
    return "\n".join(rows)


def run_lines(results: dict) -> list[str]:
    """Where the run ran: its shards, its workers and their machines, its wall time (a run folder's results; none
    for results written before the benchmark kept one).

    >>> config = {"shards": {"count": 2}, "workers": [
    ...     {"worker": "w0", "host": "a", "machine": "CPU X", "threads": 1, "questions": 3, "tree_nodes": 4},
    ...     {"worker": "w1", "host": "a", "machine": "CPU X", "threads": 1, "questions": 2, "tree_nodes": 2}],
    ...     "questions": 5, "wall_s": 720.0, "questions_per_worker_hour": 12.5, "sessions": [{}]}
    >>> print("\\n".join(run_lines({"config": config})[1:]))  # the first line: the shards, as said below
    Workers (each fitted its own tree on t(N) measured where it ran; every ratio is measured inside one worker):
    - w0 on a: CPU X, 1 thread(s), 3 question(s), fitted tree 4 nodes
    - w1 on a: CPU X, 1 thread(s), 2 question(s), fitted tree 2 nodes
    Wall time 720 s in 1 session(s); 12.5 questions a worker-hour.
    """
    config = results["config"]
    if "shards" not in config:
        return []
    lines = [f"Shards: {config['shards']['count']}, drawn stratified by category; each decoded on one worker, the "
             "hot-start matrix carried across its questions in a fixed order (results.json: config.shards), each "
             "from the shipped hot start.",
             "Workers (each fitted its own tree on t(N) measured where it ran; every ratio is measured inside one "
             "worker):"]
    lines += [f"- {w['worker']} on {w['host']}: {w['machine']}, {w['threads']} thread(s), {w['questions']} "
              f"question(s)" + (f", fitted tree {w['tree_nodes']} nodes" if w.get("tree_nodes") else "")
              for w in config["workers"]]
    if config.get("questions_planned", config["questions"]) > config["questions"]:
        lines.append(f"So far: {config['questions']} of the run's {config['questions_planned']} questions are "
                     "finished (every shard's first ones); the tables are theirs.")
    if not config["sessions"]:
        return lines + ["Wall time: the run's first session is still going."]
    lines.append(f"Wall time {config['wall_s']:.0f} s in {len(config['sessions'])} session(s)"
                 + (f"; {config['questions_per_worker_hour']:.1f} questions a worker-hour."
                    if config.get("questions_per_worker_hour") else "."))
    return lines


def pairwise_table(pairs: list[dict]) -> str:
    rows = ["| method | against | tokens/s ratio: median [95% interval] | verdict |", "|---|---|---|---|"]
    rows += [f"| {p['method']} | {p['against']} | {interval_text(p)} | {p['verdict']} |" for p in pairs]
    return "\n".join(rows)


def prediction_table(results: dict) -> str:
    """The fitted trees' predictions beside the measurements, with the two halves of a prediction apart: the tokens a
    step adds (MAT) and what a step costs over a plain step (predicted: t(N) / t(1) of the calibration; measured: the
    steps' forward + overhead over plain's)."""
    plain = results["methods"]["plain"]
    plain_step = plain["forward_ms_per_step"] + plain["overhead_ms_per_step"]
    rows = ["| method | nodes | predicted MAT | measured MAT | predicted step cost | measured step cost | "
            "predicted speedup (steps) | measured speedup (steps) | error | predicted tokens/s | measured tokens/s | "
            "error | measured speedup (median) | predicted with t(N) through the run (steps) | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, m in results["methods"].items():
        if "predicted_speedup" not in m:
            continue
        cost = m["predicted_mean_accepted_tokens"] / m["predicted_speedup"]
        measured_cost = (m["forward_ms_per_step"] + m["overhead_ms_per_step"]) / plain_step
        rows.append(f"| {n} | {m['tree_nodes']} | {m['predicted_mean_accepted_tokens']:.2f} | "
                    f"{m['mean_accepted_tokens']:.2f} | {cost:.2f}x | {measured_cost:.2f}x | "
                    f"{m['predicted_speedup']:.2f}x | {m['steps_speedup']:.2f}x | "
                    f"{m['predicted_steps_error_pct']:+.0f}% | "
                    f"{m['predicted_tokens_per_s']:.2f} | {m['tokens_per_s']:.2f} | "
                    f"{m['predicted_tokens_per_s_error_pct']:+.0f}% | {interval_text(m)} | " + (
                        f"{m['predicted_speedup_through_run']:.2f}x | "
                        f"{m['predicted_through_run_steps_error_pct']:+.0f}% |"
                        if "predicted_speedup_through_run" in m else "- | - |"))
    return "\n".join(rows)


def drift_line(before: dict, after: dict) -> str:
    """How the calibration moved during the run: t(N) / t(1) before and after, for a few N.

    >>> drift_line({1: 10.0, 4: 11.0, 8: 15.0}, {1: 12.0, 4: 14.4, 8: 18.0})
    't(N) / t(1), measured before the run -> after it: 4: 1.10 -> 1.20, 8: 1.50 -> 1.50; t(1) 10.0 -> 12.0 ms'
    """
    one_b, one_a = before[min(before)], after[min(after)]
    parts = [f"{n}: {before[n] / one_b:.2f} -> {after[n] / one_a:.2f}"
             for n in (2, 4, 8, 16) if n in before and n in after]
    return (f"t(N) / t(1), measured before the run -> after it: {', '.join(parts)}; "
            f"t(1) {one_b:.1f} -> {one_a:.1f} ms")


def histogram(records: list[Record]) -> str:
    counts = Counter(n for r in records for n in r.accepted_lengths)
    total = sum(counts.values())
    return "  ".join(f"{n}:{100 * counts[n] / total:.0f}%" for n in sorted(counts))


# The paper's comparison of the training-free methods (``Method.paper_a100``), in its order: fastest first.
PAPER_A100 = dict(sorted(((m.name, m.paper_a100) for m in METHODS.values() if m.paper_a100), key=lambda x: -x[1][0]))


def paper_table(results: dict) -> str:
    """The training-free methods the paper compares, measured here beside the paper's A100 figures, in the paper's
    order; "" when the run has none of them.

    >>> m = dict(speedup_median=1.1, speedup_ci95=[1.0, 1.2], mean_accepted_tokens=1.3)
    >>> print(paper_table({"methods": {"plain": m, "lookahead": m}}))
    | method | here: speedup [95%] | here: tokens per pass | paper, A100: speedup | paper, A100: tokens per pass |
    |---|---|---|---|---|
    | lookahead | 1.10x [1.00, 1.20] | 1.30 | 1.34x | 1.64 |
    """
    rows = [f"| {name} | {interval_text(results['methods'][name])} | "
            f"{results['methods'][name]['mean_accepted_tokens']:.2f} | {speedup:.2f}x | {mat:.2f} |"
            for name, (speedup, mat) in PAPER_A100.items() if name in results["methods"]]
    if not rows:
        return ""
    return "\n".join(["| method | here: speedup [95%] | here: tokens per pass | paper, A100: speedup | "
                      "paper, A100: tokens per pass |", "|---|---|---|---|---|"] + rows)


def temperature_table(by_temperature: dict) -> str:
    """The report's table: one row per temperature and method."""
    rows = ["| temperature | method | speedup: median [95% interval] | mean accepted tokens | identical to plain |",
            "|---|---|---|---|---|"]
    rows += [f"| {t} | {name} | {interval_text(m)} | {m['mean_accepted_tokens']:.2f} | "
             f"{m['identical']}/{m['questions']} |" for t, entry in by_temperature.items()
             for name, m in entry["methods"].items()]
    return "\n".join(rows)


def report(results: dict, runners: list[MethodRecords], args: argparse.Namespace) -> str:
    """report.md: the speedup tables (overall, each category, each pair of methods), where the time went, the fitted
    trees' predictions against what was measured, accepted lengths and first differences from plain."""
    n = results["config"]["questions"]
    lines = [f"# Spec-Bench, {n} questions, {args.max_new_tokens} new tokens, mode {args.mode}, "
              f"{args.rounds} round(s)", "",
              f"Each question decoded {args.rounds} time(s) by every method, the methods alternated in each round and "
              "the order rotated between rounds; a method's time on a question is its median round. Speedup: the "
              "median over questions of the method's tokens/s over plain's on the same question, with a 95% "
              f"bootstrap interval over the questions ({BOOTSTRAP['resamples']} resamples); \"faster\" or "
              "\"slower\" only where the interval excludes 1, and no verdict from fewer than "
              f"{MIN_QUESTIONS_FOR_VERDICT} questions. \"speedup of means\": mean tokens/s over plain's mean. "
              "Token Recycling starts every round of a question from the same matrix (carried from the question "
              "before in its shard).", "", *run_lines(results), "", "## overall", markdown_table(results)]
    if len(results["config"].get("machines", [])) > 1:
        for machine in results["config"]["machines"]:
            lines += ["", f"## overall, on {machine} alone", markdown_table(results, machine=machine)]
    if paper_table(results):
        lines += ["", "## the paper's training-free comparison: here, and the paper's A100 figures",
                  "The paper's figures: Token Recycling (arXiv 2408.08696) citing Spec-Bench's leaderboard, Vicuna-7B "
                  "on one A100, greedy. Here: this run's model, machine and mode; per category in the tables below.",
                  "", paper_table(results)]
    for c in dict.fromkeys(c for m in results["methods"].values() for c in m["by_category"]):
        lines += ["", f"## {c}", markdown_table(results, c)]
    if results["pairwise"]:
        lines += ["", "## method against method (overall)", pairwise_table(results["pairwise"])]
    lines += ["", "## rounds: how far a method's rounds of one question lay apart (median over questions)"]
    lines += [f"- {name}: {m['round_spread_pct']:.1f}%" for name, m in results["methods"].items()]
    plain_step = (results["methods"]["plain"]["forward_ms_per_step"]
                  + results["methods"]["plain"]["overhead_ms_per_step"])
    lines += ["", f"## per-step work outside the model forward, as a share of one plain step ({plain_step:.1f} ms)"]
    lines += [f"- {n}: {m['overhead_ms_per_step']:.2f} ms ({100 * m['overhead_ms_per_step'] / plain_step:.1f}%)"
               for n, m in results["methods"].items()]
    lines += ["", "## where the time went (steps only, then the whole question with its prefill)",
               "| method | forward ms/step | overhead ms/step | mean accepted tokens | step ms per token | "
               "speedup of the steps | s per question outside steps | speedup of means |",
               "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {m['forward_ms_per_step']:.1f} | {m['overhead_ms_per_step']:.2f} | "
               f"{m['mean_accepted_tokens']:.2f} | {m['step_ms_per_token']:.1f} | "
               f"{m['steps_speedup']:.2f}x | {m['outside_steps_s_per_question']:.2f} | "
               f"{m['speedup']:.2f}x |" for n, m in results["methods"].items()]
    if any("predicted_speedup" in m for m in results["methods"].values()):
        lines += ["", "## fitted trees: predicted (acceptance statistics + t(N)) vs measured",
                   "The prediction is per step: it is set against the steps' own speedup, and, times plain's measured "
                   "tokens/s, against the measured tokens/s, which also carry each question's prefill. Error: "
                   "predicted / measured - 1. Step cost: a step's time over a plain step's. The prediction is made "
                   "from t(N) measured just before the run (what the engines fitted their trees on); the last two "
                   "columns put the same expected tokens over t(N) averaged over calibrations through the run "
                   f"({results['config'].get('t_n_calibrations_through_run', 0)}: before, every "
                   f"{args.recalibrate_every} questions, after), which separates the model's error from the "
                   "machine's drift.", "",
                   prediction_table(results)]
        if results["config"].get("t_n_ms_after_run"):
            lines += ["", drift_line({int(k): v for k, v in results["config"]["t_n_ms"].items()},
                                     {int(k): v for k, v in results["config"]["t_n_ms_after_run"].items()})]
    lines += ["", "## accepted tokens per step (share of steps)"]
    lines += [f"- {r.name}: {histogram(r.records)}" for r in runners]
    if "temperatures" in results:
        lines += ["", f"## per temperature (sampled with seed {args.seed}; 0: greedy)",
                  "Speedup: the median over questions of tokens/s over plain's at the same temperature; identical: "
                  "outputs equal to plain sampling's with the same seed. The sections above are temperature "
                  f"{next(iter(results['temperatures']))}'s.", "", temperature_table(results["temperatures"])]
    diffs = [(name, d) for name, m in results["methods"].items() for d in m["first_differences"]]
    if diffs:
        lines += ["", "## first differences from plain (logits at the first differing position)"]
        lines += [f"- {name} q{d['question_id']} @ {d['position']}: plain {d.get('plain_token')} "
                   f"({d.get('plain_logit')}) vs {d.get('method_token')} ({d.get('method_logit')}), gap {d.get('gap')}"
                   for name, d in diffs]
    return "\n".join(lines)
