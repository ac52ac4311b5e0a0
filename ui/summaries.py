"""What a finished live run and a finished race measured, as plain data: the JSON that ends ``/live``
(``run_summary``) and ``/race`` (``race_summary``), the same figures the page shows. One speedup throughout:
``tr_core.stats.speedup`` (``SPEEDUP_DEFINITION``), as the benchmark computes it.

    summary = run_summary(record, settings, rates, matrix_history)
    summary["speedup"], summary["speedup_definition"]
"""

from __future__ import annotations

from statistics import mean
from typing import Mapping, Sequence

from tr_core.events import Rates, StepEvent
from tr_core.projection import Shape, fitted_here, projection
from tr_core.stats import SPEEDUP_DEFINITION, speedup

from .records import Baseline, RaceRun, RaceSummary


def draft_nodes_per_step(events: Sequence[StepEvent]) -> float:
    """The mean number of draft nodes a step verified (the root, the last accepted token, not counted)."""
    return mean(len(e.tree_tokens) - 1 for e in events) if events else 0.0


def projected(events: Sequence[StepEvent], profile: dict | None, measured: float | None) -> list[dict]:
    """What the run's steps (tree sizes, tokens, host work measured here) would give on other hardware
    (``tr_core.projection``), this machine first with its ``measured`` speedup; ``profile`` is
    ``tr_core.speed.machine_profile``'s (``None``: none could be taken, no projection)."""
    if not profile or not events:
        return []
    shape = Shape(profile["parameters"], profile["layers"])
    here = fitted_here(profile["curve"], shape, profile["bandwidth_gbs"], profile["bytes_per_weight"])
    steps = [(len(e.tree_tokens), len(e.new_tokens), e.overhead_ms) for e in events]
    return projection(steps, shape, here, profile["curve"], measured)


def run_summary(method: str, tree: str, events: Sequence[StepEvent], rates: Rates, baseline: Baseline | None,
                matrix_history: str, profile: dict | None = None) -> dict:
    """A live run's figures: its speed and plain decoding's measured beside it (``baseline``; ``None``: not
    measured, e.g. stopped), with one speedup definition."""
    plain = baseline.tokens_per_s if baseline else None
    # rounded once, here: the projection's row for this machine rounds this figure again, so both agree (rounding the
    # raw ratio 0.57949 to 3 places gives 0.579, where the summary's 0.5795 gives 0.58)
    ratio = None if plain is None else round(speedup(rates.tokens_per_s, plain), 4)
    return {"method": method, "tree": tree, "steps": len(events), "tokens": rates.tokens,
            "draft_nodes_per_step": round(draft_nodes_per_step(events), 3),
            "tokens_per_forward_pass": round(rates.mean_accepted_tokens, 3),
            "tokens_per_s": round(rates.tokens_per_s, 3),
            "plain_tokens_per_s": None if plain is None else round(plain, 3),
            "speedup": ratio,
            "speedup_definition": SPEEDUP_DEFINITION,
            "baseline": baseline.source if baseline else "not measured (the run was stopped)",
            "identical_to_plain": baseline.identical if baseline else None,
            "matrix_history": matrix_history,
            "projection": projected(events, profile, ratio)}


def race_summary_data(summary: Mapping[str, RaceSummary], rounds: Mapping[str, Sequence[RaceRun]], verdict: str,
                      matrix_history: str, runs: Mapping[str, RaceRun] | None = None,
                      profile: dict | None = None) -> dict:
    """A race's figures per method (``ui.records.race_summary``'s medians and ranges over the rounds), with the
    final verdict, and what Token Recycling's (else the first method's) median round would give on other hardware
    (``projection``, from ``runs``, the median rounds)."""
    methods = {}
    for name, s in summary.items():
        events = [e for run in rounds[name] for e in run.events]
        methods[name] = {"median_tokens_per_s": round(s.tokens_per_s.median, 3),
                         "min_tokens_per_s": round(s.tokens_per_s.low, 3),
                         "max_tokens_per_s": round(s.tokens_per_s.high, 3),
                         "speedup": round(s.speedup.median, 4),
                         "speedup_range": [round(s.speedup.low, 4), round(s.speedup.high, 4)],
                         "tokens_per_forward_pass": round(s.tokens_per_pass, 3),
                         "draft_nodes_per_step": round(draft_nodes_per_step(events), 3),
                         "rounds": s.rounds, "identical": s.identical}
    shown = "tr" if "tr" in summary else next((m for m in summary if m != "plain"), None)
    rows = projected(runs[shown].events, profile, methods[shown]["speedup"]) if runs and shown else []
    return {"methods": methods, "speedup_definition": SPEEDUP_DEFINITION, "matrix_history": matrix_history,
            "verdict": verdict, "projection": [{"method": shown, **row} for row in rows]}
