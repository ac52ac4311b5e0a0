"""The benchmark with its charts: ``tr_core.tools.bench`` measures (results.json, report.md), then ``visualize`` draws
speedup.html and tree_size.html from results.json. Like ``app.py``, this file sits above both packages: ``tr_core``
knows nothing of plotly, and ``visualize`` nothing of torch.

    python benchmark.py --per-category 5 --max-new-tokens 128 --mode exact   # any option of tr_core.tools.bench
    python benchmark.py --charts-only --out bench_out                        # the charts of a finished run, again
    python benchmark.py --resume bench_out --ray                             # go on with a stopped run, then draw
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tr_core.tools import bench
from visualize.charts import speedup_figure, tree_size_figure

CHARTS = {"speedup.html": speedup_figure, "tree_size.html": tree_size_figure}


def draw_charts(out: Path) -> list[Path]:
    """Draw each chart of the benchmark whose ``results.json`` is in ``out`` into ``out``; the files written."""
    results = json.loads((out / "results.json").read_text())
    for name, figure in CHARTS.items():
        figure(results).write_html(out / name, include_plotlyjs=True)
    return [out / name for name in CHARTS]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = bench.parser(prog="python benchmark.py")
    p.description = ("The Spec-Bench benchmark of python -m tr_core.tools.bench, then its charts, drawn from "
                     "results.json.")
    p.add_argument("--charts-only", action="store_true",
                   help="draw the charts of the results.json already in --out, without benchmarking")
    args = p.parse_args(argv)
    out = Path(args.resume or args.out)  # a resumed run's folder is its own
    if args.charts_only:
        given = [k for k in vars(args) if k not in ("out", "charts_only") and getattr(args, k) != p.get_default(k)]
        if given:
            p.error("--charts-only measures nothing: it takes --out only")
        if not (out / "results.json").is_file():
            p.error(f"no {out / 'results.json'} to draw: run the benchmark first")
    else:
        status = bench.main(argv)  # the same options, without --charts-only
        if status:
            return status
    print("charts: " + ", ".join(str(path) for path in draw_charts(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
