"""Fitting the draft tree to the hardware.

Token Recycling pays off when verifying a tree of N tokens costs little more than one decoding step. On a
datacenter GPU that holds up to N ~ 80; on a 2-core CPU the cost grows from N ~ 8. So:

1. ``measure_forward_ms`` calibrates t(N), the forward latency for N tree tokens on a cached prefix, for the loaded
   model, dtype and machine (cached on disk per model/dtype/machine);
2. ``node_acceptance`` estimates, from decoding on generic prompts with a large template, how often each node lies
   on the accepted path;
3. ``fit_tree`` grows the tree node by node in order of acceptance (children are never likelier than their parent,
   so each prefix of that order is a valid tree) and keeps the size that maximises
   expected tokens per second = (1 + expected accepted draft tokens) / (t(N) + per-step overhead).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from . import attention, decoding, kv, layouts, lean
from . import kernels as kernels_module
from .assets import ACCEPTANCE_DIR, acceptance_path, model_slug
from .attention import BLOCK
from .decoding import _max_positions, top_k, tree_mask
from .kernels import OutputHead, body, cache_dtype, feed, grouped_query_attention_in_sdpa, plan_of, window
from .kv import new_cache
from .layouts import cpu_name, source_digest
from .models import default_cache_dir
from .tree import TreeBuffers, build_tree, load_template


def machine_key(model: PreTrainedModel) -> str:
    """What t(N) depends on: the model, its dtype and linear kernels, the processor and the thread count."""
    name = Path(str(getattr(model.config, "_name_or_path", "model"))).name or "model"
    # the kernels the model was prepared with (kernels.prepare_model: format and layouts chosen by measurement), and
    # the code of the forward path and of this measurement
    plan = plan_of(model)
    code = source_digest(attention, sys.modules[__name__], decoding, kernels_module, kv, lean, layouts)
    kernels = f"{code}-" + (plan.tag() if plan is not None else "torch")
    device = model.device.type if model.device.type != "cpu" else cpu_name()
    raw = f"{name}-{str(model.dtype).removeprefix('torch.')}-{kernels}-{device}-t{torch.get_num_threads()}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in raw)


# The context (prompt and answer so far, in tokens) t(N) is calibrated on and the tree fitted for, unless a caller
# says otherwise. A tree step's extra cost grows with the context, faster than linearly: on the embedded model (fast
# mode) t(6) - t(1) measured 6.9 ms over 128 cached tokens, 8.8 over 512 and 16.3 over 1,024. So a workload of many
# contexts (the benchmark's questions) is fitted on t(N) averaged over its contexts (``context_curve``), not on t(N)
# at their mean context.
DEFAULT_FIT_CONTEXT = 256
# contexts t(N) is measured at when it is averaged over many; each context in between is interpolated linearly
CONTEXT_GRID = (128, 256, 512, 1024, 2048)


@torch.inference_mode()
def measure_forward_ms(model: PreTrainedModel, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81),
                       prefix: int = DEFAULT_FIT_CONTEXT, repeats: int = 5, block: int = 2,
                       use_cache_file: bool = True, remeasure: bool = False) -> dict[int, float]:
    """Time (ms, made non-decreasing in N; ``paired_curve``) of a step's model work for N tree tokens (the first N
    nodes of the paper tree, with its tree mask) on top of a ``prefix``-token cache: the forward, and the argmax (N =
    1) or every node's top-k (N > 1). ``repeats`` rounds over the sizes, ``block`` counted steps of a size in a row.
    The result is cached per machine (``machine_key``); ``remeasure`` measures anew and rewrites the cache."""
    max_pos = _max_positions(model)
    if max_pos is not None:  # a model with a short context is calibrated on the longest cache that leaves room
        prefix = max(1, min(prefix, max_pos - max(sizes) - 1))
    windowed = window(body(model)) is not None  # the batch-invariant attention (attention.py)
    paper = load_template("paper")
    if windowed and prefix >= BLOCK:  # the root at a window's start: every tree's depth fits in its window
        prefix = prefix // BLOCK * BLOCK
    elif windowed:  # a short cache: the deepest tree still in the first window
        prefix = max(1, min(prefix, BLOCK - 1 - paper.max_depth))
    invariant = "-invariant" if windowed else ""
    path = default_cache_dir() / "calibration" / f"{machine_key(model)}-p{prefix}-paired{invariant}.json"
    if use_cache_file and path.is_file() and not remeasure:
        cached = {int(k): v for k, v in json.loads(path.read_text()).items()}
        if all(n in cached for n in sizes):
            return {n: cached[n] for n in sizes}
    device = model.device
    if device.type == "cpu":
        grouped_query_attention_in_sdpa()  # as decoding does
    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    ctx = torch.randint(0, vocab, (1, prefix), generator=g).to(device)
    base, head = body(model), OutputHead(model)
    cache = new_cache(model.config, prefix + max(sizes), cache_dtype(base, model.dtype), device)  # as decoding does
    feed(base, ctx[0], cache)
    steps = []
    for n in sizes:
        tree = build_tree(list(paper.node_paths[1:n]), name=f"first{n}") if n > 1 else None
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
        if tree is None:
            pos, mask = torch.tensor([[prefix]], device=device), None
        else:
            pos = (prefix + tree.depth.to(device))[None]
            mask = tree_mask(tree.to(device), prefix, model.dtype, device)
        steps.append((n, ids, pos, mask))
    times = {n: [[] for _ in range(repeats)] for n in sizes}  # per size, per round: the block's timings
    # Rounds over the sizes, so that a slow spell of the machine hits every size alike; within a round each size runs
    # a block of steps in a row, as decoding does (a step after a much larger one runs on evicted caches, which
    # decoding never sees); round 0 warms up, and a block's first step (the switch) is not counted.
    for round_ in range(repeats + 1):
        for n, ids, pos, mask in steps:
            for b in range(block + 1):
                t0 = time.perf_counter()
                hidden = base(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                              use_cache=True).last_hidden_state[0]
                logits = head(hidden)
                if n > 1:  # a tree step also takes every node's top-k for the matrix update
                    top_k(logits, 8)
                else:
                    logits.argmax(dim=-1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_ and b:
                    times[n][round_ - 1].append((time.perf_counter() - t0) * 1e3)
                cache.crop(-n)
    result = paired_curve(times)
    if use_cache_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result


def paired_curve(times: dict[int, list[list[float]]]) -> dict[int, float]:
    """t(N) from timings ``times[N][round]`` (ms, a block of steps per round): the smallest size's median over all
    rounds, times the median over rounds of each round's t(N) / t(smallest) ratio, made non-decreasing in N.

    A ratio is taken within a round, between blocks timed seconds apart, so a slow spell of the machine that spans
    rounds cancels out of it; a single slow block of the smallest size no longer lifts every size above it.

    >>> paired_curve({1: [[10.0], [20.0], [10.0]], 4: [[12.0], [24.0], [12.0]], 8: [[11.0], [22.0], [11.0]]})
    {1: 10.0, 4: 12.0, 8: 12.0}
    """
    sizes = sorted(times)
    first = times[sizes[0]]
    base = statistics.median(t for block in first for t in block)
    result, running = {}, 1.0
    for n in sizes:
        rounds = [statistics.median(b) / statistics.median(a) for a, b in zip(first, times[n]) if a and b]
        # the median, not the fastest run: decoding pays the typical cost of a step. With the fastest of 5 runs, the
        # embedded model's t(4)/t(1) came out at 1.19 (exact mode) while the benchmark's steps averaged 1.11
        running = max(running, statistics.median(rounds))  # more tokens never cost less: a dip is noise
        result[n] = base * running
    return result


def context_weights(contexts: Sequence[int], grid: Sequence[int] = CONTEXT_GRID) -> dict[int, float]:
    """How much each calibration context weighs in the mean of t(N) over ``contexts``: each context's weight goes to
    the two grid points around it, by linear interpolation (clamped at the grid's ends). Weights sum to 1."""
    if not contexts:
        raise ValueError("no contexts to average t(N) over")
    grid = sorted(grid)
    weights: dict[int, float] = {}
    for c in contexts:
        if c <= grid[0] or c >= grid[-1]:
            g = grid[0] if c <= grid[0] else grid[-1]
            weights[g] = weights.get(g, 0.0) + 1.0
            continue
        hi = next(i for i, g in enumerate(grid) if g >= c)
        a, b = grid[hi - 1], grid[hi]
        f = (c - a) / (b - a)
        weights[a] = weights.get(a, 0.0) + 1.0 - f
        weights[b] = weights.get(b, 0.0) + f
    return {g: w / len(contexts) for g, w in sorted(weights.items()) if w > 0}


def context_curve(model: PreTrainedModel, context: int | Sequence[int], **measure) -> dict[int, float]:
    """t(N) over one context length, or averaged over many (e.g. one per benchmark question: each is a workload's
    share of the steps), from calibrations at the grid points around them (``context_weights``)."""
    if isinstance(context, int):
        return measure_forward_ms(model, prefix=context, **measure)
    curves = {g: (w, measure_forward_ms(model, prefix=g, **measure)) for g, w in context_weights(context).items()}
    sizes = next(iter(curves.values()))[1]
    return {n: sum(w * curve[n] for w, curve in curves.values()) for n in sizes}


def describe_context(context: int | Sequence[int]) -> str:
    """``"a 256-token context"`` or ``"30 contexts of 53-990 tokens (mean 347)"``."""
    if isinstance(context, int):
        return f"a {context}-token context"
    return (f"{len(context)} contexts of {min(context)}-{max(context)} tokens "
            f"(mean {statistics.mean(context):.0f})")


def interpolate(curve: dict[int, float], n: int) -> float:
    """t(n) by linear interpolation between measured sizes (flat beyond the ends)."""
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]]


