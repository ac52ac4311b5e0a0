"""Matmul layouts for a linear layer on a CPU: the candidates, their timing where the code runs, and the choice.

One decoding step streams every weight from memory once, so a forward over a few tree tokens should cost about what
one token costs; which matmul layout gets there depends on the CPU (``../shared/FACTS.md``: the layout that made
t(2) = t(1) on an AVX2 machine doubled t(2) on an AMX one). So nothing here is tuned by hand:

1. ``measure`` times every candidate layout for each distinct linear shape of a model and each row count decoding uses
   (rounds interleaved over row counts and layouts, medians), streaming the model's own weights as decoding does;
2. ``choose_layouts`` and ``choose_format`` are pure functions of those timings (tested with stubbed numbers);
3. ``kernel_plan`` caches the timings per machine, thread count, model and mode (``default_cache_dir()/kernels``) and
   returns the choice as a ``KernelPlan`` (plain data), which ``kernels.apply_plan`` puts into the model.

Formats: ``fp32`` (exact mode: only these), ``fp16`` (fbgemm or native.c: fp16 weights, fp32 activations and
arithmetic), ``bf16`` (bf16 weights and activations; a candidate only where the CPU has AVX-512 BF16 or AMX: emulated
bf16 was slower than fp32 for tree forwards, and it rounds activations too, so only the fast mode may choose it) and
``bf16p`` (native.c's bf16 dot products: bf16 weights, each linear layer's inputs rounded to bf16, fp32 sums and fp32
activations everywhere else; where the CPU has AVX-512 BF16 and the C library is built) and ``amx`` (the same
numbers' recipe on AMX tiles: native.c's ``tr_linear_amx``, where the CPU has AMX and the kernel grants the tiles).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ..cachefiles import write_atomically
from ..machine import cpu_name  # noqa: F401 (read here by the other modules of the room)
from ..models import default_cache_dir
from ..modes import MODES
from . import native
from .fusion import stackable
from .tiles import TILE, WeightTiles, weight_tiles  # noqa: F401 (offered here)

# Row counts timed: one token (plain decoding) up to the largest shipped tree (the paper's, 81 nodes). A row count in
# between takes the choice of the next timed count above it; more rows (a prefill) take the format's F.linear.
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 81)
# Two timings within this fraction of each other are a tie (the machines drift by more than this within minutes):
# the tie goes to the layout earlier in ``LAYOUTS`` (fewer extra weight copies, torch's own kernel first), and
# between formats to the one earlier in ``FORMATS`` (fp32, then fp16, which keeps fp32 activations).
TIE = 0.03
# Formats whose whole-step scores lie within this fraction of the best one's are a close call on a shared machine (one
# run here put bf16 products' one-token step at 10.7 ms against fp16 weights' 10.0, where four other readings gave
# 7.7-9.9 against 8.0-10.0): ``chooser.whole_steps`` times every format in ``FIRST_ROUNDS`` rounds, and on a close
# call in more, to ``CLOSE_ROUNDS`` rounds in all, every format timed in every round
CLOSE = 0.10
FIRST_ROUNDS = 3
CLOSE_ROUNDS = 6
# bf16p: bf16 weights and products (each linear layer's inputs rounded to bf16, its sums fp32), fp32 everywhere else;
# only where native.c's tr_linear_bf16 runs (AVX-512 BF16)
# amx: the same on AMX tiles (16 rows by 32 inputs a tile product), where the CPU has AMX and the kernel grants it
FORMATS = ("fp32", "fp16", "bf16", "bf16p", "amx")
# Without the method's expected tokens, the format is chosen on the row counts up to this: plain decoding's one row
# and the trees a CPU verifies (why not all 81: docs/speed.md, "Measurements behind the choices")
FORMAT_MAX_ROWS = 16
HEAD = "head"  # the shape key of the output layer; body shapes are keyed "<out>x<in>"
# per format, the layout whose calls native.c's tr_layers makes itself (the lean forward's whole pass in one call,
# where every body layer runs it); its calls are also timed bare, as they cost there (``measure``'s ``inside``)
STACK_LAYOUTS = {"fp32": "native", "fp16": "fp16n", "bf16p": "bf16n", "amx": "amxn"}
INSIDE = "inside:"  # the prefix of a bare call's timing, in ``measure``'s result and the cache file
BUSY_SOURCE = "measured here on a busy machine, not cached"  # a plan's source where other processes competed


def cpu_has_native_bf16() -> bool:
    """True where the CPU has AVX-512 BF16 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def source_digest(*modules) -> str:
    """A short digest of the modules' source: a cache keyed by it is measured again whenever that code changes, with
    no version to bump by hand."""
    digest = hashlib.sha1()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:10]


def _linear_fp16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # the C++ operator itself where there is one: calling the op's packet, or even its overload, first checks in
    # Python whether to dispatch in Python (for tracing), microseconds a call, 210 calls a step of the embedded model
    global _fp16_op
    if _fp16_op is None:
        overload = torch.ops.quantized.linear_dynamic_fp16.default
        _fp16_op = getattr(overload, "_op", overload)
    return _fp16_op(x, packed)


_fp16_op = None  # the C++ operator of fbgemm's fp16-weight linear, found on first use


def _fp16_tiles(w: torch.Tensor) -> WeightTiles:
    return weight_tiles(w, torch.float16)


def _fp32_tiles(w: torch.Tensor) -> WeightTiles:
    return weight_tiles(w, torch.float32)


def _bf16_tiles(w: torch.Tensor) -> WeightTiles:
    return weight_tiles(w, torch.bfloat16)


def _amx_tiles(w: torch.Tensor) -> WeightTiles:
    return weight_tiles(w, torch.bfloat16, amx=True)


