"""The kernel chooser: which kernels a model runs in a mode on this machine, by measurement. ``prepare_model`` puts
the plan ``choose_plan`` picks into the model: among the formats the mode may run here (``layouts.format_plans``:
each format's row-invariant layouts, timed per shape and row count), those whose whole prepared model passes the
invariance check (``invariant_plans``), the one whose whole steps decode fastest (``whole_steps``), each verdict and
timing cached per machine.

It sits above the kernels (``kernels``: the chosen layers, the output layer, the plan's description), the check
(``invariance``) and the step timing (``stepbench``), which it calls.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys

import torch
from torch import nn

from .. import mathlib
from ..assets import acceptance_stats
from ..budget import expected_tokens
from ..cachefiles import write_atomically
from ..models import default_cache_dir, max_positions
from ..modes import DEFAULT_FIT_CONTEXT, MODES
from . import attention, invariance, layouts, lean, native, stepbench
from . import kernels as kernels_module
from .fusion import fuse, fused_shapes
from .kernels import (
    SHORT_NAMES,
    KernelPlan,
    apply_plan,
    attention_invariant,
    body,
    grouped_query_attention_in_sdpa,
    plan_of,
    trials,
)


def _fp32_cpu(model: nn.Module) -> bool:
    weight = model.get_output_embeddings().weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def prepare_model(model: nn.Module, mode: str, plan: KernelPlan | None = None) -> KernelPlan | None:
    """Put the model's linear layers and output layer on the kernels of ``mode`` (in place; idempotent): for an fp32
    CPU model, the plan measured on this machine (``layouts.kernel_plan``: cached, else timed now), or ``plan``;
    where it chose bf16 the model is converted to bf16. Other dtypes and devices keep torch's own kernels (returns
    None). CPU models also get ``grouped_query_attention_in_sdpa``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if model.get_output_embeddings().weight.device.type == "cpu":
        grouped_query_attention_in_sdpa()
    if plan_of(model) is not None:
        return plan_of(model)
    if not _fp32_cpu(model):
        return None
    if plan is None or fused_shapes(model) <= set(plan.layouts):  # a given plan may be for the unfused layers
        fuse(model)  # q/k/v and gate/up as one layer each: their shapes are the ones measured and checked
    own_weights(model)  # after the fusion, which has copied the projections it fused already
    plan = plan or choose_plan(model, mode, gain=tree_gain(model))
    apply_plan(model, plan)
    return plan


# Tree sizes a whole step is timed at to choose the format: plain decoding's one row and the trees the engine may run
# (the paper's 81 nodes the largest); without the method's expected tokens, up to ``layouts.FORMAT_MAX_ROWS``.
WHOLE_SIZES = (1, 2, 4, 8, 16, 32, 81)


def choose_plan(model: nn.Module, mode: str, gain: dict[int, float] | None = None, remeasure: bool = False
                ) -> KernelPlan:
    """The plan ``prepare_model`` puts into ``model`` (fp32, fused, not yet prepared) in ``mode``: the format
    (``choose_format_plan``), and for the amx format whether attention runs on the tiles (``tiles_choice``)."""
    copies = Trials(model, mode)
    try:
        plan = choose_format_plan(model, mode, gain, remeasure, copies)
        plan.tiles, plan.tiles_note = tiles_choice(model, plan, remeasure, copies)
    finally:
        copies.clear()
    return plan


class Trials:
    """Copies of ``model``, each with one format's plan put in (``kernels.apply_plan``), made once for one choice:
    the invariance check (``invariant_plans``), the whole steps (``whole_steps``) and the tiles' choice
    (``tiles_choice``) use the same copy of a format, where they would each make their own (on a cold start of the
    embedded model here, five formats: 4.4 s of copying and packing each time). A copy is kept (``keep``) only where
    memory holds one of every format, as ``whole_steps`` needs; else it goes after its use (``done``)."""

    def __init__(self, model: nn.Module, mode: str):
        self.model, self.mode = model, mode
        self.made: dict[str, nn.Module] = {}
        self.keep = False

    def plan_to_keep(self, formats: int) -> None:
        """Keep copies from now on where ``formats`` copies and the model fit in the memory available."""
        free = available_memory_bytes()
        self.keep = free is None or (formats + 1) * model_bytes(self.model) <= free

    def get(self, fmt: str, plan: KernelPlan) -> nn.Module:
        """The copy prepared with ``plan`` (format ``fmt``), made now if there is none."""
        if fmt not in self.made:
            with trials(self.mode):  # what the mode runs here is said by the models it prepares, not by trials
                trial = copy.deepcopy(self.model)
                apply_plan(trial, plan)
            self.made[fmt] = trial
        return self.made[fmt]

    def done(self, fmt: str) -> None:
        """A use of ``fmt``'s copy is over: dropped unless copies are kept."""
        if not self.keep:
            self.made.pop(fmt, None)

    def retain(self, fmt: str) -> None:
        """Drop every copy but ``fmt``'s (the format chosen, whose copy the tiles' choice may time)."""
        self.made = {f: m for f, m in self.made.items() if f == fmt}

    def clear(self) -> None:
        self.made.clear()


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# Rounds of whole steps with attention on the tiles against fp32 attention that ``tiles_choice`` times
TILES_ROUNDS = 6