def node_acceptance(events: list, tree: TreeBuffers) -> list[float]:
    """For every node of ``tree``, the share of steps in which it lay on the accepted path (root = 1.0)."""
    counts = [0] * tree.size
    steps = 0
    for e in events:
        if e.tree_name != tree.name or len(e.tree_tokens) != tree.size:
            continue
        steps += 1
        for node in e.accepted_path:
            counts[node] += 1
    if not steps:
        raise ValueError(f"no steps with tree {tree.name!r} to count acceptance from")
    return [c / steps for c in counts]


@dataclass
class FittedTree:
    tree: TreeBuffers
    expected_accepted: float  # expected tokens per step, bonus included
    predicted_speedup: float  # over plain decoding, from t(N) and the overhead
    table: list[dict]  # one row per candidate size: nodes, expected_accepted, step_ms, predicted_speedup
    context: int | tuple[int, ...] | None = None  # the context length(s) (tokens) t(N) was calibrated on


def size_factors(acceptance: list[float], measured: dict[int, float]) -> dict[int, float]:
    """How much of the acceptance statistics' promise a tree of N nodes kept when it ran: ``measured`` maps N (nodes,
    root included) to the mean accepted tokens per step measured with the N likeliest nodes themselves; the factor
    is (measured - 1) / (expected - 1), the draft tokens accepted against those expected from ``acceptance``.

    A small tree refreshes few matrix rows a step, so its matrix is staler than the one the statistics were
    gathered with (the paper's 81 nodes), and its nodes are accepted less often than the statistics say.

    >>> size_factors([1.0, 0.5, 0.25, 0.25], {2: 1.4, 4: 1.8})
    {2: 0.8, 4: 0.8}
    """
    ordered = [1.0] + sorted(acceptance[1:], reverse=True)
    factors = {}
    for n, mat in sorted(measured.items()):
        promised = sum(ordered[1:n])
        if promised > 0:
            factors[int(n)] = round((mat - 1.0) / promised, 4)
    return factors


