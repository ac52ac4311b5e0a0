"""The benchmark's results, computed from its records (plain data, no model): per method and category its speedup
over plain decoding with a bootstrap interval (``tr_core.stats``), pairwise comparisons, the fitted trees' predictions
against what was measured, and how far rounds lay apart."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from ..modes import interpolate
from ..stats import compare, speedup


@dataclass
class Record:
    """One method on one question: its median round (``seconds`` and everything else from that round), and every
    round's time."""
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
    round_seconds: list[float] = field(default_factory=list)
    draft_nodes: int = 0  # draft nodes verified over the median round's steps (root not counted)


def ratios(records: Sequence[Record], against: Sequence[Record]) -> list[float]:
    """Per question, a method's tokens/s over another's on the same question (``records``' order)."""
    base = {r.question_id: r.tokens / r.seconds for r in against}
    return [speedup(r.tokens / r.seconds, base[r.question_id]) for r in records]


def pairwise(records: dict[str, list[Record]], categories: Sequence[str]) -> list[dict]:
    """Every pair of methods other than plain, each later one in ``records`` against each earlier one: the median
    ratio of their tokens/s per question, with its interval and verdict, overall and per category."""
    names = [n for n in records if n != "plain"]
    pairs = []
    for i, against in enumerate(names):
        for name in names[i + 1:]:
            entry = {"method": name, "against": against, "questions": len(records[name]),
                     **compare(ratios(records[name], records[against])), "by_category": {}}
            for c in categories:
                mine = [r for r in records[name] if r.category == c]
                if mine:
                    entry["by_category"][c] = {"questions": len(mine), **compare(
                        ratios(mine, [r for r in records[against] if r.category == c]))}
            pairs.append(entry)
    return pairs


def predicted_vs_measured(entry: dict, plain: dict) -> dict:
    """A fitted tree's prediction next to what was measured: the prediction is per step (expected accepted tokens
    over the calibrated t(N)), so it is set against the steps' own speedup, and, times plain's measured tokens/s,
    against the end-to-end tokens/s (which also carry each question's prefill). Errors in % of the measured."""
    predicted_tps = entry["predicted_speedup"] * plain["tokens_per_s"]
    return {"predicted_tokens_per_s": round(predicted_tps, 3),
            "predicted_tokens_per_s_error_pct": round(100 * (predicted_tps / entry["tokens_per_s"] - 1), 1),
            "predicted_steps_error_pct": round(100 * (entry["predicted_speedup"] / entry["steps_speedup"] - 1), 1),
            **({"predicted_through_run_steps_error_pct": round(
                100 * (entry["predicted_speedup_through_run"] / entry["steps_speedup"] - 1), 1)}
               if "predicted_speedup_through_run" in entry else {})}


def summarize(records: list[Record], plain_tps: dict[int, float]) -> dict:
    tps = [r.tokens / r.seconds for r in records]
    base = [plain_tps[r.question_id] for r in records]
    return {
        "tokens_per_s": round(statistics.mean(tps), 3),
        "speedup": round(statistics.mean(tps) / statistics.mean(base), 4),
        "mean_accepted_tokens": round(sum(r.tokens for r in records) / sum(r.steps for r in records), 4),
        "mean_draft_nodes": round(sum(r.draft_nodes for r in records) / sum(r.steps for r in records), 3),
        "identical": sum(r.identical for r in records),
        "questions": len(records),
        "forward_ms_per_step": round(sum(r.forward_ms for r in records) / sum(r.steps for r in records), 3),
        "overhead_ms_per_step": round(sum(r.overhead_ms for r in records) / sum(r.steps for r in records), 3),
        # where the time went: the decoding steps per generated token, and what each question spent outside its
        # steps (the prompt's prefill, which every method pays alike, and a drafter's seeding from it)
        "step_ms_per_token": round(
            sum(r.forward_ms + r.overhead_ms for r in records) / sum(r.tokens for r in records), 3),
        "outside_steps_s_per_question": round(statistics.mean(
            r.seconds - (r.forward_ms + r.overhead_ms) / 1e3 for r in records), 4),
    }


def through_run_sizes(tree_sizes: list[int], curve: dict[int, float]) -> tuple[int, ...]:
    """The sizes t(N) is sampled at through a run: one token, each fitted tree's size, and the calibrated sizes in
    between (so that the curve interpolates as before).

    >>> through_run_sizes([4, 2], {1: 1, 2: 1, 3: 1, 4: 1, 6: 1, 8: 1})
    (1, 2, 3, 4)
    """
    top = max(tree_sizes, default=1)
    return tuple(sorted({1, *tree_sizes, *(n for n in curve if n <= top)}))


def speedup_on(speedup: float, nodes: int, fitted_on: dict[int, float], other: dict[int, float]) -> float:
    """A fitted tree's predicted speedup (expected tokens per step over t(N) / t(1)) with t(N) from ``other`` in place
    of the curve it was fitted on: the expected tokens stay, the step cost changes.

    >>> speedup_on(1.3, 4, {1: 20.0, 4: 22.0}, {1: 19.0, 4: 23.75})
    1.144
    """
    cost_then = interpolate(fitted_on, nodes) / interpolate(fitted_on, 1)
    return round(speedup * cost_then / (interpolate(other, nodes) / interpolate(other, 1)), 6)


def temperature_summary(runners: Sequence) -> dict:
    """One temperature's result per method (``runners``: the benchmark's, each with ``name`` and ``records``): the
    median per-question speedup over plain (with its interval), mean accepted tokens (tokens per pass) and how many
    outputs equal plain's at the same temperature and seed."""
    plain = next(r for r in runners if r.name == "plain")
    plain_tps = {r.question_id: r.tokens / r.seconds for r in plain.records}
    out = {}
    for r in runners:
        entry = summarize(r.records, plain_tps)
        out[r.name] = {**compare(ratios(r.records, plain.records)),
                       **{k: entry[k] for k in ("mean_accepted_tokens", "identical", "questions", "tokens_per_s")}}
    return out


def round_spread_pct(records: list[Record]) -> float:
    """How far a method's rounds of one question lay apart, (slowest - fastest) / median, median over questions in
    %: the drift that the rounds were there to absorb."""
    return round(100 * statistics.median((max(r.round_seconds) - min(r.round_seconds)) / statistics.median(
        r.round_seconds) for r in records), 1)