def choose_tiles(pairs: dict[int, tuple[float, float, float]]) -> tuple[bool, str]:
    """Whether the amx format should attend on the tiles, from its whole steps against the same with fp32 attention
    (``stepbench.attention_pairs``: per size, the median ms each way and the median of the rounds' own ratios): on
    where the ratios' geometric mean over the sizes is at most 1; and why, in words.

    >>> on, why = choose_tiles({1: (10.0, 10.5, 0.95), 16: (12.0, 14.0, 0.86)})
    >>> on, why.split(": ", 1)[1]
    (True, 'whole steps 0.90x their time with fp32 attention (1 row 0.95x, 16 rows 0.86x)')
    >>> choose_tiles({1: (11.0, 10.0, 1.10), 16: (14.0, 13.0, 1.08)})[1][:59]
    'attention in fp32, chosen by measurement: whole steps 1.09x'
    """
    mean = math.exp(sum(math.log(ratio) for *_, ratio in pairs.values()) / len(pairs))
    said = ", ".join(f"{n} row{'s' * (n > 1)} {ratio:.2f}x" for n, (*_, ratio) in pairs.items())
    on = mean <= 1.0
    return on, (f"attention {'on the tiles' if on else 'in fp32'}, chosen by measurement: whole steps {mean:.2f}x "
                f"their time with fp32 attention ({said})")


def tiles_choice(model: nn.Module, plan: KernelPlan, remeasure: bool = False, copies: Trials | None = None
                 ) -> tuple[bool | None, str]:
    """For the amx format where attention on the tiles is built here and the model takes it (head size 64):
    ``choose_tiles`` on whole steps of ``plan`` put into a copy of ``model``, the tiles against fp32 attention in
    TILES_ROUNDS alternated rounds (``stepbench.attention_pairs``), cached per machine, model, plan and code
    (``remeasure``: not read); (None, "") elsewhere. The format itself was chosen with the tiles on. ``copies``:
    the choice's copies (``Trials``), whose amx copy it times where there is one."""
    if plan.fmt != "amx" or not native.attention_tiles_built():
        return None, ""
    key = "-".join([layouts.cache_key(model, plan.mode), plan.tag(), str(TILES_ROUNDS),
                    layouts.source_digest(stepbench, lean, attention, sys.modules[__name__])])
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in layouts.cache_key(model, plan.mode))[:80]
    path = default_cache_dir() / "kernels" / f"tiles-{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if path.is_file() and not remeasure:
        kept = json.loads(path.read_text())
        return kept["on"], kept["note"]
    copies = copies or Trials(model, plan.mode)
    trial = copies.get(plan.fmt, plan)
    before = native.attention_on_tiles() is not None
    native.set_attention_on_tiles(True)
    try:
        if not getattr(body(trial), "_on_tiles", bool)():  # a head size the tiles do not take: nothing to weigh
            return None, ""
        on, note = choose_tiles(stepbench.attention_pairs(trial, DEFAULT_FIT_CONTEXT, TILES_ROUNDS))
    finally:
        native.set_attention_on_tiles(before)
        del trial
        copies.done(plan.fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"on": on, "note": note}, indent=1))
    return on, note


