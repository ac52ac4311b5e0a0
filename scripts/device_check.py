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
    python scripts/device_check.py --device cpu --quick   # every line but the CUDA graphs, in ~1 minute (a test)

It measures t(N) once, in a cache folder of its own (``--cache-dir``; by default a new temporary one, so nothing is
written under the home folder and nothing measured elsewhere is read), and the engine reads that same curve.
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


QUICK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}  # --quick: the embedded model's vocabulary on a tiny Llama


def random_model(device: torch.device, dtype: torch.dtype, quick: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig
    fields = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    config = LlamaConfig(**(fields | QUICK if quick else fields))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.config._name_or_path = "smollm2-135m-instruct"  # the embedded model's shipped statistics apply
    return model


def weight_bytes(model) -> int:
    """The bytes of weights a pass reads: every parameter once (a tied output layer once), the input embedding
    (of which a pass reads a row per token) left out unless it is the output layer."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embedding and p is not head):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def bytes_a_step(model, rows: int = 88, slots: int = 1024) -> str:
    """The bytes a pass of ``rows`` rows on ``slots`` cached positions moves, from the shapes (issue 53, item 3):
    the weights, the cache read once, each row's attention window gathered; against weights + cache."""
    from tr_core.fixed.backend import _shape
    from tr_core.fixed.rows import bytes_a_pass
    layers, kv_heads, head_dim = _shape(model)
    weights = weight_bytes(model)
    moved = bytes_a_pass(layers, kv_heads, head_dim, rows, slots, model.dtype.itemsize)
    floor = weights + moved["cache"]
    ratio = (floor + moved["windows"]) / floor
    mb = 1e6
    return (f"bytes a step at {rows} rows, {slots} cached positions: weights {weights / mb:.1f} MB + the cache read "
            f"once {moved['cache'] / mb:.1f} MB + each row's window of values gathered (written, read) "
            f"{moved['windows'] / mb:.1f} MB = {ratio:.2f}x weights + cache ({'meets' if ratio <= 1.2 else 'misses'}"
            f" <= 1.2x; before: the whole cache copied per row)"), ratio


def shipped_tokens_per_pass() -> dict[str, float]:
    runs = json.loads((ROOT / "assets" / "benchmarks" / "beyond_paper.json").read_text())["runs"]
    exact = next(r for r in runs if r["mode"] == "exact")
    return {m: e["mean_accepted_tokens"] for m, e in exact["methods"].items()}


def paper_expected(model, nodes: int) -> float:
    """The tokens a pass the paper tree's first ``nodes`` nodes (BFS order: what a run of fewer rows verifies) are
    expected to give, from the shipped acceptance statistics (gathered with the paper tree) and their size
    factors."""
    from tr_core.fitting import acceptance_path, model_slug, size_factor
    stats = json.loads(acceptance_path(model_slug(model)).read_text())
    assert stats["tree"] == "paper", stats["tree"]
    factors = {int(n): f for n, f in stats.get("size_factors", {}).items()}
    return 1.0 + sum(stats["acceptance"][1:nodes]) * size_factor(factors, nodes, len(stats["acceptance"]))


def decode_all(engine, prompts, new_tokens: int) -> dict:
    from tr_core.decoding import run
    out = {}
    for method in METHODS:  # each from the registry's settings (tr-paper: the paper's tree, ...), its own matrix
        eng = engine.with_matrix(engine.fresh_matrix())
        out[method] = [run(eng.model, p["ids"], eng.drafter(method), new_tokens, backend=eng.backend)
                       for p in prompts]
    unpadded = engine.with_config(rows=1)  # plain decoding at one row a pass, unpadded: the baseline if faster
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
    p.add_argument("--quick", action="store_true",
                   help="a tiny random Llama, 2 prompts, 16 new tokens: every line but the CUDA graphs, fast")
    p.add_argument("--cache-dir", default=None, help="where t(N) is cached (default: a new temporary folder)")
    args = p.parse_args()
    if args.prepare:
        prepare(args.per_category)
        return 0
    import os
    import tempfile
    os.environ["XDG_CACHE_HOME"] = args.cache_dir or tempfile.mkdtemp(prefix="device-check-")
    if args.quick:
        args.prompts, args.new_tokens = min(args.prompts, 2), min(args.new_tokens, 16)
    from tr_core.backend import device_name, resolve_device
    from tr_core.engine import Engine, EngineConfig
    from tr_core.fitting import auto_tree
    from tr_core.fixed.timing import CPU_SIZES, rows_curve

    device = resolve_device(args.device)
    prompts = json.loads(PROMPTS.read_text())["prompts"][:args.prompts]
    shipped = shipped_tokens_per_pass()
    what = ("a tiny Llama with the embedded model's vocabulary, random weights (--quick)" if args.quick else
            "the embedded model's config with random weights (its weights do not travel here)")
    print(f"device: {device_name(device)} ({device}); torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"model: {what}; t(N) cached in {os.environ['XDG_CACHE_HOME']}")
    failures = []
    for mode, dtype in (("exact", torch.float32), ("fast", torch.bfloat16)):
        started = time.perf_counter()
        model = random_model(device, dtype, args.quick)
        sizes = SIZES if device.type != "cpu" or args.quick else CPU_SIZES
        # measured once, into the cache file the engine below reads (timing.SIZES are among these sizes)
        curve = rows_curve(model, 256, sizes=sizes, repeats=1 if args.quick else 5)
        t1 = curve[1]
        print(f"\n== {mode} ({str(dtype).removeprefix('torch.')}) ==")
        print("t(N)/t(1), N nodes on a pass of N rows rounded up to 8 (N = 1: one row, unpadded), 256 cached "
              f"positions, t(1) = {t1:.3f} ms:")
        print("  " + ", ".join(f"{n}:{t / t1:.2f}" for n, t in curve.items()))
        if 81 in curve:
            ok = curve[81] / t1 <= 1.15
            print(f"  t(81)/t(1) = {curve[81] / t1:.2f} ({'meets' if ok else 'misses'} <= 1.15)")
            if not ok and device.type == "cuda":
                failures.append(f"{mode}: t(81)/t(1)")
        line, ratio = bytes_a_step(model)
        print(line)
        if ratio > 1.2 and not args.quick:
            failures.append(f"{mode}: bytes a step {ratio:.2f}x weights + cache")
        tokenizer = SimpleNamespace(eos_token_id=None, chat_template=None)
        engine = Engine(model, tokenizer, EngineConfig(tree="auto", mode=mode, backend=args.backend,
                                                      device=str(device), fit_context=256))
        fitted = auto_tree(model, context=256, curve=curve)
        paper_nodes = min(81, engine.rows)  # a draft larger than the run's rows is cut to its first nodes
        paper_tpp = paper_expected(model, paper_nodes)
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
                tpp, source = paper_tpp, ("statistics, 81 nodes" if paper_nodes == 81 else
                                          f"statistics, cut to {paper_nodes}")
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
