"""The two numeric modes, for every method alike (plain decoding runs in the same mode as the one it is compared
with), and the matmul kernels each runs on:

- ``exact``: fp32, the model's own numerics.
- ``fast``: a decoding step on a CPU is memory-bound (every weight is streamed once per step), so the fast mode may
  store the weights in half the bytes: fp16 weights with fp32 activations and arithmetic (fbgemm or native.c; each
  weight rounded once, a relative change of at most 2^-11), bf16 weights and activations where the CPU has AVX-512
  BF16 or AMX (activations rounded too), or, where it has AVX-512 BF16, bf16 dot products (native.c: each linear
  layer's inputs rounded to bf16, fp32 everywhere else). Which one, if any, is chosen by timing whole steps of each
  (``choose_plan``).

In both modes each linear layer (``ChosenLinear``) and the output layer (``OutputHead``) compute every row count with
one matmul layout per shape (``layouts.py``: F.linear, (W @ x^T)^T, x @ W^T from a transposed copy, oneDNN-prepacked,
fbgemm fp16; a one-row call possibly on two rows), the fastest of those found *row-invariant* on this machine: a
row's result is the same bits whatever rows are computed with it, so a token's logits are the same in a plain step,
a draft tree and a prefill, and every method's output is plain decoding's in either mode (with the attention of
``attention.py``). The timings and the invariance check are made once per machine, thread count, model and mode and
cached; ``kernel_table``, ``kernel_summary`` and ``describe_format`` show the choice.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import weakref

import torch
from torch import nn

from ..modes import MODES
from . import layouts, native, pages
from .fusion import layers_swapped, supports
from .layouts import HEAD, LAYOUTS, KernelPlan
from .lean import LeanLlama


@functools.cache
def fp16_weights_available() -> bool:
    """True where this torch build has fbgemm's fp16-weight linear (x86 CPUs with AVX2)."""
    return "fp16w" in layouts.available_layouts()


# mode -> the sentence of the latest model prepared in that mode in this process: what the mode runs on this machine
# (the format is chosen per machine and model, after the model is loaded, so ``mode_dtype`` cannot know it before)
_LATEST: dict[str, str] = {}