def choose_format_plan(model: nn.Module, mode: str, gain: dict[int, float] | None = None, remeasure: bool = False,
                       copies: Trials | None = None) -> KernelPlan:
    """The plan's format and layouts (``choose_plan``): among the formats
    the mode may run here (``layouts.format_plans``), the one whose *whole* steps decode fastest (``layouts.
    pick_format`` on ``whole_steps``), each format's plan put into a copy of the model and timed here; the linear
    layers' times alone cannot see the rest of a step, which differs between formats (seen on this project's AVX-512
    machine: bf16 won on the linear layers, 0.150 expected tokens per ms against fp16's 0.140, and its whole one-token
    step took 32.8 ms against fp16's ~10, as only the fp32-activation formats run the small operations in C). Where
    there is one format, or no memory for the copies, the linear layers' choice, and the plan says why.
    ``remeasure``: time the layouts and the whole steps again. ``copies``: the prepared copies to check and time
    (``Trials``)."""
    plans = layouts.format_plans(model, mode, gain=gain, remeasure=remeasure)
    copies = copies or Trials(model, mode)
    copies.plan_to_keep(len(plans))
    plans = invariant_plans(model, plans, remeasure=remeasure, copies=copies)
    first = next(iter(plans.values()))
    if len(plans) < 2:
        return first
    sizes = WHOLE_SIZES if gain else tuple(n for n in WHOLE_SIZES if n <= layouts.FORMAT_MAX_ROWS)
    whole, why, retimed = whole_steps(model, plans, sizes, cache=first.source != layouts.BUSY_SOURCE,
                                      remeasure=remeasure, gain=gain, copies=copies)
    if whole is None:
        first.whole_note = why
        return first
    plan = plans[layouts.pick_format(whole, gain)]
    copies.retain(plan.fmt)
    plan.whole_ms = whole
    if retimed:
        plan.whole_note = (f"a close call between {' and '.join(SHORT_NAMES[f] for f in retimed)} (within "
                           f"{layouts.CLOSE:.0%} in the first {layouts.FIRST_ROUNDS} rounds): every format timed in "
                           f"{layouts.CLOSE_ROUNDS - layouts.FIRST_ROUNDS} more, and chosen on all "
                           f"{layouts.CLOSE_ROUNDS}")
    plan.speed = layouts.speed_by_format(whole, gain) if gain else {}
    return plan