def _tiles_shape(packed: WeightTiles) -> tuple[int, ...]:
    """The shape of ``packed.tiles`` for its weight's shape (``weight_tiles``)."""
    count = -(-packed.out_features // TILE)
    if packed.amx:
        return count, -(-packed.in_features // 32), 2, 16, 16, 2
    if packed.tiles.dtype == torch.bfloat16:
        return count, -(-packed.in_features // 2), TILE, 2
    return count, packed.in_features, TILE


def _linear_native(x: torch.Tensor, packed: WeightTiles) -> torch.Tensor:
    # native.c's tr_linear_f16 / _f32 / _bf16 / _amx: every output one sum in a fixed order, whatever the row count
    # (row-invariant by construction; ``row_invariant`` checks it like any other layout's)
    tiles = packed.tiles
    if not _native_linear:
        _native_linear.update({kind: native.linear(kind) for kind in native.LINEAR})
    run = _native_linear.get(packed.kernel)
    if run is None:
        raise RuntimeError(f"native {packed.kernel} linear not built here (needs AVX-512 F/BW/VL and a C compiler; "
                           f"AMX tiles also the CPU's AMX and the kernel's grant)")
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != packed.in_features:
        raise ValueError(f"native linear takes contiguous fp32 (rows, {packed.in_features}), not "
                         f"{x.dtype} {tuple(x.shape)}")
    if not tiles.is_contiguous() or tuple(tiles.shape) != _tiles_shape(packed):
        raise ValueError(f"not tiles of a ({packed.out_features}, {packed.in_features}) weight: {tuple(tiles.shape)}")
    y = torch.empty(x.shape[0], packed.out_features, dtype=torch.float32)
    run(x.data_ptr(), tiles.data_ptr(), x.shape[0], x.shape[1], packed.out_features, y.data_ptr(),
        torch.get_num_threads())
    return y


def native_tiles(run, packed) -> WeightTiles | None:
    """The tiles a linear layer's kernel call ``run(x, packed)`` reads, where it is native.c's linear layer (the lean
    forward then runs the layer inside ``tr_layers``), else None."""
    return packed if run is _linear_native and isinstance(packed, WeightTiles) else None


def _bare_call(name: str):
    """For a layout of ``STACK_LAYOUTS``: a call ``(x, packed, y)`` of its C kernel straight through ctypes, writing
    ``y`` (what a call costs inside ``tr_layers``, without the Python around it); else None."""
    if name not in STACK_LAYOUTS.values() or name not in LAYOUTS:
        return None
    fn = native.linear(TILE_KIND[LAYOUTS[name].fmt])
    if fn is None:
        return None
    threads = torch.get_num_threads()

    def call(x: torch.Tensor, packed: WeightTiles, y: torch.Tensor) -> None:
        fn(x.data_ptr(), packed.tiles.data_ptr(), x.shape[0], x.shape[1], packed.out_features, y.data_ptr(), threads)
    return call


_native_linear: dict = {}  # native.LINEAR's key -> native.linear(key), found on first use (None: not here)


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def _fp16_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)


def _f_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _w_xt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the weight as the row-major left operand, the activations as a transposed view; the result made contiguous,
    # since the next layer's matmul takes a slow path on a transposed view
    return torch.mm(w, x.t()).t().contiguous()


def _x_wt(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, wt)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@dataclass(frozen=True)
class Layout:
    """One way to compute ``x (rows, in) -> x @ W^T (rows, out)``, contiguous, without the bias.

    ``pack`` turns the weight (out, in), in the format's dtype (fp32 for ``fp16``), into what ``run`` reads: the
    weight itself, or a copy the layout keeps beside it."""
    name: str
    fmt: str
    label: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    copies: bool  # whether ``pack`` makes a copy of the weight


def _layouts() -> dict[str, Layout]:
    out = {}
    for fmt, prefix, note in (("fp32", "", ""), ("bf16", "bf16-", "bf16 ")):
        out[prefix + "linear"] = Layout(prefix + "linear", fmt, f"{note}F.linear", _same, _f_linear, False)
        out[prefix + "wxt"] = Layout(prefix + "wxt", fmt, f"{note}(W @ x^T)^T", _same, _w_xt, False)
        out[prefix + "xwt"] = Layout(prefix + "xwt", fmt, f"{note}x @ W^T (transposed copy)", _transposed, _x_wt,
                                     True)
        out[prefix + "onednn"] = Layout(prefix + "onednn", fmt, f"{note}oneDNN prepacked", _onednn_pack, _onednn,
                                        True)
        if fmt == "fp32":
            out["native"] = Layout("native", "fp32", "C kernel built for this CPU", _fp32_tiles, _linear_native, True)
            out["fp16w"] = Layout("fp16w", "fp16", "fbgemm fp16 weights", _fp16_pack, _linear_fp16, True)
            out["fp16n"] = Layout("fp16n", "fp16", "fp16 weights, C kernel built for this CPU", _fp16_tiles,
                                  _linear_native, True)
            out["bf16n"] = Layout("bf16n", "bf16p", "bf16 weights and products, C kernel built for this CPU",
                                  _bf16_tiles, _linear_native, True)
            out["amxn"] = Layout("amxn", "amx", "bf16 weights and products on AMX tiles, C kernel built for this CPU",
                                 _amx_tiles, _linear_native, True)
    return out


# in order of preference at a tie (see TIE)
LAYOUTS: dict[str, Layout] = _layouts()
# activations and the model
FORMAT_DTYPE = {"fp32": torch.float32, "fp16": torch.float32, "bf16": torch.bfloat16, "bf16p": torch.float32,
                "amx": torch.float32}
# beyond the timed rows
DEFAULT_LAYOUT = {"fp32": "linear", "fp16": "fp16w", "bf16": "bf16-linear", "bf16p": "bf16n", "amx": "amxn"}
# native.c's linear layer per format (``native.LINEAR``'s key: the weights' dtype, or "amx")
TILE_KIND = {"fp32": torch.float32, "fp16": torch.float16, "bf16p": torch.bfloat16, "amx": "amx"}


# A row count may be computed as a larger one (zero rows added, then dropped): some matmuls are slower for 1 row
# than for 2 (a matrix-vector product takes another code path than a matrix-matrix one; docs/speed.md). A padded
# choice is named "<layout>@<rows>"; it is considered up to twice the row count.
PAD = "@"


def base_layout(name: str) -> str:
    """``"wxt@2" -> "wxt"``; an unpadded name is its own base."""
    return name.split(PAD, 1)[0]


def padded_rows(name: str) -> int | None:
    """``"wxt@2" -> 2``: the rows a padded choice computes; None for an unpadded one."""
    return int(name.split(PAD, 1)[1]) if PAD in name else None


def layout_label(name: str) -> str:
    """What a (possibly padded) choice computes, e.g. ``"(W @ x^T)^T on 2 rows (zero rows added)"``."""
    label = LAYOUTS[base_layout(name)].label
    return f"{label} on {padded_rows(name)} rows (zero rows added)" if PAD in name else label


def layout_ms(timings: Timings, shape: str, rows: int, name: str) -> float:
    """The time of one call of choice ``name`` for ``rows`` rows: a padded one costs its padded row count's."""
    return timings[(shape, padded_rows(name) or rows, base_layout(name))]


@functools.cache
def available_layouts() -> tuple[str, ...]:
    """The layouts this torch build and CPU can run, each checked against F.linear on a small product."""
    names = []
    g = torch.Generator().manual_seed(0)
    w32, x32 = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
    for name, layout in LAYOUTS.items():
        if layout.fmt == "bf16" and not cpu_has_native_bf16():
            continue
        dtype = FORMAT_DTYPE[layout.fmt]
        w, x = w32.to(dtype), x32.to(dtype)
        try:
            got = layout.run(x, layout.pack(w))
        except (AttributeError, RuntimeError, NotImplementedError):
            continue
        tol = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2, "bf16p": 5e-2, "amx": 5e-2}[layout.fmt]
        if got.shape == (3, 24) and torch.allclose(got.float(), F.linear(x32, w32), rtol=tol, atol=tol):
            names.append(name)
    return tuple(names)


def mode_formats(mode: str) -> tuple[str, ...]:
    """The formats a mode chooses among: exact only fp32; fast any (fp32 too, where nothing else is faster)."""
    return ("fp32",) if mode == "exact" else FORMATS


# --- choosing: pure functions of the timings --------------------------------------------------------------------

Timings = Mapping[tuple[str, int, str], float]  # (shape, rows, layout) -> ms of one call (one layer)


def choose_families(timings: Timings, available: Iterable[str],
                    invariant: Mapping[str, Iterable[str]]) -> dict[tuple[str, int], str]:
    """Per shape, one *family* for every row count: a layout, or (``"<layout>@2"``) the layout with a one-row call
    computed on two rows (zero row added), among those ``invariant[shape]`` names (found row-invariant on this
    machine: ``row_invariant``): the fastest over the timed row counts up to ``FORMAT_MAX_ROWS`` (geometric mean; a
    tie within ``TIE`` to the unpadded family, then the layout earlier in ``LAYOUTS``). Returns the choice per
    (shape, rows) like ``choose_layouts``; a shape with no invariant family timed is left out.

    >>> t = {("8x8", 1, "linear"): 1.0, ("8x8", 2, "linear"): 2.0, ("8x8", 1, "onednn"): 3.0, ("8x8", 2, "onednn"): 1.0}
    >>> choose_families(t, ("linear", "onednn"), {"8x8": ["onednn", "onednn@2"]})
    {('8x8', 1): 'onednn@2', ('8x8', 2): 'onednn'}
    """
    available = set(available)
    order = {name: i for i, name in enumerate(LAYOUTS)}
    shapes = sorted({shape for shape, _, _ in timings})
    chosen = {}
    for shape in shapes:
        rows = sorted({r for sh, r, name in timings if sh == shape and name in available})
        scored = [r for r in rows if r <= FORMAT_MAX_ROWS] or rows
        costs = {}
        for family in invariant.get(shape, ()):
            base, padded = base_layout(family), PAD in family
            if base not in available or not all((shape, r, base) in timings for r in rows):
                continue
            if padded and 2 not in rows:
                continue
            ms = [timings[(shape, 2 if padded and r == 1 else r, base)] for r in scored]
            costs[family] = statistics.fmean(math.log(m) for m in ms)
        if not costs:
            continue
        best = min(costs.values())
        near = [f for f, c in costs.items() if c <= best + math.log1p(TIE)]
        family = min(near, key=lambda f: (PAD in f, order.get(base_layout(f), len(order))))
        for r in rows:
            chosen[(shape, r)] = family if r == 1 else base_layout(family)
    return chosen


def choose_layouts(timings: Timings, available: Iterable[str]) -> dict[tuple[str, int], str]:
    """For each (shape, rows) timed, the fastest available layout, also computed on more rows (up to twice as many,
    zero rows added: ``"<layout>@<rows>"``) where that is faster; a tie (within ``TIE``) goes to the layout earlier in
    ``LAYOUTS``, an unpadded one before any padded. A layout without a timing or not in ``available`` is never
    chosen.

    >>> choose_layouts({("8x8", 2, "linear"): 3.0, ("8x8", 2, "wxt"): 2.0, ("8x8", 2, "onednn"): 1.0},
    ...                available=("linear", "wxt"))
    {('8x8', 2): 'wxt'}
    >>> choose_layouts({("8x8", 1, "linear"): 1.02, ("8x8", 1, "wxt"): 1.0}, available=("linear", "wxt"))
    {('8x8', 1): 'linear'}
    >>> choose_layouts({("8x8", 1, "wxt"): 2.0, ("8x8", 2, "wxt"): 1.0}, available=("wxt",))
    {('8x8', 1): 'wxt@2', ('8x8', 2): 'wxt'}
    """
    available = set(available)
    order = {name: i for i, name in enumerate(LAYOUTS)}
    groups: dict[tuple[str, int], list[tuple[str, float]]] = {}
    for (shape, rows, layout), ms in timings.items():
        if layout in available:
            groups.setdefault((shape, rows), []).append((layout, ms))
    for (shape, rows), candidates in list(groups.items()):  # the same layouts on up to twice the rows
        for (other_shape, more), others in list(groups.items()):
            if other_shape == shape and rows < more <= 2 * rows:
                candidates += [(f"{layout}{PAD}{more}", ms) for layout, ms in others if PAD not in layout]

    def preference(name: str) -> tuple[int, int, int]:
        return (PAD in name, padded_rows(name) or 0, order.get(base_layout(name), len(order)))

    chosen = {}
    for key, candidates in sorted(groups.items()):
        best = min(ms for _, ms in candidates)
        near = [layout for layout, ms in candidates if ms <= best * (1 + TIE)]
        chosen[key] = min(near, key=preference)
    return chosen


def format_step_ms(timings: Timings, counts: Mapping[str, int], fmt: str,
                   available: Iterable[str], invariant: Mapping[str, Iterable[str]] | None = None) -> dict[int, float]:
    """The linear layers' time of one model step (ms) at each timed row count, in format ``fmt`` with its best
    layouts: sum over shapes of (layers of that shape) x (the chosen layout's time). Row counts where some shape has
    no timed layout of the format are left out."""
    mine = {name for name in available if name in LAYOUTS and LAYOUTS[name].fmt == fmt}
    chosen = choose_layouts(timings, mine) if invariant is None else choose_families(timings, mine, invariant)
    rows = sorted({r for _, r in chosen})
    step = {}
    for r in rows:
        if all((shape, r) in chosen for shape in counts):
            step[r] = sum(n * layout_ms(timings, shape, r, chosen[(shape, r)]) for shape, n in counts.items())
    return step


def choose_format(timings: Timings, counts: Mapping[str, int], formats: Iterable[str],
                  available: Iterable[str], invariant: Mapping[str, Iterable[str]] | None = None,
                  gain: Mapping[int, float] | None = None) -> tuple[str, dict[str, dict[int, float]]]:
    """The format (of ``formats``) that decodes fastest, and every candidate format's step times.

    With ``gain`` (tree size N -> the tokens a step of N rows is expected to add, ``budget.expected_tokens``), a
    format is scored by the decoding speed of the method it serves: the best, over the timed row counts, of tokens
    per ms of the linear layers' step time (``speed_by_format``). Without it, by the total model-step time over the
    row counts decoding uses, as a geometric mean (each row count weighs as a relative speed: a format twice as fast
    at 81 rows and 10% slower at 1 is not judged by the 81 alone); row counts above ``FORMAT_MAX_ROWS`` do not count.
    Only formats timed at every row count that any format was timed at compete; a tie (within ``TIE``) goes to the
    format earlier in ``FORMATS``.

    >>> t = {("8x8", 1, "linear"): 2.0, ("8x8", 1, "fp16w"): 1.0, ("8x8", 4, "linear"): 4.0, ("8x8", 4, "fp16w"): 2.0}
    >>> choose_format(t, {"8x8": 3}, ("fp32", "fp16"), ("linear", "fp16w"))[0]
    'fp16'

    A format faster at up to 16 rows but steep beyond wins by step time; where a 32-row tree adds 4 tokens a step,
    the flat one decodes faster (2.7 tokens per ms against 2.2 at 4 rows):

    >>> t = {(s, r, n): ms for s, r, n, ms in [("8x8", 1, "linear", 1.0), ("8x8", 4, "linear", 1.3),
    ...      ("8x8", 32, "linear", 1.5), ("8x8", 1, "fp16w", 0.6), ("8x8", 4, "fp16w", 0.9), ("8x8", 32, "fp16w", 4.0)]}
    >>> choose_format(t, {"8x8": 1}, ("fp32", "fp16"), ("linear", "fp16w"))[0]
    'fp16'
    >>> choose_format(t, {"8x8": 1}, ("fp32", "fp16"), ("linear", "fp16w"), gain={1: 1.0, 4: 2.0, 32: 4.0})[0]
    'fp32'
    """
    available = tuple(available)
    steps = {fmt: format_step_ms(timings, counts, fmt, available, invariant) for fmt in formats}
    steps = {fmt: s for fmt, s in steps.items() if s}
    if not steps:
        raise ValueError("no format has timings for every shape")
    return pick_format(steps, gain), steps


def pick_format(steps: Mapping[str, Mapping[int, float]], gain: Mapping[int, float] | None = None) -> str:
    """The format whose step times (``steps``: format -> rows -> ms) decode fastest: with ``gain``, by the best
    expected tokens per ms over the row counts (``speed_by_format``); without, by the geometric mean of the step
    times over the row counts up to ``FORMAT_MAX_ROWS``. Only formats timed at every row count that any format was
    timed at compete; a tie (within ``TIE``) goes to the format earlier in ``FORMATS``. ``choose_format`` picks on
    the linear layers' step times, ``chooser.choose_plan`` on whole steps.

    >>> pick_format({"fp16": {1: 10.0, 4: 14.0}, "bf16": {1: 33.0, 4: 34.0}})
    'fp16'
    >>> pick_format({"fp16": {1: 10.0, 4: 40.0}, "bf16": {1: 12.0, 4: 13.0}}, gain={1: 1.0, 4: 2.5})
    'bf16'
    """
    score = format_scores(steps, gain)
    best = min(score.values())
    near = [fmt for fmt, sc in score.items() if sc <= best + math.log1p(TIE)]
    return min(near, key=FORMATS.index)


def format_scores(steps: Mapping[str, Mapping[int, float]], gain: Mapping[int, float] | None = None
                  ) -> dict[str, float]:
    """``pick_format``'s score of each format that competes (lower is faster; a difference of log(x) is x times the
    speed): those timed at every row count any format was timed at (up to ``FORMAT_MAX_ROWS`` without ``gain``)."""
    steps = {fmt: s for fmt, s in steps.items() if s}
    if not steps:
        raise ValueError("no format has step times")
    every = set().union(*steps.values())
    rows = every if gain else ({r for r in every if r <= FORMAT_MAX_ROWS} or every)
    complete = {fmt: {r: ms for r, ms in s.items() if r in rows} for fmt, s in steps.items()}
    complete = {fmt: s for fmt, s in complete.items() if set(s) == rows}
    if not complete:
        raise ValueError("no format has step times at every row count")
    return {fmt: _step_score(s, gain) for fmt, s in complete.items()}


def close_formats(steps: Mapping[str, Mapping[int, float]], gain: Mapping[int, float] | None = None) -> list[str]:
    """The formats that ``pick_format`` would rank within ``CLOSE`` of the best (the best first), where there are
    two or more; else [] (a clear call).

    >>> close_formats({"fp16": {1: 10.0, 4: 12.0}, "bf16p": {1: 10.5, 4: 11.0}, "fp32": {1: 20.0, 4: 24.0}})
    ['bf16p', 'fp16']
    >>> close_formats({"fp16": {1: 10.0, 4: 12.0}, "fp32": {1: 20.0, 4: 24.0}})
    []
    """
    score = format_scores(steps, gain)
    best = min(score.values())
    close = sorted((sc, fmt) for fmt, sc in score.items() if sc <= best + math.log1p(CLOSE))
    return [fmt for _, fmt in close] if len(close) > 1 else []


def gain_at(gain: Mapping[int, float], rows: int) -> float:
    """``gain`` at ``rows`` rows: the largest tree size up to ``rows`` that it gives (1 token below them all)."""
    known = [n for n in gain if n <= rows]
    return gain[max(known)] if known else 1.0


def speed_by_format(steps: Mapping[str, Mapping[int, float]], gain: Mapping[int, float]
                    ) -> dict[str, tuple[int, float]]:
    """Per format, the row count where its expected decoding speed peaks and that speed, in tokens per ms of the
    linear layers' step time (``steps``: format -> rows -> ms; ``gain`` as for ``choose_format``).

    >>> speed_by_format({"bf16": {1: 2.0, 8: 2.5}}, {1: 1.0, 8: 2.0})
    {'bf16': (8, 0.8)}
    """
    out = {}
    for fmt, by_rows in steps.items():
        rows = max(by_rows, key=lambda r: (gain_at(gain, r) / by_rows[r], -r))
        out[fmt] = (rows, gain_at(gain, rows) / by_rows[rows])
    return out


# --- measuring ---------------------------------------------------------------------------------------------------

def linear_shapes(model: nn.Module) -> dict[str, list[nn.Linear]]:
    """The model's linear layers by shape: ``"<out>x<in>"`` -> the body's ``nn.Linear`` layers of that shape (in
    model order), and ``HEAD`` -> [the output layer]."""
    shapes: dict[str, list[nn.Linear]] = {}
    for module in model.base_model.modules():
        if isinstance(module, nn.Linear):
            shapes.setdefault(f"{module.out_features}x{module.in_features}", []).append(module)
    shapes[HEAD] = [model.get_output_embeddings()]
    return shapes


# fp32 bytes of body weights one timing pass streams: larger than any CPU cache seen here, so weights come from memory
# as in decoding (where the whole model streams between two uses of a layer), and small enough for a quick pass
STREAM_BYTES = 128 << 20


def _sample(layers: list[nn.Linear], fraction: float) -> list[torch.Tensor]:
    keep = max(1, round(len(layers) * fraction))
    step = len(layers) / keep
    return [layers[int(i * step)].weight.detach() for i in range(keep)]


@torch.inference_mode()
def measure(model: nn.Module, layouts: Iterable[str], rows: Iterable[int] = ROW_COUNTS, rounds: int = 5,
            budget_s: float = 20.0, report_busy: bool = False, inside: bool = False):
    """Time (ms of one call of one layer) of each layout for each linear shape of ``model`` (an fp32 CPU model) and
    row count: the median of every call timed. A round runs, for each row count and layout in turn, one pass over a
    sample of the body's own layers of every shape (``STREAM_BYTES`` of weights, evenly spread over the model) and the
    output layer, each call timed apart; so a slow spell of the machine hits every layout alike, and the median drops
    a call the scheduler stalled. Round 0 warms up; rounds stop once ``budget_s`` is spent (at least one is timed).
    Returns {(shape, rows, layout): ms}, and with ``report_busy`` also whether other processes competed for the cores
    meanwhile (``machine_busy``). With ``inside``, the layouts of ``STACK_LAYOUTS`` are also timed as bare C calls
    (``_bare_call``), in passes of their own after every layout's, as ``(shape, rows, INSIDE + layout)``."""
    layouts, rows = list(layouts), list(rows)
    shapes = linear_shapes(model)
    body_bytes = sum(layer.weight.numel() * 4 for s, ls in shapes.items() if s != HEAD for layer in ls)
    fraction = min(1.0, STREAM_BYTES / max(body_bytes, 1))
    weights = {s: [ls[0].weight.detach()] if s == HEAD else _sample(ls, fraction) for s, ls in shapes.items()}
    packs = {name: {s: [LAYOUTS[name].pack(w.to(FORMAT_DTYPE[LAYOUTS[name].fmt])) for w in ws]
                    for s, ws in weights.items()} for name in layouts}
    g = torch.Generator().manual_seed(0)
    inputs = {(s, r, fmt): torch.randn(r, ws[0].shape[1], generator=g).to(FORMAT_DTYPE[fmt])
              for s, ws in weights.items() for r in rows for fmt in FORMATS}
    times: dict[tuple[str, int, str], list[float]] = {}
    load: list[int] = []  # runnable threads of the machine, sampled after each row count (see machine_busy)
    clock = time.perf_counter
    start = clock()
    # each timed pass: (timings' name, the call, the layout whose packs it reads); the bare calls come after every
    # layout's own, so the weights they read were streamed out of the caches since their own pass
    passes = [(name, LAYOUTS[name].run, name) for name in layouts]
    if inside:
        passes += [(INSIDE + name, call, name) for name in layouts if (call := _bare_call(name)) is not None]
    outputs = {(name, s, r): torch.empty(r, ws[0].shape[0]) for name, _, _ in passes if name.startswith(INSIDE)
               for s, ws in weights.items() for r in rows}
    for round_ in range(rounds + 1):
        for r in rows:
            for timed, run, name in passes:
                fmt = LAYOUTS[name].fmt
                for s, ps in packs[name].items():
                    x = inputs[(s, r, fmt)]
                    samples = times.setdefault((s, r, timed), [])
                    out = outputs.get((timed, s, r))
                    for p in ps:
                        t0 = clock()
                        if out is None:
                            run(x, p)
                        else:
                            run(x, p, out)
                        if round_:
                            samples.append((clock() - t0) * 1e3)
            running = runnable_threads()
            if running is not None:
                load.append(running)
        if round_ and clock() - start > budget_s:
            break
    timings = {key: statistics.median(ts) for key, ts in times.items()}
    return (timings, machine_busy(load)) if report_busy else timings


def runnable_threads() -> int | None:
    """How many threads of the whole machine are runnable now (``procs_running`` of /proc/stat, this process's own
    included), or None where there is no /proc/stat."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def machine_busy(samples: list[int]) -> bool:
    """Whether other processes competed for the cores while timing: in most samples of ``runnable_threads`` more
    threads were runnable than this process's torch threads, plus one for the sampling thread itself.

    >>> machine_busy([2, 3, 2]), machine_busy([5, 6, 2])  # with 2 torch threads
    (False, True)
    """
    return bool(samples) and statistics.median(samples) > torch.get_num_threads() + 1


# --- row invariance: which layouts give a row the same bits whatever rows go with it ------------------------------

def _cancelling_probe(out_features: int, in_features: int, dtype: torch.dtype, rows: int,
                      g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out, in) and ``rows`` inputs (rows, in) in ``dtype`` whose products cancel: a quarter of the input
    columns are large values, another quarter their exact negatives (the weight equal on both), the rest small. The
    exact result is small, while partial sums are large, so any change in the order of accumulation shows in the
    rounded result (also after rounding to bf16, which hides most of the ordinary last-bit differences)."""
    q = in_features // 4
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    w[:, q:2 * q] = w[:, :q]
    x = (torch.randn(rows, in_features, generator=g) * 2.0 ** -6).to(dtype)
    big = (torch.randn(rows, q, generator=g) * 2.0 ** 10).to(dtype)
    x[:, :q], x[:, q:2 * q] = big, -big
    return w, x


# The row counts the invariance check runs: every count a draft tree or a prefill chunk of the embedded model's
# decoding may have up to 16, then every timed count and the counts around a window (attention.BLOCK = 64), and more
# rows than any tree (prefill chunks stop at 64; a custom model may run more)
CHECKED_ROWS = tuple(sorted(set(range(1, 17)) | set(ROW_COUNTS) | {63, 64, 65, 100}))


@torch.inference_mode()
def row_invariant(shapes: Mapping[str, tuple[int, int]], layouts: Iterable[str],
                  rows: Iterable[int] = CHECKED_ROWS) -> dict[str, list[str]]:
    """For each linear shape (``shapes``: its key -> ``(out, in)``), the families of ``layouts`` whose result for
    every row is bit for bit the same at every row count in ``rows``: ``"<layout>"`` (one row computed as one row)
    and ``"<layout>@2"`` (one row computed on two, a zero row added). Checked on this machine with inputs whose sums
    cancel (``_cancelling_probe``): every row of each call against the same row of the largest call."""
    rows = sorted(set(rows))
    most = rows[-1]
    g = torch.Generator().manual_seed(0)
    found: dict[str, list[str]] = {}
    for key, (out_features, in_features) in shapes.items():
        found[key] = []
        probes = {}
        for name in layouts:
            layout = LAYOUTS[name]
            dtype = FORMAT_DTYPE[layout.fmt]
            if dtype not in probes:
                probes[dtype] = _cancelling_probe(out_features, in_features, dtype, most, g)
            w, x = probes[dtype]
            packed = layout.pack(w)
            full = layout.run(x, packed)
            steady = all(torch.equal(layout.run(x[:r].contiguous(), packed), full[:r]) for r in rows if 2 <= r < most)
            if not steady:
                continue
            if torch.equal(layout.run(x[:1].contiguous(), packed)[0], full[0]):
                found[key].append(name)
            if torch.equal(layout.run(torch.cat([x[:1], torch.zeros_like(x[:1])]), packed)[0], full[0]):
                found[key].append(f"{name}{PAD}2")
    return found


# --- the plan: cached timings and the choice made from them -------------------------------------------------------

@dataclass
class KernelPlan:
    """What ``kernels.apply_plan`` puts into a model, as plain data: the format, and for each shape (``"<out>x<in>"``
    or ``HEAD``) and timed row count the chosen layout; with the timings it was chosen from."""
    mode: str
    fmt: str
    rows: tuple[int, ...]
    layouts: dict[str, dict[int, str]]  # shape -> rows -> layout name
    counts: dict[str, int]  # shape -> layers of that shape
    timings: dict[str, dict[int, dict[str, float]]]  # shape -> rows -> layout -> ms of one call
    step_ms: dict[str, dict[int, float]]  # format -> rows -> the linear layers' ms of one step (best layouts)
    source: str = "measured here"  # or "cached": measured by an earlier process on this machine
    # whether every shape runs one row-invariant family (a row's result the same whatever rows go with it), and the
    # layouts found row-dependent here, per format (what the chooser excluded)
    invariant: bool = False
    excluded: dict[str, list[str]] = field(default_factory=dict)
    # with the method's expected tokens per step (``choose_format``'s ``gain``): per format, the row count where its
    # decoding speed peaks and that speed (tokens per ms of the linear layers); empty where chosen by step time alone
    speed: dict[str, tuple[int, float]] = field(default_factory=dict)
    # whether the body's layers were chosen to run as one C call a pass (``stack_choice``), and the bare timings of
    # the format's ``STACK_LAYOUTS`` layout that choice weighed: shape -> rows -> ms of one call inside that call
    stacked: bool = False
    inside: dict[str, dict[int, float]] = field(default_factory=dict)
    # where the fast format was chosen on whole steps (``chooser.choose_plan``): format -> rows -> ms of a whole
    # model step (forward, output layer, top-k), each format's model prepared and timed here; else empty, and
    # ``whole_note`` says why the linear layers' times alone chose it
    whole_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    whole_note: str = ""
    # the formats whose whole prepared model gave a position other logits alone than in a tree or a prefill here
    # (``chooser.invariant_plans``): format -> what differed; none of them is offered
    dropped: dict[str, str] = field(default_factory=dict)
    # the amx format: whether attention runs on the tiles here (``chooser.tiles_choice``: whole steps with it against
    # fp32 attention, measured on this machine), None where that is not chosen (other formats, or not measured), and
    # the reason in words
    tiles: bool | None = None
    tiles_note: str = ""

    def layout_for(self, shape: str, rows: int) -> str:
        """The chosen layout for ``rows`` rows: the choice of the next timed row count up; beyond them the largest
        count's layout where the plan is row-invariant, else the format's F.linear."""
        for r in self.rows:
            if r >= rows:
                return self.layouts[shape][r]
        return base_layout(self.layouts[shape][self.rows[-1]]) if self.invariant else DEFAULT_LAYOUT[self.fmt]

    def tag(self) -> str:
        """A short name of the choice, for cache keys of what depends on it (e.g. t(N))."""
        choice = [self.fmt, sorted((s, sorted(c.items())) for s, c in self.layouts.items())]
        digest = json.dumps(choice + ([self.tiles] if self.tiles is not None else []))
        return f"{self.fmt}-{hashlib.sha1(digest.encode()).hexdigest()[:8]}"


def make_plan(mode: str, timings: Timings, counts: Mapping[str, int], available: Iterable[str],
              source: str = "measured here", invariant: Mapping[str, Iterable[str]] | None = None,
              gain: Mapping[int, float] | None = None, inside: Timings | None = None,
              only: str | None = None) -> KernelPlan:
    """The plan for ``mode`` from timings (pure): the format by ``choose_format``, then per shape and row count the
    fastest layout of that format (``choose_layouts``). Given ``invariant`` (shape -> the families found
    row-invariant here, ``row_invariant``), only formats where every shape has such a family compete, and each
    shape runs its fastest family at every row count (``choose_families``); where no format has one for every
    shape, the plan falls back to the fastest layouts and says it is not row-invariant. ``gain``: the method's
    expected tokens per step by tree size, to choose the format by decoding speed (``choose_format``). ``inside``:
    bare timings of the ``STACK_LAYOUTS`` layouts where the body can run as one C call (``stack_choice``).
    ``only``: the plan of that one format of the mode (``format_plans``)."""
    available = tuple(available)
    formats = mode_formats(mode) if only is None else tuple(f for f in mode_formats(mode) if f == only)
    steady = None
    if invariant is not None:
        whole = [f for f in formats if set(choose_families(
            timings, [n for n in available if LAYOUTS[n].fmt == f], invariant)) >= {
            (sh, r) for sh, r, n in timings if n in available and LAYOUTS[n].fmt == f}]
        if whole:
            formats, steady = tuple(whole), invariant
    fmt, steps = choose_format(timings, counts, formats, available, steady, gain)
    mine = [n for n in available if LAYOUTS[n].fmt == fmt]
    chosen = choose_layouts(timings, mine) if steady is None else choose_families(timings, mine, steady)
    rows = tuple(sorted({r for _, r in chosen}))
    layouts = {s: {r: chosen[(s, r)] for r in rows} for s in counts}
    table: dict[str, dict[int, dict[str, float]]] = {}
    for (s, r, name), ms in timings.items():
        table.setdefault(s, {}).setdefault(r, {})[name] = ms
    excluded = {}
    if invariant is not None:
        for f in mode_formats(mode):
            names = [n for n in available if LAYOUTS[n].fmt == f]
            bad = sorted({n for n in names for sh in counts if n not in invariant.get(sh, ())
                          and f"{n}{PAD}2" not in invariant.get(sh, ())})
            if bad:
                excluded[f] = bad
    stacked, stack_ms = False, {}
    if inside and steady is not None:
        stack = stack_choice(timings, inside, counts, fmt, chosen, steady, gain)
        if stack is not None:
            stacked, name, step = True, STACK_LAYOUTS[fmt], stack
            for s in counts:
                if s != HEAD:
                    layouts[s] = {r: name for r in rows}
            steps = {**steps, fmt: step}
    for (s, r, name), ms in (inside or {}).items():
        if name == STACK_LAYOUTS.get(fmt):
            stack_ms.setdefault(s, {})[r] = ms
    speed = {}
    if gain and len(steps) > 1:
        speed = speed_by_format({f: s for f, s in steps.items() if set(s) >= set(steps[fmt])}, gain)
    return KernelPlan(mode, fmt, rows, layouts, dict(counts), table, steps, source, steady is not None, excluded,
                      speed, stacked, stack_ms)


def _step_score(step: Mapping[int, float], gain: Mapping[int, float] | None) -> float:
    """Lower is faster: ``choose_format``'s score of one format's step times."""
    if gain:
        return -math.log(speed_by_format({"f": step}, gain)["f"][1])
    rows = [r for r in step if r <= FORMAT_MAX_ROWS] or list(step)
    return statistics.fmean(math.log(step[r]) for r in rows)


def stack_choice(timings: Timings, inside: Timings, counts: Mapping[str, int], fmt: str,
                 chosen: Mapping[tuple[str, int], str], invariant: Mapping[str, Iterable[str]],
                 gain: Mapping[int, float] | None = None) -> dict[int, float] | None:
    """Whether the body's linear layers should all run ``STACK_LAYOUTS[fmt]``, so that a pass runs as one C call
    (``tr_layers``), which makes that layout's calls without the Python around each: the linear layers' step time
    that way (rows -> ms: the body's bare calls, ``inside``, plus the output layer's chosen calls), where it scores at
    least as well as the step of the layouts chosen call by call (``chosen``, at their own calls' timings; a tie,
    within ``TIE``, goes to the stack, which also runs the operations between the linear layers without Python); else
    None. Needs that
    layout row-invariant for every body shape and timed bare at every row count.

    >>> t = {("8x8", 1, "fp16n"): 1.2, ("8x8", 1, "fp16w"): 1.0, (HEAD, 1, "fp16w"): 5.0}
    >>> inside = {("8x8", 1, "fp16n"): 0.9}
    >>> chosen = {("8x8", 1): "fp16w", (HEAD, 1): "fp16w"}
    >>> stack_choice(t, inside, {"8x8": 10, HEAD: 1}, "fp16", chosen, {"8x8": ["fp16n", "fp16w"]})
    {1: 14.0}
    >>> stack_choice(t, {("8x8", 1, "fp16n"): 1.2}, {"8x8": 10, HEAD: 1}, "fp16", chosen, {"8x8": ["fp16n"]}) is None
    True
    """
    name = STACK_LAYOUTS.get(fmt)
    body = [s for s in counts if s != HEAD]
    rows = sorted({r for _, r in chosen})
    if name is None or not body or not rows or any(
            name not in invariant.get(s, ()) or any((s, r, name) not in inside for r in rows) for s in body):
        return None
    stack, free = {}, {}
    for r in rows:
        head = sum(n * layout_ms(timings, s, r, chosen[(s, r)]) for s, n in counts.items() if s == HEAD)
        stack[r] = sum(counts[s] * inside[(s, r, name)] for s in body) + head
        free[r] = sum(counts[s] * layout_ms(timings, s, r, chosen[(s, r)]) for s in body) + head
    return stack if _step_score(stack, gain) <= _step_score(free, gain) + math.log1p(TIE) else None


def cache_key(model: nn.Module, mode: str) -> str:
    """What the timings depend on: the model (name and linear shapes), its dtype, the mode's candidates, the CPU,
    the thread count, the torch build and the native library (its source's digest, or "torch" where it is not
    built, and which of its linear layers: the "fp16n" and "native" layouts come and go with them). A cached plan
    also keeps only the layouts that run in this process."""
    name = Path(str(getattr(model.config, "_name_or_path", "model"))).name or "model"
    shapes = "_".join(f"{s}x{len(ls)}" if s != HEAD else f"h{ls[0].out_features}"
                      for s, ls in sorted(linear_shapes(model).items()))
    dtype = str(model.get_output_embeddings().weight.dtype).removeprefix("torch.")
    raw = (f"{source_digest(sys.modules[__name__])}-{native.tag()}-{name}-{shapes}-{dtype}-{mode}-{cpu_name()}"
           f"-t{torch.get_num_threads()}-torch{torch.__version__}")
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in raw)[:240]


