"""What a step of N tokens costs here: t(N).

Token Recycling pays off when verifying a tree of N tokens costs little more than one decoding step. On a
datacenter GPU that holds up to N ~ 80; on a 2-core CPU the cost grows from N ~ 8. ``measure_forward_ms`` measures
t(N), the step latency for N tree tokens on a cached prefix, for the loaded model, its kernels and this machine
(cached on disk, keyed by the code that measures it); ``context_curve`` averages it over contexts. ``fitting.py``
fits the draft tree to it; ``python -m tr_core.speed.calibrate --show`` prints the kernels, the read bandwidth, the
plain step against the time its weights take to stream and t(16)/t(1) against the least the CPU's arithmetic allows.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from .. import topk
from ..cachefiles import write_atomically
from ..models import default_cache_dir, load_model
from ..modes import DEFAULT_FIT_CONTEXT, MODES, interpolate  # noqa: F401 (offered here too)
from . import attention, kv, layouts, lean, native, stepbench
from . import backend as backend_module
from . import kernels as kernels_module
from .chooser import choose_plan, prepare_model, tree_gain
from .fusion import fuse, fused_shapes
from .kernels import (
    body,
    describe_format,
    parameter_count,
    plan_of,
)
from .layouts import LAYOUTS, cpu_name, linear_shapes, source_digest
from .native import PEAK_KINDS
from .stepbench import ATTENTION_SIZES, StepBench, attention_pairs, bench_prefix, paired_curve, whole_steps_ms  # noqa: F401


def machine_key(model: PreTrainedModel) -> str:
    """What t(N) depends on: the model, its dtype and linear kernels, the processor and the thread count."""
    name = Path(str(getattr(model.config, "_name_or_path", "model"))).name or "model"
    # the kernels the model was prepared with (chooser.prepare_model: format and layouts chosen by measurement), and
    # the code of the forward path and of this measurement
    plan = plan_of(model)
    code = source_digest(attention, sys.modules[__name__], stepbench, topk, backend_module, kernels_module, kv, lean,
                         layouts, native)
    code += native.tag()
    kernels = f"{code}-" + (plan.tag() if plan is not None else "torch")
    device = model.device.type if model.device.type != "cpu" else cpu_name()
    raw = f"{name}-{str(model.dtype).removeprefix('torch.')}-{kernels}-{device}-t{torch.get_num_threads()}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in raw)


# The context (prompt and answer so far, in tokens) t(N) is calibrated on and the tree fitted for, unless a caller
# says otherwise (``modes.DEFAULT_FIT_CONTEXT``). A tree step's extra cost grows with the context, faster than
# linearly (docs/speed.md), so a workload of many contexts (the benchmark's questions) is fitted on t(N) averaged over
# its contexts (``context_curve``), not on t(N) at their mean context.
# contexts t(N) is measured at when it is averaged over many; each context in between is interpolated linearly
CONTEXT_GRID = (128, 256, 512, 1024, 2048)


def measure_forward_ms(model: PreTrainedModel, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81),
                       prefix: int = DEFAULT_FIT_CONTEXT, repeats: int = 5, block: int = 2,
                       use_cache_file: bool = True, remeasure: bool = False) -> dict[int, float]:
    """Time (ms, made non-decreasing in N; ``paired_curve``) of a step's model work for N tree tokens on top of a
    ``prefix``-token cache (``StepBench``). ``repeats`` rounds over the sizes (so that a slow spell of the machine hits
    every size alike; one more, uncounted, warms up), ``block`` counted steps of a size in a row. The result is cached
    per machine (``machine_key``); ``remeasure`` measures anew and rewrites the cache."""
    prefix, windowed = bench_prefix(model, sizes, prefix)
    invariant = "-invariant" if windowed else ""
    path = default_cache_dir() / "calibration" / f"{machine_key(model)}-p{prefix}-paired{invariant}.json"
    if use_cache_file and path.is_file() and not remeasure:
        cached = {int(k): v for k, v in json.loads(path.read_text()).items()}
        if all(n in cached for n in sizes):
            return {n: cached[n] for n in sizes}
    bench = StepBench(model, sizes, prefix)
    times: dict[int, list[list[float]]] = {n: [] for n in sizes}  # per size, per round: the block's timings
    for round_ in range(repeats + 1):
        got = bench.time_round(block)
        if round_:
            for n in sizes:
                times[n].append(got[n])
    result = paired_curve(times)
    if use_cache_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(result, indent=1))
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


def show_kernels(model: PreTrainedModel, mode: str, remeasure: bool = False) -> str:
    """The kernel table of ``mode`` for ``model`` (fp32, unprepared), as text: per shape and row count the chosen
    layout and every candidate's time (ms of one call, this machine), then each format's linear time of a step. The
    shapes are those ``prepare_model`` measures: the fused projections where ``lean.fuse`` applies."""

    if fused_shapes(model):
        model = copy.deepcopy(model)
        fuse(model)
    plan = choose_plan(model, mode, gain=tree_gain(model), remeasure=remeasure)
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
    for fmt, steps in plan.whole_ms.items():
        lines.append(f"  step ms, {fmt} (whole step, {DEFAULT_FIT_CONTEXT}-token context): "
                     + ", ".join(f"{r}: {ms:.1f}" for r, ms in sorted(steps.items())))
    lines.append(f"  {describe_format(plan)}")
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


def cached_bandwidth_gbs() -> float:
    """``read_bandwidth_gbs``, measured once per machine and thread count, then read from the cache."""
    path = default_cache_dir() / "calibration" / f"bandwidth-{cpu_name()}-t{torch.get_num_threads()}.json"
    path = path.with_name("".join(c if c.isalnum() or c in "-._" else "_" for c in path.name))
    if path.is_file():
        return float(json.loads(path.read_text())["read_gbs"])
    gbs = read_bandwidth_gbs()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"read_gbs": gbs}))
    return gbs


def streamed_parameters(model: PreTrainedModel) -> int:
    """The weights one decoding step reads: every parameter, but of the input embedding only one row a token (it
    counts where the output layer shares it, as the output layer reads it whole)."""
    total = parameter_count(model)  # in the fp16 format the linear layers keep only packed weights
    embedding = model.get_input_embeddings().weight
    shared = embedding is model.get_output_embeddings().weight
    return total if shared else total - embedding.numel()


def machine_profile(model: PreTrainedModel, context: int | Sequence[int] = DEFAULT_FIT_CONTEXT) -> dict:
    """What the step-cost model (``tr_core.projection``) needs of this machine and ``model`` as prepared: the read
    bandwidth (GB/s, cached), t(N) measured here (ms by N, ``context_curve``), the weights one step streams (as
    fp32 parameters and in the model's format, bytes per weight) and the decoder layers."""
    plan = plan_of(model)
    fmt = plan.fmt if plan is not None else "fp32"
    return {"bandwidth_gbs": cached_bandwidth_gbs(), "curve": context_curve(model, context),
            "parameters": streamed_parameters(model), "bytes_per_weight": 4 if fmt == "fp32" else 2,
            "layers": model.config.num_hidden_layers}


def weight_bytes(model: PreTrainedModel, fmt: str) -> int:
    """Bytes of weights one decoding step streams in format ``fmt`` (``"fp32"``: 4 a value, ``"fp16"``/``"bf16"``:
    2): every linear layer of the body and the output layer (the input embedding reads one row a token)."""

    size = 4 if fmt == "fp32" else 2
    return sum(layer.weight.numel() * size for layers in linear_shapes(model).values() for layer in layers)


# the instruction whose peak bounds a format's linear layers from below (``native.peak_products``'s kinds)
PEAK_OF_FORMAT = {"fp32": "fma", "fp16": "fma", "bf16p": "bf16dot", "amx": "amx"}


def step_floor_ms(rows: int, stream_ms: float, products: int, peak: float | None, attention: int = 0,
                  attention_peak: float | None = None) -> float:
    """The least time a pass of ``rows`` rows can take on this machine: its weights streamed once (``stream_ms``)
    or its arithmetic, whichever is longer (they overlap at best): ``products`` a row at the CPU's ``peak`` products a
    second, plus ``attention`` products a row (the keys' and values', fp32) at ``attention_peak`` (the same cores
    do both, so these add); the streaming time alone where the peak is unknown.

    >>> step_floor_ms(1, 8.0, 100_000_000, 1e11), step_floor_ms(16, 8.0, 100_000_000, 1e11)
    (8.0, 16.0)
    >>> round(step_floor_ms(16, 8.0, 100_000_000, 1e11, attention=10_000_000, attention_peak=5e10), 6)
    19.2
    """
    if not peak:
        return stream_ms
    busy = rows * products / peak + (rows * attention / attention_peak if attention and attention_peak else 0.0)
    return max(stream_ms, busy * 1e3)


def attention_products(model: PreTrainedModel, context: int = DEFAULT_FIT_CONTEXT) -> int:
    """A row's products in attention over ``context`` cached positions, all layers: each query head's scores and
    weighted values (2 x head_dim a position)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * heads * context * 2 * head_dim


LIMIT_ROUNDS = 7  # rounds of ``paired_limits``: a read of the memory, then a block of 1-row and 16-row steps


def paired_limits(model: PreTrainedModel, rounds: int = LIMIT_ROUNDS, block: int = 2,
                  bandwidth=None) -> list[tuple[float, float, float]]:
    """Per round: the memory's read bandwidth (GB/s, ``bandwidth()``, default ``read_bandwidth_gbs`` over 1 GiB,
    the best of 3), then t(1) and t(16) of ``model`` (ms, the median of a block of ``block`` steps each,
    ``StepBench``), one right after the other. The shared machine's bandwidth moves within a minute (on the 2-vCPU
    AMD EPYC, 27 then 58 GB/s a few seconds apart), so a step is set against the bandwidth of its own round, not one
    read before all of them (which once put the step at 0.7x its streaming time)."""
    bandwidth = bandwidth or (lambda: read_bandwidth_gbs(repeats=2))
    bench = StepBench(model, (1, 16))
    bench.time_round(block)  # uncounted: the first steps pay for the threads' start and the cold caches
    out = []
    for _ in range(rounds):
        gbs = bandwidth()
        got = bench.time_round(block)
        out.append((gbs, statistics.median(got[1]), statistics.median(got[16])))
    return out


def limits_line(mode: str, fmt: str, rounds: Sequence[tuple[float, float, float]], size: int, products: int,
                peak: float | None, small: str, attention: int = 0, attention_peak: float | None = None,
                attention_kind: str = "fp32 multiply-adds") -> str:
    """``show_limits``'s line from its measurements, ``paired_limits``' rounds (bandwidth GB/s, t(1) ms, t(16) ms):
    the plain step against its weights' streaming time (``size`` bytes at its round's bandwidth), and t(16)/t(1)
    against the ratio of the two passes' floors here (``step_floor_ms``, with the CPU's ``peak`` products a second of
    the format's instruction, None where not measured: then no floor is claimed; and ``attention`` products a row at
    ``attention_peak``, where given: the peak of its ``attention_kind``, fp32 multiply-adds or, where the amx format
    attends on the tiles, AMX tile products). Each ratio is the median of the rounds' own; the
    times and the bandwidth printed are the rounds' medians."""

    med = statistics.median
    gbs = [r[0] for r in rounds]
    stream = [size / g / 1e6 for g in gbs]
    one, sixteen = med(r[1] for r in rounds), med(r[2] for r in rounds)
    to_stream = sorted(r[1] / s for r, s in zip(rounds, stream))
    line = (f"{mode} ({fmt}): plain step {one:.1f} ms at a {DEFAULT_FIT_CONTEXT}-token context; its weights "
            f"({size / 1e6:.0f} MB) stream in {med(stream):.1f} ms at {med(gbs):.1f} GB/s (read in the same rounds: "
            f"{min(gbs):.1f}-{max(gbs):.1f}): the step takes {med(to_stream):.1f}x its streaming time "
            f"({to_stream[0]:.1f}-{to_stream[-1]:.1f} round by round); t(16)/t(1) = "
            f"{med(r[2] / r[1] for r in rounds):.2f} (t(16) {sixteen:.1f} ms)")
    if peak:
        n = 16
        floors = [(step_floor_ms(1, s, products, peak, attention, attention_peak),
                   step_floor_ms(n, s, products, peak, attention, attention_peak)) for s in stream]
        also = (f", and attention's {n * attention / 1e9:.2f} G {attention_kind} at {DEFAULT_FIT_CONTEXT} positions "
                f"at {attention_peak / 1e9:.0f} G a second" if attention and attention_peak else "")
        many = med(f[1] for f in floors)
        line += (f", against {med(f[1] / f[0] for f in floors):.2f} were both passes at their floors here (one row: "
                 f"{med(f[0] for f in floors):.1f} ms; {n} rows: their {n * products / 1e9:.2f} G products at this "
                 f"CPU's measured peak of {peak / 1e9:.0f} G {PEAK_KINDS[PEAK_OF_FORMAT[fmt]][2]} a second on "
                 f"{torch.get_num_threads()} threads{also}, or the streaming if longer: {many:.1f} ms; t({n}) is "
                 f"{med(r[2] / f[1] for r, f in zip(rounds, floors)):.2f}x its floor)")
    return f"{line}; small operations: {small}"