def invariant_plans(model: nn.Module, plans: dict[str, KernelPlan], remeasure: bool = False,
                    copies: Trials | None = None) -> dict[str, KernelPlan]:
    """The plans of ``plans`` (format -> plan, ``layouts.format_plans``) whose whole prepared model is batch-invariant
    here (``invariance.check``: a position's logits the same alone, in trees and in prefills fed in pieces), each
    holding the formats left out with what differed (``KernelPlan.dropped``). Each format's plan is put into a copy
    of ``model`` in turn and checked (seconds each), the verdicts cached per machine, model, mode, plans and the
    forward's code, ``mathlib``'s included (verdicts from before its first call of the vector math could have
    dropped a format on a bad first forward) (``remeasure``: not read). A plan whose layouts are not row-invariant
    already (``plan.invariant`` false), or whose model does not run the batch-invariant attention, is kept unchecked:
    its description says so. Where no format passes, every plan is kept, each marked not invariant with why (the
    exact mode has only fp32). ``copies``: where the prepared copies come from and stay (``Trials``)."""
    mode = next(iter(plans.values())).mode
    copies = copies or Trials(model, mode)
    key = "-".join([layouts.cache_key(model, mode), *sorted(p.tag() for p in plans.values()),
                    layouts.source_digest(invariance, lean, attention, kernels_module, mathlib,
                                          sys.modules[__name__])])
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in layouts.cache_key(model, mode))[:80]
    path = default_cache_dir() / "kernels" / f"invariant-{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    verdicts: dict[str, str | None] = {}
    if path.is_file() and not remeasure:
        verdicts = json.loads(path.read_text())
    known = dict(verdicts)
    for fmt, plan in plans.items():
        if fmt in verdicts or not plan.invariant:
            continue
        trial = copies.get(fmt, plan)
        # None: not checked, where the attention is not the batch-invariant one (the description says so) or the
        # model takes fewer positions than the check
        room = max_positions(model) or invariance.probe_ids(1).numel()
        checkable = attention_invariant(trial) and room >= invariance.probe_ids(1).numel()
        verdicts[fmt] = invariance.verdict(invariance.check(trial)) if checkable else None
        del trial
        copies.done(fmt)
    if verdicts != known:  # written where something was checked now
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(verdicts, indent=1))
    dropped = {fmt: why for fmt, why in verdicts.items() if why and fmt in plans}
    kept = {fmt: plan for fmt, plan in plans.items() if fmt not in dropped}
    if not kept:  # none passes: the plans as they were, each saying so
        for plan in plans.values():
            plan.invariant = False
        kept = plans
    for plan in kept.values():
        plan.dropped = dict(dropped)
    return kept


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (bytes), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def whole_steps(model: nn.Module, plans: dict[str, KernelPlan], sizes: tuple[int, ...], cache: bool = True,
                remeasure: bool = False, gain: dict[int, float] | None = None, copies: Trials | None = None
                ) -> tuple[dict[str, dict[int, float]] | None, str, list[str]]:
    """Per format of ``plans``, t(N) of a whole step at ``sizes`` (``stepbench.whole_steps_ms``: the forward, the
    output layer and the top-k, at the calibration's context), each format's plan put into a deep copy of ``model``
    (all copies held at once, and timed in turn round by round). Where two or more formats come out within
    ``layouts.CLOSE`` of the best (``layouts.close_formats``, scored with ``gain`` as ``pick_format`` scores them)
    after ``layouts.FIRST_ROUNDS`` rounds, every format is timed in more rounds, to ``layouts.CLOSE_ROUNDS`` in all,
    and the result is taken over all of them (``stepbench.whole_steps_ms``' ``pool``; before, the first rounds were
    thrown away and ``CLOSE_ROUNDS`` timed afresh: the whole steps took 45 and 48 s on two cold starts with a close
    call here, 30 s now with one). Cached per
    machine, model, mode and plans (``cache``: also written; ``remeasure``: not read), and not written where other
    processes competed for the cores. Returns (steps, how they were obtained, the close formats that made it time
    again), or (None, why, []) where the copies would not fit in the memory available. ``copies``: the choice's
    copies (``Trials``), those made already used as they are."""
    mode = next(iter(plans.values())).mode
    key = "-".join([layouts.cache_key(model, mode), *sorted(p.tag() for p in plans.values()), str(sizes),
                    layouts.source_digest(stepbench),
                    f"close{layouts.CLOSE}x{layouts.FIRST_ROUNDS}+{layouts.CLOSE_ROUNDS}-pooled"])
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in layouts.cache_key(model, mode))[:80]
    path = default_cache_dir() / "kernels" / f"whole-{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if path.is_file() and not remeasure:
        data = json.loads(path.read_text())
        retimed, data = (data["retimed"], data["steps"]) if "steps" in data else ([], data)  # earlier files: steps
        return {fmt: {int(n): ms for n, ms in by.items()} for fmt, by in data.items()}, "cached", retimed
    copies = copies or Trials(model, mode)
    held = [fmt for fmt in plans if fmt in copies.made]
    need = (len(plans) - len(held) + 1) * model_bytes(model)
    free = available_memory_bytes()
    if free is not None and need > free:
        return None, (f"chosen on the linear layers' times alone: timing each format's whole step needs "
                      f"{need / 2**30:.1f} GiB for copies of the model, and {free / 2**30:.1f} GiB is available"), []
    models, pool = {}, {}
    try:
        models = {fmt: copies.get(fmt, plan) for fmt, plan in plans.items()}
        steps, busy = stepbench.whole_steps_ms(models, sizes, repeats=layouts.FIRST_ROUNDS, pool=pool)
        retimed = layouts.close_formats(steps, gain)
        if retimed:  # every format in more rounds, so that all are compared on the same rounds: this machine's
            # memory may run at half the speed a minute later (the close ones alone, timed again, once lost to fp32's
            # first reading)
            steps, busy_again = stepbench.whole_steps_ms(models, sizes, repeats=layouts.CLOSE_ROUNDS -
                                                         layouts.FIRST_ROUNDS, pool=pool)
            busy = busy or busy_again
    finally:
        models.clear()
        pool.clear()
        for fmt in plans:
            copies.done(fmt)
    if cache and not busy:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"steps": steps, "retimed": retimed}, indent=1))
    return steps, layouts.BUSY_SOURCE if busy else "measured here", retimed


def own_weights(model: nn.Module) -> None:
    """Give every parameter of ``model`` memory of its own (a copy; ties kept: each shared parameter is copied
    once). transformers reads safetensors weights as views of the file mapped into memory, and pages of it that were
    read stay in the process's RSS for as long as any one weight lives there; ``prepare_model`` then replaces most
    weights (the fused projections, the fp16 format's packed copies), so the mapped originals were kept twice over:
    measured here, a process holding the embedded model in both modes took 2.61 GB with the mapping kept, 1.95 GB
    with every weight copied first (the app's own figures: docs/app.md, "Memory over time")."""
    with torch.no_grad():
        for param in model.parameters():  # each shared (tied) parameter once
            param.data = param.data.clone()


def tree_gain(model: nn.Module) -> dict[int, float] | None:
    """The tokens a Token Recycling step is expected to add with a tree of N nodes, for every N (the model's shipped
    acceptance statistics, ``budget.expected_tokens``); None for a model without them. The fast format is chosen for
    the decoding speed it gives with these (``layouts.choose_format``)."""
    stats = acceptance_stats(model)
    return expected_tokens(stats["acceptance"]) if stats else None