def mode_dtype(mode: str, model: nn.Module | None = None) -> tuple[torch.dtype, str]:
    """The dtype a mode loads the model in (fp32: the fast mode measures its formats on the fp32 model and converts
    it in ``prepare_model`` where bf16 is chosen), and a sentence saying what the mode runs on this machine: that of
    ``model`` once prepared, else of the latest model prepared in that mode, else what it will choose among."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    plan = _PLANS.get(model) if model is not None else None
    if plan is not None and plan.mode == mode:
        return torch.float32, describe_format(plan, attention_invariant(model))
    if mode in _LATEST:
        return torch.float32, _LATEST[mode]
    if mode == "exact":
        return torch.float32, "exact: fp32"
    half = [name for name, ok in (("fp16 weights", fp16_weights_available()),
                                  ("bf16", "bf16-linear" in layouts.available_layouts()),
                                  ("bf16 products", "bf16n" in layouts.available_layouts()),
                                  ("bf16 products on AMX tiles", "amxn" in layouts.available_layouts())) if ok]
    if not half:
        return torch.float32, "fast: fp32 (no fp16-weight kernel and no AVX-512 BF16/AMX on this CPU)"
    return torch.float32, f"fast: {' or '.join(half + ['fp32'])}, whichever measures fastest here"


FORMAT_NAMES = {"fp32": "fp32", "fp16": "fp16 weights, fp32 arithmetic", "bf16": "bf16",
                "bf16p": "bf16 weights and products, fp32 activations",
                "amx": "bf16 weights and products on AMX tiles, fp32 activations"}
SHORT_NAMES = {"fp32": "fp32", "fp16": "fp16 weights", "bf16": "bf16", "bf16p": "bf16 products",
               "amx": "AMX tiles"}


def _bf16_unit() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    return "AMX" if " amx_bf16" in flags else "AVX-512 BF16"


def _format_name(fmt: str) -> str:
    if fmt == "amx" and native.attention_on_tiles() is not None:
        return ("bf16 weights and products on AMX tiles, and attention over the keys before its window too, fp32 "
                "activations")
    return f"bf16 ({_bf16_unit()})" if fmt == "bf16" else FORMAT_NAMES[fmt]


def describe_format(plan: KernelPlan, attention: bool = True) -> str:
    """``"exact: fp32"`` or, for the fast mode, which format it runs and why, e.g. ``"fast: bf16 (AMX), chosen by
    measurement: linear layers 1.9x faster than fp16 weights, 2.8x than fp32 (steps of 1-16 tokens, geometric
    mean)"``: the ratios ``layouts.choose_format`` chose by; then whether a row's numbers are the same alone, in a
    tree and in a prefill (``describe_invariance``; ``attention``: whether the model runs the batch-invariant
    attention, ``attention_invariant``)."""
    tiles = f"; {plan.tiles_note}" if plan.tiles_note else ""
    return f"{_describe_format(plan)}{tiles}; {describe_invariance(plan, attention)}"


def describe_invariance(plan: KernelPlan, attention: bool = True) -> str:
    """Whether the plan's linear kernels (and, by ``attention``, the model's attention) give a row the same bits
    whatever rows go with it, checked on this machine (what makes every method's output plain decoding's), and which
    layouts the plan left out for not doing so."""
    dropped = [", ".join(sorted({LAYOUTS[n].label for names in plan.excluded.values() for n in names}))]
    dropped += [f"the {SHORT_NAMES[fmt]} format, whose whole model {why}" for fmt, why in plan.dropped.items()
                if fmt != plan.fmt]
    dropped = [d for d in dropped if d]
    left_out = f" (left out as row-dependent here: {'; '.join(dropped)})" if dropped else ""
    if not attention:
        return ("NOT batch-invariant: this model's attention is torch's fused kernel (only Llama-family models on a "
                "CPU with a row-invariant product run the batch-invariant one), so a tree step may decide a float "
                "near-tie differently from plain decoding")
    if plan.invariant:
        return f"batch-invariant: each row's numbers are the same alone, in a tree or in a prefill{left_out}"
    if plan.fmt in plan.dropped:
        return (f"NOT batch-invariant on this CPU: checked whole, the model {plan.dropped[plan.fmt]} (and no other "
                "format did better), so a tree step may decide a float near-tie differently from plain decoding")
    return ("NOT batch-invariant on this CPU: no layout of the format gave a row the same bits at every row count, "
            "so a tree step may decide a float near-tie differently from plain decoding")


def _describe_format(plan: KernelPlan) -> str:
    if plan.mode == "exact":
        return "exact: fp32"
    short = SHORT_NAMES
    whole = len(plan.whole_ms) > 1  # chosen on whole steps (``choose_plan``), else on the linear layers' times
    note = f"; {plan.whole_note}" if plan.whole_note else ""
    if plan.fmt in plan.speed and len(plan.speed) > 1:
        rows, mine = plan.speed[plan.fmt]
        others = sorted((mine / speed, short[fmt]) for fmt, (_, speed) in plan.speed.items() if fmt != plan.fmt)
        said = ", ".join((f"{x:.2f}x {'faster' if x >= 1 else 'slower'} than {name}" if i == 0 else
                          f"{x:.2f}x than {name}") for i, (x, name) in enumerate(others))  # runner-up first
        per = "a whole step" if whole else "the linear layers"
        return (f"fast: {_format_name(plan.fmt)}, chosen by measurement for Token Recycling's decoding speed "
                f"(expected tokens per ms of {per}, each format at its best tree size: {rows} nodes for this "
                f"one when it was chosen): {said}{note}")
    by_format = plan.whole_ms if whole else plan.step_ms
    mine = by_format[plan.fmt]
    rows = [r for r in mine if r <= layouts.FORMAT_MAX_ROWS] or list(mine)
    ratios = []
    for fmt, steps in by_format.items():
        if fmt != plan.fmt and steps and all(r in steps for r in rows):
            ratios.append((math.exp(sum(math.log(steps[r] / mine[r]) for r in rows) / len(rows)), short[fmt]))
    if not ratios:
        return f"fast: {_format_name(plan.fmt)} (the only format this CPU runs fast)"
    said = ", ".join((f"{r:.1f}x {'faster' if r >= 1 else 'slower'} than {name}" if i == 0 else
                      f"{r:.1f}x than {name}") for i, (r, name) in enumerate(sorted(ratios)))  # runner-up first
    return (f"fast: {_format_name(plan.fmt)}, chosen by measurement: {'whole steps' if whole else 'linear layers'} "
            f"{said} (steps of {min(rows)}-{max(rows)} tokens, geometric mean{note})")


# transformers' switch for SDPA's own grouped-query attention when a mask is given (transformers.integrations.
# sdpa_attention.use_gqa_in_sdpa)
GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def grouped_query_attention_in_sdpa() -> None:
    """Let SDPA attend with the key/value heads as they are cached, also under a tree mask.

    Without this, transformers copies every cached key and value once per query head group (``repeat_kv``) in any
    forward with a mask: a tree step paid for a copy of the whole cache, 30 layers a step, and its cost grew with
    the context much faster than a one-token step's. Measured on the embedded model (fast mode, ms, a step's model
    work for 1 / 2 / 5 / 8 tree tokens): with a 1,024-token context 52.6 / 68.7 / 83.7 / 89.6 before and
    35.5 / 40.3 / 47.2 / 52.1 after; with 128 tokens 32.5 / 37.3 / 39.1 / 54.2 before and 31.1 / 34.9 / 36.5 / 43.6.
    SDPA's CPU kernel takes masks with ``enable_gqa``; transformers keeps the copy by default because some GPU
    kernels fall back to slow paths for that combination, so this is only switched on for CPU models. It is a
    process-wide setting (an environment variable transformers reads at every attention call); idempotent.
    """
    os.environ.setdefault(GQA_SWITCH, "1")


def _padded(run, rows: int):
    """``run`` on ``rows`` rows: the call's rows, zero rows after them, and only the call's rows of the result (a
    row-major slice of the first rows: contiguous)."""
    def call(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return run(torch.cat([x, x.new_zeros(rows - n, x.shape[1])]), packed)[:n]
    return call


def _runner(layout: str, weight: torch.Tensor, packs: dict[str, torch.Tensor]):
    base = layouts.base_layout(layout)
    if base not in packs:
        packs[base] = LAYOUTS[base].pack(weight)
    run, pad = LAYOUTS[base].run, layouts.padded_rows(layout)
    return (_padded(run, pad) if pad else run), packs[base]


def _dispatch(plan: KernelPlan, shape: str, weight: torch.Tensor) -> tuple[list, tuple]:
    """Per row count 0..max timed rows, the (run, packed weight) to call; and the one for more rows. Packs only what
    the chosen layouts need (one copy per layout)."""
    packs: dict[str, torch.Tensor] = {}
    large = _runner(plan.layout_for(shape, max(plan.rows) + 1), weight, packs)
    table = [large]
    for r in range(1, max(plan.rows) + 1):
        name = plan.layout_for(shape, r)
        pad = layouts.padded_rows(name)
        table.append(_runner(name if pad is None or pad > r else layouts.base_layout(name), weight, packs))
    return table, large


class ChosenLinear(nn.Module):
    """A linear layer computing each call with the layout its ``KernelPlan`` chose for the call's row count.

    Keeps the layer's weight and bias parameters (fp32, or bf16 in the bf16 format) and the copies the chosen layouts
    need (a transposed or oneDNN-prepacked weight); in the fp16 format only the fp16-packed weight (the fp32 one is
    dropped: the model takes about half its fp32 memory). Made by ``apply_plan``."""

    def __init__(self, linear: nn.Linear, plan: KernelPlan):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt = plan.fmt
        weight = linear.weight.detach()
        if plan.fmt in ("fp16", "bf16p", "amx"):  # only the packed copies are read
            self.register_parameter("weight", None)
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), False)
        else:
            self.weight, self.bias = linear.weight, linear.bias
        self._table, self._large = _dispatch(plan, f"{self.out_features}x{self.in_features}", weight)
        shape = f"{self.out_features}x{self.in_features}"
        self.layouts = sorted({plan.layout_for(shape, r) for r in plan.rows} | {plan.layout_for(shape, 10**6)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> "ChosenLinear":
        """A copy with packed weights of its own. oneDNN's prepacked weights are opaque tensors, which
        ``copy.deepcopy`` cannot copy ("Cannot access storage of OpaqueTensorImpl": seen where the chooser takes them,
        on a CPU without AVX-512): the copy packs them again from its copy of the weight, which the layouts that use
        them keep. Layouts that read the weight itself read the copy's (a plain deep copy would give them a second
        copy of it). Everything else is copied as it is."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("_table", "_large")},
                                          memo))
        repacked: dict[int, torch.Tensor] = {}

        def entry(run_packed: tuple) -> tuple:
            run, packed = run_packed
            if not isinstance(packed, torch.Tensor):
                return run, copy.deepcopy(packed, memo)
            if packed.layout == torch._mkldnn:
                if new.weight is None:
                    raise TypeError(f"a {self.fmt} layer with oneDNN-prepacked weights but no weight to pack again")
                if id(packed) not in repacked:
                    repacked[id(packed)] = layouts.LAYOUTS["onednn"].pack(new.weight.detach())
                return run, repacked[id(packed)]
            if self.weight is not None and packed.shape == self.weight.shape and \
                    packed.data_ptr() == self.weight.data_ptr():  # the weight itself (F.linear, (W @ x^T)^T)
                return run, new.weight.detach()
            return run, copy.deepcopy(packed, memo)

        new._large = entry(self._large)
        new._table = [entry(e) for e in self._table]
        return new

    def kernel_for(self, rows: int) -> tuple:
        """``(run, packed)``: the kernel call for ``rows`` rows, ``run(x, packed)``."""
        return self._table[rows] if rows < len(self._table) else self._large

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for ``x`` already (rows, in_features) and contiguous (the lean forward's activations): the
        same kernel call without the reshapes."""
        run, packed = self.kernel_for(x.shape[0])
        out = run(x, packed)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.fmt}: {', '.join(self.layouts)}")


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, a linear layer's weight counted also where only its packed copy is kept (the fp16
    format drops the fp32 weight: ``ChosenLinear``), so a prepared model counts as many as it had before."""
    total = sum(p.numel() for p in model.parameters())
    return total + sum(m.in_features * m.out_features for m in model.modules()
                       if isinstance(m, ChosenLinear) and m.weight is None)


# model -> its KernelPlan, once prepared; kept beside the model, not in it
_PLANS: "weakref.WeakKeyDictionary[nn.Module, KernelPlan]" = weakref.WeakKeyDictionary()
# model -> its output layer's dispatch (per-row-count table, beyond), made with the plan
_HEADS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def apply_plan(model: nn.Module, plan: KernelPlan) -> None:
    """Replace every ``nn.Linear`` of ``model.base_model`` by a ``ChosenLinear`` following ``plan``, and make the
    output layer's dispatch (``OutputHead``); convert the model to bf16 first where the plan's format is bf16."""
    if plan.fmt == "bf16":
        model.to(torch.bfloat16)
    if plan.fmt == "amx" and plan.tiles is not None:  # chosen by measurement here (``chooser.tiles_choice``)
        native.set_attention_on_tiles(plan.tiles)
    with pages.huge_pages():  # the packed weights a step streams whole: on 2 MB pages where the system has them
        for parent in list(model.base_model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.weight.device.type == "cpu":
                    setattr(parent, name, ChosenLinear(child, plan))
        head = _dispatch(plan, HEAD, model.get_output_embeddings().weight.detach())
    layers_swapped()
    lean = _LEAN.get(model)
    if lean is not None and hasattr(lean, "_collected"):  # a LeanLlama: the replaced linears not kept alive
        lean._collected = None
    _HEADS[model] = head
    _PLANS[model] = plan
    _LATEST[plan.mode] = describe_format(plan, attention_invariant(model))


@contextlib.contextmanager
def trials(mode: str):
    """Within it, models prepared in ``mode`` are trials (copies a chooser times or checks): what the mode runs here
    is said by the models it prepares for use, so the sentence ``mode_dtype`` gives is set back after them."""
    said = _LATEST.get(mode)
    try:
        yield
    finally:
        if said is None:
            _LATEST.pop(mode, None)
        else:
            _LATEST[mode] = said


def plan_of(model: nn.Module) -> KernelPlan | None:
    """The plan the model was prepared with (None: torch's own kernels)."""
    return _PLANS.get(model)


class OutputHead:
    """The model's output layer, computed with the layout its plan chose for the number of rows (``prepare_model``;
    an unprepared model's with F.linear).

    The engine runs the base model (``model.base_model``) and applies this head to its final hidden states, so the
    output layer is computed only for the positions it needs (none at prefill). Cheap to make: the packed weights
    are made once per model, by ``apply_plan``."""

    def __init__(self, model: torch.nn.Module):
        head = model.get_output_embeddings()
        self.weight = head.weight  # (V, d), shared with the input embedding when tied
        self.bias = getattr(head, "bias", None)
        self._dispatch = _HEADS.get(model)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (n, d) -> logits (n, V), contiguous."""
        if self._dispatch is None:
            logits = torch.nn.functional.linear(hidden, self.weight)
        else:
            table, large = self._dispatch
            rows = hidden.shape[0]
            run, packed = table[rows] if rows < len(table) else large
            logits = run(hidden.contiguous(), packed)
        return logits + self.bias if self.bias is not None else logits


def kernel_table(model: nn.Module) -> list[dict]:
    """The prepared model's choice as plain data: one row per shape and timed row count, with ``shape``
    (``"<out>x<in>"`` or ``"head"``), ``layers`` (how many), ``rows``, ``chosen`` (layout name), ``label`` (what it
    computes) and ``timings`` (layout -> ms of one call). Empty for an unprepared model."""
    plan = _PLANS.get(model)
    if plan is None:
        return []
    return [{"shape": s, "layers": plan.counts[s], "rows": r, "chosen": plan.layouts[s][r],
             "label": layouts.layout_label(plan.layouts[s][r]), "timings": dict(plan.timings[s][r])}
            for s in plan.layouts for r in plan.rows]


def _ranges(by_rows: list[tuple[int, str]]) -> str:
    """``[(1, "linear"), (2, "wxt"), (4, "wxt"), (8, "onednn")] -> "F.linear for 1 row, (W @ x^T)^T for 2-4, oneDNN
    prepacked for 5-8"``: a row count between timed ones takes the next timed choice up (``KernelPlan.layout_for``)."""
    parts, lo = [], 1
    for i, (r, name) in enumerate(by_rows):
        if i + 1 < len(by_rows) and by_rows[i + 1][1] == name:
            continue
        span = f"{lo} row{'s' if lo > 1 else ''}" if r == lo else f"{lo}-{r}"
        parts.append(f"{layouts.layout_label(name)} for {span}")
        lo = r + 1
    return ", ".join(parts)


def kernel_summary(model: nn.Module) -> str:
    """One line: the mode's format and, for the body (the layout taking most of its linear time at each row count)
    and the output layer, which layout runs which row counts; e.g. ``"exact (fp32): body F.linear for 1 row, (W @
    x^T)^T for 2-5, oneDNN prepacked for 6+; output layer ... (measured here)"``."""
    plan = _PLANS.get(model)
    if plan is None:
        return "torch's own kernels (not an fp32 CPU model)"
    chosen = []
    for r in plan.rows:
        share: dict[str, float] = {}
        for s, n in plan.counts.items():
            if s != HEAD:
                name = plan.layouts[s][r]
                ms = plan.timings[s][layouts.padded_rows(name) or r][layouts.base_layout(name)]
                share[name] = share.get(name, 0.0) + n * ms
        chosen.append((r, max(share, key=share.get)))
    head = [(r, plan.layouts[HEAD][r]) for r in plan.rows]
    lean = body(model)
    small = f"; small operations: {lean.small_ops()}" if hasattr(lean, "small_ops") else ""
    placed = pages_note(model)
    return (f"{plan.mode} ({_format_name(plan.fmt)}): body {_ranges(chosen)}{_stack_note(plan)}; "
            f"output layer {_ranges(head)} ({plan.source}, {torch.get_num_threads()} threads){small}"
            + (f"; {placed}" if placed else ""))


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tiles of native.c's linear layers (``layouts.WeightTiles``) that a prepared model's layers and output layer
    read, each once: the packed weights ``apply_plan`` places on 2 MB pages (``pages``)."""
    tables = [m._table + [m._large] for m in model.modules() if isinstance(m, ChosenLinear)]
    head = _HEADS.get(model)
    if head is not None:
        tables.append(head[0] + [head[1]])
    out, seen = [], set()
    for table in tables:
        for _, packed in table:
            if isinstance(packed, layouts.WeightTiles) and packed.tiles.data_ptr() not in seen:
                seen.add(packed.tiles.data_ptr())
                out.append(packed.tiles)
    return out


def pages_note(model: nn.Module) -> str:
    """How much of a prepared model's packed weights lies on 2 MB pages (``pages``), in words, read once per plan put
    into the model (``/proc/self/smaps``: ~10 ms); "" where it has none of native.c's tiles (the only ones placed
    there)."""
    plan = _PLANS.get(model)
    kept = _PAGES_NOTES.get(model)
    if kept is not None and kept[0] is plan:
        return kept[1]
    tensors = packed_tensors(model)
    note = ""
    if tensors:
        on, total = pages.huge_share(tensors)
        note = (f"packed weights on 2 MB pages: {on / 1e6:.0f} of {total / 1e6:.0f} MB (the system's transparent "
                f"huge pages: {pages.mode()})")
    _PAGES_NOTES[model] = (plan, note)
    return note


_PAGES_NOTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its plan, pages_note's words)


def _stack_note(plan: KernelPlan) -> str:
    """Where the body runs as one C call a pass (``layouts.stack_choice``): that, and the one-row step of its linear
    layers timed inside it against the same kernels called one by one from Python."""
    if not plan.stacked:
        return ""
    name = layouts.STACK_LAYOUTS[plan.fmt]
    body_shapes = [s for s in plan.counts if s != HEAD]
    r = plan.rows[0]
    try:
        inside = sum(plan.counts[s] * plan.inside[s][r] for s in body_shapes)
        alone = sum(plan.counts[s] * plan.timings[s][r][name] for s in body_shapes)
    except KeyError:
        return ", all layers in one C call a pass"
    return (f", all layers in one C call a pass (its linear layers {inside:.1f} ms for {r} row inside it, "
            f"{alone:.1f} ms called one by one)")


# model -> its lean forward (lean.LeanLlama), made on first use
_LEAN: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def body(model: nn.Module):
    """What a decoding step runs: for a Llama-family model on the CPU, ``lean.LeanLlama`` (the same operations
    without transformers' per-call machinery, ~15% of a one-token step of the embedded model, and the batch-invariant
    attention); else ``model.base_model``. Both are called alike."""
    lean = _LEAN.get(model)
    if lean is None:

        lean = _LEAN[model] = LeanLlama(model) if supports(model) else model.base_model
    return lean


def window(base) -> int | None:
    """The positions one forward pass of ``base`` (what ``body`` returned) may span: ``attention.BLOCK`` where its
    rows are computed alike alone and among others (the lean forward on a machine where ``attention.batch_invariant``
    holds), None where any rows may go together (and rows are not promised to be batch-invariant)."""
    return base.window if isinstance(base, LeanLlama) else None


def attention_invariant(model: nn.Module) -> bool:
    """Whether ``model``'s decoding steps run the batch-invariant attention (``attention.py``)."""
    return window(body(model)) is not None


def cache_dtype(base, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV cache ``base`` reads: fp32 for the batch-invariant attention (computed in fp32 whatever
    the model's format), else the model's ``dtype``."""
    return torch.float32 if window(base) is not None else dtype


def feed(base, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run ``ids`` (p,), the tokens after the cache's, into ``cache``; returns their final hidden states (p, d).
    Where ``base`` has a ``window``, in chunks that end at its window boundaries (every row then attends in its own
    window), so a token's hidden state is the same whatever prefill or step computed it."""
    size = window(base)
    past = cache.get_seq_length()
    if size is None or ids.numel() == 0:
        return base(input_ids=ids[None], cache=cache, use_cache=True).last_hidden_state[0]
    out, done = [], 0
    while done < ids.numel():
        end = min(ids.numel(), (past + done) // size * size + size - past)
        positions = torch.arange(past + done, past + end, device=ids.device)[None]
        out.append(base(input_ids=ids[None, done:end], position_ids=positions, cache=cache,
                        use_cache=True).last_hidden_state[0])
        done = end
    return torch.cat(out) if len(out) > 1 else out[0]
