"""The figures of benchmark runs that the app quotes (the "How it works" tab's step on the methods beyond the
paper), kept small and shipped: one entry per run (per mode), read from the runs' ``results.json``.

    python -m tr_core.bench_summary bench_exact bench_fast [--to assets/benchmarks/beyond_paper.json]

Each entry gives the run's setting (machine, mode, questions, new tokens, rounds, the benchmark's arguments) and,
per method, its median speedup over plain with the 95% interval and verdict, tokens per forward pass, draft nodes
per step, how many outputs equal plain decoding's, and the median speedup per category; and each method's median
speedup over Token Recycling (``tr``) and Prompt Lookup (``pld``), question by question, with its interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .assets import BEYOND_PAPER

METHOD_KEYS = ("speedup_median", "speedup_ci95", "verdict", "mean_accepted_tokens", "mean_draft_nodes", "identical",
               "questions", "tokens_per_s")
SETTING_KEYS = ("mode", "mode_note", "cpu", "threads", "questions", "per_category", "max_new_tokens", "rounds",
                "arguments")


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
    pairs = [{**{k: pair[k] for k in ("method", "against", "speedup_median", "speedup_ci95", "verdict") if k in pair},
              "by_category": {c: v["speedup_median"] for c, v in pair.get("by_category", {}).items()}}
             for pair in results.get("pairwise", []) if pair.get("against") in ("tr", "pld")]
    return {**{k: config[k] for k in SETTING_KEYS if k in config}, "methods": methods, "pairwise": pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tr_core.bench_summary", description=__doc__.splitlines()[0])
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
    out.write_text(json.dumps({"built_by": "python -m tr_core.bench_summary " + " ".join(args.runs),
                               "runs": entries}, indent=1) + "\n")
    print(f"{out}: {len(entries)} run(s), " + ", ".join(f"{e.get('mode')} ({len(e['methods'])} methods)"
                                                        for e in entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