def show_limits(model: PreTrainedModel, mode: str) -> str:
    """One line: ``mode``'s plain (one-token) step on this machine against the time its weights take to stream at
    the read bandwidth of the same minute (the step's memory limit), and its 16-row pass against the least the CPU's
    peak arithmetic allows (``limits_line`` on ``paired_limits``). Prepares a copy of ``model`` (fp32, unprepared) in
    the mode."""

    prepared = copy.deepcopy(model)
    prepare_model(prepared, mode)
    plan = plan_of(prepared)
    fmt = plan.fmt if plan is not None else "fp32"
    kind = PEAK_OF_FORMAT.get(fmt)

    # attention's products: fp32 multiply-adds, or tile products where the amx format attends on the tiles
    tiles = fmt == "amx" and native.attention_on_tiles() is not None and getattr(body(prepared), "_on_tiles", bool)()
    attention_kind = "fp32 multiply-adds" if not tiles else PEAK_KINDS["amx"][2]

    def peaks() -> tuple[float | None, float | None]:  # the format's instruction's; attention's
        peak = native.peak_products(kind) if kind else None
        return peak, (peak if kind == "fma" or tiles else native.peak_products("fma")) if peak else None

    before = peaks()
    rounds = paired_limits(prepared)
    after = peaks()  # a ceiling: a busy spell of the shared machine only lowers it, so the higher of the two reads
    peak, fma = (max(a, b) if a and b else a or b for a, b in zip(before, after))
    forward = body(prepared)
    small = forward.small_ops() if hasattr(forward, "small_ops") else "the model's own forward"
    placed = kernels_module.pages_note(prepared)
    small += f"; {placed}" if placed else ""
    return limits_line(mode, fmt, rounds, weight_bytes(model, fmt), weight_bytes(model, "fp32") // 4, peak, small,
                       attention_products(model), fma, attention_kind)