def size_factor(factors: dict[int, float], n: int, full: int = 81) -> float:
    """The factor at ``n`` nodes, interpolated in log N between the measured sizes, and towards 1 at the statistics'
    own tree of ``full`` nodes; 1 where nothing was measured.

    >>> size_factor({2: 0.6, 8: 0.9}, 4), size_factor({2: 0.6}, 1), size_factor({}, 5)
    (0.75, 0.6, 1.0)
    """
    if not factors:
        return 1.0
    points = sorted({**{full: 1.0}, **factors}.items()) if max(factors) < full else sorted(factors.items())
    if n <= points[0][0]:
        return points[0][1]
    for (a, fa), (b, fb) in zip(points, points[1:]):
        if n <= b:
            w = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))
            return fa + w * (fb - fa)
    return points[-1][1]


def fit_tree(source: TreeBuffers, acceptance: list[float], curve: dict[int, float],
             overhead_ms: float = 0.0, name: str = "auto", max_nodes: int | None = None,
             size: int | None = None, factors: dict[int, float] | None = None) -> FittedTree:
    """The prefix of ``source``'s nodes, in order of acceptance, that maximises expected tokens per second (or, with
    ``size``, the prefix of that many nodes, root included). ``factors`` (``size_factors``): the share of the
    expected draft tokens that trees of each size were measured to keep; none: all of them."""
    order = sorted(range(1, source.size), key=lambda i: (-acceptance[i], i))
    plain_ms = interpolate(curve, 1) + overhead_ms
    best, table, promised = None, [], 0.0
    limit = source.size - 1 if max_nodes is None else min(max_nodes, source.size - 1)
    for count in range(0, limit + 1):
        if count:
            promised += acceptance[order[count - 1]]
        # never fewer expected tokens than a smaller tree's (measured factors carry noise)
        expected = max(1.0 + promised * size_factor(factors or {}, count + 1, source.size),
                       table[-1]["expected_accepted"] if table else 1.0)
        step_ms = interpolate(curve, count + 1) + overhead_ms
        speedup = expected / step_ms * plain_ms
        table.append({"nodes": count + 1, "expected_accepted": expected, "step_ms": step_ms,
                      "predicted_speedup": speedup})
        if best is None or speedup > best[2]:
            best = (count, expected, speedup)
    if size is not None:
        if not 1 <= size <= len(table):
            raise ValueError(f"a tree of {size} nodes cannot be cut from {source.name!r} ({source.size} nodes)")
        row = table[size - 1]
        best = (size - 1, row["expected_accepted"], row["predicted_speedup"])
    count, expected, speedup = best
    chosen = [source.node_paths[i] for i in order[:count]]
    return FittedTree(build_tree(chosen, name=name), expected, speedup, table)


