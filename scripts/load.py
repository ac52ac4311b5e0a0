"""A bounded load on the app, on 127.0.0.1: N clients (each its own session), each M live runs, within a time limit.

    .venv/bin/python scripts/load.py --clients 8 --runs 5 --tokens 32          # launches the app in this process
    .venv/bin/python scripts/load.py --url http://127.0.0.1:7860/ ...           # or loads a running one (no RSS)

Prints, and with ``--json FILE`` writes: each request's wait in the queue (submit to its first update) and its run
time (first update to the end) as percentiles, the runs served per minute, the process's RSS over time (start, peak,
end, per run) and whether every answer equals the same prompt's answer run alone before the load. Nothing leaves
127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from html import unescape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")

PROMPTS = ["Name three colours.", "Explain how a bicycle works, in a few sentences.", "Write a haiku about rain.",
           "What is the capital of France?", "Give two tips for sleeping well."]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def answer_text(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", "", html))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"p50": round(pick(0.5), 3), "p90": round(pick(0.9), 3), "max": round(ordered[-1], 3)}


def launch() -> tuple[str, object]:
    import app
    from ui.gradio_fix import limit_malloc_arenas
    from ui.models import ModelCache

    limit_malloc_arenas()  # as app.main does, so that the RSS reported is the app's
    models = ModelCache()
    app.preload(models)
    demo = app.build_app(models)
    _, url, _ = app.launch(demo, server_name="127.0.0.1", prevent_thread_lock=True,
                           quiet=True)
    return url, demo


def run_load(url: str, clients: int, runs: int, tokens: int, limit_s: float, sample_rss: bool) -> dict:
    from gradio_client import Client

    solo = {}
    reference = Client(url, verbose=False)
    for prompt in PROMPTS:  # each prompt alone first: what every answer under load must equal
        solo[prompt] = answer_text(reference.predict(prompt, tokens, "small", 8, True, "", api_name="/live")[0])
    rss, stop = [], threading.Event()

    def sampler():
        started = time.perf_counter()
        while not stop.is_set():
            rss.append((round(time.perf_counter() - started, 2), round(rss_mb(), 1)))
            stop.wait(0.5)

    if sample_rss:
        threading.Thread(target=sampler, daemon=True).start()
    results, lock, deadline = [], threading.Lock(), time.perf_counter() + limit_s

    def user(index: int):
        c = Client(url, verbose=False)
        for r in range(runs):
            if time.perf_counter() > deadline:
                return
            prompt = PROMPTS[(index + r) % len(PROMPTS)]
            submitted = time.perf_counter()
            job = c.submit(prompt, tokens, "small", 8, True, "", api_name="/live")
            first = None
            for _ in job:
                first = first or time.perf_counter()
            final = job.result()
            ended = time.perf_counter()
            with lock:
                results.append({"client": index, "wait_s": (first or ended) - submitted,
                                "run_s": ended - (first or ended), "same": answer_text(final[0]) == solo[prompt]})

    started = time.perf_counter()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    stop.set()
    peak = max((m for _, m in rss), default=float("nan"))
    return {
        "clients": clients, "runs_each": runs, "tokens": tokens, "runs": len(results), "elapsed_s": round(elapsed, 1),
        "runs_per_minute": round(60 * len(results) / elapsed, 2) if elapsed else 0.0,
        "wait_s": percentiles([r["wait_s"] for r in results]), "run_s": percentiles([r["run_s"] for r in results]),
        "identical_to_solo": sum(r["same"] for r in results), "mean_run_s": round(statistics.mean(
            r["run_s"] for r in results), 3) if results else None,
        "rss_mb": {"start": rss[0][1], "peak": peak, "end": rss[-1][1],
                   "per_run": round((rss[-1][1] - rss[0][1]) / max(1, len(results)), 3), "samples": rss}
        if rss else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--runs", type=int, default=3, help="live runs per client")
    p.add_argument("--tokens", type=int, default=32, help="max new tokens per run")
    p.add_argument("--limit-s", type=float, default=600, help="no run starts after this many seconds")
    p.add_argument("--url", default=None, help="an app already running (default: launch one in this process)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    demo = None
    url = args.url
    if url is None:
        url, demo = launch()
    try:
        report = run_load(url, args.clients, args.runs, args.tokens, args.limit_s, sample_rss=demo is not None)
    finally:
        if demo is not None:
            demo.close()
    shown = {k: v for k, v in report.items() if k != "rss_mb"}
    print(json.dumps(shown))
    if report["rss_mb"]:
        r = report["rss_mb"]
        print(f"RSS: {r['start']} MB at the start, {r['peak']} MB at the peak, {r['end']} MB at the end "
              f"({r['per_run']:+.3f} MB a run)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["identical_to_solo"] == report["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
