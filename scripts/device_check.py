"""The device check: on a machine with a CUDA GPU (no network, no gradio, no gguf), within 8 minutes, the figures
issue 45 asks for. Run it as ``bash scripts/device_check.sh`` (it runs the tests marked ``cuda`` first).

The embedded model's weights (98 MB as GGUF, 538 MB as fp32) do not travel to such a machine (64 MiB a copy), so it
runs a model of the embedded model's config with random weights (``assets/device_check/``): the timings (t(N), host
work a step) and the identity of every method are the real model's shape's; its drafts are rarely accepted, so the
tokens per pass of the speedups come from the embedded model decoded here (on a CPU): for ``tr`` and ``tr-paper``
the shipped acceptance statistics (Spec-Bench questions decoded with the paper's tree), fitted to this device's
t(N) by the same chooser; for ``pld`` and ``tr-context`` the shipped benchmark (exact mode). Each line says which.

    python scripts/device_check.py --prepare   # here, on a CPU: the prompts, tokenized by the embedded tokenizer
    python scripts/device_check.py             # there: the figures (--device cpu --backend torch: the same here)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HERE = ROOT / "assets" / "device_check"
CONFIG = HERE / "smollm2-135m-instruct.config.json"
PROMPTS = HERE / "prompts.json"
METHODS = ("plain", "pld", "tr", "tr-paper", "tr-context")
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81, 96, 128)


def prepare(per_category: int) -> None:
    from tr_core.models import encode_prompt, load_model
    from tr_core.spec_bench import load_questions, stratified
    _, tokenizer = load_model(None)
    questions = stratified(load_questions(), per_category)
    prompts = [{"id": q.question_id, "category": q.category, "ids": encode_prompt(tokenizer, q.prompt)}
               for q in questions]
    PROMPTS.write_text(json.dumps({"built_by": "python scripts/device_check.py --prepare", "prompts": prompts}))
    print(f"wrote {PROMPTS}: {len(prompts)} prompts")


def random_model(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig
    fields = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    config = LlamaConfig(**fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.config._name_or_path = "smollm2-135m-instruct"  # the embedded model's shipped statistics apply
    return model


def shipped_tokens_per_pass() -> dict[str, float]:
    runs = json.loads((ROOT / "assets" / "benchmarks" / "beyond_paper.json").read_text())["runs"]
    exact = next(r for r in runs if r["mode"] == "exact")
    return {m: e["mean_accepted_tokens"] for m, e in exact["methods"].items()}


def decode_all(engine, prompts, new_tokens: int) -> dict:
    from tr_core.decoding import run
    out = {}
    for method in METHODS:
        name, tree = ("tr", "paper") if method == "tr-paper" else (method, engine.config.tree)
        eng = engine.with_config(tree=tree) if tree != engine.config.tree else engine
        rows = []
        for p in prompts:
            result = run(eng.model, p["ids"], eng.drafter(name), new_tokens, backend=eng.backend)
            rows.append(result)
        out[method] = rows
    unpadded = engine.with_config(rows=1)  # plain decoding at one row a pass: the speed baseline if faster
    out["plain-1row"] = [run(unpadded.model, p["ids"], unpadded.drafter("plain"), new_tokens,
                             backend=unpadded.backend) for p in prompts]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="torch")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        prepare(args.per_category)
        return 0
    from tr_core.backend import device_name, resolve_device
    from tr_core.engine import Engine, EngineConfig
    from tr_core.fitting import auto_tree
    from tr_core.fixed.timing import rows_curve

    device = resolve_device(args.device)
    prompts = json.loads(PROMPTS.read_text())["prompts"][:args.prompts]
    shipped = shipped_tokens_per_pass()
    print(f"device: {device_name(device)} ({device}); torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"model: the embedded model's config with random weights (its weights do not travel here)")
    failures = []
    for mode, dtype in (("exact", torch.float32), ("fast", torch.bfloat16)):
        started = time.perf_counter()
        model = random_model(device, dtype)
        sizes = SIZES if device.type != "cpu" else (1, 2, 4, 8, 16)
        curve = rows_curve(model, 256, sizes=sizes, use_cache_file=False)
        t1 = curve[1]
        print(f"\n== {mode} ({str(dtype).removeprefix('torch.')}) ==")
        print("t(N)/t(1), N nodes on a pass of N rows rounded up to 8 (N = 1: one row), 256 cached positions, "
              f"t(1) = {t1:.3f} ms:")
        print("  " + ", ".join(f"{n}:{t / t1:.2f}" for n, t in curve.items()))
        if 81 in curve:
            ok = curve[81] / t1 <= 1.15
            print(f"  t(81)/t(1) = {curve[81] / t1:.2f} ({'meets' if ok else 'misses'} <= 1.15)")
            if not ok:
                failures.append(f"{mode}: t(81)/t(1)")
        tokenizer = SimpleNamespace(eos_token_id=None, chat_template=None)
        engine = Engine(model, tokenizer, EngineConfig(tree="auto", mode=mode, backend=args.backend,
                                                      device=str(device), fit_context=256))
        fitted = auto_tree(model, context=256, curve=curve)
        paper_row = fitted.table[min(80, len(fitted.table) - 1)]  # 81 nodes, or the most this curve measured
        print(f"the chooser's tree on this curve: {fitted.tree.size} nodes, {fitted.expected_accepted:.2f} tokens a "
              f"pass expected (shipped acceptance statistics); every pass {engine.rows} rows")
        decoded = decode_all(engine, prompts, args.new_tokens)
        plain = decoded["plain"]

        def ms_a_step(results):
            return statistics.mean(e.forward_ms + e.overhead_ms for r in results for e in r.events)

        plain_ms = min(ms_a_step(plain), ms_a_step(decoded["plain-1row"]))
        print(f"plain decoding: {ms_a_step(plain):.2f} ms a step padded to {engine.rows} rows, "
              f"{ms_a_step(decoded['plain-1row']):.2f} unpadded; the faster is the baseline")
        print(f"{'method':<11} {'identical':>9} {'passes/tok':>10} {'host ms':>8} {'host %':>7} {'step ms':>8} "
              f"{'tokens/pass (source)':>30} {'speedup':>8}")
        for method, results in decoded.items():
            identical = sum(r.token_ids == b.token_ids for r, b in zip(results, plain))
            if method == "plain-1row":
                print(f"{method:<11} {identical:>4}/{len(results):<4} (unpadded plain decoding against padded)")
                continue
            host = statistics.mean(e.overhead_ms for r in results for e in r.events)
            step = statistics.mean(e.forward_ms + e.overhead_ms for r in results for e in r.events)
            random_tpp = sum(len(r.token_ids) for r in results) / sum(r.steps for r in results)
            if method == "plain":
                tpp, source = 1.0, "plain"
            elif method == "tr":
                tpp, source = fitted.expected_accepted, "statistics, fitted here"
            elif method == "tr-paper":
                tpp, source = paper_row["expected_accepted"], f"statistics, {paper_row['nodes']} nodes"
            else:
                tpp, source = shipped.get(method, random_tpp), "CPU benchmark"
            speedup = tpp * plain_ms / step
            print(f"{method:<11} {identical:>4}/{len(results):<4} {1 / random_tpp:>10.2f} {host:>8.2f} "
                  f"{100 * host / step:>6.1f}% {step:>8.2f} {tpp:>22.2f} ({source}) {speedup:>7.2f}x")
            if identical != len(results):
                failures.append(f"{mode}: {method} not identical")
            if method in ("tr", "tr-paper") and device.type == "cuda" and speedup < 2.0:
                failures.append(f"{mode}: {method} {speedup:.2f}x < 2.0x")
            if device.type == "cuda" and host > 0.1 * step:
                failures.append(f"{mode}: {method} host work {100 * host / step:.0f}% of a step")
        print(f"({mode} took {time.perf_counter() - started:.0f} s; passes/tok: the random-weights model's own "
              "decoding, which accepts few drafts)")
        del model, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\nchecks missed: " + ("; ".join(failures) if failures else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