def has_acceptance_stats(model: PreTrainedModel, acceptance_dir: Path = ACCEPTANCE_DIR) -> bool:
    return acceptance_path(model_slug(model), acceptance_dir).is_file()


def auto_tree(model: PreTrainedModel, acceptance_dir: Path = ACCEPTANCE_DIR, size: int | None = None,
              context: int | Sequence[int] = DEFAULT_FIT_CONTEXT) -> FittedTree:
    """The tree fitted to this model on this machine: shipped acceptance statistics + t(N) calibrated over a
    ``context``-token cache (or averaged over several contexts, ``context_curve``). With ``size``, the ``size``
    likeliest nodes instead (named ``auto-<size>``), to compare sizes."""
    path = acceptance_path(model_slug(model), acceptance_dir)
    if not path.is_file():
        raise ValueError(f"no acceptance statistics for {model_slug(model)!r} (looked for {path}); build them with "
                         "`python -m tr_core.build_assets --model ...`, or choose a named tree")
    stats = json.loads(path.read_text())
    source = build_tree([tuple(p) for p in stats["node_paths"] if p], name=stats.get("tree", "source"))
    if [list(p) for p in source.node_paths] != stats["node_paths"]:
        raise ValueError(f"{path}: node_paths are not in BFS order")
    name = "auto" if size is None else f"auto-{size}"
    factors = {int(n): f for n, f in stats.get("size_factors", {}).items()}
    fitted = fit_tree(source, stats["acceptance"], context_curve(model, context), name=name, size=size,
                      factors=factors)
    fitted.context = context
    return fitted