def cache_path(model: nn.Module, mode: str) -> Path:
    return default_cache_dir() / "kernels" / f"{cache_key(model, mode)}.json"


def kernel_plan(model: nn.Module, mode: str, use_cache_file: bool = True, remeasure: bool = False,
                gain: Mapping[int, float] | None = None, **measure_kw) -> KernelPlan:
    """The plan for ``model`` (fp32, on the CPU) in ``mode``, the format chosen on the linear layers' times: from this
    machine's cached timings, else (or with ``remeasure``) measured now (a few seconds to ~30 s on 2 cores) and
    cached. ``gain``: see ``make_plan``."""
    return make_plan(mode, gain=gain, **plan_inputs(model, mode, use_cache_file, remeasure, **measure_kw))


def format_plans(model: nn.Module, mode: str, use_cache_file: bool = True, remeasure: bool = False,
                 gain: Mapping[int, float] | None = None, **measure_kw) -> dict[str, KernelPlan]:
    """Per format the mode may run here, its plan (``make_plan``'s ``only``), from one set of timings
    (``plan_inputs``): first the format ``kernel_plan`` chooses on the linear layers' times, then every other format
    that is as row-invariant as it and timed at every row count. ``chooser.choose_plan`` times their whole steps."""
    inputs = plan_inputs(model, mode, use_cache_file, remeasure, **measure_kw)
    first = make_plan(mode, gain=gain, **inputs)
    plans = {first.fmt: first}
    for fmt in mode_formats(mode):
        if fmt in plans:
            continue
        try:
            plan = make_plan(mode, gain=gain, only=fmt, **inputs)
        except ValueError:  # no timings of this format for every shape
            continue
        if plan.fmt == fmt and plan.invariant == first.invariant and set(plan.rows) == set(first.rows):
            plans[fmt] = plan
    return plans