def show_attention_pairs(model: PreTrainedModel, prefix: int, rounds: int = 8) -> str:
    """``attention_pairs`` as lines, for ``--attention``; a sentence where the fast mode does not run the amx
    format with attention on the tiles here."""
    prepared = copy.deepcopy(model)
    prepare_model(prepared, "fast")
    plan = plan_of(prepared)
    if plan is None or plan.fmt != "amx" or native.attention_on_tiles() is None:
        return (f"attention on AMX tiles: not run here (the fast mode's format: {plan.fmt if plan else 'torch'}; "
                "attention on the tiles needs the amx format, a CPU with amx_tile and amx_bf16 and the kernel's grant)")
    pairs = attention_pairs(prepared, prefix, rounds)
    context = bench_prefix(prepared, ATTENTION_SIZES, prefix)[0]
    lines = [f"fast (amx), whole steps at a {context}-token context, attention on the tiles against fp32 "
             f"attention, alternated in {rounds} rounds (ms, medians; the ratio is the median of the rounds' own):"]
    lines += [f"  N={n:3d}: tiles {a:6.1f}  fp32 {b:6.1f}  tiles/fp32 {r:.2f}" for n, (a, b, r) in pairs.items()]
    for on, name in ((0, "tiles"), (1, "fp32 ")):
        one = pairs[1][on]
        lines.append(f"  {name} " + ", ".join(f"t({n})/t(1) {pairs[n][on] / one:.2f}" for n in ATTENTION_SIZES[1:]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m tr_core.speed.calibrate --show [--mode exact|fast] [--remeasure] [--attention CONTEXT]``: the
    kernels chosen on this machine for the embedded model, whether they are batch-invariant here, the machine's read
    bandwidth, and each mode's plain step against the time its weights take to stream, and t(16)/t(1) against its
    floor here; with ``--attention``, the amx format's steps with attention on the tiles against fp32 attention."""

    p = argparse.ArgumentParser(prog="python -m tr_core.speed.calibrate", description=main.__doc__)
    p.add_argument("--show", action="store_true", help="print the chosen kernel table (measured once, then cached)")
    p.add_argument("--mode", choices=MODES, action="append", help="one mode (default: both)")
    p.add_argument("--model", default=None, help="hub id or folder (default: the embedded model)")
    p.add_argument("--remeasure", action="store_true", help="time the layouts again (and cache the new timings)")
    p.add_argument("--attention", type=int, metavar="CONTEXT", action="append",
                   help="the amx format's whole steps with attention on the tiles against fp32 attention, side by "
                        "side, at a cache of CONTEXT tokens (repeatable)")
    args = p.parse_args(argv)
    if not args.show and not args.attention:
        p.error("nothing to do: pass --show or --attention CONTEXT")
    model, _ = load_model(args.model, dtype=torch.float32)
    for context in args.attention or ():
        print(show_attention_pairs(model, context))
    if not args.show:
        return 0
    for mode in args.mode or MODES:
        print(show_kernels(model, mode, remeasure=args.remeasure))
    bandwidth = read_bandwidth_gbs()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (a sum over 1 GiB, {torch.get_num_threads()} threads; it "
          f"moves from minute to minute on a shared machine, so each mode's line reads it again beside its steps)")
    for mode in args.mode or MODES:
        print(show_limits(model, mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