def show_kernels(model: PreTrainedModel, mode: str, remeasure: bool = False) -> str:
    """The kernel table of ``mode`` for ``model`` (fp32, unprepared), as text: per shape and row count the chosen
    layout and every candidate's time (ms of one call, this machine), then each format's linear time of a step."""
    from .kernels import LAYOUTS
    from .layouts import kernel_plan

    plan = kernel_plan(model, mode, remeasure=remeasure)
    lines = [f"{mode}: format {plan.fmt} ({plan.source}; {torch.get_num_threads()} threads, {cpu_name()})"]
    for shape, by_rows in plan.layouts.items():
        names = sorted(plan.timings[shape][plan.rows[0]], key=list(LAYOUTS).index)
        lines.append(f"  {shape} x{plan.counts[shape]}: rows  " + "  ".join(f"{n:>12}" for n in names) + "  chosen")
        for r in plan.rows:
            t = plan.timings[shape][r]
            lines.append(f"  {'':>{len(shape) + len(str(plan.counts[shape])) + 2}}{r:>6}  "
                         + "  ".join(f"{t[n]:>12.3f}" if n in t else f"{'-':>12}" for n in names)
                         + f"  {by_rows[r]}")
    for fmt, steps in plan.step_ms.items():
        lines.append(f"  step ms, {fmt} (linear layers, best layouts): "
                     + ", ".join(f"{r}: {ms:.1f}" for r, ms in sorted(steps.items())))
    from .kernels import describe_invariance
    lines.append(f"  {describe_invariance(plan)}")
    return "\n".join(lines)


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in GB/s as torch sees it: the fastest of ``repeats`` sums over ``gib``
    GiB of fp32 (larger than any CPU cache), on torch's threads."""
    x = torch.ones(int(gib * 2**28))
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: PreTrainedModel, fmt: str) -> int:
    """Bytes of weights one decoding step streams in format ``fmt`` (``"fp32"``: 4 a value, ``"fp16"``/``"bf16"``:
    2): every linear layer of the body and the output layer (the input embedding reads one row a token)."""
    from .layouts import linear_shapes

    size = 4 if fmt == "fp32" else 2
    return sum(layer.weight.numel() * size for layers in linear_shapes(model).values() for layer in layers)


def show_limits(model: PreTrainedModel, mode: str, bandwidth_gbs: float) -> str:
    """One line: ``mode``'s plain (one-token) step on this machine against the time its weights take to stream at
    ``bandwidth_gbs`` (the step's memory limit). Prepares a copy of ``model`` (fp32, unprepared) in the mode."""
    import copy

    from .kernels import plan_of, prepare_model

    prepared = copy.deepcopy(model)
    prepare_model(prepared, mode)
    plan = plan_of(prepared)
    fmt = plan.fmt if plan is not None else "fp32"
    step = measure_forward_ms(prepared, sizes=(1, 16), use_cache_file=False)
    size = weight_bytes(model, fmt)
    stream = size / bandwidth_gbs / 1e6
    return (f"{mode} ({fmt}): plain step {step[1]:.1f} ms at a {DEFAULT_FIT_CONTEXT}-token context; its weights "
            f"({size / 1e6:.0f} MB) stream in {stream:.1f} ms at {bandwidth_gbs:.1f} GB/s: the step takes "
            f"{step[1] / stream:.1f}x its streaming time; t(16)/t(1) = {step[16] / step[1]:.2f}")


def main(argv: list[str] | None = None) -> int:
    """``python -m tr_core.calibrate --show [--mode exact|fast] [--remeasure]``: the kernels chosen on this machine
    for the embedded model, whether they are batch-invariant here, the machine's read bandwidth, and each mode's
    plain step against the time its weights take to stream."""
    import argparse

    from .kernels import MODES
    from .models import load_model

    p = argparse.ArgumentParser(prog="python -m tr_core.calibrate", description=main.__doc__)
    p.add_argument("--show", action="store_true", help="print the chosen kernel table (measured once, then cached)")
    p.add_argument("--mode", choices=MODES, action="append", help="one mode (default: both)")
    p.add_argument("--model", default=None, help="hub id or folder (default: the embedded model)")
    p.add_argument("--remeasure", action="store_true", help="time the layouts again (and cache the new timings)")
    args = p.parse_args(argv)
    if not args.show:
        p.error("nothing to do: pass --show")
    model, _ = load_model(args.model, dtype=torch.float32)
    for mode in args.mode or MODES:
        print(show_kernels(model, mode, remeasure=args.remeasure))
    bandwidth = read_bandwidth_gbs()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (a sum over 1 GiB, {torch.get_num_threads()} threads)")
    for mode in args.mode or MODES:
        print(show_limits(model, mode, bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