def plan_inputs(model: nn.Module, mode: str, use_cache_file: bool = True, remeasure: bool = False,
                **measure_kw) -> dict:
    """``make_plan``'s arguments but the mode (timings, counts, available, source, invariant, inside) for ``model``
    in ``mode``: this machine's cached timings, else those of a mode whose candidates include all of this mode's
    (``wider_cache``: the exact mode's from the fast mode's, which times the fp32 layouts in the same passes as the
    others), else (or with ``remeasure``) measured now and cached, unless other processes competed for the cores
    meanwhile (then used by this process, measured again by the next). Within ``every_mode_at_once`` a mode measured
    now times the widest mode's candidates, cached as that mode's, and reads its own from them."""
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    layouts = [n for n in available_layouts() if LAYOUTS[n].fmt in mode_formats(mode)]
    stack = stackable(model)
    path = cache_path(model, mode)
    cached = None
    if use_cache_file and not remeasure:
        cached = (json.loads(path.read_text()), "cached") if path.is_file() else wider_cache(model, mode, layouts)
        widest = max(MODES, key=lambda m: len(mode_formats(m)))
        if cached is None and _EVERY_MODE and widest != mode and set(mode_formats(mode)) <= set(mode_formats(widest)):
            plan_inputs(model, widest, use_cache_file, remeasure, **measure_kw)  # cached unless the machine was busy
            cached = wider_cache(model, mode, layouts)
    if cached is not None:
        data, source = cached
        here = set(layouts)  # a cache folder copied from another machine may name layouts that do not run here
        timings = {(s, int(r), name): ms for s, r, name, ms in data["timings"] if name.removeprefix(INSIDE) in here}
        timings, inside = _split_inside(timings)
        invariant = {s: [f for f in families if base_layout(f) in here] for s, families in data["invariant"].items()}
        return dict(timings=timings, counts=counts, available=[n for n in data["available"] if n in here],
                    source=source, invariant=invariant, inside=inside if stack else None)
    invariant = row_invariant(_shape_sizes(model), layouts)
    timings, busy = measure(model, layouts, report_busy=True, inside=stack, **measure_kw)
    timings, inside = _split_inside(timings)
    if busy:  # a busy machine's timings are mostly scheduler stalls (seen: every 2-thread matmul taking a 12 or 24 ms
        # time slice while other processes ran)
        return dict(timings=timings, counts=counts, available=layouts, invariant=invariant, inside=inside,
                    source=BUSY_SOURCE)
    if use_cache_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [[s, r, name, ms] for (s, r, name), ms in sorted(timings.items())]
        rows += [[s, r, INSIDE + name, ms] for (s, r, name), ms in sorted(inside.items())]
        write_atomically(path, json.dumps({"available": layouts, "cpu": cpu_name(), "threads": torch.get_num_threads(),
                                    "invariant": invariant, "timings": rows}, indent=0))
    return dict(timings=timings, counts=counts, available=layouts, invariant=invariant, inside=inside)


