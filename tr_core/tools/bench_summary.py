"""The figures of benchmark runs that the app quotes (the "How it works" tab's step on the methods beyond the
paper), kept small and shipped: one entry per run (per mode), read from the runs' ``results.json``.

    python -m tr_core.tools.bench_summary bench_exact bench_fast [--to assets/benchmarks/beyond_paper.json]

Each entry gives the run's setting (machine, mode, questions, new tokens, rounds, the benchmark's arguments) and,
per method, its median speedup over plain with the 95% interval and verdict, tokens per forward pass, draft nodes
per step, how many outputs equal plain decoding's, and the median speedup per category; and each method's median
speedup over Token Recycling (``tr``) and Prompt Lookup (``pld``), question by question, with its interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..assets import BEYOND_PAPER

METHOD_KEYS = ("speedup_median", "speedup_ci95", "verdict", "mean_accepted_tokens", "mean_draft_nodes", "identical",
               "questions", "tokens_per_s")
SETTING_KEYS = ("mode", "mode_note", "cpu", "threads", "questions", "per_category", "max_new_tokens", "rounds",
                "arguments")


FLIPPED_VERDICT = {"faster": "slower", "slower": "faster"}


def facing(pair: dict, against: str) -> dict:
    """A pairwise comparison turned to face ``against`` (``"tr"`` or ``"pld"``): the benchmark compares each later
    method with each earlier one, so a pair may come the other way round; its ratio, interval and verdict flip.

    >>> pair = {"method": "tr", "against": "tr-plus", "speedup_median": 0.8, "speedup_ci95": [0.5, 1.0],
    ...         "verdict": "slower", "by_category": {"qa": {"speedup_median": 0.5}}}
    >>> facing(pair, "tr")  # doctest: +NORMALIZE_WHITESPACE
    {'method': 'tr-plus', 'against': 'tr', 'speedup_median': 1.25, 'speedup_ci95': [1.0, 2.0], 'verdict': 'faster',
     'by_category': {'qa': 2.0}}
    """
    by_category = {c: v["speedup_median"] for c, v in pair.get("by_category", {}).items()}
    if pair["against"] == against:
        return {**{k: pair[k] for k in ("method", "against", "speedup_median", "speedup_ci95", "verdict") if k in pair},
                "by_category": by_category}
    ci = pair.get("speedup_ci95")
    return {"method": pair["against"], "against": against, "speedup_median": round(1 / pair["speedup_median"], 4),
            "speedup_ci95": [round(1 / ci[1], 4), round(1 / ci[0], 4)] if ci else ci,
            "verdict": FLIPPED_VERDICT.get(pair.get("verdict"), pair.get("verdict")),
            "by_category": {c: round(1 / v, 4) for c, v in by_category.items()}}


def summarize_run(results: dict) -> dict:
    """One run's entry, from its ``results.json`` as a dict.

    >>> entry = summarize_run({"config": {"mode": "exact", "questions": 6}, "methods": {"tr": {
    ...     "speedup_median": 1.1, "by_category": {"qa": {"speedup_median": 1.2}}}}})
    >>> entry["mode"], entry["methods"]["tr"], entry["pairwise"]
    ('exact', {'speedup_median': 1.1, 'by_category': {'qa': 1.2}}, [])
    """
    config = results["config"]
    methods = {}
    for name, m in results["methods"].items():
        methods[name] = {k: m[k] for k in METHOD_KEYS if k in m}
        methods[name]["by_category"] = {c: v["speedup_median"] for c, v in m.get("by_category", {}).items()}
    pairs = [facing(pair, against) for pair in results.get("pairwise", []) for against in ("tr", "pld")
             if against in (pair.get("method"), pair.get("against")) and pair.get("method") != pair.get("against")]
    pairs = [p for p in pairs if p["method"] not in ("tr", "pld") or p["method"] > p["against"]]
    return {**{k: config[k] for k in SETTING_KEYS if k in config}, "methods": methods, "pairwise": pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.tools.bench_summary", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="benchmark output folders (each with a results.json)")
    p.add_argument("--to", default=str(BEYOND_PAPER), help="the summary file to write")
    args = p.parse_args(argv)
    entries = []
    for folder in args.runs:
        path = Path(folder) / "results.json"
        if not path.is_file():
            p.error(f"no {path}: run the benchmark first (python benchmark.py --out {folder} ...)")
        entries.append(summarize_run(json.loads(path.read_text())))
    out = Path(args.to)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"built_by": "python -m tr_core.tools.bench_summary " + " ".join(args.runs),
                               "runs": entries}, indent=1) + "\n")
    print(f"{out}: {len(entries)} run(s), " + ", ".join(f"{e.get('mode')} ({len(e['methods'])} methods)"
                                                        for e in entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