_EVERY_MODE = False  # within ``every_mode_at_once``


@contextlib.contextmanager
def every_mode_at_once():
    """Within it, the first mode whose layouts are timed on this machine times the widest mode's candidates (the fast
    mode's, which include the exact mode's fp32 layouts) in one measurement, cached as that mode's, and reads its own
    from it (``wider_cache``); the other mode then reads its cache. For a caller that prepares both modes, as the app
    does at its start (``app.preload``). On cold starts of the 2-vCPU Xeon with AMX: the exact mode's own measurement
    15.0 s (13.1 s of timings, 1.9 s of row-invariance probes), the fast mode's 29.6 s (25.6 + 4.0); both at once
    27.3 s (22.6 + 4.7; the timings stop on a budget, ``measure``'s ``budget_s``). A caller of one mode (the command
    line) times only that mode's candidates."""
    global _EVERY_MODE
    before, _EVERY_MODE = _EVERY_MODE, True
    try:
        yield
    finally:
        _EVERY_MODE = before


def wider_cache(model: nn.Module, mode: str, layouts: Iterable[str]) -> tuple[dict, str] | None:
    """This machine's cached timings of another mode that timed every one of ``layouts`` (``mode``'s candidates),
    and the plan's source that says so; None where there are none. Each round of ``measure`` times every layout in
    turn, so the fast mode's passes over the fp32 layouts are timed as the exact mode's own would be (in fewer
    rounds: its budget, ``measure``'s ``budget_s``, is shared by more layouts), and its row-invariance check covers
    them (``every_mode_at_once``)."""
    for other in MODES:
        path = cache_path(model, other)
        if other == mode or not path.is_file():
            continue
        data = json.loads(path.read_text())
        if set(layouts) <= set(data["available"]):
            return data, f"cached, timed with the {other} mode's candidates"
    return None


def _split_inside(timings: Timings) -> tuple[dict, dict]:
    """``measure``'s timings as (the layouts' own calls, the bare calls without ``INSIDE`` in their names)."""
    own, inside = {}, {}
    for (s, r, name), ms in timings.items():
        if name.startswith(INSIDE):
            inside[(s, r, name.removeprefix(INSIDE))] = ms
        else:
            own[(s, r, name)] = ms
    return own, inside


def _shape_sizes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The model's linear shapes (``linear_shapes``' keys) as (out, in), the output layer's too."""
    return {s: (ls[0].out_features, ls[0].in_features) for s, ls in linear_shapes(model).items()}
